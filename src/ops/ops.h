/*
 * ops.h -- the operations of a Llama-family forward pass, behind a backend table.
 *
 * A backend is a table of function pointers (like ggml_backend_i): the CPU backend is the
 * reference, a CUDA backend will be its equal. Callers ask supports_op() before dispatching.
 * Buffers (float *) live in the backend's memory. Every op's arithmetic order is defined in
 * docs/ARITHMETIC.md so that results never depend on the thread count, and so that a GPU can
 * reproduce them bit for bit.
 *
 * Shapes use the names of formats/model_config.h: N tokens in the batch, C model width, R
 * output rows, NH/KVH query/key-value heads, HS head size, T cached positions.
 */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include "../base/tensor.h"
#include "kiln.h"
#include "sampling.h"

#include <string.h>

typedef enum kiln_op {
    KILN_OP_EMBED = 0,
    KILN_OP_RMSNORM,
    KILN_OP_MATMUL,
    KILN_OP_ROPE,
    KILN_OP_ATTENTION,
    KILN_OP_SWIGLU,
    KILN_OP_ADD,
    /* backward (training) ops; add is its own backward (identity) */
    KILN_OP_MATMUL_BACKWARD,
    KILN_OP_RMSNORM_BACKWARD,
    KILN_OP_ROPE_BACKWARD,
    KILN_OP_ATTENTION_BACKWARD,
    KILN_OP_SWIGLU_BACKWARD,
    KILN_OP_EMBED_BACKWARD,
    KILN_OP_COUNT
} kiln_op;

typedef struct kiln_backend kiln_backend;

/* ops.h's products: n products of one input x(N,C) with the decode step's fused epilogues.
 * Defined as the composition (kiln_op_products):
 *   xn   = norm_w ? rmsnorm(x, norm_w, eps) : x                       (into scratch_x)
 *   pair (up set, n = 1): out[0] = swiglu(xn W[0]^T (+ bias[0]), xn up^T (+ bias[1]))
 *                          (the products into scratch_gate, scratch_up: matmul_multi's bits)
 *   else:                 out[i] = xn W[i]^T (+ bias[i])             (matmul_multi's bits)
 *   then out[i] = out[i] + res[i] where res and res[i] are set        (add's bits)
 * A backend's fused op gives exactly these bits. Scratch (backend memory) a composing backend
 * writes: scratch_x (N,C) when norm_w is set, scratch_gate and scratch_up (N, R) for a pair
 * (out may be scratch_gate). No out may overlap x, another out or another product's res;
 * res[i] may not overlap out[i]. */
typedef struct kiln_products {
    int n;                              /* 1..KILN_MATMUL_MULTI_MAX */
    float *const *out;
    const float *const *res;            /* NULL, or per product NULL or (N, R_i) */
    const kiln_tensor *const *W;
    const float *const *bias;           /* NULL, or per product NULL or (R_i); a pair: {gate's, up's} */
    const kiln_tensor *up;              /* a SwiGLU pair's up weights (n = 1), or NULL */
    const float *norm_w;                /* x normed first (rmsnorm), or NULL */
    float eps;
    float *scratch_x, *scratch_gate, *scratch_up;
} kiln_products;
/* The fused linear cross-entropy's call (fused_ce.h), the fused distillation loss's
 * (fused_kd.h); AdamW's tensors and scalars (adamw_op.h, adamw_math.h). */
struct kiln_fused_ce_params;
struct kiln_fused_ce_result;
struct kiln_fused_kd_params;
struct kiln_fused_kd_result;
struct kiln_adamw_table;
struct kiln_adamw_scalars;

/* Where attention_backward_seqs16 leaves the gradients of q, k, v in bf16 (see there). */
typedef struct kiln_attn_grad16 {
    uint16_t *dq16, *dk16, *dv16; /* B*N token rows, ld16 apart (column blocks of a wider
                                   * matrix when ld16 exceeds a head set's width) */
    int64_t ld16;
    bool keep_f32;                /* also leave the f32 results in dq, dk, dv */
    const int32_t *pos;           /* the B*N positions q and k were rotated at (host or backend
                                   * memory, as rope_backward's) */
    const float *cos_tab, *sin_tab; /* rope_backward's tables */
} kiln_attn_grad16;

/* A paged KV cache as the attention ops see it. One layer's cache is a pool of blocks of
 * block_size rows (positions), each row KVH*HS floats; sequence s's position p lives in pool
 * row
 *     block_table[s * max_blocks + p / block_size] * block_size + p % block_size.
 * block_size is a positive multiple of KILN_ATTN_BLOCK (64), so each key block of the online
 * softmax (docs/ARITHMETIC.md) lies inside one cache block: attention over a paged cache has
 * the bits of attention over the same keys stored densely. A dense per-sequence cache is the
 * case where each sequence's blocks follow one another. block_table: backend memory. */
typedef struct kiln_kv_pages {
    int block_size;
    int max_blocks;              /* block_table entries per sequence */
    const int32_t *block_table;  /* (n_seq, max_blocks) */
    const int32_t *host_table;   /* the same table in host memory (what the device holds when
                                  * the op runs), or NULL (inside a recorded graph) */
} kiln_kv_pages;

/* A run of a batch: n consecutive tokens (from token `first`) of one sequence at consecutive
 * positions pos0, pos0+1, ... (a prefill chunk, or one decode token). Host memory. */
typedef struct kiln_batch_run {
    int first, n;
    int seq, pos0;
} kiln_batch_run;

