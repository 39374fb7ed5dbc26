/*
 * cuda_mx.cu -- the exact block formats on the GPU (cuda_mx.h): quantization, one warp per
 * block, in integers on the f32 bits as src/ops/mx.c does; the product on the int8 tensor
 * cores (mma.sync m16n8k32 s8), each output's blocks combined in an int64 and rounded once.
 * Every step is the definition of docs/ARITHMETIC.md ("Exact block formats (mx8, mx16)"),
 * so the results are the CPU's bits (tests/gpu/test_cuda_mx.cu).
 */
#include "cuda_mx.h"
#include "cuda_common.cuh"
#include "cuda_mma.cuh"

#include "../../base/kmath.h"

#include <limits.h>
#include <string.h>

#define MX_FULL 0xffffffffu

/* ---- quantization ------------------------------------------------------------------------ */

/* floor(P / 2^s), s >= 0 (mx.h kiln_mx_floor_shift): an arithmetic right shift, clamped. */
static __device__ __forceinline__ long long mx_floor_shift(long long P, int s) {
    return s >= 63 ? (P < 0 ? -1 : 0) : P >> s;
}

/* One block's term of an output's sum, P 2^d, with d <= 31 and |P| < 2^31: exact for d >= 0,
 * floor(P 2^d) for d < 0 (mx.h kiln_mx_floor_shift's; 0 or -1 from 31 below on). As
 * (P 2^32) >> s with s = 32 - d clamped to 63: one arithmetic right shift of a 64-bit word whose
 * low half is zero, for either sign of d (no branch). */
static __device__ __forceinline__ long long mx_term(int P, int s) {
    return (long long)((unsigned long long)(uint32_t)P << 32) >> (s < 63 ? s : 63);
}

/* splitmix64's finalizer and the stochastic rounding's number (mx.h kiln_mx_random24). */
static __device__ __forceinline__ uint64_t mx_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static __device__ __forceinline__ uint32_t mx_random24(uint64_t seed, uint64_t tensor_id,
                                                       uint64_t index) {
    uint64_t h = mx_mix64(seed + 0x9e3779b97f4a7c15ull);
    h = mx_mix64(h ^ tensor_id);
    h = mx_mix64(h ^ index);
    return (uint32_t)(h >> 40);
}

