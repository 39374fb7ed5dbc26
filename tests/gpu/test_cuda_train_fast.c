/*
 * test_cuda_train_fast.c -- fast training on the GPU (kiln_train_params.fast = 1, device 0)
 * against auditable training on the same GPU (fast = 0), through the public API.
 *
 * A tiny random llama from kiln_model_create on a config.json written here (C 128, 2 layers,
 * 2 query heads of 64 over 1 kv head: the tensor-core flash attention's head size; FF 352;
 * the llama vocabulary, tied head), with f32 weights and with bf16 weights + f32 master copy.
 * Three trainers start from the model's weights: an auditable one (A) and two fast ones (F1,
 * F2). Every step gives them the same sequence of 64 tokens (a learnable pattern over 256
 * ids, so the loss falls): kiln_train_step, clip_grads(1.0), optimizer_step; 20 steps.
 *
 * What is required, and why these bounds (fast mode: docs/TRAINING.md, "Fast mode"):
 *   - step 1 gradients (same weights, same batch: the difference is only the arithmetic of
 *     one forward + backward), per tensor: ||g_F - g_A|| / ||g_A|| <= GRAD_BOUND = 5e-2. Each
 *     product rounds its operands to bf16 (relative 2^-8 each), so an element of a product is
 *     off by at most 2^-7 of sum |a_k b_k|; with random signs the errors mostly cancel and the
 *     norm-wise error of a gradient is typically a few 2^-9 (about 2e-3 to 1e-2 after several
 *     chained products); 5e-2 leaves room for cancellation in small gradients, while a wrong
 *     product (transposed, missing accumulate, wrong operand) gives about 1 or more;
 *   - the loss of every step: |loss_F - loss_A| / loss_A <= LOSS_BOUND = 2e-2. The loss is
 *     an average over 63 positions of log-sum-exps of logits whose errors are about 2^-8 of
 *     sum |h||w| (small against 1 at this init), so the first loss agrees to about 1e-4; the
 *     trajectories then drift apart as AdamW (a sign-like update early on) amplifies the
 *     gradient differences of near-zero gradient elements, but over 20 steps at lr 3e-3 the
 *     losses stay within a fraction of a percent;
 *   - the weights after 20 steps: ||w_F - w_A|| / ||w_A - w_0|| <= WEIGHT_BOUND = 0.5 over
 *     all parameters (w_0 the initial weights): the fast run moved the weights along the same
 *     path as the auditable one, differing by at most half the distance travelled (a wrong
 *     gradient gives about 1.4, a sign error 2; AdamW's updates of elements whose gradient is
 *     near zero can flip sign under bf16 rounding, which is why this cannot be tight);
 *   - determinism: F1 and F2 have the same bits for every loss, every step-1 gradient, the
 *     clip norms, and every parameter after 20 steps; F1 records its step graphs at step 2
 *     and replays them (describe() says so), F2 runs with KILN_CUDA_GRAPHS=0, so this also
 *     checks that a replayed step is the step;
 *   - mixed precision: F1 and F2 keep bf16 activations (the products' inputs, gate/up and the
 *     attention output in bf16, docs/TRAINING.md), the same bytes of them;
 *   - resume: a third fast trainer loads F1's checkpoint of step 10 and replays steps 11-20
 *     with the same batches: every loss and every final parameter has F1's bits (with f32
 *     weights the bf16 copies the products take are remade from the loaded weights).
 * The maxima seen are printed, so the bounds can be tightened from a run on the target GPU.
 *
 * Without a usable GPU: checks that fast = 1 with device = -1 is refused with
 * KILN_ERR_UNSUPPORTED ("fast is a GPU mode"), that fast defaults to 0, and that a trainer on
 * device 0 (auditable and fast) is refused with KILN_ERR_UNSUPPORTED; then exits 77.
 *   test_cuda_train_fast [vocab-dir]
 * vocab-dir holds ggml-vocab-llama-spm.gguf (default $KILN_VOCAB_DIR,
 * $KILN_SHARED_DIR/testdata/tokenizer-vectors, or the source tree's
 * ../shared/testdata/tokenizer-vectors). Prints the loss curves and "ALL OK" or "FAILED n".
 */
#include "base/base.h"
#include "models/model.h"

#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define STEPS 20
#define SEQ 64
#define LR 3e-3
#define GRAD_BOUND 5e-2
#define LOSS_BOUND 2e-2
#define WEIGHT_BOUND 0.5

#define GPU_TEST_SEED 0x6b696c6e46535431ull
#include "gpu_test_models.h"

/* arch "llama", or "qwen2" (q, k, v biases: the stacked q/k/v backward with its separate
 * bias sums) */