typedef struct kiln_backend_i {
    const char *name; /* "cpu", "cuda": for messages only (callers never compare it) */
    /* The float * buffers the ops take are plain host memory (the CPU backend's): the caller
     * may read and write them directly, and the memory entries below are kiln_malloc and
     * memcpy. false: backend memory, reached only through alloc / upload / download. */
    bool host_memory;
    void (*free)(kiln_backend *be);
    /* Whether op runs here for weights of type wtype (wtype ignored for non-weight ops). */
    bool (*supports_op)(const kiln_backend *be, kiln_op op, kiln_dtype wtype);

    /* out(N,C) = table[ids[n], :] widened/dequantized to f32. ids are checked by the caller. */
    void (*embed)(kiln_backend *be, float *out, const kiln_tensor *table, const int32_t *ids,
                  int N);
    /* out(N,C) = x / sqrt(mean(x^2) + eps) * w; w may be NULL (no scale). out may be x. */
    void (*rmsnorm)(kiln_backend *be, float *out, const float *x, const float *w, int N, int C,
                    float eps);
    /* out(N,R) = x(N,C) @ W(R,C)^T + bias(R). W any dtype supports_op accepts; bias may be
     * NULL. out must not alias x. */
    void (*matmul)(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                   const float *bias, int N);
    /* In place, rotate-half (NeoX / Hugging Face) RoPE on x(N,H,HS): for token n at position
     * pos[n] and i < HS/2, with c = cos_tab[pos[n]*HS/2 + i], s = sin_tab[...]:
     *   x'[i] = x[i]*c - x[i+HS/2]*s,   x'[i+HS/2] = x[i+HS/2]*c + x[i]*s. */
    void (*rope)(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                 const float *cos_tab, const float *sin_tab);
    /* Causal grouped-query attention. q(N,NH,HS) are the queries of positions
     * n_past..n_past+N-1; k,v(T,KVH,HS) hold positions 0..n_past+N-1 (T >= n_past+N).
     * Query head h reads kv head h / (NH/KVH). out(N,NH,HS) = softmax(q.k * scale) v.
     * window > 0 (a sliding window, Gemma's): the query at position p reads keys
     * p - window < j <= p only, the key blocks walked as attention_paged walks them
     * (docs/ARITHMETIC.md, "Sliding window"); 0: every earlier key. */
    void (*attention)(kiln_backend *be, float *out, const float *q, const float *k,
                      const float *v, int N, int n_past, int NH, int KVH, int HS, float scale,
                      int window);
    /* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). out may alias gate. */
    void (*swiglu)(kiln_backend *be, float *out, const float *gate, const float *up, size_t n);
    /* x[i] += y[i]. */
    void (*add)(kiln_backend *be, float *x, const float *y, size_t n);

    /* ---- backward (training). Gradients are f32; each op's order of operations is defined
     * in docs/ARITHMETIC.md, "Backward ops"; results never depend on the thread count. An
     * output documented as `+=` is accumulated into (the caller zeroes it once per step);
     * other outputs are overwritten. Scratch buffers are the caller's (the training arena),
     * so no backward op allocates. Outputs must not alias inputs unless stated. ---- */

    /* Backward of matmul, for x(N,C), W(R,C) (supports_op(MATMUL_BACKWARD, dtype): F32,
     * BF16, F16), dy(N,R):
     *   dx(N,C)   = dy @ W              (accumulate_dx: dx += dy @ W); dx NULL: skipped
     *   dW(R,C)  += dy^T @ x            f32, whatever W's dtype; NULL: frozen weight
     *   dbias(R) += sum over tokens of dy; NULL: no bias
     * Each element is one lane-16 dot (over r for dx, over tokens for dW and dbias). */
    void (*matmul_backward)(kiln_backend *be, float *dx, float *dW, float *dbias,
                            const float *dy, const float *x, const kiln_tensor *W, int N,
                            bool accumulate_dx);
    /* Backward of rmsnorm over rows x(N,C) with weight w(C) (NULL: none), dy(N,C):
     *   dx(N,C) = d out / d x applied to dy  (accumulate_dx: dx += ...)
     *   dw(C)  += sum over rows of dy * (x * r)   (skipped when dw or w is NULL)
     * rstd(N): scratch the op overwrites with each row's r = 1/sqrt(mean(x^2)+eps). For
     * Qwen3's per-head q/k norms pass N*H rows of C = HS. */
    void (*rmsnorm_backward)(kiln_backend *be, float *dx, float *dw, const float *dy,
                             const float *x, const float *w, int N, int C, float eps,
                             float *rstd, bool accumulate_dx);
    /* In place on d(N,H,HS): the transpose of rope's rotation (same tables, positions):
     *   d'[i] = d[i]*c + d[i+HS/2]*s,   d'[i+HS/2] = d[i+HS/2]*c - d[i]*s. */
    void (*rope_backward)(kiln_backend *be, float *d, const int32_t *pos, int N, int H, int HS,
                          const float *cos_tab, const float *sin_tab);
    /* Backward of causal GQA attention with the forward's arguments (q(N,NH,HS), k,v(T,KVH,
     * HS), n_past, scale), its output out(N,NH,HS) and dout(N,NH,HS):
     *   dq(N,NH,HS) overwritten; dk, dv(n_past+N, KVH, HS) overwritten (rows past
     *   n_past+N untouched). ws: scratch of kiln_attention_backward_ws_floats(...) floats
     *   (softmax statistics, recomputed FlashAttention-2 style, and in a fast GPU mode with
     *   GQA each query head's partial dk, dv: O(N*NH + T*NH*HS), never N x T).
     *   window: the forward's (0: none). */
    void (*attention_backward)(kiln_backend *be, float *dq, float *dk, float *dv,
                               const float *dout, const float *q, const float *k,
                               const float *v, const float *out, float *ws, int N, int n_past,
                               int NH, int KVH, int HS, float scale, int window);
    /* Backward of out = silu(gate) * up over n elements: dgate[i], dup[i] from dout[i],
     * gate[i], up[i]. Element-wise: dgate/dup may alias gate, up or dout at the same index
     * (not each other). */
    void (*swiglu_backward)(kiln_backend *be, float *dgate, float *dup, const float *dout,
                            const float *gate, const float *up, size_t n);
    /* Backward of embed: dtable(V,C) f32 += dy rows: row v gets the dy rows of the tokens
     * with ids[n] == v, in increasing n. ids are in [0, V) (checked by the caller). */
    void (*embed_backward)(kiln_backend *be, float *dtable, const float *dy, const int32_t *ids,
                           int N, int V, int C);

    /* ---- memory (for device backends; the CPU's are kiln_malloc / memcpy). The float *
     * buffers the ops take live in this memory: the caller allocates activations, the KV
     * cache, norm weights, biases and rope tables here and uploads what it computed on the
     * host. kiln_tensor weights may stay in host memory: a device backend uploads each one
     * once (docs/CUDA.md). Entries may be NULL in a backend that has none (use the
     * kiln_backend_* wrappers below). ---- */

    /* nbytes of backend memory, at least 64-byte aligned, uninitialised; NULL on failure
     * with the error message set. */
    void *(*alloc)(kiln_backend *be, size_t nbytes);
    /* Free a buffer from alloc; NULL is a no-op. */
    void (*free_buf)(kiln_backend *be, void *p);
    /* Copy nbytes host -> backend memory (upload) or backend -> host (download), after all
     * work submitted before and before all work submitted after. download returns when the
     * copy is complete. upload returns once src may be reused: a device backend may stage a
     * small copy and finish it later, in order (the CUDA backend: up to 4 MiB through pinned
     * slots; a failure then poisons the backend and shows in the next status). */
    kiln_status (*upload)(kiln_backend *be, void *dst, const void *src, size_t nbytes);
    kiln_status (*download)(kiln_backend *be, void *dst, const void *src, size_t nbytes);
    /* Wait for all submitted work; KILN_OK, or the error that poisoned the backend (a failed
     * device call or launch: every later op is skipped and every later status says so). */
    kiln_status (*status)(kiln_backend *be);

    /* ---- decode graphs (optional; NULL in a backend without them, e.g. the CPU). A decode
     * step of B tokens recorded once and replayed for every later step: the ops read the
     * tokens' ids, positions, sequences and cache rows from backend memory (attention_paged
     * with runs NULL), so the recorded launches never change. ---- */

    /* Record the ops submitted between graph_begin and graph_end (nothing runs meanwhile; no
     * op may allocate or synchronise: weights must already be on the device, and ops whose
     * workspaces grow on demand must have run at these shapes before) into *graph;
     * graph_launch replays it in order with later work; graph_free releases it. graph_begin
     * gets the decode batch (B sequences) and attention shape so that the decode workspace is
     * sized before recording; B = 0 reserves nothing (a training step's recording). An op
     * that fails while recording poisons the backend as usual; graph_end then ends the
     * recording and returns that error with no graph. graph_launch returns KILN_ERR_STATE,
     * without poisoning the backend, when a workspace the graph uses has been reallocated
     * since it was recorded (a larger call in between): free it and record again. */
    kiln_status (*graph_begin)(kiln_backend *be, int B, int NH, int HS, int max_T);
    kiln_status (*graph_end)(kiln_backend *be, void **graph);
    kiln_status (*graph_launch)(kiln_backend *be, void *graph);
    void (*graph_free)(kiln_backend *be, void *graph);

    /* ---- whole-buffer helpers (training) ---- */
    /* x[0..n) = +0.0f. */
    void (*zero)(kiln_backend *be, float *x, size_t n);
    /* x[i] = x[i] * s, one binary32 rounding each (clip_grad_norm_'s scaling). */
    void (*scale)(kiln_backend *be, float *x, float s, size_t n);

    /* ---- sampling on the device (optional) ----
     * The next token from logits(V) (backend memory) with a sampler's parameters p and random
     * stream rng (sampling.h; kiln_sampler's, src/generate/sampler.h), and the host history
     * hist[0..n_hist) (its last repeat_last_n ids are the penalty window): the id
     * kiln_sampler_sample gives for the same logits, history and stream position
     * (docs/ARITHMETIC.md "Sampling"), written to *id once known (waits for the work before
     * it). rng advances by one u exactly when the CPU sampler's would (temperature > 0), and
     * not at all when the call is refused. KILN_ERR_RANGE when the logits hold a NaN. */
    kiln_status (*sample)(kiln_backend *be, const float *logits, int V,
                          const kiln_sampler_params *p, kiln_sample_rng *rng,
                          const int32_t *hist, size_t n_hist, int32_t *id);

    /* ---- attention over several sequences in one call (training; optional: NULL in a
     * backend without it, e.g. the CPU, and the caller loops over the sequences) ----
     * B sequences of N tokens each, rows back to back, each attending causally to its own N
     * keys only (n_past 0): q, out, dout, dq (B*N, NH, HS); k, v, dk, dv (B*N, KVH, HS).
     *
     * attention_seqs: out = the bits of B attention() calls, one per sequence. lse: NULL, or
     * kiln_attention_lse_floats(B, N, NH) floats in which the backend may save each query
     * row's softmax statistic for attention_backward_seqs (its own layout; a backend or a
     * shape that saves none leaves lse untouched). out16 (fast modes; out NULL then): the
     * output in bf16 instead, each value the kiln_fp32_to_bf16 of what out would hold (16-byte
     * aligned); a backend or shape that cannot fails the call (KILN_ERR_UNSUPPORTED).
     * keep (fast modes, with out16): NULL, or kiln_attention_keep_bytes(B, N, NH, KVH, HS)
     * bytes of backend memory (256-byte aligned) in which the backend keeps its own copy of
     * q, k, v for attention_backward_seqs, which then takes keep in place of them (the caller
     * need not keep q, k, v). rope_pos (with keep; NULL: none): q and k are given before RoPE
     * and the attention rotates them first, exactly as rope(q, rope_pos, B*N, NH, HS,
     * rope_cos, rope_sin) and the same for k would (the caller never writes the rotated
     * q, k). A backend or shape that cannot take keep or rope_pos fails the call
     * (KILN_ERR_UNSUPPORTED).
     * attention_backward_seqs: dq, dk, dv (overwritten) of the B sequences, given lse as
     * attention_seqs left it for the same q, k, v, out (or NULL: the statistics are
     * recomputed), the forward's output as out (f32) or out16 (bf16, then out NULL: what
     * the backward takes of it is its widened values), and keep as the forward left it (then
     * q, k, v are not read and may be NULL; else keep NULL). In auditable arithmetic the bits
     * of B
     * attention_backward() calls; in a fast mode the backend's own deterministic result (the
     * same bits with or without lse is not promised; the same with or without keep). ws:
     * kiln_attention_backward_seqs_ws_floats(B, N, NH, KVH, HS). */
    void (*attention_seqs)(kiln_backend *be, float *out, uint16_t *out16, float *lse,
                           void *keep, const int32_t *rope_pos, const float *rope_cos,
                           const float *rope_sin, const float *q, const float *k,
                           const float *v, int B, int N, int NH, int KVH, int HS, float scale);
    void (*attention_backward_seqs)(kiln_backend *be, float *dq, float *dk, float *dv,
                                    const float *dout, const float *q, const float *k,
                                    const float *v, const float *out, const uint16_t *out16,
                                    const float *lse, const void *keep, float *ws, int B, int N,
                                    int NH, int KVH, int HS, float scale);

    /* ---- several products of one input (optional: NULL, and the caller makes one call
     * each). n in 1..KILN_MATMUL_MULTI_MAX; weights as for matmul / matmul_backward.
     * matmul_multi: out[i](N, R_i) = x(N,C) @ W[i]^T + bias[i] (bias NULL or bias[i] NULL:
     * none) for i < n: the bits of n matmul calls (a fast mode rounds x to bf16 once).
     * matmul_backward_multi: for i < n with dy[i](N, R_i): dW[i] += dy[i]^T @ x, dbias[i] +=
     * sums of dy[i] (dW[i], dbias[i] NULL, or the array NULL: skipped) and dx(N,C) = the sum
     * of dy[i] @ W[i] in order i = 0..n-1 (accumulate_dx: added to dx; dx NULL: skipped):
     * the bits of n matmul_backward calls, the first with accumulate_dx, the rest
     * accumulating (a fast mode rounds x to bf16 once). ---- */
    void (*matmul_multi)(kiln_backend *be, int n, float *const *out, const float *x,
                         const kiln_tensor *const *W, const float *const *bias, int N);
    void (*matmul_backward_multi)(kiln_backend *be, int n, float *dx, float *const *dW,
                                  float *const *dbias, const float *const *dy, const float *x,
                                  const kiln_tensor *const *W, int N, bool accumulate_dx);

    /* dst[i] = kiln_fp32_to_bf16(src[i]) for i < n (round to nearest even; the bf16 copies
     * a fast mode keeps of f32 weights). Optional: NULL in a backend without it. */
    void (*to_bf16)(kiln_backend *be, uint16_t *dst, const float *src, size_t n);

    /* ---- bf16 activations (optional, fast modes only: NULL in a backend without them, and
     * the caller keeps those activations in f32). A fast mode rounds every matrix product's
     * input x to bf16 anyway; where the producer writes x in bf16 once, the rounding is not
     * redone by every product that reads it (forward and backward) and the saved activation
     * takes half the memory. Some products may also write their result in bf16, as PyTorch's
     * bf16 autocast does (that changes what later ops read: a mixed-precision mode of its
     * own). x16 / out16 / gate16 ...: bf16 bit patterns, rows back to back, 16-byte aligned.
     * rmsnorm_bf16: out16 = kiln_fp32_to_bf16 of RMSNorm of these arguments, its row sum in
     * an order of the backend's own (a fast mode's: within one bf16 rounding flip of
     * kiln_fp32_to_bf16 of what rmsnorm writes).
     * swiglu_bf16: out16[i] = kiln_fp32_to_bf16 of swiglu's out[i] on the widened gate16[i],
     * up16[i].
     * swiglu_backward_bf16: dgate16, dup16 = kiln_fp32_to_bf16 of what swiglu_backward
     * writes on dout and the widened gate16, up16 (no aliasing).
     * A fast-mode backend may compute both SwiGLU ones with a faster sigmoid (the CUDA
     * backend's: the MUFU's 2^x and reciprocal): then each output is within one bf16
     * rounding flip of those bits (no more than 1 in 100 elements may flip).
     * rmsnorm_backward_bf16: rmsnorm_backward, and dx16 = kiln_fp32_to_bf16 of the dx it
     * leaves (after accumulate_dx: the products of the next layer down read it).
     * matmul_multi_bf16x / matmul_backward_multi_bf16x: matmul_multi / matmul_backward_multi
     * with x given as x16, its bf16 rounding; in the backward, dy16 NULL or dy16[i] NULL takes
     * dy[i] (f32), else dy16[i] is dy[i]'s bf16 rounding (R_i values a row) and dy[i] may be
     * NULL unless dbias[i] is wanted. With C and every R_i given in bf16 a multiple of 8 and
     * N > 8, the bits of the f32 entries on any x (dy) that rounds to x16 (dy16); otherwise
     * the same arithmetic (products of the same bf16 values summed in f32) whose bits may
     * differ. In the forward, per product i: out16 (NULL, or out16[i] NULL: out[i] f32)
     * receives the result in bf16 (the rounding of the f32 result; no bias[i], no add[i]);
     * add (NULL, or add[i] NULL: none) is an f32 (N, R_i) matrix added to out[i] in the
     * product's own epilogue: out[i] = add[i] + x W[i]^T (+ bias[i]) in f32, add[i] may be
     * out[i] (the residual of a block; bits not promised equal to a separate add). ---- */
    void (*rmsnorm_bf16)(kiln_backend *be, uint16_t *out16, const float *x, const float *w,
                         int N, int C, float eps);
    void (*swiglu_bf16)(kiln_backend *be, uint16_t *out16, const uint16_t *gate16,
                        const uint16_t *up16, size_t n);
    void (*matmul_multi_bf16x)(kiln_backend *be, int n, float *const *out,
                               uint16_t *const *out16, const float *const *add,
                               const uint16_t *x16, const kiln_tensor *const *W,
                               const float *const *bias, int N);
    void (*matmul_backward_multi_bf16x)(kiln_backend *be, int n, float *dx, float *const *dW,
                                        float *const *dbias, const float *const *dy,
                                        const uint16_t *const *dy16, const uint16_t *x16,
                                        const kiln_tensor *const *W, int N, bool accumulate_dx);
    void (*swiglu_backward_bf16)(kiln_backend *be, uint16_t *dgate16, uint16_t *dup16,
                                 const float *dout, const uint16_t *gate16,
                                 const uint16_t *up16, size_t n);
    void (*rmsnorm_backward_bf16)(kiln_backend *be, float *dx, uint16_t *dx16, float *dw,
                                  const float *dy, const float *x, const float *w, int N, int C,
                                  float eps, float *rstd, bool accumulate_dx);
    /* rope_backward, its results rounded (kiln_fp32_to_bf16) into d16 (N rows of H x HS
     * values, ld16 >= H x HS apart: a column block of a wider matrix when larger); d gets them
     * too when keep_f32, else keeps its values (the caller reads d16 only). The q and k
     * gradients' last step before their products, fused with the rounding the products
     * would do.
     * to_bf16_2d: dst (rows x cols, ld_dst apart) = kiln_fp32_to_bf16 of src (ld_src). */
    void (*rope_backward_bf16)(kiln_backend *be, float *d, uint16_t *d16, int64_t ld16,
                               bool keep_f32, const int32_t *pos, int N, int H, int HS,
                               const float *cos_tab, const float *sin_tab);
    void (*to_bf16_2d)(kiln_backend *be, uint16_t *dst, int64_t ld_dst, const float *src,
                       int64_t ld_src, int64_t rows, int64_t cols);
    /* matmul_backward_dx16: one product's backward from bf16 dy16 (N rows of R) and x16 (N
     * rows of C), W (R, C): dx16 (N rows of C) = dy @ W rounded to bf16 by the product
     * itself (fast mode's GEMM: not the f32 dx's bits rounded), dW (NULL: skipped) += dy^T @ x
     * as matmul_backward_multi_bf16x computes it. For a dx whose only reader takes bf16 (the
     * MLP's down projection: swiglu's backward).
     * swiglu_backward_bf16_d16: swiglu_backward_bf16 with dout in bf16 (widened exactly),
     * all rows x cols, dgate16 and dup16 rows ld16 >= cols apart (column blocks of one matrix
     * when the caller stacks the gate and up products). */
    void (*matmul_backward_dx16)(kiln_backend *be, uint16_t *dx16, float *dW,
                                 const uint16_t *dy16, const uint16_t *x16, const kiln_tensor *W,
                                 int N);
    void (*swiglu_backward_bf16_d16)(kiln_backend *be, uint16_t *dgate16, uint16_t *dup16,
                                     int64_t ld16, const uint16_t *dout16,
                                     const uint16_t *gate16, const uint16_t *up16, int64_t rows,
                                     int64_t cols);

    /* Optional: device memory the backend holds for its own work (workspaces and scratch it
     * grows, staging: not the buffers callers allocate, not the weights it caches) in *held,
     * and in *transient_peak the most its short-lived stream-ordered allocations (and those of
     * recorded graphs) have held at once since the last reset_peak (or the process began);
     * reset_peak then restarts that count from what they hold now. Either pointer may be
     * NULL. For a caller's accounting of peak memory (kiln_train_describe: a step's peak). */
    void (*own_memory)(kiln_backend *be, uint64_t *held, uint64_t *transient_peak,
                       bool reset_peak);

    /* Optional: a download the host need not wait for at once. download_begin enqueues the
     * copy of nbytes of backend memory src (after all work submitted before it, before all
     * work submitted after) into the backend's own host staging and returns without waiting;
     * download_end then waits for that copy alone (not for the work submitted after the
     * begin) and copies its nbytes (<= the begin's) into dst. One at a time: a begin while
     * one is open, or an end without one, is KILN_ERR_STATE; a failure poisons the backend
     * as download's does (the end returns it). Not inside a graph capture. */
    kiln_status (*download_begin)(kiln_backend *be, const void *src, size_t nbytes);
    kiln_status (*download_end)(kiln_backend *be, void *dst, size_t nbytes);

    /* Optional (NULL: the caller makes the calls it stands for): the attention backward's
     * last steps before the q, k, v products, in the backward's own kernels where the backend
     * can. The bits of attention_backward_seqs(dq, dk, dv, ...) followed by
     * rope_backward_bf16(dq, g->dq16, g->ld16, g->keep_f32, g->pos, B*N, NH, HS, g->cos_tab,
     * g->sin_tab), the same for dk (KVH heads) into g->dk16, and to_bf16_2d(g->dv16, g->ld16,
     * dv, KVH*HS, B*N, KVH*HS). Without g->keep_f32, dq, dk and dv are scratch afterwards
     * (their contents unspecified: the fused kernels need not write them). */
    void (*attention_backward_seqs16)(kiln_backend *be, float *dq, float *dk, float *dv,
                                      const kiln_attn_grad16 *g, const float *dout,
                                      const float *q, const float *k, const float *v,
                                      const float *out, const uint16_t *out16, const float *lse,
                                      const void *keep, float *ws, int B, int N, int NH, int KVH,
                                      int HS, float scale);

    /* Optional (NULL: status, which waits): the error that poisoned the backend, or one the
     * device has already reported, without waiting for the submitted work. A fault in work
     * still running shows in a later status, poll or download. For a caller that wants the
     * device to stay busy while it prepares the next work (kiln_train_step_batch). */
    kiln_status (*poll)(kiln_backend *be);

    /* ---- batches of many sequences over a paged KV cache (kiln_kv_pages) ----
     * A batch of N tokens may mix prefill chunks and decode tokens of different sequences;
     * every array is indexed by token and lives in backend memory unless stated.
     *
     * kv_store_rows: pool row slots[n] of k_pool / v_pool = row n of k_rows / v_rows
     * (row_floats each), n < N.
     * attention_paged: for each token n, q and out rows (N, NH, HS): causal grouped-query
     * attention over positions 0..pos[n] of sequence seq[n] in the pool (whose rows up to
     * pos[n] the caller has stored), with the bits of attention(N = 1, n_past = pos[n]) over
     * those keys stored densely: in auditable arithmetic a token's output never depends on
     * the other tokens of the batch. window > 0 (a sliding window, Gemma's): only positions
     * pos[n] - window < p <= pos[n] (window keys, the token's own included); the online
     * softmax still walks the KILN_ATTN_BLOCK-aligned key blocks, the first one cut to start
     * at the window (docs/ARITHMETIC.md, "Sliding window"). window 0: every earlier key. max_T >= pos[n] + 1 for every n (a bound for sizing
     * launches and workspaces; a recorded graph replays with it). runs (host memory, NULL
     * when the batch's layout is known only on the device, as in a recorded decode graph:
     * then treat each token on its own) lists the batch as n_runs runs in token order; a
     * fast-mode backend may take a run's tokens together (its prefill kernels), within its
     * own deterministic arithmetic.
     * get_rows: out row i (C floats) = x row idx[i] (idx host memory), i < n. out must not
     * alias x. */
    void (*kv_store_rows)(kiln_backend *be, float *k_pool, float *v_pool, const float *k_rows,
                          const float *v_rows, const int32_t *slots, int N, size_t row_floats);
    void (*attention_paged)(kiln_backend *be, float *out, const float *q, const float *k_pool,
                            const float *v_pool, const kiln_kv_pages *pg, const int32_t *seq,
                            const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                            int max_T, int NH, int KVH, int HS, float scale, int window);
    void (*get_rows)(kiln_backend *be, float *out, const float *x, const int32_t *idx, int n,
                     int C);

    /* Optional (NULL: nothing cached): drop every cached copy of host memory overlapping
     * [host, host + nbytes) (kiln_backends_forget). */
    void (*forget)(kiln_backend *be, const void *host, size_t nbytes);

    /* out[i] = kiln_geglu(gate[i], up[i]) = gelu_tanh(gate[i]) * up[i] (base/kmath.h) for
     * i < n; out may alias gate. Optional (NULL: the backend has no GeGLU; an architecture
     * that needs it refuses the backend). */
    void (*geglu)(kiln_backend *be, float *out, const float *gate, const float *up, size_t n);

    /* ---- fused linear cross-entropy (training; optional: NULL in a backend without it) ----
     * fused_ce.h defines the op; callers use its entry, kiln_fused_ce, which checks p (its
     * sizes, pointers and targets) and counts its S >= 1 supervised rows before it calls
     * fused_ce here (out zeroed, or NULL). fused_ce_workspace: the bytes of scratch that call
     * takes (its result.scratch_bytes; 0 when the size overflows), for the same p and S. */
    size_t (*fused_ce_workspace)(kiln_backend *be, const struct kiln_fused_ce_params *p,
                                 int64_t S);
    kiln_status (*fused_ce)(kiln_backend *be, const struct kiln_fused_ce_params *p, int64_t S,
                            struct kiln_fused_ce_result *out);

    /* ---- fused distillation loss (training; optional: NULL in a backend without it) ----
     * fused_kd.h defines the op; callers use its entry, kiln_fused_kd, which checks p (its
     * sizes, pointers, targets, teacher, temperature and weights) and counts its S >= 1
     * supervised rows before it calls fused_kd here (out zeroed, or NULL). */
    kiln_status (*fused_kd)(kiln_backend *be, const struct kiln_fused_kd_params *p, int64_t S,
                            struct kiln_fused_kd_result *out);

    /* ---- AdamW (training; optional: NULL in a backend without it) ----
     * adamw_op.h defines the ops; callers use its entries (kiln_adamw_op_*), which pass the
     * table, the workspace and the host outputs through unchanged. */
    size_t (*adamw_workspace)(kiln_backend *be, const struct kiln_adamw_table *tab);
    kiln_status (*adamw_prepare)(kiln_backend *be, const struct kiln_adamw_table *tab, void *ws,
                                 int init);
    kiln_status (*adamw_step)(kiln_backend *be, const struct kiln_adamw_table *tab, void *ws,
                              const struct kiln_adamw_scalars *s);
    kiln_status (*adamw_nonfinite)(kiln_backend *be, const struct kiln_adamw_table *tab,
                                   void *ws, int64_t *bad);
    kiln_status (*adamw_grad_norm)(kiln_backend *be, const struct kiln_adamw_table *tab,
                                   void *ws, float *norms, float *sq, float *total);
    kiln_status (*adamw_clip)(kiln_backend *be, const struct kiln_adamw_table *tab, void *ws,
                              float max_norm_f, float *total, float *coef);

    /* Optional (NULL: every pointer is): whether p points into memory this backend's ops can
     * use as a buffer (a device backend: its device or managed memory). For callers that
     * check what they were handed (kiln_backend_holds). */
    bool (*holds)(const kiln_backend *be, const void *p);

    /* Backward of geglu over n elements: dgate[i], dup[i] = kiln_geglu_backward(gate[i],
     * up[i], dout[i]) (base/kmath.h). Element-wise, as swiglu_backward: the outputs may alias
     * the inputs at the same index (not each other). Optional (NULL: an architecture with a
     * GeGLU MLP cannot train on the backend). */
    void (*geglu_backward)(kiln_backend *be, float *dgate, float *dup, const float *dout,
                           const float *gate, const float *up, size_t n);

    /* ---- Qwen3.5's ops (optional: NULL in a backend without them; an architecture that
     * needs them refuses the backend). Arithmetic: docs/ARITHMETIC.md, "Gated DeltaNet". ----
     *
     * Linear attention keeps a state per sequence instead of a KV cache. conv1d_silu and
     * gated_delta take a batch as attention_paged does: token n at position pos[n] of sequence
     * seq[n] (backend memory), listed as runs (host; NULL inside a recorded graph: each token
     * is its own run, at pos[n] of seq[n]); the runs of one sequence come in position order
     * and each sequence has at most one run in a batch. A run starting at position 0 starts
     * from a zero state, any other from its sequence's slot of `state`, which the op leaves
     * holding the state after the run's last token. state NULL (training): every run starts
     * from zero, nothing is kept, and seq, pos are not read (runs must be given).
     *
     * conv1d_silu: out(N,CH) = silu(causal depthwise convolution of x(N,CH) with w(CH,K)):
     * out[n,c] = silu(sum_j w[c,j] x(p - K + 1 + j, c)) for the token at position p, inputs
     * before position 0 zero. state (n_seq, K-1, CH): a sequence's last K-1 inputs (row r the
     * input at position p - K + 1 + r before the token at p). out must not alias x.
     * gated_delta: the Gated DeltaNet recurrence (transformers' recurrent_gated_delta_rule)
     * over qkv(N, 2 nk dk + nv dv) rows [q (nk,dk) | k (nk,dk) | v (nv,dv)], g(N,nv) the log
     * decays, beta(N,nv): per value head h (key head h / (nv/nk)) with q, k l2-normalised (eps
     * 1e-6) and q times scale, S = exp(g) S; S += k (beta (v - S^T k))^T; out(N, nv dv) = S^T q.
     * state (n_seq, nv, dk, dv): each head's S (row i of dk, column j of dv), f32.
     * Limits (the model config's checks guarantee them): K <= 64, dk and dv <= 512, nv a
     * multiple of nk; a call outside them writes nothing. */
    void (*conv1d_silu)(kiln_backend *be, float *out, const float *x, const float *w, float *state,
                        const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                        int CH, int K);
    void (*gated_delta)(kiln_backend *be, float *out, const float *qkv, const float *g, const float *beta,
                        float *state, const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                        int n_runs, int N, int nk, int nv, int dk, int dv, float scale);
    /* g(N,nv) = -(exp(A_log) softplus(a + dt_bias)), beta(N,nv) = sigmoid(b) from a, b (N,nv)
     * and A_log, dt_bias (nv) (kiln_gdn_gates). */
    void (*gdn_gates)(kiln_backend *be, float *g, float *beta, const float *a, const float *b,
                      const float *A_log, const float *dt_bias, int N, int nv);
    /* out[i] = x[i] * sigmoid(gate[i]) (the gated attention's output gate); out may alias x. */
    void (*sigmoid_mul)(kiln_backend *be, float *out, const float *x, const float *gate, size_t n);
    /* Halves of rows: x(rows, 2n) -> a(rows, n) = x[:, :n], b(rows, n) = x[:, n:] (split), and
     * back (join). No aliasing. */
    void (*split_halves)(kiln_backend *be, float *a, float *b, const float *x, int64_t rows, int n);
    void (*join_halves)(kiln_backend *be, float *x, const float *a, const float *b, int64_t rows, int n);
    /* rope (above) on the first rot (even, <= HS) dims of each head only, pairs (i, i + rot/2)
     * for i < rot/2, tables (positions, rot/2); the other HS - rot dims pass unchanged. And its
     * transpose, as rope_backward. */
    void (*rope_partial)(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS, int rot,
                         const float *cos_tab, const float *sin_tab);
    void (*rope_partial_backward)(kiln_backend *be, float *d, const int32_t *pos, int N, int H, int HS, int rot,
                                  const float *cos_tab, const float *sin_tab);
    /* Backwards (training: n_seq sequences of T tokens back to back, N = n_seq T, each from
     * a zero state, as the forward ran them with state NULL).
     * conv1d_silu_backward: dx(N,CH) overwritten; dw(CH,K) += (lane-16 over tokens).
     * gated_delta_backward: dqkv(N, 2 nk dk + nv dv), dg, dbeta (N,nv) overwritten from
     * dout(N, nv dv); the states are recomputed (checkpoints every KILN_GDN_CHUNK tokens), ws
     * kiln_gated_delta_backward_ws_floats(...) floats of scratch.
     * gdn_gates_backward: da, db (N,nv) overwritten; dA_log, ddt_bias (nv) += (lane-16 over
     * tokens). sigmoid_mul_backward: dx, dgate (n) overwritten (may alias dout). */
    void (*conv1d_silu_backward)(kiln_backend *be, float *dx, float *dw, const float *dout, const float *x,
                                 const float *w, int n_seq, int T, int CH, int K);
    void (*gated_delta_backward)(kiln_backend *be, float *dqkv, float *dg, float *dbeta, const float *dout,
                                 const float *qkv, const float *g, const float *beta, float *ws, int n_seq,
                                 int T, int nk, int nv, int dk, int dv, float scale);
    void (*gdn_gates_backward)(kiln_backend *be, float *da, float *db, float *dA_log, float *ddt_bias,
                               const float *dg, const float *dbeta, const float *a, const float *b,
                               const float *A_log, const float *dt_bias, int N, int nv);
    void (*sigmoid_mul_backward)(kiln_backend *be, float *dx, float *dgate, const float *dout, const float *x,
                                 const float *gate, size_t n);

    /* ---- fused forms of the ops above (optional: NULL means the model composes the ops) --------
     * Each is defined as the composition it replaces and gives its bits exactly, in either mode;
     * a backend offers one only where fusing saves launches or passes (the decode step). */
    /* products of one input with their epilogues (kiln_products below): the bits of rmsnorm
     * (norm_w set), then matmul_multi, then swiglu (a pair) and add (res). */
    void (*products)(kiln_backend *be, const float *x, const struct kiln_products *p, int N);
    /* rope(q) over NH heads and rope(k) over KVH heads at pos (both in place, as rope), then
     * kv_store_rows(k_pool, v_pool, k, v, slots, N, KVH * HS) with the rotated k. */
    void (*rope_kv_store)(kiln_backend *be, float *q, float *k, const float *v, const int32_t *pos, int N, int NH,
                          int KVH, int HS, const float *cos_tab, const float *sin_tab, float *k_pool,
                          float *v_pool, const int32_t *slots);

    /* Optional (NULL: the backend has no exact-format training): in an exact format's mode,
     * how the following backward quantizes its gradient operands (dy of dx = dy W and dy^T of
     * dW = dy^T x): stochastic != 0 with the random numbers of the run's seed, the optimizer
     * steps done and the micro-batch's place in its step (docs/ARITHMETIC.md, "Training in a
     * format"), else to nearest even. Called at each backward's start; it restarts the count
     * of the backward's products that keys each one's random numbers. */
    void (*grad_rounding)(kiln_backend *be, int stochastic, uint64_t seed, uint64_t step, uint64_t micro);

    /* Optional, device backends (NULL on the CPU, whose memory is the host's): the moves of a
     * data-parallel rank's flat vector (src/train/trainer_dp.c) between the trainer's tensors
     * and the communicator's device buffers, queued on the backend's stream like its kernels.
     *   copy        dst <- src, nbytes, both backend memory (may not overlap);
     *   bf16_words  to_words: words[i] = (uint32_t)h[i] << 16 (a bf16 weight as the 4-byte word
     *               the collectives move, exact); else h[i] = words[i] >> 16;
     *   native_stream  the stream those are queued on (a cudaStream_t), which the communicator
     *               queues its collectives on too, so they are ordered without host waits. */
    kiln_status (*copy)(kiln_backend *be, void *dst, const void *src, size_t nbytes);
    void (*bf16_words)(kiln_backend *be, uint32_t *words, uint16_t *h, size_t n, int to_words);
    void *(*native_stream)(kiln_backend *be);
} kiln_backend_i;