/* round_half_even(m 2^-t), t >= 1, m < 2^24 (mx.c rne_shift). */
static __device__ __forceinline__ uint32_t mx_rne_shift(uint32_t m, int t) {
    if (t >= 26) return 0;
    uint32_t q = m >> t, rem = m & ((1u << t) - 1), half = 1u << (t - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

/* The block whose element i lane i holds (v; +0 past K) quantized: this lane's mantissa
 * written to q (mx16: the pieces to q and lo) at o * 32 + lane and the block's e to e[o].
 * idx0: the block's first element's index (stochastic rounding). mx.c quantize_block, lane
 * by lane; every lane of the warp takes part. */
template <int F, bool STOCH>
static __device__ __forceinline__ void mx_quantize_block(float v, int lane, size_t o, int8_t *__restrict__ q,
                                                         int8_t *__restrict__ lo, int16_t *__restrict__ e,
                                                         uint64_t seed, uint64_t tensor_id, uint64_t idx0) {
    const int32_t qmax = (1 << (F + 1)) - 1;
    const uint32_t u = __float_as_uint(v), mag = u & 0x7fffffffu;
    const bool nonfinite = __any_sync(MX_FULL, mag >= 0x7f800000u);
    const uint32_t amax = __reduce_max_sync(MX_FULL, mag);
    int32_t mant = 0;
    int E16;
    if (nonfinite) {
        E16 = KILN_MX_EXP_NONFINITE;
    } else if (amax == 0) {
        E16 = KILN_MX_EXP_ZERO;
    } else {
        const int E = amax >= 0x800000u ? (int)(amax >> 23) - 127 : (31 - __clz((int)amax)) - 149;
        E16 = E;
        const uint32_t ef = (u >> 23) & 0xffu, fr = u & 0x7fffffu;
        const uint32_t m = ef ? (fr | 0x800000u) : fr;
        const int x = ef ? (int)ef - 150 : -149, neg = (int)(u >> 31);
        if (m) {
            const int sh = x + F - E; /* q = m 2^sh before rounding */
            if (STOCH) {
                const long long sv = neg ? -(long long)m : (long long)m;
                const long long V = sh + 24 >= 0 ? sv * (1ll << (sh + 24)) : mx_floor_shift(sv, -(sh + 24));
                const uint32_t r = mx_random24(seed, tensor_id, idx0 + (uint64_t)lane);
                const long long qq = mx_floor_shift(V + (long long)r, 24);
                mant = (int32_t)(qq > qmax ? qmax : qq < -qmax ? -qmax : qq);
            } else {
                uint32_t qq = sh >= 0 ? m << sh : mx_rne_shift(m, -sh);
                if (qq > (uint32_t)qmax) qq = (uint32_t)qmax;
                mant = neg ? -(int32_t)qq : (int32_t)qq;
            }
        }
    }
    if (F == KILN_MX8_F) {
        q[o * 32 + lane] = (int8_t)mant;
    } else { /* q = hi 128 + lo, lo in [-64, 63] (mx.c) */
        const int32_t hi = (mant + 64 + 8192) / 128 - 64;
        q[o * 32 + lane] = (int8_t)hi;
        lo[o * 32 + lane] = (int8_t)(mant - hi * 128);
    }
    if (lane == 0) e[o] = (int16_t)E16;
}

/* One warp per block b of row j (warps stride over rows * nb blocks); lane i holds element
 * k = 32 b + i (+0 past K). */
template <int F, bool STOCH>
static __global__ void __launch_bounds__(256)
mx_quantize_kernel(int8_t *__restrict__ q, int8_t *__restrict__ lo, int16_t *__restrict__ e,
                   const float *__restrict__ a, int64_t s_row, int64_t s_col, int64_t rows,
                   int64_t K, int64_t nb, uint64_t seed, uint64_t tensor_id) {
    const int lane = threadIdx.x & 31;
    const int64_t n_warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t wb = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; wb < rows * nb;
         wb += n_warps) {
        const int64_t j = wb / nb, b = wb - j * nb, k = b * 32 + lane;
        const float v = k < K ? a[j * s_row + k * s_col] : 0.0f;
        mx_quantize_block<F, STOCH>(v, lane, (size_t)(j * nb + b), q, lo, e, seed, tensor_id,
                                    (uint64_t)j * (uint64_t)K + (uint64_t)(b * 32));
    }
}

/* A source read down its columns (s_row = 1: element (j, k) at a[j + k * s_col], the
 * backward's W^T, dy^T and x^T): a CTA takes 32 rows j by one block of 32 k through a shared
 * tile, read along j (consecutive lanes, consecutive addresses) and quantized along k, warp w
 * quantizing rows w, w + 8, ... of the 32 (the bits of mx_quantize_kernel). */
template <int F, bool STOCH>
static __global__ void __launch_bounds__(256)
mx_quantize_cols_kernel(int8_t *__restrict__ q, int8_t *__restrict__ lo, int16_t *__restrict__ e,
                        const float *__restrict__ a, int64_t s_col, int64_t rows, int64_t K, int64_t nb,
                        uint64_t seed, uint64_t tensor_id) {
    __shared__ float tile[32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row_tiles = (rows + 31) / 32;
    for (int64_t t = blockIdx.x; t < row_tiles * nb; t += gridDim.x) {
        const int64_t j0 = (t % row_tiles) * 32, b = t / row_tiles, k0 = b * 32;
        for (int i = warp; i < 32; i += 8) { /* tile[i][l] = element (j0 + l, k0 + i) */
            const int64_t j = j0 + lane, k = k0 + i;
            tile[i][lane] = j < rows && k < K ? a[j + k * s_col] : 0.0f;
        }
        __syncthreads();
        for (int r = warp; r < 32; r += 8) {
            const int64_t j = j0 + r;
            if (j >= rows) break; /* the warp's later rows are past the end too */
            mx_quantize_block<F, STOCH>(tile[lane][r], lane, (size_t)(j * nb + b), q, lo, e, seed, tensor_id,
                                        (uint64_t)j * (uint64_t)K + (uint64_t)k0);
        }
        __syncthreads(); /* the tile is the next one's */
    }
}

/* rmsnorm(x) * w quantized (nearest): one CTA per row (striding), its first half-warp taking
 * the row's scale r exactly as kiln_cuda_rmsnorm does (lane j's fmaf chain over elements
 * j + 16k, the lane-16 tree, kiln_rms_scale), then every warp quantizing blocks of
 * (x[i] * r) * w[i] (rmsnorm's two roundings): the bits of kiln_cuda_rmsnorm then
 * mx_quantize_kernel. */
template <int F>
static __global__ void __launch_bounds__(256)
mx_quantize_norm_kernel(int8_t *__restrict__ q, int8_t *__restrict__ lo, int16_t *__restrict__ e,
                        const float *__restrict__ x, const float *__restrict__ w, float eps, int64_t rows,
                        int64_t K, int64_t nb) {
    __shared__ float s_r;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
        const float *xr = x + j * K;
        if (threadIdx.x < 16) {
            float acc = 0.0f;
            for (int64_t i = threadIdx.x; i < K; i += 16) acc = __fmaf_rn(xr[i], xr[i], acc);
            const float sum = lane16_tree(acc, 0x0000ffffu);
            if (threadIdx.x == 0) s_r = kiln_rms_scale(sum, (int)K, eps);
        }
        __syncthreads();
        const float r = s_r;
        for (int64_t b = warp; b < nb; b += (int64_t)(blockDim.x >> 5)) {
            const int64_t k = b * 32 + lane;
            const float v = k < K ? __fmul_rn(__fmul_rn(xr[k], r), w[k]) : 0.0f;
            mx_quantize_block<F, false>(v, lane, (size_t)(j * nb + b), q, lo, e, 0, 0, 0);
        }
        __syncthreads(); /* s_r is the next row's */
    }
}

/* ---- the one rounding (mx.c kiln_mx_round) ------------------------------------------------ */

static __device__ __forceinline__ uint64_t mx_rne_shift64(uint64_t v, int t) {
    if (t >= 64) return 0;
    uint64_t q = v >> t, rem = v & ((1ull << t) - 1), half = 1ull << (t - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

/* m 2^p exactly, for m 2^p representable in f32 (m < 2^25): in double, then narrowed (exact). */
static __device__ __forceinline__ float mx_scale_exact(uint64_t m, int p) {
    const double two_p = __longlong_as_double((long long)(p + 1023) << 52); /* p in [-1022, 1023] */
    return __double2float_rn(__dmul_rn((double)m, two_p));
}

static __device__ float mx_round(long long S, int p) {
    if (S == 0) return 0.0f;
    if (p >= -126 && p <= 63) /* (float)S, one RNE rounding, then an exact scaling */
        return __fmul_rn(__ll2float_rn(S), __uint_as_float((uint32_t)(p + 127) << 23));
    const int neg = S < 0;
    const uint64_t mag = neg ? 0ull - (uint64_t)S : (uint64_t)S;
    const int msb = 63 - __clzll((long long)mag);
    float r;
    if (msb + p >= -126) {
        uint64_t m = mag;
        int t = 0;
        if (msb > 23) {
            t = msb - 23;
            m = mx_rne_shift64(mag, t);
        }
        const int top = 63 - __clzll((long long)m);
        r = top + t + p >= 128 ? __uint_as_float(0x7f800000u) : mx_scale_exact(m, t + p);
    } else { /* subnormal: a multiple of 2^-149, rounded once */
        const int sh = p + 149;
        const uint64_t m = sh >= 0 ? mag << sh : mx_rne_shift64(mag, -sh);
        r = mx_scale_exact(m, -149);
    }
    return neg ? -r : r;
}

/* ---- the product ------------------------------------------------------------------------- */

/* D = A(16x32, row) B(32x8, col) + C in s32. Fragments (PTX ISA, m16n8k32 .s8), with
 * g = lane / 4, t = lane % 4: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..],
 * a3 = A[g+8][16+4t..]; b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]; d0, d1 = D[g][2t, 2t+1],
 * d2, d3 = D[g+8][2t, 2t+1]. */
static __device__ __forceinline__ void mma_s8(int d[4], const uint32_t a[4], uint32_t b0,
                                              uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t ld_s8x4(const int8_t *p) {
    return (uint32_t)__ldg((const int *)p);
}

typedef struct mx_mm_args {
    const int8_t *xq, *xlo, *wq, *wlo;
    const int16_t *xe, *we;
    int64_t N, R, nb;
    int64_t kb_per; /* blocks per split (gridDim.z splits) */
    float *out;
    int64_t ldo;
    const float *bias, *res;
    int accumulate;
    unsigned long long *ws_S; /* split: (N, R) sums, zeroed; NULL unsplit */
    int *ws_m;                /* split: (N, R) largest exponent sum, INT_MIN none, INT_MAX bad */
    int *ws_cnt;              /* split: per tile, the CTAs done (the last one rounds) */
} mx_mm_args;

/* The f32 result of an output from its sum S, its largest exponent sum m (INT_MIN: no
 * contributing block, INT_MAX: a non-finite row) and the epilogue. */
template <int F, int SH>
static __device__ __forceinline__ void mx_store(const mx_mm_args &p, int64_t n, int64_t r,
                                                long long S, int m) {
    float v = m == INT_MAX ? __uint_as_float(0x7fc00000u)
              : m == INT_MIN ? 0.0f
                             : mx_round(S, m - 2 * F - SH);
    float *o = p.out + n * p.ldo + r;
    if (p.accumulate) {
        v = __fadd_rn(*o, v);
    } else {
        if (p.bias) v = __fadd_rn(v, p.bias[r]);
        if (p.res) v = __fadd_rn(v, p.res[n * p.ldo + r]);
    }
    *o = v;
}

/* 9 to 32 rows of x (NT = 4). A CTA: 4 warps along R (16 rows of W each, 64 in all) by 8 NT
 * rows of x; gridDim.z splits the blocks. Pass 1 walks every block's exponents for each output's largest exponent sum
 * over the contributing blocks (and its rows' non-finite marks); pass 2 walks the split's
 * blocks: one MMA (mx16: four) per block and 8-row tile, each P_k shifted into its output's
 * int64 sum by e_k - base. */
template <int KIND, int NT>
static __global__ void __launch_bounds__(128) mx_matmul_kernel(const mx_mm_args p) {
    constexpr int F = KIND == KILN_MX8 ? KILN_MX8_F : KILN_MX16_F;
    constexpr int SH = KIND == KILN_MX8 ? KILN_MX8_SH : KILN_MX16_SH;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int64_t nb = p.nb;
    const int64_t ra = (int64_t)blockIdx.x * 64 + warp * 16 + g, rb = ra + 8;
    const int64_t n0 = (int64_t)blockIdx.y * (8 * NT);
    const bool va = ra < p.R, vb = rb < p.R;
    /* this thread's outputs: rows ra (h = 0, 1) and rb (h = 2, 3), columns nc[j][h & 1] */
    int64_t nc[NT][2];
    bool vc[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++)
        for (int c = 0; c < 2; c++) {
            nc[j][c] = n0 + 8 * j + 2 * t + c;
            vc[j][c] = nc[j][c] < p.N;
        }
    const int16_t *wea = p.we + (va ? ra : 0) * nb, *web = p.we + (vb ? rb : 0) * nb;

    /* pass 1: largest Ex + Ew over blocks where neither is a zero block; non-finite rows */
    int sm[NT][4];
    bool bad_w[2] = {false, false}, bad_x[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        bad_x[j][0] = bad_x[j][1] = false;
        for (int h = 0; h < 4; h++) sm[j][h] = INT_MIN;
    }
    for (int64_t k = 0; k < nb; k++) {
        const int ew[2] = {va ? wea[k] : KILN_MX_EXP_ZERO, vb ? web[k] : KILN_MX_EXP_ZERO};
        bad_w[0] |= ew[0] == KILN_MX_EXP_NONFINITE;
        bad_w[1] |= ew[1] == KILN_MX_EXP_NONFINITE;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int ex = vc[j][c] ? p.xe[nc[j][c] * nb + k] : KILN_MX_EXP_ZERO;
                bad_x[j][c] |= ex == KILN_MX_EXP_NONFINITE;
                if (ex == KILN_MX_EXP_ZERO) continue;
#pragma unroll
                for (int h2 = 0; h2 < 2; h2++)
                    if (ew[h2] != KILN_MX_EXP_ZERO) sm[j][2 * h2 + c] = max(sm[j][2 * h2 + c], ew[h2] + ex);
            }
    }
    /* d = Ex + Ew + dbase = e_k - base, dbase = SH - smax */
    int dbase[NT][4];
    long long S[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
        for (int h = 0; h < 4; h++) {
            dbase[j][h] = sm[j][h] == INT_MIN ? 0 : SH - sm[j][h];
            S[j][h] = 0;
        }

    /* pass 2: the split's blocks */
    const int64_t k0 = (int64_t)blockIdx.z * p.kb_per;
    const int64_t k1 = k0 + p.kb_per < nb ? k0 + p.kb_per : nb;
    const int8_t *wqa = p.wq + (size_t)(va ? ra : 0) * nb * 32 + 4 * t;
    const int8_t *wqb = p.wq + (size_t)(vb ? rb : 0) * nb * 32 + 4 * t;
    for (int64_t k = k0; k < k1; k++) {
        uint32_t a[4], al[4] = {0, 0, 0, 0};
        const size_t ko = (size_t)k * 32;
        a[0] = va ? ld_s8x4(wqa + ko) : 0u;
        a[1] = vb ? ld_s8x4(wqb + ko) : 0u;
        a[2] = va ? ld_s8x4(wqa + ko + 16) : 0u;
        a[3] = vb ? ld_s8x4(wqb + ko + 16) : 0u;
        if (KIND == KILN_MX16) {
            const ptrdiff_t dl = p.wlo - p.wq;
            al[0] = va ? ld_s8x4(wqa + dl + ko) : 0u;
            al[1] = vb ? ld_s8x4(wqb + dl + ko) : 0u;
            al[2] = va ? ld_s8x4(wqa + dl + ko + 16) : 0u;
            al[3] = vb ? ld_s8x4(wqb + dl + ko + 16) : 0u;
        }
        const int ew[2] = {va ? wea[k] : KILN_MX_EXP_ZERO, vb ? web[k] : KILN_MX_EXP_ZERO};
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int64_t nB = n0 + 8 * j + g; /* the B fragment's row of x */
            const bool vB = nB < p.N;
            const int8_t *xb = p.xq + ((size_t)(vB ? nB : 0) * nb + k) * 32 + 4 * t;
            const uint32_t b0 = vB ? ld_s8x4(xb) : 0u, b1 = vB ? ld_s8x4(xb + 16) : 0u;
            int P[4];
            if (KIND == KILN_MX8) {
                P[0] = P[1] = P[2] = P[3] = 0;
                mma_s8(P, a, b0, b1);
            } else {
                const int8_t *xl = xb + (p.xlo - p.xq);
                const uint32_t l0 = vB ? ld_s8x4(xl) : 0u, l1 = vB ? ld_s8x4(xl + 16) : 0u;
                int hh[4] = {0, 0, 0, 0}, mid[4] = {0, 0, 0, 0}, ll[4] = {0, 0, 0, 0};
                mma_s8(hh, a, b0, b1);
                mma_s8(mid, a, l0, l1);
                mma_s8(mid, al, b0, b1);
                mma_s8(ll, al, l0, l1);
                /* P = hh 2^14 + (hl + lh) 2^7 + ll: |P| < 2^31, so 32-bit wrapping sums are exact */
#pragma unroll
                for (int h = 0; h < 4; h++)
                    P[h] = (int)((uint32_t)hh[h] * 16384u + (uint32_t)mid[h] * 128u + (uint32_t)ll[h]);
            }
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const int c = h & 1;
                const int ex = vc[j][c] ? p.xe[nc[j][c] * nb + k] : KILN_MX_EXP_ZERO;
                const int d = ew[h >> 1] + ex + dbase[j][h];
                /* a zero block on either side has P = 0; a non-finite row is NaN anyway */
                const long long Pl = P[h];
                S[j][h] += d >= 0 ? Pl << (d < 40 ? d : 40) : mx_floor_shift(Pl, -d);
            }
        }
    }

    /* outputs */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const int c = h & 1;
            const bool vr = h < 2 ? va : vb;
            if (!vr || !vc[j][c]) continue;
            const int64_t r = h < 2 ? ra : rb, n = nc[j][c];
            const int m = bad_w[h >> 1] || bad_x[j][c] ? INT_MAX : sm[j][h];
            if (!p.ws_S) {
                mx_store<F, SH>(p, n, r, S[j][h], m);
            } else {
                if (S[j][h]) atomicAdd(p.ws_S + n * p.R + r, (unsigned long long)S[j][h]);
                if (blockIdx.z == 0) p.ws_m[n * p.R + r] = m;
            }
        }
    if (!p.ws_S) return;
    /* split: the tile's last CTA to finish rounds its outputs and leaves the scratch zeroed */
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    int *count = p.ws_cnt + blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) last = atomicAdd(count, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const int c = h & 1;
            const bool vr = h < 2 ? va : vb;
            if (!vr || !vc[j][c]) continue;
            const int64_t r = h < 2 ? ra : rb, n = nc[j][c], o = n * p.R + r;
            const long long Sum = (long long)__ldcg(p.ws_S + o);
            const int m = __ldcg(p.ws_m + o);
            p.ws_S[o] = 0;
            p.ws_m[o] = 0;
            mx_store<F, SH>(p, n, r, Sum, m);
        }
    if (threadIdx.x == 0) *count = 0;
}

