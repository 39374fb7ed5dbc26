/* test_dtype.c -- dtype traits, nbytes overflow refusal, f16/bf16 conversions (exhaustive
 * round trips, round-to-nearest-even at every midpoint, NaN/Inf/subnormals), and
 * kiln_dequantize_block == kiln_dequantize on every quantized type. */
#include "base/tensor.h"
#include "test_util.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bitsf(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_traits(void) {
    static const struct {
        kiln_dtype t;
        const char *name;
        int bs, ts, q;
    } want[] = {
        {KILN_DTYPE_F32, "f32", 1, 4, 0},       {KILN_DTYPE_F16, "f16", 1, 2, 0},
        {KILN_DTYPE_BF16, "bf16", 1, 2, 0},     {KILN_DTYPE_Q8_0, "q8_0", 32, 34, 1},
        {KILN_DTYPE_Q4_0, "q4_0", 32, 18, 1},   {KILN_DTYPE_Q4_1, "q4_1", 32, 20, 1},
        {KILN_DTYPE_Q5_0, "q5_0", 32, 22, 1},   {KILN_DTYPE_Q5_1, "q5_1", 32, 24, 1},
        {KILN_DTYPE_Q4_K, "q4_k", 256, 144, 1}, {KILN_DTYPE_Q5_K, "q5_k", 256, 176, 1},
        {KILN_DTYPE_Q6_K, "q6_k", 256, 210, 1}, {KILN_DTYPE_I32, "i32", 1, 4, 0},
        {KILN_DTYPE_I64, "i64", 1, 8, 0},
    };
    CHECK(sizeof want / sizeof want[0] == KILN_DTYPE_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const kiln_dtype_traits *tr = kiln_dtype_get_traits(want[i].t);
        CHECK(tr != NULL);
        if (!tr) continue;
        CHECK_MSG(strcmp(tr->name, want[i].name) == 0, "%s", want[i].name);
        CHECK(strcmp(kiln_dtype_name(want[i].t), want[i].name) == 0);
        CHECK(tr->block_size == want[i].bs && tr->type_size == want[i].ts);
        CHECK(tr->is_quantized == want[i].q);
    }
    CHECK(kiln_dtype_get_traits(KILN_DTYPE_COUNT) == NULL);
    CHECK(kiln_dtype_get_traits((kiln_dtype)-1) == NULL);
    CHECK(strcmp(kiln_dtype_name(KILN_DTYPE_COUNT), "?") == 0);
    CHECK(strcmp(kiln_dtype_name((kiln_dtype)1000), "?") == 0);
}

static void test_nbytes(void) {
    uint64_t n = 12345;
    CHECK(kiln_dtype_nbytes(KILN_DTYPE_Q4_0, 64, &n) && n == 36);
    CHECK(kiln_dtype_nbytes(KILN_DTYPE_Q6_K, 512, &n) && n == 420);
    CHECK(kiln_dtype_nbytes(KILN_DTYPE_F32, 0, &n) && n == 0);
    CHECK(kiln_dtype_nbytes(KILN_DTYPE_BF16, 7, &n) && n == 14);
    n = 777;
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_Q4_0, 33, &n) && n == 777); /* not a block multiple */
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_Q4_K, 128, &n));
    CHECK(kiln_dtype_nbytes(KILN_DTYPE_F32, (uint64_t)1 << 61, &n) && n == (uint64_t)1 << 63);
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_F32, (uint64_t)1 << 62, &n)); /* 2^64 overflows */
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_I64, UINT64_MAX, &n));
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_Q8_0, UINT64_MAX / 32 * 32, &n)); /* blocks*34 */
    CHECK(!kiln_dtype_nbytes(KILN_DTYPE_COUNT, 4, &n));
}