/* The most products one matmul_multi / matmul_backward_multi call takes. */
#define KILN_MATMUL_MULTI_MAX 4

struct kiln_backend {
    const kiln_backend_i *i;
    int n_threads;
    void *ctx; /* backend private state (thread pool, streams, ...) */
};

/* The CPU backend with n_threads workers (0 = all cores). Results are bit-identical for any
 * n_threads. */
kiln_status kiln_backend_cpu_create(int n_threads, kiln_backend **out);
/* A backend's arithmetic mode (kiln_backend_acquire): auditable, fast, or fast and
 * batch-invariant (a token's result never depends on how many tokens share its products;
 * on CUDA an inference mode: docs/CUDA.md, "The batch-invariant fast mode"). */
enum { KILN_MODE_AUDITABLE = 0, KILN_MODE_FAST = 1, KILN_MODE_FAST_INVARIANT = 2 };
/* The exact block formats (docs/ARITHMETIC.md, "Exact block formats"): the auditable mode
 * with every matmul in mx16 or mx8 (both operands quantized along K, exact integer block
 * products, one rounding; the same bits on the CPU and CUDA). Modes of their own, so that a backend is
 * shared only by engines of one format. */
enum { KILN_MODE_MX16 = 3, KILN_MODE_MX8 = 4 };
/* The mode of the public settings (kiln_context_params' / kiln_engine_params' fast,
 * batch_invariant, format) into *mode, or an error prefixed with who naming the conflict
 * (a format with fast; a format out of range). */