/* ---- the product for up to 8 rows of x (decode): a warp per row of W -------------------------
 *
 * Lane l takes blocks l, l + 32, ... of row r of W: pass 1 finds each x row's largest exponent
 * sum over the contributing blocks (the definition's smax) and the non-finite rows, the maxima
 * then across the warp; pass 2 reads the lane's blocks of W once (32 contiguous bytes a block
 * and plane: a warp reads the row in 1 KB runs), forms every P_k with dp4a, shifts it by
 * e_k - base into the x row's int64 sum, and the sums are added across the lanes (integers:
 * any order). Lane c rounds x row c's output. The operands are read once from DRAM, W in
 * 16-byte loads, so the product runs at the memory's rate rather than the MMA kernel's. */
template <int KIND, int NX>
static __global__ void __launch_bounds__(256) mx_gemv_kernel(const mx_mm_args p) {
    constexpr int F = KIND == KILN_MX8 ? KILN_MX8_F : KILN_MX16_F;
    constexpr int SH = KIND == KILN_MX8 ? KILN_MX8_SH : KILN_MX16_SH;
    const int lane = threadIdx.x & 31;
    const int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= p.R) return; /* the whole warp */
    const int64_t nb = p.nb;
    const int n = (int)p.N; /* <= NX */
    const int16_t *we = p.we + r * nb;
    int sm[NX];
    bool bad_x[NX], bad_w = false;
