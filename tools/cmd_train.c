/* cmd_train.c -- `kiln train`: train or fine-tune a model on the CPU or a CUDA GPU. */
#include "cli.h"

#include "base/base.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/shards.h"
#include "train/trainer.h"
#include "train_audit.h"
#include "base/sha256.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_HIDDEN 64
#define MAX_SHARDS 64

static const char *train_help =
    "usage: kiln train (-m MODEL | --config NAME --tokenizer TOK) --data SHARD [options]\n\n"
    "Trains on token shards made by `kiln data`. MODEL (.gguf or Hugging Face folder) is\n"
    "fine-tuned; --config NAME (tiny, small, base, or a config.json) trains from scratch with\n"
    "the vocabulary of TOK. Writes OUT/metrics.csv, OUT/loss.png, checkpoints in\n"
    "OUT/checkpoints and, at the end, the model as a Hugging Face folder in OUT/model.\n\n"
    "  --data SHARD         a token shard (repeatable)\n"
    "  --out DIR            output folder (default: kiln-run); one that is not empty needs\n"
    "                       --resume (continue its run) or --overwrite\n"
    "  --overwrite          start a new run in a used --out: its checkpoints are deleted\n"
    "                       first (metrics.csv, loss.png and model/ are written anew)\n"
    "  --steps N            optimizer steps (default 200)\n"
    "  --batch B            sequences per micro-batch (default 8); under mpirun -np N the\n"
    "                       global batch: N ranks share it (docs/DISTRIBUTED.md)\n"
    "  --seq T              tokens per sequence (default 128)\n"
    "  --accum K            micro-batches per step (gradient accumulation, default 1)\n"
    "  --seqs-per-forward K sequences of a micro-batch forwarded at once (K divides --batch):\n"
    "                       larger products, K x the activation memory; the gradients are\n"
    "                       within rounding of K = 1's, not its bits. Default: with --fast\n"
    "                       on a GPU the largest K whose activations fit in half the free\n"
    "                       memory; else 1 (the same bits on the CPU and the GPU); on\n"
    "                       --resume the checkpoint's\n"
    "  --lr LR              peak learning rate (default 1e-3)\n"
    "  --min-lr LR          final learning rate of the decay (default lr/10)\n"
    "  --warmup N           linear warmup steps (default 20)\n"
    "  --schedule S         cosine, linear or constant after warmup (default cosine)\n"
    "  --weight-decay W     AdamW weight decay (default 0.1; none on biases and norms)\n"
    "  --clip C             clip the gradient norm to C; 0 = off (default 1.0)\n"
    "  --storage S          f32, bf16_master, bf16_kahan or bf16_sr (default f32)\n"
    "  --moments M          f32 or q8 (default f32)\n"
    "  --eval-every N       evaluate every N steps; 0 = only at the end (default 50)\n"
    "  --eval-fraction F    documents held out for evaluation (default 0.02)\n"
    "  --eval-batches K     batches per evaluation (default 4)\n"
    "  --save-every N       checkpoint every N steps; 0 = only at the end (default 100)\n"
    "  --keep-last N        checkpoints kept (default 2)\n"
    "  --resume             continue from the newest checkpoint in OUT/checkpoints; the\n"
    "                       settings that shape training must be the checkpoint's\n"
    "  --override-hparams   with --resume: accept other settings from the checkpoint's step on\n"
    "                       (printed, and recorded in the next checkpoint)\n"
    "  --stop-after N       stop (with a checkpoint) after N steps of this run\n"
    "  --seed S             data order and initialisation (default 1)\n"
    "  --threads N          CPU threads (default: all cores)\n"
    "  --device D           cpu (default), cuda or cuda:N: train on CUDA GPU N (the CPU's bits;\n"
    "                       checkpoints resume on either). Under torchrun (--no-python) or\n"
    "                       mpirun: GPU ranks over NCCL, each on its local rank's GPU\n"
    "                       (docs/DISTRIBUTED.md, \"GPU ranks\"). A list, one device a rank of\n"
    "                       mpirun (--device cpu,cuda:0): CPU and GPU ranks together over MPI,\n"
    "                       auditable, ZeRO-2 (\"CPU and GPU ranks together\")\n"
    "  --fast               with --device cuda: matrix products (forward and backward) on bf16\n"
    "                       tensor cores; approximate but deterministic (docs/TRAINING.md)\n"
    "  --format F           f32 (default), mx16 or mx8: the matrix products forward and backward\n"
    "                       in an exact block format (the same bits on cpu and cuda;\n"
    "                       docs/ARITHMETIC.md), then per-weight rules, the last match winning:\n"
    "                       mx16,output=f32 or f32,attn_v=mx8,blk.0=mx16\n"
    "  --format-rounding R  with --format mx16|mx8: how the backward's gradients are quantized:\n"
    "                       nearest (default, to nearest even) or stochastic (seeded by --seed,\n"
    "                       the step and the micro-batch: the same bits on any thread or rank count)\n"
    "  --loss-row-block N   with --fast: the loss walks the rows in blocks of N, each block's\n"
    "                       logits (N x vocabulary, bf16) made once (default 2048; 0: the\n"
    "                       vocabulary walk, one product more, less memory)\n"
    "  --loss-logits-f32    with --fast: that walk keeps the logits in f32 (twice the memory;\n"
    "                       the default bf16 is autocast's head output)\n"
    "  --no-export          do not write OUT/model at the end (`kiln export OUT` does it later)\n"
    "  --zero S             with ranks: 3 (CPU ranks' default) shards the weights, gradients and\n"
    "                       AdamW state across the ranks (each layer's weights gathered for\n"
    "                       its forward and backward); 2 keeps the whole weights on every\n"
    "                       rank (less traffic; GPU ranks' default and only stage so far).\n"
    "                       The same bits either way\n"
    "  --audit              keep OUT/audit.jsonl: per step, the batch's hash, the loss, the\n"
    "                       gradient norm and the weights' fingerprint, chained by SHA-256;\n"
    "                       `kiln audit OUT --from N` replays it from checkpoint N (keep the\n"
    "                       checkpoints to audit from: --keep-last 0 keeps them all)\n\n"
    "Ctrl-C (SIGINT) or SIGTERM finishes the current step, writes a checkpoint and exits with\n"
    "status 130 or 143 (continue with --resume); a second signal exits at once.\n";

static const char *distill_help =
    "usage: kiln distill --teacher MODEL (-m STUDENT | --config NAME [--tokenizer TOK])\n"
    "                    --data SHARD [options]\n\n"
    "Distils the teacher (.gguf or Hugging Face folder, inference only) into the student:\n"
    "`kiln train` whose loss per next-token position is\n"
    "    alpha * tau^2 * KL(softmax(teacher / tau) || softmax(student / tau))\n"
    "  + (1 - alpha) * cross-entropy(student, the true next token)\n"
    "with neither model's logits held for the whole batch (docs/TRAINING.md,\n"
    "\"Distillation\"). Teacher and student share the tokenizer (refused otherwise); --config\n"
    "without --tokenizer takes the teacher's. The evaluation loss is the student's\n"
    "cross-entropy on held-out documents, comparable with a `kiln train` run's.\n\n"
    "  --teacher MODEL      the teacher\n"
    "  --temperature TAU    softening of both distributions (default 1; bench/RESULTS.md)\n"
    "  --alpha A            weight of the KL term in [0, 1]; the hard cross-entropy gets\n"
    "                       1 - A (default 0.5)\n"
    "  --hidden-map S:T,... hidden-state matching: the student's layer S against the\n"
    "                       teacher's layer T (from 1: the residual stream after the layer),\n"
    "                       through a learned projection (trained with the student, kept in\n"
    "                       checkpoints, not exported) when the widths differ\n"
    "  --hidden-weight B    weight of the hidden-state loss, summed over the pairs (default 1)\n"
    "  --hidden-loss L      mse (default: mean square over the teacher's width) or cosine\n"
    "                       (1 - cosine similarity)\n\n"
    "Every option of `kiln train` (below) applies.\n\n";

typedef struct train_opts {
    const char *model, *config, *tokenizer, *out, *schedule, *storage, *moments;
    const char *data[MAX_SHARDS];
    int n_data;
    long steps, batch, seq, accum, per_forward, warmup, eval_every, eval_batches, save_every, keep_last, threads, stop_after;
    long zero; /* the ZeRO stage of mpirun ranks: 2 or 3 */
    int zero_given;
    const char *device_list; /* --device D0,D1,...: rank r of mpirun on Dr (NULL: one device for all) */
    long loss_row_block; /* --loss-row-block; -1: the library's default */
    int loss_logits_f32; /* --loss-logits-f32 */
    double lr, min_lr, weight_decay, clip, eval_fraction;
    unsigned long long seed;
    int resume, export_model, overwrite;
    int override_hparams; /* --override-hparams: resume with settings other than the checkpoint's */
    int device; /* -1 = CPU, N >= 0 = CUDA device N */
    int fast;   /* --fast: the CUDA backend's fast arithmetic (GPU only) */
    int audit;                 /* --audit: OUT/audit.jsonl */
    int format;                /* --format: kiln_format of the products */
    const char *format_rules;  /* --format's per-weight rules (NULL: none) */
    int format_rounding;       /* --format-rounding: kiln_format_rounding of the gradients */
    const char *teacher;       /* kiln distill --teacher */
    double temperature, alpha; /* kiln distill --temperature, --alpha */
    const char *hidden_map;    /* kiln distill --hidden-map, as given */
    double hidden_weight;      /* --hidden-weight */
    const char *hidden_loss;   /* --hidden-loss: mse or cosine */
    kiln_hidden_pair pairs[MAX_HIDDEN];
    int n_pairs;
    kiln_train_extra extras[MAX_HIDDEN]; /* the pairs' projections, when the widths differ */
    char extra_names[MAX_HIDDEN][32];
    int n_extra;
} train_opts;

/* "S:T,S:T,..." into o->pairs (each layer >= 1; the models' ranges are the teacher's to check).
 * Returns 0 or the usage error's code. */
