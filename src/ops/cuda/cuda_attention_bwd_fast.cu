/*
 * cuda_attention_bwd_fast.cu -- fast-mode attention backward on bf16 tensor cores (contract
 * and the kernels: cuda_attention_bwd_fast.h).
 *
 * Tiles: 4 warps of 16 rows. The dq kernel's rows are 64 queries and it walks the keys in
 * tiles of BW_TILE(HS) (64 for HS 64, 32 for HS 128, which keeps the registers of a thread
 * under 255: q, dout fragments and the dq accumulator grow with HS); the dkv kernel's rows
 * are 64 keys and it walks the queries in tiles of BW_TILE(HS). Fragment layouts: the table
 * in cuda_mma.cuh. Operands taken as B with n along the tile's rows (K for S = q k^T, q for
 * S^T = k q^T, ...) are staged row-major; operands taken as B with k along rows (K for
 * dq += dS K, q and dout for dk/dv) are staged transposed, so that every fragment load is
 * a 4-byte pair of consecutive bf16.
 *
 * Compiled with the CUDA backend's flags (--fmad=false): the products are mma.sync, the
 * few other FMAs are written (fmaf).
 */
#include "cuda_attention_bwd_fast.h"

#include "cuda_mma.cuh"

#include <limits.h>
#include <math.h>

typedef __nv_bfloat16 bf16;

#define BW_THREADS 128 /* 4 warps */
#define BW_ROWS 64     /* rows of a block: queries (dq kernel), keys (dkv kernel) */
#define BW_PAD 8       /* bf16 of padding per shared row */
#define BW_TILE(HS) ((HS) == 64 ? 64 : 32)
static_assert(BW_ROWS == 16 * (BW_THREADS / 32), "one m16 tile of rows per warp");

/* dst[r * LD + c] = bf16(src[r * ld + c]) for r < R, c < HS; rows r >= nrows are zeros. */
template <int HS>
static __device__ __forceinline__ void stage_rows(bf16 *dst, int LD, const float *src,
                                                  int64_t ld, int nrows, int R) {
    constexpr int C4 = HS / 4;
    for (int idx = threadIdx.x; idx < R * C4; idx += BW_THREADS) {
        const int r = idx / C4, c = (idx - r * C4) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < nrows) x = *reinterpret_cast<const float4 *>(src + (int64_t)r * ld + c);
        st_bf16x4(dst + r * LD + c, x);
    }
}

/* Transposed: dst[c * LD + r] = bf16(src[r * ld + c]) for r < R (even), c < HS; rows r >=
 * nrows are zeros. A thread takes rows 2rp, 2rp+1 at columns c..c+3 and writes four pairs. */
template <int HS>
static __device__ __forceinline__ void stage_cols(bf16 *dst, int LD, const float *src,
                                                  int64_t ld, int nrows, int R) {
    constexpr int C4 = HS / 4;
    const int RP = R / 2;
    for (int idx = threadIdx.x; idx < RP * C4; idx += BW_THREADS) {
        const int rp = idx % RP, c = (idx / RP) * 4, r = 2 * rp;
        float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
        if (r < nrows) x0 = *reinterpret_cast<const float4 *>(src + (int64_t)r * ld + c);
        if (r + 1 < nrows) x1 = *reinterpret_cast<const float4 *>(src + (int64_t)(r + 1) * ld + c);
        bf16 *p = dst + c * LD + r;
        *reinterpret_cast<uint32_t *>(p) = pack_bf16(x0.x, x1.x);
        *reinterpret_cast<uint32_t *>(p + LD) = pack_bf16(x0.y, x1.y);
        *reinterpret_cast<uint32_t *>(p + 2 * LD) = pack_bf16(x0.z, x1.z);
        *reinterpret_cast<uint32_t *>(p + 3 * LD) = pack_bf16(x0.w, x1.w);
    }
}

static __device__ __forceinline__ float2 ld2_or0(const float *p) {
    return p ? *reinterpret_cast<const float2 *>(p) : make_float2(0.0f, 0.0f);
}

/* The A fragments (HS/16 k-steps) of a 16-row tile whose rows g and g+8 start at row0 and
 * row1 in global memory (NULL: a padding row, zeros). */
