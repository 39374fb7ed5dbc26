/*
 * cuda_train.h -- the CUDA backend's training operations: the kernels' entry points that the
 * op bodies written in C drive (cuda_fused_ce_op.c, cuda_adamw_op.c), and those bodies, which
 * the backend's table (cuda_backend.cu) points at. Plain C types only (no cudaStream_t): each
 * takes the CUDA backend
 * (be from kiln_backend_cuda_create*), enqueues its work on the backend's stream and returns
 * KILN_OK, or the status that poisoned the backend (a failed launch poisons it, docs/CUDA.md).
 * Pointers are device memory unless stated. In a build without CUDA every entry point exists
 * (cuda_train_stub.c) and returns KILN_ERR_UNSUPPORTED.
 *
 * The arithmetic is the CPU's, element for element: AdamW's from src/ops/adamw_math.h
 * (shared source), the fused loss's as docs/ARITHMETIC.md, "Fused linear cross-entropy".
 */
#ifndef KILN_CUDA_TRAIN_H
#define KILN_CUDA_TRAIN_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../adamw_math.h"
#include "../ops.h"

/* ---- the table's entries (ops.h) ------------------------------------------------------------ */

/* fused_ce_workspace and fused_ce (cuda_fused_ce_op.c): fused_ce.h's op on device buffers. */
size_t kiln_cuda_fused_ce_workspace(kiln_backend *be, const struct kiln_fused_ce_params *p,
                                    int64_t S);
kiln_status kiln_cuda_fused_ce(kiln_backend *be, const struct kiln_fused_ce_params *p, int64_t S,
                               struct kiln_fused_ce_result *out);
/* fused_kd (cuda_fused_kd_op.c): fused_kd.h's op on device buffers. */
kiln_status kiln_cuda_fused_kd(kiln_backend *be, const struct kiln_fused_kd_params *p, int64_t S,
                               struct kiln_fused_kd_result *out);
/* The format the backend's matmul and matmul_backward run in on the weight holding data:
 * KILN_MX16 / KILN_MX8 (its entry in the per-weight table, else the exact format's mode), or 0
 * (the auditable f32 product; kiln_backend_cpu_weight_format's meaning). */
int kiln_cuda_weight_format(kiln_backend *be, const void *data);
/* ops.h's matmul of an f32 W in the auditable f32 arithmetic whatever the mode or the table:
 * the fused loss's products on its f32 scratch copies of a head that takes f32 products. */
void kiln_cuda_matmul_f32(kiln_backend *be, float *out, const float *x, const struct kiln_tensor *W,
                          const float *bias, int N);
/* adamw_workspace ... adamw_clip (cuda_adamw_op.c): adamw_op.h's ops on device arrays. */
size_t kiln_cuda_adamw_op_workspace(kiln_backend *be, const struct kiln_adamw_table *tab);
kiln_status kiln_cuda_adamw_op_prepare(kiln_backend *be, const struct kiln_adamw_table *tab,
                                       void *ws, int init);
kiln_status kiln_cuda_adamw_op_step(kiln_backend *be, const struct kiln_adamw_table *tab,
                                    void *ws, const kiln_adamw_scalars *s);
kiln_status kiln_cuda_adamw_op_nonfinite(kiln_backend *be, const struct kiln_adamw_table *tab,
                                         void *ws, int64_t *bad);
kiln_status kiln_cuda_adamw_op_grad_norm(kiln_backend *be, const struct kiln_adamw_table *tab,
                                         void *ws, float *norms, float *sq_norm, float *total);
kiln_status kiln_cuda_adamw_op_clip(kiln_backend *be, const struct kiln_adamw_table *tab,
                                    void *ws, float max_norm_f, float *total_norm, float *coef);

/* ---- generic ----------------------------------------------------------------------------- */

/* Whether p is device (or managed) memory. */
bool kiln_cuda_train_is_device(const void *p);
/* Enqueue memset(p, byte, nbytes). */
kiln_status kiln_cuda_train_memset(kiln_backend *be, void *p, int byte, size_t nbytes);

/* ---- AdamW (cuda_adamw.cu; driven by cuda_adamw_op.c) ------------------------------------- */