kiln_status kiln_backend_mode_of(int device, int fast, int batch_invariant, int format, const char *who,
                                 int *mode);

/* The CPU backend in a mode (KILN_MODE_*; the names below are the fast modes'): fast_q8 = 0
 * is kiln_backend_cpu_create (exact); KILN_MODE_MX16 / MX8 that with its matmuls in the exact
 * format (weights quantized once, on first use, and kept until kiln_backends_forget); fast_q8 = 1
 * makes matmul with Q8_0/Q4_0/Q4_1 weights and N <= 8 tokens quantize x to 8-bit blocks
 * and sum integer products (approximate; docs/ARITHMETIC.md, "Fast mode: 8-bit
 * activations"); fast_q8 = 2 takes that path at every N, 8 tokens at a time, so a token's
 * row never depends on the batch (slower prefill: the weights are read once per 8 tokens).
 * Bit-identical for any n_threads and SIMD path. */
kiln_status kiln_backend_cpu_create_mode(int n_threads, int fast_q8, kiln_backend **out);
void kiln_backend_free(kiln_backend *be);

/* The CUDA backend on GPU `device` (auditable arithmetic: the CPU backend's bits; see
 * docs/CUDA.md). KILN_ERR_UNSUPPORTED with a message when kiln was built without CUDA, or
 * when no usable GPU (or no device of that index) is present. */