template <int HS>
static __device__ __forceinline__ void load_a_frags(uint32_t f[HS / 16][4], const float *row0,
                                                    const float *row1, int t) {
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        const int c = kk * 16 + 2 * t;
        const float2 a0 = ld2_or0(row0 ? row0 + c : nullptr);
        const float2 a1 = ld2_or0(row1 ? row1 + c : nullptr);
        const float2 a2 = ld2_or0(row0 ? row0 + c + 8 : nullptr);
        const float2 a3 = ld2_or0(row1 ? row1 + c + 8 : nullptr);
        f[kk][0] = pack_bf16(a0.x, a0.y);
        f[kk][1] = pack_bf16(a1.x, a1.y);
        f[kk][2] = pack_bf16(a2.x, a2.y);
        f[kk][3] = pack_bf16(a3.x, a3.y);
    }
}

/* c[nt] = A(16 x HS, fragments f) x B^T where B's rows n (NT/8 tiles of 8) are bf16 rows of
 * length HS at sB + n * LD: the product of a warp's rows with a staged row-major tile. */
template <int HS, int NT>
static __device__ __forceinline__ void rows_times_tile(float c[NT / 8][4],
                                                       const uint32_t f[HS / 16][4],
                                                       const bf16 *sB, int LD, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < NT / 8; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
#pragma unroll
        for (int nt = 0; nt < NT / 8; nt++) {
            const bf16 *bp = sB + (nt * 8 + g) * LD + kk * 16 + 2 * t;
            const uint32_t b[2] = {ld_pair(bp), ld_pair(bp + 8)};
            mma_bf16_16816(c[nt], f[kk], b);
        }
    }
}

/* acc(16 x HS) += P(16 x NT, C fragments p, rounded to bf16 here) x B, where B[k][n] is
 * stored transposed: sBt[n * LD + k] (n < HS, k < NT). */
template <int HS, int NT>
static __device__ __forceinline__ void tile_times_cols(float acc[HS / 8][4],
                                                       const float p[NT / 8][4],
                                                       const bf16 *sBt, int LD, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT / 16; j++) {
        const uint32_t a[4] = {pack_bf16(p[2 * j][0], p[2 * j][1]),
                               pack_bf16(p[2 * j][2], p[2 * j][3]),
                               pack_bf16(p[2 * j + 1][0], p[2 * j + 1][1]),
                               pack_bf16(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            const bf16 *bp = sBt + (dt * 8 + g) * LD + j * 16 + 2 * t;
            const uint32_t b[2] = {ld_pair(bp), ld_pair(bp + 8)};
            mma_bf16_16816(acc[dt], a, b);
        }
    }
}

template <int HS>
static constexpr size_t dq_smem() {
    return sizeof(bf16) * ((size_t)2 * BW_TILE(HS) * (HS + BW_PAD) +
                           (size_t)HS * (BW_TILE(HS) + BW_PAD));
}

template <int HS>
static constexpr size_t dkv_smem() {
    return sizeof(bf16) * ((size_t)2 * BW_ROWS * (HS + BW_PAD) +
                           (size_t)2 * BW_TILE(HS) * (HS + BW_PAD) +
                           (size_t)2 * HS * (BW_TILE(HS) + BW_PAD)) +
           sizeof(float) * 2 * BW_TILE(HS);
}

/* A query tile qt of head h (rows r0 = q0 + 16 warp + g and r1 = r0 + 8; a padding row >= N
 * sees no key and writes nothing). STATS: D and L into the workspace (kernel 1); else dq from
 * them (kernel 2's dq blocks). */