static int write_config(const char *arch, char *path, size_t cap) {
    return gpu_write_config("llama-fast", arch, 128, 2, 2, 1, 64, 352, 32000, 1, 10000.0, path, cap);
}

/* The batch of step s: a walk over 256 ids (id' = (5 id + 17 + (s % 3)) mod 256, offset 300)
 * started at a random id: next-token prediction a model can learn. */
static void make_batch(int32_t *ids, int s) {
    int32_t v = (int32_t)(rnd_u64() % 256);
    for (int i = 0; i < SEQ; i++) {
        ids[i] = 300 + v;
        v = (5 * v + 17 + (s % 3)) % 256;
    }
}

#define TRY(expr, what)                                                                        \
    do {                                                                                       \
        if ((expr) != KILN_OK) {                                                               \
            fprintf(stderr, "    %s: %s\n", what, kiln_last_error());                          \
            ok = 0;                                                                            \
            goto done;                                                                         \
        }                                                                                      \
    } while (0)

static kiln_trainer *make_trainer(kiln_model *m, kiln_weight_storage storage, int fast) {
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = SEQ;
    p.n_threads = 2;
    p.ce_chunk = 4096;
    p.lr = LR;
    p.weight_decay = 0.1;
    p.weight_storage = storage;
    p.seed = 7;
    p.device = 0;
    p.fast = fast;
    kiln_trainer *t = NULL;
    if (kiln_trainer_create(m, &p, &t) != KILN_OK) {
        fprintf(stderr, "    trainer (fast %d): %s\n", fast, kiln_last_error());
        return NULL;
    }
    return t;
}

/* All parameters (grads = 0) or gradients (grads = 1) of t, concatenated, in out (total
 * floats; NaN-poisoned first so that a value not written cannot pass). */
static int read_all(kiln_trainer *t, int grads, float *out, size_t total) {
    for (size_t i = 0; i < total; i++) out[i] = NAN;
    size_t off = 0;
    for (int i = 0; i < kiln_train_n_params(t); i++) {
        const char *name = NULL;
        int64_t ne = 0;
        if (kiln_train_param_info(t, i, &name, &ne, NULL) != KILN_OK || off + (size_t)ne > total) return 0;
        kiln_status st = grads ? kiln_train_get_grad(t, name, out + off, ne) : kiln_train_get_param(t, name, out + off, ne);
        if (st != KILN_OK) {
            fprintf(stderr, "    read %s %s: %s\n", grads ? "grad" : "param", name, kiln_last_error());
            return 0;
        }
        off += (size_t)ne;
    }
    return off == total;
}

static size_t total_floats(kiln_trainer *t) {
    size_t total = 0;
    for (int i = 0; i < kiln_train_n_params(t); i++) {
        int64_t ne = 0;
        if (kiln_train_param_info(t, i, NULL, &ne, NULL) != KILN_OK) return 0;
        total += (size_t)ne;
    }
    return total;
}

/* First differing bit pattern of a and b (n floats), or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0) return (long)i;
    return -1;
}

/* Step-1 gradients per tensor: ||f - a|| / ||a||; returns the worst ratio, *bad counts the
 * tensors over GRAD_BOUND (a NaN counts). */
static double grad_ratios(kiln_trainer *t, const float *ga, const float *gf, int *bad) {
    double worst = 0.0;
    size_t off = 0;
    for (int i = 0; i < kiln_train_n_params(t); i++) {
        const char *name = NULL;
        int64_t ne = 0;
        kiln_train_param_info(t, i, &name, &ne, NULL);
        double d2 = 0.0, a2 = 0.0;
        for (int64_t j = 0; j < ne; j++) {
            const double a = ga[off + (size_t)j], d = (double)gf[off + (size_t)j] - a;
            d2 += d * d;
            a2 += a * a;
        }
        const double r = a2 > 0.0 ? sqrt(d2 / a2) : sqrt(d2);
        if (!(r <= GRAD_BOUND)) {
            fprintf(stderr, "    step-1 gradient %s: ||fast - auditable|| / ||auditable|| = %.3g > %.3g\n", name, r,
                    GRAD_BOUND);
            (*bad)++;
        }
        if (r > worst || r != r) worst = r;
        off += (size_t)ne;
    }
    return worst;
}

