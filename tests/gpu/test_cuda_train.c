/*
 * test_cuda_train.c -- training on the CUDA backend (kiln_train_params.device = 0) against the
 * CPU trainer (device = -1), bit for bit, through the public API.
 *
 * Random models from kiln_model_create on small config.json files written here: a tiny
 * llama (tied head), a qwen2 (q/k/v biases, tied), a qwen3 (per-head q/k norms, untied
 * head), a gemma3 (sliding windows, GeGLU, (1 + w) norms), with randomised norms and biases; each trained with f32 weights + f32 AdamW and
 * with bf16 weights + f32 master copy (one extra case: bf16 + Kahan with 8-bit moments).
 * Per case, a CPU trainer and a GPU trainer get the same batches:
 *   steps 1..3: a loss step (kiln_train_step), a second micro-batch accumulated with
 *     kiln_train_forward (SUM, scaled, some targets unsupervised) + backward, a batch of two
 *     sequences of 8 through kiln_train_forward_batch (MEAN) + backward, and on step 3
 *     a third through kiln_train_forward_hidden + backward(dhidden); then grad_sq_norm,
 *     clip_grads, optimizer_step. Losses, hidden states, every gradient (before and after
 *     the clip), the norms and the coefficient, and every parameter after AdamW must have
 *     the same bits (memcmp; outputs poisoned with NaN before each read).
 *   Checkpoints: the CPU trainer saves after step 3 and a fresh GPU trainer loads it; the GPU
 *     trainer saves and a fresh CPU trainer loads it; then 2 more steps on all four: every
 *     loss, gradient and parameter bit-identical.
 * describe() must report the same parameter, gradient, optimizer and activation bytes on both,
 * and device 0 on the GPU.
 *
 * Without a usable GPU it checks that a trainer with device = 0 is refused with
 * KILN_ERR_UNSUPPORTED naming CUDA (and device = -2 with KILN_ERR_INVALID_ARG), then exits 77.
 *   test_cuda_train [vocab-dir] [--only SUBSTR]
 * vocab-dir holds ggml-vocab-llama-spm.gguf and ggml-vocab-qwen2.gguf (default
 * $KILN_VOCAB_DIR, $KILN_SHARED_DIR/testdata/tokenizer-vectors, or the source tree's
 * ../shared/testdata/tokenizer-vectors). Prints one line per case and "ALL OK" or "FAILED n".
 */
#include "base/base.h"
#include "models/model.h"
#include "ops/ops.h"

#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define GPU_TEST_SEED 0x6b696c6e54524e31ull
#include "gpu_test_models.h"

typedef struct model_case {
    const char *name, *arch;
    int C, L, NH, KVH, HS, FF, V, tied, qwen_vocab;
    kiln_weight_storage storage;
    kiln_moment_storage moments;
    int format, rounding; /* kiln_train_params.format, format_rounding */
} model_case;

static int write_config(const model_case *mc, char *path, size_t cap) {
    return gpu_write_config(mc->name, mc->arch, mc->C, mc->L, mc->NH, mc->KVH, mc->HS, mc->FF,
                            mc->V, mc->tied, 1000000.0, path, cap);
}

/* ---- comparisons ----------------------------------------------------------------------------- */

static int same_floats(const float *a, const float *b, size_t n, const char *what, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            uint32_t ua, ub;
            memcpy(&ua, &a[i], 4);
            memcpy(&ub, &b[i], 4);
            fprintf(stderr, "    %s %s: first mismatch at [%zu]: cpu %.9g (0x%08x) gpu %.9g (0x%08x)\n", what,
                    name, i, (double)a[i], ua, (double)b[i], ub);
            return 0;
        }
    return 1;
}

typedef struct cmp_stats {
    size_t tensors, values, differing_tensors;
} cmp_stats;

