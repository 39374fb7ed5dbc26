/*
 * kmath.h -- kiln's defined arithmetic: the pieces every backend must reproduce bit for bit.
 *
 * This header compiles as C11 and as CUDA (KILN_HD marks functions for host and device).
 * Everything here is written with IEEE-754 binary32 operations whose results are fully
 * specified (+, -, *, /, sqrtf, fmaf, integer bit manipulation) in round-to-nearest-even, so
 * a CPU SIMD path or a GPU thread that performs the same operations in the same order gets
 * the same bits. The definitions are documented in docs/ARITHMETIC.md; change one only with
 * that document, and the CPU SIMD paths and tests that mirror it.
 *
 * Builds must not contract a*b+c into an FMA behind kiln's back (-ffp-contract=off on the
 * host, --fmad=false under nvcc): every FMA here is an explicit fmaf().
 */
#ifndef KILN_KMATH_H
#define KILN_KMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KILN_HD __host__ __device__
#else
#define KILN_HD
#endif

/* Number of lane accumulators of the defined dot product (docs/ARITHMETIC.md, "dot"). */
#define KILN_DOT_LANES 16
/* Keys per block of the online softmax of attention (docs/ARITHMETIC.md, "attention"). */
#define KILN_ATTN_BLOCK 64
/* The first key a causal query with T keys (0..T-1, its own the last) reads under a sliding
 * window of `window` keys (docs/ARITHMETIC.md, "Sliding window"); 0 for window 0 (none). */
static inline KILN_HD int kiln_attn_window_lo(int T, int window) {
    return window > 0 && T > window ? T - window : 0;
}

static inline KILN_HD uint32_t kiln_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline KILN_HD float kiln_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The fixed pairwise tree that ends every dot product: lanes (j, j+8) for j < 8, then
 * (j, j+4) for j < 4, (j, j+2) for j < 2, and (0, 1). */
