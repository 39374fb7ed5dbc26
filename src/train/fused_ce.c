/*
 * fused_ce.c -- fused linear cross-entropy: loss, dh and dW without the N x V logits.
 *
 * The math (docs/ARITHMETIC.md, "Fused linear cross-entropy"), for the S supervised rows
 * hs(S,H) gathered in ascending position order and the vocabulary in chunks [c0, c0+n):
 *
 *   pass 1, per chunk:  z(S,n) = hs @ W[c0:c0+n]^T             (backend matmul)
 *                       per row: online log-sum-exp (m, l), and z at the target
 *   per row:            loss_i = (m_i - z_t) + log(l_i)
 *   pass 2, per chunk:  z again;  g = (exp(z - m_i) / l_i - onehot) * gs     (in place)
 *                       dh_acc(S,H) += g @ W[c0:c0+n]        (matmul on W chunk transposed)
 *                       dW[c0:c0+n] += g^T @ hs               (matmul on g and hs transposed)
 *
 * Everything a thread computes is one output element in a fixed order (the backend's matmul
 * guarantees it for the products; the row work, transposes and sums here are split over the
 * backend's pool by rows or ranges, each output one task's: ce_parallel), so the results are
 * the same bits for any thread count.
 *
 * On the CUDA backend (ce_device below) the same steps run on the device in the same order:
 * the products are the backend's matmul (the auditable kernel gives the CPU matmul's bits),
 * the row-wise work is cuda_fused_ce.cu, and the per-row loss, its check and the two sums
 * (O(S) scalars) are computed here on the host from the downloaded row statistics, with the
 * very code the CPU path runs (ce_row_losses, the lane-16 sum).
 *
 * Fast mode (kiln_cuda_ce_is_fast: the products are bf16 tensor-core GEMMs, not the CPU's
 * bits) changes four things, each deterministic run to run:
 *   - pass 1's row statistics come from a parallel kernel (a tree max, a fixed-order sum);
 *   - the supervised rows are padded with zero rows to Sp, a multiple of 8 (when the padded
 *     scratch still fits kiln_fused_ce_scratch_bytes), so the row count is never an odd
 *     GEMM dimension (an odd K made cuBLASLt fall back to its align-1 kernels); the padding
 *     rows have zero hidden states and zero gradient factors, so they add exact zeros;
 *   - the operands are rounded to bf16 once each (ce_pass2_bf16, layout CE_BF16): hs when it
 *     is gathered (hsb, once per call, reused by every logits GEMM and every dW GEMM); g by
 *     the gradient kernel itself, which writes bf16 (gb) instead of f32; each W chunk once per
 *     chunk in pass 2, shared by its logits and dh products (read in place when it is bf16
 *     with 16-byte aligned rows); pass 1's logits GEMM (and pass 2's without dh) converts
 *     its W chunk itself (kiln_cuda_gemm_linear_bf16, into the GEMM module's scratch). The
 *     logits stay f32 (z): pass 1's statistics and g are computed from them as before;
 *   - pass 2's products, per chunk, are dh_acc(Sp,H) (+)= g @ W_chunk and
 *     dW[c0:c0+n] += g^T @ hs, straight on those bf16 operands: no transposes, no partial
 *     products, no adds (hT, gT, wpart, dpart and wT are not allocated).
 * Every bf16 operand has the leading dimension (padded to 8 elements) and alignment class
 * (16 bytes or more) of the copies the backend's matmul (kiln_cuda_gemm_linear) and
 * matmul_backward (kiln_cuda_matmul_backward_fast) make, and the same values
 * (kiln_fp32_to_bf16), so every product is the same GEMM-module problem as in the
 * composition of those two ops (ce_pass2_fast, layout CE_LEAN), run by the same cached
 * algorithm: the results have the composition's bits (tests/gpu/test_cuda_fused_ce_fast.cu
 * checks it, through kiln_cuda_ce_set_legacy). The composition still runs where the bf16
 * layout would pass the bound (with dh but not dW, for chunks above about 3 H; tiny H and
 * chunks) and for S <= 8 rows, whose logits the backend's matmul computes by its f32
 * matrix-vector kernels; its matmul_backward allocates its bf16 copies with cudaMallocAsync
 * on every chunk. The bf16 path allocates nothing but the one scratch block (the GEMM
 * module's scratch belongs to the backend's handle and grows only on a first, larger use).
 * The loss, its checks and the reductions are the auditable ones, from the fast statistics.
 *
 * Fast mode's row-block walk (params.row_block, the one-call form only: ce_row_block and
 * ce_rows_bf16 below) walks the supervised rows instead of the vocabulary: per block of rows,
 * the block's whole logits in one product, the statistics and the bf16 gradient from them in
 * one kernel (written over the logits), then dh and dW -- three products instead of four,
 * since nothing needs the loss before the gradient there. The block's logits are bf16 by
 * default (the f32 product rounded once by the GEMM's epilogue, as PyTorch's autocast head
 * output, whose loss upcasts them): half the scratch and half the traffic of the statistics
 * kernel; params.row_logits_f32 keeps them f32. tests/gpu/test_cuda_fused_ce_fast.cu measures
 * both against the vocabulary walk and auditable mode.
 */
#include "fused_ce.h"

#include "../base/kmath.h"
#include "../base/threadpool.h"
#include "../ops/cpu/cpu_kernels.h"
#include "../ops/cuda/cuda_train.h"

#include <math.h>
#include <string.h>

kiln_fused_ce_params kiln_fused_ce_default_params(void) {
    kiln_fused_ce_params p;
    memset(&p, 0, sizeof p);
    p.weight_dtype = KILN_DTYPE_F32;
    p.reduction = KILN_CE_REDUCTION_MEAN;
    p.scale = 1.0f;
    return p;
}

/* ---- log ---------------------------------------------------------------------------------- */

/* Constants of kiln_fused_ce_logf: ln2 split so that e * LN2_HI is exact for |e| < 2^8
 * (LN2_HI has 9 significant bits); the polynomial is the classic degree-8 fit of
 * (log(1+f) - f + f^2/2) / f^3 on [sqrt(1/2) - 1, sqrt(2) - 1] (Cephes' logf coefficients). */
#define CE_LN2_HI 0.693359375f
#define CE_LN2_LO -2.12194440e-4f
#define CE_SQRT2 1.41421356237309504880f

float kiln_fused_ce_logf(float x) {
    if (x != x) return x + x;
    if (x < 0.0f) return NAN;
    if (x == 0.0f) return -INFINITY;
    if (x == INFINITY) return x;
    int32_t e = 0;
    uint32_t u = kiln_f32_bits(x);
    if ((u >> 23) == 0) { /* subnormal: scale into the normal range (exact) */
        x = x * 8388608.0f;
        u = kiln_f32_bits(x);
        e = -23;
    }
    e += (int32_t)(u >> 23) - 127;
    float mant = kiln_bits_f32((u & 0x007fffffu) | 0x3f800000u); /* [1, 2) */
    if (mant > CE_SQRT2) {                                        /* -> [sqrt(2)/2, sqrt(2)] */
        mant = mant * 0.5f;
        e += 1;
    }
    float f = mant - 1.0f; /* exact */
    float z = f * f;
    float p = 7.0376836292e-2f;
    p = fmaf(p, f, -1.1514610310e-1f);
    p = fmaf(p, f, 1.1676998740e-1f);
    p = fmaf(p, f, -1.2420140846e-1f);
    p = fmaf(p, f, 1.4249322787e-1f);
    p = fmaf(p, f, -1.6668057665e-1f);
    p = fmaf(p, f, 2.0000714765e-1f);
    p = fmaf(p, f, -2.4999993993e-1f);
    p = fmaf(p, f, 3.3333331174e-1f);
    float ef = (float)e;
    float y = (p * f) * z;
    y = fmaf(ef, CE_LN2_LO, y);
    y = fmaf(z, -0.5f, y);
    float r = f + y;
    return fmaf(ef, CE_LN2_HI, r);
}

