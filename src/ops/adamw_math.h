/*
 * adamw_math.h -- the per-element arithmetic of AdamW (docs/ARITHMETIC.md, "AdamW and
 * clipping"), written once for the CPU (src/ops/cpu/cpu_adamw.c) and the GPU
 * (src/ops/cuda/cuda_adamw.cu): every function is KILN_HD (host and device) and uses only IEEE
 * binary32 operations and integer bit manipulation, so both sides perform the same operations
 * in the same order and get the same bits. Change a definition only with ARITHMETIC.md.
 * Also the storage variants those functions serve (the optimizer, src/train/adamw.h, says
 * what each keeps).
 */
#ifndef KILN_OPS_ADAMW_MATH_H
#define KILN_OPS_ADAMW_MATH_H

#include "../base/kmath.h"

#include <stdint.h>

/* How the weights are stored and updated. */
typedef enum kiln_adamw_weights {
    KILN_ADAMW_F32 = 0,
    KILN_ADAMW_BF16_MASTER = 1,
    KILN_ADAMW_BF16_KAHAN = 2,
    KILN_ADAMW_BF16_SR = 3,
} kiln_adamw_weights;

/* How the moments are stored. */
typedef enum kiln_adamw_moments {
    KILN_ADAMW_MOMENTS_F32 = 0,
    KILN_ADAMW_MOMENTS_Q8 = 1,
} kiln_adamw_moments;

/* Elements per block of the 8-bit moments (one f32 scale each). */
#define KILN_ADAMW_Q8_BLOCK 256

/* The per-step scalars, rounded to float once on the host (ARITHMETIC.md). */
typedef struct kiln_adamw_scalars {
    float wd_mul;        /* float(1 - lr * weight_decay) */
    int lerp_small;      /* |float(1 - beta1)| < 0.5: torch's lerp branch */
    float lerp_coeff;    /* w or (w - 1) with w = float(1 - beta1) */
    float beta2;         /* float(beta2) */
    float c2;            /* float(1 - beta2) */
    float bc2_sqrt;      /* float(pow(1 - beta2^step, 0.5)) */
    float eps;           /* float(eps) */
    float neg_step_size; /* float(-(lr / (1 - beta1^step))) */
    int use_wd;          /* weight_decay != 0 */
    uint64_t sr_key;     /* mix64(mix64(seed) + step) */
    int scale_grad;      /* each gradient is first multiplied by grad_scale (a clip */
    float grad_scale;    /* coefficient not yet applied to the stored gradients) */
} kiln_adamw_scalars;

/* torch's update of one element: param.mul_, exp_avg.lerp_, exp_avg_sq.mul_().addcmul_(),
 * denom = sqrt(v) / bc2_sqrt + eps, param.addcdiv_(m, denom, value=-step_size). */
static inline KILN_HD float kiln_adamw_update(const kiln_adamw_scalars *s, int decay, float p,
                                              float g, float *m, float *v) {
    if (s->scale_grad) g = g * s->grad_scale; /* the bits of scaling the stored g first */
    if (decay) p = p * s->wd_mul;
    float mm = *m;
    /* lerp(start=mm, end=g, w): w < 0.5 ? fma(w, end - start, start)
     *                                    : fma(w - 1, end - start, end) */
    mm = s->lerp_small ? fmaf(s->lerp_coeff, g - mm, mm) : fmaf(s->lerp_coeff, g - mm, g);
    float vv = *v * s->beta2;
    vv = fmaf(s->c2 * g, g, vv);
    float denom = sqrtf(vv) / s->bc2_sqrt + s->eps;
    p = p + (s->neg_step_size * mm) / denom;
    *m = mm;
    *v = vv;
    return p;
}

/* splitmix64's finaliser (mod 2^64). */
static inline KILN_HD uint64_t kiln_adamw_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* bf16 <-> f32 as tensor.c's kiln_bf16_to_fp32 / kiln_fp32_to_bf16 (RNE; NaN stays a quiet
 * NaN with the top payload bits). */