static int parse_hidden_map(const char *cmd, const char *v, train_opts *o) {
    const char *p = v;
    o->n_pairs = 0;
    while (*p) {
        char *end;
        long s = strtol(p, &end, 10), t;
        if (end == p || *end != ':' || s < 1 || s > 1000000) goto bad;
        p = end + 1;
        t = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || t < 1 || t > 1000000) goto bad;
        if (o->n_pairs == MAX_HIDDEN) return cli_usage_error(cmd, "--hidden-map: at most %d pairs", MAX_HIDDEN);
        o->pairs[o->n_pairs++] = (kiln_hidden_pair){(int)s, (int)t};
        p = *end ? end + 1 : end;
        if (*end && !*p) goto bad;
    }
    if (o->n_pairs) return 0;
bad:
    return cli_usage_error(cmd, "--hidden-map takes STUDENT_LAYER:TEACHER_LAYER pairs separated by commas, layers "
                                "from 1 (e.g. 3:6,6:12), not '%s'", v);
}

/* --device: "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N, as `kiln generate --device` (a copy of
 * cmd_generate.c's parser: both belong in cli_util.c). Returns 0 or the usage error's code. */
/* --device's value: one device, or a comma-separated list, one a rank (D0,D1,...). Every entry
 * is checked; *device is entry `rank` (-1: the first). 0, or a usage error's exit code. */
static int parse_device_list(const char *cmd, const char *v, int rank, int *device) {
    char one[64];
    int k = 0, err = 0;
    for (const char *p = v;; k++) {
        const char *comma = strchr(p, ',');
        const size_t n = comma ? (size_t)(comma - p) : strlen(p);
        if (n >= sizeof one) return cli_usage_error(cmd, "--device '%s': entry %d is too long", v, k);
        memcpy(one, p, n);
        one[n] = '\0';
        int d = -1;
        if (!err) err = cli_parse_device(cmd, one, &d);
        if (!err && (k == rank || (rank < 0 && k == 0))) *device = d;
        if (!comma) break;
        p = comma + 1;
    }
    return err;
}

static int parse(int argc, char **argv, train_opts *o, int *code, int distill) {
    memset(o, 0, sizeof *o);
    o->out = "kiln-run";
    o->schedule = "cosine";
    o->storage = "f32";
    o->moments = "f32";
    o->steps = 200;
    o->batch = 8;
    o->seq = 128;
    o->accum = 1;
    o->zero = 3;
    o->per_forward = 0; /* chosen in cmd_train (choose_per_forward) */
    o->warmup = 20;
    o->eval_every = 50;
    o->eval_batches = 4;
    o->save_every = 100;
    o->keep_last = 2;
    o->lr = 1e-3;
    o->min_lr = -1;
    o->weight_decay = 0.1;
    o->clip = 1.0;
    o->eval_fraction = 0.02;
    o->seed = 1;
    o->export_model = 1;
    o->device = -1;
    o->loss_row_block = -1;
    o->temperature = 1.0;
    o->alpha = 0.5;
    o->hidden_weight = 1.0;
    o->hidden_loss = "mse";
    const char *cmd = distill ? "distill" : "train";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (distill) fputs(distill_help, stdout);
            fputs(train_help, stdout);
            *code = 0;
            return 1;
        }
#define OPT(name) cli_opt(argc, argv, &i, name, &v, &err, cmd)
#define INT(field, lo, hi) (void)(!err && (err = cli_parse_int(cmd, a, v, lo, hi, &o->field)))
#define DBL(field, lo, hi) (void)(!err && (err = cli_parse_float(cmd, a, v, lo, hi, &o->field)))
        if (OPT("-m") || OPT("--model")) o->model = v;
        else if (OPT("--config")) o->config = v;
        else if (OPT("--tokenizer")) o->tokenizer = v;
        else if (OPT("--out")) o->out = v;
        else if (OPT("--data")) {
            if (!err && o->n_data == MAX_SHARDS) err = cli_usage_error(cmd, "at most %d --data shards", MAX_SHARDS);
            else if (!err) o->data[o->n_data++] = v;
        } else if (OPT("--steps")) INT(steps, 1, 100000000);
        else if (OPT("--batch")) INT(batch, 1, 65536);
        else if (OPT("--seq")) INT(seq, 1, 1 << 20);
        else if (OPT("--accum")) INT(accum, 1, 65536);
        else if (OPT("--seqs-per-forward")) INT(per_forward, 1, 65536);
        else if (OPT("--zero")) {
            INT(zero, 2, 3);
            o->zero_given = 1;
        }
        else if (OPT("--warmup")) INT(warmup, 0, 100000000);
        else if (OPT("--eval-every")) INT(eval_every, 0, 100000000);
        else if (OPT("--eval-batches")) INT(eval_batches, 1, 100000);
        else if (OPT("--save-every")) INT(save_every, 0, 100000000);
        else if (OPT("--keep-last")) INT(keep_last, 0, 100000);
        else if (OPT("--threads")) INT(threads, 1, 256);
        else if (OPT("--stop-after")) INT(stop_after, 1, 100000000);
        else if (OPT("--loss-row-block")) INT(loss_row_block, 0, 1 << 20);
        else if (OPT("--lr")) DBL(lr, 0, 10);
        else if (OPT("--min-lr")) DBL(min_lr, 0, 10);
        else if (OPT("--weight-decay")) DBL(weight_decay, 0, 10);
        else if (OPT("--clip")) DBL(clip, 0, 1e9);
        else if (OPT("--eval-fraction")) DBL(eval_fraction, 0, 0.9);
        else if (distill && OPT("--teacher")) o->teacher = v;
        else if (distill && OPT("--temperature")) DBL(temperature, 1e-3, 1e3);
        else if (distill && OPT("--alpha")) DBL(alpha, 0, 1);
        else if (distill && OPT("--hidden-weight")) DBL(hidden_weight, 0, 1e6);
        else if (distill && OPT("--hidden-map")) {
            o->hidden_map = v;
            if (!err) err = parse_hidden_map(cmd, v, o);
        } else if (distill && OPT("--hidden-loss")) {
            o->hidden_loss = v;
            if (!err && strcmp(v, "mse") && strcmp(v, "cosine"))
                err = cli_usage_error(cmd, "--hidden-loss takes mse or cosine, not '%s'", v);
        }
        else if (OPT("--seed")) {
            if (!err) err = cli_parse_u64(cmd, a, v, &o->seed);
        } else if (OPT("--schedule")) {
            o->schedule = v;
            if (!err && strcmp(v, "cosine") && strcmp(v, "linear") && strcmp(v, "constant"))
                err = cli_usage_error(cmd, "--schedule takes cosine, linear or constant, not '%s'", v);
        } else if (OPT("--storage")) {
            o->storage = v;
            if (!err && strcmp(v, "f32") && strcmp(v, "bf16_master") && strcmp(v, "bf16_kahan") && strcmp(v, "bf16_sr"))
                err = cli_usage_error(cmd, "--storage takes f32, bf16_master, bf16_kahan or bf16_sr, not '%s'", v);
        } else if (OPT("--moments")) {
            o->moments = v;
            if (!err && strcmp(v, "f32") && strcmp(v, "q8"))
                err = cli_usage_error(cmd, "--moments takes f32 or q8, not '%s'", v);
        } else if (OPT("--device")) {
            o->device_list = strchr(v, ',') ? v : NULL;
            if (!err) err = parse_device_list(cmd, v, -1, &o->device);
        } else if (OPT("--format")) {
            if (!err) err = cli_parse_format(cmd, v, &o->format, &o->format_rules);
        } else if (OPT("--format-rounding")) {
            if (!strcmp(v, "nearest")) o->format_rounding = KILN_ROUND_NEAREST;
            else if (!strcmp(v, "stochastic")) o->format_rounding = KILN_ROUND_STOCHASTIC;
            else if (!err) err = cli_usage_error(cmd, "--format-rounding takes nearest or stochastic, not '%s'", v);
        } else if (!strcmp(a, "--resume")) o->resume = 1;
        else if (!strcmp(a, "--override-hparams")) o->override_hparams = 1;
        else if (!strcmp(a, "--overwrite")) o->overwrite = 1;
        else if (!strcmp(a, "--fast")) o->fast = 1;
        else if (!strcmp(a, "--loss-logits-f32")) o->loss_logits_f32 = 1;
        else if (!strcmp(a, "--no-export")) o->export_model = 0;
        else if (!strcmp(a, "--audit")) o->audit = 1;
        else err = cli_usage_error(cmd, "unknown option '%s'", a);
#undef OPT
#undef INT
#undef DBL
        if (err) {
            *code = 2;
            return 1;
        }
    }
    if (!!o->model == !!o->config) {
        *code = cli_usage_error(cmd, "give either -m MODEL (fine-tune) or --config NAME (from scratch)");
        return 1;
    }
    if (distill && !o->teacher) {
        *code = cli_usage_error(cmd, "--teacher MODEL is required");
        return 1;
    }
    if (!o->n_pairs && (o->hidden_weight != 1.0 || strcmp(o->hidden_loss, "mse"))) {
        *code = cli_usage_error(cmd, "--hidden-weight and --hidden-loss need --hidden-map");
        return 1;
    }
    if (o->config && !o->tokenizer && o->teacher) o->tokenizer = o->teacher;
    if (o->config && !o->tokenizer) {
        *code = cli_usage_error(cmd, "--config needs --tokenizer (a .gguf, folder or tokenizer.json)");
        return 1;
    }
    if (o->n_data == 0) {
        *code = cli_usage_error(cmd, "at least one --data SHARD is required (make one with `kiln data`)");
        return 1;
    }
    if (o->per_forward > 0 && o->batch % o->per_forward != 0) {
        *code = cli_usage_error(cmd, "--seqs-per-forward %ld does not divide --batch %ld", o->per_forward, o->batch);
        return 1;
    }
    if (o->fast && o->device < 0) {
        *code = cli_usage_error(cmd, "--fast is a GPU mode: use it with --device cuda or cuda:N");
        return 1;
    }
    if (o->device_list && (o->fast || (o->zero_given && o->zero == 3))) {
        *code = cli_usage_error(cmd, "--device %s (a device a rank): the ranks share the auditable arithmetic's bits "
                                "with ZeRO-2, so not with %s", o->device_list, o->fast ? "--fast" : "--zero 3");
        return 1;
    }
    if (o->format_rounding == KILN_ROUND_STOCHASTIC && o->format == KILN_FORMAT_F32 && !o->format_rules) {
        *code = cli_usage_error(cmd, "--format-rounding stochastic goes with --format mx16 or mx8");
        return 1;
    }
    if (o->overwrite && o->resume) {
        *code = cli_usage_error(cmd, "--overwrite starts a new run, --resume continues one: give one of them");
        return 1;
    }
    if (o->override_hparams && !o->resume) {
        *code = cli_usage_error(cmd, "--override-hparams goes with --resume");
        return 1;
    }
    if (o->min_lr < 0) o->min_lr = o->lr / 10;
    if (o->warmup > o->steps) o->warmup = o->steps;
    return 0;
}

