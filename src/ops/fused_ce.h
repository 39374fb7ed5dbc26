/*
 * fused_ce.h -- fused linear cross-entropy without materialised logits: a backend operation
 * (ops.h, fused_ce and fused_ce_workspace), called through kiln_fused_ce below. The CPU
 * backend's body (src/ops/cpu/cpu_fused_ce.c) is the reference; the CUDA backend's is
 * src/ops/cuda/cuda_fused_ce_op.c.
 *
 * For hidden states h(N,H), an LM head W(V,H), targets(N) and a mask(N):
 *
 *   loss_n = logsumexp_v(h_n . W_v) - h_n . W_{t_n}        for every supervised position n
 *   loss   = scale * sum_n loss_n / S   (MEAN)   or   scale * sum_n loss_n   (SUM)
 *
 * with S the number of supervised positions (mask[n] != 0 and targets[n] >= 0), and the
 * gradients of `loss` with respect to h (dh, N x H) and W (dW, V x H). Only the S supervised
 * rows are computed: they are gathered first, then the vocabulary is walked in chunks of
 * `chunk` columns, twice: pass 1 computes each row's log-sum-exp online, pass 2 recomputes
 * each chunk's logits and turns them into (softmax - onehot) * scale, which it multiplies
 * into dh and dW. The scratch memory is bounded by
 * kiln_fused_ce_scratch_bytes(S, H, V, chunk, ...) -- about 2 S x chunk + 4 S x H +
 * 2 chunk x H floats -- never N x V.
 *
 * The arithmetic order is defined in docs/ARITHMETIC.md ("Fused linear cross-entropy"): the
 * three products are the backend's defined matmul, the reductions are fixed, so the results
 * are bit-identical for every thread count and SIMD path. They DO depend on the chunk size
 * (the online log-sum-exp and the chunk-by-chunk sums of dh follow the chunking): a result is
 * defined for a given chunk size.
 *
 * All buffers are the caller's (CPU memory for the CPU backend). On any error nothing the
 * caller passed is written: validation, the scratch allocations and the whole loss (pass 1,
 * which detects a non-finite loss) come before the first write to dh, dW or row_loss.
 *
 * On the CUDA backend (kiln_backend_cuda_create) this same call is the loss on device
 * pointers the caller owns (e.g. a framework's CUDA tensors): hidden, weight, dhidden,
 * dweight, row_loss, row_stats_out and row_stats_in are DEVICE memory (checked: host pointers
 * are refused with KILN_ERR_INVALID_ARG), while targets and mask stay HOST memory (the
 * selection and validation of the supervised rows run on the host; their positions are
 * uploaded). The work is enqueued on the backend's stream and the call returns once the
 * outputs are complete. In the auditable mode every output (loss, loss_f64, dh, dW,
 * row_loss, row_stats) has the CPU backend's bits for the same chunk; the scratch is device
 * memory, bounded by the same kiln_fused_ce_scratch_bytes and freed at return. A device
 * failure poisons the backend (docs/CUDA.md) and is returned. The products run on the
 * backend's matmul, whose launch limits S and the chunk to 524,280 rows.
 *
 * In the CUDA backend's fast mode (kiln_backend_cuda_create_mode(device, 1)) the results are
 * not the CPU's bits but are the same bits from run to run on one GPU model: the products are
 * bf16 tensor-core GEMMs on operands rounded to bf16 once each (cuda_fused_ce_op.c: hs once
 * per call, g written in bf16, each W chunk once per chunk and pass), pass 1's sum of
 * exponentials has a fixed order of its own (cuda_fused_ce.cu), and the supervised rows are
 * padded with zero
 * rows to a multiple of 8 (exact zeros in every sum). The scratch is then at most
 * kiln_fused_ce_scratch_bytes (scratch_bytes says how much), plus the GEMM module's own
 * scratch (the backend's, grown once) and, on the calls that keep the older composition
 * (cuda_fused_ce_op.c says which), what matmul_backward allocates for its bf16 copies
 * (docs/TRAINING.md, "Fast mode"). row_stats_in must come from a call in the same mode.
 */
#ifndef KILN_FUSED_CE_H
#define KILN_FUSED_CE_H

#include "ops.h"

/* Vocabulary columns per chunk when params.chunk is 0. */
#define KILN_FUSED_CE_DEFAULT_CHUNK 4096

/* The largest vocabulary whose row-block walk can keep its logits in bf16 (row_logits_f32):
 * the CUDA row kernel's bound (KILN_CUDA_CE_ROWS16_MAX_V, checked equal there). */
#define KILN_FUSED_CE_ROWS16_MAX_V ((int64_t)819200)

typedef enum kiln_ce_reduction {
    KILN_CE_REDUCTION_MEAN = 0, /* sum over supervised positions / S, times scale */
    KILN_CE_REDUCTION_SUM = 1,  /* sum over supervised positions, times scale */
} kiln_ce_reduction;