/* One parameter's device arrays for a step (adamw_op.h's kiln_adamw_tensor), an entry of the
 * multi-tensor step's table. weights_kind is a kiln_adamw_weights value, q8 whether the moments
 * are 8-bit blocks (mq, vq, ms, vs) rather than f32 (m, v). decay: weight decay applies
 * (already and-ed with weight_decay != 0). */
typedef struct kiln_cuda_adamw_param {
    int64_t n;
    int param_index;     /* the stochastic rounding key's parameter */
    int weights_kind;
    int q8;
    int decay;
    void *weights;       /* (n) f32 or bf16 */
    const float *grad;   /* (n) */
    float *m, *v;        /* (n) f32 moments, or NULL */
    int8_t *mq;          /* (n) */
    uint8_t *vq;         /* (n) */
    float *ms, *vs;      /* (ceil(n / 256)) */
    float *master;       /* (n) BF16_MASTER only */
    uint16_t *comp;      /* (n) BF16_KAHAN only */
    uint16_t *w16;       /* (n) F32 only, or NULL: bf16 (RNE) of the updated weights */
} kiln_cuda_adamw_param;

/* The multi-tensor step: every parameter of an optimizer in one launch.
 *
 * The parameters are cut into chunks of KILN_CUDA_ADAMW_CHUNK elements (the last one of each
 * parameter shorter), numbered in parameter order, then element order: chunk[c] = {parameter,
 * index of the chunk inside it}. The chunk is a multiple of KILN_ADAMW_Q8_BLOCK (and of 4), so
 * every 8-bit block lies in one chunk and every chunk starts on a 16-byte boundary of an
 * aligned array. */
#define KILN_CUDA_ADAMW_CHUNK 16384
typedef struct kiln_cuda_adamw_chunk {
    int32_t param, index;
} kiln_cuda_adamw_chunk;

/* An optimizer's tensor table: table[p] = parameter p's arrays (every entry complete: the
 * arrays its weights_kind and q8 need); every entry has the plan's weights_kind and q8, and
 * decay is the parameter's own flag -- the kernel ands it with s->use_wd, so the table holds
 * nothing that changes per step.
 * table and chunk are device memory the caller owns, built on the host (the chunks by
 * kiln_cuda_adamw_chunks) and uploaded when the optimizer is created, again only when an
 * entry changes (a restored decay flag); the plan struct itself is host memory. */
typedef struct kiln_cuda_adamw_plan {
    const kiln_cuda_adamw_param *table; /* (P) device */
    const kiln_cuda_adamw_chunk *chunk; /* (n_chunks) device */
    int64_t n_chunks;                   /* <= INT32_MAX */
    int weights_kind;                   /* every entry's (a kiln_adamw_weights value) */
    int q8;                             /* every entry's */
} kiln_cuda_adamw_plan;

/* Host helper: the chunks of the P parameters of table (a host array; only n is read) written
 * to chunk (NULL: count only). Returns n_chunks. */
static inline int64_t kiln_cuda_adamw_chunks(const kiln_cuda_adamw_param *table, int P,
                                             kiln_cuda_adamw_chunk *chunk) {
    int64_t c = 0;
    for (int p = 0; p < P; p++)
        for (int64_t j = 0; j * KILN_CUDA_ADAMW_CHUNK < table[p].n; j++, c++)
            if (chunk) {
                chunk[c].param = p;
                chunk[c].index = (int32_t)j;
            }
    return c;
}

/* One AdamW update of every parameter of the plan: cpu_adamw.c's update_range / step_task on
 * every element of each entry, with its bits (decay and-ed with s->use_wd; stochastic
 * rounding keyed by mix64(s->sr_key + param_index) per entry, as on the CPU), in one launch
 * whatever the number of parameters, no allocation and no host synchronisation (it can be
 * captured in a CUDA graph; the scalars are kernel arguments). f32 moments: one block of 256
 * threads per chunk, each thread taking 4 consecutive elements at a time -- one 16-byte load
 * per array when the entry's arrays are aligned for it (f32 arrays 16 bytes, bf16 ones 8),
 * else element by element; the per-element operations are the same either way. 8-bit
 * moments: one warp per 8-bit block of 256. Nothing is checked on the device: the entries
 * must be valid. */
