/*
 * test_cuda_products_mixed.c -- ops.h's products on the CUDA backend when the products of one
 * input have weights of different dtypes, as a GGUF Q4_K_M layer's q/k/v do (q and k Q4_K, v
 * Q6_K in a third of the layers; Q5_0 / Q8_0 where rows are not a multiple of 256): the
 * backend launches one fused product a dtype, each with the RMSNorm in its prologue, instead
 * of a standalone rmsnorm and a launch a product. The results must be the composition's bits:
 *   - auditable mode: the CPU backend's products (the CPU's bits), bit for bit;
 *   - fast mode: the CUDA backend's own composition (rmsnorm, then one matmul a product with
 *     its bias, then the residual add), bit for bit.
 * Mixes (Q4_K, Q4_K, Q6_K), (Q5_0, Q5_0, Q8_0), (Q8_0, Q4_K, Q8_0: the groups' order), each
 * with and without biases and residuals (ops.h: a residual never overlaps its output), N 1, 3,
 * 8 and 11 (fast mode past 8 tokens takes the composition itself). Every output starts as NaN bits. Without a
 * usable GPU it exits 77.
 */
#include "base/base.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "ops/ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t g_rng = 0x6d69786564507231ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_unit(void) { return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0); }

static int g_failed, g_cases;

enum { C = 256, NP = 3, MAXN = 11 };
static const int64_t g_rows[NP] = {128, 32, 32}; /* q, k, v */

/* R x C random blocks of dt with small positive f16 scales (the d fields). */
static uint8_t *random_blocks(kiln_dtype dt, int64_t R, size_t *nbytes) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    const size_t ts = (size_t)tr->type_size, nb = (size_t)R * (size_t)(C / tr->block_size) * ts;
    uint8_t *w = malloc(nb);
    for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd_u64();
    for (size_t b = 0; b < nb / ts; b++) {
        uint8_t *p = w + b * ts;
        const uint16_t h = kiln_fp32_to_fp16(0.002f + 0.004f * (rnd_unit() * 0.5f + 0.5f));
        switch (dt) {
        case KILN_DTYPE_Q8_0: case KILN_DTYPE_Q5_0: memcpy(p, &h, 2); break;
        case KILN_DTYPE_Q4_K: memcpy(p, &h, 2); memcpy(p + 2, &h, 2); break;
        case KILN_DTYPE_Q6_K: memcpy(p + 208, &h, 2); break;
        default: break;
        }
    }
    *nbytes = nb;
    return w;
}

static float *dev_upload(kiln_backend *be, const float *h, size_t n) {
    float *p = kiln_backend_alloc(be, n * sizeof(float));
    if (!p || kiln_backend_upload(be, p, h, n * sizeof(float)) != KILN_OK) {
        fprintf(stderr, "device buffer: %s\n", kiln_last_error());
        exit(1);
    }
    return p;
}

/* The inputs of one case, on the host. */
typedef struct {
    float x[MAXN * C], nw[C], bias[NP][128], res[NP][MAXN * 128];
} inputs;

/* ops.h's products of the case on be (inputs uploaded to its memory), the outputs downloaded
 * into got[p] (N x R_p). compose: the
 * composition by hand (rmsnorm, matmul with bias, add) instead of kiln_op_products. */
static int run(kiln_backend *be, const inputs *in, const kiln_tensor *W, int N, int biases,
               int residuals, int compose, float *const *got) {
    size_t total = (size_t)N * C + C + NP * 128 + 4 * (size_t)N * 128 * NP + 3 * (size_t)N * 128;
    float *h = malloc(total * sizeof(float));
    float *x = h, *nw = x + (size_t)N * C, *b = nw + C, *res = b + NP * 128, *out = res + (size_t)NP * N * 128;
    memcpy(x, in->x, (size_t)N * C * sizeof(float));
    memcpy(nw, in->nw, sizeof in->nw);
    for (int p = 0; p < NP; p++) {
        memcpy(b + p * 128, in->bias[p], 128 * sizeof(float));
        memcpy(res + (size_t)p * N * 128, in->res[p], (size_t)N * 128 * sizeof(float));
    }
    uint32_t nan_bits = 0x7fc00001u;
    for (size_t i = 0; i < (size_t)NP * N * 128; i++) memcpy(out + i, &nan_bits, 4);
    float *d = dev_upload(be, h, total);
    float *dx = d, *dnw = dx + (size_t)N * C, *db = dnw + C, *dres = db + NP * 128, *dout = dres + (size_t)NP * N * 128,
          *dscr = dout + (size_t)NP * N * 128;
    float *outs[NP];
    const float *bs[NP], *rs[NP];
    const kiln_tensor *ws[NP];
    for (int p = 0; p < NP; p++) {
        outs[p] = dout + (size_t)p * N * 128;
        bs[p] = biases ? db + p * 128 : NULL;
        rs[p] = residuals ? dres + (size_t)p * N * 128 : NULL;
        ws[p] = &W[p];
    }
    if (compose) {
        be->i->rmsnorm(be, dscr, dx, dnw, N, C, 1e-6f);
        for (int p = 0; p < NP; p++) {
            be->i->matmul(be, outs[p], dscr, ws[p], bs[p], N);
            if (rs[p]) be->i->add(be, outs[p], rs[p], (size_t)N * (size_t)g_rows[p]);
        }
    } else {
        kiln_products pr;
        memset(&pr, 0, sizeof pr);
        pr.n = NP;
        pr.out = outs;
        pr.res = residuals ? rs : NULL;
        pr.W = ws;
        pr.bias = biases ? bs : NULL;
        pr.norm_w = dnw;
        pr.eps = 1e-6f;
        pr.scratch_x = dscr;
        kiln_op_products(be, dx, &pr, N);
    }
    int ok = kiln_backend_status(be) == KILN_OK;
    for (int p = 0; ok && p < NP; p++) {
        const size_t n = (size_t)N * (size_t)g_rows[p];
        ok = kiln_backend_download(be, got[p], outs[p], n * sizeof(float)) == KILN_OK;
    }
    if (!ok) fprintf(stderr, "products: %s\n", kiln_last_error());
    kiln_backend_free_buf(be, d);
    free(h);
    return ok;
}

