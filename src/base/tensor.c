/*
 * tensor.c -- per-dtype facts, f16/bf16 conversions and block dequantization.
 *
 * The dequantizers give exactly the float32 bits of gguf-py's gguf.quants.dequantize (the
 * oracle in tests/python/test_dequant.py): every product and sum below is one IEEE float32
 * operation in the order numpy evaluates it, and the build passes -ffp-contract=off so that
 * no a*b+c is fused. Do not "simplify" (d*q)+m into fmaf or reorder d*sc*q: the bits change.
 *
 * Block layouts (little-endian; "f16" is an IEEE half; offsets in bytes):
 *   q8_0  (32 el, 34 B):  f16 d | int8 qs[32]                  y = qs*d
 *   q4_0  (32 el, 18 B):  f16 d | u8 qs[16]                    y = d*(q-8)
 *   q4_1  (32 el, 20 B):  f16 d | f16 m | u8 qs[16]            y = (d*q)+m
 *   q5_0  (32 el, 22 B):  f16 d | u32 qh | u8 qs[16]           y = d*(q-16)
 *   q5_1  (32 el, 24 B):  f16 d | f16 m | u32 qh | u8 qs[16]   y = (d*q)+m
 *   q4_k (256 el, 144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
 *   q5_k (256 el, 176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
 *                         y = (d*sc)*q - (dmin*m), sc/m 6-bit per 32-element group
 *   q6_k (256 el, 210 B): u8 ql[128] | u8 qh[64] | int8 scales[16] | f16 d
 *                         y = (d*sc)*(q-32), sc per 16-element group
 * In the 32-element formats element j < 16 is the low nibble of qs[j] and element j >= 16
 * the high nibble of qs[j-16]; the fifth bit of element j is bit j of qh.
 */
#include "tensor.h"

#include <string.h>

static const kiln_dtype_traits g_traits[KILN_DTYPE_COUNT] = {
    [KILN_DTYPE_F32] = {"f32", 1, 4, 0},
    [KILN_DTYPE_F16] = {"f16", 1, 2, 0},
    [KILN_DTYPE_BF16] = {"bf16", 1, 2, 0},
    [KILN_DTYPE_Q8_0] = {"q8_0", 32, 34, 1},
    [KILN_DTYPE_Q4_0] = {"q4_0", 32, 18, 1},
    [KILN_DTYPE_Q4_1] = {"q4_1", 32, 20, 1},
    [KILN_DTYPE_Q5_0] = {"q5_0", 32, 22, 1},
    [KILN_DTYPE_Q5_1] = {"q5_1", 32, 24, 1},
    [KILN_DTYPE_Q4_K] = {"q4_k", 256, 144, 1},
    [KILN_DTYPE_Q5_K] = {"q5_k", 256, 176, 1},
    [KILN_DTYPE_Q6_K] = {"q6_k", 256, 210, 1},
    [KILN_DTYPE_I32] = {"i32", 1, 4, 0},
    [KILN_DTYPE_I64] = {"i64", 1, 8, 0},
};

const kiln_dtype_traits *kiln_dtype_get_traits(kiln_dtype t) {
    if ((int)t < 0 || t >= KILN_DTYPE_COUNT) return NULL;
    return &g_traits[t];
}

const char *kiln_dtype_name(kiln_dtype t) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(t);
    return tr ? tr->name : "?";
}

bool kiln_dtype_nbytes(kiln_dtype t, uint64_t n, uint64_t *out) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(t);
    if (!tr || n % (uint64_t)tr->block_size != 0) return false;
    uint64_t r;
    if (kiln_mul_overflow_u64(n / (uint64_t)tr->block_size, (uint64_t)tr->type_size, &r))
        return false;
    *out = r;
    return true;
}

/* ---- scalar conversions ---------------------------------------------------------------- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Exact widening, written as selects (no branches) so loops over f16 data vectorize, and
 * without touching f32 subnormals (slow on x86): normals and Inf/NaN rebias the exponent
 * with an integer add (NaN keeps sign and payload, as numpy does); f16 subnormals are
 * em * 2^-24, an exact int-to-float conversion times a power of two. */
static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t normal = (em << 13) + 0x38000000u;  /* exponent + (127 - 15) */
    uint32_t special = (em << 13) + 0x70000000u; /* exponent 31 -> 255 */
    uint32_t sub = f32_bits((float)(int32_t)em * 0x1p-24f);
    uint32_t r = em < 0x400u ? sub : em >= 0x7c00u ? special : normal;
    return bits_f32(r | sign);
}