kiln_status kiln_cuda_adamw_step_multi(kiln_backend *be, const kiln_cuda_adamw_plan *plan,
                                       const kiln_adamw_scalars *s);
/* master(n) = weights(n) bf16 widened. */
kiln_status kiln_cuda_adamw_widen_bf16(kiln_backend *be, float *master, const uint16_t *w,
                                       int64_t n);

/* The gradient table of an optimizer: P entries {grad, n}, an array in device memory (the
 * caller builds it on the host and uploads it once). */
typedef struct kiln_cuda_grad_entry {
    float *grad;
    int64_t n;
} kiln_cuda_grad_entry;

/* bad[p] (P uint64, device) = the lowest element index of grad p that is not finite, or
 * UINT64_MAX. */
kiln_status kiln_cuda_adamw_nonfinite(kiln_backend *be, const kiln_cuda_grad_entry *table,
                                      int P, int64_t max_n, uint64_t *bad);
/* Fast mode's per-tensor norm plan. Grad p is cut into ceil(n_p / KILN_CUDA_NORM_CHUNK)
 * chunks (the last one shorter), numbered in parameter order, then element order:
 * chunk[c] = {parameter, index of the chunk inside it}, first[p] = parameter p's first chunk
 * (first[0] = 0, first[P] = n_chunks <= INT32_MAX), partial = one double per chunk (scratch,
 * overwritten by every call). The three arrays are device memory the caller owns; chunk and
 * first are built on the host once, from the same sizes as the table. */
#define KILN_CUDA_NORM_CHUNK 65536
typedef struct kiln_cuda_norm_chunk {
    int32_t param, index;
} kiln_cuda_norm_chunk;
typedef struct kiln_cuda_norm_plan {
    const kiln_cuda_norm_chunk *chunk; /* (n_chunks) */
    const int32_t *first;              /* (P + 1) */
    double *partial;                   /* (n_chunks) */
    int64_t n_chunks;
} kiln_cuda_norm_plan;

/* Per-tensor norms, then out[0] = torch_sumsq(norms, P) (grad_sq_norm, the 8-lane order in f32),
 * out[1] = sqrtf(out[0]) (the total norm), and, when clip != 0,
 * out[2] = kiln_adamw_clip_coef(out[1], max_norm_f). norms and out are device arrays (P and
 * 3 floats). The per-tensor norms: auditable backend, or plan NULL: norms[p] =
 * sqrtf(torch_sumsq(grad p)), the CPU's bits (the 8-lane order). Fast backend with a plan
 * (host struct, device arrays): a fixed order independent of timing, in double -- each chunk's
 * squares (each exact in double) summed per thread in element order, then a fixed tree over the
 * block; each parameter's chunk partials likewise; norms[p] = (float)sqrt(sum) (docs/TRAINING.md,
 * "Fast mode"). Same bits run to run; a non-finite gradient gives a non-finite norm. */
kiln_status kiln_cuda_adamw_norms(kiln_backend *be, const kiln_cuda_grad_entry *table, int P,
                                  const kiln_cuda_norm_plan *plan, float *norms, float *out,
                                  int clip, float max_norm_f);
/* grad p *= *coef (a device float) for every entry: no host round trip. */
kiln_status kiln_cuda_adamw_scale(kiln_backend *be, const kiln_cuda_grad_entry *table, int P,
                                  int64_t max_n, const float *coef);

/* ---- fused linear cross-entropy (cuda_fused_ce_op.c) --------------------------------------- */

/* hs(S, H) = hidden rows idx[i] (idx: S int64, device). */
kiln_status kiln_cuda_ce_gather(kiln_backend *be, float *hs, const float *hidden,
                                const int64_t *idx, int64_t S, int64_t H);
/* m = -inf, l = 0, zt = 0 for S rows; or, with stats (N, 3) not NULL, m, l, zt = the rows
 * idx[i] of stats. */
kiln_status kiln_cuda_ce_init_rows(kiln_backend *be, float *m, float *l, float *zt,
                                   const float *stats, const int64_t *idx, int64_t S);