/* ---- scratch ------------------------------------------------------------------------------ */

typedef struct ce_scratch {
    int64_t *idx;    /* (S) positions of the supervised rows, ascending */
    float *m, *l;    /* (S) running max and sum of exponentials */
    float *zt;       /* (S) the target's logit */
    float *loss;     /* (S) loss_i */
    float *ones;     /* (max(cn, S)) 1.0f: sums as dots with ones */
    float *hs;       /* (S, H) gathered hidden rows */
    float *z;        /* (S, cn) logits of one chunk, then g in place */
    float *hT;       /* (H, S) hs transposed (dW only) */
    float *gT;       /* (cn, S) g transposed (dW only) */
    float *wpart;    /* (cn, H) this chunk's dW (dW only) */
    float *dh_acc;   /* (S, H) dh of the supervised rows (dh only) */
    float *dpart;    /* (S, H) this chunk's dh (dh only) */
    float *wT;       /* (H, cn) W chunk transposed, as f32 (dh only) */
    uint16_t *hsb;   /* (Sp, ld(H)) hs in bf16 (CE_BF16) */
    uint16_t *gb;    /* (Sp, ld(cn)) g in bf16, ld(n) per chunk (CE_BF16, dh or dW) */
    uint16_t *wb;    /* (cn, ld(H)) W chunk in bf16 (CE_BF16, dh, W not read in place) */
} ce_scratch;

/* Which regions a call takes:
 *   CE_FULL: the CPU and the auditable CUDA path (every f32 region, Sp == S);
 *   CE_LEAN: fast mode's composition of the backend's matmul and matmul_backward
 *            (ce_pass2_fast): hs, z and dh_acc with Sp rows, none of hT, gT, wpart, dpart, wT;
 *   CE_BF16: fast mode on bf16 operands (ce_pass2_bf16): z (S rows, f32: pass 1's statistics
 *            and g are computed from f32 logits), hsb, gb, wb and dh_acc; no f32 hs;
 *   CE_ROWS: fast mode's row-block walk (ce_rows_bf16): hsb, dh_acc and z with rb rows of
 *            cn = ld(V) floats (a block's whole f32 logits, then its g in place) or ld(V) / 2
 *            (its bf16 logits: ce_rows_zcols); no gb, wb. */
typedef enum ce_kind { CE_FULL, CE_LEAN, CE_BF16, CE_ROWS } ce_kind;

/* Leading dimension of a bf16 operand: cols rounded up to 8 elements (16 bytes), as the GEMM
 * module and kiln_cuda_matmul_backward_fast pad their own copies (padded_ld): a product's
 * algorithm, hence its bits, depends on the leading dimensions. */
static int64_t ce_bf16_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* Carve the scratch regions from one block; returns the total bytes (0 on overflow). With
 * base NULL only sizes. Every region starts at a multiple of 64 bytes (a 16-byte alignment
 * class for the GEMM module). Sp (>= S): the padded rows of fast mode (S otherwise); w_copy
 * (CE_BF16): the W chunk is converted into wb. Absent regions have NULL pointers. The CPU
 * and auditable layout is (S, S, ..., CE_FULL); a CE_LEAN layout with Sp == S is a subset of
 * it, hence never larger; a CE_BF16 one is used only where it is not larger either. */
static size_t ce_layout(int64_t S, int64_t Sp, int64_t H, int64_t cn, int with_dh, int with_dw,
                        ce_kind kind, int w_copy, int64_t rb, uint8_t *base, ce_scratch *sc) {
    size_t total = 0;
    int ok = 1;
    if (Sp < S || (kind == CE_ROWS && (rb < 1 || rb > Sp))) return 0;
    const int full = kind == CE_FULL, bf = kind == CE_BF16, rows = kind == CE_ROWS;
    /* z's rows: Sp, S (CE_BF16) or rb (CE_ROWS) */
    const uint64_t uz = (uint64_t)(rows ? rb : bf ? S : Sp);
    uint64_t uS = (uint64_t)S, uSp = (uint64_t)Sp, uH = (uint64_t)H, uc = (uint64_t)cn;
    uint64_t uldH = (uint64_t)ce_bf16_ld(H), uldc = (uint64_t)ce_bf16_ld(cn);
    uint64_t ones_n = uc > uS ? uc : uS;
#define CE_REGION(field, type, count, want)                                                    \
    do {                                                                                       \
        size_t bytes_ = 0;                                                                     \
        if (want) {                                                                            \
            if (kiln_mul_overflow((size_t)(count), sizeof(type), &bytes_) ||                   \
                kiln_add_overflow(bytes_, 63, &bytes_))                                        \
                ok = 0;                                                                        \
            bytes_ &= ~(size_t)63;                                                             \
        }                                                                                      \
        if (base && sc) sc->field = (want) ? (type *)(void *)(base + total) : NULL;            \
        if (kiln_add_overflow(total, bytes_, &total)) ok = 0;                                  \
    } while (0)
    uint64_t SH, Sc, cH, SpH, SpldH, Spldc, cldH, zc;
    if (kiln_mul_overflow_u64(uS, uH, &SH) || kiln_mul_overflow_u64(uS, uc, &Sc) ||
        kiln_mul_overflow_u64(uz, uc, &zc) || zc > SIZE_MAX ||
        kiln_mul_overflow_u64(uc, uH, &cH) || kiln_mul_overflow_u64(uSp, uH, &SpH) ||
        kiln_mul_overflow_u64(uSp, uldH, &SpldH) ||
        kiln_mul_overflow_u64(uSp, uldc, &Spldc) || kiln_mul_overflow_u64(uc, uldH, &cldH) ||
        SpH > SIZE_MAX || cH > SIZE_MAX || SpldH > SIZE_MAX ||
        Spldc > SIZE_MAX || cldH > SIZE_MAX)
        return 0;
    CE_REGION(idx, int64_t, uS, 1);
    CE_REGION(m, float, uS, 1);
    CE_REGION(l, float, uS, 1);
    CE_REGION(zt, float, uS, 1);
    CE_REGION(loss, float, uS, 1);
    CE_REGION(ones, float, ones_n, 1);
    CE_REGION(hs, float, SpH, !bf && !rows);
    CE_REGION(z, float, zc, 1);
    CE_REGION(hsb, uint16_t, SpldH, bf || rows);
    CE_REGION(gb, uint16_t, Spldc, bf && (with_dh || with_dw));
    CE_REGION(wb, uint16_t, cldH, bf && with_dh && w_copy);
    CE_REGION(hT, float, SH, with_dw && full);
    CE_REGION(gT, float, Sc, with_dw && full);
    CE_REGION(wpart, float, cH, with_dw && full);
    CE_REGION(dh_acc, float, SpH, with_dh);
    CE_REGION(dpart, float, SH, with_dh && full);
    CE_REGION(wT, float, cH, with_dh && full);
#undef CE_REGION
    return ok ? total : 0;
}

size_t kiln_fused_ce_scratch_bytes(int64_t S, int64_t H, int64_t V, int64_t chunk, int with_dh,
                                   int with_dw) {
    if (S <= 0 || H <= 0 || V <= 0 || chunk < 0) return 0;
    int64_t cn = chunk == 0 ? KILN_FUSED_CE_DEFAULT_CHUNK : chunk;
    if (cn > V) cn = V;
    return ce_layout(S, S, H, cn, with_dh, with_dw, CE_FULL, 0, 0, NULL, NULL);
}

/* The row-block walk's rows per block: row_block (> 0) rounded up to 8, at most Sp (a multiple
 * of 8). */
static int64_t ce_rows_of(int64_t row_block, int64_t Sp) {
    return row_block > Sp ? Sp : (row_block + 7) & ~(int64_t)7;
}

/* Whether the row-block walk keeps its logits in bf16: unless the caller asks for f32
 * (params.row_logits_f32) or V is past the bf16 row kernel's bound. */