kiln_status kiln_backend_cuda_create(int device, kiln_backend **out);
/* The same in a mode (KILN_MODE_*): KILN_MODE_AUDITABLE (0) is kiln_backend_cuda_create;
 * KILN_MODE_FAST (1) runs matrix products on bf16 tensor cores with f32 accumulation and other
 * fixed-order kernels (docs/CUDA.md, "Fast mode"): not the CPU's bits, but deterministic from
 * run to run on one GPU model; KILN_MODE_MX16 / MX8 is the auditable mode with every matmul
 * and matmul_backward in the exact format on the int8 tensor cores (src/ops/cuda/cuda_mx.h):
 * the CPU backend's bits in that mode. */
kiln_status kiln_backend_cuda_create_mode(int device, int mode, kiln_backend **out);
/* Free and total memory of CUDA device `device` (kiln.h kiln_device_memory). */
kiln_status kiln_cuda_device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes);

/* The process's backend for a device (-1: the CPU with n_threads workers, 0 = all cores;
 * >= 0: that CUDA device) in a mode (the CPU: fast_q8; CUDA: fast), shared by every engine
 * that asks for the same one and reference counted: each acquire is paired with one
 * kiln_backend_release, and the backend is freed with the last. A poisoned backend is not
 * shared further (a new one is made). Engines that share a backend use it from one thread at
 * a time (kiln.h: contexts, trainers and losses on one device are not used concurrently).
 * kiln_backend_release of a backend that was not acquired frees it (kiln_backend_free). */
