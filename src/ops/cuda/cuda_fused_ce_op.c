/*
 * cuda_fused_ce_op.c -- the fused linear cross-entropy (src/ops/fused_ce.h) on the CUDA
 * backend: the op's body, which drives the kernels of cuda_fused_ce.cu (cuda_train.h) and the
 * backend's matmul and matmul_backward. kiln_fused_ce has checked the call and counted its S
 * supervised rows.
 *
 * The CPU's steps (src/ops/cpu/cpu_fused_ce.c) run on the device in the same order (ce_device
 * below): the products are the backend's matmul (the auditable kernel gives the CPU matmul's
 * bits), the row-wise work is cuda_fused_ce.cu, and the per-row loss, its check and the two
 * sums (O(S) scalars) are computed on the host from the downloaded row statistics, with the
 * very code the CPU runs (kiln_ce_row_losses, the lane-16 sum).
 *
 * Fast mode (kiln_cuda_ce_is_fast: the products are bf16 tensor-core GEMMs, not the CPU's
 * bits) changes four things, each deterministic run to run:
 *   - pass 1's row statistics come from a parallel kernel (a tree max, a fixed-order sum);
 *   - the supervised rows are padded with zero rows to Sp, a multiple of 8 (when the padded
 *     scratch still fits kiln_fused_ce_scratch_bytes), so the row count is never an odd
 *     GEMM dimension (an odd K made cuBLASLt fall back to its align-1 kernels); the padding
 *     rows have zero hidden states and zero gradient factors, so they add exact zeros;
 *   - the operands are rounded to bf16 once each (ce_pass2_bf16, layout KILN_CE_BF16): hs when it
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
 * composition of those two ops (ce_pass2_products, layout KILN_CE_LEAN), run by the same cached
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
#include "../fused_ce.h"

#ifdef KILN_HAVE_CUDA
#include "../fused_ce_impl.h"
#include "cuda_train.h"

#include <math.h>
#include <string.h>

_Static_assert(KILN_FUSED_CE_ROWS16_MAX_V == KILN_CUDA_CE_ROWS16_MAX_V,
               "fused_ce.h's bound is the row kernel's");

/* Fast mode's rows: S rounded up to a multiple of 8 when the lean layout with them fits the
 * documented bound kiln_fused_ce_scratch_bytes (always but for tiny H and chunk), else S.
 * Only pass 2 has products with the rows as an inner dimension, so without dh and dW: S. */
static int64_t ce_fast_rows(int64_t S, int64_t H, int64_t cn, int with_dh, int with_dw) {
    if (!with_dh && !with_dw) return S;
    const int64_t Sp = (S + 7) & ~(int64_t)7;
    if (Sp > INT32_MAX) return S; /* the products take an int row count */
    size_t bound = kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, NULL, NULL);
    size_t padded = kiln_ce_layout(S, Sp, H, cn, with_dh, with_dw, KILN_CE_LEAN, 0, 0, NULL, NULL);
    return padded != 0 && padded <= bound ? Sp : S;
}

/* The backend's fast matmul runs up to this many rows as matrix-vector kernels on f32 hs
 * (cuda_backend.cu, cu_matmul), not as a GEMM: the bf16 path, whose logits are GEMMs, would
 * give other bits, so those calls keep the composition. */
#define CE_MATVEC_ROWS 8

/* Fast mode's layout for S rows padded to Sp (ce_fast_rows, the same for both, so both give
 * the same products): KILN_CE_BF16 when it fits the documented bound and S > CE_MATVEC_ROWS, else
 * KILN_CE_LEAN. With dh but not dW, KILN_CE_BF16 needs 2 S cn bytes more than the bound's slack
 * (6 S H + 2 cn H bytes) for g's bf16 copy, so it fits only for chunks up to about 3 H; the
 * calls with both gradients or neither always fit but for tiny H and chunk. */