static int run_case(const char *name, const char *arch, kiln_weight_storage storage,
                    const char *vocab_dir) {
    char cfg[1200], tok[1200];
    int ok = 1;
    if (!write_config(arch, cfg, sizeof cfg)) {
        fprintf(stderr, "FAIL %s: cannot write %s\n", name, cfg);
        return 0;
    }
    snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
    kiln_model *m = NULL;
    if (kiln_model_create(cfg, tok, 1234, &m) != KILN_OK) {
        fprintf(stderr, "FAIL %s: kiln_model_create: %s\n", name, kiln_last_error());
        remove(cfg);
        return 0;
    }
    remove(cfg);
    gpu_randomise_vectors(m);
    const double t0 = now_s();
    /* F2 launches every op itself (KILN_CUDA_GRAPHS=0); F1 and the resumed run replay the
     * step graphs they record at their second step: the bits must not change. */
    kiln_trainer *ta = make_trainer(m, storage, 0), *tf1 = make_trainer(m, storage, 1), *tr = make_trainer(m, storage, 1);
    setenv("KILN_CUDA_GRAPHS", "0", 1);
    kiln_trainer *tf2 = make_trainer(m, storage, 1);
    unsetenv("KILN_CUDA_GRAPHS");
    /* resume: tf1 is saved after step HALF; tr loads that checkpoint and replays the later
     * steps, which must give tf1's losses and weights bit for bit (in fast mode the bf16
     * copies of f32 weights are remade from the loaded ones) */
    enum { HALF = STEPS / 2 };
    float lf1s[STEPS];
    int32_t batches[STEPS][SEQ]; /* make_batch draws from the test's stream: kept to replay */
    char ckpt[400];
    snprintf(ckpt, sizeof ckpt, "%s/resume-%s", g_tmpdir, name);
    int resumed_same = 0;
    float *w0 = NULL, *wa = NULL, *wf1 = NULL, *wf2 = NULL;
    size_t total = 0;
    double worst_loss = 0.0, worst_grad = 0.0, wratio = 0.0, wrel = 0.0;
    int grad_bad = 0;
    if (!ta || !tf1 || !tf2 || !tr) {
        ok = 0;
        goto done;
    }
    total = total_floats(ta);
    w0 = malloc(total * sizeof(float));
    wa = malloc(total * sizeof(float));
    wf1 = malloc(total * sizeof(float));
    wf2 = malloc(total * sizeof(float));
    if (!total || !w0 || !wa || !wf1 || !wf2 || total != total_floats(tf1)) {
        fprintf(stderr, "    out of memory or parameter counts differ\n");
        ok = 0;
        goto done;
    }
    if (!read_all(ta, 0, w0, total)) {
        ok = 0;
        goto done;
    }
    {
        char desc[1024];
        kiln_train_memory mem;
        if (kiln_train_describe(tf1, desc, sizeof desc, &mem) != KILN_OK || mem.device != 0 ||
            !strstr(desc, "cuda:0")) {
            fprintf(stderr, "    describe (fast): %s\n", desc);
            ok = 0;
        }
    }
    printf("%s\n  step   loss auditable   loss fast        rel diff   (fast run 2: same bits)\n", name);
    for (int s = 0; s < STEPS; s++) {
        int32_t ids[SEQ];
        make_batch(ids, s);
        memcpy(batches[s], ids, sizeof ids);
        float la = NAN, lf1 = NAN, lf2 = NAN, ta_norm, tf1_norm, tf2_norm, ca, cf1, cf2;
        TRY(kiln_train_step(ta, ids, SEQ, &la), "train_step (auditable)");
        TRY(kiln_train_step(tf1, ids, SEQ, &lf1), "train_step (fast)");
        TRY(kiln_train_step(tf2, ids, SEQ, &lf2), "train_step (fast, run 2)");
        if (s == 0) { /* the gradients of one forward + backward from the same weights */
            float *ga = wa, *gf1 = wf1, *gf2 = wf2; /* the buffers serve as scratch here */
            if (!read_all(ta, 1, ga, total) || !read_all(tf1, 1, gf1, total) || !read_all(tf2, 1, gf2, total)) {
                ok = 0;
                goto done;
            }
            worst_grad = grad_ratios(ta, ga, gf1, &grad_bad);
            if (grad_bad) ok = 0;
            long d = first_diff(gf1, gf2, total);
            if (d >= 0) {
                fprintf(stderr, "    step-1 gradients of the two fast runs differ at [%ld]: %.9g vs %.9g\n", d,
                        (double)gf1[d], (double)gf2[d]);
                ok = 0;
            }
        }
        TRY(kiln_train_clip_grads(ta, 1.0, &ta_norm, &ca), "clip (auditable)");
        TRY(kiln_train_clip_grads(tf1, 1.0, &tf1_norm, &cf1), "clip (fast)");
        TRY(kiln_train_clip_grads(tf2, 1.0, &tf2_norm, &cf2), "clip (fast, run 2)");
        TRY(kiln_train_optimizer_step(ta, LR), "adamw (auditable)");
        TRY(kiln_train_optimizer_step(tf1, LR), "adamw (fast)");
        TRY(kiln_train_optimizer_step(tf2, LR), "adamw (fast, run 2)");
        lf1s[s] = lf1;
        if (s + 1 == HALF) TRY(kiln_train_save(tf1, ckpt, (uint64_t)HALF, NULL, 1), "save (fast)");
        const double rel = fabs((double)lf1 - (double)la) / fabs((double)la);
        const int same = memcmp(&lf1, &lf2, 4) == 0 && memcmp(&tf1_norm, &tf2_norm, 4) == 0 &&
                         memcmp(&cf1, &cf2, 4) == 0;
        printf("  %4d   %-15.9g  %-15.9g  %.3e  %s\n", s + 1, (double)la, (double)lf1, rel, same ? "yes" : "NO");
        if (!(rel <= LOSS_BOUND)) {
            fprintf(stderr, "    step %d: loss rel diff %.3g > %.3g\n", s + 1, rel, LOSS_BOUND);
            ok = 0;
        }
        if (!same) {
            fprintf(stderr, "    step %d: fast runs differ: loss %.9g / %.9g, norm %.9g / %.9g, coef %.9g / %.9g\n",
                    s + 1, (double)lf1, (double)lf2, (double)tf1_norm, (double)tf2_norm, (double)cf1, (double)cf2);
            ok = 0;
        }
        if (rel > worst_loss || rel != rel) worst_loss = rel;
    }
    if (!read_all(ta, 0, wa, total) || !read_all(tf1, 0, wf1, total) || !read_all(tf2, 0, wf2, total)) {
        ok = 0;
        goto done;
    }
    { /* F1 replayed recorded steps; F2 did not record graphs; both kept bf16 activations */
        char d1[1024], d2[1024];
        kiln_train_memory m1, m2;
        if (kiln_train_describe(tf1, d1, sizeof d1, &m1) != KILN_OK || !strstr(d1, "step graphs recorded") ||
            kiln_train_describe(tf2, d2, sizeof d2, &m2) != KILN_OK || strstr(d2, "graphs")) {
            fprintf(stderr, "    step graphs: F1 should have recorded them, F2 not: F1 '%s', F2 '%s'\n", d1, d2);
            ok = 0;
        } else if (m1.activations != m2.activations) {
            fprintf(stderr, "    activations: F1 holds %llu bytes, F2 %llu\n", (unsigned long long)m1.activations,
                    (unsigned long long)m2.activations);
            ok = 0;
        } else {
            printf("  activations: %.2f MiB in bf16 mixed precision\n", m1.activations / 1048576.0);
        }
    }
    { /* resume from step HALF and replay the rest */
        uint64_t at = 0;
        TRY(kiln_train_load(tr, ckpt, &at, NULL), "load (fast)");
        resumed_same = at == HALF;
        for (int s = HALF; s < STEPS; s++) {
            float l = NAN, nrm, cf;
            TRY(kiln_train_step(tr, batches[s], SEQ, &l), "train_step (fast, resumed)");
            TRY(kiln_train_clip_grads(tr, 1.0, &nrm, &cf), "clip (fast, resumed)");
            TRY(kiln_train_optimizer_step(tr, LR), "adamw (fast, resumed)");
            if (memcmp(&l, &lf1s[s], 4) != 0) {
                fprintf(stderr, "    resumed step %d: loss %.9g, uninterrupted %.9g\n", s + 1, (double)l,
                        (double)lf1s[s]);
                resumed_same = 0;
            }
        }
        float *wr = malloc(total * sizeof(float));
        if (!wr || !read_all(tr, 0, wr, total) || first_diff(wr, wf1, total) >= 0) {
            fprintf(stderr, "    resumed weights differ from the uninterrupted run's\n");
            resumed_same = 0;
        }
        free(wr);
        if (!resumed_same) ok = 0;
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", ckpt);
        if (system(cmd) != 0) fprintf(stderr, "    could not remove %s\n", ckpt);
    }
    {
        double d2 = 0.0, u2 = 0.0, a2 = 0.0;
        for (size_t i = 0; i < total; i++) {
            const double d = (double)wf1[i] - (double)wa[i], u = (double)wa[i] - (double)w0[i];
            d2 += d * d;
            u2 += u * u;
            a2 += (double)wa[i] * (double)wa[i];
        }
        wratio = u2 > 0.0 ? sqrt(d2 / u2) : INFINITY;
        wrel = a2 > 0.0 ? sqrt(d2 / a2) : INFINITY;
        if (!(wratio <= WEIGHT_BOUND)) {
            fprintf(stderr, "    weights after %d steps: ||fast - auditable|| / ||auditable - initial|| = %.3g > %.3g\n",
                    STEPS, wratio, WEIGHT_BOUND);
            ok = 0;
        }
        long d = first_diff(wf1, wf2, total);
        if (d >= 0) {
            fprintf(stderr, "    weights of the two fast runs differ at [%ld]: %.9g vs %.9g\n", d, (double)wf1[d],
                    (double)wf2[d]);
            ok = 0;
        }
    }
done:
    printf("%-22s max loss rel diff %.3e (bound %.0e); step-1 grads max rel %.3e (bound %.0e); weights after "
           "%d steps: diff/update %.3e (bound %.1f), diff/weights %.3e; fast runs bit-identical: checked; "
           "resumed from step %d: %s; %.2f s: %s\n",
           name, worst_loss, LOSS_BOUND, worst_grad, GRAD_BOUND, STEPS, wratio, WEIGHT_BOUND, wrel, (int)HALF,
           resumed_same ? "same bits" : "DIFFERS", now_s() - t0,
           ok ? "OK" : "FAIL");
    fflush(stdout);
    free(w0);
    free(wa);
    free(wf1);
    free(wf2);
    kiln_trainer_free(ta);
    kiln_trainer_free(tf1);
    kiln_trainer_free(tf2);
    kiln_trainer_free(tr);
    kiln_model_close(m);
    return ok;
}