/* Learning rate of step s (0-based): linear warmup to lr, then the schedule down to min_lr. */
static double lr_at(const train_opts *o, long s) {
    if (s < o->warmup) return o->lr * (double)(s + 1) / (double)o->warmup;
    if (!strcmp(o->schedule, "constant") || o->steps <= o->warmup) return o->lr;
    double p = (double)(s - o->warmup) / (double)(o->steps - o->warmup);
    if (!strcmp(o->schedule, "linear")) return o->lr - (o->lr - o->min_lr) * p;
    return o->min_lr + (o->lr - o->min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
}

static void format_eta(double s, char *buf, size_t cap) {
    if (s < 0 || s > 1e7) snprintf(buf, cap, "?");
    else if (s >= 3600) snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
    else snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)s % 60);
}

/* Mean loss over K fixed evaluation batches (forward only). */
static kiln_status evaluate(kiln_trainer *tr, const kiln_batch_sampler *ev, const train_opts *o, int32_t *buf,
                            double *out) {
    long B = o->batch, T = o->seq;
    double sum = 0;
    for (long k = 0; k < o->eval_batches; k++) {
        kiln_status st = kiln_batch_sampler_get(ev, (uint64_t)k, buf);
        /* ZeRO-3: every rank evaluates (each forward gathers the layers), agreeing on each batch */
        if (kiln_train_dp_stage(tr) == 3) st = kiln_train_dp_agree(tr, st, "the evaluation's batch");
        KILN_TRY(st);
        for (long b = 0; b < B; b++) {
            const int32_t *ids = buf + b * (T + 1);
            float loss;
            KILN_TRY(kiln_train_forward(tr, ids, (int)T, ids + 1, KILN_LOSS_SUM,
                                        (float)(1.0 / ((double)B * T * o->eval_batches)), &loss));
            kiln_train_discard(tr);
            sum += loss;
        }
    }
    *out = sum;
    return KILN_OK;
}

/* After the last step: the model as a Hugging Face folder (OUT/model), which transformers and
 * `kiln generate` load. */
static int train_finish(kiln_trainer *tr, const train_opts *o) {
    if (o->export_model) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/model", o->out);
        kiln_status st = kiln_train_export_hf(tr, dir, !strcmp(o->storage, "f32") ? 0 : 1, 1);
        if (st != KILN_OK) return cli_fail("train", "export", st);
        fprintf(stderr, "[kiln train] model: %s (try: kiln generate -m %s -p \"...\")\n", dir, dir);
    }
    fprintf(stderr, "[kiln train] metrics: %s/metrics.csv, plot: %s/loss.png, checkpoints: %s/checkpoints\n", o->out,
            o->out, o->out);
    return 0;
}

/* A shard's ids mean something only under the tokenizer that made it: refuse one made by
 * another tokenizer (its fingerprint, kiln_tokenizer_fingerprint) or a larger
 * vocabulary. A shard written without a fingerprint (all zeros) is let through with a
 * warning. Returns 0, or 1 after printing why. */
static int check_shard_tokenizer(const char *path, const kiln_shard_info *si, const kiln_model_info *mi,
                                 const uint8_t model_fp[32]) {
    if ((int64_t)si->vocab_size > mi->n_vocab) {
        fprintf(stderr, "kiln train: %s was made with a vocabulary of %u tokens, the model has %d\n", path,
                si->vocab_size, mi->n_vocab);
        return 1;
    }
    static const uint8_t zero[32];
    if (!memcmp(si->fingerprint, zero, 32)) {
        fprintf(stderr, "[kiln train] warning: %s has no tokenizer fingerprint; its tokenizer is not checked\n", path);
        return 0;
    }
    if (memcmp(si->fingerprint, model_fp, 32) != 0) {
        char a[65], b[65];
        kiln_sha256_hex(si->fingerprint, a);
        kiln_sha256_hex(model_fp, b);
        fprintf(stderr,
                "kiln train: %s was made by another tokenizer than the model's (tokenizer fingerprint %.16s..., "
                "the model's %.16s...): its token ids would mean other words; remake it with "
                "kiln data -m <this model>\n",
                path, a, b);
        return 1;
    }
    return 0;
}

/* ---- resume: the run's settings against the checkpoint's ------------------------------- */

/* The settings that decide the bits of the steps still to run (docs/TRAINING.md, "Resuming a
 * run"): the data order and batches (seed, batch, seq, accum, eval_fraction, which splits the
 * documents), the forward's grouping (seqs_per_forward: within rounding, not the same bits),
 * the update (lr schedule, weight decay, clip) and fast mode. --steps only counts when the
 * schedule decays over it. Threads, device (CPU and GPU give the same bits), evaluation and
 * checkpoint cadence do not change the run. Storage and moments are in the checkpoint's
 * config and refused by kiln_train_load. */
enum { SET_INT, SET_REAL, SET_TEXT };
typedef struct run_setting {
    const char *key, *flag;
    int kind;
    char now[CLI_FORMAT_SPEC_MAX + 16]; /* this run's value as run_json_write writes it (a
                                        * --format spec is the longest) */
} run_setting;

static void setting_add(run_setting *v, int *n, const char *key, const char *flag, int kind, const char *fmt, ...) {
    run_setting *r = &v[(*n)++];
    r->key = key;
    r->flag = flag;
    r->kind = kind;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->now, sizeof r->now, fmt, ap);
    va_end(ap);
}

/* The shortest "%.Ng" text that reads back as x exactly. */
static const char *real_text(double x, char *buf, size_t cap) {
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, x);
        if (strtod(buf, NULL) == x) break;
    }
    return buf;
}

/* This run's settings into v (room for 24); returns their number. */
static int run_settings(const train_opts *o, run_setting *v) {
    int n = 0;
    char rt[32];
    setting_add(v, &n, "steps", "--steps", SET_INT, "%ld", o->steps);
    setting_add(v, &n, "batch", "--batch", SET_INT, "%ld", o->batch);
    setting_add(v, &n, "seq", "--seq", SET_INT, "%ld", o->seq);
    setting_add(v, &n, "accum", "--accum", SET_INT, "%ld", o->accum);
    setting_add(v, &n, "seqs_per_forward", "--seqs-per-forward", SET_INT, "%ld", o->per_forward);
    setting_add(v, &n, "lr", "--lr", SET_REAL, "%s", real_text(o->lr, rt, sizeof rt));
    setting_add(v, &n, "min_lr", "--min-lr", SET_REAL, "%s", real_text(o->min_lr, rt, sizeof rt));
    setting_add(v, &n, "warmup", "--warmup", SET_INT, "%ld", o->warmup);
    setting_add(v, &n, "schedule", "--schedule", SET_TEXT, "%s", o->schedule);
    setting_add(v, &n, "seed", "--seed", SET_INT, "%llu", o->seed);
    setting_add(v, &n, "weight_decay", "--weight-decay", SET_REAL, "%s", real_text(o->weight_decay, rt, sizeof rt));
    setting_add(v, &n, "clip", "--clip", SET_REAL, "%s", real_text(o->clip, rt, sizeof rt));
    setting_add(v, &n, "eval_fraction", "--eval-fraction", SET_REAL, "%s", real_text(o->eval_fraction, rt, sizeof rt));
    setting_add(v, &n, "fast", "--fast", SET_INT, "%d", o->fast);
    char spec[sizeof v->now];
    cli_format_spec(o->format, o->format_rules, spec, sizeof spec);
    setting_add(v, &n, "format", "--format", SET_TEXT, "%s", spec);
    if (o->format != KILN_FORMAT_F32 || o->format_rules) /* recorded only where it means something */
        setting_add(v, &n, "format_rounding", "--format-rounding", SET_TEXT, "%s",
                    o->format_rounding == KILN_ROUND_STOCHASTIC ? "stochastic" : "nearest");
    if (o->teacher) {
        setting_add(v, &n, "temperature", "--temperature", SET_REAL, "%s", real_text(o->temperature, rt, sizeof rt));
        setting_add(v, &n, "alpha", "--alpha", SET_REAL, "%s", real_text(o->alpha, rt, sizeof rt));
        {
            char map[64 * 16] = "";
            size_t len = 0;
            for (int k = 0; k < o->n_pairs && len < sizeof map; k++)
                len += (size_t)snprintf(map + len, sizeof map - len, "%s%d:%d", k ? "," : "", o->pairs[k].student_layer,
                                        o->pairs[k].teacher_layer);
            setting_add(v, &n, "hidden_map", "--hidden-map", SET_TEXT, "%s", map);
            setting_add(v, &n, "hidden_weight", "--hidden-weight", SET_REAL, "%s",
                        real_text(o->hidden_weight, rt, sizeof rt));
            setting_add(v, &n, "hidden_loss", "--hidden-loss", SET_TEXT, "%s", o->hidden_loss);
        }
    }
    return n;
}

/* Whether s can stand in a JSON string as it is (no quote, backslash or control byte). */
static int json_plain(const char *s) {
    for (; *s; s++)
        if (*s == '"' || *s == '\\' || (unsigned char)*s < 0x20) return 0;
    return 1;
}

/* The run configuration saved with each checkpoint: the settings, the model's source, the data
 * position, and the history of --override-hparams (a text, newest last). Returns 0, or -1 if cap is too small. */