kiln_status kiln_backend_acquire(int device, int mode, int n_threads, kiln_backend **out);
void kiln_backend_release(kiln_backend *be);

/* Formats per weight (docs/ARITHMETIC.md, "Formats per weight"): the weights whose products
 * run in another format than the mode's, each the byte range of a weight's data [data, data +
 * nbytes) (a product on any view inside it, such as the fused loss's chunks of the head,
 * takes its format) and its kiln_format (KILN_FORMAT_F32: the auditable f32 product; MX16 /
 * MX8: the exact format's). Sorted by data, not overlapping (kiln_weight_formats_sort). Made
 * above the backend, which may not ask a model for its roles (src/models/format_rules.c). */
typedef struct kiln_weight_format {
    const void *data;
    size_t nbytes;
    int format;
} kiln_weight_format;
typedef struct kiln_weight_formats {
    kiln_weight_format *e;
    int n;
} kiln_weight_formats;
/* Sort t by data; KILN_ERR_INVALID_ARG naming who when two ranges overlap with different
 * formats (equal ranges of one format are merged: a tied head and its embedding). */
kiln_status kiln_weight_formats_sort(kiln_weight_formats *t, const char *who);
/* The format of the weight whose range holds data, or dflt when t has none. */
int kiln_weight_formats_find(const kiln_weight_formats *t, const void *data, int dflt);
/* The same as a kiln_mx_kind (mx.h; 0: the auditable f32 product), mode_kind when t has none:
 * the kind a backend's product on the weight at data runs in. */