template <int HS, bool STATS>
static __device__ __forceinline__ void dq_tile(int qt, int h, float *__restrict__ dq,
                                               float *__restrict__ wsD, float *__restrict__ wsL,
                                               const float *__restrict__ dout,
                                               const float *__restrict__ q,
                                               const float *__restrict__ k,
                                               const float *__restrict__ v,
                                               const float *__restrict__ out, int N, int n_past,
                                               int NH, int KVH, float scale) {
    constexpr int KT = BW_TILE(HS), LDS = HS + BW_PAD, LDT = KT + BW_PAD;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sK = reinterpret_cast<bf16 *>(bw_sm); /* (KT, LDS) */
    bf16 *sV = sK + KT * LDS;                   /* (KT, LDS) */
    bf16 *sKt = sV + KT * LDS;                  /* (HS, LDT) */

    const int kvh = h / (NH / KVH);
    const int q0 = qt * BW_ROWS, T = n_past + N;
    const int rows = N - q0 < BW_ROWS ? N - q0 : BW_ROWS;
    const int kend = n_past + q0 + rows; /* keys the tile's last row sees */
    const int64_t kvs = (int64_t)KVH * HS;
    const float *kb = k + (int64_t)kvh * HS, *vb = v + (int64_t)kvh * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const bool ok0 = r0 < N, ok1 = r1 < N;
    const int lim0 = ok0 ? n_past + r0 : -1, lim1 = ok1 ? n_past + r1 : -1;
    const int64_t o0 = ((int64_t)r0 * NH + h) * HS, o1 = ((int64_t)r1 * NH + h) * HS;

    uint32_t qf[HS / 16][4];
    load_a_frags<HS>(qf, ok0 ? q + o0 : nullptr, ok1 ? q + o1 : nullptr, t);
    if (STATS) {
    /* D = rowsum(dout * out): thread t of the row's quad takes columns [t HS/4, (t+1) HS/4) in
     * order, then the quad adds (commutative: all four end with the same bits) */
    float D0 = 0.0f, D1 = 0.0f;
    for (int i = 0; i < HS / 4; i++) {
        const int d = t * (HS / 4) + i;
        if (ok0) D0 = fmaf(dout[o0 + d], out[o0 + d], D0);
        if (ok1) D1 = fmaf(dout[o1 + d], out[o1 + d], D1);
    }
    D0 = D0 + __shfl_xor_sync(0xffffffffu, D0, 1);
    D0 = D0 + __shfl_xor_sync(0xffffffffu, D0, 2);
    D1 = D1 + __shfl_xor_sync(0xffffffffu, D1, 1);
    D1 = D1 + __shfl_xor_sync(0xffffffffu, D1, 2);

    /* pass 1: L = log sum exp of the scaled scores (online over the key tiles) */
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    for (int k0 = 0; k0 < kend; k0 += KT) {
        const int nk = T - k0 < KT ? T - k0 : KT;
        __syncthreads();
        stage_rows<HS>(sK, LDS, kb + (int64_t)k0 * kvs, kvs, nk, KT);
        __syncthreads();
        float sc[KT / 8][4];
        rows_times_tile<HS, KT>(sc, qf, sK, LDS, g, t);
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            const int key = k0 + nt * 8 + 2 * t;
            sc[nt][0] = key <= lim0 ? sc[nt][0] * scale : -INFINITY;
            sc[nt][1] = key + 1 <= lim0 ? sc[nt][1] * scale : -INFINITY;
            sc[nt][2] = key <= lim1 ? sc[nt][2] * scale : -INFINITY;
            sc[nt][3] = key + 1 <= lim1 ? sc[nt][3] * scale : -INFINITY;
            mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            ps0 = ps0 + (__expf(sc[nt][0] - b0) + __expf(sc[nt][1] - b0));
            ps1 = ps1 + (__expf(sc[nt][2] - b1) + __expf(sc[nt][3] - b1));
        }
        l0 = l0 * __expf(m0 - b0) + ps0;
        l1 = l1 * __expf(m1 - b1) + ps1;
        m0 = mn0;
        m1 = mn1;
    }
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 = l0 + __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 = l1 + __shfl_xor_sync(0xffffffffu, l1, 2);
    const float L0 = ok0 ? m0 + logf(l0) : 0.0f, L1 = ok1 ? m1 + logf(l1) : 0.0f;
    if (t == 0) {
        if (ok0) {
            wsD[(int64_t)r0 * NH + h] = D0;
            wsL[(int64_t)r0 * NH + h] = L0;
        }
        if (ok1) {
            wsD[(int64_t)r1 * NH + h] = D1;
            wsL[(int64_t)r1 * NH + h] = L1;
        }
    }
    return;
    }

    uint32_t of[HS / 16][4];
    load_a_frags<HS>(of, ok0 ? dout + o0 : nullptr, ok1 ? dout + o1 : nullptr, t);
    const float D0 = ok0 ? wsD[(int64_t)r0 * NH + h] : 0.0f, D1 = ok1 ? wsD[(int64_t)r1 * NH + h] : 0.0f;
    const float L0 = ok0 ? wsL[(int64_t)r0 * NH + h] : 0.0f, L1 = ok1 ? wsL[(int64_t)r1 * NH + h] : 0.0f;

    /* pass 2: dq += dS K over the same key tiles */
    float acc[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    for (int k0 = 0; k0 < kend; k0 += KT) {
        const int nk = T - k0 < KT ? T - k0 : KT;
        __syncthreads();
        stage_rows<HS>(sK, LDS, kb + (int64_t)k0 * kvs, kvs, nk, KT);
        stage_rows<HS>(sV, LDS, vb + (int64_t)k0 * kvs, kvs, nk, KT);
        stage_cols<HS>(sKt, LDT, kb + (int64_t)k0 * kvs, kvs, nk, KT);
        __syncthreads();
        float sc[KT / 8][4], dp[KT / 8][4];
        rows_times_tile<HS, KT>(sc, qf, sK, LDS, g, t);
        rows_times_tile<HS, KT>(dp, of, sV, LDS, g, t);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            const int key = k0 + nt * 8 + 2 * t;
            const float p00 = key <= lim0 ? __expf(sc[nt][0] * scale - L0) : 0.0f;
            const float p01 = key + 1 <= lim0 ? __expf(sc[nt][1] * scale - L0) : 0.0f;
            const float p10 = key <= lim1 ? __expf(sc[nt][2] * scale - L1) : 0.0f;
            const float p11 = key + 1 <= lim1 ? __expf(sc[nt][3] * scale - L1) : 0.0f;
            sc[nt][0] = p00 * (dp[nt][0] - D0); /* dS */
            sc[nt][1] = p01 * (dp[nt][1] - D0);
            sc[nt][2] = p10 * (dp[nt][2] - D1);
            sc[nt][3] = p11 * (dp[nt][3] - D1);
        }
        tile_times_cols<HS, KT>(acc, sc, sKt, LDT, g, t);
    }
    if (ok0) {
        float *p = dq + o0 + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            *reinterpret_cast<float2 *>(p + dt * 8) = make_float2(acc[dt][0] * scale, acc[dt][1] * scale);
    }
    if (ok1) {
        float *p = dq + o1 + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            *reinterpret_cast<float2 *>(p + dt * 8) = make_float2(acc[dt][2] * scale, acc[dt][3] * scale);
    }
}