int main(int argc, char **argv) {
    if (argc > 1) g_rng = strtoull(argv[1], NULL, 0);
    kiln_backend *cpu = NULL, *aud = NULL, *fast = NULL;
    if (kiln_backend_acquire(0, KILN_MODE_AUDITABLE, 0, &aud) != KILN_OK) {
        fprintf(stderr, "no usable CUDA device (%s): skipped\n", kiln_last_error());
        return 77;
    }
    if (kiln_backend_acquire(0, KILN_MODE_FAST, 0, &fast) != KILN_OK ||
        kiln_backend_acquire(-1, KILN_MODE_AUDITABLE, 2, &cpu) != KILN_OK) {
        fprintf(stderr, "backends: %s\n", kiln_last_error());
        return 1;
    }
    static const kiln_dtype mixes[][NP] = {{KILN_DTYPE_Q4_K, KILN_DTYPE_Q4_K, KILN_DTYPE_Q6_K},
                                           {KILN_DTYPE_Q5_0, KILN_DTYPE_Q5_0, KILN_DTYPE_Q8_0},
                                           {KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_K, KILN_DTYPE_Q8_0}};
    static const int Ns[] = {1, 3, 8, 11};
    static inputs in;
    float *want[NP], *got[NP];
    for (int p = 0; p < NP; p++) {
        want[p] = malloc((size_t)MAXN * 128 * sizeof(float));
        got[p] = malloc((size_t)MAXN * 128 * sizeof(float));
    }
    for (size_t m = 0; m < sizeof mixes / sizeof mixes[0]; m++) {
        kiln_tensor W[NP];
        uint8_t *wd[NP];
        for (int p = 0; p < NP; p++) {
            memset(&W[p], 0, sizeof W[p]);
            wd[p] = random_blocks(mixes[m][p], g_rows[p], &W[p].nbytes);
            W[p].name = "mixed";
            W[p].dtype = mixes[m][p];
            W[p].n_dims = 2;
            W[p].shape[0] = g_rows[p];
            W[p].shape[1] = C;
            W[p].data = wd[p];
        }
        for (size_t k = 0; k < sizeof Ns / sizeof Ns[0]; k++)
            for (int v = 0; v < 4; v++) {
                const int N = Ns[k], biases = v & 1, residuals = v >> 1;
                for (size_t i = 0; i < (size_t)N * C; i++) in.x[i] = 2.0f * rnd_unit();
                for (int i = 0; i < C; i++) in.nw[i] = 1.0f + 0.1f * rnd_unit();
                for (int p = 0; p < NP; p++) {
                    for (int i = 0; i < 128; i++) in.bias[p][i] = rnd_unit();
                    for (int i = 0; i < N * 128; i++) in.res[p][i] = rnd_unit();
                }
                for (int mode = 0; mode < 2; mode++) {
                    kiln_backend *ref = mode ? fast : cpu, *be = mode ? fast : aud;
                    if (!run(ref, &in, W, N, biases, residuals, mode, want) ||
                        !run(be, &in, W, N, biases, residuals, 0, got)) {
                        g_failed++;
                        continue;
                    }
                    long bad = 0, n = 0;
                    for (int p = 0; p < NP; p++)
                        for (int64_t i = 0; i < N * g_rows[p]; i++, n++)
                            bad += memcmp(&want[p][i], &got[p][i], 4) != 0;
                    g_cases++;
                    if (bad) {
                        g_failed++;
                        fprintf(stderr, "FAIL %s mix %zu N %d bias %d residual %d: %ld of %ld differ\n",
                                mode ? "fast (vs the composition)" : "auditable (vs the CPU)", m, N, biases,
                                residuals, bad, n);
                    }
                }
            }
        for (int p = 0; p < NP; p++) {
            kiln_backends_forget(wd[p], W[p].nbytes);
            free(wd[p]);
        }
    }
    for (int p = 0; p < NP; p++) {
        free(want[p]);
        free(got[p]);
    }
    kiln_backend_release(cpu);
    kiln_backend_release(aud);
    kiln_backend_release(fast);
    printf("%d cases, %d failed\n%s\n", g_cases, g_failed, g_failed ? "FAILED" : "ALL BIT-IDENTICAL");
    return g_failed ? 1 : 0;
}