static int run_json_write(const train_opts *o, const char *overridden, char *out, size_t cap) {
    run_setting v[24];
    int n = run_settings(o, v);
    size_t len = (size_t)snprintf(out, cap, "{");
    for (int i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(out + len, cap - len, v[i].kind == SET_TEXT ? "\"%s\":\"%s\"," : "\"%s\":%s,",
                                v[i].key, v[i].now);
    if (len < cap && overridden && overridden[0])
        len += (size_t)snprintf(out + len, cap - len, "\"overridden\":\"%s\",", overridden);
    /* where the weights came from, for `kiln export` (absolute paths; a path JSON would need
     * escaped is left out, and export then asks for -m) */
    const char *keys[3] = {"model", "config", "tokenizer"};
    const char *vals[3] = {o->model, o->config, o->tokenizer};
    for (int i = 0; i < 3 && len < cap; i++) {
        char abs[8192], cwd[4096];
        const char *src = vals[i];
        if (!src) continue;
        if (src[0] != '/' && (kiln_path_is_file(src) || kiln_path_is_dir(src)) && getcwd(cwd, sizeof cwd)) {
            snprintf(abs, sizeof abs, "%s/%s", cwd, src);
            src = abs;
        }
        if (!json_plain(src)) continue;
        len += (size_t)snprintf(out + len, cap - len, "\"%s\":\"%s\",", keys[i], src);
    }
    if (len < cap) len += (size_t)snprintf(out + len, cap - len, "\"data_position\":\"step\"}");
    return len < cap ? 0 : -1;
}

/* Whether a recorded value equals this run's (reals: as doubles, or as the "%g" text older
 * checkpoints wrote). */
static int setting_equal(const run_setting *v, const char *saved) {
    if (v->kind == SET_TEXT || v->kind == SET_INT) return !strcmp(saved, v->now);
    char *end;
    double a = strtod(saved, &end), b = strtod(v->now, NULL);
    if (*end == 0 && a == b) return 1;
    char g[64];
    snprintf(g, sizeof g, "%g", b);
    return !strcmp(saved, g);
}

/* Compare this run's settings with the checkpoint's run json (NULL: not recorded). On a
 * difference: refused (returns 1) naming each setting with both values, unless
 * --override-hparams, then printed and appended to *history ("at step k: flag a -> b, ...").
 * history (cap bytes) starts as the checkpoint's own override history. */
static int check_resume_settings(const train_opts *o, const char *run, long start, char *history, size_t cap) {
    history[0] = 0;
    if (!run) {
        fprintf(stderr, "[kiln train] note: the checkpoint records no run settings; they are not checked\n");
        return 0;
    }
    cli_run_value(run, "overridden", history, cap);
    run_setting v[24];
    int n = run_settings(o, v), n_diff = 0;
    char diff[2048] = "", saved[sizeof v->now];
    size_t dl = 0;
    for (int i = 0; i < n; i++) {
        if (!cli_run_value(run, v[i].key, saved, sizeof saved)) { /* an older kiln's checkpoint */
            fprintf(stderr, "[kiln train] note: the checkpoint does not record %s; not checked\n", v[i].flag);
            continue;
        }
        if (setting_equal(&v[i], saved)) continue;
        /* --steps moves only a decaying schedule's learning rate: a constant one may be extended */
        if (!strcmp(v[i].key, "steps") && !strcmp(o->schedule, "constant")) continue;
        const char *why = !strcmp(v[i].key, "steps") ? " (the learning rate of the remaining steps decays over --steps)" : "";
        if (!o->override_hparams) fprintf(stderr, "  %s: checkpoint %s, now %s%s\n", v[i].flag, saved, v[i].now, why);
        else fprintf(stderr, "[kiln train] --override-hparams: %s %s -> %s from step %ld\n", v[i].flag, saved, v[i].now, start);
        if (dl < sizeof diff)
            dl += (size_t)snprintf(diff + dl, sizeof diff - dl, "%s%s %s -> %s", n_diff ? ", " : "", v[i].flag, saved, v[i].now);
        n_diff++;
    }
    if (!n_diff) return 0;
    if (!o->override_hparams) {
        fprintf(stderr, "kiln train: --resume: %d setting%s above differ%s from the checkpoint's; resuming with them "
                        "would not continue the same run. Pass the checkpoint's values, or --override-hparams to "
                        "change them from step %ld on\n", n_diff, n_diff > 1 ? "s" : "", n_diff > 1 ? "" : "s", start);
        return 1;
    }
    size_t hl = strlen(history);
    snprintf(history + hl, cap - hl, "%sat step %ld: %s", hl ? "; " : "", start, diff);
    return 0;
}

/* The trainer for o's settings, o->per_forward sequences a forward. */
/* GPU ranks were asked for: a launcher's variables (mpirun, or torchrun with WORLD_SIZE > 1), or
 * KILN_COMM=nccl (one rank over NCCL: the GPU ranks' path on one device, which the GPU tests
 * compare with a plain run). Variables that cannot be read count as asked, so that the NCCL
 * open names them. */
static int gpu_ranks_launched(void) {
    const char *f = getenv("KILN_COMM");
    if (f && strcmp(f, "nccl") == 0) return 1;
    kiln_comm_launch l;
    return kiln_comm_launch_from_env(&l) != KILN_OK || l.kind != KILN_COMM_LAUNCH_SELF;
}

/* The trainer of the options; comm (may be NULL: one process) with more than one rank: this
 * process's rank of the data-parallel run (kiln_train_create_rank: with --zero 3 made lean,
 * holding only its range from the start). */
static kiln_status make_trainer_on(kiln_model *m, const train_opts *o, kiln_comm *comm, kiln_trainer **tr) {
    kiln_train_params tp = kiln_train_default_params();
    tp.max_seq = (int)o->seq;
    tp.max_batch = (int)o->per_forward;
    tp.n_threads = (int)o->threads;
    tp.lr = o->lr;
    tp.weight_decay = o->weight_decay;
    tp.seed = o->seed;
    tp.weight_storage = !strcmp(o->storage, "f32") ? KILN_STORAGE_F32
                        : !strcmp(o->storage, "bf16_master") ? KILN_STORAGE_BF16_MASTER
                        : !strcmp(o->storage, "bf16_kahan") ? KILN_STORAGE_BF16_KAHAN
                                                           : KILN_STORAGE_BF16_SR;
    tp.moment_storage = !strcmp(o->moments, "q8") ? KILN_MOMENTS_Q8 : KILN_MOMENTS_F32;
    tp.device = o->device;
    tp.fast = o->fast;
    if (o->loss_row_block >= 0) tp.ce_row_block = (int)o->loss_row_block;
    tp.ce_logits_f32 = o->loss_logits_f32;
    tp.format = o->format;
    tp.format_rules = o->format_rules;
    tp.format_rounding = o->format_rounding;
    tp.n_extra = o->n_extra;
    tp.extra = o->extras;
    /* a fresh run never makes its trainer again: it consumes a --config model's initial weights
     * as it copies them (a resume may remake it for the checkpoint's settings: it releases the
     * model after; kiln_train_release_source) */
    if (comm && (kiln_comm_size(comm) > 1 || !kiln_comm_host_memory(comm))) /* GPU ranks: even one */
        return kiln_train_create_rank(m, &tp, comm, (int)o->zero, !o->resume, tr);
    return kiln_trainer_create(m, &tp, tr);
}

static kiln_status make_trainer(kiln_model *m, const train_opts *o, kiln_trainer **tr) {
    return make_trainer_on(m, o, NULL, tr);
}

/* make_trainer, then this process made a rank of comm's data-parallel run (with more than one
 * rank: the optimizer state and gradients sharded, and with --zero 3 the weights too,
 * src/train/trainer_dp.c). */
static kiln_status make_rank_trainer(kiln_model *m, const train_opts *o, kiln_comm *comm, kiln_trainer **tr) {
    return make_trainer_on(m, o, comm, tr);
}

/* One micro-batch of a step: sequences first .. first + K - 1 of the step's batch buf (seq + 1
 * tokens each: the ids, then the targets one token on) packed into packed (2 K seq ids), one
 * forward and backward (kiln_train_step_batch, or with a teacher the distillation step), the
 * gradients accumulated when acc. Its loss to *l; distilling, its KL, CE and hidden parts are
 * added to parts. */
static kiln_status micro_step(kiln_trainer *tr, kiln_teacher *teacher, const kiln_distill_params *dp,
                              const int32_t *buf, long first, long K, long seq, int32_t *packed, float scale,
                              int acc, float *l, double parts[3]) {
    int32_t *pid = packed, *ptg = packed + K * seq;
    for (long k = 0; k < K; k++) {
        const int32_t *row = buf + (first + k) * (seq + 1);
        memcpy(pid + k * seq, row, (size_t)seq * sizeof *pid);
        memcpy(ptg + k * seq, row + 1, (size_t)seq * sizeof *ptg);
    }
    if (!teacher) return kiln_train_step_batch(tr, pid, (int)K, (int)seq, ptg, KILN_LOSS_SUM, scale, acc, l);
    kiln_distill_loss dl;
    KILN_TRY(kiln_train_distill_step(tr, teacher, pid, (int)K, (int)seq, ptg, dp, KILN_LOSS_SUM, scale, acc, &dl));
    *l = dl.loss;
    parts[0] += dl.kl;
    parts[1] += dl.ce;
    parts[2] += dl.hidden;
    return KILN_OK;
}

/* The ranks' agreement (docs/DISTRIBUTED.md, "Errors"): every rank passes its rc (0: fine);
 * when any rank's is not 0, every rank returns the same nonzero status (rank 0's rc, or 1 when
 * rank 0's is 0) and *agreed is set, so that nobody waits in a collective for a rank that has
 * stopped. Every agreement is the same collective (an all-reduce of three doubles: the failure
 * count, x1, rank 0's rc), so a rank that fails between two of them meets the others' next one
 * at its exit (train_main's out:). x1 (may be NULL) is summed over the ranks in rank order (the
 * step's loss). One process: rc as it is. */
static int ranks_agree(kiln_comm *c, int rc, double *x1, int *agreed) {
    if (kiln_comm_size(c) == 1) return rc;
    double x[3] = {rc != 0, x1 ? *x1 : 0.0, kiln_comm_rank(c) == 0 ? (double)rc : 0.0};
    if (kiln_comm_allreduce_f64(c, x, 3) != KILN_OK) {
        fprintf(stderr, "kiln train: rank %d: the ranks' agreement failed: %s\n", kiln_comm_rank(c), kiln_last_error());
        *agreed = 1;
        return rc ? rc : 1;
    }
    if (x1) *x1 = x[1];
    if (x[0] == 0) return 0;
    *agreed = 1;
    return x[2] != 0 ? (int)x[2] : 1;
}

/* --seqs-per-forward left to kiln, fast mode on a GPU: the largest divisor K of --batch whose
 * activations and loss scratch (K x a one-sequence trainer's) fit in half the device memory
 * left free with the one-sequence trainer made. *tr is that trainer on entry and the chosen
 * one on return (remade when K > 1). */
static kiln_status choose_per_forward(kiln_model *m, train_opts *o, kiln_trainer **tr) {
    kiln_train_memory mem;
    uint64_t free_b = 0, total_b = 0;
    KILN_TRY(kiln_train_describe(*tr, NULL, 0, &mem));
    if (kiln_device_memory(o->device, &free_b, &total_b) != KILN_OK) return KILN_OK; /* keep 1 */
    const uint64_t per_seq = mem.activations + mem.scratch;
    long k = 1;
    for (long d = o->batch; d > 1; d--)
        if (o->batch % d == 0 && per_seq && (uint64_t)(d - 1) <= free_b / 2 / per_seq) {
            k = d;
            break;
        }
    fprintf(stderr, "[kiln train] --seqs-per-forward %ld: a sequence's activations take %.1f MiB, %.1f GiB of the "
                    "GPU are free (pass the flag to choose)\n", k, (double)per_seq / 1048576.0, (double)free_b / 1073741824.0);
    if (k == 1) return KILN_OK;
    kiln_trainer_free(*tr);
    *tr = NULL;
    o->per_forward = k;
    return make_trainer(m, o, tr);
}

/* SIGINT / SIGTERM: the first is noted and the loop stops after its step (with a
 * checkpoint); a second exits at once. */
static volatile sig_atomic_t train_signal;

static void train_on_signal(int sig) {
    if (train_signal) _exit(128 + sig);
    train_signal = sig;
}

/* 1 when dir exists and holds anything. */
static int dir_has_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *de;
    int any = 0;
    while (!any && (de = readdir(d)))
        any = strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
    closedir(d);
    return any;
}