#pragma unroll
    for (int c = 0; c < NX; c++) {
        sm[c] = INT_MIN;
        bad_x[c] = false;
    }
    for (int64_t k = lane; k < nb; k += 32) {
        const int ew = we[k];
        bad_w |= ew == KILN_MX_EXP_NONFINITE;
#pragma unroll
        for (int c = 0; c < NX; c++)
            if (c < n) {
                const int ex = p.xe[c * nb + k];
                bad_x[c] |= ex == KILN_MX_EXP_NONFINITE;
                if (ew != KILN_MX_EXP_ZERO && ex != KILN_MX_EXP_ZERO) sm[c] = max(sm[c], ew + ex);
            }
    }
    bad_w = __any_sync(MX_FULL, bad_w);
#pragma unroll
    for (int c = 0; c < NX; c++) {
        sm[c] = __reduce_max_sync(MX_FULL, sm[c]);
        bad_x[c] = __any_sync(MX_FULL, bad_x[c]);
    }
    long long S[NX];
#pragma unroll
    for (int c = 0; c < NX; c++) S[c] = 0;
    for (int64_t k = lane; k < nb; k += 32) {
        const int4 *wq = (const int4 *)(p.wq + (r * nb + k) * 32);
        const int4 w0 = __ldg(wq), w1 = __ldg(wq + 1);
        int4 l0 = make_int4(0, 0, 0, 0), l1 = l0;
        if (KIND == KILN_MX16) {
            const int4 *wl = (const int4 *)(p.wlo + (r * nb + k) * 32);
            l0 = __ldg(wl);
            l1 = __ldg(wl + 1);
        }
        const int ew = we[k];
        if (ew == KILN_MX_EXP_ZERO) continue; /* P_k = 0 for every x row */
#pragma unroll
        for (int c = 0; c < NX; c++) {
            if (c >= n) continue;
            const int ex = p.xe[c * nb + k];
            if (ex == KILN_MX_EXP_ZERO) continue;
            const int4 *xq = (const int4 *)(p.xq + (c * nb + k) * 32);
            const int4 x0 = __ldg(xq), x1 = __ldg(xq + 1);
            int P;
            if (KIND == KILN_MX8) {
                P = __dp4a(x0.x, w0.x, 0);
                P = __dp4a(x0.y, w0.y, P);
                P = __dp4a(x0.z, w0.z, P);
                P = __dp4a(x0.w, w0.w, P);
                P = __dp4a(x1.x, w1.x, P);
                P = __dp4a(x1.y, w1.y, P);
                P = __dp4a(x1.z, w1.z, P);
                P = __dp4a(x1.w, w1.w, P);
            } else {
                const int4 *xl = (const int4 *)(p.xlo + (c * nb + k) * 32);
                const int4 y0 = __ldg(xl), y1 = __ldg(xl + 1);
                int hh = 0, mid = 0, ll = 0;
                hh = __dp4a(x0.x, w0.x, hh), mid = __dp4a(x0.x, l0.x, mid), mid = __dp4a(y0.x, w0.x, mid), ll = __dp4a(y0.x, l0.x, ll);
                hh = __dp4a(x0.y, w0.y, hh), mid = __dp4a(x0.y, l0.y, mid), mid = __dp4a(y0.y, w0.y, mid), ll = __dp4a(y0.y, l0.y, ll);
                hh = __dp4a(x0.z, w0.z, hh), mid = __dp4a(x0.z, l0.z, mid), mid = __dp4a(y0.z, w0.z, mid), ll = __dp4a(y0.z, l0.z, ll);
                hh = __dp4a(x0.w, w0.w, hh), mid = __dp4a(x0.w, l0.w, mid), mid = __dp4a(y0.w, w0.w, mid), ll = __dp4a(y0.w, l0.w, ll);
                hh = __dp4a(x1.x, w1.x, hh), mid = __dp4a(x1.x, l1.x, mid), mid = __dp4a(y1.x, w1.x, mid), ll = __dp4a(y1.x, l1.x, ll);
                hh = __dp4a(x1.y, w1.y, hh), mid = __dp4a(x1.y, l1.y, mid), mid = __dp4a(y1.y, w1.y, mid), ll = __dp4a(y1.y, l1.y, ll);
                hh = __dp4a(x1.z, w1.z, hh), mid = __dp4a(x1.z, l1.z, mid), mid = __dp4a(y1.z, w1.z, mid), ll = __dp4a(y1.z, l1.z, ll);
                hh = __dp4a(x1.w, w1.w, hh), mid = __dp4a(x1.w, l1.w, mid), mid = __dp4a(y1.w, w1.w, mid), ll = __dp4a(y1.w, l1.w, ll);
                P = (int)((uint32_t)hh * 16384u + (uint32_t)mid * 128u + (uint32_t)ll);
            }
            const int d = ew + ex - (sm[c] - SH); /* e_k - base <= SH */
            S[c] += d >= 0 ? (long long)((unsigned long long)(long long)P << d) : mx_floor_shift(P, -d);
        }
    }
#pragma unroll
    for (int c = 0; c < NX; c++)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) S[c] += __shfl_xor_sync(MX_FULL, S[c], o);
#pragma unroll
    for (int c = 0; c < NX; c++)
        if (c < n && lane == c) mx_store<F, SH>(p, c, r, S[c], bad_w || bad_x[c] ? INT_MAX : sm[c]);
}

