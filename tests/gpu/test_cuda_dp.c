/*
 * test_cuda_dp.c -- GPU ranks: the nccl communicator (src/dist/comm_nccl.c) and a GPU trainer
 * as a ZeRO-2 rank over it, with one rank on one GPU (the machines lent have one; the path is
 * N's: every collective goes through NCCL and the rank-order sum kernel, the flat vector
 * through the device staging, chunk by chunk).
 *
 *   1. The communicator alone (kiln_comm_open_nccl on device 0, no launcher: one rank): every
 *      collective on device buffers and on host buffers, sizes 1 .. 100,003 bytes; the sums'
 *      bits (+0.0f + x: -0.0 becomes +0.0, as the rank-order sum from +0 says); argument errors.
 *   2. Training: per case, a plain GPU trainer and a GPU rank (kiln_train_create_rank with the
 *      communicator, ZeRO-2, KILN_DP_CHUNK small so a step crosses many chunks) get the same
 *      batches for 3 steps (kiln_train_step_batch of 2 sequences, then for the rank
 *      kiln_train_dp_reduce_grads, clip_grads(1.0), optimizer_step): every loss, norm and clip
 *      coefficient, and every parameter after each step, bit for bit. Cases: f32 and bf16 +
 *      master (auditable), f32 in fast mode (deterministic, so the same bits too), a tied and an
 *      untied head.
 *   3. The rank's checkpoint (a set of one shard, its optimizer state read from the device) loads
 *      into a CPU trainer, back into the GPU rank and into a plain GPU trainer: their weights and
 *      moments equal the plain GPU trainer's.
 * Without a GPU: exits 77. A GPU without NCCL's library is a failure (the GPU script puts
 * PyTorch's nvidia-nccl on LD_LIBRARY_PATH).
 *   test_cuda_dp [vocab-dir]
 */
#include "base/base.h"
#include "dist/comm.h"
#include "models/model.h"
#include "ops/ops.h"
#include "train/trainer.h"

#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GPU_TEST_SEED 0x6b696c6e44503031ull
#include "gpu_test_models.h"

static int g_fail;
#define CHECK(cond, ...)                                                                             \
    do {                                                                                             \
        if (!(cond)) {                                                                               \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                     \
            fprintf(stderr, __VA_ARGS__);                                                            \
            fprintf(stderr, " [%s]\n", kiln_last_error());                                           \
            g_fail++;                                                                                \
        }                                                                                            \
    } while (0)

/* ---- 1. the communicator ------------------------------------------------------------------- */

static void *dev_alloc(kiln_backend *be, size_t n) { return kiln_backend_alloc(be, n ? n : 1); }