static void test_fp16(void) {
    /* known values */
    CHECK(kiln_fp16_to_fp32(0x3c00) == 1.0f);
    CHECK(kiln_fp16_to_fp32(0xc000) == -2.0f);
    CHECK(kiln_fp16_to_fp32(0x7bff) == 65504.0f);
    CHECK(kiln_fp16_to_fp32(0x0001) == ldexpf(1.0f, -24));
    CHECK(kiln_fp16_to_fp32(0x03ff) == ldexpf(1023.0f, -24));
    CHECK(kiln_fp16_to_fp32(0x0400) == ldexpf(1.0f, -14));
    CHECK(fbits(kiln_fp16_to_fp32(0x8000)) == 0x80000000u);
    CHECK(isinf(kiln_fp16_to_fp32(0x7c00)) && kiln_fp16_to_fp32(0x7c00) > 0);
    CHECK(isinf(kiln_fp16_to_fp32(0xfc00)) && kiln_fp16_to_fp32(0xfc00) < 0);
    CHECK(fbits(kiln_fp16_to_fp32(0x7e00)) == 0x7fc00000u);
    CHECK(fbits(kiln_fp16_to_fp32(0xfd01)) == (0xff800000u | (0x101u << 13))); /* payload kept */

    /* every half round-trips; NaN stays NaN */
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = kiln_fp16_to_fp32((uint16_t)h);
        uint16_t back = kiln_fp32_to_fp16(f);
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (nan ? !(isnan(f) && (back & 0x7c00) == 0x7c00 && (back & 0x3ff)) : back != h) bad++;
    }
    CHECK_MSG(bad == 0, "%d halves did not round-trip", bad);

    /* midpoints between neighbours round to the even one; one f32 ulp either side to the
     * nearer one; covers subnormals (h < 0x400) and the top binade */
    bad = 0;
    for (uint32_t h = 0; h < 0x7bff; h++) {
        for (int sign = 0; sign < 2; sign++) {
            uint16_t s = sign ? 0x8000 : 0;
            double lo = kiln_fp16_to_fp32((uint16_t)(h | s)), hi = kiln_fp16_to_fp32((uint16_t)((h + 1) | s));
            float mid = (float)((lo + hi) / 2); /* exact: halves have 11 bits */
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            if (kiln_fp32_to_fp16(mid) != (even | s)) bad++;
            float above = nextafterf(mid, sign ? -INFINITY : INFINITY);
            float below = nextafterf(mid, 0.0f);
            if (kiln_fp32_to_fp16(above) != ((h + 1) | s)) bad++;
            if (kiln_fp32_to_fp16(below) != (h | s)) bad++;
        }
    }
    CHECK_MSG(bad == 0, "%d midpoint roundings wrong", bad);

    /* overflow and underflow edges */
    CHECK(kiln_fp32_to_fp16(65519.996f) == 0x7bff);
    CHECK(kiln_fp32_to_fp16(65520.0f) == 0x7c00); /* tie, 0x7bff is odd: to Inf */
    CHECK(kiln_fp32_to_fp16(-1e10f) == 0xfc00);
    CHECK(kiln_fp32_to_fp16(INFINITY) == 0x7c00);
    CHECK(kiln_fp32_to_fp16(ldexpf(1.0f, -25)) == 0x0000); /* tie with 0: to even (0) */
    CHECK(kiln_fp32_to_fp16(nextafterf(ldexpf(1.0f, -25), 1.0f)) == 0x0001);
    CHECK(kiln_fp32_to_fp16(ldexpf(3.0f, -26)) == 0x0001);
    CHECK(kiln_fp32_to_fp16(-ldexpf(1.0f, -26)) == 0x8000);
    CHECK(kiln_fp32_to_fp16(1e-30f) == 0x0000);
    CHECK(kiln_fp32_to_fp16(ldexpf(1.0f, -149)) == 0x0000); /* f32 subnormal */
    uint16_t qn = kiln_fp32_to_fp16(bitsf(0x7f800001u)); /* signalling NaN stays NaN */
    CHECK((qn & 0x7c00) == 0x7c00 && (qn & 0x3ff) != 0);
}

static void test_bf16(void) {
    CHECK(kiln_bf16_to_fp32(0x3f80) == 1.0f);
    CHECK(kiln_bf16_to_fp32(0x0001) == ldexpf(1.0f, -133)); /* subnormal */
    CHECK(isinf(kiln_bf16_to_fp32(0xff80)));
    int bad = 0;
    for (uint32_t b = 0; b < 0x10000; b++) {
        float f = kiln_bf16_to_fp32((uint16_t)b);
        if (fbits(f) != b << 16) bad++;
        uint16_t back = kiln_fp32_to_bf16(f);
        bool nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f);
        if (nan ? !((back & 0x7f80) == 0x7f80 && (back & 0x40)) : back != b) bad++;
    }
    CHECK_MSG(bad == 0, "%d bf16 values did not round-trip", bad);
    bad = 0;
    for (uint32_t b = 0; b < 0x7f7f; b++) { /* every positive finite neighbour pair */
        for (uint32_t s = 0; s < 2; s++) {
            uint32_t lo = (b | (s << 15)) << 16;
            uint32_t mid = lo | 0x8000u;
            uint16_t even = (uint16_t)((b & 1) ? b + 1 : b) | (uint16_t)(s << 15);
            if (kiln_fp32_to_bf16(bitsf(mid)) != even) bad++;
            if (kiln_fp32_to_bf16(bitsf(mid + 1)) != (uint16_t)((b + 1) | (s << 15))) bad++;
            if (kiln_fp32_to_bf16(bitsf(mid - 1)) != (uint16_t)(b | (s << 15))) bad++;
        }
    }
    CHECK_MSG(bad == 0, "%d bf16 midpoint roundings wrong", bad);
    CHECK(kiln_fp32_to_bf16(3.4028235e38f) == 0x7f80); /* FLT_MAX rounds up to Inf */
    CHECK(kiln_fp32_to_bf16(bitsf(0x7f800001u)) == 0x7fc0); /* sNaN -> quiet NaN */
    CHECK(kiln_fp32_to_bf16(bitsf(0xffc12345u)) == 0xffc1);
    CHECK(kiln_fp32_to_bf16(-0.0f) == 0x8000);
}