/* ---- the product for many rows of x (prefill, training): tiles through shared memory ---------
 *
 * A CTA of 8 warps (4 along W, 2 along x) computes a tile of MXG_BR rows of W by
 * mxg_layout::BN rows of x; a warp covers 32 rows of W by 8 WNT rows of x (2 m16 by WNT n8
 * MMA tiles: WNT = 4 for mx8, 2 for mx16, whose four piece products need the registers), so
 * a thread holds 8 WNT outputs. First each thread walks every block's exponents for its
 * outputs' smax (the definition's largest exponent sum over the contributing blocks; zero
 * blocks enter as MXG_EXP_ZERO, whose sums never win against a contributing pair), which
 * fixes each output's base. Then the blocks stream through shared memory MXG_KB at a time
 * (cp.async, two stages; the fragments read with ldmatrix), and each block's P_k is added as
 * P_k << d (d = Ex + Ew - smax + SH <= SH, a funnel shift) or, for a far-below block (d < 0),
 * as its floor (an arithmetic right shift), exactly the definition's T_k. */
#define MXG_BR 128
#define MXG_KB 4
#define MXG_ROWB (MXG_KB * 32 + 16) /* a staged row: 8 rows an ldmatrix reads fall in 8 bank groups */
#define MXG_EXP_ZERO (-30000)       /* a zero block's exponent here: a sum with it is below -29000 */
#define MXG_NONE (-100000)          /* dbase of an output with no contributing block (d < 0 always) */
#define MXG_MIN_N 33                /* fewer rows of x take mx_matmul_kernel */

template <int KIND>
struct mxg_layout {
    static constexpr int WNT = KIND == KILN_MX16 ? 2 : 4; /* n8 tiles a warp */
    static constexpr int BN = 2 * 8 * WNT;                /* rows of x a CTA */
    static constexpr int ROWS = MXG_BR + BN;              /* staged rows: W's, then x's */
    static constexpr int planes = KIND == KILN_MX16 ? 2 : 1;
    static constexpr int plane = ROWS * MXG_ROWB;
    static constexpr int stage = plane * planes + MXG_KB * ROWS * 4; /* q planes, then e[KB][ROWS] */
    static constexpr int bytes = 2 * stage;
};

/* 16 bytes global -> shared, or 16 zero bytes when !ok (cp.async's src-size 0). */
static __device__ __forceinline__ void cp_async16_or_zero(void *dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(ok ? 16 : 0));
}

/* Block exponents as the kernel adds them: finite blocks' lie within +-200; the non-finite
 * marker enters as +MXG_EXP16 (its outputs are NaN whatever their sums; clamped so that every
 * output's terms keep d <= SH), a zero block as MXG_EXP_ZERO in the main loop and as
 * -MXG_EXP16 in the exponent pass's 16-bit lanes (whose sums must not wrap). */
#define MXG_EXP16 16000
static __device__ __forceinline__ int mxg_exp(int e) {
    return e == KILN_MX_EXP_ZERO ? MXG_EXP_ZERO : e < MXG_EXP16 ? e : MXG_EXP16;
}
static __device__ __forceinline__ int mxg_exp16(int e) {
    return e == KILN_MX_EXP_ZERO ? -MXG_EXP16 : e < MXG_EXP16 ? e : MXG_EXP16;
}

template <int KIND>
static __global__ void __launch_bounds__(256, 1) mx_gemm_kernel(const mx_mm_args p) {
    constexpr int F = KIND == KILN_MX8 ? KILN_MX8_F : KILN_MX16_F;
    constexpr int SH = KIND == KILN_MX8 ? KILN_MX8_SH : KILN_MX16_SH;
    typedef mxg_layout<KIND> L;
    constexpr int WNT = L::WNT, BN = L::BN, ROWS = L::ROWS;
    extern __shared__ __align__(16) unsigned char mxg_sm[];
    __shared__ unsigned char s_bad[ROWS]; /* a staged row holds a non-finite block */
    __shared__ bool s_last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp & 3, wn = warp >> 2; /* the warp's rows of W: wm * 32.., of x: wn * 8 WNT.. */
    const int64_t r0 = (int64_t)blockIdx.x * MXG_BR, n0 = (int64_t)blockIdx.y * BN, nb = p.nb;

    for (int row = warp; row < ROWS; row += 8) {
        const bool isx = row >= MXG_BR;
        const int64_t j = isx ? n0 + (row - MXG_BR) : r0 + row;
        const bool valid = j < (isx ? p.N : p.R);
        const int16_t *e = (isx ? p.xe : p.we) + (valid ? j : 0) * nb;
        bool bad = false;
        if (valid)
            for (int64_t k = lane; k < nb; k += 32) bad |= e[k] == KILN_MX_EXP_NONFINITE;
        bad = __any_sync(MX_FULL, bad);
        if (lane == 0) s_bad[row] = bad;
    }

    /* this thread's outputs: o = (mt * WNT + nt) * 4 + h is W row wr(mt, h >> 1) and x row
     * xc(nt, h & 1) of the tile */
    int wr[2][2], xc[WNT][2];
    bool wv[2][2], xv[WNT][2];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            wr[mt][hh] = wm * 32 + mt * 16 + g + 8 * hh;
            wv[mt][hh] = r0 + wr[mt][hh] < p.R;
        }