int kiln_weight_formats_kind(const kiln_weight_formats *t, const void *data, int mode_kind);
/* kiln_backend_acquire with per-weight formats (t NULL or empty: kiln_backend_acquire): the
 * backend is shared only by engines of equal tables; mode is one of the auditable ones
 * (AUDITABLE, MX16, MX8: the format of every other weight), on the CPU or a CUDA device. */
kiln_status kiln_backend_acquire_formats(int device, int mode, int n_threads, const kiln_weight_formats *t,
                                         kiln_backend **out);
/* The CPU backend in a mode with per-weight formats (t copied; NULL: none). */
kiln_status kiln_backend_cpu_create_formats(int n_threads, int mode, const kiln_weight_formats *t,
                                            kiln_backend **out);
/* kiln_backend_cuda_create_mode with per-weight formats (t copied; NULL or empty: none; mode
 * an auditable one: AUDITABLE, MX16, MX8). */
kiln_status kiln_backend_cuda_create_formats(int device, int mode, const kiln_weight_formats *t, kiln_backend **out);
/* Every shared backend drops what it cached of host memory [host, host + nbytes) (a device
 * backend's weight copies): called when that memory goes away (a model closes), so a later
 * allocation at the same address is never mistaken for it. */
void kiln_backends_forget(const void *host, size_t nbytes);

/* The public boundary's view of poisoning (kiln.h KILN_ERR_POISONED). kiln_backend_enter:
 * KILN_OK while be is not poisoned, else KILN_ERR_POISONED naming fn and the failure that
 * poisoned it (without waiting for work in flight: ops.h poll). kiln_backend_leave: a call's
 * status st as it leaves the API: KILN_ERR_POISONED (the message kept) when st is a failure
 * and be is poisoned now, else st. */
kiln_status kiln_backend_enter(kiln_backend *be, const char *fn);
kiln_status kiln_backend_leave(kiln_backend *be, kiln_status st, const char *fn);
/* Poison a CPU backend as a device fault poisons a GPU's: every later status and poll returns
 * st with msg. The CPU has no device to fail; tests use this to reach the poisoned paths. */
void kiln_backend_cpu_poison(kiln_backend *be, kiln_status st, const char *msg);

/* nbytes (at least 64, rounded up to 4) of backend memory set to zero: kiln_calloc on a
 * host-memory backend, else alloc and the zero op (or uploads of zeros where the backend has
 * none). NULL with the error set, naming owner and what ("trainer", "activations"). Freed
 * with kiln_backend_free_buf. */
void *kiln_backend_alloc_zeroed(kiln_backend *be, size_t nbytes, const char *owner, const char *what);

/* The fused ops (kiln_backend_i's products, rope_kv_store) where the backend has them, else
 * the compositions that define them (the same bits). Arguments as there. */
void kiln_op_products(kiln_backend *be, const float *x, const kiln_products *p, int N);
void kiln_op_rope_kv_store(kiln_backend *be, float *q, float *k, const float *v, const int32_t *pos, int N, int NH,
                           int KVH, int HS, const float *cos_tab, const float *sin_tab, float *k_pool, float *v_pool,
                           const int32_t *slots);

