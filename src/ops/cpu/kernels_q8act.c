/*
 * kernels_q8act.c -- the fast mode's int8-activation matmul in plain C: the reference of
 * docs/ARITHMETIC.md, "Fast mode: 8-bit activations". kernels_q8act_avx2.c must equal it
 * bit for bit (tests/c/test_ops_fast.c).
 */
#include "kernels_q8act.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* Blocks whose absmax is below this quantize to zero (keeps 127 / absmax finite). */
#define Q8ACT_TINY 0x1p-96f

size_t kiln_q8act_bytes(int N, int64_t C) {
    if (N < 0 || C < 0) return 0;
    uint64_t nbp = (uint64_t)(C / 32 + KILN_Q8ACT_LANES - 1) / KILN_Q8ACT_LANES * KILN_Q8ACT_LANES;
    uint64_t per_block = 32 + 3 * 4; /* q, d, s, sum */
    uint64_t n = 0;
    if (kiln_mul_overflow_u64(nbp, per_block, &n) || kiln_mul_overflow_u64(n, (uint64_t)N, &n) ||
        n > SIZE_MAX)
        return 0;
    return (size_t)n;
}

void kiln_q8act_init(kiln_q8act *qa, void *buf, int N, int64_t C) {
    qa->N = N;
    qa->nb = C / 32;
    qa->nbp = (qa->nb + KILN_Q8ACT_LANES - 1) / KILN_Q8ACT_LANES * KILN_Q8ACT_LANES;
    size_t nblk = (size_t)N * (size_t)qa->nbp;
    uint8_t *p = buf;
    qa->q = (int8_t *)p;                 /* nblk*32 bytes: keeps the arrays below aligned */
    qa->d = (float *)(p + nblk * 32);
    qa->s = qa->d + nblk;
    qa->sum = (int32_t *)(qa->s + nblk);
}

bool kiln_q8act_supports(kiln_dtype t) {
    return t == KILN_DTYPE_Q8_0 || t == KILN_DTYPE_Q4_0 || t == KILN_DTYPE_Q4_1;
}

/* ---- quantization of the activations ------------------------------------------------------ */

static void quantize_block_ref(const float *x, int8_t *q, float *d, float *s, int32_t *sum) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < 32; i++) {
        float a = fabsf(x[i]);
        if (!(a <= FLT_MAX)) finite = 0;
        else if (a > amax) amax = a;
    }
    memset(q, 0, 32);
    *sum = 0;
    if (!finite) {
        *d = *s = NAN;
        return;
    }
    if (amax < Q8ACT_TINY) {
        *d = *s = 0.0f;
        return;
    }
    float dx = amax / 127.0f, inv = 127.0f / amax;
    int32_t acc = 0;
    for (int i = 0; i < 32; i++) {
        float v = rintf(x[i] * inv); /* round half to even (the default rounding mode) */
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
        acc += q[i];
    }
    *d = dx;
    *sum = acc;
    *s = dx * (float)acc;
}

static void p_quantize(kiln_q8act *qa, const float *x, int64_t ldx) {
    for (int t = 0; t < qa->N; t++) {
        size_t o = (size_t)t * (size_t)qa->nbp;
        for (int64_t b = 0; b < qa->nbp; b++) {
            if (b < qa->nb) {
                quantize_block_ref(x + t * ldx + b * 32, qa->q + (o + b) * 32, qa->d + o + b,
                                   qa->s + o + b, qa->sum + o + b);
            } else {
                memset(qa->q + (o + b) * 32, 0, 32);
                qa->d[o + b] = qa->s[o + b] = 0.0f;
                qa->sum[o + b] = 0;
            }
        }
    }
}

/* ---- the dot of one row with one token ---------------------------------------------------- */

static float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kiln_fp16_to_fp32(h);
}

/* The fixed tree over the 8 lanes. */
static float lane8_reduce(const float acc[KILN_Q8ACT_LANES]) {
    float s4[4], s2[2];
    for (int j = 0; j < 4; j++) s4[j] = acc[j] + acc[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    return s2[0] + s2[1];
}

static float dot_row_ref(const kiln_q8act *qa, int t, const uint8_t *row, kiln_dtype dt) {
    float acc[KILN_Q8ACT_LANES] = {0};
    size_t o = (size_t)t * (size_t)qa->nbp;
    for (int64_t b = 0; b < qa->nb; b++) {
        const int8_t *xq = qa->q + (o + b) * 32;
        float dx = qa->d[o + b];
        int32_t isum = 0;
        float *a = &acc[b % KILN_Q8ACT_LANES];
        if (dt == KILN_DTYPE_Q8_0) {
            const uint8_t *blk = row + (size_t)b * 34;
            for (int i = 0; i < 32; i++) isum += (int32_t)(int8_t)blk[2 + i] * xq[i];
            *a = fmaf(h2f(blk) * dx, (float)isum, *a);
        } else if (dt == KILN_DTYPE_Q4_0) {
            const uint8_t *blk = row + (size_t)b * 18;
            for (int j = 0; j < 16; j++)
                isum += (blk[2 + j] & 15) * xq[j] + (blk[2 + j] >> 4) * xq[16 + j];
            isum -= 8 * qa->sum[o + b]; /* sum (n - 8) x = sum n x - 8 sum x, exact */
            *a = fmaf(h2f(blk) * dx, (float)isum, *a);
        } else { /* Q4_1 */
            const uint8_t *blk = row + (size_t)b * 20;
            for (int j = 0; j < 16; j++)
                isum += (blk[4 + j] & 15) * xq[j] + (blk[4 + j] >> 4) * xq[16 + j];
            *a = fmaf(h2f(blk) * dx, (float)isum, *a);
            *a = fmaf(h2f(blk + 2), qa->s[o + b], *a);
        }
    }
    return lane8_reduce(acc);
}

static void p_rows(const kiln_q8act_mm *m, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int t = 0; t < m->xa->N; t++) {
            float s = dot_row_ref(m->xa, t, m->w + (size_t)r * m->row_bytes, m->dtype);
            if (m->bias) s = s + m->bias[r];
            m->out[t * m->ldo + r] = s;
        }
}

const kiln_q8act_kernels kiln_q8act_kernels_portable = {
    .name = "portable",
    .quantize = p_quantize,
    .rows = p_rows,
};