#pragma unroll
    for (int nt = 0; nt < WNT; nt++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            xc[nt][c] = wn * 8 * WNT + nt * 8 + 2 * t + c;
            xv[nt][c] = n0 + xc[nt][c] < p.N;
        }

    /* the exponent pass: smax over every block (a CTA of a split walks them all too), two
     * outputs a word: s16x2 lanes (x rows xc[nt][0], xc[nt][1]) of one W row, max(ew + ex, smax)
     * per lane (Hopper's add.s16x2 / max.s16x2; mxg_exp16), so no lane's sum wraps and a sum
     * with a zero block stays below -MXG_EXP16 / 2. */
    int dbase[2][WNT][4];
    {
        unsigned smx[2][WNT][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < WNT; nt++) smx[mt][nt][0] = smx[mt][nt][1] = 0x80008000u;
        const int16_t *wep[2][2], *xep[WNT][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) wep[mt][hh] = p.we + (wv[mt][hh] ? r0 + wr[mt][hh] : 0) * nb;
#pragma unroll
        for (int nt = 0; nt < WNT; nt++)
#pragma unroll
            for (int c = 0; c < 2; c++) xep[nt][c] = p.xe + (xv[nt][c] ? n0 + xc[nt][c] : 0) * nb;
        for (int64_t k = 0; k < nb; k++) {
            unsigned ew2[2][2], ex2[WNT];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
                    ew2[mt][hh] = 0x10001u * (uint16_t)(wv[mt][hh] ? mxg_exp16(__ldg(wep[mt][hh] + k)) : -MXG_EXP16);
#pragma unroll
            for (int nt = 0; nt < WNT; nt++) {
                const int lo = xv[nt][0] ? mxg_exp16(__ldg(xep[nt][0] + k)) : -MXG_EXP16;
                const int hi = xv[nt][1] ? mxg_exp16(__ldg(xep[nt][1] + k)) : -MXG_EXP16;
                ex2[nt] = (uint16_t)lo | (unsigned)(uint16_t)hi << 16;
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < WNT; nt++)
#pragma unroll
                    for (int hh = 0; hh < 2; hh++)
                        smx[mt][nt][hh] = __viaddmax_s16x2(ew2[mt][hh], ex2[nt], smx[mt][nt][hh]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < WNT; nt++)
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    const unsigned v = smx[mt][nt][h >> 1];
                    const int sm = (int16_t)(uint16_t)(h & 1 ? v >> 16 : v & 0xffffu);
                    dbase[mt][nt][h] = sm < -MXG_EXP16 / 2 ? 2 * MXG_EXP_ZERO : sm; /* none: below -29000 */
                }
    }
    /* smax below -29000: no contributing block (the output is +0); a block's term is P 2^d with
     * d = Ex + Ew + dbase <= SH, taken by mx_term as a shift by 32 - d = sbase - Ex - Ew: dbase[]
     * holds sbase = 32 - dbase from here on */
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < WNT; nt++)
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const int sm = dbase[mt][nt][h];
                dbase[mt][nt][h] = 32 - (sm < -29000 ? MXG_NONE : SH - sm);
            }
    __syncthreads(); /* s_bad */

    const int64_t kb0 = (int64_t)blockIdx.z * p.kb_per;
    const int64_t kb1 = kb0 + p.kb_per < nb ? kb0 + p.kb_per : nb;
    const int nst = (int)((kb1 - kb0 + MXG_KB - 1) / MXG_KB);

    /* stage loads: the planes by cp.async (zeros past the rows and the split's blocks), the
     * exponents through registers (fetched before a stage's compute, stored after it) */
    constexpr int CH = MXG_KB * 2; /* 16-byte chunks of a staged row */
    auto load_q = [&](int buf, int64_t kbs) {
        unsigned char *st = mxg_sm + buf * L::stage;
#pragma unroll
        for (int pl = 0; pl < L::planes; pl++)
#pragma unroll
            for (int i = tid; i < ROWS * CH; i += 256) {
                const int row = i / CH, c = i - row * CH;
                const bool isx = row >= MXG_BR;
                const int64_t j = isx ? n0 + (row - MXG_BR) : r0 + row, kb = kbs + c / 2;
                const bool ok = j < (isx ? p.N : p.R) && kb < kb1;
                const int8_t *base = isx ? (pl ? p.xlo : p.xq) : (pl ? p.wlo : p.wq);
                cp_async16_or_zero(st + pl * L::plane + row * MXG_ROWB + c * 16,
                                   base + (ok ? (j * nb + kb) * 32 + (c & 1) * 16 : 0), ok);
            }
    };
    constexpr int NE = (MXG_KB * ROWS + 255) / 256; /* exponents a thread moves per stage */
    int pe[NE];
    auto fetch_e = [&](int64_t kbs) {
#pragma unroll
        for (int i = 0; i < NE; i++) {
            const int idx = tid + i * 256, kk = idx / ROWS, row = idx - kk * ROWS;
            const bool isx = row >= MXG_BR;
            const int64_t j = isx ? n0 + (row - MXG_BR) : r0 + row, kb = kbs + kk;
            const bool ok = idx < MXG_KB * ROWS && j < (isx ? p.N : p.R) && kb < kb1;
            pe[i] = ok ? mxg_exp((isx ? p.xe : p.we)[j * nb + kb]) : MXG_EXP_ZERO;
        }
    };
    auto store_e = [&](int buf) {
        int *es = (int *)(mxg_sm + buf * L::stage + L::planes * L::plane);
#pragma unroll
        for (int i = 0; i < NE; i++)
            if (tid + i * 256 < MXG_KB * ROWS) es[tid + i * 256] = pe[i];
    };

    long long S[2][WNT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < WNT; nt++)
#pragma unroll
            for (int h = 0; h < 4; h++) S[mt][nt][h] = 0;

    if (nst > 0) {
        load_q(0, kb0);
        fetch_e(kb0);
        store_e(0);
    }
    cp_async_commit();
    for (int s = 0; s < nst; s++) {
        const int buf = s & 1;
        const bool more = s + 1 < nst;
        if (more) {
            load_q(buf ^ 1, kb0 + (int64_t)(s + 1) * MXG_KB);
            fetch_e(kb0 + (int64_t)(s + 1) * MXG_KB);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned char *st = mxg_sm + buf * L::stage;
        const int *es = (const int *)(st + L::planes * L::plane);
        const int64_t left = kb1 - (kb0 + (int64_t)s * MXG_KB);
        const int nv = left < MXG_KB ? (int)left : MXG_KB;
        for (int kk = 0; kk < nv; kk++) {
            uint32_t a[2][4], al[2][4], b[WNT / 2][4], bl[WNT / 2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const unsigned char *pa = st + (wm * 32 + mt * 16 + (lane & 15)) * MXG_ROWB + kk * 32 + (lane >> 4) * 16;
                ldsm_x4(a[mt], smem_u32(pa));
                if (KIND == KILN_MX16) ldsm_x4(al[mt], smem_u32(pa + L::plane));
            }
#pragma unroll
            for (int np = 0; np < WNT / 2; np++) {
                const int row = MXG_BR + wn * 8 * WNT + np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
                const unsigned char *pb = st + row * MXG_ROWB + kk * 32 + ((lane >> 3) & 1) * 16;
                ldsm_x4(b[np], smem_u32(pb));
                if (KIND == KILN_MX16) ldsm_x4(bl[np], smem_u32(pb + L::plane));
            }
            const int *ek = es + kk * ROWS;
            int ew[2][2], ex[WNT][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) ew[mt][hh] = ek[wr[mt][hh]];
#pragma unroll
            for (int nt = 0; nt < WNT; nt++)
#pragma unroll
                for (int c = 0; c < 2; c++) ex[nt][c] = ek[MXG_BR + xc[nt][c]];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < WNT; nt++) {
                    const uint32_t b0 = b[nt >> 1][(nt & 1) * 2], b1 = b[nt >> 1][(nt & 1) * 2 + 1];
                    int P[4] = {0, 0, 0, 0};
                    if (KIND == KILN_MX8) {
                        mma_s8(P, a[mt], b0, b1);
                    } else {
                        const uint32_t l0 = bl[nt >> 1][(nt & 1) * 2], l1 = bl[nt >> 1][(nt & 1) * 2 + 1];
                        int hh[4] = {0, 0, 0, 0}, mid[4] = {0, 0, 0, 0}, ll[4] = {0, 0, 0, 0};
                        mma_s8(hh, a[mt], b0, b1);
                        mma_s8(mid, a[mt], l0, l1);
                        mma_s8(mid, al[mt], b0, b1);
                        mma_s8(ll, al[mt], l0, l1);
#pragma unroll
                        for (int h = 0; h < 4; h++)
                            P[h] = (int)((uint32_t)hh[h] * 16384u + (uint32_t)mid[h] * 128u + (uint32_t)ll[h]);
                    }
#pragma unroll
                    for (int h = 0; h < 4; h++) /* a zero block: P = 0, d far below; no contributing
                                                 * block: dbase MXG_NONE, d far below too */
                        S[mt][nt][h] += mx_term(P[h], dbase[mt][nt][h] - ew[mt][h >> 1] - ex[nt][h & 1]);
                }
        }
        if (more) store_e(buf ^ 1);
        __syncthreads();
    }

    /* outputs: S[mt][nt][h] is W row r0 + wr[mt][h >> 1], x row n0 + xc[nt][h & 1] */
    if (p.ws_S) {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < WNT; nt++)