static int ce_rows_z16(int64_t V, int logits_f32) {
    return !logits_f32 && V <= KILN_CUDA_CE_ROWS16_MAX_V;
}

/* The row-block walk's z columns, in floats (ce_layout's unit): ld(V) f32 logits, or ld(V)
 * bf16 ones in half as many floats (ld(V) is even). */
static int64_t ce_rows_zcols(int64_t V, int z16) {
    return z16 ? ce_bf16_ld(V) / 2 : ce_bf16_ld(V);
}

size_t kiln_fused_ce_row_block_bytes(int64_t S, int64_t H, int64_t V, int64_t row_block,
                                     int with_dh, int with_dw, int logits_f32) {
    if (S <= 0 || H <= 0 || V <= 0 || row_block <= 0 || S > INT32_MAX) return 0;
    const int64_t Sp = (S + 7) & ~(int64_t)7;
    return ce_layout(S, Sp, H, ce_rows_zcols(V, ce_rows_z16(V, logits_f32)), with_dh, with_dw,
                     CE_ROWS, 0, ce_rows_of(row_block, Sp), NULL, NULL);
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* dst(C, R) = src(R, C)^T, in 32 x 32 tiles (a copy: no arithmetic). */
/* Rows [rlo, rhi) of that transpose (the parallel pieces of transpose_f32). */
static void transpose_f32_rows(float *dst, const float *src, int64_t R, int64_t C, int64_t rlo,
                               int64_t rhi) {
    for (int64_t r0 = rlo; r0 < rhi; r0 += 32)
        for (int64_t c0 = 0; c0 < C; c0 += 32) {
            int64_t r1 = r0 + 32 < rhi ? r0 + 32 : rhi, c1 = c0 + 32 < C ? c0 + 32 : C;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) dst[c * R + r] = src[r * C + c];
        }
}

static void transpose_f32(float *dst, const float *src, int64_t R, int64_t C) {
    transpose_f32_rows(dst, src, R, C, 0, R);
}

/* dst(H, n) = W rows [rlo, rhi) of [0, n) transposed and widened to f32 (exact for bf16). */
static void transpose_weight_rows(float *dst, const void *w, kiln_dtype dt, int64_t n, int64_t H,
                                  int64_t rlo, int64_t rhi) {
    if (dt == KILN_DTYPE_F32) {
        transpose_f32_rows(dst, (const float *)w, n, H, rlo, rhi);
        return;
    }
    const uint16_t *b = (const uint16_t *)w;
    for (int64_t r0 = rlo; r0 < rhi; r0 += 32)
        for (int64_t c0 = 0; c0 < H; c0 += 32) {
            int64_t r1 = r0 + 32 < rhi ? r0 + 32 : rhi, c1 = c0 + 32 < H ? c0 + 32 : H;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) dst[c * n + r] = kiln_bf16_to_fp32(b[r * H + c]);
        }
}

static const kiln_cpu_kernels *kernels_of(const kiln_backend *be) {
#if defined(KILN_CPU_HAVE_X86)
    kiln_cpu_path path = kiln_backend_cpu_path(be);
    if (path == KILN_CPU_PATH_AVX512) return &kiln_cpu_kernels_avx512;
    if (path == KILN_CPU_PATH_AVX2) return &kiln_cpu_kernels_avx2;
#else
    (void)be;
#endif
    return &kiln_cpu_kernels_portable;
}

/* The defined sum of v[0..n): 16 lanes (lane i % 16), then the fixed tree -- the dot of v
 * with ones (fmaf(v, 1, acc) rounds exactly like v + acc). */
static float lane_sum(const kiln_cpu_kernels *k, const float *v, const float *ones, int64_t n) {
    float acc[KILN_DOT_LANES] = {0};
    k->dot_accum(acc, v, ones, n);
    return kiln_lane16_reduce(acc);
}

/* The (n, H) tensor view of the weight rows [c0, c0+n). */
static kiln_tensor weight_chunk(const kiln_fused_ce_params *p, int64_t c0, int64_t n,
                                size_t row_bytes) {
    kiln_tensor wc;
    memset(&wc, 0, sizeof wc);
    wc.name = "fused_ce.weight_chunk";
    wc.dtype = p->weight_dtype;
    wc.n_dims = 2;
    wc.shape[0] = n;
    wc.shape[1] = p->H;
    wc.data = (const uint8_t *)p->weight + (size_t)c0 * row_bytes;
    wc.nbytes = (size_t)n * row_bytes;
    return wc;
}

/* z(S, n) = hs(S, H) @ W[c0 : c0+n]^T with the backend's matmul. */
static void chunk_logits(kiln_backend *be, const kiln_fused_ce_params *p, const float *hs,
                         int64_t S, int64_t c0, int64_t n, size_t row_bytes, float *z) {
    kiln_tensor wc = weight_chunk(p, c0, n, row_bytes);
    be->i->matmul(be, z, hs, &wc, NULL, (int)S);
}

/* A (R, C) f32 tensor view of caller scratch, for the backend's matmul. */
static kiln_tensor f32_view(const char *name, const float *data, int64_t R, int64_t C) {
    kiln_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.dtype = KILN_DTYPE_F32;
    t.n_dims = 2;
    t.shape[0] = R;
    t.shape[1] = C;
    t.data = data;
    t.nbytes = (size_t)R * (size_t)C * sizeof(float);
    return t;
}

/* ---- the op ------------------------------------------------------------------------------- */

static bool is_cuda(const kiln_backend *be) {
    return be->i && be->i->name && strcmp(be->i->name, "cuda") == 0;
}

static kiln_status check_params(const kiln_backend *be, const kiln_fused_ce_params *p) {
    if (!be || !p) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: backend or params is NULL");
    if (!be->i || !be->i->name || (strcmp(be->i->name, "cpu") != 0 && !is_cuda(be)))
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "fused_ce: only the CPU and CUDA backends are supported");
    if (p->N <= 0 || p->H <= 0 || p->V <= 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: N %lld, H %lld, V %lld must be > 0",
                          (long long)p->N, (long long)p->H, (long long)p->V);
    if (p->N > INT32_MAX || p->V > INT32_MAX || p->H > INT32_MAX)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: N, H or V above 2^31 - 1");
    if (!p->hidden || !p->weight || !p->targets)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: hidden, weight or targets is NULL");
    if (p->weight_dtype != KILN_DTYPE_F32 && p->weight_dtype != KILN_DTYPE_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "fused_ce: weight dtype %d: only f32 and bf16 are supported",
                          (int)p->weight_dtype);
    if (p->reduction != KILN_CE_REDUCTION_MEAN && p->reduction != KILN_CE_REDUCTION_SUM)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: reduction %d is not MEAN or SUM",
                          (int)p->reduction);
    if (!isfinite(p->scale))
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: scale %g is not finite",
                          (double)p->scale);
    if (p->chunk < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: chunk %lld < 0", (long long)p->chunk);
    if (p->row_block < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: row_block %lld < 0",
                          (long long)p->row_block);
    size_t tmp;
    if (kiln_mul_overflow((size_t)p->N, (size_t)p->H, &tmp) ||
        kiln_mul_overflow(tmp, sizeof(float), &tmp) ||
        kiln_mul_overflow((size_t)p->V, (size_t)p->H, &tmp) ||
        kiln_mul_overflow(tmp, sizeof(float), &tmp))
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: N x H or V x H overflows");
    return KILN_OK;
}

/* loss_i = (m - zt) + log(l) for the S rows; a non-finite one is an error naming its
 * position (idx: the rows' positions). */
