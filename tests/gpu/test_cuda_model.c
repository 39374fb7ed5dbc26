/*
 * test_cuda_model.c -- whole models through the public API on the CUDA backend
 * (kiln_context_params.device = 0) against the CPU backend (device = -1), bit for bit.
 *
 * Random models from kiln_model_create on small config.json files written here: a tiny
 * llama, a qwen2 (q/k/v biases), a qwen3 (per-head q/k norms, untied head), with the layer
 * matrices also converted to bf16 and Q8_0, and one real-shaped model (Qwen2.5-0.5B: 896
 * wide, 24 layers, 14/2 heads, ff 4864, vocab 151936; about 2 GB of f32 weights), and a tiny
 * Gemma 3 (GeGLU, (1 + w) pre- and post-norms, sliding window 8, f32 and Q8_0), and cases of
 * these in the exact formats (kiln_context_params.format mx16 / mx8). The
 * norms and biases are randomised (kiln_model_create makes them 1 and 0) so that their
 * upload is tested. Per model: a prefill of 20 tokens with every row of logits, 8 cached
 * greedy decode steps, then a truncate and re-decode; the logits of the two contexts must
 * have the same bits (memcmp) and the greedy ids must agree. Prints a table last (model,
 * logits compared, differing, decode ms/token on the CPU and the GPU).
 *
 * Without a usable GPU it checks that a context with device = 0 is refused with
 * KILN_ERR_UNSUPPORTED and a message, then exits 77 (skipped).
 *   test_cuda_model [vocab-dir] [--no-big] [--only SUBSTR]
 * vocab-dir holds ggml-vocab-llama-spm.gguf and ggml-vocab-qwen2.gguf (default
 * $KILN_VOCAB_DIR, $KILN_SHARED_DIR/testdata/tokenizer-vectors, or the source tree's
 * ../shared/testdata/tokenizer-vectors).
 */
#include "base/base.h"
#include "base/tensor.h"
#include "models/model.h"

#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define GPU_TEST_SEED 0x6b696c6e4d4f444cull
#include "gpu_test_models.h"

typedef struct model_case {
    const char *name, *arch;
    int C, L, NH, KVH, HS, FF, V, tied, qwen_vocab, n_batch;
    kiln_dtype wtype; /* layer matrices converted to this type (F32: as created) */
    int big;
    int format; /* kiln_context_params.format on both contexts */
} model_case;

typedef struct result {
    char name[64];
    size_t compared, differing;
    int ids_equal;
    double cpu_ms, gpu_ms; /* per decode step */
} result;

static int write_config(const model_case *mc, char *path, size_t cap) {
    return gpu_write_config(mc->name, mc->arch, mc->C, mc->L, mc->NH, mc->KVH, mc->HS, mc->FF,
                            mc->V, mc->tied, 1000000.0, path, cap);
}