#pragma unroll
                for (int h = 0; h < 4; h++)
                    if (wv[mt][h >> 1] && xv[nt][h & 1] && S[mt][nt][h])
                        atomicAdd(p.ws_S + (n0 + xc[nt][h & 1]) * p.R + r0 + wr[mt][h >> 1],
                                  (unsigned long long)S[mt][nt][h]);
        /* split: the tile's last CTA to finish rounds the outputs, its threads the same ones
         * (each CTA knows every output's smax), and leaves the scratch zeroed */
        __threadfence();
        __syncthreads();
        int *count = p.ws_cnt + blockIdx.y * gridDim.x + blockIdx.x;
        if (tid == 0) s_last = atomicAdd(count, 1) == (int)gridDim.z - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < WNT; nt++)
#pragma unroll
            for (int h = 0; h < 4; h++) {
                const int rr = wr[mt][h >> 1], cc = xc[nt][h & 1];
                if (!wv[mt][h >> 1] || !xv[nt][h & 1]) continue;
                const int64_t r = r0 + rr, n = n0 + cc;
                long long Sv = S[mt][nt][h];
                if (p.ws_S) {
                    const int64_t o = n * p.R + r;
                    Sv = (long long)__ldcg(p.ws_S + o);
                    p.ws_S[o] = 0;
                }
                const int db = 32 - dbase[mt][nt][h];
                const int m = s_bad[rr] || s_bad[MXG_BR + cc] ? INT_MAX : db == MXG_NONE ? INT_MIN : SH - db;
                mx_store<F, SH>(p, n, r, Sv, m);
            }
    if (p.ws_S && tid == 0) *(p.ws_cnt + blockIdx.y * gridDim.x + blockIdx.x) = 0;
}

/* ---- launchers --------------------------------------------------------------------------- */

size_t kiln_cuda_mx_bytes(int kind, int64_t rows, int64_t K) {
    const int64_t nb = (K + 31) / 32;
    const size_t plane = (size_t)rows * (size_t)nb * 32, planes = kind == KILN_MX16 ? 2 : 1;
    return plane * planes + (size_t)rows * (size_t)nb * 2 + 256;
}

void kiln_cuda_mx_view(kiln_cuda_mx *m, void *mem, int kind, int64_t rows, int64_t K) {
    memset(m, 0, sizeof *m);
    const int64_t nb = (K + 31) / 32;
    const size_t plane = (size_t)rows * (size_t)nb * 32, planes = kind == KILN_MX16 ? 2 : 1;
    m->kind = kind;
    m->rows = m->cap_rows = rows;
    m->K = K;
    m->nb = nb;
    m->q = (int8_t *)mem;
    m->lo = kind == KILN_MX16 ? (int8_t *)mem + plane : NULL;
    m->e = (int16_t *)((int8_t *)mem + plane * planes);
}

cudaError_t kiln_cuda_mx_alloc(kiln_cuda_mx *m, int kind, int64_t rows, int64_t K) {
    memset(m, 0, sizeof *m);
    if ((kind != KILN_MX8 && kind != KILN_MX16) || rows < 0 || K < 0 || K > KILN_MX_MAX_K)
        return cudaErrorInvalidValue;
    void *mem = NULL;
    cudaError_t e = cudaMalloc(&mem, kiln_cuda_mx_bytes(kind, rows, K));
    if (e != cudaSuccess) return e;
    kiln_cuda_mx_view(m, mem, kind, rows, K);
    m->mem = mem;
    return cudaSuccess;
}

void kiln_cuda_mx_free(kiln_cuda_mx *m) {
    if (!m) return;
    if (m->mem) cudaFree(m->mem);
    memset(m, 0, sizeof *m);
}

cudaError_t kiln_cuda_mx_quantize(cudaStream_t s, kiln_cuda_mx *m, const float *a, int64_t s_row,
                                  int64_t s_col, int stochastic, uint64_t seed, uint64_t tensor_id) {
    if (!m || (m->kind != KILN_MX8 && m->kind != KILN_MX16) || m->rows > m->cap_rows)
        return cudaErrorInvalidValue;
    const int64_t blocks = m->rows * m->nb;
    if (blocks == 0) return cudaSuccess;
    if (!a && m->K > 0) return cudaErrorInvalidValue;
    if (s_row == 1 && s_col != 1) { /* down the columns: through shared tiles */
        const int64_t tiles = (m->rows + 31) / 32 * m->nb;
        const unsigned g = (unsigned)(tiles < 65535 * 8 ? tiles : 65535 * 8);
        if (m->kind == KILN_MX8) {
            if (stochastic)
                mx_quantize_cols_kernel<KILN_MX8_F, true><<<g, 256, 0, s>>>(m->q, m->lo, m->e, a, s_col, m->rows, m->K,
                                                                            m->nb, seed, tensor_id);
            else
                mx_quantize_cols_kernel<KILN_MX8_F, false><<<g, 256, 0, s>>>(m->q, m->lo, m->e, a, s_col, m->rows,
                                                                             m->K, m->nb, seed, tensor_id);
        } else {
            if (stochastic)
                mx_quantize_cols_kernel<KILN_MX16_F, true><<<g, 256, 0, s>>>(m->q, m->lo, m->e, a, s_col, m->rows,
                                                                             m->K, m->nb, seed, tensor_id);
            else
                mx_quantize_cols_kernel<KILN_MX16_F, false><<<g, 256, 0, s>>>(m->q, m->lo, m->e, a, s_col, m->rows,
                                                                              m->K, m->nb, seed, tensor_id);
        }
        return cudaGetLastError();
    }
    const unsigned grid = grid_for(blocks * 32, 256);
    if (m->kind == KILN_MX8) {
        if (stochastic)
            mx_quantize_kernel<KILN_MX8_F, true><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, a, s_row, s_col, m->rows,
                                                                      m->K, m->nb, seed, tensor_id);
        else
            mx_quantize_kernel<KILN_MX8_F, false><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, a, s_row, s_col, m->rows,
                                                                       m->K, m->nb, seed, tensor_id);
    } else {
        if (stochastic)
            mx_quantize_kernel<KILN_MX16_F, true><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, a, s_row, s_col, m->rows,
                                                                       m->K, m->nb, seed, tensor_id);
        else
            mx_quantize_kernel<KILN_MX16_F, false><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, a, s_row, s_col,
                                                                        m->rows, m->K, m->nb, seed, tensor_id);
    }
    return cudaGetLastError();
}

cudaError_t kiln_cuda_mx_quantize_norm(cudaStream_t s, kiln_cuda_mx *m, const float *x, const float *norm_w,
                                       float eps) {
    if (!m || (m->kind != KILN_MX8 && m->kind != KILN_MX16) || m->rows > m->cap_rows || !x || !norm_w ||
        m->K > INT_MAX)
        return cudaErrorInvalidValue;
    if (m->rows == 0 || m->K == 0) return cudaSuccess;
    const unsigned grid = (unsigned)(m->rows < 65535 ? m->rows : 65535);
    if (m->kind == KILN_MX8)
        mx_quantize_norm_kernel<KILN_MX8_F><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, x, norm_w, eps, m->rows, m->K, m->nb);
    else
        mx_quantize_norm_kernel<KILN_MX16_F><<<grid, 256, 0, s>>>(m->q, m->lo, m->e, x, norm_w, eps, m->rows, m->K, m->nb);
    return cudaGetLastError();
}