static kiln_status ce_row_losses(const int64_t *idx, const float *m, const float *l,
                                 const float *zt, float *loss, int64_t S) {
    for (int64_t i = 0; i < S; i++) {
        float li = (m[i] - zt[i]) + kiln_fused_ce_logf(l[i]);
        if (!isfinite(li))
            return kiln_error(
                KILN_ERR_RANGE,
                "fused_ce: position %lld (supervised row %lld): loss is not finite (max logit "
                "%g, sum of exponentials %g, target logit %g): non-finite hidden states or "
                "weights, or logits beyond the float range",
                (long long)idx[i], (long long)i, (double)m[i], (double)l[i], (double)zt[i]);
        loss[i] = li;
    }
    return KILN_OK;
}

/* The reduced loss, the gradient factor and the float64 loss from the row losses and their
 * lane-16 sum. */
static void ce_reduce(const kiln_fused_ce_params *p, const float *row_loss, float sum, int64_t S,
                      float *loss, float *gs, double *loss64) {
    const int mean = p->reduction == KILN_CE_REDUCTION_MEAN;
    *gs = mean ? p->scale / (float)S : p->scale;
    if (!row_loss) return; /* gs alone: it does not depend on the losses */
    double sum64 = 0.0;
    for (int64_t i = 0; i < S; i++) sum64 += (double)row_loss[i];
    if (mean) {
        *loss = (sum / (float)S) * p->scale;
        *loss64 = sum64 / (double)S * (double)p->scale;
    } else {
        *loss = sum * p->scale;
        *loss64 = sum64 * (double)p->scale;
    }
}

/* The lane-16 sum of v[0..n) on the host without a ones array: kiln_dot_accum_ref's lanes with
 * b = 1 (fmaf(v, 1, acc)), then the fixed tree -- the bits of lane_sum on any CPU path. */
static float host_sum16(const float *v, int64_t n) {
    float acc[KILN_DOT_LANES] = {0};
    for (int64_t i = 0; i < n; i++)
        acc[i % KILN_DOT_LANES] = fmaf(v[i], 1.0f, acc[i % KILN_DOT_LANES]);
    return kiln_lane16_reduce(acc);
}

/* ---- the CPU path's row work on the backend's pool ----------------------------------------- */

/* Every piece below computes outputs of its own (rows of z and of the row statistics, rows of
 * a transpose, a range of a sum) in the serial code's order, so the split changes no bit. */
typedef struct ce_cpu_job {
    const kiln_fused_ce_params *p;
    ce_scratch *sc;
    const kiln_cpu_kernels *k;
    int64_t c0, n;    /* the chunk: columns [c0, c0 + n) */
    float *z;         /* the chunk's logits (S, n): sc->z, or its slot in p->keep */
    float gs;         /* the gradient's factor (pass 2) */
    float *dst;       /* transposes and sums: the destination */
    const float *src; /* ... and the source */
    const void *w;    /* the weight chunk's first row (its transpose) */
    int64_t rows, cols;
} ce_cpu_job;

typedef void (*ce_range_fn)(const ce_cpu_job *j, int64_t lo, int64_t hi);

typedef struct ce_par {
    ce_range_fn fn;
    const ce_cpu_job *j;
    int64_t n, grain;
    int tasks;
} ce_par;

static void ce_par_task(void *arg, int task, int thread) {
    (void)thread;
    const ce_par *q = arg;
    int64_t per = (q->n + q->tasks - 1) / q->tasks;
    per = (per + q->grain - 1) / q->grain * q->grain;
    int64_t lo = (int64_t)task * per, hi = lo + per < q->n ? lo + per : q->n;
    if (lo < hi) q->fn(q->j, lo, hi);
}

/* fn over [0, n) in pieces that start at multiples of grain: on the pool when there is one
 * with several threads, else on the calling thread. */
static void ce_parallel(kiln_pool *pool, int64_t n, int64_t grain, ce_range_fn fn,
                        const ce_cpu_job *j) {
    int nt = pool ? kiln_pool_n_threads(pool) : 1;
    int64_t tasks = n / (grain * 8) + 1;
    if (tasks > 4 * (int64_t)nt) tasks = 4 * (int64_t)nt;
    if (nt <= 1 || tasks <= 1) {
        fn(j, 0, n);
        return;
    }
    ce_par q = {fn, j, n, grain, (int)tasks};
    kiln_pool_run(pool, (int)tasks, ce_par_task, &q);
}

/* Pass 1 on rows [lo, hi) of one chunk: the target's logit, the chunk's max, the online
 * rescale and the lane sum of the exponentials. */
static void ce_pass1_rows(const ce_cpu_job *j, int64_t lo, int64_t hi) {
    ce_scratch *sc = j->sc;
    const int64_t n = j->n;
    for (int64_t i = lo; i < hi; i++) {
        const float *zr = j->z + i * n; /* the logits: left as they are when kept */
        float *er = sc->z + i * n;      /* their exponentials (in place when not kept) */
        int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        if (t >= 0 && t < n) sc->zt[i] = zr[t];
        float bm = zr[0];
        for (int64_t c = 1; c < n; c++) bm = zr[c] > bm ? zr[c] : bm;
        float m_new = bm > sc->m[i] ? bm : sc->m[i];
        float alpha = kiln_expf(sc->m[i] - m_new); /* first chunk: exp(-inf) = 0 */
        j->k->exp_sub(er, zr, m_new, (int)n);
        float csum = lane_sum(j->k, er, sc->ones, n);
        sc->l[i] = sc->l[i] * alpha + csum;
        sc->m[i] = m_new;
    }
}

/* Pass 2 on rows [lo, hi) of one chunk: g = (softmax - onehot) * gs in place. */
static void ce_pass2_rows(const ce_cpu_job *j, int64_t lo, int64_t hi) {
    ce_scratch *sc = j->sc;
    const int64_t n = j->n;
    const float gs = j->gs;
    for (int64_t i = lo; i < hi; i++) {
        float *zr = j->z + i * n;
        float li = sc->l[i];
        int64_t t = j->p->targets[sc->idx[i]] - j->c0;
        j->k->exp_sub(zr, zr, sc->m[i], (int)n);
        float et = (t >= 0 && t < n) ? zr[t] : 0.0f;
        for (int64_t c = 0; c < n; c++) zr[c] = (zr[c] / li) * gs;
        if (t >= 0 && t < n) zr[t] = ((et / li) - 1.0f) * gs;
    }
}

static void ce_transpose_rows(const ce_cpu_job *j, int64_t lo, int64_t hi) {
    transpose_f32_rows(j->dst, j->src, j->rows, j->cols, lo, hi);
}

/* The W chunk (n rows from src) transposed into dst(H, n), rows [lo, hi) of the chunk. */
static void ce_weight_t_rows(const ce_cpu_job *j, int64_t lo, int64_t hi) {
    transpose_weight_rows(j->dst, j->w, j->p->weight_dtype, j->n, j->p->H, lo, hi);
}

static void ce_add_range(const ce_cpu_job *j, int64_t lo, int64_t hi) {
    j->k->add(j->dst + lo, j->src + lo, (size_t)(hi - lo));
}

/* ---- the op on the CUDA backend ----------------------------------------------------------- */

/* Fast mode's rows: S rounded up to a multiple of 8 when the lean layout with them fits the
 * documented bound kiln_fused_ce_scratch_bytes (always but for tiny H and chunk), else S.
 * Only pass 2 has products with the rows as an inner dimension, so without dh and dW: S. */
static int64_t ce_fast_rows(int64_t S, int64_t H, int64_t cn, int with_dh, int with_dw) {
    if (!with_dh && !with_dw) return S;
    const int64_t Sp = (S + 7) & ~(int64_t)7;
    if (Sp > INT32_MAX) return S; /* the products take an int row count */
    size_t bound = ce_layout(S, S, H, cn, with_dh, with_dw, CE_FULL, 0, 0, NULL, NULL);
    size_t padded = ce_layout(S, Sp, H, cn, with_dh, with_dw, CE_LEAN, 0, 0, NULL, NULL);
    return padded != 0 && padded <= bound ? Sp : S;
}