typedef struct kiln_fused_ce_params {
    int64_t N, H, V;            /* positions, hidden size, vocabulary size */
    const float *hidden;        /* (N, H) f32, row n at hidden + n * hidden_ld; or NULL with
                                 * hidden16 */
    const uint16_t *hidden16;   /* instead of hidden: (N, H) bf16 bit patterns, each widened
                                 * exactly to f32 as the rows are gathered (host-memory
                                 * backends only: the CPU's) */
    int64_t hidden_ld;          /* elements from one row of hidden (hidden16) to the next: 0 =
                                 * H (rows back to back), else >= H (a strided view); host-
                                 * memory backends only unless 0 or H */
    const void *weight;         /* (V, H), weight_dtype: F32 or BF16 */
    kiln_dtype weight_dtype;
    const int32_t *targets;     /* (N); a target < 0 (e.g. -100) marks a position unsupervised */
    const uint8_t *mask;        /* (N) or NULL (= all ones); 0 marks a position unsupervised */
    kiln_ce_reduction reduction;
    float scale;                /* multiplies the loss and every gradient (1/N: a batch mean) */
    int64_t chunk;              /* vocabulary columns per chunk; 0 = KILN_FUSED_CE_DEFAULT_CHUNK */
    /* Outputs, each optional (NULL: not computed). With both dhidden and dweight NULL, only
     * pass 1 runs (the loss alone). */
    float *dhidden;             /* (N, H): overwritten (unsupervised rows set to 0), or, with
                                 * dhidden_accumulate, dhidden += d loss / d h (unsupervised
                                 * rows untouched) */
    int dhidden_accumulate;
    float *dweight;             /* (V, H) f32: dweight += d loss / d W, always accumulated */
    float *row_loss;            /* (N): loss_n (unscaled, unreduced); 0 at unsupervised rows */
    /* Pass 1's per-row statistics (max logit, sum of exponentials, target logit), as (N, 3)
     * floats; unsupervised rows untouched. row_stats_out: written when not NULL. row_stats_in:
     * when not NULL, pass 1 is skipped and these are used instead: they must come from a call
     * with the same hidden, weight, targets, mask and chunk (the loss-then-gradient pattern of
     * training), which then gives the same bits as recomputing them. */
    float *row_stats_out;
    const float *row_stats_in;
    /* CPU backend: pass 1's logits kept for pass 2 (the chunks that fit keep_floats floats,
     * from the first: chunk j's S x n logits at keep + j x S x chunk, S the supervised rows),
     * so pass 2 reads them instead of computing them again (one product of three saved per
     * kept chunk; the same values, hence the same bits). A call that runs pass 1 writes them;
     * a call with row_stats_in reads them, and they must then come from the call that made
     * row_stats_in with the same keep and keep_floats. Pass 2 overwrites them with the
     * gradient. NULL or too small for one chunk: nothing kept. Device backends ignore it. */
    float *keep;
    size_t keep_floats;
    /* Device backends: scratch the caller owns (backend memory, scratch_cap bytes, 256-byte
     * aligned), used when it holds what the call needs (result.scratch_bytes says how much),
     * so that repeated calls need no allocation (which waits for the device); NULL or too
     * small: the call allocates its own and frees it before returning. Ignored on the CPU. */
    void *scratch;
    size_t scratch_cap;
    /* Device backends in fast mode, with row_stats_in, the caller's scratch and no row_loss:
     * the call only enqueues its work and returns without waiting for the device (no loss:
     * result.loss and loss_f64 are NaN, result.loss_pending is 1; an error of the device
     * work surfaces at the backend's next status or download). The backward half of
     * training uses it so that the host launches the layers' backward while the device runs
     * the loss's gradient.
     * With row_stats_out instead of row_stats_in (and dhidden or dweight), the same call runs
     * pass 1 and enqueues pass 2 right behind it, before the loss is known: the caller
     * downloads row_stats_out when it likes and gets the loss from
     * kiln_fused_ce_loss_from_stats (the bits this call would have returned). Then a
     * non-finite loss leaves dhidden and dweight UNSPECIFIED (not untouched): a training
     * step in one call (kiln_train_step_batch), which discards such a step's gradients.
     * Without the caller's scratch it still enqueues pass 2 first but then waits and returns
     * the loss. Otherwise ignored. */
    int no_wait;
    /* Device backends in fast mode, in that one-call form (no_wait with row_stats_out, not
     * row_stats_in; dhidden or dweight) with a bf16 weight read in place (16-byte aligned
     * rows): > 0 walks the supervised rows in blocks of row_block (rounded up to 8) instead
     * of the vocabulary in chunks. Each block's whole logits (rows x V, bf16 or f32:
     * row_logits_f32 below; in the scratch) are made once, its
     * statistics and gradient come from them in one kernel (the gradient in bf16, in place),
     * then dh = g @ W and dW += g^T @ hs: three products a row instead of the vocabulary
     * walk's four (its pass 2 makes every logit again). The results are defined for a given
     * row_block and differ from the vocabulary walk's in the last bits (the order of the
     * statistics' sums, dW summed block by block); deterministic run to run. 0 (the
     * default), or a call not in that form: the vocabulary walk. < 0: KILN_ERR_INVALID_ARG. */
    int64_t row_block;
    /* The row-block walk's logits: 0 (the default) keeps each block's logits in bf16 (the
     * f32 product rounded once, as PyTorch's autocast makes the head's output; the
     * statistics and gradient are computed in f32 from those values): scratch of about
     * 2 x row_block x V bytes, and the statistics kernel moves half the bytes; non-zero keeps
     * them in f32 (4 x row_block x V bytes). V above KILN_FUSED_CE_ROWS16_MAX_V (819,200)
     * always takes f32. Ignored by the vocabulary walk. */
    int row_logits_f32;
} kiln_fused_ce_params;