/* The product's shape, a function of (kind, N, R, nb) only. Up to 8 rows of x (decode):
 * mx_gemv_kernel, a warp per row of W, unsplit; up to MXG_MIN_N - 1: mx_matmul_kernel (x tiles
 * of 32 rows, CTAs of 64 rows of W); more: mx_gemm_kernel's tiles of 128 rows of W by 64 (mx8)
 * or 32 (mx16) rows of x. The blocks are
 * split so that about 2 x 132 (mx_matmul_kernel) or 132 (mx_gemm_kernel: one CTA an SM) CTAs
 * run, with at least 2 blocks (mx_gemm_kernel: 2 stages) a split. */
typedef struct mx_plan {
    int NT; /* 0: mx_gemm_kernel, 1: mx_gemv_kernel, 4: mx_matmul_kernel */
    int64_t gx, gy, splits, kb_per;
} mx_plan;

static mx_plan mx_plan_of(int kind, int64_t N, int64_t R, int64_t nb) {
    mx_plan pl;
    int64_t want, min_per, align;
    if (N >= MXG_MIN_N) {
        const int64_t bn = kind == KILN_MX16 ? mxg_layout<KILN_MX16>::BN : mxg_layout<KILN_MX8>::BN;
        pl.NT = 0;
        pl.gx = (R + MXG_BR - 1) / MXG_BR;
        pl.gy = (N + bn - 1) / bn;
        want = 132, min_per = 2 * MXG_KB, align = MXG_KB;
    } else if (N <= 8) { /* mx_gemv_kernel: a warp per row of W, unsplit */
        pl.NT = 1;
        pl.gx = (R + 7) / 8;
        pl.gy = 1;
        pl.splits = 1;
        pl.kb_per = nb > 0 ? nb : 1;
        return pl;
    } else {
        pl.NT = 4;
        pl.gx = (R + 63) / 64;
        pl.gy = (N + 31) / 32;
        want = 264, min_per = 2, align = 1;
    }
    const int64_t ctas = pl.gx * pl.gy;
    int64_t splits = 1;
    if (ctas < want && nb >= 2 * min_per) {
        splits = (want + ctas - 1) / ctas;
        if (splits > nb / min_per) splits = nb / min_per;
    }
    pl.kb_per = (nb + splits - 1) / splits;
    pl.kb_per = (pl.kb_per + align - 1) / align * align;
    if (pl.kb_per < 1) pl.kb_per = 1;
    pl.splits = nb > 0 ? (nb + pl.kb_per - 1) / pl.kb_per : 1;
    return pl;
}

static size_t mx_ws_bytes(const mx_plan &pl, int64_t N, int64_t R) {
    return pl.splits > 1 ? (size_t)N * (size_t)R * (sizeof(unsigned long long) + sizeof(int)) +
                               (size_t)(pl.gx * pl.gy) * sizeof(int)
                         : 0;
}

size_t kiln_cuda_mx_matmul_ws_bytes(int64_t N, int64_t R, int64_t nb) {
    const size_t a = mx_ws_bytes(mx_plan_of(KILN_MX8, N, R, nb), N, R),
                 b = mx_ws_bytes(mx_plan_of(KILN_MX16, N, R, nb), N, R);
    return a > b ? a : b;
}

template <int KIND, int NT>
static void mx_matmul_launch(cudaStream_t s, const mx_plan &pl, const mx_mm_args &a) {
    mx_matmul_kernel<KIND, NT><<<dim3((unsigned)pl.gx, (unsigned)pl.gy, (unsigned)pl.splits), 128, 0, s>>>(a);
}

template <int KIND>
static void mx_gemv_launch(cudaStream_t s, const mx_plan &pl, const mx_mm_args &a) {
    const dim3 grid((unsigned)pl.gx);
    if (a.N == 1) mx_gemv_kernel<KIND, 1><<<grid, 256, 0, s>>>(a);
    else if (a.N == 2) mx_gemv_kernel<KIND, 2><<<grid, 256, 0, s>>>(a);
    else if (a.N <= 4) mx_gemv_kernel<KIND, 4><<<grid, 256, 0, s>>>(a);
    else mx_gemv_kernel<KIND, 8><<<grid, 256, 0, s>>>(a);
}

template <int KIND>
static cudaError_t mx_gemm_launch(cudaStream_t s, const mx_plan &pl, const mx_mm_args &a) {
    const int bytes = mxg_layout<KIND>::bytes;
    cudaError_t e = cudaFuncSetAttribute(mx_gemm_kernel<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    mx_gemm_kernel<KIND><<<dim3((unsigned)pl.gx, (unsigned)pl.gy, (unsigned)pl.splits), 256, bytes, s>>>(a);
    return cudaSuccess;
}

cudaError_t kiln_cuda_mx_matmul(cudaStream_t s, const kiln_cuda_mx *x, const kiln_cuda_mx *w,
                                float *out, int64_t ldo, const float *bias, const float *res,
                                int accumulate, void *ws) {
    if (!x || !w || x->kind != w->kind || x->K != w->K || ldo < w->rows) return cudaErrorInvalidValue;
    const int64_t N = x->rows, R = w->rows, nb = x->nb;
    if (N <= 0 || R <= 0) return cudaSuccess;
    if (!out || N > 65535ll * 32 || R > (int64_t)INT_MAX * 64) return cudaErrorInvalidValue;
    const mx_plan pl = mx_plan_of(x->kind, N, R, nb);
    if (pl.splits > 1 && !ws) return cudaErrorInvalidValue;
    mx_mm_args a;
    a.xq = x->q;
    a.xlo = x->lo;
    a.wq = w->q;
    a.wlo = w->lo;
    a.xe = x->e;
    a.we = w->e;
    a.N = N;
    a.R = R;
    a.nb = nb;
    a.kb_per = pl.kb_per;
    a.out = out;
    a.ldo = ldo;
    a.bias = bias;
    a.res = res;
    a.accumulate = accumulate;
    a.ws_S = pl.splits > 1 ? (unsigned long long *)ws : NULL;
    a.ws_m = pl.splits > 1 ? (int *)((unsigned long long *)ws + N * R) : NULL;
    a.ws_cnt = pl.splits > 1 ? a.ws_m + N * R : NULL;
    if (pl.NT == 0) {
        const cudaError_t e = x->kind == KILN_MX8 ? mx_gemm_launch<KILN_MX8>(s, pl, a) : mx_gemm_launch<KILN_MX16>(s, pl, a);
        if (e != cudaSuccess) return e;
    } else if (pl.NT == 1) {
        if (x->kind == KILN_MX8) mx_gemv_launch<KILN_MX8>(s, pl, a);
        else mx_gemv_launch<KILN_MX16>(s, pl, a);
    } else if (x->kind == KILN_MX8) {
        mx_matmul_launch<KILN_MX8, 4>(s, pl, a);
    } else {
        mx_matmul_launch<KILN_MX16, 4>(s, pl, a);
    }
    return cudaGetLastError();
}