static void check_comm(kiln_backend *be, kiln_comm *c) {
    CHECK(kiln_comm_size(c) == 1 && kiln_comm_rank(c) == 0, "one rank");
    CHECK(!kiln_comm_host_memory(c) && !strcmp(kiln_comm_name(c), "nccl") && kiln_comm_device(c) == 0, "nccl on 0");
    CHECK(kiln_comm_barrier(c) == KILN_OK, "barrier");
    static const size_t sizes[] = {1, 3, 4096, 100003};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const size_t nb = sizes[si], nf = nb; /* bytes, or floats for the sums */
        uint8_t *h = malloc(nb), *h2 = malloc(nb);
        float *fs = malloc(nf * 4), *fr = malloc(nf * 4);
        uint8_t *d1 = dev_alloc(be, nb), *d2 = dev_alloc(be, nb);
        float *df = dev_alloc(be, nf * 4), *dg = dev_alloc(be, nf * 4);
        if (!h || !h2 || !fs || !fr || !d1 || !d2 || !df || !dg) {
            CHECK(0, "out of memory");
            return;
        }
        for (size_t i = 0; i < nb; i++) h[i] = (uint8_t)rnd_u64();
        for (size_t i = 0; i < nf; i++) fs[i] = i % 7 == 3 ? -0.0f : rnd_unit() * 1e3f;
        /* device buffers */
        CHECK(kiln_backend_upload(be, d1, h, nb) == KILN_OK, "upload");
        CHECK(kiln_comm_allgather(c, d2, d1, nb) == KILN_OK, "allgather %zu", nb);
        CHECK(kiln_backend_download(be, h2, d2, nb) == KILN_OK && !memcmp(h, h2, nb), "allgather bytes %zu", nb);
        CHECK(kiln_comm_allgather(c, d1, d1, nb) == KILN_OK, "allgather in place %zu", nb);
        CHECK(kiln_comm_alltoall(c, d2, d1, nb) == KILN_OK, "alltoall %zu", nb);
        CHECK(kiln_backend_download(be, h2, d2, nb) == KILN_OK && !memcmp(h, h2, nb), "alltoall bytes %zu", nb);
        CHECK(kiln_comm_broadcast(c, d2, nb, 0) == KILN_OK, "broadcast %zu", nb);
        CHECK(kiln_backend_download(be, h2, d2, nb) == KILN_OK && !memcmp(h, h2, nb), "broadcast bytes %zu", nb);
        CHECK(kiln_backend_upload(be, df, fs, nf * 4) == KILN_OK, "upload");
        for (int red = 0; red < 2; red++) {
            for (size_t i = 0; i < nf; i++) fr[i] = NAN;
            CHECK(kiln_backend_upload(be, dg, fr, nf * 4) == KILN_OK, "upload");
            if (red == 0) CHECK(kiln_comm_reduce_scatter_f32(c, dg, df, nf) == KILN_OK, "reduce_scatter %zu", nf);
            else CHECK(kiln_comm_reduce_f32(c, dg, df, nf, 0) == KILN_OK, "reduce %zu", nf);
            CHECK(kiln_backend_download(be, fr, dg, nf * 4) == KILN_OK, "download");
            size_t bad = 0;
            for (size_t i = 0; i < nf; i++) {
                const float want = 0.0f + fs[i]; /* -0.0 -> +0.0 */
                if (memcmp(&want, &fr[i], 4)) bad++;
            }
            CHECK(bad == 0, "%s %zu: %zu floats differ from +0 + x", red ? "reduce" : "reduce_scatter", nf, bad);
        }
        /* host buffers (staged through the device) */
        memset(h2, 0, nb);
        CHECK(kiln_comm_allgather(c, h2, h, nb) == KILN_OK && !memcmp(h, h2, nb), "host allgather %zu", nb);
        memset(h2, 0, nb);
        CHECK(kiln_comm_alltoall(c, h2, h, nb) == KILN_OK && !memcmp(h, h2, nb), "host alltoall %zu", nb);
        memcpy(h2, h, nb);
        CHECK(kiln_comm_broadcast(c, h2, nb, 0) == KILN_OK && !memcmp(h, h2, nb), "host broadcast %zu", nb);
        for (size_t i = 0; i < nf; i++) fr[i] = NAN;
        CHECK(kiln_comm_reduce_scatter_f32(c, fr, fs, nf) == KILN_OK, "host reduce_scatter");
        size_t bad = 0;
        for (size_t i = 0; i < nf; i++) {
            const float want = 0.0f + fs[i];
            if (memcmp(&want, &fr[i], 4)) bad++;
        }
        CHECK(bad == 0, "host reduce_scatter %zu: %zu differ", nf, bad);
        free(h);
        free(h2);
        free(fs);
        free(fr);
        kiln_backend_free_buf(be, d1);
        kiln_backend_free_buf(be, d2);
        kiln_backend_free_buf(be, df);
        kiln_backend_free_buf(be, dg);
    }
    double x[3] = {1.5, -0.0, 1e300};
    CHECK(kiln_comm_allreduce_f64(c, x, 3) == KILN_OK && x[0] == 1.5 && !signbit(x[1]) && x[2] == 1e300,
          "allreduce_f64");
    /* argument errors leave it usable */
    CHECK(kiln_comm_broadcast(c, x, 8, 1) == KILN_ERR_INVALID_ARG, "root 1 of 1");
    CHECK(kiln_comm_allgather(c, NULL, x, 8) == KILN_ERR_INVALID_ARG, "NULL recv");
    CHECK(kiln_comm_barrier(c) == KILN_OK, "usable after argument errors");
}

/* ---- 2. a GPU rank against a plain GPU trainer ------------------------------------------------- */

typedef struct dp_case {
    const char *name, *arch;
    int C, L, NH, KVH, HS, FF, V, tied, qwen_vocab;
    kiln_weight_storage storage;
    int fast;
} dp_case;