/* Every parameter (grads = 0) or gradient (grads = 1) of a and b; NaN-poisoned buffers. */
static int compare_all(kiln_trainer *a, kiln_trainer *b, int grads, const char *when, cmp_stats *cs) {
    int n = kiln_train_n_params(a), ok = n == kiln_train_n_params(b);
    if (!ok) {
        fprintf(stderr, "    %s: parameter counts differ\n", when);
        return 0;
    }
    for (int i = 0; i < n; i++) {
        const char *name = NULL;
        int64_t ne = 0;
        if (kiln_train_param_info(a, i, &name, &ne, NULL) != KILN_OK) return 0;
        float *x = malloc((size_t)ne * sizeof(float)), *y = malloc((size_t)ne * sizeof(float));
        if (!x || !y) {
            free(x);
            free(y);
            return 0;
        }
        for (int64_t j = 0; j < ne; j++) x[j] = y[j] = NAN;
        kiln_status s1 = grads ? kiln_train_get_grad(a, name, x, ne) : kiln_train_get_param(a, name, x, ne);
        kiln_status s2 = grads ? kiln_train_get_grad(b, name, y, ne) : kiln_train_get_param(b, name, y, ne);
        char what[96];
        snprintf(what, sizeof what, "%s %s", when, grads ? "grad" : "param");
        int same = s1 == KILN_OK && s2 == KILN_OK && same_floats(x, y, (size_t)ne, what, name);
        if (s1 != KILN_OK || s2 != KILN_OK)
            fprintf(stderr, "    %s %s: read failed: %s\n", what, name, kiln_last_error());
        cs->tensors++;
        cs->values += (size_t)ne;
        if (!same) cs->differing_tensors++;
        ok &= same;
        free(x);
        free(y);
    }
    return ok;
}

static int same_f(float a, float b, const char *what) {
    if (memcmp(&a, &b, sizeof a) == 0) return 1;
    fprintf(stderr, "    %s: cpu %.9g gpu %.9g\n", what, (double)a, (double)b);
    return 0;
}

/* ---- one step on a set of trainers ------------------------------------------------------------ */

#define MAX_T 24
#define MAX_BATCH 2 /* sequences per forward (the batch-of-two step) */

typedef struct batch {
    int32_t ids[3][MAX_T], targets[MAX_T], positions[4];
    int32_t bids[2 * 8], btargets[2 * 8]; /* a batch of 2 sequences of 8 (forward_batch) */
    int n[3], n_pos;
    float dhidden[4 * 256]; /* n_pos x C, C <= 256 */
    int with_hidden;
} batch;

static void make_batch(batch *b, int V, int C, int step) {
    static const int lens[5][3] = {{24, 17, 9}, {13, 24, 6}, {7, 11, 24}, {24, 2, 19}, {16, 23, 5}};
    memset(b, 0, sizeof *b);
    for (int k = 0; k < 3; k++) {
        b->n[k] = lens[step % 5][k];
        for (int i = 0; i < b->n[k]; i++) b->ids[k][i] = (int32_t)(rnd_u64() % (uint64_t)V);
    }
    for (int i = 0; i < b->n[1]; i++) b->targets[i] = (i % 3 == 1) ? -1 : (int32_t)(rnd_u64() % (uint64_t)V);
    b->targets[0] = (int32_t)(rnd_u64() % (uint64_t)V); /* at least one supervised */
    for (int i = 0; i < 16; i++) {
        b->bids[i] = (int32_t)(rnd_u64() % (uint64_t)V);
        b->btargets[i] = i % 8 == 7 || i % 5 == 2 ? -1 : (int32_t)(rnd_u64() % (uint64_t)V);
    }
    b->with_hidden = step == 2 || step == 4;
    b->n_pos = b->n[2] < 4 ? b->n[2] : 4;
    for (int i = 0; i < b->n_pos; i++) b->positions[i] = b->n[2] - 1 - 2 * i >= 0 ? b->n[2] - 1 - 2 * i : i;
    for (int i = 0; i < b->n_pos; i++) /* distinct positions */
        for (int j = 0; j < i; j++)
            if (b->positions[j] == b->positions[i]) b->positions[i] = (b->positions[i] + 1) % b->n[2];
    for (int i = 0; i < b->n_pos * C; i++) b->dhidden[i] = 0.01f * rnd_unit();
}

typedef struct step_out {
    float loss1, loss2, loss3, hidden[4 * 256];
    double sq_norm;
    float total, coef;
} step_out;

#define TRY(expr, what)                                                                        \
    do {                                                                                       \
        if ((expr) != KILN_OK) {                                                               \
            fprintf(stderr, "    %s: %s\n", what, kiln_last_error());                          \
            return 0;                                                                          \
        }                                                                                      \
    } while (0)

/* Forward + backward of the batch's micro-batches; clip and AdamW only when clip_and_step
 * (so that the gradients can be compared between). */
