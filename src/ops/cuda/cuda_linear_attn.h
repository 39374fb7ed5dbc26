/*
 * cuda_linear_attn.h -- Qwen3.5's ops on the GPU (cuda_linear_attn.cu): the causal depthwise
 * convolution with its per-sequence state, the Gated DeltaNet recurrence and their backwards,
 * the gates, the output gate, halves of rows and the partial rotary embedding (ops.h, "Qwen3.5's
 * ops"). Included from .cu files only (C++ linkage).
 *
 * Every launcher here, in both modes of the backend, gives the CPU reference's bits
 * (src/ops/cpu/cpu_linear_attn.c, docs/ARITHMETIC.md "Gated DeltaNet"): the same IEEE binary32
 * operations in the same order per output element. Shapes as in ops.h. Each only enqueues work
 * on stream s and returns the launch's error (cudaGetLastError), cudaSuccess when there is
 * nothing to do, or cudaErrorInvalidValue / cudaErrorInvalidConfiguration for arguments it
 * cannot run (checked before anything is enqueued). Pointers are device pointers (seq and pos
 * included), except `runs`, which is host memory as in ops.h: the launchers pass the run table
 * to the kernels by value (LA_RUNS_PER_LAUNCH runs a launch), so a recorded graph holds it and
 * no staging buffer is involved. No launcher allocates; the scratch buffers are the caller's.
 */
#ifndef KILN_CUDA_LINEAR_ATTN_H
#define KILN_CUDA_LINEAR_ATTN_H

#include "cuda_internal.h"

/* The largest convolution width and Gated DeltaNet head sizes the launchers take (the CPU
 * reference's limits: K <= 64, dk, dv <= 512). */
#define KILN_CUDA_CONV_MAX_K 64
#define KILN_CUDA_GDN_MAX_HEAD 512

/* =================================================================================================
 * Forward.
 * ============================================================================================== */

/* ops.h conv1d_silu: out(N,CH) from x(N,CH), w(CH,K) and state (n_seq, K-1, CH) or NULL; runs
 * (host, n_runs of them) or NULL (each token its own run at pos[n] of seq[n]). A sequence with
 * seq < 0 starts from zeros and keeps nothing (as the CPU's). */
cudaError_t kiln_cuda_conv1d_silu(cudaStream_t s, float *out, const float *x, const float *w,
                                  float *state, const int32_t *seq, const int32_t *pos,
                                  const kiln_batch_run *runs, int n_runs, int N, int CH, int K);

/* ops.h gated_delta: out(N, nv dv) from qkv(N, 2 nk dk + nv dv), g, beta (N, nv) and state
 * (n_seq, nv, dk, dv) or NULL; runs as kiln_cuda_conv1d_silu's. A sequence with seq < 0 starts
 * from zeros and keeps nothing (the CPU would index its state out of bounds). */
cudaError_t kiln_cuda_gated_delta(cudaStream_t s, float *out, const float *qkv, const float *g,
                                  const float *beta, float *state, const int32_t *seq,
                                  const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                                  int nk, int nv, int dk, int dv, float scale);

/* ops.h gdn_gates: g, beta (N,nv) = kiln_gdn_gates of a, b (N,nv), A_log, dt_bias (nv). */
cudaError_t kiln_cuda_gdn_gates(cudaStream_t s, float *g, float *beta, const float *a,
                                const float *b, const float *A_log, const float *dt_bias, int N,
                                int nv);

/* out[i] = x[i] * kiln_sigmoid(gate[i]); out may alias x. */
cudaError_t kiln_cuda_sigmoid_mul(cudaStream_t s, float *out, const float *x, const float *gate,
                                  size_t n);

/* x(rows, 2n) -> a, b (rows, n) (split) and back (join). No aliasing. */
cudaError_t kiln_cuda_split_halves(cudaStream_t s, float *a, float *b, const float *x, int64_t rows,
                                   int n);
cudaError_t kiln_cuda_join_halves(cudaStream_t s, float *x, const float *a, const float *b,
                                  int64_t rows, int n);

/* In place on x(N,H,HS): rope on the first rot dims of each head (tables (positions, rot/2)),
 * transpose 0; its transpose (rope_partial_backward), transpose 1. rot even, 0 < rot <= HS. */
cudaError_t kiln_cuda_rope_partial(cudaStream_t s, float *x, const int32_t *pos, int N, int H,
                                   int HS, int rot, const float *cos_tab, const float *sin_tab,
                                   int transpose);

/* =================================================================================================
 * Backward (training: n_seq sequences of T tokens back to back, each from a zero state).
 * ============================================================================================== */

/* ops.h conv1d_silu_backward: dx(N,CH) overwritten, dw(CH,K) += (lane-16 over all N tokens). */
cudaError_t kiln_cuda_conv1d_silu_backward(cudaStream_t s, float *dx, float *dw, const float *dout,
                                           const float *x, const float *w, int n_seq, int T, int CH,
                                           int K);

/* Whether gated_delta_backward runs at head sizes dk x dv on the current device (its walk keeps
 * a state, the previous state and the state's gradient of one head in shared memory: about
 * 12 dk dv bytes, 198 KB at 128 x 128). */
bool kiln_cuda_gated_delta_backward_fits(int dk, int dv);

/* ops.h gated_delta_backward: dqkv(N, 2 nk dk + nv dv), dg, dbeta (N,nv) overwritten from
 * dout(N, nv dv); ws: kiln_gated_delta_backward_ws_floats(n_seq, T, nk, nv, dk, dv) floats
 * (the CPU's layout: the chunk checkpoints, the walked chunk's states, u and d, then the value
 * heads' gradients of the normalised q and k, which also hold the normalised q and k until
 * their token's gradients replace them). */
cudaError_t kiln_cuda_gated_delta_backward(cudaStream_t s, float *dqkv, float *dg, float *dbeta,
                                           const float *dout, const float *qkv, const float *g,
                                           const float *beta, float *ws, int n_seq, int T, int nk,
                                           int nv, int dk, int dv, float scale);

/* ops.h gdn_gates_backward: da, db (N,nv) overwritten; dA_log, ddt_bias (nv) += lane-16 sums
 * over tokens (either may be NULL: skipped). */
cudaError_t kiln_cuda_gdn_gates_backward(cudaStream_t s, float *da, float *db, float *dA_log,
                                         float *ddt_bias, const float *dg, const float *dbeta,
                                         const float *a, const float *b, const float *A_log,
                                         const float *dt_bias, int N, int nv);

/* ops.h sigmoid_mul_backward: dx, dgate (n) from dout, x, gate; either may alias dout. */
cudaError_t kiln_cuda_sigmoid_mul_backward(cudaStream_t s, float *dx, float *dgate,
                                           const float *dout, const float *x, const float *gate,
                                           size_t n);

#endif /* KILN_CUDA_LINEAR_ATTN_H */