/* Key tile kt for query head h (kernel 2's dk/dv blocks). Keys key0 = k0 + 16 warp + g and
 * key1 = key0 + 8 (padding keys >= T are zeros, masked, and write nothing). Writes dk, dv of
 * kv head h / G directly when G = 1, else this head's partials pk, pv (T, NH, HS). */
template <int HS>
static __device__ __forceinline__ void dkv_tile(int kt, int h, float *__restrict__ dk,
                                                float *__restrict__ dv,
                                                const float *__restrict__ wsD,
                                                const float *__restrict__ wsL,
                                                const float *__restrict__ dout,
                                                const float *__restrict__ q,
                                                const float *__restrict__ k,
                                                const float *__restrict__ v, int N, int n_past,
                                                int NH, int KVH, float scale) {
    constexpr int QT = BW_TILE(HS), LDS = HS + BW_PAD, LDT = QT + BW_PAD;
    extern __shared__ __align__(16) unsigned char bw_sm[];
    bf16 *sK = reinterpret_cast<bf16 *>(bw_sm); /* (BW_ROWS, LDS) */
    bf16 *sV = sK + BW_ROWS * LDS;              /* (BW_ROWS, LDS) */
    bf16 *sQ = sV + BW_ROWS * LDS;              /* (QT, LDS) */
    bf16 *sO = sQ + QT * LDS;                   /* (QT, LDS): dout */
    bf16 *sQt = sO + QT * LDS;                  /* (HS, LDT) */
    bf16 *sOt = sQt + HS * LDT;                 /* (HS, LDT) */
    float *sL = reinterpret_cast<float *>(sOt + HS * LDT); /* (QT) */
    float *sD = sL + QT;                                   /* (QT) */

    const int G = NH / KVH, kvh = h / G;
    const int k0 = kt * BW_ROWS, T = n_past + N;
    const int nk = T - k0 < BW_ROWS ? T - k0 : BW_ROWS;
    const int64_t qs = (int64_t)NH * HS, kvs = (int64_t)KVH * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;

    stage_rows<HS>(sK, LDS, k + (int64_t)k0 * kvs + (int64_t)kvh * HS, kvs, nk, BW_ROWS);
    stage_rows<HS>(sV, LDS, v + (int64_t)k0 * kvs + (int64_t)kvh * HS, kvs, nk, BW_ROWS);

    float ak[HS / 8][4], av[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        ak[dt][0] = ak[dt][1] = ak[dt][2] = ak[dt][3] = 0.0f;
        av[dt][0] = av[dt][1] = av[dt][2] = av[dt][3] = 0.0f;
    }
    const int first = k0 - n_past > 0 ? k0 - n_past : 0; /* first query that sees key k0 */
    for (int q0 = first / QT * QT; q0 < N; q0 += QT) {
        const int nq = N - q0 < QT ? N - q0 : QT;
        const float *qb = q + (int64_t)q0 * qs + (int64_t)h * HS;
        const float *ob = dout + (int64_t)q0 * qs + (int64_t)h * HS;
        __syncthreads(); /* the previous tile is no longer read */
        stage_rows<HS>(sQ, LDS, qb, qs, nq, QT);
        stage_rows<HS>(sO, LDS, ob, qs, nq, QT);
        stage_cols<HS>(sQt, LDT, qb, qs, nq, QT);
        stage_cols<HS>(sOt, LDT, ob, qs, nq, QT);
        for (int r = threadIdx.x; r < QT; r += BW_THREADS) {
            sL[r] = r < nq ? wsL[(int64_t)(q0 + r) * NH + h] : 0.0f;
            sD[r] = r < nq ? wsD[(int64_t)(q0 + r) * NH + h] : 0.0f;
        }
        __syncthreads();

        /* S^T = K q^T and dP^T = V dout^T for the warp's 16 keys x QT queries */
        float st[QT / 8][4], dpt[QT / 8][4];
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.0f;
            dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) {
            const bf16 *ka = sK + (warp * 16 + g) * LDS + kk * 16 + 2 * t;
            const bf16 *va = sV + (warp * 16 + g) * LDS + kk * 16 + 2 * t;
            const uint32_t a_k[4] = {ld_pair(ka), ld_pair(ka + 8 * LDS), ld_pair(ka + 8),
                                     ld_pair(ka + 8 * LDS + 8)};
            const uint32_t a_v[4] = {ld_pair(va), ld_pair(va + 8 * LDS), ld_pair(va + 8),
                                     ld_pair(va + 8 * LDS + 8)};
#pragma unroll
            for (int nt = 0; nt < QT / 8; nt++) {
                const bf16 *qp = sQ + (nt * 8 + g) * LDS + kk * 16 + 2 * t;
                const bf16 *op = sO + (nt * 8 + g) * LDS + kk * 16 + 2 * t;
                const uint32_t bq[2] = {ld_pair(qp), ld_pair(qp + 8)};
                const uint32_t bo[2] = {ld_pair(op), ld_pair(op + 8)};
                mma_bf16_16816(st[nt], a_k, bq);
                mma_bf16_16816(dpt[nt], a_v, bo);
            }
        }
        /* P^T and dS^T: c[0] (key0, qi), c[1] (key0, qi+1), c[2] (key1, qi), c[3] (key1, qi+1) */
#pragma unroll
        for (int nt = 0; nt < QT / 8; nt++) {
            const int qi = nt * 8 + 2 * t, qa = n_past + q0 + qi; /* qa: the query's position */
            const bool in0 = qi < nq, in1 = qi + 1 < nq;
            const float p00 = in0 && qa >= key0 ? __expf(st[nt][0] * scale - sL[qi]) : 0.0f;
            const float p01 = in1 && qa + 1 >= key0 ? __expf(st[nt][1] * scale - sL[qi + 1]) : 0.0f;
            const float p10 = in0 && qa >= key1 ? __expf(st[nt][2] * scale - sL[qi]) : 0.0f;
            const float p11 = in1 && qa + 1 >= key1 ? __expf(st[nt][3] * scale - sL[qi + 1]) : 0.0f;
            dpt[nt][0] = p00 * (dpt[nt][0] - sD[qi]);
            dpt[nt][1] = p01 * (dpt[nt][1] - sD[qi + 1]);
            dpt[nt][2] = p10 * (dpt[nt][2] - sD[qi]);
            dpt[nt][3] = p11 * (dpt[nt][3] - sD[qi + 1]);
            st[nt][0] = p00;
            st[nt][1] = p01;
            st[nt][2] = p10;
            st[nt][3] = p11;
        }
        tile_times_cols<HS, QT>(av, st, sOt, LDT, g, t);  /* dv += P^T dout */
        tile_times_cols<HS, QT>(ak, dpt, sQt, LDT, g, t); /* dk += dS^T q */
    }

    /* G = 1: this head's are the kv head's gradients; else partials at (key, h) */
    const int64_t ks = G == 1 ? kvs : qs, hoff = (int64_t)(G == 1 ? kvh : h) * HS;
    if (key0 < T) {
        float *pk = dk + (int64_t)key0 * ks + hoff + 2 * t, *pv = dv + (int64_t)key0 * ks + hoff + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            *reinterpret_cast<float2 *>(pk + dt * 8) = make_float2(ak[dt][0] * scale, ak[dt][1] * scale);
            *reinterpret_cast<float2 *>(pv + dt * 8) = make_float2(av[dt][0], av[dt][1]);
        }
    }
    if (key1 < T) {
        float *pk = dk + (int64_t)key1 * ks + hoff + 2 * t, *pv = dv + (int64_t)key1 * ks + hoff + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++) {
            *reinterpret_cast<float2 *>(pk + dt * 8) = make_float2(ak[dt][2] * scale, ak[dt][3] * scale);
            *reinterpret_cast<float2 *>(pv + dt * 8) = make_float2(av[dt][2], av[dt][3]);
        }
    }
}