/* The backend's fast matmul runs up to this many rows as matrix-vector kernels on f32 hs
 * (cuda_backend.cu, cu_matmul), not as a GEMM: the bf16 path, whose logits are GEMMs, would
 * give other bits, so those calls keep the composition. */
#define CE_MATVEC_ROWS 8

/* Fast mode's layout for S rows padded to Sp (ce_fast_rows, the same for both, so both give
 * the same products): CE_BF16 when it fits the documented bound and S > CE_MATVEC_ROWS, else
 * CE_LEAN. With dh but not dW, CE_BF16 needs 2 S cn bytes more than the bound's slack
 * (6 S H + 2 cn H bytes) for g's bf16 copy, so it fits only for chunks up to about 3 H; the
 * calls with both gradients or neither always fit but for tiny H and chunk. */
static ce_kind ce_fast_kind(int64_t S, int64_t Sp, int64_t H, int64_t cn, int with_dh,
                            int with_dw, int w_copy) {
    if (kiln_cuda_ce_legacy() || S <= CE_MATVEC_ROWS) return CE_LEAN;
    size_t bound = ce_layout(S, S, H, cn, with_dh, with_dw, CE_FULL, 0, 0, NULL, NULL);
    size_t bf = ce_layout(S, Sp, H, cn, with_dh, with_dw, CE_BF16, w_copy, 0, NULL, NULL);
    return bf != 0 && bf <= bound ? CE_BF16 : CE_LEAN;
}

/* Fast mode's pass 2 (device memory; hs has Sp rows, rows S..Sp-1 zero): per chunk the
 * logits of the S rows, g in place with its padding rows zeroed, then one matmul_backward:
 *   dh_acc(Sp, H) = g(Sp, n) @ W_chunk(n, H)      (the first chunk overwrites, later ones add)
 *   dW[c0 : c0+n] += g^T @ hs(Sp, H)
 * A failed product poisons the backend: the next kernel entry returns it, or else the
 * caller's final kiln_backend_status (no synchronisation here). */
static kiln_status ce_pass2_fast(kiln_backend *be, const kiln_fused_ce_params *p,
                                 const ce_scratch *sc, int64_t S, int64_t Sp, int64_t cn,
                                 const int32_t *d_tgt, float gs, size_t row_bytes) {
    const int64_t H = p->H, V = p->V;
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        chunk_logits(be, p, sc->hs, S, c0, n, row_bytes, sc->z);
        KILN_TRY(kiln_cuda_ce_grad_fast(be, sc->z, S, Sp, n, c0, d_tgt, sc->m, sc->l, gs));
        kiln_tensor wc = weight_chunk(p, c0, n, row_bytes);
        be->i->matmul_backward(be, p->dhidden ? sc->dh_acc : NULL,
                               p->dweight ? p->dweight + c0 * H : NULL, NULL, sc->z, sc->hs,
                               &wc, (int)Sp, c0 > 0);
    }
    return KILN_OK;
}

/* z(S, n) = hsb @ W[c0 : c0+n]^T on bf16 operands: with wb (the chunk in bf16, ldw apart) one
 * kiln_cuda_gemm_bf16, else kiln_cuda_gemm_linear_bf16, which reads a bf16 W in place or
 * converts W into the GEMM module's scratch with the same leading dimension -- the one product
 * either way, and kiln_cuda_gemm_linear's on hs (the module's contract). */
static kiln_status ce_logits_bf16(kiln_backend *be, const kiln_fused_ce_params *p,
                                  const ce_scratch *sc, int64_t S, int64_t c0, int64_t n,
                                  size_t row_bytes, const uint16_t *wb, int64_t ldw) {
    const int64_t H = p->H, ldH = ce_bf16_ld(H);
    if (wb) return kiln_cuda_ce_gemm_bf16(be, 0, 1, S, n, H, sc->hsb, ldH, wb, ldw, sc->z, n, 0);
    return kiln_cuda_ce_linear_bf16(be, sc->z, sc->hsb, ldH,
                                    (const uint8_t *)p->weight + (size_t)c0 * row_bytes,
                                    row_bytes, p->weight_dtype, n, H, S);
}

/* Fast mode's pass 2 on bf16 operands (layout CE_BF16; hsb has Sp rows, rows S..Sp-1 zero),
 * per chunk, with the operands kiln_cuda_matmul_backward_fast would make (ld(.): ce_bf16_ld):
 *   wb(n, ld(H))      = W[c0 : c0+n] in bf16 when dh is wanted: read in place when bf16 with
 *                       16-byte aligned rows, else converted into sc->wb, once for both of
 *                       this chunk's products that read it;
 *   z(S, n)           = hsb @ wb^T                          (ce_logits_bf16)
 *   gb(Sp, ld(n))     = bf16(g), rows S..Sp-1 zero           (one kernel: no f32 g)
 *   dh_acc(Sp, H)    (+)= gb @ wb                            (the first chunk overwrites)
 *   dW[c0 : c0+n]     += gb^T @ hsb
 * A failed product poisons the backend and is returned. */
static kiln_status ce_pass2_bf16(kiln_backend *be, const kiln_fused_ce_params *p,
                                 const ce_scratch *sc, int64_t S, int64_t Sp, int64_t cn,
                                 const int32_t *d_tgt, float gs, size_t row_bytes) {
    const int64_t H = p->H, V = p->V, ldH = ce_bf16_ld(H);
    const int in_place = kiln_cuda_ce_weight_in_place(p->weight, row_bytes, p->weight_dtype);
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        const int64_t n = V - c0 < cn ? V - c0 : cn, ldg = ce_bf16_ld(n);
        const uint8_t *w = (const uint8_t *)p->weight + (size_t)c0 * row_bytes;
        const uint16_t *wb = NULL;
        int64_t ldw = 0;
        if (p->dhidden && in_place) {
            wb = (const uint16_t *)(const void *)w;
            ldw = (int64_t)(row_bytes / 2);
        } else if (p->dhidden) {
            KILN_TRY(kiln_cuda_ce_weight_bf16(be, sc->wb, ldH, w, row_bytes, p->weight_dtype, n,
                                              H));
            wb = sc->wb;
            ldw = ldH;
        }
        KILN_TRY(ce_logits_bf16(be, p, sc, S, c0, n, row_bytes, wb, ldw));
        KILN_TRY(kiln_cuda_ce_grad_bf16(be, sc->gb, ldg, sc->z, S, Sp, n, c0, d_tgt, sc->m, sc->l,
                                        gs));
        if (p->dhidden)
            KILN_TRY(kiln_cuda_ce_gemm_bf16(be, 0, 0, Sp, H, n, sc->gb, ldg, wb, ldw, sc->dh_acc,
                                            H, c0 > 0));
        if (p->dweight)
            KILN_TRY(kiln_cuda_ce_gemm_bf16(be, 1, 0, n, H, Sp, sc->gb, ldg, sc->hsb, ldH,
                                            p->dweight + c0 * H, H, 1));
    }
    return KILN_OK;
}

/* Rows per block of fast mode's row-block walk for this call (kiln_fused_ce_params.row_block,
 * rounded up to 8 and at most Sp8, S rounded up to 8), or 0 for the vocabulary walk: the call
 * must be in the one-call form (no_wait with row_stats_out, no row_stats_in), want a gradient,
 * read a bf16 weight in place, and have more than CE_MATVEC_ROWS rows. */
static int64_t ce_row_block(const kiln_fused_ce_params *p, int64_t S, int fast,
                            size_t row_bytes) {
    const int64_t Sp8 = (S + 7) & ~(int64_t)7;
    if (!fast || p->row_block <= 0 || (!p->dhidden && !p->dweight) || !p->no_wait ||
        !p->row_stats_out || p->row_stats_in || kiln_cuda_ce_legacy() || S <= CE_MATVEC_ROWS ||
        Sp8 > INT32_MAX || !kiln_cuda_ce_weight_in_place(p->weight, row_bytes, p->weight_dtype))
        return 0;
    return ce_rows_of(p->row_block, Sp8);
}