/* One zeroed block (kiln_backend_alloc_zeroed) carved into n regions: *slots[i] = the start of
 * region i, floats[i] floats (0: an empty region), each start 64 floats (256 bytes) aligned;
 * *block (to free with kiln_backend_free_buf) and its size in bytes. KILN_ERR_RANGE for a size
 * that overflows, KILN_ERR_NOMEM. */
kiln_status kiln_backend_alloc_carved(kiln_backend *be, int n, float **const *slots, const size_t *floats,
                                      void **block, size_t *bytes, const char *owner, const char *what);

/* The table's memory entries, with host-memory defaults for a backend that has none. */
static inline void *kiln_backend_alloc(kiln_backend *be, size_t nbytes) {
    return be->i->alloc ? be->i->alloc(be, nbytes) : kiln_malloc(nbytes);
}
static inline void kiln_backend_free_buf(kiln_backend *be, void *p) {
    if (be->i->free_buf) be->i->free_buf(be, p);
    else kiln_free(p);
}
static inline kiln_status kiln_backend_upload(kiln_backend *be, void *dst, const void *src,
                                              size_t nbytes) {
    if (be->i->upload) return be->i->upload(be, dst, src, nbytes);
    if (nbytes) memcpy(dst, src, nbytes);
    return KILN_OK;
}
static inline kiln_status kiln_backend_download(kiln_backend *be, void *dst, const void *src,
                                                size_t nbytes) {
    if (be->i->download) return be->i->download(be, dst, src, nbytes);
    if (nbytes) memcpy(dst, src, nbytes);
    return KILN_OK;
}
/* Floats of the fast CUDA attention backward's workspace (cuda_attention.h): D and L
 * (2 NH Npad), the per-head partial dk, dv with GQA (2 T NH HS), bf16 copies of q, dout
 * (NH Npad HS each) and k, v (KVH Tpad HS each) -- Npad, Tpad = N, T = n_past + N rounded up
 * to 64. 0 for a negative count. */
static inline size_t kiln_attention_backward_fast_ws_floats(int N, int n_past, int NH, int KVH, int HS) {
    if (N < 0 || n_past < 0 || NH < 0 || KVH < 0 || HS < 0) return 0;
    size_t T = (size_t)n_past + (size_t)N, Npad = ((size_t)N + 63) / 64 * 64, Tpad = (T + 63) / 64 * 64;
    size_t w = 2 * (size_t)NH * Npad + ((size_t)NH * Npad + (size_t)KVH * Tpad) * (size_t)HS;
    if (NH != KVH) w += 2 * T * (size_t)NH * (size_t)HS;
    return w;
}
/* Floats of the ws scratch attention_backward takes for these arguments: 3 N NH (the
 * auditable kernels' statistics), or the fast CUDA kernels' workspace where larger. */
static inline size_t kiln_attention_backward_ws_floats(int N, int n_past, int NH, int KVH, int HS) {
    size_t w = 3 * (size_t)N * (size_t)NH, f = kiln_attention_backward_fast_ws_floats(N, n_past, NH, KVH, HS);
    return f > w ? f : w;
}
/* Floats of attention_seqs' lse for B sequences of N tokens and NH heads: B NH Npad, Npad = N
 * rounded up to 64 (the fast CUDA kernels' [B][NH][Npad]); 0 for a negative count. */
static inline size_t kiln_attention_lse_floats(int B, int N, int NH) {
    if (B < 0 || N < 0 || NH < 0) return 0;
    return (size_t)B * (size_t)NH * (((size_t)N + 63) / 64 * 64);
}
/* Bytes of attention_seqs' keep: q (B, NH) and k, v (B, KVH) heads of N rows rounded up to
 * 64, HS values of 2 bytes each, every region 256-byte aligned (the CUDA backend's packed
 * bf16 tiles). 0 on a negative size or overflow. */
static inline size_t kiln_attention_keep_bytes(int B, int N, int NH, int KVH, int HS) {
    if (B < 0 || N < 0 || NH < 0 || KVH < 0 || HS < 0 || N > 0x7fffffc0) return 0;
    const size_t npad = ((size_t)N + 63) / 64 * 64, head = npad * (size_t)HS * 2;
    const size_t q = (size_t)B * (size_t)NH, kv = (size_t)B * (size_t)KVH;
    if (head && (q > SIZE_MAX / 4 / head || kv > SIZE_MAX / 4 / head)) return 0;
    return (q * head + 255) / 256 * 256 + 2 * ((kv * head + 255) / 256 * 256);
}
/* Floats of the ws scratch attention_backward_seqs takes: B times attention_backward's for
 * one sequence (the fast CUDA kernels run all B at once; a loop reuses the first part). */
static inline size_t kiln_attention_backward_seqs_ws_floats(int B, int N, int NH, int KVH, int HS) {
    if (B < 0) return 0;
    return (size_t)B * kiln_attention_backward_ws_floats(N, 0, NH, KVH, HS);
}
/* Tokens between the gated delta backward's saved states; the value columns of one group of
 * its walk (the sums over columns are taken per group, then over groups in order:
 * docs/ARITHMETIC.md, "Gated DeltaNet backward"). */
#define KILN_GDN_CHUNK 64
#define KILN_GDN_COLS 32
/* Floats of gated_delta_backward's ws: per (sequence, value head, column group) its states at
 * every chunk start, the states, u and delta of one chunk being walked back, its state and
 * gradient; per (token, value head, group) the partial sums; the per-value-head gradients of
 * the normalised q and k (the CPU's layout; the CUDA backend lays out its own within the same
 * size). 0 on a negative size. */
static inline size_t kiln_gated_delta_backward_ws_floats(int n_seq, int T, int nk, int nv, int dk, int dv) {
    if (n_seq < 0 || T < 0 || nk < 0 || nv < 0 || dk < 0 || dv < 1) return 0;
    const size_t W = dv < KILN_GDN_COLS ? (size_t)dv : KILN_GDN_COLS, G = ((size_t)dv + W - 1) / W;
    const size_t tasks = (size_t)n_seq * (size_t)nv * G, S = (size_t)dk * W;
    const size_t chunks = ((size_t)T + KILN_GDN_CHUNK - 1) / KILN_GDN_CHUNK;
    const size_t N = (size_t)n_seq * (size_t)T;
    (void)nk;
    return tasks * (chunks * S + KILN_GDN_CHUNK * (S + 2 * W) + 16 * W + 2 * (size_t)dk + 2 * S) +
           N * (size_t)nv * G * (2 * (size_t)dk + 2) + 2 * N * (size_t)nv * (size_t)dk;
}
/* Whether p may be one of be's buffers (ops.h, holds). */
static inline bool kiln_backend_holds(const kiln_backend *be, const void *p) {
    return be->i->holds ? be->i->holds(be, p) : true;
}
/* KILN_OK, or the error that poisoned the backend; waits for submitted work. */
static inline kiln_status kiln_backend_status(kiln_backend *be) {
    return be && be->i->status ? be->i->status(be) : KILN_OK;
}
/* The same without waiting where the backend can (poll), else kiln_backend_status. */
static inline kiln_status kiln_backend_poll(kiln_backend *be) {
    return be && be->i->poll ? be->i->poll(be) : kiln_backend_status(be);
}

#endif /* KILN_OPS_H */