/* kiln_train_step_batch (the one-call step: no wait between the forward and the backward)
 * against forward_batch + backward on two fast trainers from the same weights: every loss,
 * every gradient after each optimizer step, and the weights after them, bit for bit, over
 * SB_STEPS steps of two micro-batches of 2 sequences (the second accumulating), so that the
 * step graphs are recorded and replayed on both paths. Then a non-finite loss (the final
 * norm's weight set to 1e38, so that the logits overflow): step_batch must fail naming the loss, clip and optimizer_step
 * must refuse the gradients (KILN_ERR_STATE), and after the weight is restored a step that
 * does not accumulate must work again, with forward_batch + backward's loss bits. */
#define SB_STEPS 4

/* The tiny llama of the one-call cases (seed 99, vectors randomised), or NULL (said why). */
static kiln_model *sb_model(const char *vocab_dir, const char *what) {
    char cfg[1200], tok[1200];
    if (!write_config("llama", cfg, sizeof cfg)) return NULL;
    snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
    kiln_model *m = NULL;
    if (kiln_model_create(cfg, tok, 99, &m) != KILN_OK) {
        fprintf(stderr, "FAIL %s: kiln_model_create: %s\n", what, kiln_last_error());
        m = NULL;
    }
    remove(cfg);
    if (m) gpu_randomise_vectors(m);
    return m;
}

