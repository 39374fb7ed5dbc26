/*
 * cuda_attention_bwd_fast.h -- fast-mode backward of causal grouped-query attention on bf16
 * tensor cores (issue 5, item 1): FlashAttention-2's backward (Dao 2023, Algorithm 2) made
 * deterministic. Same contract as ops.h's attention_backward: q(N,NH,HS) are the queries of
 * positions n_past..n_past+N-1, k,v(T = n_past+N, KVH, HS), out and dout (N,NH,HS); dq
 * overwritten, dk and dv (T, KVH, HS) overwritten. Device pointers to f32 (the batched entry
 * point also takes out as bf16 bits); C++ linkage.
 *
 * Three kernels, no atomics, so the bits depend only on the inputs:
 *   1. stats: a block per (64-query tile, head): D = rowsum(dout * out) (f32, fixed order)
 *      and the log-sum-exp L of the scaled scores q k^T (online over the key tiles, f32),
 *      into the workspace;
 *   2. main: two kinds of blocks in one launch (twice the blocks of either alone):
 *      - dq, a block per (64-query tile, head): recomputes S = q k^T, P = exp(S * scale - L),
 *        dP = dout v^T, dS = P (dP - D) and accumulates dq = scale * dS k over the row's keys;
 *      - dk/dv, a block per (64-key tile, query head): S^T = k q^T, P^T, dP^T = v dout^T over
 *        the query tiles that see the keys, dv += P^T dout, dk += scale * dS^T q. With GQA
 *        (NH > KVH) each query head writes its own partial dk, dv to the workspace;
 *   3. reduce (GQA only): dk, dv of kv head j = the partials of heads jG..jG+G-1 added in
 *      increasing head order.
 * On an sm_90a device (cuda_wgmma.h: kiln_cuda_wgmma_usable) head size 64 runs the main
 * kernel on wgmma instead of mma.sync, with the same blocks, arithmetic and outputs. (A
 * two-pass form, the dk/dv blocks storing dS^T in bf16 for dq blocks that take one product a
 * tile from it, was slower on the H200: 0.151 against 0.125 ms on wgmma, 0.163 against 0.145
 * on mma.sync; bench/RESULTS.md, 2026-12-01, 1f4a80a.)
 * Products run on mma.sync m16n8k16 bf16 -> f32: q, k, v and dout are rounded to bf16 as
 * they are staged; P and dS are rounded to bf16 before the products that take them; the
 * softmax statistics, D and every accumulator are f32 (exp: __expf). The error against the
 * exact backward is that of bf16 inputs (tested within 2e-2 of the largest gradient).
 * Head sizes 64 and 128, 16-byte aligned pointers; kiln_cuda_attention_backward_fast_ok
 * says whether a call qualifies (the backend falls back to the auditable kernels otherwise).
 */
#ifndef KILN_CUDA_ATTENTION_BWD_FAST_H
#define KILN_CUDA_ATTENTION_BWD_FAST_H

#include <cuda_runtime.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Floats of workspace the fast backward needs (ops.h kiln_attention_backward_fast_ws_floats:
 * D and L, with GQA the partial dk and dv of every query head, the bf16 copies of q, dout, k,
 * v). */
size_t kiln_cuda_attention_backward_fast_ws(int N, int n_past, int NH, int KVH, int HS);

/* Whether the fast kernels take this call (head size, alignment, sizes). out is only checked
 * for 16-byte alignment: the f32 out, or the bf16 out16 of
 * kiln_cuda_attention_backward_fast_seqs. Pointers are only checked for alignment, so NULL
 * passes (kiln_cuda_attention_backward_fast_seqs with keep takes NULL q, k, v). */
bool kiln_cuda_attention_backward_fast_ok(const float *dq, const float *dk, const float *dv,
                                          const float *dout, const float *q, const float *k,
                                          const float *v, const void *out, int N, int n_past,
                                          int NH, int KVH, int HS);

/* The backward on stream s; ws holds ws_floats >= kiln_cuda_attention_backward_fast_ws(...)
 * floats. cudaErrorInvalidValue for a call kiln_cuda_attention_backward_fast_ok refuses or a
 * workspace too small; otherwise the launch status. */