static kiln_ce_kind ce_fast_kind(int64_t S, int64_t Sp, int64_t H, int64_t cn, int with_dh,
                            int with_dw, int w_copy) {
    if (kiln_cuda_ce_legacy() || S <= CE_MATVEC_ROWS) return KILN_CE_LEAN;
    size_t bound = kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, NULL, NULL);
    size_t bf = kiln_ce_layout(S, Sp, H, cn, with_dh, with_dw, KILN_CE_BF16, w_copy, 0, NULL, NULL);
    return bf != 0 && bf <= bound ? KILN_CE_BF16 : KILN_CE_LEAN;
}

/* The cross-entropy's gradient of one chunk for kiln_cuda_ce_pass2: fast mode's (its padding
 * rows S..Sp-1 zeroed) or the auditable one. */
typedef struct ce_grad_ctx {
    const kiln_ce_scratch *sc;
    const int32_t *d_tgt;
    int64_t S, Sp;
    float gs;
    int fast;
} ce_grad_ctx;

static kiln_status ce_grad_chunk(kiln_backend *be, const void *ctx, float *z, int64_t c0,
                                 int64_t n) {
    const ce_grad_ctx *c = ctx;
    return c->fast ? kiln_cuda_ce_grad_fast(be, z, c->S, c->Sp, n, c0, c->d_tgt, c->sc->m,
                                            c->sc->l, c->gs)
                   : kiln_cuda_ce_grad(be, z, c->S, n, c0, c->d_tgt, c->sc->m, c->sc->l, c->gs);
}

kiln_status kiln_cuda_ce_pass2(kiln_backend *be, const kiln_fused_ce_params *p,
                               const kiln_ce_scratch *sc, int64_t S, int64_t Sp, int64_t cn,
                               size_t row_bytes, kiln_cuda_ce_grad_fn grad, const void *ctx) {
    const int64_t H = p->H, V = p->V;
    const int bf16 = p->weight_dtype == KILN_DTYPE_BF16;
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    if (kiln_cuda_ce_is_fast(be) || kiln_cuda_weight_format(be, p->weight)) {
        /* A failed product poisons the backend: the next kernel entry returns it, or else the
         * caller's final kiln_backend_status (no synchronisation here). */
        for (int64_t c0 = 0; c0 < V; c0 += cn) {
            const int64_t n = V - c0 < cn ? V - c0 : cn;
            kiln_ce_chunk_logits(be, p, sc->hs, S, c0, n, row_bytes, sc->z);
            KILN_TRY(grad(be, ctx, sc->z, c0, n));
            kiln_tensor wc = kiln_ce_weight_chunk(p, c0, n, row_bytes);
            be->i->matmul_backward(be, with_dh ? sc->dh_acc : NULL,
                                   with_dw ? p->dweight + c0 * H : NULL, NULL, sc->z, sc->hs,
                                   &wc, (int)Sp, c0 > 0);
        }
        return KILN_OK;
    }
    /* auditable: the CPU's products on transposed copies, then the adds */
    if (with_dw) KILN_TRY(kiln_cuda_ce_transpose(be, sc->hT, sc->hs, 0, S, H));
    if (with_dh)
        KILN_TRY(kiln_cuda_train_memset(be, sc->dh_acc, 0, (size_t)S * (size_t)H * sizeof(float)));
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        const int64_t n = V - c0 < cn ? V - c0 : cn;
        kiln_ce_chunk_logits(be, p, sc->hs, S, c0, n, row_bytes, sc->z);
        KILN_TRY(grad(be, ctx, sc->z, c0, n));
        if (with_dh) {
            KILN_TRY(kiln_cuda_ce_transpose(be, sc->wT,
                                            (const uint8_t *)p->weight + (size_t)c0 * row_bytes,
                                            bf16, n, H));
            kiln_tensor wt = kiln_ce_f32_view("fused_ce.weight_chunk_t", sc->wT, H, n);
            kiln_cuda_matmul_f32(be, sc->dpart, sc->z, &wt, NULL, (int)S);
            KILN_TRY(kiln_cuda_ce_add(be, sc->dh_acc, sc->dpart, (size_t)S * (size_t)H));
        }
        if (with_dw) {
            KILN_TRY(kiln_cuda_ce_transpose(be, sc->gT, sc->z, 0, S, n));
            kiln_tensor ht = kiln_ce_f32_view("fused_ce.hidden_t", sc->hT, H, S);
            kiln_cuda_matmul_f32(be, sc->wpart, sc->gT, &ht, NULL, (int)n);
            KILN_TRY(kiln_cuda_ce_add(be, p->dweight + c0 * H, sc->wpart, (size_t)n * (size_t)H));
        }
    }
    return KILN_OK;
}