/* Deterministic pseudo-random bytes. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint8_t rnd8(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint8_t)(rng_state >> 24);
}

static void test_block_matches_whole(void) {
    static uint8_t src[4 * 210];
    static float a[4 * 256], b[256];
    for (int t = 0; t < KILN_DTYPE_COUNT; t++) {
        const kiln_dtype_traits *tr = kiln_dtype_get_traits((kiln_dtype)t);
        for (size_t i = 0; i < sizeof src; i++) src[i] = rnd8();
        if (t == KILN_DTYPE_F32 || t == KILN_DTYPE_F16 || t == KILN_DTYPE_BF16) {
            /* keep plain floats finite: clear the top exponent bit of every element */
            for (int i = 0; i < 4; i++) src[i * tr->type_size + tr->type_size - 1] &= 0x3f;
        } else if (tr->is_quantized) { /* finite f16 scales: clear bit 14 of each f16 */
            int offs[2] = {1, 3};
            int n_offs = (t == KILN_DTYPE_Q4_1 || t == KILN_DTYPE_Q5_1 || t == KILN_DTYPE_Q4_K ||
                          t == KILN_DTYPE_Q5_K) ? 2 : 1;
            if (t == KILN_DTYPE_Q6_K) offs[0] = 209;
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < n_offs; k++) src[i * tr->type_size + offs[k]] &= 0xbf;
        }
        kiln_dequantize((kiln_dtype)t, src, a, 4 * tr->block_size);
        int bad = 0;
        for (int i = 0; i < 4; i++) {
            kiln_dequantize_block((kiln_dtype)t, src + i * tr->type_size, b);
            for (int j = 0; j < tr->block_size; j++)
                if (fbits(a[i * tr->block_size + j]) != fbits(b[j])) bad++;
        }
        CHECK_MSG(bad == 0, "%s: %d block values differ from kiln_dequantize", tr->name, bad);
    }
}

/* Hand-made blocks with known values (the layouts of tensor.c's header comment). */
static void test_known_blocks(void) {
    uint8_t blk[34];
    float y[32];
    /* q8_0: d = 0.5, qs[j] = j - 16 */
    blk[0] = 0x00, blk[1] = 0x38;
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(j - 16);
    kiln_dequantize(KILN_DTYPE_Q8_0, blk, y, 32);
    int bad = 0;
    for (int j = 0; j < 32; j++) bad += y[j] != 0.5f * (float)(j - 16);
    CHECK(bad == 0);
    /* q4_1: d = 2, m = -1; qs[j] = j | (15 - j) << 4 */
    blk[0] = 0x00, blk[1] = 0x40, blk[2] = 0x00, blk[3] = 0xbc;
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)(j | ((15 - j) << 4));
    kiln_dequantize(KILN_DTYPE_Q4_1, blk, y, 32);
    bad = 0;
    for (int j = 0; j < 16; j++) bad += y[j] != 2.0f * j - 1.0f || y[16 + j] != 2.0f * (15 - j) - 1.0f;
    CHECK(bad == 0);
    /* q5_0: d = 1, qh = bit 31 only: element 31 gets the fifth bit */
    memset(blk, 0, sizeof blk);
    blk[1] = 0x3c;
    blk[5] = 0x80;
    kiln_dequantize(KILN_DTYPE_Q5_0, blk, y, 32);
    CHECK(y[0] == -16.0f && y[30] == -16.0f && y[31] == 0.0f);
    /* plain types */
    uint16_t h[3] = {0x3c00, 0xc000, 0x0001};
    kiln_dequantize(KILN_DTYPE_F16, h, y, 3);
    CHECK(y[0] == 1.0f && y[1] == -2.0f && y[2] == ldexpf(1.0f, -24));
    int64_t iv[2] = {-3, ((int64_t)1 << 53) + 1};
    kiln_dequantize(KILN_DTYPE_I64, iv, y, 2);
    CHECK(y[0] == -3.0f && y[1] == 9007199254740992.0f);
}

int main(void) {
    test_traits();
    test_nbytes();
    test_fp16();
    test_bf16();
    test_block_matches_whole();
    test_known_blocks();
    return test_finish("test_dtype");
}