static int run_grads(kiln_trainer *t, const batch *b, int C, step_out *o) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < 4 * 256; i++) o->hidden[i] = NAN;
    TRY(kiln_train_step(t, b->ids[0], b->n[0], &o->loss1), "train_step");
    TRY(kiln_train_forward(t, b->ids[1], b->n[1], b->targets, KILN_LOSS_SUM, 0.25f, &o->loss2), "train_forward");
    TRY(kiln_train_backward(t, NULL, 1), "train_backward (accumulate)");
    TRY(kiln_train_forward_batch(t, b->bids, 2, 8, b->btargets, KILN_LOSS_MEAN, 0.5f, &o->loss3),
        "train_forward_batch");
    TRY(kiln_train_backward(t, NULL, 1), "train_backward (batch, accumulate)");
    if (b->with_hidden) {
        TRY(kiln_train_forward_hidden(t, b->ids[2], b->n[2], b->positions, b->n_pos, o->hidden),
            "train_forward_hidden");
        TRY(kiln_train_backward(t, b->dhidden, 1), "train_backward (dhidden)");
    }
    (void)C;
    TRY(kiln_train_grad_sq_norm(t, &o->sq_norm), "grad_sq_norm");
    return 1;
}

static int run_update(kiln_trainer *t, step_out *o) {
    TRY(kiln_train_clip_grads(t, 0.5, &o->total, &o->coef), "clip_grads");
    TRY(kiln_train_optimizer_step(t, 2e-3), "optimizer_step");
    return 1;
}

static int same_outputs(const step_out *a, const step_out *b, const batch *bt, int C, const char *when) {
    char w[96];
    int ok = 1;
    snprintf(w, sizeof w, "%s loss (step)", when);
    ok &= same_f(a->loss1, b->loss1, w);
    snprintf(w, sizeof w, "%s loss (forward, sum)", when);
    ok &= same_f(a->loss2, b->loss2, w);
    snprintf(w, sizeof w, "%s loss (forward_batch of 2)", when);
    ok &= same_f(a->loss3, b->loss3, w);
    if (bt->with_hidden) ok &= same_floats(a->hidden, b->hidden, (size_t)bt->n_pos * C, when, "hidden");
    if (memcmp(&a->sq_norm, &b->sq_norm, sizeof a->sq_norm) != 0) {
        fprintf(stderr, "    %s grad_sq_norm: cpu %.17g gpu %.17g\n", when, a->sq_norm, b->sq_norm);
        ok = 0;
    }
    return ok;
}

static kiln_trainer *make_trainer(kiln_model *m, const model_case *mc, int device) {
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = MAX_T;
    p.max_batch = MAX_BATCH;
    p.n_threads = 2;
    p.ce_chunk = 1000; /* several chunks of the vocabulary, one ragged */
    p.lr = 2e-3;
    p.weight_decay = 0.1;
    p.weight_storage = mc->storage;
    p.moment_storage = mc->moments;
    p.format = mc->format;
    p.format_rounding = mc->rounding;
    p.seed = 7;
    p.device = device;
    kiln_trainer *t = NULL;
    if (kiln_trainer_create(m, &p, &t) != KILN_OK) {
        fprintf(stderr, "    trainer on device %d: %s\n", device, kiln_last_error());
        return NULL;
    }
    return t;
}

static int rm_tree(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd);
}

/* ---- one case ---------------------------------------------------------------------------------- */