/* Their fast trainers' parameters: 2 sequences of SEQ a forward, on device 0. */
static kiln_train_params sb_params(void) {
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = SEQ;
    p.max_batch = 2;
    p.n_threads = 2;
    p.lr = LR;
    p.weight_decay = 0.1;
    p.device = 0;
    p.fast = 1;
    return p;
}

static int run_step_batch_case(const char *vocab_dir) {
    int ok = 1;
    kiln_model *m = sb_model(vocab_dir, "step_batch");
    if (!m) return 0;
    kiln_trainer *ts = NULL, *tb = NULL; /* split (forward_batch + backward), one call */
    kiln_train_params p = sb_params();
    p.ce_row_block = 0; /* the vocabulary walk: forward_batch + backward's products */
    float *a = NULL, *b = NULL, *nan_w = NULL, *norm_w = NULL;
    size_t total = 0;
    int steps_same = 1;
    if (kiln_trainer_create(m, &p, &ts) != KILN_OK || kiln_trainer_create(m, &p, &tb) != KILN_OK) {
        fprintf(stderr, "    trainers: %s\n", kiln_last_error());
        ok = 0;
        goto done;
    }
    total = total_floats(ts);
    a = malloc(total * sizeof(float));
    b = malloc(total * sizeof(float));
    nan_w = malloc(128 * sizeof(float));
    norm_w = malloc(128 * sizeof(float));
    if (!total || !a || !b || !nan_w || !norm_w) {
        ok = 0;
        goto done;
    }
    int32_t ids[2][2 * SEQ], tg[2][2 * SEQ];
    for (int s = 0; s < SB_STEPS; s++) {
        for (int mb = 0; mb < 2; mb++)
            for (int q = 0; q < 2; q++) {
                make_batch(ids[mb] + q * SEQ, s + mb + q);
                for (int i = 0; i < SEQ; i++) tg[mb][q * SEQ + i] = i + 1 < SEQ ? ids[mb][q * SEQ + i + 1] : -1;
            }
        for (int mb = 0; mb < 2; mb++) {
            float ls = NAN, lb = NAN;
            TRY(kiln_train_forward_batch(ts, ids[mb], 2, SEQ, tg[mb], KILN_LOSS_MEAN, 0.5f, &ls), "forward_batch");
            TRY(kiln_train_backward(ts, NULL, mb > 0), "backward");
            TRY(kiln_train_step_batch(tb, ids[mb], 2, SEQ, tg[mb], KILN_LOSS_MEAN, 0.5f, mb > 0, &lb), "step_batch");
            if (memcmp(&ls, &lb, 4) != 0) {
                fprintf(stderr, "    step %d micro %d: loss %.9g (forward_batch + backward) vs %.9g (step_batch)\n",
                        s + 1, mb, (double)ls, (double)lb);
                steps_same = 0;
            }
        }
        if (!read_all(ts, 1, a, total) || !read_all(tb, 1, b, total)) {
            ok = 0;
            goto done;
        }
        long d = first_diff(a, b, total);
        if (d >= 0) {
            fprintf(stderr, "    step %d: gradients differ at [%ld]: %.9g vs %.9g\n", s + 1, d, (double)a[d],
                    (double)b[d]);
            steps_same = 0;
        }
        float n1, n2, c1, c2;
        TRY(kiln_train_clip_grads(ts, 1.0, &n1, &c1), "clip (split)");
        TRY(kiln_train_clip_grads(tb, 1.0, &n2, &c2), "clip (step_batch)");
        TRY(kiln_train_optimizer_step(ts, LR), "adamw (split)");
        TRY(kiln_train_optimizer_step(tb, LR), "adamw (step_batch)");
    }
    if (!read_all(ts, 0, a, total) || !read_all(tb, 0, b, total) || first_diff(a, b, total) >= 0) {
        fprintf(stderr, "    weights after %d steps differ (or could not be read)\n", SB_STEPS);
        steps_same = 0;
    }
    if (!steps_same) ok = 0;
    { /* a non-finite loss */
        const char *nm = "model.norm.weight";
        float l = 0.0f, nrm, cf;
        for (int i = 0; i < 128; i++) nan_w[i] = 1e38f; /* set_param refuses NaN: logits overflow instead */
        TRY(kiln_train_get_param(tb, nm, norm_w, 128), "get norm weight");
        TRY(kiln_train_set_param(tb, nm, nan_w, 128), "set norm weight");
        kiln_status st = kiln_train_step_batch(tb, ids[0], 2, SEQ, tg[0], KILN_LOSS_MEAN, 0.5f, 0, &l);
        const int named = st == KILN_ERR_RANGE && strstr(kiln_last_error(), "not finite") != NULL &&
                          strstr(kiln_last_error(), "discarded") != NULL;
        if (!named) {
            fprintf(stderr, "    non-finite loss: status %d, '%s' (want KILN_ERR_RANGE naming it)\n", (int)st,
                    kiln_last_error());
            ok = 0;
        }
        if (kiln_train_optimizer_step(tb, LR) != KILN_ERR_STATE || kiln_train_clip_grads(tb, 1.0, &nrm, &cf) != KILN_ERR_STATE) {
            fprintf(stderr, "    after a non-finite loss the optimizer / clip took the gradients: %s\n",
                    kiln_last_error());
            ok = 0;
        }
        TRY(kiln_train_set_param(tb, nm, norm_w, 128), "restore norm weight");
        float ls = NAN, lb = NAN;
        TRY(kiln_train_forward_batch(ts, ids[0], 2, SEQ, tg[0], KILN_LOSS_MEAN, 0.5f, &ls), "forward_batch (after)");
        TRY(kiln_train_backward(ts, NULL, 0), "backward (after)");
        TRY(kiln_train_step_batch(tb, ids[0], 2, SEQ, tg[0], KILN_LOSS_MEAN, 0.5f, 0, &lb), "step_batch (after)");
        TRY(kiln_train_clip_grads(tb, 1.0, &nrm, &cf), "clip (after)");
        if (memcmp(&ls, &lb, 4) != 0) {
            fprintf(stderr, "    after the restore: loss %.9g vs %.9g\n", (double)ls, (double)lb);
            ok = 0;
        }
    }
done:
    printf("%-22s step_batch vs forward_batch + backward over %d steps x 2 micro-batches: %s; non-finite loss "
           "refused: %s\n", "step_batch (fast)", SB_STEPS, steps_same ? "same bits" : "DIFFER", ok ? "OK" : "FAIL");
    free(a);
    free(b);
    free(nan_w);
    free(norm_w);
    kiln_trainer_free(ts);
    kiln_trainer_free(tb);
    kiln_model_close(m);
    return ok;
}