/* z(S, n) = hsb @ W[c0 : c0+n]^T on bf16 operands: with wb (the chunk in bf16, ldw apart) one
 * kiln_cuda_gemm_bf16, else kiln_cuda_gemm_linear_bf16, which reads a bf16 W in place or
 * converts W into the GEMM module's scratch with the same leading dimension -- the one product
 * either way, and kiln_cuda_gemm_linear's on hs (the module's contract). */
static kiln_status ce_logits_bf16(kiln_backend *be, const kiln_fused_ce_params *p,
                                  const kiln_ce_scratch *sc, int64_t S, int64_t c0, int64_t n,
                                  size_t row_bytes, const uint16_t *wb, int64_t ldw) {
    const int64_t H = p->H, ldH = kiln_ce_bf16_ld(H);
    if (wb) return kiln_cuda_ce_gemm_bf16(be, 0, 1, S, n, H, sc->hsb, ldH, wb, ldw, sc->z, n, 0);
    return kiln_cuda_ce_linear_bf16(be, sc->z, sc->hsb, ldH,
                                    (const uint8_t *)p->weight + (size_t)c0 * row_bytes,
                                    row_bytes, p->weight_dtype, n, H, S);
}

/* Fast mode's pass 2 on bf16 operands (layout KILN_CE_BF16; hsb has Sp rows, rows S..Sp-1 zero),
 * per chunk, with the operands kiln_cuda_matmul_backward_fast would make (ld(.): kiln_ce_bf16_ld):
 *   wb(n, ld(H))      = W[c0 : c0+n] in bf16 when dh is wanted: read in place when bf16 with
 *                       16-byte aligned rows, else converted into sc->wb, once for both of
 *                       this chunk's products that read it;
 *   z(S, n)           = hsb @ wb^T                          (ce_logits_bf16)
 *   gb(Sp, ld(n))     = bf16(g), rows S..Sp-1 zero           (one kernel: no f32 g)
 *   dh_acc(Sp, H)    (+)= gb @ wb                            (the first chunk overwrites)
 *   dW[c0 : c0+n]     += gb^T @ hsb
 * A failed product poisons the backend and is returned. */
static kiln_status ce_pass2_bf16(kiln_backend *be, const kiln_fused_ce_params *p,
                                 const kiln_ce_scratch *sc, int64_t S, int64_t Sp, int64_t cn,
                                 const int32_t *d_tgt, float gs, size_t row_bytes) {
    const int64_t H = p->H, V = p->V, ldH = kiln_ce_bf16_ld(H);
    const int in_place = kiln_cuda_ce_weight_in_place(p->weight, row_bytes, p->weight_dtype);
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        const int64_t n = V - c0 < cn ? V - c0 : cn, ldg = kiln_ce_bf16_ld(n);
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
    return kiln_ce_rows_of(p->row_block, Sp8);
}

/* Fast mode's row-block walk (layout KILN_CE_ROWS; hsb has Sp rows, a multiple of 8, rows S..Sp-1
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
                                const kiln_ce_scratch *sc, int64_t S, int64_t Sp, int64_t rb,
                                int z16, const int32_t *d_tgt, float gs, size_t row_bytes) {
    const int64_t H = p->H, V = p->V, ldH = kiln_ce_bf16_ld(H), ldz = kiln_ce_bf16_ld(V);
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

/* The shape of a call on the device, which ce_device and the workspace query both take from
 * here: fast mode, the weight's row bytes and whether the bf16 products convert it (w_copy),
 * the row-block walk's rows per block (rb, 0: the vocabulary walk) and bf16 logits (z16), the
 * rows padded to Sp, the scratch layout (kind, with lcn floats of z per row) and its bytes (0
 * on overflow). */