float kiln_fp16_to_fp32(uint16_t h) { return fp16_to_fp32(h); }

float kiln_bf16_to_fp32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

/* Same as gguf-py's BF16.quantize_blocks / ggml_compute_fp32_to_bf16: NaN becomes a quiet
 * NaN with the top payload bits kept, everything else rounds to nearest even (overflow
 * rounds to Inf). */
uint16_t kiln_fp32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)(((uint64_t)u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

uint16_t kiln_fp32_to_fp16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t ax = u & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN */
    if (ax >= 0x38800000u) { /* |f| >= 2^-14: normal f16 or overflow */
        if (ax >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); /* >= 2^16: Inf */
        uint32_t h = (ax - 0x38000000u) >> 13; /* rebias 127 -> 15 */
        uint32_t rem = ax & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* carry may give Inf */
        return (uint16_t)(sign | (h >= 0x7c00u ? 0x7c00u : h));
    }
    if (ax <= 0x33000000u) return sign; /* <= 2^-25: ties to even give 0 */
    /* subnormal f16: value = m * 2^(e-150), unit 2^-24, so h = m >> (126 - e) rounded */
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* ---- block dequantizers ---------------------------------------------------------------- */

static inline void deq_q8_0(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

static inline void deq_q4_0(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
        y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static inline void deq_q4_1(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const float m = fp16_to_fp32(rd_u16(b + 2));
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0x0f) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

/* The fifth bits of a q5 block as bytes (0 or 16) per element: bit j of the little-endian
 * u32 at qh. Byte-wise unpacking keeps the per-element loops free of variable shifts, which
 * baseline x86-64 (SSE2) cannot vectorize. */
static inline void q5_high_bits(const uint8_t *qh, uint8_t hb[32]) {
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 8; i++) hb[k * 8 + i] = (uint8_t)(((qh[k] >> i) & 1u) << 4);
}

static inline void deq_q5_0(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    uint8_t hb[32];
    q5_high_bits(b + 2, hb);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((qs[j] & 0x0fu) | hb[j]) - 16);
        y[j + 16] = d * (float)((int)((qs[j] >> 4) | hb[j + 16]) - 16);
    }
}

static inline void deq_q5_1(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const float m = fp16_to_fp32(rd_u16(b + 2));
    uint8_t hb[32];
    q5_high_bits(b + 4, hb);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 0x0fu) | hb[j]) + m;
        y[j + 16] = d * (float)((qs[j] >> 4) | hb[j + 16]) + m;
    }
}

/* The 12 packed bytes of q4_k/q5_k scales: 8 six-bit scales and 8 six-bit mins. */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
}

static inline void deq_q4_k(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const float dmin = fp16_to_fp32(rd_u16(b + 2));
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 8; g++) { /* group g: 32 elements, nibble (g&1) of qs[(g/2)*32 ..] */
        const float dg = d * (float)sc[g], mg = dmin * (float)mn[g];
        const uint8_t *q = qs + (g >> 1) * 32;
        const int sh = (g & 1) * 4;
        float *yg = y + g * 32;
        for (int l = 0; l < 32; l++) yg[l] = dg * (float)((q[l] >> sh) & 0x0f) - mg;
    }
}

static inline void deq_q5_k(const uint8_t *b, float *y) {
    const float d = fp16_to_fp32(rd_u16(b));
    const float dmin = fp16_to_fp32(rd_u16(b + 2));
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; g++) { /* fifth bit of group g is bit g of qh[l] */
        const float dg = d * (float)sc[g], mg = dmin * (float)mn[g];
        const uint8_t *q = qs + (g >> 1) * 32;
        const int sh = (g & 1) * 4;
        float *yg = y + g * 32;
        for (int l = 0; l < 32; l++) {
            uint32_t v = ((q[l] >> sh) & 0x0fu) | (((uint32_t)(qh[l] >> g) & 1u) << 4);
            yg[l] = dg * (float)v - mg;
        }
    }
}