/* step_batch with the loss's row-block walk (ce_row_block, the default 2048: one block here;
 * its logits in bf16, the default, or f32: ce_logits_f32) against forward_batch + backward
 * (the vocabulary walk) over SB_STEPS steps of two micro-batches: two row-walk trainers give
 * the same bits for every loss, every gradient and the weights after each step; against the
 * split trainer step 1's losses within 1e-5 relative with f32 logits (the same weights: the
 * statistics' sums run in another order) or 2e-4 with bf16 logits (each logit rounded once
 * more), later ones within 1e-3, as the weights drift apart; step 1's gradients per tensor
 * within GRAD_BOUND (the same bound as fast against auditable; printed), and the weights
 * after SB_STEPS steps within WEIGHT_BOUND of the distance travelled. */
static int run_row_block_case(const char *vocab_dir, int logits_f32) {
    int ok = 1;
    kiln_model *m = sb_model(vocab_dir, "row block");
    if (!m) return 0;
    kiln_trainer *ts = NULL, *r1 = NULL, *r2 = NULL;
    kiln_train_params p = sb_params();
    float *a = NULL, *b = NULL, *c = NULL, *w0 = NULL;
    size_t total = 0;
    double worst_loss = 0.0, worst_grad = 0.0, wdiff = 0.0, wmove = 0.0;
    int same = 1, bad = 0, loss_bad = 0;
    const double step1_bound = logits_f32 ? 1e-5 : 2e-4;
    if (p.ce_logits_f32 != 0) {
        fprintf(stderr, "    default ce_logits_f32 %d, expected 0 (bf16 logits)\n", p.ce_logits_f32);
        ok = 0;
        goto done;
    }
    p.ce_logits_f32 = logits_f32;
    if (p.ce_row_block != 2048 || kiln_trainer_create(m, &p, &ts) != KILN_OK ||
        kiln_trainer_create(m, &p, &r1) != KILN_OK || kiln_trainer_create(m, &p, &r2) != KILN_OK) {
        fprintf(stderr, "    trainers (default ce_row_block %d): %s\n", p.ce_row_block, kiln_last_error());
        ok = 0;
        goto done;
    }
    total = total_floats(ts);
    a = malloc(total * sizeof(float));
    b = malloc(total * sizeof(float));
    c = malloc(total * sizeof(float));
    w0 = malloc(total * sizeof(float));
    if (!total || !a || !b || !c || !w0 || !read_all(ts, 0, w0, total)) {
        ok = 0;
        goto done;
    }
    int32_t ids[2][2 * SEQ], tg[2][2 * SEQ];
    for (int s = 0; s < SB_STEPS; s++) {
        for (int mb = 0; mb < 2; mb++)
            for (int q = 0; q < 2; q++) {
                make_batch(ids[mb] + q * SEQ, 7 * s + mb + q);
                for (int i = 0; i < SEQ; i++) tg[mb][q * SEQ + i] = i + 1 < SEQ ? ids[mb][q * SEQ + i + 1] : -1;
            }
        for (int mb = 0; mb < 2; mb++) {
            float ls = NAN, l1 = NAN, l2 = NAN;
            TRY(kiln_train_forward_batch(ts, ids[mb], 2, SEQ, tg[mb], KILN_LOSS_MEAN, 0.5f, &ls), "forward_batch");
            TRY(kiln_train_backward(ts, NULL, mb > 0), "backward");
            TRY(kiln_train_step_batch(r1, ids[mb], 2, SEQ, tg[mb], KILN_LOSS_MEAN, 0.5f, mb > 0, &l1), "step_batch 1");
            TRY(kiln_train_step_batch(r2, ids[mb], 2, SEQ, tg[mb], KILN_LOSS_MEAN, 0.5f, mb > 0, &l2), "step_batch 2");
            if (memcmp(&l1, &l2, 4) != 0) {
                fprintf(stderr, "    step %d micro %d: row walk losses %.9g vs %.9g\n", s + 1, mb, (double)l1,
                        (double)l2);
                same = 0;
            }
            const double e = fabs((double)l1 - (double)ls) / fabs((double)ls);
            /* step 1: the same weights, only the statistics' order differs; later the
             * trajectories drift apart as in fast against auditable */
            if (!(e <= (s == 0 ? step1_bound : 1e-3))) loss_bad = 1; /* a NaN too */
            if (e > worst_loss) worst_loss = e;
        }
        if (!read_all(ts, 1, a, total) || !read_all(r1, 1, b, total) || !read_all(r2, 1, c, total)) {
            ok = 0;
            goto done;
        }
        if (first_diff(b, c, total) >= 0) same = 0;
        if (s == 0) worst_grad = grad_ratios(ts, a, b, &bad);
        float n0, n1, n2, c0, c1, c2;
        TRY(kiln_train_clip_grads(ts, 1.0, &n0, &c0), "clip (split)");
        TRY(kiln_train_clip_grads(r1, 1.0, &n1, &c1), "clip (row walk 1)");
        TRY(kiln_train_clip_grads(r2, 1.0, &n2, &c2), "clip (row walk 2)");
        TRY(kiln_train_optimizer_step(ts, LR), "adamw (split)");
        TRY(kiln_train_optimizer_step(r1, LR), "adamw (row walk 1)");
        TRY(kiln_train_optimizer_step(r2, LR), "adamw (row walk 2)");
    }
    if (!read_all(ts, 0, a, total) || !read_all(r1, 0, b, total) || !read_all(r2, 0, c, total)) {
        ok = 0;
        goto done;
    }
    if (first_diff(b, c, total) >= 0) same = 0;
    for (size_t i = 0; i < total; i++) {
        wdiff += ((double)b[i] - a[i]) * ((double)b[i] - a[i]);
        wmove += ((double)a[i] - w0[i]) * ((double)a[i] - w0[i]);
    }
    wdiff = wmove > 0 ? sqrt(wdiff / wmove) : INFINITY;
    if (!same || loss_bad || bad || !(wdiff <= WEIGHT_BOUND)) ok = 0;
done:
    printf("%-22s row walk twice: %s; vs forward_batch + backward over %d steps: max loss rel diff %.3e (bound "
           "%.0e at step 1, 1e-3 after), step-1 grads max rel %.3e (bound %.0e), weights diff/update %.3e (bound %.1f): %s\n",
           logits_f32 ? "step_batch rows f32" : "step_batch row walk", same ? "same bits" : "DIFFER", SB_STEPS,
           worst_loss, step1_bound, worst_grad, GRAD_BOUND, wdiff, WEIGHT_BOUND, ok ? "OK" : "FAIL");
    free(a);
    free(b);
    free(c);
    free(w0);
    kiln_trainer_free(ts);
    kiln_trainer_free(r1);
    kiln_trainer_free(r2);
    kiln_model_close(m);
    return ok;
}