typedef struct ce_shape {
    int fast, w_copy, z16;
    size_t row_bytes, bytes;
    int64_t rb, Sp, lcn;
    kiln_ce_kind kind;
} ce_shape;

static ce_shape ce_shape_of(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                            int64_t cn) {
    const int64_t H = p->H, V = p->V;
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    ce_shape s;
    s.fast = kiln_cuda_ce_is_fast(be);
    /* fast: Sp padded rows and the bf16 or lean layout (<= the auditable one, the documented
     * bound) */
    s.row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    /* fast mode's row-block walk (rb > 0: KILN_CE_ROWS, z's columns ld(V)) */
    s.rb = ce_row_block(p, S, s.fast, s.row_bytes);
    s.Sp = s.rb ? (S + 7) & ~(int64_t)7 : s.fast ? ce_fast_rows(S, H, cn, with_dh, with_dw) : S;
    s.w_copy = !kiln_cuda_ce_weight_in_place(p->weight, s.row_bytes, p->weight_dtype);
    s.kind = s.rb ? KILN_CE_ROWS
             : !s.fast ? KILN_CE_FULL
             : ce_fast_kind(S, s.Sp, H, cn, with_dh, with_dw, s.w_copy);
    s.z16 = s.rb && kiln_ce_rows_z16(V, p->row_logits_f32); /* the walk's logits in bf16 */
    s.lcn = s.rb ? kiln_ce_rows_zcols(V, s.z16) : cn;       /* z's columns, floats */
    s.bytes = kiln_ce_layout(S, s.Sp, H, s.lcn, with_dh, with_dw, s.kind, s.w_copy, s.rb, NULL,
                             NULL);
    return s;
}

/* kiln_fused_ce's body on the device, for S >= 1 validated supervised rows and chunk cn:
 * hidden, weight and the outputs are device memory, targets and mask host memory. The scratch
 * is one kiln_backend_alloc block with kiln_ce_layout's regions (so kiln_fused_ce_scratch_bytes
 * bounds it), where `ones` (max(cn, S) floats, unused on the device) holds the rows' int32
 * targets. */