/* Fast mode's row-block walk (layout CE_ROWS; hsb has Sp rows, a multiple of 8, rows S..Sp-1
 * zero; the weight is bf16, read in place, ldw = row_bytes / 2), per block of R <= rb rows
 * [r0, r0+R) (a multiple of 8; only the last holds padding rows):
 *   z(R, ld(V))       = hsb[r0 : r0+R] @ W^T                  (the block's whole logits, in
 *                       bf16 when z16 -- the f32 product rounded once, as autocast's head
 *                       output -- else f32)
 *   m, l, zt[r0 ...]  = its rows' statistics; g = bf16 gradient, in place in z: g(R, ld(V))
 *                       over bf16 logits, g(R, 2 ld(V)) over f32 ones
 *                       (kiln_cuda_ce_rows_fast; the padding rows' g zero)
 *   dh_acc[r0 ...]    = g @ W                                 (R x H, overwritten)
 *   dW               += g^T @ hsb[r0 : r0+R]
 * A failed product poisons the backend and is returned. */
static kiln_status ce_rows_bf16(kiln_backend *be, const kiln_fused_ce_params *p,
                                const ce_scratch *sc, int64_t S, int64_t Sp, int64_t rb, int z16,
                                const int32_t *d_tgt, float gs, size_t row_bytes) {
    const int64_t H = p->H, V = p->V, ldH = ce_bf16_ld(H), ldz = ce_bf16_ld(V);
    const uint16_t *w = (const uint16_t *)p->weight;
    const int64_t ldw = (int64_t)(row_bytes / 2), ldg = z16 ? ldz : 2 * ldz;
    uint16_t *g = (uint16_t *)(void *)sc->z; /* the bf16 logits, then the gradient */
    for (int64_t r0 = 0; r0 < Sp; r0 += rb) {
        const int64_t R = Sp - r0 < rb ? Sp - r0 : rb;
        const int64_t Rs = S - r0 < R ? S - r0 : R; /* >= 1: r0 <= Sp - 8 < S */
        const uint16_t *hb = sc->hsb + r0 * ldH;
        if (z16)
            KILN_TRY(kiln_cuda_ce_gemm_bf16_out16(be, 0, 1, R, V, H, hb, ldH, w, ldw, g, ldz));
        else
            KILN_TRY(kiln_cuda_ce_gemm_bf16(be, 0, 1, R, V, H, hb, ldH, w, ldw, sc->z, ldz, 0));
        KILN_TRY(kiln_cuda_ce_rows_fast(be, sc->z, ldz, R, Rs, V, z16, d_tgt + r0, sc->m + r0,
                                        sc->l + r0, sc->zt + r0, gs));
        if (p->dhidden)
            KILN_TRY(kiln_cuda_ce_gemm_bf16(be, 0, 0, R, H, V, g, ldg, w, ldw,
                                            sc->dh_acc + r0 * H, H, 0));
        if (p->dweight)
            KILN_TRY(kiln_cuda_ce_gemm_bf16(be, 1, 0, V, H, R, g, ldg, hb, ldH, p->dweight, H, 1));
    }
    return KILN_OK;
}

/* As kiln_fused_ce's CPU body, for S >= 1 validated supervised rows and chunk cn: hidden,
 * weight and the outputs are device memory, targets and mask host memory. The scratch is one
 * kiln_backend_alloc block with ce_layout's regions (so kiln_fused_ce_scratch_bytes bounds it),
 * where `ones` (max(cn, S) floats, unused on the device) holds the rows' int32 targets. */