int main(int argc, char **argv) {
    char shared[1024];
    const char *vocab_dir = gpu_vocab_dir(shared, sizeof shared);
    if (argc > 1) vocab_dir = argv[1];
    if (!gpu_make_tmpdir("cuda-train-fast")) return 1;

    /* refusals that need no GPU */
    char tok[1200], cfg[1200];
    snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
    if (access(tok, R_OK) != 0) {
        rmdir(g_tmpdir);
        return gpu_missing_vocab_status(tok);
    }
    if (!write_config("llama", cfg, sizeof cfg)) {
        fprintf(stderr, "FAIL: cannot write a config into %s\n", g_tmpdir);
        rmdir(g_tmpdir);
        return 1;
    }
    kiln_model *m = NULL;
    int ok = kiln_model_create(cfg, tok, 1, &m) == KILN_OK;
    remove(cfg);
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = 16;
    ok &= p.fast == 0 && p.device == -1;
    kiln_trainer *t = NULL;
    p.fast = 1; /* on the CPU: refused */
    ok &= m && kiln_trainer_create(m, &p, &t) == KILN_ERR_UNSUPPORTED && t == NULL &&
          strstr(kiln_last_error(), "fast is a GPU mode") != NULL;
    if (!ok) {
        fprintf(stderr, "FAIL: refusals: %s\n", kiln_last_error());
        kiln_model_close(m);
        rmdir(g_tmpdir);
        return 1;
    }
    p.device = 0;
    kiln_status st_fast = kiln_trainer_create(m, &p, &t);
    kiln_trainer_free(t);
    t = NULL;
    p.fast = 0;
    kiln_status st = kiln_trainer_create(m, &p, &t);
    kiln_trainer_free(t);
    kiln_model_close(m);
    if (st != KILN_OK || st_fast != KILN_OK) {
        /* no GPU: both must be refused clearly */
        int refused = st == KILN_ERR_UNSUPPORTED && st_fast == KILN_ERR_UNSUPPORTED &&
                      strstr(kiln_last_error(), "CUDA") != NULL;
        fprintf(stderr, "no GPU: trainers on device 0 refused: %s\n", kiln_last_error());
        rmdir(g_tmpdir);
        if (!refused) {
            fprintf(stderr, "FAIL: expected KILN_ERR_UNSUPPORTED naming CUDA for both, got %d (fast) and %d\n",
                    st_fast, st);
            return 1;
        }
        return 77;
    }

    int failed = 0;
    failed += !run_case("llama-fast f32", "llama", KILN_STORAGE_F32, vocab_dir);
    failed += !run_case("llama-fast bf16 master", "llama", KILN_STORAGE_BF16_MASTER, vocab_dir);
    failed += !run_case("qwen2-fast f32", "qwen2", KILN_STORAGE_F32, vocab_dir);
    failed += !run_step_batch_case(vocab_dir);
    failed += !run_row_block_case(vocab_dir, 0);
    failed += !run_row_block_case(vocab_dir, 1);
    rmdir(g_tmpdir);
    if (failed) printf("FAILED %d\n", failed);
    else printf("ALL OK\n");
    return failed ? 1 : 0;
}