/* Kernel 1: D and L, a block per (query tile, head), the longest rows first. */
template <int HS>
static __global__ void __launch_bounds__(BW_THREADS)
bwd_stats_kernel(float *__restrict__ wsD, float *__restrict__ wsL, const float *__restrict__ dout,
                 const float *__restrict__ q, const float *__restrict__ k,
                 const float *__restrict__ out, int N, int n_past, int NH, int KVH, float scale) {
    dq_tile<HS, true>((int)(gridDim.x - 1 - blockIdx.x), (int)blockIdx.y, nullptr, wsD, wsL, dout,
                      q, k, nullptr, out, N, n_past, NH, KVH, scale);
}

/* Kernel 2: the dk/dv blocks (x < nkt: key tile x, the ones that see the most queries first)
 * and the dq blocks (x >= nkt: query tiles, the longest first) in one launch, so that the GPU
 * holds twice the blocks of either alone; they are independent given D and L. */
template <int HS>
static __global__ void __launch_bounds__(BW_THREADS)
bwd_main_kernel(float *__restrict__ dq, float *__restrict__ dk, float *__restrict__ dv,
                float *__restrict__ wsD, float *__restrict__ wsL, /* read only here */
                const float *__restrict__ dout, const float *__restrict__ q,
                const float *__restrict__ k, const float *__restrict__ v, int N, int n_past,
                int NH, int KVH, float scale, int nkt) {
    const int x = (int)blockIdx.x, h = (int)blockIdx.y;
    if (x < nkt)
        dkv_tile<HS>(x, h, dk, dv, wsD, wsL, dout, q, k, v, N, n_past, NH, KVH, scale);
    else
        dq_tile<HS, false>((int)gridDim.x - 1 - x, h, dq, wsD, wsL, dout, q, k, v, nullptr, N,
                           n_past, NH, KVH, scale);
}