#define SEQ 16
#define NSEQ 2

static kiln_trainer *make(kiln_model *m, const dp_case *dc, int device, kiln_comm *c) {
    kiln_train_params p = kiln_train_default_params();
    p.max_seq = SEQ;
    p.max_batch = NSEQ;
    p.n_threads = 2;
    p.ce_chunk = 1000;
    p.lr = 2e-3;
    p.weight_decay = 0.1;
    p.weight_storage = dc->storage;
    p.fast = dc->fast;
    p.seed = 11;
    p.device = device;
    kiln_trainer *t = NULL;
    kiln_status st = c ? kiln_train_create_rank(m, &p, c, 2, 0, &t) : kiln_trainer_create(m, &p, &t);
    CHECK(st == KILN_OK, "%s: trainer (device %d, %s)", dc->name, device, c ? "rank" : "plain");
    return st == KILN_OK ? t : NULL;
}

/* parameter i of a and b (or their moments) bit for bit */
static int same_state(kiln_trainer *a, kiln_trainer *b, int moments, const char *when) {
    int n = kiln_train_n_params(a), ok = 1;
    for (int i = 0; i < n && ok; i++) {
        const char *name = NULL;
        int64_t ne = 0;
        if (kiln_train_param_info(a, i, &name, &ne, NULL) != KILN_OK) return 0;
        float *x = malloc((size_t)ne * 8), *y = malloc((size_t)ne * 8);
        if (!x || !y) return 0;
        for (int64_t j = 0; j < 2 * ne; j++) x[j] = y[j] = NAN;
        int64_t ka = -1, kb = -2;
        kiln_status s1 = moments ? kiln_train_get_moments(a, name, x, x + ne, ne, &ka) : kiln_train_get_param(a, name, x, ne);
        kiln_status s2 = moments ? kiln_train_get_moments(b, name, y, y + ne, ne, &kb) : kiln_train_get_param(b, name, y, ne);
        if (moments && s1 == KILN_OK && s2 == KILN_OK && ka != kb) {
            fprintf(stderr, "    %s %s: optimizer steps %lld vs %lld\n", when, name, (long long)ka, (long long)kb);
            ok = 0;
        }
        const size_t nn = (size_t)ne * (moments ? 2 : 1);
        if (s1 != KILN_OK || s2 != KILN_OK) {
            fprintf(stderr, "    %s %s: read failed: %s\n", when, name, kiln_last_error());
            ok = 0;
        }
        for (size_t j = 0; ok && j < nn; j++)
            if (memcmp(&x[j], &y[j], 4)) {
                fprintf(stderr, "    %s %s %s [%zu]: %.9g vs %.9g\n", when, name, moments ? "moments" : "param", j,
                        (double)x[j], (double)y[j]);
                ok = 0;
            }
        free(x);
        free(y);
    }
    return ok;
}