/* Pass 1 on one chunk: z(S, n) the chunk's logits (columns c0 .. c0+n-1), tgt(S) int32 the
 * rows' targets; per row the target logit, the max in order, alpha, the lane-16 sum of
 * kiln_expf(z - m_new), l = l * alpha + sum, m = m_new. */
kiln_status kiln_cuda_ce_pass1(kiln_backend *be, const float *z, int64_t S, int64_t n,
                               int64_t c0, const int32_t *tgt, float *m, float *l, float *zt);
/* stats rows idx[i] (N, 3) = (m, l, zt)[i]. */
kiln_status kiln_cuda_ce_stats_out(kiln_backend *be, float *stats, const float *m,
                                   const float *l, const float *zt, const int64_t *idx,
                                   int64_t S);
/* Pass 2 on one chunk, in place: z(S, n) -> g = (kiln_expf(z - m) / l [- 1 at the target])
 * * gs. */
kiln_status kiln_cuda_ce_grad(kiln_backend *be, float *z, int64_t S, int64_t n, int64_t c0,
                              const int32_t *tgt, const float *m, const float *l, float gs);
/* dst(C, R) = src(R, C)^T as f32; src_bf16: src is bf16 (widened exactly), else f32. */
kiln_status kiln_cuda_ce_transpose(kiln_backend *be, float *dst, const void *src, int src_bf16,
                                   int64_t R, int64_t C);
/* x[i] = x[i] + y[i] (k->add's operation). */
kiln_status kiln_cuda_ce_add(kiln_backend *be, float *x, const float *y, size_t n);
/* Rows idx[i] of dst(., H) = src row i (accumulate: dst row + src row). */
kiln_status kiln_cuda_ce_scatter_rows(kiln_backend *be, float *dst, const float *src,
                                      const int64_t *idx, int64_t S, int64_t H, int accumulate);

/* Pass 2 of a fused loss, what the cross-entropy's body and the distillation loss's
 * (cuda_fused_kd_op.c) share: per chunk [c0, c0+n) of cn columns, the logits z(S, n) of the S
 * gathered rows hs (the backend's matmul), grad(be, ctx, z, c0, n) turning them into
 * d loss / d logits in place, then dh_acc (+)= g @ W_chunk and dweight[c0 : c0+n] += g^T @ hs
 * (each as p asks): in fast mode and in an exact format's mode one matmul_backward of Sp rows
 * (rows S..Sp-1 of hs and g zero, the first chunk overwriting dh_acc), in auditable mode the
 * CPU's transposed products and adds (docs/ARITHMETIC.md, "Fused linear cross-entropy"; layout
 * KILN_CE_FULL, Sp == S). sc: the call's scratch (struct kiln_ce_scratch, fused_ce_impl.h). */
typedef kiln_status (*kiln_cuda_ce_grad_fn)(kiln_backend *be, const void *ctx, float *z,
                                            int64_t c0, int64_t n);
struct kiln_ce_scratch;
kiln_status kiln_cuda_ce_pass2(kiln_backend *be, const struct kiln_fused_ce_params *p,
                               const struct kiln_ce_scratch *sc, int64_t S, int64_t Sp,
                               int64_t cn, size_t row_bytes, kiln_cuda_ce_grad_fn grad,
                               const void *ctx);

/* The distillation loss's row work (cuda_fused_ce.cu; cpu_fused_kd.c's operations, in its
 * order): the statistics of the S supervised rows, each array (S) in supervised order --
 * the student at temperature 1 (m, l, zt: the cross-entropy's), the student at tau (ms, ls),
 * the teacher at tau (mt, lt), the teacher-weighted sum a, the first non-finite teacher
 * column (bad, -1: none). */