/* Remove path and, when it is a folder, everything under it (depth left: levels it may go
 * down; a checkpoints folder holds step-<k>/ folders of plain files). 0, or -1 with errno. */
static int remove_tree(const char *path, int depth) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return errno == ENOENT ? 0 : -1;
    if (S_ISDIR(sb.st_mode)) {
        if (depth <= 0) {
            errno = ENOTEMPTY;
            return -1;
        }
        DIR *d = opendir(path);
        if (!d) return -1;
        struct dirent *de;
        int rc = 0;
        while (rc == 0 && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            size_t n = strlen(path) + strlen(de->d_name) + 2;
            char *sub = malloc(n);
            if (!sub) {
                rc = -1;
                break;
            }
            snprintf(sub, n, "%s/%s", path, de->d_name);
            rc = remove_tree(sub, depth - 1);
            free(sub);
        }
        closedir(d);
        return rc == 0 ? rmdir(path) : rc;
    }
    return unlink(path);
}

/* --out: refuse a used folder unless --resume or --overwrite; --overwrite deletes the old
 * checkpoints (metrics.csv, loss.png and OUT/model are written anew by the run). */
static int prepare_out(const train_opts *o) {
    if (!o->resume && dir_has_entries(o->out)) {
        if (!o->overwrite) {
            fprintf(stderr, "kiln train: the output folder '%s' is not empty: pass --resume to continue the run in it, "
                            "or --overwrite to start a new one there (deleting its checkpoints)\n", o->out);
            return 2;
        }
        char p[4096];
        snprintf(p, sizeof p, "%s/checkpoints", o->out);
        if (remove_tree(p, 3) != 0) {
            fprintf(stderr, "kiln train: --overwrite: cannot remove '%s': %s\n", p, strerror(errno));
            return 1;
        }
    }
    if (mkdir(o->out, 0755) != 0 && !kiln_path_is_dir(o->out)) {
        fprintf(stderr, "kiln train: cannot create output folder '%s': %s\n", o->out, strerror(errno));
        return 1;
    }
    return 0;
}

/* kiln audit's replay of a run's steps from..to (train_main's replay mode). */
typedef struct audit_replay {
    train_audit *log;
    long from, to;
} audit_replay;

/* kiln train, and kiln distill (distill: --teacher and the distillation loss). With rp, the
 * replay of an audited run (kiln audit): OUT is only read (its checkpoint of step rp->from),
 * steps rp->from + 1 .. rp->to run and their records are compared with rp->log's, nothing is
 * written. */