static int run_case(const dp_case *dc, const char *vocab_dir, kiln_comm *c) {
    char cfg[1200], tok[1200];
    snprintf(tok, sizeof tok, "%s/%s", vocab_dir, dc->qwen_vocab ? "ggml-vocab-qwen2.gguf" : "ggml-vocab-llama-spm.gguf");
    if (!gpu_write_config(dc->name, dc->arch, dc->C, dc->L, dc->NH, dc->KVH, dc->HS, dc->FF, dc->V, dc->tied,
                          1000000.0, cfg, sizeof cfg))
        return 0;
    kiln_model *m = NULL;
    if (kiln_model_create(cfg, tok, 5 + (uint64_t)dc->C, &m) != KILN_OK) {
        fprintf(stderr, "FAIL %s: kiln_model_create: %s\n", dc->name, kiln_last_error());
        remove(cfg);
        return 0;
    }
    remove(cfg);
    gpu_randomise_vectors(m);
    const int before = g_fail;
    if (!dc->fast && dc->tied) { /* ZeRO-3 on GPU ranks: refused, saying what to use */
        kiln_train_params p = kiln_train_default_params();
        p.max_seq = SEQ;
        p.device = 0;
        kiln_trainer *t3 = NULL;
        CHECK(kiln_train_create_rank(m, &p, c, 3, 0, &t3) == KILN_ERR_UNSUPPORTED && !t3 &&
                  strstr(kiln_last_error(), "--zero 2"), "%s: ZeRO-3 on a GPU refused", dc->name);
        kiln_trainer_free(t3);
    }
    kiln_trainer *a = make(m, dc, 0, NULL), *b = make(m, dc, 0, c);
    int ok = a && b && kiln_train_dp_size(b) == 1 && kiln_train_dp_stage(b) == 2;
    int32_t ids[NSEQ * SEQ], tg[NSEQ * SEQ];
    for (int s = 0; ok && s < 3; s++) {
        for (int i = 0; i < NSEQ * SEQ; i++) {
            ids[i] = (int32_t)(rnd_u64() % (uint64_t)dc->V);
            tg[i] = i % 5 == 2 ? -1 : (int32_t)(rnd_u64() % (uint64_t)dc->V);
        }
        float la = NAN, lb = NAN, na = NAN, nb = NAN, ca = NAN, cb = NAN;
        const float scale = 1.0f / (NSEQ * SEQ);
        ok &= kiln_train_step_batch(a, ids, NSEQ, SEQ, tg, KILN_LOSS_SUM, scale, 0, &la) == KILN_OK;
        ok &= kiln_train_step_batch(b, ids, NSEQ, SEQ, tg, KILN_LOSS_SUM, scale, 0, &lb) == KILN_OK;
        ok &= kiln_train_dp_reduce_grads(b) == KILN_OK;
        ok &= kiln_train_clip_grads(a, 0.5, &na, &ca) == KILN_OK;
        ok &= kiln_train_clip_grads(b, 0.5, &nb, &cb) == KILN_OK;
        ok &= kiln_train_optimizer_step(a, 2e-3) == KILN_OK;
        ok &= kiln_train_optimizer_step(b, 2e-3) == KILN_OK;
        CHECK(ok, "%s step %d", dc->name, s + 1);
        if (!ok) break;
        if (memcmp(&la, &lb, 4) || memcmp(&na, &nb, 4) || memcmp(&ca, &cb, 4)) {
            CHECK(0, "%s step %d: loss %.9g / %.9g, norm %.9g / %.9g, coef %.9g / %.9g", dc->name, s + 1, (double)la,
                  (double)lb, (double)na, (double)nb, (double)ca, (double)cb);
            ok = 0;
        }
        char when[64];
        snprintf(when, sizeof when, "%s step %d", dc->name, s + 1);
        if (ok && !same_state(a, b, 0, when)) {
            CHECK(0, "%s: weights differ after step %d", dc->name, s + 1);
            ok = 0;
        }
    }
    /* 3. the rank's set of shards into a CPU trainer (auditable cases: the CPU's bits) */
    if (ok && !dc->fast) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s-ckpt", g_tmpdir, dc->name);
        uint64_t step = 0;
        kiln_trainer *h = make(m, dc, -1, NULL);
        ok = h && kiln_train_save(b, dir, 3, "{}", 0) == KILN_OK;
        CHECK(ok, "%s: the rank's save", dc->name);
        if (ok) ok = kiln_train_load(h, dir, &step, NULL) == KILN_OK && step == 3;
        CHECK(ok, "%s: the set loads on the CPU", dc->name);
        if (ok) CHECK(same_state(a, h, 0, "loaded weights") && same_state(a, h, 1, "loaded moments"),
                      "%s: the CPU trainer holds what the GPU ranks saved", dc->name);
        /* the set loads back into the GPU rank (a resume: its range's state uploaded, the weights
         * gathered) and into a plain GPU trainer (each slot's state uploaded once) */
        if (ok) {
            ok = kiln_train_load(b, dir, &step, NULL) == KILN_OK && step == 3;
            CHECK(ok, "%s: the GPU rank loads its set: %s", dc->name, kiln_last_error());
            if (ok) CHECK(same_state(a, b, 0, "the rank's loaded weights"), "%s: the rank's weights after its load",
                          dc->name);
            kiln_trainer *g = ok ? make(m, dc, 0, NULL) : NULL;
            ok = g && kiln_train_load(g, dir, &step, NULL) == KILN_OK && step == 3;
            CHECK(ok, "%s: the set loads into a plain GPU trainer: %s", dc->name, kiln_last_error());
            if (ok) CHECK(same_state(a, g, 0, "GPU-loaded weights") && same_state(a, g, 1, "GPU-loaded moments"),
                          "%s: the GPU trainer holds what the GPU ranks saved", dc->name);
            kiln_trainer_free(g);
        }
        /* one more step and a second save: the rank's state read anew (not the first save's) */
        float la = 0, lb = 0;
        if (ok)
            ok = kiln_train_step_batch(a, ids, NSEQ, SEQ, tg, KILN_LOSS_SUM, 1.0f / (NSEQ * SEQ), 0, &la) == KILN_OK &&
                 kiln_train_step_batch(b, ids, NSEQ, SEQ, tg, KILN_LOSS_SUM, 1.0f / (NSEQ * SEQ), 0, &lb) == KILN_OK &&
                 kiln_train_dp_reduce_grads(b) == KILN_OK && kiln_train_optimizer_step(a, 2e-3) == KILN_OK &&
                 kiln_train_optimizer_step(b, 2e-3) == KILN_OK && kiln_train_save(b, dir, 4, "{}", 0) == KILN_OK;
        CHECK(ok, "%s: step 4 and the second save", dc->name);
        kiln_trainer *h2 = ok ? make(m, dc, -1, NULL) : NULL;
        if (h2) {
            ok = kiln_train_load(h2, dir, &step, NULL) == KILN_OK && step == 4;
            CHECK(ok, "%s: the second set loads on the CPU", dc->name);
            if (ok) CHECK(same_state(a, h2, 0, "second save's weights") && same_state(a, h2, 1, "second save's moments"),
                          "%s: the second save holds step 4's state", dc->name);
            kiln_trainer_free(h2);
        }
        kiln_trainer_free(h);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "    could not remove %s\n", dir);
    }
    kiln_trainer_free(a);
    kiln_trainer_free(b);
    kiln_model_close(m);
    const int pass = ok && g_fail == before;
    printf("%-28s %s\n", dc->name, pass ? "ok" : "FAILED");
    return pass;
}