/* Kernel 3 (G > 1): dk[key][j][d] = pk[key][jG][d] + pk[key][jG+1][d] + ... in head order. */
static __global__ void bwd_reduce_kernel(float *__restrict__ dk, float *__restrict__ dv,
                                         const float *__restrict__ pk,
                                         const float *__restrict__ pv, int64_t total, int NH,
                                         int KVH, int HS) {
    const int G = NH / KVH;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t key = u / ((int64_t)KVH * HS);
        const int rem = (int)(u - key * KVH * HS), j = rem / HS, d = rem - j * HS;
        const int64_t base = (key * NH + (int64_t)j * G) * HS + d;
        float sk = pk[base], sv = pv[base];
        for (int gi = 1; gi < G; gi++) {
            sk = sk + pk[base + (int64_t)gi * HS];
            sv = sv + pv[base + (int64_t)gi * HS];
        }
        dk[u] = sk;
        dv[u] = sv;
    }
}

/* ==== entry points ============================================================================ */

size_t kiln_cuda_attention_backward_fast_ws(int N, int n_past, int NH, int KVH, int HS) {
    if (N <= 0 || n_past < 0 || NH <= 0 || KVH <= 0 || HS <= 0) return 0;
    const size_t T = (size_t)n_past + (size_t)N;
    size_t w = 2 * (size_t)N * (size_t)NH;
    if (NH != KVH) w += 2 * T * (size_t)NH * (size_t)HS;
    return w;
}