typedef struct kiln_cuda_kd_stats {
    float *m, *l, *zt, *ms, *ls, *mt, *lt, *a;
    int64_t *bad;
} kiln_cuda_kd_stats;
/* m, ms, mt = -inf; l, zt, ls, lt, a = 0; bad = -1. */
kiln_status kiln_cuda_kd_stats_init(kiln_backend *be, const kiln_cuda_kd_stats *r, int64_t S);
/* Pass 1 on one chunk: z(S, n) the student's logits of columns c0 .. c0+n-1, the teacher's row
 * of supervised row i at teacher + idx[i] teacher_ld + c0, tgt(S) int32 the targets; per row
 * kd_pass1_rows's maxima (in order; in fast mode a tree over the half-warp), rescales and
 * lane-16 sums. */
kiln_status kiln_cuda_kd_pass1(kiln_backend *be, const float *z, const float *teacher,
                               int64_t teacher_ld, const int64_t *idx, int64_t S, int64_t n,
                               int64_t c0, const int32_t *tgt, float tau,
                               const kiln_cuda_kd_stats *r);
/* Pass 2 on one chunk, in place: z(S, n) -> kd_pass2_rows's g (kd_weight * tau (q - p) +
 * ce_weight (softmax(s) - onehot)) * gs, a term of weight 0 left out. */
kiln_status kiln_cuda_kd_grad(kiln_backend *be, float *z, const float *teacher,
                              int64_t teacher_ld, const int64_t *idx, int64_t S, int64_t n,
                              int64_t c0, const int32_t *tgt, float tau, float kd_weight,
                              float ce_weight, float gs, const kiln_cuda_kd_stats *r);

/* Fast mode (cuda_fused_ce_op.c runs these when kiln_cuda_ce_is_fast(be); the order of
 * operations is written down in cuda_fused_ce.cu). */
/* Whether be runs the fast arithmetic (kiln_backend_cuda_create_mode(device, 1)). */
bool kiln_cuda_ce_is_fast(kiln_backend *be);
/* kiln_cuda_ce_pass1 with one block per row: the max is a tree, the sum of the kiln_expf
 * values a fixed order of its own (deterministic; not the lane-16 sum). */
kiln_status kiln_cuda_ce_pass1_fast(kiln_backend *be, const float *z, int64_t S, int64_t n,
                                    int64_t c0, const int32_t *tgt, float *m, float *l,
                                    float *zt);
/* kiln_cuda_ce_grad on rows [0, S) of z(Sp, n) (the same operations per element), and rows
 * [S, Sp) set to 0 (the padding rows of the products). Sp >= S. */
kiln_status kiln_cuda_ce_grad_fast(kiln_backend *be, float *z, int64_t S, int64_t Sp, int64_t n,
                                   int64_t c0, const int32_t *tgt, const float *m,
                                   const float *l, float gs);

/* Fast mode on bf16 operands (the op's ce_pass2_bf16): hs is rounded to bf16 once per
 * call and g is written in bf16 by the gradient kernel, then the products are the GEMM
 * module's (cuda_matmul.h) on the backend's handle, with the operands laid out as
 * kiln_cuda_gemm_linear and kiln_cuda_matmul_backward_fast lay out their own copies (leading
 * dimensions padded to a multiple of 8 elements, 16-byte aligned starts), so every product has
 * the bits of the matmul / matmul_backward composition (kiln_cuda_ce_set_legacy). The bf16
 * values are tensor.c's kiln_fp32_to_bf16 of the f32 ones (round to nearest even). */
/* hsb(Sp, ld) bf16: row i < S = the bf16 of hidden row idx[i] (H columns), rows [S, Sp) zero.
 * ld >= H, a multiple of 8; hsb 16-byte aligned. */
kiln_status kiln_cuda_ce_gather_bf16(kiln_backend *be, uint16_t *hsb, int64_t ld,
                                     const float *hidden, const int64_t *idx, int64_t S,
                                     int64_t Sp, int64_t H);
/* g(Sp, ldg) bf16: rows [0, S) = the bf16 of kiln_cuda_ce_grad_fast's values on z(S, n)
 * (z itself is not written), rows [S, Sp) zero. ldg >= n, a multiple of 8; g 16-byte
 * aligned. */
kiln_status kiln_cuda_ce_grad_bf16(kiln_backend *be, uint16_t *g, int64_t ldg, const float *z,
                                   int64_t S, int64_t Sp, int64_t n, int64_t c0,
                                   const int32_t *tgt, const float *m, const float *l, float gs);