cudaError_t kiln_cuda_attention_backward_fast(cudaStream_t s, float *dq, float *dk, float *dv,
                                              const float *dout, const float *q,
                                              const float *k, const float *v, const float *out,
                                              float *ws, size_t ws_floats, int N, int n_past,
                                              int NH, int KVH, int HS, float scale);

/* ops.h's attention_backward_seqs in fast mode: B sequences of N tokens (rows back to back,
 * n_past 0) in one set of launches (grid z = sequence). The forward's output comes as exactly
 * one of out (f32) and out16 (bf16 bits, as kiln_cuda_attention_fast_seqs writes it); it only
 * enters D = rowsum(dout * out), which with out16 takes the widened (exact) values in the
 * same f32 operations, so the result has the bits of a call whose out holds those values.
 * lse: NULL, or what kiln_cuda_attention_fast_seqs wrote for the same q, k, v and output
 * pointer ([B][NH][Npad], 16-byte aligned): used as L in place of the statistics kernel when
 * kiln_cuda_attn_saves_lse holds for these pointers (out16's when given; else ignored). With
 * lse NULL each sequence gets the bits of kiln_cuda_attention_backward_fast on its rows; with
 * lse, the forward's L replaces the recomputed one.
 * keep: NULL, or what kiln_cuda_attention_fast_seqs left in its keep for the same B, N, NH,
 * KVH, HS (KILN_ATTN_KEEP_ALIGN-byte aligned): the packed q, k, v are taken from there and
 * only dout is packed (with D); q, k, v are not read and may be NULL. The forward's flash
 * path has then run (only it fills keep), so lse, when given, is used whatever q, k, v are.
 * The result has the bits of the same call with keep NULL and the q, k, v the forward packed
 * (rotated, when the forward applied rope): the packing is exact and deterministic.
 * ws_floats >= B x kiln_cuda_attention_backward_fast_ws(N, 0, NH, KVH, HS) (with keep too).
 * cudaErrorInvalidValue as kiln_cuda_attention_backward_fast (with out16 in out's place), for
 * B outside 1..65535, when both or neither of out, out16 are given, without keep for a NULL
 * q, k or v, or with keep misaligned or for a shape the flash forward does not take
 * (kiln_cuda_attn_fast_is_mma false). */
cudaError_t kiln_cuda_attention_backward_fast_seqs(cudaStream_t s, float *dq, float *dk,
                                                   float *dv, const float *dout, const float *q,
                                                   const float *k, const float *v,
                                                   const float *out, const uint16_t *out16,
                                                   const float *lse, const void *keep, float *ws,
                                                   size_t ws_floats, int B, int N, int NH,
                                                   int KVH, int HS, float scale);

/* The same with the attention backward's last steps before the q, k, v products fused into
 * its stores (ops.h's attention_backward_seqs16; g16 NULL: kiln_cuda_attention_backward_fast_
 * seqs): dq, and without GQA dk and dv, are rotated back and rounded to bf16 by the stores
 * of the dq and dk/dv blocks, with GQA dk and dv by the reduction, so the f32 gradients are
 * written only with g16->keep_f32. The bits of the unfused call followed by
 * kiln_cuda_rope_backward_bf16 on dq and dk and kiln_cuda_f32_to_bf16 on dv (the same f32
 * operations on the same values). g16->pos is device memory (B*N positions).
 * kiln_cuda_attention_grad16_ok: whether the epilogue takes g16 (HS 64, 4-byte aligned bf16
 * destinations, an even ld16 >= NH HS, 8-byte aligned tables); the call is
 * cudaErrorInvalidValue when it refuses. */
struct kiln_attn_grad16;
bool kiln_cuda_attention_grad16_ok(const struct kiln_attn_grad16 *g16, int NH, int KVH, int HS);
cudaError_t kiln_cuda_attention_backward_fast_seqs16(cudaStream_t s, float *dq, float *dk,
                                                     float *dv, const struct kiln_attn_grad16 *g16,
                                                     const float *dout, const float *q,
                                                     const float *k, const float *v,
                                                     const float *out, const uint16_t *out16,
                                                     const float *lse, const void *keep,
                                                     float *ws, size_t ws_floats, int B, int N,
                                                     int NH, int KVH, int HS, float scale);

#endif /* KILN_CUDA_ATTENTION_BWD_FAST_H */