static int run_case(const model_case *mc, const char *vocab_dir) {
    char cfg[1200], tok[1200];
    if (!write_config(mc, cfg, sizeof cfg)) {
        fprintf(stderr, "FAIL %s: cannot write %s\n", mc->name, cfg);
        return 0;
    }
    snprintf(tok, sizeof tok, "%s/%s", vocab_dir, mc->qwen_vocab ? "ggml-vocab-qwen2.gguf" : "ggml-vocab-llama-spm.gguf");
    kiln_model *m = NULL;
    if (kiln_model_create(cfg, tok, 99 + (uint64_t)mc->C, &m) != KILN_OK) {
        fprintf(stderr, "FAIL %s: kiln_model_create: %s\n", mc->name, kiln_last_error());
        remove(cfg);
        return 0;
    }
    remove(cfg);
    gpu_randomise_vectors(m);
    double t0 = now_s();
    int ok = 1, C = m->cfg.n_embd, V = m->cfg.n_vocab;
    cmp_stats cs = {0};
    kiln_trainer *cpu = make_trainer(m, mc, -1), *gpu = make_trainer(m, mc, 0);
    kiln_trainer *gpu2 = NULL, *cpu2 = NULL;
    char dir_cpu[600], dir_gpu[600];
    snprintf(dir_cpu, sizeof dir_cpu, "%s/%s-cpu", g_tmpdir, mc->name);
    snprintf(dir_gpu, sizeof dir_gpu, "%s/%s-gpu", g_tmpdir, mc->name);
    if (!cpu || !gpu) ok = 0;
    /* describe: the same figures, another device */
    int describe_ok = 1;
    if (ok) {
        kiln_train_memory a, b;
        char da[1024], db[1024];
        ok &= kiln_train_describe(cpu, da, sizeof da, &a) == KILN_OK && kiln_train_describe(gpu, db, sizeof db, &b) == KILN_OK;
        /* both blocks hold pos and ids (max_seq x max_batch ints each); the gpu block also each
         * layer's attention statistics (lse) and the batched attention backward's workspace in
         * place of one sequence's (ops.h) */
        const kiln_model_config *c = &m->cfg;
        uint64_t lse = kiln_attention_lse_floats(MAX_BATCH, MAX_T, c->n_head);
        uint64_t ws1 = kiln_attention_backward_ws_floats(MAX_T, 0, c->n_head, c->n_head_kv, c->head_dim);
        uint64_t wsb = kiln_attention_backward_seqs_ws_floats(MAX_BATCH, MAX_T, c->n_head, c->n_head_kv, c->head_dim);
        uint64_t gpu_extra = ((uint64_t)c->n_layer * ((lse + 63) & ~(uint64_t)63) + ((wsb + 63) & ~(uint64_t)63) -
                              ((ws1 + 63) & ~(uint64_t)63)) * sizeof(float); /* slots of 64 floats */
        /* gemma3.c attends one sequence at a time on both; qwen35.c keeps no statistics and
         * sizes its workspace for the larger of its two backwards on both */
        if (!strcmp(mc->arch, "gemma3_text") || !strcmp(mc->arch, "qwen3_5_text")) gpu_extra = 0;
        uint64_t cpu_extra = 0;
        if (ok && (a.params != b.params || a.grads != b.grads || a.optimizer != b.optimizer ||
                   a.activations - cpu_extra != b.activations - gpu_extra ||
                   a.device != -1 || b.device != 0 || !strstr(db, "cuda:0"))) {
            fprintf(stderr, "    describe differs: params %llu/%llu grads %llu/%llu optimizer %llu/%llu "
                    "activations %llu/%llu device %d/%d\n      cpu: %s\n      gpu: %s\n",
                    (unsigned long long)a.params, (unsigned long long)b.params,
                    (unsigned long long)a.grads, (unsigned long long)b.grads,
                    (unsigned long long)a.optimizer, (unsigned long long)b.optimizer,
                    (unsigned long long)a.activations, (unsigned long long)b.activations, a.device,
                    b.device, da, db);
            describe_ok = 0; /* reported; the bits are still compared */
        }
    }
    /* 3 steps, everything compared after the backward and after the update */
    for (int s = 0; ok && s < 3; s++) {
        batch b;
        make_batch(&b, V, C, s);
        step_out oc, og;
        char when[32];
        snprintf(when, sizeof when, "step %d", s + 1);
        ok &= run_grads(cpu, &b, C, &oc) && run_grads(gpu, &b, C, &og);
        ok = ok && same_outputs(&oc, &og, &b, C, when);
        ok = ok && compare_all(cpu, gpu, 1, when, &cs);
        ok = ok && run_update(cpu, &oc) && run_update(gpu, &og);
        ok = ok && same_f(oc.total, og.total, "clip total norm") && same_f(oc.coef, og.coef, "clip coefficient");
        snprintf(when, sizeof when, "step %d clipped", s + 1);
        ok = ok && compare_all(cpu, gpu, 1, when, &cs);
        snprintf(when, sizeof when, "step %d adamw", s + 1);
        ok = ok && compare_all(cpu, gpu, 0, when, &cs);
    }
    /* checkpoints across devices */
    if (ok) {
        rm_tree(dir_cpu);
        rm_tree(dir_gpu);
        if (kiln_train_save(cpu, dir_cpu, 3, "{\"from\":\"cpu\"}", 0) != KILN_OK ||
            kiln_train_save(gpu, dir_gpu, 3, "{\"from\":\"gpu\"}", 0) != KILN_OK) {
            fprintf(stderr, "    save: %s\n", kiln_last_error());
            ok = 0;
        }
    }
    if (ok) {
        gpu2 = make_trainer(m, mc, 0);
        cpu2 = make_trainer(m, mc, -1);
        uint64_t k1 = 0, k2 = 0;
        char *r1 = NULL, *r2 = NULL;
        if (!gpu2 || !cpu2 || kiln_train_load(gpu2, dir_cpu, &k1, &r1) != KILN_OK ||
            kiln_train_load(cpu2, dir_gpu, &k2, &r2) != KILN_OK) {
            fprintf(stderr, "    load: %s\n", kiln_last_error());
            ok = 0;
        } else if (k1 != 3 || k2 != 3 || !r1 || !r2 || strcmp(r1, "{\"from\":\"cpu\"}") || strcmp(r2, "{\"from\":\"gpu\"}")) {
            fprintf(stderr, "    load: step %llu/%llu, run %s/%s\n", (unsigned long long)k1, (unsigned long long)k2,
                    r1 ? r1 : "(null)", r2 ? r2 : "(null)");
            ok = 0;
        }
        kiln_string_free(r1);
        kiln_string_free(r2);
        ok = ok && compare_all(cpu, gpu2, 0, "cpu ckpt -> gpu", &cs) && compare_all(gpu, cpu2, 0, "gpu ckpt -> cpu", &cs);
    }
    for (int s = 3; ok && s < 5; s++) {
        batch b;
        make_batch(&b, V, C, s);
        kiln_trainer *tr[4] = {cpu, gpu, gpu2, cpu2};
        static const char *tn[4] = {"cpu", "gpu", "gpu from cpu ckpt", "cpu from gpu ckpt"};
        step_out o[4];
        for (int k = 0; ok && k < 4; k++) ok &= run_grads(tr[k], &b, C, &o[k]) && run_update(tr[k], &o[k]);
        for (int k = 1; ok && k < 4; k++) {
            char when[64];
            snprintf(when, sizeof when, "step %d %s", s + 1, tn[k]);
            ok = ok && same_outputs(&o[0], &o[k], &b, C, when);
            ok = ok && same_f(o[0].coef, o[k].coef, when);
            ok = ok && compare_all(cpu, tr[k], 1, when, &cs) && compare_all(cpu, tr[k], 0, when, &cs);
        }
    }
    rm_tree(dir_cpu);
    rm_tree(dir_gpu);
    kiln_trainer_free(cpu);
    kiln_trainer_free(gpu);
    kiln_trainer_free(gpu2);
    kiln_trainer_free(cpu2);
    kiln_model_close(m);
    ok = ok && describe_ok;
    printf("%-24s tensors compared %zu (%zu values), differing %zu, %.2f s: %s\n", mc->name, cs.tensors, cs.values,
           cs.differing_tensors, now_s() - t0, ok ? "OK" : "FAIL");
    fflush(stdout);
    return ok;
}