/* Fast mode's row-block walk (the op's ce_rows_bf16): z(R, ldz) holds a block's whole
 * logits, columns [0, V) (ldz >= V, a multiple of 8; z 16-byte aligned), in f32 (z16 == 0) or
 * bf16 (z16 != 0; V <= KILN_CUDA_CE_ROWS16_MAX_V). Per row i < Rs: m[i], l[i], zt[i] = the
 * row's max, sum of exponentials and target logit (pass1_fast's order over the whole row, in
 * slots of 4 (f32) or 8 (bf16) columns, from m = -inf, l = 0), then the gradient (grad_bf16's
 * values) written in bf16 IN PLACE: with f32 logits as g(R, 2 ldz), row i's values at
 * (uint16_t *)(z + i ldz); with bf16 logits as g(R, ldz) over the logits themselves. Rows
 * [Rs, R) and the columns from V to the next slot boundary are zeros. tgt, m, l, zt: the
 * block's rows. Afterwards z no longer holds the logits. */
#define KILN_CUDA_CE_ROWS16_MAX_V ((int64_t)8 * 8 * (200 * 1024 / 16))
kiln_status kiln_cuda_ce_rows_fast(kiln_backend *be, void *z, int64_t ldz, int64_t R,
                                   int64_t Rs, int64_t V, int z16, const int32_t *tgt, float *m,
                                   float *l, float *zt, float gs);
/* Whether the GEMMs read weight rows w (row_bytes apart, dtype dt) in place: bf16 with
 * 16-byte aligned rows (the GEMM module's rule); otherwise they take a bf16 copy. */
bool kiln_cuda_ce_weight_in_place(const void *w, size_t row_bytes, kiln_dtype dt);
/* dst(n, ld) bf16 = the n weight rows w (H columns, row_bytes apart, f32 or bf16) rounded to
 * bf16 (kiln_cuda_weights_to_bf16). ld >= H, a multiple of 8. */
kiln_status kiln_cuda_ce_weight_bf16(kiln_backend *be, uint16_t *dst, int64_t ld, const void *w,
                                     size_t row_bytes, kiln_dtype dt, int64_t n, int64_t H);
/* z(S, n) = hsb(S, ldh) @ W(n, H)^T by kiln_cuda_gemm_linear_bf16 (W: n rows row_bytes apart,
 * converted into the GEMM module's own scratch unless read in place). 1 <= S <= INT32_MAX. */
kiln_status kiln_cuda_ce_linear_bf16(kiln_backend *be, float *z, const uint16_t *hsb,
                                     int64_t ldh, const void *w, size_t row_bytes, kiln_dtype dt,
                                     int64_t n, int64_t H, int64_t S);
/* kiln_cuda_gemm_bf16 on the backend's handle and stream: D(M, N; ldd) (+)= A'(M, K) B'(K, N)
 * with A' = A or A^T (trans_a), B' = B or B^T (trans_b), bf16 operands used in place. */
kiln_status kiln_cuda_ce_gemm_bf16(kiln_backend *be, int trans_a, int trans_b, int64_t M,
                                   int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                   const uint16_t *B, int64_t ldb, float *D, int64_t ldd,
                                   int accumulate);
/* The same product with D in bf16 (kiln_cuda_gemm_bf16_out16: the RNE rounding of the f32
 * result; no accumulate). */
kiln_status kiln_cuda_ce_gemm_bf16_out16(kiln_backend *be, int trans_a, int trans_b, int64_t M,
                                         int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                         const uint16_t *B, int64_t ldb, uint16_t *D,
                                         int64_t ldd);
/* For the tests and benchmarks: on != 0 makes every later fast-mode kiln_fused_ce (any backend,
 * this process) take the composition it ran before the bf16 path -- the backend's matmul for
 * the logits and one matmul_backward per chunk (the op's ce_pass2_fast) -- which the bf16
 * path must match bit for bit. Not synchronised with calls running on other threads. */
void kiln_cuda_ce_set_legacy(int on);
int kiln_cuda_ce_legacy(void);

#ifdef __cplusplus
}
#endif

#endif /* KILN_CUDA_TRAIN_H */