static inline void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = fp16_to_fp32(rd_u16(b + 208));
    for (int h = 0; h < 2; h++) { /* two halves of 128 elements */
        const uint8_t *l4 = ql + h * 64, *h2 = qh + h * 32;
        float *yh = y + h * 128;
        for (int g = 0; g < 4; g++) { /* 32-element quarter: nibble g/2, qh bits 2g..2g+1 */
            const uint8_t *lq = l4 + (g & 1) * 32;
            const int lsh = (g >> 1) * 4, hsh = g * 2;
            const float d0 = d * (float)scales[h * 8 + g * 2];
            const float d1 = d * (float)scales[h * 8 + g * 2 + 1];
            float *yg = yh + g * 32;
            for (int l = 0; l < 32; l++) {
                int q = (int)(((lq[l] >> lsh) & 0x0fu) | (((uint32_t)(h2[l] >> hsh) & 3u) << 4));
                yg[l] = (l < 16 ? d0 : d1) * (float)(q - 32);
            }
        }
    }
}

void kiln_dequantize_block(kiln_dtype t, const void *block, float *dst) {
    const uint8_t *b = block;
    switch (t) {
    case KILN_DTYPE_F32: memcpy(dst, b, 4); break;
    case KILN_DTYPE_F16: dst[0] = fp16_to_fp32(rd_u16(b)); break;
    case KILN_DTYPE_BF16: dst[0] = kiln_bf16_to_fp32(rd_u16(b)); break;
    case KILN_DTYPE_Q8_0: deq_q8_0(b, dst); break;
    case KILN_DTYPE_Q4_0: deq_q4_0(b, dst); break;
    case KILN_DTYPE_Q4_1: deq_q4_1(b, dst); break;
    case KILN_DTYPE_Q5_0: deq_q5_0(b, dst); break;
    case KILN_DTYPE_Q5_1: deq_q5_1(b, dst); break;
    case KILN_DTYPE_Q4_K: deq_q4_k(b, dst); break;
    case KILN_DTYPE_Q5_K: deq_q5_k(b, dst); break;
    case KILN_DTYPE_Q6_K: deq_q6_k(b, dst); break;
    case KILN_DTYPE_I32: {
        int32_t v;
        memcpy(&v, b, 4);
        dst[0] = (float)v;
        break;
    }
    case KILN_DTYPE_I64: {
        int64_t v;
        memcpy(&v, b, 8);
        dst[0] = (float)v;
        break;
    }
    default: break;
    }
}

/* Run a block dequantizer over nb consecutive blocks. */
#define DEQ_LOOP(fn, bs, ts)                                                                   \
    for (int64_t i = 0; i < nb; i++) fn(s + i * (ts), dst + i * (bs))

void kiln_dequantize(kiln_dtype t, const void *src, float *dst, int64_t n) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(t);
    if (!tr || n <= 0) return;
    const uint8_t *s = src;
    const int64_t nb = n / tr->block_size;
    switch (t) {
    case KILN_DTYPE_F32: memcpy(dst, s, (size_t)n * 4); break;
    case KILN_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_fp32(rd_u16(s + 2 * i));
        break;
    case KILN_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)rd_u16(s + 2 * i) << 16);
        break;
    case KILN_DTYPE_Q8_0: DEQ_LOOP(deq_q8_0, 32, 34); break;
    case KILN_DTYPE_Q4_0: DEQ_LOOP(deq_q4_0, 32, 18); break;
    case KILN_DTYPE_Q4_1: DEQ_LOOP(deq_q4_1, 32, 20); break;
    case KILN_DTYPE_Q5_0: DEQ_LOOP(deq_q5_0, 32, 22); break;
    case KILN_DTYPE_Q5_1: DEQ_LOOP(deq_q5_1, 32, 24); break;
    case KILN_DTYPE_Q4_K: DEQ_LOOP(deq_q4_k, 256, 144); break;
    case KILN_DTYPE_Q5_K: DEQ_LOOP(deq_q5_k, 256, 176); break;
    case KILN_DTYPE_Q6_K: DEQ_LOOP(deq_q6_k, 256, 210); break;
    case KILN_DTYPE_I32: /* the value, rounded to nearest */
        for (int64_t i = 0; i < n; i++) dst[i] = (float)(int32_t)rd_u32(s + 4 * i);
        break;
    case KILN_DTYPE_I64:
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)(int64_t)(rd_u32(s + 8 * i) | ((uint64_t)rd_u32(s + 8 * i + 4) << 32));
        break;
    default: break;
    }
}