int main(int argc, char **argv) {
    char shared[1024];
    const char *vocab_dir = argc > 1 ? argv[1] : gpu_vocab_dir(shared, sizeof shared);
    setvbuf(stdout, NULL, _IOLBF, 0);
    kiln_backend *be = NULL;
    if (kiln_backend_cuda_create(0, &be) != KILN_OK) {
        fprintf(stderr, "no GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }
    /* no launcher: one rank */
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                                       "PMIX_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
    kiln_comm *c = NULL;
    if (kiln_comm_open_nccl(0, &c) != KILN_OK) {
        fprintf(stderr, "FAIL: kiln_comm_open_nccl: %s\n", kiln_last_error());
        kiln_backend_free(be);
        return 1;
    }
    /* the collectives on the backend's stream, as a trainer's rank queues them (on the
     * communicator's own stream, the backend's downloads would not wait for them) */
    CHECK(kiln_comm_set_stream(c, be->i->native_stream(be)) == KILN_OK, "set_stream");
    check_comm(be, c);
    CHECK(kiln_comm_set_stream(c, NULL) == KILN_OK, "set_stream NULL");
    kiln_backend_free(be);
    printf("%-28s %s\n", "nccl communicator", g_fail ? "FAILED" : "ok");

    char tok[1200];
    snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
    if (access(tok, R_OK) != 0) {
        kiln_comm_close(c);
        return gpu_missing_vocab_status(tok);
    }
    if (!gpu_make_tmpdir("cuda-dp")) return 1;
    setenv("KILN_DP_CHUNK", "1000", 1); /* a step crosses many chunks, and tensors cut by them */
    static const dp_case cases[] = {
        {"llama-tied-f32", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_F32, 0},
        {"qwen3-untied-bf16m", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, KILN_STORAGE_BF16_MASTER, 0},
        {"llama-tied-f32-fast", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, KILN_STORAGE_F32, 1},
        {"qwen3-untied-bf16m-fast", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, KILN_STORAGE_BF16_MASTER, 1},
    };
    int failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) failed += !run_case(&cases[i], vocab_dir, c);
    kiln_comm_close(c);
    rmdir(g_tmpdir);
    if (failed || g_fail) {
        printf("FAILED %d\n", failed + (g_fail && !failed));
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