static kiln_status ce_device(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                             int64_t cn, kiln_fused_ce_result *out) {
    const int64_t N = p->N, H = p->H, V = p->V;
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    const int bf16 = p->weight_dtype == KILN_DTYPE_BF16;
    const int fast = kiln_cuda_ce_is_fast(be);
    if (!kiln_cuda_train_is_device(p->hidden) || !kiln_cuda_train_is_device(p->weight) ||
        (p->dhidden && !kiln_cuda_train_is_device(p->dhidden)) ||
        (p->dweight && !kiln_cuda_train_is_device(p->dweight)) ||
        (p->row_loss && !kiln_cuda_train_is_device(p->row_loss)) ||
        (p->row_stats_out && !kiln_cuda_train_is_device(p->row_stats_out)) ||
        (p->row_stats_in && !kiln_cuda_train_is_device(p->row_stats_in)))
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "fused_ce: on the CUDA backend hidden, weight, dhidden, dweight, "
                          "row_loss and row_stats must be device memory (targets and mask stay "
                          "host memory)");
    /* fast: Sp padded rows and the bf16 or lean layout (<= the auditable one, the documented
     * bound) */
    const size_t row_bytes = (size_t)H * (bf16 ? 2 : 4);
    /* fast mode's row-block walk (rb > 0: CE_ROWS, z's columns ld(V)) */
    const int64_t rb = ce_row_block(p, S, fast, row_bytes);
    const int64_t Sp = rb ? (S + 7) & ~(int64_t)7 : fast ? ce_fast_rows(S, H, cn, with_dh, with_dw) : S;
    const int w_copy = !kiln_cuda_ce_weight_in_place(p->weight, row_bytes, p->weight_dtype);
    const ce_kind kind = rb ? CE_ROWS : !fast ? CE_FULL : ce_fast_kind(S, Sp, H, cn, with_dh, with_dw, w_copy);
    const int z16 = rb && ce_rows_z16(V, p->row_logits_f32); /* the walk's logits in bf16 */
    const int64_t ldH = ce_bf16_ld(H), lcn = rb ? ce_rows_zcols(V, z16) : cn; /* z's columns, floats */
    size_t bytes = ce_layout(S, Sp, H, lcn, with_dh, with_dw, kind, w_copy, rb, NULL, NULL);
    if (bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: scratch size overflows");
    /* host: positions, targets, then m, l, zt, loss of the rows */
    int64_t *hidx = kiln_malloc((size_t)S * sizeof(int64_t));
    int32_t *htgt = kiln_malloc((size_t)S * sizeof(int32_t));
    /* hrow: the rows' losses, then m, l, zt as they lie in the scratch (ce_layout's regions,
     * consecutive, each padded to 64 bytes) */
    float *hrow = kiln_malloc((4 * (size_t)S + 48) * sizeof(float));
    uint8_t *block = NULL;
    int own = 1; /* block is this call's allocation (not the caller's scratch) */
    kiln_status st = KILN_OK;
#define CE_DEV(call)                                                                               do {                                                                                               st = (call);                                                                                   if (st != KILN_OK) goto done;                                                              } while (0)
    if (!hidx || !htgt || !hrow) {
        st = kiln_error(KILN_ERR_NOMEM, "fused_ce: out of host memory for %lld rows",
                        (long long)S);
        goto done;
    }
    own = !(p->scratch && p->scratch_cap >= bytes && ((uintptr_t)p->scratch & 255u) == 0);
    block = own ? kiln_backend_alloc(be, bytes) : (uint8_t *)p->scratch;
    if (!block) {
        st = kiln_error(KILN_ERR_NOMEM, "fused_ce: out of device memory for %zu bytes of "
                        "scratch (%lld supervised rows x chunk %lld)", bytes, (long long)S,
                        (long long)cn);
        goto done;
    }
    ce_scratch sc;
    ce_layout(S, Sp, H, lcn, with_dh, with_dw, kind, w_copy, rb, block, &sc);
    int32_t *d_tgt = (int32_t *)(void *)sc.ones;
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        hidx[i] = n;
        htgt[i] = p->targets[n];
        i++;
    }
    CE_DEV(kiln_backend_upload(be, sc.idx, hidx, (size_t)S * sizeof(int64_t)));
    CE_DEV(kiln_backend_upload(be, d_tgt, htgt, (size_t)S * sizeof(int32_t)));
    if (kind == CE_BF16 || kind == CE_ROWS) { /* hs in bf16 once, its padding rows zero */
        CE_DEV(kiln_cuda_ce_gather_bf16(be, sc.hsb, ldH, p->hidden, sc.idx, S, Sp, H));
    } else {
        CE_DEV(kiln_cuda_ce_gather(be, sc.hs, p->hidden, sc.idx, S, H));
        if (Sp > S) /* fast mode's padding rows: zero hidden states */
            CE_DEV(kiln_cuda_train_memset(be, sc.hs + S * H, 0,
                                          (size_t)(Sp - S) * (size_t)H * sizeof(float)));
    }
    /* gs, the gradient's factor, depends on S and the reduction only (ce_reduce) */
    float loss = 0.0f, gs;
    double loss64 = 0.0;
    ce_reduce(p, NULL, 0.0f, S, NULL, &gs, NULL);
    if (kind == CE_ROWS) /* statistics and gradients, block by block */
        CE_DEV(ce_rows_bf16(be, p, &sc, S, Sp, rb, z16, d_tgt, gs, row_bytes));
    else
        CE_DEV(kiln_cuda_ce_init_rows(be, sc.m, sc.l, sc.zt, p->row_stats_in, sc.idx, S));

    /* Pass 1 (skipped with row_stats_in, and by the row-block walk). */
    for (int64_t c0 = 0; kind != CE_ROWS && !p->row_stats_in && c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        if (kind == CE_BF16)
            CE_DEV(ce_logits_bf16(be, p, &sc, S, c0, n, row_bytes, NULL, 0));
        else
            chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, sc.z);
        if (fast)
            CE_DEV(kiln_cuda_ce_pass1_fast(be, sc.z, S, n, c0, d_tgt, sc.m, sc.l, sc.zt));
        else
            CE_DEV(kiln_cuda_ce_pass1(be, sc.z, S, n, c0, d_tgt, sc.m, sc.l, sc.zt));
    }
    if (p->row_stats_out)
        CE_DEV(kiln_cuda_ce_stats_out(be, p->row_stats_out, sc.m, sc.l, sc.zt, sc.idx, S));
    /* The loss needs the statistics on the host. With row_stats_in they were checked by the
     * call that made them, so the fast pass 2 is enqueued before the download and the device
     * works while the host waits for it; otherwise the download and the loss's check come
     * first, so that a non-finite loss leaves dhidden and dweight untouched (but in the
     * one-call form, no_wait with row_stats_out, and the row-block walk, which is only that). */
    const int early = fast && (with_dh || with_dw) &&
                      (p->row_stats_in != NULL || (p->no_wait && p->row_stats_out != NULL));
    if (early && kind == CE_BF16) /* (CE_ROWS: done above) */
        CE_DEV(ce_pass2_bf16(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    else if (early && kind != CE_ROWS)
        CE_DEV(ce_pass2_fast(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    /* no_wait: nothing below waits for the device (the stats were checked when made) */
    const int no_wait = p->no_wait && early && !own && !p->row_loss;
    float *hloss = hrow;
    if (no_wait) {
        loss = NAN;
        loss64 = NAN;
    } else {
        const size_t off_l = (size_t)((char *)sc.l - (char *)sc.m) / sizeof(float);
        const size_t off_zt = (size_t)((char *)sc.zt - (char *)sc.m) / sizeof(float);
        float *hm = hrow + S, *hl = hm + off_l, *hzt = hm + off_zt;
        CE_DEV(kiln_backend_download(be, hm, sc.m, (off_zt + (size_t)S) * sizeof(float)));
        CE_DEV(ce_row_losses(hidx, hm, hl, hzt, hloss, S));
        ce_reduce(p, hloss, host_sum16(hloss, S), S, &loss, &gs, &loss64);
    }

    /* Pass 2. */
    if (!early && kind == CE_BF16 && (with_dh || with_dw))
        CE_DEV(ce_pass2_bf16(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    else if (!early && fast && (with_dh || with_dw))
        CE_DEV(ce_pass2_fast(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    if (!fast && (with_dh || with_dw)) {
        if (with_dw) CE_DEV(kiln_cuda_ce_transpose(be, sc.hT, sc.hs, 0, S, H));
        if (with_dh)
            CE_DEV(kiln_cuda_train_memset(be, sc.dh_acc, 0, (size_t)S * (size_t)H * sizeof(float)));
        for (int64_t c0 = 0; c0 < V; c0 += cn) {
            int64_t n = V - c0 < cn ? V - c0 : cn;
            chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, sc.z);
            CE_DEV(kiln_cuda_ce_grad(be, sc.z, S, n, c0, d_tgt, sc.m, sc.l, gs));
            if (with_dh) {
                CE_DEV(kiln_cuda_ce_transpose(be, sc.wT,
                                              (const uint8_t *)p->weight + (size_t)c0 * row_bytes,
                                              bf16, n, H));
                kiln_tensor wt = f32_view("fused_ce.weight_chunk_t", sc.wT, H, n);
                be->i->matmul(be, sc.dpart, sc.z, &wt, NULL, (int)S);
                CE_DEV(kiln_cuda_ce_add(be, sc.dh_acc, sc.dpart, (size_t)S * (size_t)H));
            }
            if (with_dw) {
                CE_DEV(kiln_cuda_ce_transpose(be, sc.gT, sc.z, 0, S, n));
                kiln_tensor ht = f32_view("fused_ce.hidden_t", sc.hT, H, S);
                be->i->matmul(be, sc.wpart, sc.gT, &ht, NULL, (int)n);
                CE_DEV(kiln_cuda_ce_add(be, p->dweight + c0 * H, sc.wpart, (size_t)n * (size_t)H));
            }
        }
    }

    /* Outputs. */
    if (p->row_loss) {
        CE_DEV(kiln_backend_upload(be, sc.loss, hloss, (size_t)S * sizeof(float)));
        CE_DEV(kiln_cuda_train_memset(be, p->row_loss, 0, (size_t)N * sizeof(float)));
        CE_DEV(kiln_cuda_ce_scatter_rows(be, p->row_loss, sc.loss, sc.idx, S, 1, 0));
    }
    if (with_dh) {
        if (!p->dhidden_accumulate)
            CE_DEV(kiln_cuda_train_memset(be, p->dhidden, 0,
                                          (size_t)N * (size_t)H * sizeof(float)));
        CE_DEV(kiln_cuda_ce_scatter_rows(be, p->dhidden, sc.dh_acc, sc.idx, S, H,
                                         p->dhidden_accumulate));
    }
    if (!no_wait) CE_DEV(kiln_backend_status(be));
    if (out) {
        out->loss = loss;
        out->loss_f64 = loss64;
        out->n_supervised = S;
        out->scratch_bytes = bytes;
        out->loss_pending = no_wait;
    }
done:
#undef CE_DEV
    if (block && own) {
        /* the scratch may still be in use by enqueued work after an error: wait first */
        (void)kiln_backend_status(be);
        kiln_backend_free_buf(be, block);
    }
    kiln_free(hidx);
    kiln_free(htgt);
    kiln_free(hrow);
    return st;
}

kiln_status kiln_fused_ce_supervised(const kiln_fused_ce_params *p, int64_t *S_out) {
    /* Supervised rows: mask (or all) and target >= 0. Their targets must be < V. */
    int64_t S = 0;
    for (int64_t n = 0; n < p->N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        if (p->targets[n] >= p->V)
            return kiln_error(KILN_ERR_RANGE,
                              "fused_ce: position %lld: target %d >= vocabulary size %lld",
                              (long long)n, (int)p->targets[n], (long long)p->V);
        S++;
    }
    if (S == 0)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "fused_ce: no supervised positions (the mask and targets select none "
                          "of the %lld positions)", (long long)p->N);
    *S_out = S;
    return KILN_OK;
}

kiln_status kiln_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p,
                          kiln_fused_ce_result *out) {
    if (out) memset(out, 0, sizeof *out);
    KILN_TRY(check_params(be, p));
    const int64_t N = p->N, H = p->H, V = p->V;

    int64_t S = 0;
    KILN_TRY(kiln_fused_ce_supervised(p, &S));

    int64_t cn = p->chunk == 0 ? KILN_FUSED_CE_DEFAULT_CHUNK : p->chunk;
    if (cn > V) cn = V;
    if (is_cuda(be)) return ce_device(be, p, S, cn, out);
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    ce_scratch sc;
    size_t bytes = ce_layout(S, S, H, cn, with_dh, with_dw, CE_FULL, 0, 0, NULL, NULL);
    if (bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: scratch size overflows");
    uint8_t *block = kiln_malloc(bytes);
    if (!block)
        return kiln_error(KILN_ERR_NOMEM, "fused_ce: out of memory for %zu bytes of scratch "
                          "(%lld supervised rows x chunk %lld)", bytes, (long long)S,
                          (long long)cn);
    ce_layout(S, S, H, cn, with_dh, with_dw, CE_FULL, 0, 0, block, &sc);

    const kiln_cpu_kernels *k = kernels_of(be);
    kiln_pool *pool = kiln_backend_cpu_pool(be);
    const size_t row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    int64_t ones_n = cn > S ? cn : S;
    for (int64_t j = 0; j < ones_n; j++) sc.ones[j] = 1.0f;

    /* Gather (ascending positions). */
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        sc.idx[i] = n;
        memcpy(sc.hs + i * H, p->hidden + n * H, (size_t)H * sizeof(float));
        i++;
    }
    for (int64_t i = 0; i < S; i++) {
        sc.m[i] = -INFINITY;
        sc.l[i] = 0.0f;
        sc.zt[i] = 0.0f;
    }

    /* Pass 1: online log-sum-exp, chunks ascending (or its statistics from an earlier call). */
    if (p->row_stats_in)
        for (int64_t i = 0; i < S; i++) {
            const float *rs = p->row_stats_in + 3 * sc.idx[i];
            sc.m[i] = rs[0];
            sc.l[i] = rs[1];
            sc.zt[i] = rs[2];
        }
    ce_cpu_job job = {p, &sc, k, 0, 0, sc.z, 0.0f, NULL, NULL, NULL, 0, 0};
    /* the chunks whose logits p->keep holds: the first kept_chunks */
    const int64_t slot = S * cn;
    const int64_t kept_chunks = p->keep ? (int64_t)(p->keep_floats / (size_t)slot) : 0;
    for (int64_t c0 = 0; !p->row_stats_in && c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        job.z = c0 / cn < kept_chunks ? p->keep + (c0 / cn) * slot : sc.z;
        chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, job.z);
        job.c0 = c0;
        job.n = n;
        ce_parallel(pool, S, 1, ce_pass1_rows, &job);
    }
    if (p->row_stats_out)
        for (int64_t i = 0; i < S; i++) {
            float *rs = p->row_stats_out + 3 * sc.idx[i];
            rs[0] = sc.m[i];
            rs[1] = sc.l[i];
            rs[2] = sc.zt[i];
        }
    kiln_status lst = ce_row_losses(sc.idx, sc.m, sc.l, sc.zt, sc.loss, S);
    if (lst != KILN_OK) {
        kiln_free(block);
        return lst;
    }
    float loss = 0.0f, gs;
    double loss64 = 0.0;
    ce_reduce(p, sc.loss, lane_sum(k, sc.loss, sc.ones, S), S, &loss, &gs, &loss64);

    /* Pass 2: g = (softmax - onehot) * gs per chunk, into dh and dW. */
    if (with_dh || with_dw) {
        if (with_dw) transpose_f32(sc.hT, sc.hs, S, H);
        if (with_dh) memset(sc.dh_acc, 0, (size_t)S * (size_t)H * sizeof(float));
        job.gs = gs;
        for (int64_t c0 = 0; c0 < V; c0 += cn) {
            int64_t n = V - c0 < cn ? V - c0 : cn;
            float *g = c0 / cn < kept_chunks ? p->keep + (c0 / cn) * slot : sc.z;
            if (g == sc.z) chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, sc.z);
            job.z = g;
            job.c0 = c0;
            job.n = n;
            ce_parallel(pool, S, 1, ce_pass2_rows, &job);
            if (with_dh) {
                job.dst = sc.wT;
                job.w = (const uint8_t *)p->weight + (size_t)c0 * row_bytes;
                ce_parallel(pool, n, 32, ce_weight_t_rows, &job);
                kiln_tensor wt = f32_view("fused_ce.weight_chunk_t", sc.wT, H, n);
                be->i->matmul(be, sc.dpart, g, &wt, NULL, (int)S);
                job.dst = sc.dh_acc;
                job.src = sc.dpart;
                ce_parallel(pool, S * H, 4096, ce_add_range, &job);
            }
            if (with_dw) {
                job.dst = sc.gT;
                job.src = g;
                job.rows = S;
                job.cols = n;
                ce_parallel(pool, S, 32, ce_transpose_rows, &job);
                kiln_tensor ht = f32_view("fused_ce.hidden_t", sc.hT, H, S);
                be->i->matmul(be, sc.wpart, sc.gT, &ht, NULL, (int)n);
                job.dst = p->dweight + c0 * H;
                job.src = sc.wpart;
                ce_parallel(pool, n * H, 4096, ce_add_range, &job);
            }
        }
    }

    /* Outputs. */
    if (p->row_loss) {
        memset(p->row_loss, 0, (size_t)N * sizeof(float));
        for (int64_t i = 0; i < S; i++) p->row_loss[sc.idx[i]] = sc.loss[i];
    }
    if (with_dh) {
        if (!p->dhidden_accumulate) {
            memset(p->dhidden, 0, (size_t)N * (size_t)H * sizeof(float));
            for (int64_t i = 0; i < S; i++)
                memcpy(p->dhidden + sc.idx[i] * H, sc.dh_acc + i * H, (size_t)H * sizeof(float));
        } else {
            for (int64_t i = 0; i < S; i++)
                k->add(p->dhidden + sc.idx[i] * H, sc.dh_acc + i * H, (size_t)H);
        }
    }
    if (out) {
        out->loss = loss;
        out->loss_f64 = loss64;
        out->n_supervised = S;
        out->scratch_bytes = bytes;
    }
    kiln_free(block);
    return KILN_OK;
}

kiln_status kiln_fused_ce_loss_from_stats(const kiln_fused_ce_params *p, const float *row_stats,
                                          kiln_fused_ce_result *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!p || !row_stats || !p->targets || p->N < 1)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce_loss_from_stats: NULL parameters or no rows");
    const int64_t N = p->N;
    int64_t S = 0;
    KILN_TRY(kiln_fused_ce_supervised(p, &S));
    /* the device path's arrays: positions, then m, l, zt and the row losses, supervised order */
    int64_t *idx = kiln_malloc((size_t)S * sizeof(int64_t));
    float *f = kiln_malloc(4 * (size_t)S * sizeof(float));
    if (!idx || !f) {
        kiln_free(idx);
        kiln_free(f);
        return kiln_error(KILN_ERR_NOMEM, "fused_ce: out of host memory for %lld rows", (long long)S);
    }
    float *m = f, *l = f + S, *zt = f + 2 * S, *loss_rows = f + 3 * S;
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        idx[i] = n;
        m[i] = row_stats[3 * n];
        l[i] = row_stats[3 * n + 1];
        zt[i] = row_stats[3 * n + 2];
        i++;
    }
    kiln_status st = ce_row_losses(idx, m, l, zt, loss_rows, S);
    if (st == KILN_OK && out) {
        float gs;
        ce_reduce(p, loss_rows, host_sum16(loss_rows, S), S, &out->loss, &gs, &out->loss_f64);
        out->n_supervised = S;
    }
    kiln_free(idx);
    kiln_free(f);
    return st;
}