static kiln_status ce_device(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                             int64_t cn, kiln_fused_ce_result *out) {
    const int64_t N = p->N, H = p->H, V = p->V;
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
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
    const ce_shape sh = ce_shape_of(be, p, S, cn);
    const int fast = sh.fast, w_copy = sh.w_copy, z16 = sh.z16;
    const size_t row_bytes = sh.row_bytes, bytes = sh.bytes;
    const int64_t rb = sh.rb, Sp = sh.Sp, lcn = sh.lcn, ldH = kiln_ce_bf16_ld(H);
    const kiln_ce_kind kind = sh.kind;
    if (bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: scratch size overflows");
    /* host: positions, targets, then m, l, zt, loss of the rows */
    int64_t *hidx = kiln_malloc((size_t)S * sizeof(int64_t));
    int32_t *htgt = kiln_malloc((size_t)S * sizeof(int32_t));
    /* hrow: the rows' losses, then m, l, zt as they lie in the scratch (kiln_ce_layout's
     * regions, consecutive, each padded to 64 bytes) */
    float *hrow = kiln_malloc((4 * (size_t)S + 48) * sizeof(float));
    uint8_t *block = NULL;
    int own = 1; /* block is this call's allocation (not the caller's scratch) */
    kiln_status st = KILN_OK;
#define CE_DEV(call)                                                                           \
    do {                                                                                       \
        st = (call);                                                                           \
        if (st != KILN_OK) goto done;                                                          \
    } while (0)
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
    kiln_ce_scratch sc;
    kiln_ce_layout(S, Sp, H, lcn, with_dh, with_dw, kind, w_copy, rb, block, &sc);
    int32_t *d_tgt = (int32_t *)(void *)sc.ones;
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        hidx[i] = n;
        htgt[i] = p->targets[n];
        i++;
    }
    CE_DEV(kiln_backend_upload(be, sc.idx, hidx, (size_t)S * sizeof(int64_t)));
    CE_DEV(kiln_backend_upload(be, d_tgt, htgt, (size_t)S * sizeof(int32_t)));
    if (kind == KILN_CE_BF16 || kind == KILN_CE_ROWS) { /* hs in bf16 once, its padding rows zero */
        CE_DEV(kiln_cuda_ce_gather_bf16(be, sc.hsb, ldH, p->hidden, sc.idx, S, Sp, H));
    } else {
        CE_DEV(kiln_cuda_ce_gather(be, sc.hs, p->hidden, sc.idx, S, H));
        if (Sp > S) /* fast mode's padding rows: zero hidden states */
            CE_DEV(kiln_cuda_train_memset(be, sc.hs + S * H, 0,
                                          (size_t)(Sp - S) * (size_t)H * sizeof(float)));
    }
    /* gs, the gradient's factor, depends on S and the reduction only (kiln_ce_reduce) */
    float loss = 0.0f, gs;
    double loss64 = 0.0;
    kiln_ce_reduce(p, NULL, 0.0f, S, NULL, &gs, NULL);
    const ce_grad_ctx gctx = {&sc, d_tgt, S, Sp, gs, fast};
    if (kind == KILN_CE_ROWS) /* statistics and gradients, block by block */
        CE_DEV(ce_rows_bf16(be, p, &sc, S, Sp, rb, z16, d_tgt, gs, row_bytes));
    else
        CE_DEV(kiln_cuda_ce_init_rows(be, sc.m, sc.l, sc.zt, p->row_stats_in, sc.idx, S));

    /* Pass 1 (skipped with row_stats_in, and by the row-block walk). */
    for (int64_t c0 = 0; kind != KILN_CE_ROWS && !p->row_stats_in && c0 < V; c0 += cn) {
        int64_t n = V - c0 < cn ? V - c0 : cn;
        if (kind == KILN_CE_BF16)
            CE_DEV(ce_logits_bf16(be, p, &sc, S, c0, n, row_bytes, NULL, 0));
        else
            kiln_ce_chunk_logits(be, p, sc.hs, S, c0, n, row_bytes, sc.z);
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
    if (early && kind == KILN_CE_BF16) /* (KILN_CE_ROWS: done above) */
        CE_DEV(ce_pass2_bf16(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    else if (early && kind != KILN_CE_ROWS)
        CE_DEV(kiln_cuda_ce_pass2(be, p, &sc, S, Sp, cn, row_bytes, ce_grad_chunk, &gctx));
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
        CE_DEV(kiln_ce_row_losses(hidx, hm, hl, hzt, hloss, S));
        kiln_ce_reduce(p, hloss, kiln_ce_host_sum16(hloss, S), S, &loss, &gs, &loss64);
    }

    /* Pass 2. */
    if (!early && kind == KILN_CE_BF16 && (with_dh || with_dw))
        CE_DEV(ce_pass2_bf16(be, p, &sc, S, Sp, cn, d_tgt, gs, row_bytes));
    else if (!early && (with_dh || with_dw)) /* fast mode's lean layout, a format, auditable */
        CE_DEV(kiln_cuda_ce_pass2(be, p, &sc, S, Sp, cn, row_bytes, ce_grad_chunk, &gctx));

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

size_t kiln_cuda_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S) {
    return ce_shape_of(be, p, S, kiln_ce_chunk(p)).bytes;
}

kiln_status kiln_cuda_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p, int64_t S,
                               kiln_fused_ce_result *out) {
    return ce_device(be, p, S, kiln_ce_chunk(p), out);
}
#else
typedef int kiln_cuda_fused_ce_op_unused; /* ISO C wants a non-empty translation unit */
#endif /* KILN_HAVE_CUDA */