bool kiln_cuda_attention_backward_fast_ok(const float *dq, const float *dk, const float *dv,
                                          const float *dout, const float *q, const float *k,
                                          const float *v, const float *out, int N, int n_past,
                                          int NH, int KVH, int HS) {
    if (HS != 64 && HS != 128) return false;
    if (N <= 0 || n_past < 0 || NH <= 0 || KVH <= 0 || NH % KVH != 0 || NH > 65535) return false;
    if ((int64_t)n_past + N > INT_MAX - BW_ROWS) return false;
    const uintptr_t a = (uintptr_t)dq | (uintptr_t)dk | (uintptr_t)dv | (uintptr_t)dout |
                        (uintptr_t)q | (uintptr_t)k | (uintptr_t)v | (uintptr_t)out;
    return (a & 15) == 0;
}

template <int HS>
static cudaError_t bwd_launch(cudaStream_t s, float *dq, float *dk, float *dv, const float *dout,
                              const float *q, const float *k, const float *v, const float *out,
                              float *ws, int N, int n_past, int NH, int KVH, float scale) {
    constexpr size_t smem = dq_smem<HS>() > dkv_smem<HS>() ? dq_smem<HS>() : dkv_smem<HS>();
    cudaError_t e = cudaFuncSetAttribute(bwd_stats_kernel<HS>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)dq_smem<HS>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(bwd_main_kernel<HS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem);
    if (e != cudaSuccess) return e;
    const int T = n_past + N;
    float *wsD = ws, *wsL = ws + (size_t)N * NH;
    const int nqt = (N + BW_ROWS - 1) / BW_ROWS, nkt = (T + BW_ROWS - 1) / BW_ROWS;
    bwd_stats_kernel<HS><<<dim3((unsigned)nqt, (unsigned)NH), BW_THREADS, dq_smem<HS>(), s>>>(
        wsD, wsL, dout, q, k, out, N, n_past, NH, KVH, scale);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    float *pk = dk, *pv = dv;
    if (NH != KVH) {
        pk = ws + 2 * (size_t)N * NH;
        pv = pk + (size_t)T * NH * HS;
    }
    bwd_main_kernel<HS><<<dim3((unsigned)(nqt + nkt), (unsigned)NH), BW_THREADS, smem, s>>>(
        dq, pk, pv, wsD, wsL, dout, q, k, v, N, n_past, NH, KVH, scale, nkt);
    if ((e = cudaGetLastError()) != cudaSuccess || NH == KVH) return e;
    const int64_t total = (int64_t)T * KVH * HS;
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    bwd_reduce_kernel<<<(unsigned)blocks, 256, 0, s>>>(dk, dv, pk, pv, total, NH, KVH, HS);
    return cudaGetLastError();
}

cudaError_t kiln_cuda_attention_backward_fast(cudaStream_t s, float *dq, float *dk, float *dv,
                                              const float *dout, const float *q,
                                              const float *k, const float *v, const float *out,
                                              float *ws, size_t ws_floats, int N, int n_past,
                                              int NH, int KVH, int HS, float scale) {
    if (!kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, out, N, n_past, NH, KVH,
                                              HS) ||
        !ws || ws_floats < kiln_cuda_attention_backward_fast_ws(N, n_past, NH, KVH, HS) ||
        ((uintptr_t)ws & 15) != 0)
        return cudaErrorInvalidValue;
    if (HS == 64)
        return bwd_launch<64>(s, dq, dk, dv, dout, q, k, v, out, ws, N, n_past, NH, KVH, scale);
    return bwd_launch<128>(s, dq, dk, dv, dout, q, k, v, out, ws, N, n_past, NH, KVH, scale);
}