static inline KILN_HD float kiln_adamw_bf16_f32(uint16_t b) {
    return kiln_bits_f32((uint32_t)b << 16);
}
static inline KILN_HD uint16_t kiln_adamw_f32_bf16(float f) {
    uint32_t u = kiln_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)(((uint64_t)u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Round x to bf16 stochastically with 16 random bits r: add r to the 16 bits that bf16
 * drops and truncate. |x| rounds away from zero with probability (dropped bits) / 2^16, so
 * the result is one of the two neighbours and its expectation is x. Inf and NaN as RNE. */
static inline KILN_HD uint16_t kiln_adamw_bf16_stochastic(float x, uint32_t r16) {
    uint32_t u = kiln_f32_bits(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return kiln_adamw_f32_bf16(x);
    return (uint16_t)((u + r16) >> 16);
}

/* The 16 random bits of element e of a parameter whose key is mix64(sr_key + param). */
static inline KILN_HD uint32_t kiln_adamw_sr_bits(uint64_t key, uint64_t e) {
    return (uint32_t)(kiln_adamw_mix64(key + e * 0x9E3779B97F4A7C15ull) >> 48);
}

/* ---- 8-bit log codes --------------------------------------------------------------------- */

/* 2^(j/8) and the geometric midpoints 2^((j+0.5)/8), j = 0..7, rounded to float (literals:
 * both compilers round a decimal literal correctly; selects and switches with constant
 * operands rather than a table, so that device code needs no __constant__ copy). */
static inline KILN_HD float kiln_adamw_q8_level(int j) {
    /* selects, not a switch: j differs lane to lane on the GPU, where a switch branches */
    float x = 1.0f;
    x = j == 1 ? 1.09050773266525765921f : x;
    x = j == 2 ? 1.18920711500272106672f : x;
    x = j == 3 ? 1.29683955465100966593f : x;
    x = j == 4 ? 1.41421356237309504880f : x;
    x = j == 5 ? 1.54221082540794082361f : x;
    x = j == 6 ? 1.68179283050742908606f : x;
    x = j >= 7 ? 1.83400808640934246349f : x;
    return x;
}
static inline KILN_HD float kiln_adamw_q8_mid(int j) {
    switch (j) {
    case 0: return 1.04427378242741384032f;
    case 1: return 1.13878863475669165370f;
    case 2: return 1.24185781207348404859f;
    case 3: return 1.35425554693689272830f;
    case 4: return 1.47682614593949931139f;
    case 5: return 1.61049033194925430820f;
    case 6: return 1.75625216037329948312f;
    default: return 1.91520656139714729387f;
    }
}

/* Code of r = |x| / absmax in [0, 1] with max_code levels: level L = round(8 log2 r) by
 * exact comparisons with the midpoints, code = max_code + L; below code 1: floor_code (0 for
 * the first moment, where 0 is harmless; 1 for the second moment, so that a nonzero v never
 * becomes 0 and turns the update into m / eps). r == 0 gives 0. */
static inline KILN_HD int kiln_adamw_q8_code(float r, int max_code, int floor_code) {
    if (!(r > 0.0f)) return 0;
    uint32_t u = kiln_f32_bits(r);
    int e = (int)((u >> 23) & 0xffu);
    if (e == 0) return floor_code; /* subnormal: far below the range */
    float f = kiln_bits_f32((u & 0x7fffffu) | 0x3f800000u); /* [1, 2) */
    /* j = the number of midpoints <= f (they increase: the first j of them), counted without
     * branches, which costs the GPU's warps far less than a loop that stops early */
    int j = 0;
    for (int k = 0; k < 8; k++) j += f >= kiln_adamw_q8_mid(k);
    int level = 8 * (e - 127) + j;
    int code = max_code + level;
    if (code < 1) return floor_code;
    if (code > max_code) code = max_code; /* r > 1 cannot happen; kept for safety */
    return code;
}

/* absmax * 2^((code - max_code) / 8): the power built exactly, then one multiply. */
static inline KILN_HD float kiln_adamw_q8_value(int code, int max_code, float absmax) {
    if (code == 0) return 0.0f;
    int level = code - max_code; /* <= 0 */
    int e = -((-level + 7) / 8); /* floor(level / 8) */
    int j = level - 8 * e;       /* 0..7 */
    float pw = kiln_bits_f32((uint32_t)(e + 127) << 23);
    return absmax * (kiln_adamw_q8_level(j) * pw);
}

/* The dequantized first moment of code c (sign * code) and second moment of code c. */
static inline KILN_HD float kiln_adamw_q8_m(int8_t c, float ms) {
    int k = c;
    float a = kiln_adamw_q8_value(k < 0 ? -k : k, 127, ms);
    return k < 0 ? -a : a;
}
static inline KILN_HD float kiln_adamw_q8_v(uint8_t c, float vs) {
    return kiln_adamw_q8_value(c, 255, vs);
}
/* m[i], v[i] = the dequantized moments of the len codes of one block (absmax ms, vs). */
static inline void kiln_adamw_q8_dequant_block(const int8_t *mq, const uint8_t *vq, float ms,
                                               float vs, float *m, float *v, int len) {
    for (int i = 0; i < len; i++) {
        m[i] = kiln_adamw_q8_m(mq[i], ms);
        v[i] = kiln_adamw_q8_v(vq[i], vs);
    }
}
/* The codes of m and v in a block with absmax am / av. */
static inline KILN_HD int8_t kiln_adamw_q8_mcode(float m, float am) {
    int c = am > 0.0f ? kiln_adamw_q8_code(fabsf(m) / am, 127, 0) : 0;
    return (int8_t)(m < 0.0f ? -c : c);
}
static inline KILN_HD uint8_t kiln_adamw_q8_vcode(float v, float av) {
    return (uint8_t)(av > 0.0f ? kiln_adamw_q8_code(v / av, 255, 1) : 0);
}
/* One block of len moments quantized as the step stores them: absmax *ms, *vs, then each
 * element's code (host side: the CPU step and the optimizer's set_moments). */
static inline void kiln_adamw_q8_quant_block(const float *m, const float *v, int8_t *mq,
                                             uint8_t *vq, float *ms, float *vs, int len) {
    float am = 0.0f, av = 0.0f;
    for (int i = 0; i < len; i++) {
        if (fabsf(m[i]) > am) am = fabsf(m[i]);
        if (fabsf(v[i]) > av) av = fabsf(v[i]);
    }
    *ms = am;
    *vs = av;
    for (int i = 0; i < len; i++) {
        mq[i] = kiln_adamw_q8_mcode(m[i], am);
        vq[i] = kiln_adamw_q8_vcode(v[i], av);
    }
}

/* ---- gradient norm ----------------------------------------------------------------------- */

/* torch's CPU float32 sum of squares on its AVX2 kernels (8 float lanes):
 *   acc[j] = acc[j] + x*x over full groups of 8, then s = acc[0] + acc[1] + ... + acc[7]
 *   in order, then s = s + x*x for the tail, every product and sum rounded. */
static inline KILN_HD float kiln_adamw_sumsq8(const float *g, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t head = n - n % 8, d = 0;
    for (; d < head; d += 8)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + g[d + j] * g[d + j];
    float s = acc[0];
    for (int j = 1; j < 8; j++) s = s + acc[j];
    for (; d < n; d++) s = s + g[d] * g[d];
    return s;
}

/* clip_coef_clamped = min((1 / (total + 1e-6f)) * max_norm, 1), max_norm already float;
 * NaN stays NaN, as torch.clamp. */
static inline KILN_HD float kiln_adamw_clip_coef(float total_norm, float max_norm_f) {
    float t = total_norm + (float)1e-6;
    float coef = (1.0f / t) * max_norm_f;
    return coef > 1.0f ? 1.0f : coef;
}

#endif /* KILN_OPS_ADAMW_MATH_H */