typedef struct kiln_fused_ce_result {
    float loss;            /* the reduced, scaled loss (f32, defined order) */
    double loss_f64;       /* the same from the f32 row losses summed in float64 */
    int64_t n_supervised;  /* S */
    size_t scratch_bytes;  /* bytes of scratch this call needed (its own allocation, freed on
                            * return, unless the caller's scratch held them) */
    int loss_pending;      /* 1: no_wait took effect: loss and loss_f64 are NaN (see no_wait) */
} kiln_fused_ce_result;

/* Defaults: everything zero/NULL, weight F32, MEAN, scale 1, chunk 0 (= 4096). */
kiln_fused_ce_params kiln_fused_ce_default_params(void);

/* The loss and gradients described above, on backend be: the op's entry, which checks p,
 * counts the supervised rows and runs the backend's fused_ce (the CPU backend: its thread pool
 * runs the three products; the CUDA backend: device buffers as described above). out may be
 * NULL.
 * Errors: a backend without the op -> KILN_ERR_UNSUPPORTED; NULL/inconsistent parameters, a
 * weight dtype other than F32/BF16, or sizes that overflow -> KILN_ERR_INVALID_ARG /
 * KILN_ERR_UNSUPPORTED; no supervised position ->
 * KILN_ERR_INVALID_ARG "no supervised positions"; a supervised target >= V ->
 * KILN_ERR_RANGE naming the position; a non-finite row loss -> KILN_ERR_RANGE naming the
 * position; scratch allocation failure -> KILN_ERR_NOMEM. */
kiln_status kiln_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p,
                          kiln_fused_ce_result *out);

/* The op's workspace query: *bytes = the scratch kiln_fused_ce(be, p) takes -- exactly the
 * result.scratch_bytes it reports (host memory it allocates on the CPU; on a device backend
 * what p->scratch must hold to be used instead of an allocation of the call's own; it may
 * depend on the pointers, e.g. whether a bf16 weight is read in place). kiln_fused_ce's
 * errors for the parameters and rows; KILN_ERR_INVALID_ARG when the size overflows. */
kiln_status kiln_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p,
                                    size_t *bytes);

/* The number of supervised positions of p (mask, targets >= 0) in *S, after checking that
 * their targets are < V: kiln_fused_ce's own row checks, with its errors (a target >= V ->
 * KILN_ERR_RANGE naming the position; none supervised -> KILN_ERR_INVALID_ARG). */
kiln_status kiln_fused_ce_supervised(const kiln_fused_ce_params *p, int64_t *S);

/* The loss of a call that left it pending (no_wait with row_stats_out), from its row
 * statistics copied to HOST memory (row_stats: N x 3 floats as row_stats_out lays them out)
 * and the call's parameters (N, targets, mask, reduction, scale): out gets loss, loss_f64 and
 * n_supervised with the bits the call would have returned. Errors as kiln_fused_ce's for the
 * rows (no supervised position, a target >= V, a non-finite row loss naming the position). */
kiln_status kiln_fused_ce_loss_from_stats(const kiln_fused_ce_params *p, const float *row_stats,
                                          kiln_fused_ce_result *out);

/* The scratch bytes kiln_fused_ce allocates for S supervised rows (the whole bound: the
 * products themselves allocate nothing). with_dh / with_dw: whether dhidden / dweight are
 * requested. 0 when the size overflows. */
size_t kiln_fused_ce_scratch_bytes(int64_t S, int64_t H, int64_t V, int64_t chunk, int with_dh,
                                   int with_dw);

/* The same for the row-block walk (params.row_block > 0 where it applies) with blocks of
 * row_block rows and logits_f32 as params.row_logits_f32: about 2 (bf16 logits) or 4 (f32)
 * x min(row_block, S) x V bytes more than the vocabulary walk's. */
size_t kiln_fused_ce_row_block_bytes(int64_t S, int64_t H, int64_t V, int64_t row_block,
                                     int with_dh, int with_dw, int logits_f32);

/* kiln's log for the loss: finite x > 0 (the row sums of exponentials, >= 1); defined in
 * docs/ARITHMETIC.md. Exposed for the accuracy test. */
float kiln_fused_ce_logf(float x);

#endif /* KILN_FUSED_CE_H */