static inline KILN_HD float kiln_lane16_reduce(const float acc[KILN_DOT_LANES]) {
    float s8[8], s4[4], s2[2];
    for (int j = 0; j < 8; j++) s8[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    for (int j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    return s2[0] + s2[1];
}

/* Continue the 16 lane accumulators over a[0..n) * b[0..n): lane i % 16 does
 * acc = fmaf(a[i], b[i], acc) in increasing i. Pieces of one dot must start at multiples of
 * 16 for the lane assignment to continue (all but the last piece have n % 16 == 0). */
static inline KILN_HD void kiln_dot_accum_ref(float acc[KILN_DOT_LANES], const float *a,
                                              const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i % KILN_DOT_LANES] = fmaf(a[i], b[i], acc[i % KILN_DOT_LANES]);
}

/* The defined dot product of length n (portable reference; the SIMD paths equal it). */
static inline KILN_HD float kiln_dot_ref(const float *a, const float *b, int64_t n) {
    float acc[KILN_DOT_LANES] = {0};
    kiln_dot_accum_ref(acc, a, b, n);
    return kiln_lane16_reduce(acc);
}

/* ---- exp -------------------------------------------------------------------------------- */

/* Constants of kiln_expf. ln2 is split so that k * KILN_EXP_LN2_HI is exact for |k| <= 2^9
 * (the high part has 16 significant bits) and the reduction r = x - k*ln2 is done with two
 * FMAs. The polynomial is the classic degree-6 minimax fit of (exp(r) - 1 - r) / r^2 on
 * [-ln2/2, ln2/2] (Cephes' expf coefficients). */
#define KILN_EXP_LOG2E 1.44269502162933349609375f     /* float(log2(e)) */
#define KILN_EXP_LN2_HI 0.693145751953125f            /* 0x3f317200 */
#define KILN_EXP_LN2_LO 1.428606765330187045e-06f     /* float(ln2 - LN2_HI) */
#define KILN_EXP_SHIFTER 12582912.0f                  /* 1.5 * 2^23: rounds to an integer */
#define KILN_EXP_HI 88.72283935546875f                /* above: +inf (largest x < ln(FLT_MAX)) */
#define KILN_EXP_LO -103.972084045410156f             /* below: +0 (exp < 2^-150) */
#define KILN_EXP_P0 1.9875691500e-4f
#define KILN_EXP_P1 1.3981999507e-3f
#define KILN_EXP_P2 8.3334519073e-3f
#define KILN_EXP_P3 4.1665795894e-2f
#define KILN_EXP_P4 1.6666665459e-1f
#define KILN_EXP_P5 5.0000001201e-1f

/* kiln's exp for binary32, about 1 ulp. Defined operation by operation:
 *   NaN -> NaN (x + x); x > EXP_HI -> +inf; x < EXP_LO -> +0;
 *   k  = (x * LOG2E + SHIFTER) - SHIFTER          (round to nearest integer, two roundings)
 *   r  = fmaf(-k, LN2_HI, x);  r = fmaf(-k, LN2_LO, r)
 *   p  = P0; p = fmaf(p, r, P1); ... p = fmaf(p, r, P5)     (Horner)
 *   y  = fmaf(p, r * r, r) + 1.0f
 *   k1 = k >> 1 (floor), k2 = k - k1;  result = (y * 2^k1) * 2^k2   (2^k built from bits)
 * The split scaling keeps 2^k1 and 2^k2 normal for k in [-150, 128], so only the last
 * multiply can round (into a subnormal). */
static inline KILN_HD float kiln_expf(float x) {
    if (x != x) return x + x;
    if (x > KILN_EXP_HI) return INFINITY;
    if (x < KILN_EXP_LO) return 0.0f;
    float t = x * KILN_EXP_LOG2E;
    float kf = (t + KILN_EXP_SHIFTER) - KILN_EXP_SHIFTER;
    float r = fmaf(-kf, KILN_EXP_LN2_HI, x);
    r = fmaf(-kf, KILN_EXP_LN2_LO, r);
    float p = KILN_EXP_P0;
    p = fmaf(p, r, KILN_EXP_P1);
    p = fmaf(p, r, KILN_EXP_P2);
    p = fmaf(p, r, KILN_EXP_P3);
    p = fmaf(p, r, KILN_EXP_P4);
    p = fmaf(p, r, KILN_EXP_P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    int32_t k = (int32_t)kf;
    int32_t k1 = k >> 1; /* arithmetic shift: floor(k / 2) */
    int32_t k2 = k - k1;
    float s1 = kiln_bits_f32((uint32_t)(k1 + 127) << 23);
    float s2 = kiln_bits_f32((uint32_t)(k2 + 127) << 23);
    return (y * s1) * s2;
}

/* silu(g) = g / (1 + exp(-g)), with kiln_expf; then swiglu = silu(g) * u (two roundings). */
static inline KILN_HD float kiln_silu(float g) { return g / (1.0f + kiln_expf(-g)); }
static inline KILN_HD float kiln_swiglu(float g, float u) { return kiln_silu(g) * u; }

/* tanh(z) (docs/ARITHMETIC.md, "tanh and GELU"): 1 - 2 / (e^(2|z|) + 1) with z's sign, and
 * below |z| < 2^-4, where that form cancels, the odd Taylor polynomial z - z^3/3 + 2z^5/15.
 * NaN stays NaN; +-inf gives +-1. */
static inline KILN_HD float kiln_tanhf(float z) {
    const float a = z < 0.0f ? -z : z;
    float t;
    if (a < 0.0625f) {
        const float a2 = a * a;
        t = a * (1.0f - a2 * (0.333333343f - a2 * 0.133333340f));
    } else {
        t = 1.0f - 2.0f / (kiln_expf(2.0f * a) + 1.0f);
    }
    return z < 0.0f ? -t : t;
}
/* GELU with the tanh approximation (PyTorch's gelu(approximate="tanh")):
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in this order of f32 operations. */
static inline KILN_HD float kiln_gelu_tanh(float x) {
    const float inner = 0.797884583473205566f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + kiln_tanhf(inner));
}
static inline KILN_HD float kiln_geglu(float g, float u) { return kiln_gelu_tanh(g) * u; }
/* The backward of out = kiln_geglu(g, u) given d = d loss / d out, in this order of f32
 * operations (t = tanh(inner) as the forward computes it, k = sqrt(2/pi)):
 *   gelu = 0.5 g (1 + t)                                 (the forward's bits)
 *   gelu' = 0.5 (1 + t) + (0.5 g) ((1 - t t) (k (1 + 3 * 0.044715 g g)))
 *   *du = d gelu ;  *dg = (d u) gelu'                                                      */
static inline KILN_HD void kiln_geglu_backward(float g, float u, float d, float *dg, float *du) {
    const float inner = 0.797884583473205566f * (g + 0.044715f * (g * g * g));
    const float t = kiln_tanhf(inner);
    const float gelu = 0.5f * g * (1.0f + t);
    const float dinner = 0.797884583473205566f * (1.0f + 0.134145006537437439f * (g * g));
    const float dgelu = 0.5f * (1.0f + t) + (0.5f * g) * ((1.0f - t * t) * dinner);
    *du = d * gelu;
    *dg = (d * u) * dgelu;
}

/* rmsnorm's scale for a row with sum of squares ss (the defined dot of x with itself):
 * 1 / sqrt(ss / C + eps), three correctly rounded operations and one division. */
static inline KILN_HD float kiln_rms_scale(float ss, int C, float eps) {
    float mean = ss / (float)C;
    return 1.0f / sqrtf(mean + eps);
}

/* ---- log, softplus, sigmoid (Gated DeltaNet's gates; docs/ARITHMETIC.md, "log and softplus") */

/* ln(x) for binary32, about 1 ulp, from +, -, *, fmaf and bit manipulation only:
 *   NaN or x < 0 -> NaN; 0 -> -inf; +inf -> +inf; subnormals scaled by 2^23 first;
 *   x = m 2^e with m in [sqrt(1/2), sqrt(2));  f = m - 1;  z = f * f
 *   p = L0; p = fmaf(p, f, L1); ... p = fmaf(p, f, L8)              (Horner)
 *   y = (f * z) * p;  y = fmaf(e, L_LO, y);  y = fmaf(-0.5f, z, y);  r = f + y
 *   result = fmaf(e, L_HI, r)
 * The polynomial is the classic fit of (ln(1 + f) - f + f^2/2) / f^3 on [sqrt(1/2) - 1,
 * sqrt(2) - 1] (Cephes' logf coefficients); ln2 = L_HI + L_LO with L_HI exact in 9 bits. */
#define KILN_LOG_L0 7.0376836292e-2f
#define KILN_LOG_L1 -1.1514610310e-1f
#define KILN_LOG_L2 1.1676998740e-1f
#define KILN_LOG_L3 -1.2420140846e-1f
#define KILN_LOG_L4 1.4249322787e-1f
#define KILN_LOG_L5 -1.6668057665e-1f
#define KILN_LOG_L6 2.0000714765e-1f
#define KILN_LOG_L7 -2.4999993993e-1f
#define KILN_LOG_L8 3.3333331174e-1f
#define KILN_LOG_HI 0.693359375f
#define KILN_LOG_LO -2.12194440e-4f
static inline KILN_HD float kiln_logf(float x) {
    if (x != x || x < 0.0f) return (x - x) / (x - x); /* NaN */
    if (x == 0.0f) return -INFINITY;
    if (x == INFINITY) return x;
    int32_t e = 0;
    if (x < 1.17549435e-38f) { /* subnormal: scale into the normal range */
        x *= 8388608.0f;
        e = -23;
    }
    uint32_t u = kiln_f32_bits(x);
    e += (int32_t)((u >> 23) & 0xff) - 127;
    float m = kiln_bits_f32((u & 0x007fffffu) | 0x3f800000u); /* [1, 2) */
    if (m > 1.41421356f) { /* [sqrt(1/2), sqrt(2)) */
        m *= 0.5f;
        e += 1;
    }
    const float f = m - 1.0f, z = f * f, ef = (float)e;
    float p = KILN_LOG_L0;
    p = fmaf(p, f, KILN_LOG_L1);
    p = fmaf(p, f, KILN_LOG_L2);
    p = fmaf(p, f, KILN_LOG_L3);
    p = fmaf(p, f, KILN_LOG_L4);
    p = fmaf(p, f, KILN_LOG_L5);
    p = fmaf(p, f, KILN_LOG_L6);
    p = fmaf(p, f, KILN_LOG_L7);
    p = fmaf(p, f, KILN_LOG_L8);
    float y = (f * z) * p;
    y = fmaf(ef, KILN_LOG_LO, y);
    y = fmaf(-0.5f, z, y);
    const float r = f + y;
    return fmaf(ef, KILN_LOG_HI, r);
}

/* softplus(x) = ln(1 + e^x) as torch's F.softplus (threshold 20): x > 20 -> x; else with
 * e = kiln_expf(x): e < 2^-24 -> e (ln(1 + e) = e to binary32); else y = 1 + e and
 * ln(y) + (e - (y - 1)) / y (the rounding of 1 + e corrected to first order). */
static inline KILN_HD float kiln_softplus(float x) {
    if (x > 20.0f) return x;
    const float e = kiln_expf(x);
    if (e < 5.9604645e-8f) return e;
    const float y = 1.0f + e;
    return kiln_logf(y) + (e - (y - 1.0f)) / y;
}
/* sigmoid(x) = 1 / (1 + kiln_expf(-x)), softplus's derivative. */
static inline KILN_HD float kiln_sigmoid(float x) { return 1.0f / (1.0f + kiln_expf(-x)); }

/* Gated DeltaNet's gates for one (token, value head): beta = sigmoid(b) and the log decay
 * g = -(kiln_expf(A_log) * softplus(a + dt_bias)) (transformers' -A_log.exp() * softplus(a +
 * dt_bias): the negation is exact). */
static inline KILN_HD void kiln_gdn_gates(float a, float b, float A_log, float dt_bias, float *g, float *beta) {
    *g = -(kiln_expf(A_log) * kiln_softplus(a + dt_bias));
    *beta = kiln_sigmoid(b);
}
/* Their backward, given dg and dbeta: d a = (dg * -exp(A_log)) * sigmoid(a + dt_bias) (also d
 * dt_bias's term), d b = dbeta * (beta * (1 - beta)), d A_log's term = dg * g. */
static inline KILN_HD void kiln_gdn_gates_backward(float a, float b, float A_log, float dt_bias, float dg,
                                                   float dbeta, float *da, float *db, float *dA_term) {
    const float ea = kiln_expf(A_log), x = a + dt_bias;
    const float g = -(ea * kiln_softplus(x)), beta = kiln_sigmoid(b);
    *da = (dg * -ea) * kiln_sigmoid(x);
    *db = dbeta * (beta * (1.0f - beta));
    *dA_term = dg * g;
}

#endif /* KILN_KMATH_H */