/* A copy of the f32 matrix t as bf16 or Q8_0 (scale a power of two, so it is exact in f16). */
static kiln_tensor *convert(const kiln_tensor *t, kiln_dtype to, void **data_out) {
    int64_t n = kiln_tensor_nelements(t);
    const float *src = t->data;
    kiln_tensor *o = malloc(sizeof *o);
    *o = *t;
    o->dtype = to;
    if (to == KILN_DTYPE_BF16) {
        uint16_t *d = malloc((size_t)n * 2);
        for (int64_t i = 0; i < n; i++) d[i] = kiln_fp32_to_bf16(src[i]);
        o->data = d;
        o->nbytes = (size_t)n * 2;
    } else { /* Q8_0: 34-byte blocks {f16 d, int8 q[32]} */
        unsigned char *d = malloc((size_t)(n / 32) * 34);
        for (int64_t b = 0; b < n / 32; b++) {
            float amax = 0;
            for (int i = 0; i < 32; i++) {
                float a = src[b * 32 + i] < 0 ? -src[b * 32 + i] : src[b * 32 + i];
                if (a > amax) amax = a;
            }
            float sc = 0x1p-20f;
            while (sc * 127.0f < amax) sc *= 2.0f;
            uint16_t h = kiln_fp32_to_fp16(sc);
            memcpy(d + b * 34, &h, 2);
            for (int i = 0; i < 32; i++) {
                float q = src[b * 32 + i] / sc;
                int qi = (int)(q < 0 ? q - 0.5f : q + 0.5f);
                signed char s = (signed char)(qi > 127 ? 127 : qi < -127 ? -127 : qi);
                memcpy(d + b * 34 + 2 + i, &s, 1);
            }
        }
        o->data = d;
        o->nbytes = (size_t)(n / 32) * 34;
    }
    *data_out = (void *)o->data;
    return o;
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static size_t count_diff(const float *a, const float *b, size_t n) {
    size_t d = 0;
    for (size_t i = 0; i < n; i++) d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

static int run_case(const model_case *mc, const char *vocab_dir, result *r) {
    char cfg[1200], tok[1200];
    snprintf(r->name, sizeof r->name, "%s", mc->name);
    if (!write_config(mc, cfg, sizeof cfg)) {
        fprintf(stderr, "FAIL %s: cannot write %s\n", mc->name, cfg);
        return 0;
    }
    snprintf(tok, sizeof tok, "%s/%s", vocab_dir,
             mc->qwen_vocab ? "ggml-vocab-qwen2.gguf" : "ggml-vocab-llama-spm.gguf");
    double t0 = now_s();
    kiln_model *m = NULL;
    kiln_status st = kiln_model_create(cfg, tok, 1234 + (uint64_t)mc->C, &m);
    if (st != KILN_OK) {
        fprintf(stderr, "FAIL %s: kiln_model_create: %s\n", mc->name, kiln_last_error());
        return 0;
    }
    gpu_randomise_vectors(m);
    /* converted layer matrices (freed after the model and the contexts) */
    int L = m->cfg.n_layer, nconv = 0, NR = m->arch->n_layer_roles;
    void **bufs = calloc((size_t)L * NR + 1, sizeof *bufs);
    kiln_tensor **convs = calloc((size_t)L * NR + 1, sizeof *convs);
    if (mc->wtype != KILN_DTYPE_F32) { /* every layer matrix */
        for (int i = 0; i < L * NR; i++) {
            kiln_wref *w = &m->layer_refs[i];
            if (!w->mat) continue;
            convs[nconv] = convert(w->mat, mc->wtype, &bufs[nconv]);
            w->mat = convs[nconv++];
        }
    }
    fprintf(stderr, "%s: model made in %.1f s\n", mc->name, now_s() - t0);

    int V = m->cfg.n_vocab, n_prompt = 20, n_steps = 8, ok = 1;
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = 64;
    cp.n_batch = mc->n_batch;
    cp.format = mc->format;
    kiln_context *cc = NULL, *gc = NULL;
    st = kiln_context_create(m, &cp, &cc);
    if (st == KILN_OK) {
        cp.device = 0;
        st = kiln_context_create(m, &cp, &gc);
    }
    float *lc = malloc((size_t)n_prompt * V * sizeof(float));
    float *lg = malloc((size_t)n_prompt * V * sizeof(float));
    if (st != KILN_OK || !lc || !lg) {
        fprintf(stderr, "FAIL %s: context: %s\n", mc->name, kiln_last_error());
        ok = 0;
        goto done;
    }
    int32_t ids[64];
    int tv = V < 32000 ? V : 32000;
    for (int i = 0; i < n_prompt; i++) ids[i] = (int32_t)(rnd_u64() % (uint64_t)tv);
    for (size_t i = 0; i < (size_t)n_prompt * V; i++) lg[i] = NAN; /* NaN: unwritten fails */

    /* prefill, every row */
    ok &= kiln_decode(cc, ids, n_prompt, 1, lc) == KILN_OK;
    ok &= kiln_decode(gc, ids, n_prompt, 1, lg) == KILN_OK;
    if (!ok) fprintf(stderr, "FAIL %s: prefill: %s\n", mc->name, kiln_last_error());
    r->compared += (size_t)n_prompt * V;
    r->differing += count_diff(lc, lg, (size_t)n_prompt * V);
    for (int i = 0; i < n_prompt; i++)
        if (count_diff(lc + (size_t)i * V, lg + (size_t)i * V, (size_t)V))
            fprintf(stderr, "  %s: prefill row %d differs\n", mc->name, i);
    r->ids_equal = 1;
    int next = argmax(lc + (size_t)(n_prompt - 1) * V, V);
    r->ids_equal &= next == argmax(lg + (size_t)(n_prompt - 1) * V, V);

    /* cached greedy decode, timed per backend */
    double tc = 0, tg = 0;
    for (int s = 0; s < n_steps && ok; s++) {
        int32_t id = next;
        ids[n_prompt + s] = id;
        double a = now_s();
        ok &= kiln_decode(cc, &id, 1, 0, lc) == KILN_OK;
        double b = now_s();
        ok &= kiln_decode(gc, &id, 1, 0, lg) == KILN_OK;
        tg += now_s() - b;
        tc += b - a;
        r->compared += (size_t)V;
        size_t d = count_diff(lc, lg, (size_t)V);
        r->differing += d;
        if (d) fprintf(stderr, "  %s: decode step %d differs (%zu logits)\n", mc->name, s, d);
        next = argmax(lc, V);
        r->ids_equal &= next == argmax(lg, V);
    }
    r->cpu_ms = tc * 1e3 / n_steps;
    r->gpu_ms = tg * 1e3 / n_steps;

    /* truncate and re-run the last 5 positions (overwrites the cache rows), every row; a
     * recurrent state (Qwen3.5) cannot go back but to 0 (refused, then from the start) */
    int keep = n_prompt + n_steps - 5;
    if (!strcmp(mc->arch, "qwen3_5_text")) {
        ok &= kiln_context_truncate(gc, keep) == KILN_ERR_UNSUPPORTED;
        keep = 0;
    }
    ok &= kiln_context_truncate(cc, keep) == KILN_OK && kiln_context_truncate(gc, keep) == KILN_OK;
    ok &= kiln_decode(cc, ids + keep, 5, 1, lc) == KILN_OK;
    ok &= kiln_decode(gc, ids + keep, 5, 1, lg) == KILN_OK;
    r->compared += (size_t)5 * V;
    r->differing += count_diff(lc, lg, (size_t)5 * V);
    /* no logits asked: the cache still advances on both */
    ok &= kiln_decode(gc, ids, 1, 0, NULL) == KILN_OK && kiln_context_n_past(gc) == keep + 6;
    if (!ok) fprintf(stderr, "FAIL %s: decode: %s\n", mc->name, kiln_last_error());

done:
    kiln_context_free(cc);
    kiln_context_free(gc);
    kiln_model_close(m);
    for (int i = 0; i < nconv; i++) {
        free(bufs[i]);
        free(convs[i]);
    }
    free(bufs);
    free(convs);
    free(lc);
    free(lg);
    return ok && r->differing == 0 && r->ids_equal;
}

int main(int argc, char **argv) {
    char shared[1024];
    const char *vocab_dir = gpu_vocab_dir(shared, sizeof shared);
    int big = 1;
    const char *only = NULL; /* --only SUBSTR: the cases whose name holds it */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-big")) big = 0;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else vocab_dir = argv[i];
    }
    if (!gpu_make_tmpdir("cuda-model")) return 1;
    static const model_case cases[] = {
        {"llama-tiny", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, 512, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        {"llama-tiny-q8_0", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, 512, KILN_DTYPE_Q8_0, 0, KILN_FORMAT_F32},
        {"qwen2-bias-b7", "qwen2", 96, 3, 6, 2, 16, 224, 151936, 1, 1, 7, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        {"qwen3-qknorm", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, 512, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        {"qwen3-qknorm-bf16", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, 512, KILN_DTYPE_BF16, 0, KILN_FORMAT_F32},
        {"qwen2.5-0.5b-shape", "qwen2", 896, 24, 14, 2, 64, 4864, 151936, 1, 1, 512, KILN_DTYPE_F32, 1, KILN_FORMAT_F32},
        /* Gemma 3: GeGLU, (1 + w) pre- and post-norms, a sliding window of 8 the 28 positions
         * cross, one full layer in three */
        {"gemma3-tiny", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 512, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        {"gemma3-tiny-q8_0", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 5, KILN_DTYPE_Q8_0, 0, KILN_FORMAT_F32},
        /* Qwen3.5: Gated DeltaNet layers with their recurrent state around gated attention */
        {"qwen35-tiny", "qwen3_5_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 512, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        {"qwen35-tiny-b5", "qwen3_5_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 5, KILN_DTYPE_F32, 0, KILN_FORMAT_F32},
        /* the exact formats: every product on the int8 tensor cores, the CPU's bits */
        {"llama-tiny-mx16", "llama", 64, 2, 4, 2, 16, 160, 32000, 1, 0, 512, KILN_DTYPE_F32, 0, KILN_FORMAT_MX16},
        {"qwen2-bias-b7-mx8", "qwen2", 96, 3, 6, 2, 16, 224, 151936, 1, 1, 7, KILN_DTYPE_F32, 0, KILN_FORMAT_MX8},
        {"qwen3-qknorm-bf16-mx16", "qwen3", 128, 2, 4, 2, 48, 256, 151936, 0, 1, 512, KILN_DTYPE_BF16, 0,
         KILN_FORMAT_MX16},
        {"gemma3-tiny-q8_0-mx8", "gemma3_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 5, KILN_DTYPE_Q8_0, 0,
         KILN_FORMAT_MX8},
        {"qwen35-tiny-mx16", "qwen3_5_text", 64, 3, 4, 2, 16, 128, 32000, 1, 0, 512, KILN_DTYPE_F32, 0,
         KILN_FORMAT_MX16},
        {"qwen2.5-0.5b-shape-mx8", "qwen2", 896, 24, 14, 2, 64, 4864, 151936, 1, 1, 512, KILN_DTYPE_F32, 1,
         KILN_FORMAT_MX8},
    };
    int n_cases = (int)(sizeof cases / sizeof cases[0]);

    kiln_backend *be = NULL;
    kiln_status st = kiln_backend_cuda_create(0, &be);
    if (st != KILN_OK) {
        /* no GPU: a context on device 0 must be refused clearly, like the backend */
        int ok = st == KILN_ERR_UNSUPPORTED;
        char cfg[1200], tok[1200];
        snprintf(tok, sizeof tok, "%s/ggml-vocab-llama-spm.gguf", vocab_dir);
        if (access(tok, R_OK) == 0 && write_config(&cases[0], cfg, sizeof cfg)) {
            kiln_model *m = NULL;
            kiln_context *c = NULL;
            ok &= kiln_model_create(cfg, tok, 1, &m) == KILN_OK;
            kiln_context_params cp = kiln_context_default_params();
            cp.n_ctx = 16;
            cp.device = 0;
            if (ok) st = kiln_context_create(m, &cp, &c);
            ok &= st == KILN_ERR_UNSUPPORTED && c == NULL && strstr(kiln_last_error(), "CUDA") != NULL;
            fprintf(stderr, "no GPU: context on device 0 refused: %s\n", kiln_last_error());
            kiln_model_close(m);
            remove(cfg);
        }
        rmdir(g_tmpdir);
        if (!ok) {
            fprintf(stderr, "FAIL: expected KILN_ERR_UNSUPPORTED naming CUDA, got %d\n", st);
            return 1;
        }
        return 77;
    }
    kiln_backend_free(be);

    result res[sizeof cases / sizeof cases[0]];
    memset(res, 0, sizeof res);
    int all_ok = 1, n_run = 0;
    for (int i = 0; i < n_cases; i++) {
        if ((cases[i].big && !big) || (only && !strstr(cases[i].name, only))) continue;
        int ok = run_case(&cases[i], vocab_dir, &res[n_run]);
        fprintf(stderr, "%s %s\n", ok ? "ok  " : "FAIL", cases[i].name);
        all_ok &= ok;
        n_run++;
        char p[600];
        snprintf(p, sizeof p, "%s/%s.json", g_tmpdir, cases[i].name);
        remove(p);
    }
    rmdir(g_tmpdir);
    printf("model | logits compared | differing bits | greedy ids equal | decode ms/token cpu | cuda\n");
    for (int i = 0; i < n_run; i++)
        printf("%s | %zu | %zu | %s | %.2f | %.2f\n", res[i].name, res[i].compared, res[i].differing,
               res[i].ids_equal ? "yes" : "NO", res[i].cpu_ms, res[i].gpu_ms);
    printf("%s\n", all_ok ? "ALL MODELS BIT-IDENTICAL" : "FAILED");
    return all_ok ? 0 : 1;
}