static int train_main(int argc, char **argv, int distill, const audit_replay *rp) {
    train_opts o;
    int code = 0;
    if (parse(argc, argv, &o, &code, distill)) return code;
    if (rp) o.resume = o.overwrite = 0;
    const int pf_given = o.per_forward != 0;
    /* the ranks of a data-parallel run (mpirun -np N), or one process */
    kiln_comm *comm = NULL;
    kiln_status cst;
    if (rp) {
        cst = kiln_comm_open_self(&comm);
    } else if (o.device_list) {
        /* a device a rank (CPU and GPU ranks together): over MPI, each GPU rank's pieces through
         * host memory (docs/DISTRIBUTED.md, "CPU and GPU ranks together") */
        if (!o.zero_given) o.zero = 2;
        cst = kiln_comm_open(&comm);
        if (cst == KILN_OK) {
            int n_entries = 1;
            for (const char *p = o.device_list; *p; p++) n_entries += *p == ',';
            if (n_entries != kiln_comm_size(comm)) {
                if (kiln_comm_rank(comm) == 0)
                    fprintf(stderr, "kiln train: --device %s names %d devices for %d ranks: give one a rank "
                                    "(mpirun -np %d)\n", o.device_list, n_entries, kiln_comm_size(comm), n_entries);
                kiln_comm_close(comm);
                return 2;
            }
            parse_device_list("train", o.device_list, kiln_comm_rank(comm), &o.device);
        }
    } else if (o.device >= 0 && gpu_ranks_launched()) {
        /* GPU ranks (torchrun, or mpirun with --device cuda): NCCL, each rank on the device of its
         * local rank; --zero 2 unless asked (ZeRO-3 is the CPU ranks') */
        int n_dev = 0;
        uint64_t fb, tb;
        while (n_dev < 1024 && kiln_device_memory(n_dev, &fb, &tb) == KILN_OK) n_dev++;
        o.device = kiln_comm_gpu_device(n_dev);
        if (!o.zero_given) o.zero = 2;
        cst = o.device < 0 ? KILN_ERR_INVALID_ARG : kiln_comm_open_nccl(o.device, &comm);
    } else {
        cst = kiln_comm_open(&comm);
    }
    if (cst != KILN_OK) return cli_fail("train", "the ranks (kiln_comm_open)", cst);
    const int n_ranks = kiln_comm_size(comm), rank = kiln_comm_rank(comm), rank0 = rank == 0;
    /* the ranks' path: several ranks, or GPU ranks (nccl) even alone */
    const int ranked = n_ranks > 1 || !kiln_comm_host_memory(comm);
    int agreed = 0; /* the ranks know of a failure already (ranks_agree) */
    if (ranked) { /* the same arguments on every rank: the same refusals */
        const char *no = o.accum > 1 ? "--accum > 1 (a rank's gradient is one micro-batch: see --seqs-per-forward)"
                                     : NULL;
        if (no) {
            if (rank0) fprintf(stderr, "kiln %s: %d ranks: %s is not supported yet; run one process\n",
                               distill ? "distill" : "train", n_ranks, no);
            kiln_comm_close(comm);
            return 2;
        }
        if (o.per_forward == 0 && o.batch % n_ranks != 0) {
            if (rank0) fprintf(stderr, "kiln train: --batch %ld is not a multiple of the %d ranks: give "
                                       "--seqs-per-forward K with --batch / K <= %d micro-batches\n",
                               o.batch, n_ranks, n_ranks);
            kiln_comm_close(comm);
            return 2;
        }
        if (o.per_forward == 0) o.per_forward = o.batch / n_ranks; /* one micro-batch a rank */
    }
    int rc = 0;
    train_audit *audit = NULL;
    kiln_model *m = NULL, *tm = NULL;
    kiln_trainer *tr = NULL;
    kiln_teacher *teacher = NULL;
    kiln_distill_params dp = kiln_distill_default_params();
    dp.temperature = (float)o.temperature;
    dp.kd_weight = (float)o.alpha;
    dp.ce_weight = (float)(1.0 - o.alpha);
    dp.hidden_weight = (float)o.hidden_weight;
    kiln_shard *shards[MAX_SHARDS] = {0};
    kiln_batch_sampler *train_s = NULL, *eval_s = NULL;
    int32_t *buf = NULL, *packed = NULL;
    kiln_metrics *csv = NULL;
    char path[4096], png[4096], ckdir[4096];
    kiln_status st;

    if (!rp && rank0) rc = prepare_out(&o);
    if ((rc = ranks_agree(comm, rc, NULL, &agreed))) {
        kiln_comm_close(comm);
        return rc;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = train_on_signal;
    sa.sa_flags = SA_RESTART; /* a checkpoint's writes are not cut short */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    snprintf(ckdir, sizeof ckdir, "%s/checkpoints", o.out);
    st = o.model ? kiln_model_open(o.model, NULL, &m) : kiln_model_create(o.config, o.tokenizer, o.seed, &m);
    if (st != KILN_OK) {
        rc = cli_fail("train", o.model ? o.model : o.config, st);
        goto out;
    }
    kiln_model_info mi;
    kiln_model_get_info(m, &mi);
    if (o.seq > mi.n_ctx_train) {
        rc = cli_usage_error("train", "--seq %ld exceeds the model's context length %d", o.seq, mi.n_ctx_train);
        goto out;
    }
    uint8_t model_fp[32];
    st = kiln_tokenizer_fingerprint(kiln_model_get_tokenizer(m), model_fp);
    if (st != KILN_OK) {
        rc = cli_fail("train", "tokenizer", st);
        goto out;
    }
    for (int i = 0; i < o.n_data; i++) {
        /* every byte checked against the shard's SHA-256 (one streaming pass, at about the
         * disk's speed): a flipped token that stays a valid id must not train silently */
        st = kiln_shard_open(o.data[i], KILN_SHARD_VERIFY_CHECKSUM, &shards[i]);
        if (st != KILN_OK) {
            rc = cli_fail("train", o.data[i], st);
            goto out;
        }
        if ((rc = check_shard_tokenizer(o.data[i], kiln_shard_get_info(shards[i]), &mi, model_fp))) goto out;
    }
    kiln_batch_sampler_params sp = kiln_batch_sampler_default_params();
    sp.seed = o.seed;
    sp.split_seed = 0x6b696c6e; /* fixed: the held-out documents do not move between runs */
    sp.eval_fraction = o.eval_fraction;
    sp.batch = (int)o.batch;
    sp.seq_len = (int)o.seq;
    sp.split = KILN_SPLIT_TRAIN;
    st = kiln_batch_sampler_create(shards, o.n_data, &sp, &train_s);
    if (st == KILN_OK && o.eval_fraction > 0) {
        sp.split = KILN_SPLIT_EVAL;
        st = kiln_batch_sampler_create(shards, o.n_data, &sp, &eval_s);
    }
    if (st != KILN_OK) {
        rc = cli_fail("train", "data", st);
        goto out;
    }
    const int auto_pf = o.per_forward == 0 || (ranked && !pf_given);
    if (o.per_forward == 0) o.per_forward = 1;
    if (o.teacher) { /* before the trainer: a hidden map's projections are trainer parameters */
        st = kiln_model_open(o.teacher, NULL, &tm);
        if (st != KILN_OK) {
            rc = cli_fail("distill", o.teacher, st);
            goto out;
        }
        kiln_model_info ti;
        kiln_model_get_info(tm, &ti);
        o.n_extra = 0;
        for (int k = 0; k < o.n_pairs && ti.n_embd != mi.n_embd; k++) { /* widths differ: a projection a pair */
            snprintf(o.extra_names[k], sizeof o.extra_names[k], KILN_HIDDEN_PROJ_NAME, k);
            o.extras[k] = (kiln_train_extra){o.extra_names[k], ti.n_embd, mi.n_embd};
            o.n_extra++;
        }
    }
    st = make_rank_trainer(m, &o, comm, &tr);
    if (st != KILN_OK) {
        rc = cli_fail("train", "trainer", st);
        goto out;
    }
    if (auto_pf && o.fast && o.device >= 0 && !o.resume) st = choose_per_forward(m, &o, &tr);
    if (st != KILN_OK) {
        rc = cli_fail("train", "trainer", st);
        goto out;
    }
    long start = 0;
    char overridden[4096] = ""; /* --override-hparams history, kept in every checkpoint's run json */
    if ((rc = ranks_agree(comm, rc, NULL, &agreed))) goto out; /* every rank has its trainer */
    if (o.resume) {
        uint64_t k = 0;
        char *run = NULL, *notes = NULL;
        st = kiln_train_load_ex(tr, ckdir, &k, &run, &notes);
        if (st != KILN_OK) {
            rc = cli_fail("train", "--resume", st);
            goto out;
        }
        /* newer checkpoints passed over (and set aside when complete): say which and why */
        for (const char *line = rank0 ? notes : NULL; line && *line;) {
            const char *nl = strchr(line, '\n');
            int len = nl ? (int)(nl - line) : (int)strlen(line);
            fprintf(stderr, "[kiln train] warning: passed over a newer checkpoint: %.*s\n", len, line);
            line += len + (nl != NULL);
        }
        kiln_string_free(notes);
        start = (long)k;
        if (k > (uint64_t)o.steps) {
            fprintf(stderr, "kiln train: --resume: the checkpoint is at step %llu, past --steps %ld\n",
                    (unsigned long long)k, o.steps);
            kiln_string_free(run);
            rc = 1;
            goto out;
        }
        char saved_pf[64];
        long pf = 0;
        if (auto_pf && run && cli_run_value(run, "seqs_per_forward", saved_pf, sizeof saved_pf) &&
            (pf = strtol(saved_pf, NULL, 10)) > (n_ranks > 1 ? 0 : 1) && pf <= o.batch && o.batch % pf == 0 && pf != o.per_forward) {
            /* the run's own grouping (its bits): the trainer remade for it, the checkpoint again */
            kiln_trainer_free(tr);
            tr = NULL;
            o.per_forward = pf;
            st = make_rank_trainer(m, &o, comm, &tr);
            /* the ranks agree before the load, a collective */
            if ((rc = ranks_agree(comm, st != KILN_OK, NULL, &agreed))) {
                kiln_string_free(run);
                if (st != KILN_OK) cli_fail("train", "--resume", st);
                goto out;
            }
            if (st == KILN_OK) st = kiln_train_load_ex(tr, ckdir, &k, NULL, NULL);
            if (st != KILN_OK) {
                kiln_string_free(run);
                rc = cli_fail("train", "--resume", st);
                goto out;
            }
        }
        int refused = check_resume_settings(&o, run, start, overridden, sizeof overridden);
        kiln_string_free(run);
        if (refused) {
            rc = 1;
            goto out;
        }
        if (rank0) fprintf(stderr, "[kiln train] resumed from %s at step %ld\n", ckdir, start);
    }
    const long n_micro = o.batch / o.per_forward; /* micro-batches of a step */
    if (ranked && n_micro > n_ranks) {
        if (rank0)
            fprintf(stderr, "kiln train: --batch %ld in micro-batches of %ld sequences (--seqs-per-forward) is %ld "
                            "micro-batches, more than the %d ranks: a rank's gradient is one micro-batch (the "
                            "rank-order sum of several per rank would not be one process's order)\n",
                    o.batch, o.per_forward, n_micro, n_ranks);
        rc = 2;
        goto out;
    }
    if (rp) { /* from 0: the run's initial weights, made again from its model or config and seed */
        st = rp->from ? kiln_train_load_step(tr, ckdir, (uint64_t)rp->from, NULL) : KILN_OK;
        if (st != KILN_OK) {
            rc = cli_fail("audit", "the checkpoint to replay from", st);
            goto out;
        }
        start = rp->from;
        if (rp->from) fprintf(stderr, "[kiln audit] replaying steps %ld..%ld from %s/step-%ld\n", rp->from + 1, rp->to, ckdir, rp->from);
        else fprintf(stderr, "[kiln audit] replaying steps 1..%ld from the run's initial weights\n", rp->to);
    }
    if (o.teacher) {
        kiln_teacher_params tpar = kiln_teacher_default_params();
        tpar.n_hidden = o.n_pairs;
        tpar.hidden = o.pairs;
        tpar.hidden_loss = !strcmp(o.hidden_loss, "cosine") ? KILN_HIDDEN_COSINE : KILN_HIDDEN_MSE;
        st = kiln_teacher_create_ex(tm, tr, &tpar, &teacher);
        if (st != KILN_OK) {
            rc = cli_fail("distill", o.teacher, st);
            goto out;
        }
        kiln_model_info ti;
        kiln_model_get_info(tm, &ti);
        if (rank0) fprintf(stderr, "[kiln distill] teacher %s: %.1fM parameters; temperature %g, alpha %g (KL) / %g (CE)\n",
                ti.name, (double)ti.n_params / 1e6, o.temperature, o.alpha, 1.0 - o.alpha);
        if (rank0 && o.n_pairs)
            fprintf(stderr, "[kiln distill] hidden states %s (%s, weight %g)%s\n", o.hidden_map, o.hidden_loss,
                    o.hidden_weight, o.n_extra ? ": a projection a pair, teacher width x student width" : "");
    }
    char desc[1024];
    kiln_train_describe(tr, desc, sizeof desc, NULL);
    if (rank0) fprintf(stderr, "[kiln train] %s: %.1fM parameters; %s\n", mi.name, (double)mi.n_params / 1e6, desc);
    if (rank0 && ranked)
        fprintf(stderr, "[kiln train] %d ranks (%s): the global batch of %ld sequences as %ld micro-batches of %ld, one "
                        "a rank%s\n", n_ranks, kiln_comm_name(comm), o.batch, n_micro, o.per_forward,
                n_micro < n_ranks ? " (the ranks past them only hold their share of the optimizer state)" : "");
    if (rank0) fprintf(stderr, "[kiln train] data: %llu training tokens in %llu documents, %llu held out; %ld steps x %ld x %ld tokens\n",
            (unsigned long long)kiln_batch_sampler_n_tokens(train_s), (unsigned long long)kiln_batch_sampler_n_docs(train_s),
            eval_s ? (unsigned long long)kiln_batch_sampler_n_tokens(eval_s) : 0ULL, o.steps, o.batch * o.accum, o.seq);
    buf = malloc((size_t)o.batch * (size_t)(o.seq + 1) * sizeof *buf);
    /* --seqs-per-forward K: K sequences' ids and targets packed back to back */
    packed = malloc((size_t)2 * (size_t)o.per_forward * (size_t)o.seq * sizeof *packed);
    if (!buf || !packed) {
        fprintf(stderr, "kiln train: out of memory for the batch\n");
        rc = 1;
        goto out;
    }
    snprintf(path, sizeof path, "%s/metrics.csv", o.out);
    snprintf(png, sizeof png, "%s/loss.png", o.out);
    /* on resume, rows past the checkpoint (written before a crash) are cut, then appended to */
    st = !rank0 ? KILN_OK : o.resume ? kiln_metrics_open_resume(path, (uint64_t)start, &csv) : kiln_metrics_open(path, &csv);
    if (st != KILN_OK) {
        rc = cli_fail("train", path, st);
        goto out;
    }
    char run_json[16384];
    if (run_json_write(&o, overridden, run_json, sizeof run_json) != 0) {
        fprintf(stderr, "kiln train: the run configuration does not fit %zu bytes\n", sizeof run_json);
        rc = 1;
        goto out;
    }
    /* the trainer holds its own copy of every weight: the source model's are given back (a
     * --config model's initial weights on every rank, a file's converted tensors) */
    if (kiln_train_release_source(tr) != KILN_OK && rank0)
        fprintf(stderr, "[kiln train] note: the source model's weights stay in memory: %s\n", kiln_last_error());
    /* ZeRO-3: a fingerprint reads every weight, gathered on every rank for it (an audited run's
     * cost: the whole weights on every rank for a moment each step) */
    const int sharded = kiln_train_dp_stage(tr) == 3;
    if (o.audit && !rp && sharded) {
        if ((rc = ranks_agree(comm, rc, NULL, &agreed))) goto out;
        st = kiln_train_dp_gather_params(tr);
        if (st != KILN_OK) {
            rc = cli_fail("train", "--audit", st);
            agreed = 1; /* a broken transport: mpirun ends the job */
            goto out;
        }
    }
    if (o.audit && !rp && rank0) {
        uint8_t fp0[32];
        char apath[4200];
        snprintf(apath, sizeof apath, "%s/audit.jsonl", o.out);
        st = kiln_train_fingerprint(tr, fp0);
        if (st != KILN_OK) {
            rc = cli_fail("train", "--audit", st);
            goto out;
        }
        /* ranks that chose --seqs-per-forward (B / N): the log's command line says it, so that
         * kiln audit's one-process replay runs the same micro-batches (docs/DISTRIBUTED.md) */
        char kbuf[32];
        char **av = calloc((size_t)argc + 2, sizeof *av);
        int ac = 0;
        for (int i = 0; av && i < argc; i++) av[ac++] = argv[i];
        if (av && ranked && !pf_given) {
            snprintf(kbuf, sizeof kbuf, "%ld", o.per_forward);
            av[ac++] = "--seqs-per-forward";
            av[ac++] = kbuf;
        }
        int bad = !av || audit_open_write(apath, start, ac, av, fp0, &audit);
        free(av);
        if (bad) {
            if (!av) fprintf(stderr, "kiln train: out of memory for the audit log\n");
            rc = 1;
            goto out;
        }
    }
    if (sharded) kiln_train_dp_release_params(tr);
    if ((rc = ranks_agree(comm, rc, NULL, &agreed))) goto out; /* every rank is ready to train */
    int tty = isatty(2) && !rp && rank0;
    char plot_title[256];
    snprintf(plot_title, sizeof plot_title, "kiln train: %s", mi.name);
    double t0 = kiln_time_seconds(), last_eval = NAN;
    long tokens_per_step = o.batch * o.accum * o.seq;
    const long end = rp ? rp->to : o.steps;
    for (long s = start; s < end; s++) {
        double ts = kiln_time_seconds(), loss = 0;
        double kd_parts[3] = {0, 0, 0}; /* distilling: the step's KL, CE and hidden parts */
        kiln_sha256_ctx *bh = NULL; /* the step's token ids, for the audit record */
        if ((audit || rp) && st == KILN_OK) st = kiln_sha256_init(&bh);
        float scale = (float)(1.0 / ((double)o.batch * o.seq * o.accum));
        int sig_now = 0;
        if (ranked) { /* this rank's micro-batch of the global batch, then the ranks' sums */
            st = kiln_batch_sampler_get(train_s, (uint64_t)s, buf);
            if (bh && st == KILN_OK) st = kiln_sha256_update(bh, buf, (size_t)o.batch * (size_t)(o.seq + 1) * sizeof *buf);
            float l = 0.0f;
            if (st == KILN_OK && rank < n_micro) {
                /* every rank holds the whole teacher: its forward is this rank's sequences' */
                st = micro_step(tr, teacher, &dp, buf, rank * o.per_forward, o.per_forward, o.seq, packed, scale, 0,
                                &l, kd_parts);
            } else if (st == KILN_OK || sharded) {
                /* no micro-batch (or, ZeRO-3, a failure to carry into the others' step): the
                 * step's collectives with a zero contribution */
                st = kiln_train_dp_idle_step(tr, st);
            }
            /* the loss: the ranks' in rank order from +0, as one process adds its micro-batches'; a
             * failure or a signal on any rank stops every rank here */
            loss = l;
            sig_now = train_signal;
            if (st != KILN_OK)
                fprintf(stderr, "kiln train: rank %d: stopped at step %ld before updating the weights: %s\n", rank, s + 1,
                        kiln_last_error());
            if ((rc = ranks_agree(comm, st != KILN_OK, &loss, &agreed))) break;
            double sg = sig_now;
            if ((rc = ranks_agree(comm, 0, &sg, &agreed))) break;
            sig_now = sg > 0 ? (sig_now ? sig_now : SIGTERM) : 0;
            if (teacher) { /* the loss's parts, for the log: summed as the loss is */
                st = kiln_comm_allreduce_f64(comm, kd_parts, 3);
                if (st != KILN_OK) {
                    fprintf(stderr, "kiln distill: rank %d: the sum of the KL and CE parts failed: %s\n", rank,
                            kiln_last_error());
                    rc = 1;
                    agreed = 1;
                    break;
                }
            }
            st = kiln_train_dp_reduce_grads(tr);
        }
        for (long a = 0; a < o.accum && st == KILN_OK && !ranked; a++) {
            st = kiln_batch_sampler_get(train_s, (uint64_t)(s * o.accum + a), buf);
            if (bh && st == KILN_OK) st = kiln_sha256_update(bh, buf, (size_t)o.batch * (size_t)(o.seq + 1) * sizeof *buf);
            for (long b = 0; b < o.batch && st == KILN_OK; b += o.per_forward) {
                float l;
                const int acc = a > 0 || b > 0; /* forward + backward in one call: step_batch */
                st = micro_step(tr, teacher, &dp, buf, b, o.per_forward, o.seq, packed, scale, acc, &l, kd_parts);
                loss += l;
            }
        }
        float gnorm = 0, coef = 1;
        if (st == KILN_OK && o.clip > 0) st = kiln_train_clip_grads(tr, o.clip, &gnorm, &coef);
        else if (st == KILN_OK) {
            double sq;
            st = kiln_train_grad_sq_norm(tr, &sq);
            gnorm = (float)sqrt(sq);
        }
        double lr = lr_at(&o, s);
        if (st == KILN_OK) st = kiln_train_optimizer_step(tr, lr);
        audit_step as = {s + 1, {0}, loss, lr, gnorm, {0}};
        /* ZeRO-3: the fingerprint's weights gathered on every rank (the step's status is every
         * rank's here: the norms and the optimizer's refusals are the same on all) */
        if (o.audit && sharded && !rp && st == KILN_OK) st = kiln_train_dp_gather_params(tr);
        if (bh) {
            kiln_status hs = kiln_sha256_final(bh, as.batch); /* frees bh */
            if (st == KILN_OK) st = hs;
            if (st == KILN_OK) st = kiln_train_fingerprint(tr, as.params);
        }
        if (sharded) kiln_train_dp_release_params(tr);
        if (st != KILN_OK) {
            if (tty) fputc('\n', stderr);
            fprintf(stderr, "kiln train: stopped at step %ld before updating the weights: %s\n", s + 1, kiln_last_error());
            rc = 1;
            /* with ranks: a failure in the step's collectives is every rank's (the same norms, the
             * same refusal), or a broken transport, where this rank exits and mpirun ends the job */
            if (ranked) agreed = 1;
            break;
        }
        if (!rank0) { /* rank 0 keeps the metrics, the plot, the log and the evaluation */
            const int last = s + 1 == o.steps, stop_now = o.stop_after && s + 1 - start == o.stop_after && !last;
            if (sharded && eval_s && ((o.eval_every && (s + 1) % o.eval_every == 0) || last)) {
                /* ZeRO-3: the evaluation's forwards gather the layers on every rank */
                double ignored;
                st = evaluate(tr, eval_s, &o, buf, &ignored);
                if (st != KILN_OK) {
                    rc = cli_fail("train", "evaluation", st);
                    break;
                }
            }
            if ((o.save_every && (s + 1) % o.save_every == 0) || last || stop_now || sig_now) {
                st = kiln_train_save(tr, ckdir, (uint64_t)(s + 1), run_json, (int)o.keep_last);
                if (st != KILN_OK) {
                    rc = cli_fail("train", "checkpoint", st);
                    agreed = 1; /* every rank has the checkpoint's status */
                    break;
                }
            }
            if (sig_now) {
                rc = 128 + sig_now;
                break;
            }
            if (stop_now) break;
            continue;
        }
        if (rp) { /* the replay: compare, write nothing */
            if (audit_record(rp->log, &as)) {
                fprintf(stderr, "kiln audit: step %ld differs from its record (above)\n", s + 1);
                rc = 1;
                break;
            }
            fprintf(stderr, "step %ld/%ld matches its record (loss %.4f)\n", s + 1, end, loss);
            continue;
        }
        if (audit && audit_record(audit, &as)) {
            rc = 1;
            break;
        }
        double now = kiln_time_seconds(), tps = tokens_per_step / (now - ts);
        double eval_loss = NAN;
        int last = s + 1 == o.steps;
        int stop_now = o.stop_after && s + 1 - start == o.stop_after && !last;
        if (eval_s && ((o.eval_every && (s + 1) % o.eval_every == 0) || last)) {
            st = evaluate(tr, eval_s, &o, buf, &eval_loss);
            if (st != KILN_OK) {
                rc = cli_fail("train", "evaluation", st);
                break;
            }
            last_eval = eval_loss;
        }
        kiln_metrics_values mv = kiln_metrics_values_empty();
        mv.step = (uint64_t)(s + 1);
        mv.loss = loss;
        mv.eval_loss = eval_loss;
        mv.lr = lr;
        mv.grad_norm = gnorm;
        mv.tokens_per_s = tps;
        mv.elapsed_s = now - t0;
        st = kiln_metrics_row(csv, &mv);
        if (st == KILN_OK && (!isnan(eval_loss) || last)) st = kiln_metrics_plot(path, png, 800, 500, plot_title);
        if (st != KILN_OK) {
            if (tty) fputc('\n', stderr);
            rc = cli_fail("train", "metrics", st);
            break;
        }
        char eta[32];
        format_eta((now - t0) / (double)(s + 1 - start) * (double)(o.steps - s - 1), eta, sizeof eta);
        if (tty) {
            int width = 24, done = (int)((s + 1) * width / o.steps);
            char bar[32];
            for (int i = 0; i < width; i++) bar[i] = i < done ? '=' : (i == done ? '>' : ' ');
            bar[width] = 0;
            fprintf(stderr, "\r[%s] step %ld/%ld loss %.4f eval %.4f lr %.2e %.0f tok/s ETA %s   ", bar, s + 1, o.steps,
                    loss, last_eval, lr, tps, eta);
            if (last) fputc('\n', stderr);
        } else if ((s + 1) % 10 == 0 || s == start || last || !isnan(eval_loss)) {
            char ev[32] = "", parts[96] = "";
            if (!isnan(eval_loss)) snprintf(ev, sizeof ev, " eval %.4f", eval_loss);
            if (teacher && o.n_pairs)
                snprintf(parts, sizeof parts, " (kl %.4f ce %.4f hidden %.4f)", kd_parts[0], kd_parts[1], kd_parts[2]);
            else if (teacher)
                snprintf(parts, sizeof parts, " (kl %.4f ce %.4f)", kd_parts[0], kd_parts[1]);
            fprintf(stderr, "step %ld/%ld loss %.4f%s%s lr %.3e grad_norm %.3f %.0f tok/s ETA %s\n", s + 1, o.steps, loss,
                    parts, ev, lr, gnorm, tps, eta);
        }
        const int sig = ranked ? sig_now : train_signal; /* read once: the step and its checkpoint agree */
        if ((o.save_every && (s + 1) % o.save_every == 0) || last || stop_now || sig) {
            st = kiln_train_save(tr, ckdir, (uint64_t)(s + 1), run_json, (int)o.keep_last);
            if (st != KILN_OK) {
                if (tty) fputc('\n', stderr);
                rc = cli_fail("train", "checkpoint", st);
                agreed = 1; /* with ranks: every rank has the checkpoint's status */
                break;
            }
        }
        if (sig) {
            if (tty) fputc('\n', stderr);
            fprintf(stderr, "[kiln train] %s: stopped after step %ld; checkpoint: %s/step-%ld; continue with the same "
                            "command and --resume\n", sig == SIGINT ? "SIGINT" : "SIGTERM", s + 1, ckdir, s + 1);
            rc = 128 + sig;
            break;
        }
        if (stop_now) {
            if (tty) fputc('\n', stderr);
            fprintf(stderr, "[kiln train] stopped after %ld steps (--stop-after); continue with --resume\n", o.stop_after);
            break;
        }
    }
    if (rp) {
        if (!rc) fprintf(stderr, "kiln audit: all %ld steps (%ld..%ld) match their records\n", rp->to - rp->from,
                         rp->from + 1, rp->to);
        goto out;
    }
    st = kiln_metrics_close(csv);
    csv = NULL;
    if (st != KILN_OK && !rc) rc = cli_fail("train", path, st);
    if (ranked && !rp) { /* every rank: what it held (kiln's count) and its peak resident set */
        char held[512];
        struct rusage ru;
        long pages = 0, resident = -1;
        FILE *f = fopen("/proc/self/statm", "r"); /* Linux: the resident set now, in pages */
        if (f) {
            if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
            fclose(f);
        }
        char now[64] = "";
        if (resident >= 0) snprintf(now, sizeof now, "resident set %.1f MiB, ", resident * (sysconf(_SC_PAGESIZE) / 1048576.0));
        if (kiln_train_dp_describe(tr, held, sizeof held) == KILN_OK && getrusage(RUSAGE_SELF, &ru) == 0)
            fprintf(stderr, "[kiln train] %s; %speak %.1f MiB\n", held, now,
                    fmax(ru.ru_maxrss / 1024.0, resident * (sysconf(_SC_PAGESIZE) / 1048576.0)));
    }
    if (sharded && o.export_model) { /* ZeRO-3: the export reads every weight, gathered on every rank */
        if (!(rc = ranks_agree(comm, rc, NULL, &agreed))) {
            st = kiln_train_dp_gather_params(tr);
            if (st != KILN_OK) rc = cli_fail("train", "export", st);
        }
    }
    if (!rc && rank0) rc = train_finish(tr, &o);
out:
    /* every rank leaves with a status that says whether any failed (a rank that stopped on its
     * own meets the others' next agreement here) */
    if (!agreed) rc = ranks_agree(comm, rc, NULL, &agreed);
    audit_close(audit);
    kiln_metrics_close(csv);
    free(buf);
    free(packed);
    kiln_batch_sampler_free(train_s);
    kiln_batch_sampler_free(eval_s);
    for (int i = 0; i < o.n_data; i++) kiln_shard_close(shards[i]);
    kiln_teacher_free(teacher);
    kiln_trainer_free(tr);
    kiln_model_close(tm);
    kiln_model_close(m);
    kiln_comm_close(comm);
    return rc;
}

int cmd_train(int argc, char **argv) { return train_main(argc, argv, 0, NULL); }

int cmd_distill(int argc, char **argv) { return train_main(argc, argv, 1, NULL); }

static const char *audit_help =
    "usage: kiln audit RUN [--from N [--to M]] [--device D] [--threads N]\n\n"
    "Checks the audit log of a run made with `kiln train --audit` (or `kiln distill --audit`):\n"
    "RUN/audit.jsonl's chain of SHA-256 hashes (a changed, removed or reordered record is\n"
    "named). With --from N, also replays steps N+1..M (default: the log's last) from the run's\n"
    "checkpoint of step N (N = 0: its initial weights, made again) on this machine, with the\n"
    "run's own command line, and compares every\n"
    "step's batch hash, loss and gradient-norm bits and weights' fingerprint with its record:\n"
    "exit 0 when all match, 1 at the first that differs (named), 2 for usage errors.\n\n"
    "  --device D   cpu, cuda or cuda:N (default: the run's own): the auditable arithmetic\n"
    "               gives the same bits on either\n"
    "  --threads N  CPU threads (any number gives the same bits)\n";

int cmd_audit(int argc, char **argv) {
    const char *cmd = "audit", *run = NULL, *device = NULL, *threads = NULL;
    long from = -1, to = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        int err = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(audit_help, stdout);
            return 0;
        }
        if (cli_opt(argc, argv, &i, "--from", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 0, 100000000, &from);
        } else if (cli_opt(argc, argv, &i, "--to", &v, &err, cmd)) {
            if (!err) err = cli_parse_int(cmd, a, v, 1, 100000000, &to);
        } else if (cli_opt(argc, argv, &i, "--device", &v, &err, cmd)) {
            int d;
            if (!err) err = cli_parse_device(cmd, v, &d);
            device = v;
        } else if (cli_opt(argc, argv, &i, "--threads", &v, &err, cmd)) {
            long t;
            if (!err) err = cli_parse_int(cmd, a, v, 1, 256, &t);
            threads = v;
        } else if (a[0] == '-' && a[1]) {
            err = cli_usage_error(cmd, "unknown option '%s'", a);
        } else if (run) {
            err = cli_usage_error(cmd, "one RUN folder, not '%s' too", a);
        } else {
            run = a;
        }
        if (err) return 2;
    }
    if (!run) return cli_usage_error(cmd, "give the RUN folder of a `kiln train --audit` run");
    if (to >= 0 && from < 0) return cli_usage_error(cmd, "--to goes with --from");
    char abs_run[8200], here[4096], logp[8300];
    if (run[0] == '/') snprintf(abs_run, sizeof abs_run, "%s", run);
    else if (getcwd(here, sizeof here)) snprintf(abs_run, sizeof abs_run, "%s/%s", here, run);
    else {
        fprintf(stderr, "kiln audit: the current directory: %s\n", strerror(errno));
        return 1;
    }
    snprintf(logp, sizeof logp, "%s/audit.jsonl", abs_run);
    train_audit *log = NULL;
    if (audit_open_replay(logp, &log)) return 1;
    long first, last;
    audit_steps(log, &first, &last);
    if (from < 0) {
        printf("%s: the chain is intact: %ld step records (steps %ld..%ld)\n", logp, last - first + (last > 0),
               first, last);
        audit_close(log);
        return 0;
    }
    if (to < 0) to = last;
    if (from >= to || from + 1 < first || to > last) {
        audit_close(log);
        return cli_usage_error(cmd, "--from %ld --to %ld: the log holds steps %ld..%ld", from, to, first, last);
    }
    int hargc;
    char **hargv;
    const char *cwd;
    audit_command(log, &hargc, &hargv, &cwd);
    if (hargc < 1 || (strcmp(hargv[0], "train") && strcmp(hargv[0], "distill"))) {
        fprintf(stderr, "kiln audit: %s: the header's command is not a kiln train or distill\n", logp);
        audit_close(log);
        return 1;
    }
    /* the run's command line, run where it ran, on this run folder, with the overrides last */
    char **av = calloc((size_t)hargc + 8, sizeof *av);
    int ac = 0;
    for (int i = 0; av && i < hargc; i++) av[ac++] = hargv[i];
    if (av) {
        av[ac++] = "--out";
        av[ac++] = abs_run;
        if (device) av[ac++] = "--device", av[ac++] = (char *)device;
        if (threads) av[ac++] = "--threads", av[ac++] = (char *)threads;
    }
    int rc;
    if (!av || chdir(cwd) != 0) {
        fprintf(stderr, "kiln audit: cannot run in %s: %s\n", cwd, strerror(errno));
        rc = 1;
    } else {
        audit_replay rp = {log, from, to};
        rc = train_main(ac, av, !strcmp(hargv[0], "distill"), &rp);
    }
    free(av);
    audit_close(log);
    return rc;
}