int main(int argc, char **argv) {
    char shared[1024];
    const char *vocab_dir = gpu_vocab_dir(shared, sizeof shared);
    const char *only = NULL; /* --only SUBSTR: the cases whose name holds it */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else vocab_dir = argv[i];
    }
    if (!gpu_make_tmpdir("cuda-train")) return 1;
    static const model_case cases[] = {
        {"llama-tiny-f32", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_F32, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"llama-tiny-bf16m", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_BF16_MASTER, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"qwen2-bias-f32", "qwen2", 96, 2, 6, 2, 16, 224, 151936, 1, 1, KILN_STORAGE_F32, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"qwen2-bias-bf16m", "qwen2", 96, 2, 6, 2, 16, 224, 151936, 1, 1, KILN_STORAGE_BF16_MASTER, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"qwen3-qknorm-f32", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, KILN_STORAGE_F32, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"qwen3-qknorm-bf16m", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, KILN_STORAGE_BF16_MASTER, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"llama-tiny-kahan-q8", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_BF16_KAHAN, KILN_MOMENTS_Q8, KILN_FORMAT_F32, 0},
        /* sliding windows of 8 that the 24-token sequences cross, GeGLU, (1 + w) norms */
        {"gemma3-tiny-f32", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, KILN_STORAGE_F32, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"gemma3-tiny-bf16m", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, KILN_STORAGE_BF16_MASTER, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        /* Gated DeltaNet around gated attention, (1 + w) norms, the linear layers' state */
        {"qwen35-tiny-f32", "qwen3_5_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, KILN_STORAGE_F32, KILN_MOMENTS_F32, KILN_FORMAT_F32, 0},
        {"qwen35-tiny-kahan-q8", "qwen3_5_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, KILN_STORAGE_BF16_KAHAN,
         KILN_MOMENTS_Q8, KILN_FORMAT_F32, 0},
        /* the exact formats: every product of the forward and the backward on the int8 tensor
         * cores (the loss's head products f32), the CPU's bits */
        {"llama-tiny-mx16", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_F32, KILN_MOMENTS_F32,
         KILN_FORMAT_MX16, KILN_ROUND_NEAREST},
        {"qwen2-bias-mx8-stochastic", "qwen2", 96, 2, 6, 2, 16, 224, 151936, 1, 1, KILN_STORAGE_F32,
         KILN_MOMENTS_F32, KILN_FORMAT_MX8, KILN_ROUND_STOCHASTIC},
        {"qwen3-qknorm-bf16m-mx16-stochastic", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1,
         KILN_STORAGE_BF16_MASTER, KILN_MOMENTS_F32, KILN_FORMAT_MX16, KILN_ROUND_STOCHASTIC},
        {"gemma3-tiny-mx8", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, KILN_STORAGE_F32, KILN_MOMENTS_F32,
         KILN_FORMAT_MX8, KILN_ROUND_NEAREST},
    };
    int n_cases = (int)(sizeof cases / sizeof cases[0]);

    /* refusals that need no GPU */
    char tok[1200], cfg[1200];
    snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
    if (access(tok, R_OK) != 0) {
        rmdir(g_tmpdir);
        return gpu_missing_vocab_status(tok);
    }
    if (!write_config(&cases[0], cfg, sizeof cfg)) {
        fprintf(stderr, "FAIL: cannot write a config into %s\n", g_tmpdir);
        rmdir(g_tmpdir);
        return 1;
    }
    kiln_model *m = NULL;
    int ok = kiln_model_create(cfg, tok, 1, &m) == KILN_OK;
    remove(cfg);
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = 16;
    ok &= p.device == -1;
    kiln_trainer *t = NULL;
    p.device = -2;
    ok &= m && kiln_trainer_create(m, &p, &t) == KILN_ERR_INVALID_ARG && t == NULL &&
          strstr(kiln_last_error(), "device -2") != NULL;
    p.device = 999; /* no machine has that GPU */
    ok &= m && kiln_trainer_create(m, &p, &t) == KILN_ERR_UNSUPPORTED && t == NULL &&
          strstr(kiln_last_error(), "device 999 (CUDA)") != NULL;
    if (!ok) {
        fprintf(stderr, "FAIL: refusals: %s\n", kiln_last_error());
        kiln_model_close(m);
        rmdir(g_tmpdir);
        return 1;
    }
    p.device = 0;
    kiln_status st = kiln_trainer_create(m, &p, &t);
    kiln_trainer_free(t);
    kiln_model_close(m);
    if (st != KILN_OK) {
        /* no GPU: a trainer on device 0 must be refused clearly */
        int refused = st == KILN_ERR_UNSUPPORTED && strstr(kiln_last_error(), "CUDA") != NULL;
        fprintf(stderr, "no GPU: trainer on device 0 refused: %s\n", kiln_last_error());
        rmdir(g_tmpdir);
        if (!refused) {
            fprintf(stderr, "FAIL: expected KILN_ERR_UNSUPPORTED naming CUDA, got %d\n", st);
            return 1;
        }
        return 77;
    }

    int failed = 0;
    for (int i = 0; i < n_cases; i++)
        if (!only || strstr(cases[i].name, only)) failed += !run_case(&cases[i], vocab_dir);
    rmdir(g_tmpdir);
    if (failed) printf("FAILED %d\n", failed);
    else printf("ALL OK\n");
    return failed ? 1 : 0;
}
