/*
 * cuda_attention.h -- causal grouped-query attention on the GPU, every mode and both
 * directions (cuda_attention.cu): the auditable forward over a dense or a paged cache and the
 * auditable backward, whose outputs have the CPU backend's bits; the fast mode's forward (flash
 * attention on bf16 tensor cores, the split decode, the plain f32 kernel, the head packing) and
 * backward (FlashAttention-2's, made deterministic). Included from .cu files only (C++ linkage).
 *
 * The auditable launchers: every output element is the IEEE binary32 operations of
 * docs/ARITHMETIC.md in the CPU reference's order (src/ops/cpu/kernels_portable.c,
 * backward_portable.c and tensor.c's dequantizers), so the results are the CPU backend's bits
 * (docs/CUDA.md). Shapes as in ops.h. Each only enqueues work on stream s and returns the launch's
 * error (cudaGetLastError), cudaSuccess when there is nothing to do, or cudaErrorInvalidValue /
 * cudaErrorInvalidConfiguration for arguments it cannot run (checked before anything is
 * enqueued). All pointers are device pointers, ids and pos included. No launcher allocates; the
 * scratch buffers are the caller's, as on the CPU.
 */
#ifndef KILN_CUDA_ATTENTION_H
#define KILN_CUDA_ATTENTION_H

#include "cuda_internal.h"

#include <cuda_bf16.h>
#include <limits.h>

/* =================================================================================================
 * Auditable.
 * ============================================================================================== */

/* Maximum head size the attention kernel takes (shared memory holds q and the accumulator). */
#define KILN_CUDA_MAX_HS 1024

/* ops.h's attention in the auditable arithmetic (window: a sliding window, 0 none). */
cudaError_t kiln_cuda_attention(cudaStream_t s, float *out, const float *q, const float *k,
                                const float *v, int N, int n_past, int NH, int KVH, int HS,
                                float scale, int window);
/* ops.h's attention_paged in the auditable arithmetic: token n (q, out rows (N, NH, HS))
 * attends to positions 0..d_pos[n] of sequence d_seq[n] of the paged pool (block_table
 * (n_seq, max_blocks), block_size a positive multiple of KILN_ATTN_BLOCK; all device memory),
 * with the bits of kiln_cuda_attention(N = 1, n_past = d_pos[n]) over those keys stored
 * densely. window > 0: only positions d_pos[n] - window < p <= d_pos[n], in the CPU's block
 * walk (docs/ARITHMETIC.md, "Sliding window": the aligned key blocks from the one holding the
 * window's first key, that block cut to start there): the CPU's bits; neither the pool rows
 * below the window nor the table entries of blocks wholly below it are read. A token whose
 * position is negative or past the table gets NaN. No allocation, no host synchronisation
 * (graph capture). cudaErrorInvalidValue for window < 0. */
cudaError_t kiln_cuda_attention_paged(cudaStream_t s, float *out, const float *q,
                                      const float *k_pool, const float *v_pool,
                                      const int32_t *block_table, int block_size, int max_blocks,
                                      const int32_t *d_seq, const int32_t *d_pos, int N, int NH,
                                      int KVH, int HS, float scale, int window);

/* Set up the auditable kernels on the current device (their shared memory above 48 KiB): once
 * per device, outside any graph capture (the backend's creation; the launchers call it too). */
cudaError_t kiln_cuda_attention_setup(void);

/* Causal GQA attention backward: dq(N,NH,HS) overwritten; dk, dv rows 0..n_past+N-1 of
 * (T,KVH,HS) overwritten, later rows untouched; ws: 3*N*NH floats of scratch. HS at most
 * KILN_CUDA_MAX_HS, NH a multiple of KVH. window > 0: the forward's sliding window (ops.h
 * attention), the CPU's bits. */
cudaError_t kiln_cuda_attention_backward(cudaStream_t s, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, const float *k,
                                         const float *v, const float *out, float *ws, int N,
                                         int n_past, int NH, int KVH, int HS, float scale,
                                         int window);

/* =================================================================================================
 * Fast forward (issue 4, item 3). Same semantics as ops.h's attention op: q(N,NH,HS) are
 * the queries of positions n_past..n_past+N-1; k,v(T,KVH,HS) hold positions
 * 0..n_past+N-1; query head h reads kv head h / (NH/KVH); out(N,NH,HS) =
 * softmax(q.k * scale) v over keys 0..n_past+n (causal). All pointers are device pointers
 * to f32 (but out16, bf16 bit patterns).
 *
 * Which kernel runs (kiln_cuda_attention_fast; the switch is kiln_cuda_attn_fast_is_mma):
 *   - N <= KILN_ATTN_DECODE_MAX_N (8): the split decode. The keys are cut into fixed splits
 *     of KILN_ATTN_SPLIT (64) keys; the query rows of a kv head go in chunks of <= 16, and
 *     one block of 256 threads per (split, kv head, 4 rows of a chunk, sequence) copies the
 *     split's K and V to shared memory (cp.async), computes the scores of its rows and keys
 *     in parallel, the split's max m and sum l per row and the unnormalised acc(HS); the
 *     row's splits are then merged in increasing split order. A chunk whose rows see one
 *     split writes out directly (at any max_T). Otherwise, when the grid has at most 64
 *     splits (max_T <= 4096), the last of a row's blocks to finish (an arrival counter in
 *     the workspace, signalling only, reset by that block) merges the partials in the same
 *     launch; above 64 splits a combine kernel does. f32 throughout, kiln_expf. A row's
 *     operations are fixed by its q, its keys, the split size and its chunk's keys -- never
 *     by the grid, the block order, or which block or kernel merges -- so the result is
 *     deterministic and kiln_cuda_attention_decode_dev (any B, max_T) has the bits of this
 *     call with N = 1 (tested, and against a host emulation of the definition in
 *     cuda_attention.cu, bit for bit).
 *   - N > 8 and HS 64 or 128 (and q, k, v 16-byte aligned): flash attention on bf16 tensor
 *     cores (FlashAttention-2 style: a block per (64-row query tile, head), 4 warps of 16
 *     rows, key tiles of 64, online softmax in f32 over the raw scores, each weight one FMA
 *     and the MUFU's 2^x (ex2.approx), mma.sync m16n8k16 bf16 ->
 *     f32). q, k, v are first rounded to bf16 and packed per head in the workspace
 *     (kiln_cuda_attn_pack_heads); the kernel copies key tiles with cp.async, double-buffered
 *     under the products of the previous tile, and reads fragments with ldmatrix. The softmax
 *     weights p are rounded to bf16 before the p.v product (l sums the f32 weights), so
 *     the result is within about 1e-2 * max|v| of the exact attention (tested at 2e-2). The
 *     batched entry point can have it store the output as bf16 instead (out16), pack into
 *     caller memory that the backward then reads in place of packing q, k, v again (keep),
 *     and apply RoPE to q and k as it packs them (rope, with keep).
 *   - N > 8 otherwise (HS up to KILN_ATTN_FAST_MAX_HS, e.g. 48, 80, 96, 256; or unaligned
 *     pointers): the split kernel's code run as one split over all of a row's keys, writing
 *     out directly (plain f32, kiln_expf).
 * Every path is deterministic: the same inputs give the same bits on every run.
 * ============================================================================================== */

/* Keys per split of the decode kernel. The partials, hence the bits, depend on it, so it is
 * a constant (never a function of n_past or max_T: decode_dev's bits must not depend on the
 * graph's max_T). 64 keys of the 0.5B/3B shapes are 32/64 KiB of K and V per block: enough
 * blocks at short contexts, few enough partials at long ones. */
#define KILN_ATTN_SPLIT 64
/* Largest N that takes the split decode kernel in kiln_cuda_attention_fast. */
#define KILN_ATTN_DECODE_MAX_N 8
/* Largest head size of the fast attention (the f32 kernels keep 16 rows x HS in registers). */
#define KILN_ATTN_FAST_MAX_HS 256

/* The flash kernels read q, k, v (and the backward dout) as bf16 copies packed per head,
 * [H][Rpad][HS] with Rpad = R rounded up to KILN_ATTN_PACK_ROWS and the padding rows zero, so
 * that every tile is whole and 16-byte aligned. */
#define KILN_ATTN_PACK_ROWS 64
/* R rounded up to KILN_ATTN_PACK_ROWS; -1 when R < 0 or it overflows an int. */
static inline int kiln_cuda_attn_pack_rows(int R) {
    if (R < 0 || R > INT_MAX - (KILN_ATTN_PACK_ROWS - 1)) return -1;
    return (R + KILN_ATTN_PACK_ROWS - 1) / KILN_ATTN_PACK_ROWS * KILN_ATTN_PACK_ROWS;
}
/* RoPE applied by the packing (kiln_cuda_attention_fast_seqs' rope, a pack job's rope), with
 * kiln_cuda_rope's arguments and arithmetic: pos (device) holds the position of each of the
 * B*R source rows (pos[b * R + r] for sequence b's row r); cos_tab, sin_tab (device) are
 * (max_pos, HS/2) f32, the angle of pair i (elements i and i + HS/2 of a head) at position p
 * at [p * HS/2 + i]. Positions are not checked (as kiln_cuda_rope). */
typedef struct {
    const int32_t *pos;
    const float *cos_tab, *sin_tab;
} kiln_cuda_attn_rope;

/* One tensor to pack, for B >= 1 sequences of R rows each: src (B*R, H, HS) f32 (16-byte
 * aligned for HS 128, 8 for 64) -> dst [B][H][Rpad][HS] bf16 (round to nearest even), rows
 * R..Rpad-1 of each (sequence, head) zero; Rpad a multiple of KILN_ATTN_PACK_ROWS and >= R.
 * With rope.pos: every pair of src is first rotated with kiln_cuda_rope's f32 operations
 * (cuda_common.cuh's kiln_rope_pair), so dst has the bits of kiln_cuda_rope on src followed
 * by the packing; never with d.
 * With d and one of out (f32) or out16 (bf16 bits, 8-byte aligned), both with src's layout:
 * d[(b * H + h) * Rpad + r] = sum over i of src * out (the backward's D = rowsum(dout * out),
 * f32 in a fixed order; 0 on padding rows). out16's values are widened to f32 (exact) and
 * then take the same operations, so d has the bits of an f32 out holding those values.
 * [B][H] is [B*H]: the kernels index a sequence's head h as b * H + h. */
typedef struct {
    __nv_bfloat16 *dst;
    const float *src, *out;   /* out: NULL, or (B*R, H, HS) f32 */
    const uint16_t *out16;    /* NULL, or (B*R, H, HS) bf16 bits; never with out */
    float *d;                 /* NULL exactly when out and out16 are */
    int R, Rpad, H, B;
    kiln_cuda_attn_rope rope; /* pos NULL: none; else all three given */
} kiln_cuda_attn_pack_job;
#define KILN_ATTN_PACK_MAX_JOBS 4
/* Packs n (1..KILN_ATTN_PACK_MAX_JOBS) tensors of head size HS (64 or 128) in one launch on
 * s. cudaErrorInvalidValue for a job out of contract. */
cudaError_t kiln_cuda_attn_pack_heads(cudaStream_t s, const kiln_cuda_attn_pack_job *jobs,
                                      int n, int HS);

typedef struct kiln_cuda_attn kiln_cuda_attn; /* workspace for the split partials */

/* Whether kiln_cuda_attention_fast runs the bf16 tensor-core flash kernel for these shapes
 * (given 16-byte aligned q, k, v); otherwise an f32 kernel. */
static inline bool kiln_cuda_attn_fast_is_mma(int N, int HS) {
    return N > KILN_ATTN_DECODE_MAX_N && (HS == 64 || HS == 128);
}

/* A workspace with nothing reserved yet, for the current device: sets the kernels' shared
 * memory limits there (so create it with the device it will run on current). *out is NULL
 * on failure. */
cudaError_t kiln_cuda_attn_create(kiln_cuda_attn **out);
/* Frees the workspace (waits for the device to finish with it); NULL is a no-op. */
void kiln_cuda_attn_free(kiln_cuda_attn *a);
/* Device bytes its buffers hold (0 for NULL). */
size_t kiln_cuda_attn_device_bytes(const kiln_cuda_attn *a);
/* Make sure the workspace holds B sequences x N query tokens x NH heads x HS over max_T keys
 * (grows; call outside CUDA-graph capture; synchronises the device when it grows).
 * cudaErrorInvalidValue on a non-positive size. The workspace serves one stream at a time. */
cudaError_t kiln_cuda_attn_reserve(kiln_cuda_attn *a, int B, int N, int NH, int HS, int max_T);
/* A count that changes whenever the workspace reallocates one of its buffers (0 for NULL): a
 * graph recorded at another generation reads freed memory and must be recorded again. */
uint64_t kiln_cuda_attn_generation(const kiln_cuda_attn *a);
/* The op: any N >= 1 (split decode for N <= 8, flash kernel above: see "Fast forward").
 * May grow the workspace (so not inside graph capture when it must grow). Enqueues on s only.
 * cudaErrorInvalidValue when HS is outside 1..KILN_ATTN_FAST_MAX_HS, KVH does not divide NH,
 * or a count is negative; cudaSuccess with nothing done when N, NH or HS is 0. */
cudaError_t kiln_cuda_attention_fast(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                     const float *q, const float *k, const float *v, int N,
                                     int n_past, int NH, int KVH, int HS, float scale);
/* kiln_cuda_attention_fast with a sliding window (docs/ARITHMETIC.md, "Sliding window"):
 * window > 0, the query at position p = n_past + n sees keys p - window < j <= p only; 0 is
 * kiln_cuda_attention_fast. Keys below the first query's window are never read (the call
 * starts k and v at that key, moving n_past with them, before choosing the kernel); each
 * kernel then masks the keys outside a row's window and skips the tiles (flash), sub-tiles
 * (f32) or splits (split decode) that hold none of its rows' keys. Deterministic; the
 * bounds of kiln_cuda_attention_fast. cudaErrorInvalidValue for window < 0. */
cudaError_t kiln_cuda_attention_fast_window(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                            const float *q, const float *k, const float *v,
                                            int N, int n_past, int NH, int KVH, int HS,
                                            float scale, int window);
/* Whether kiln_cuda_attention_fast_seqs runs the one-launch flash path, hence writes lse,
 * for these arguments; out is the output it writes (the f32 out, or out16 when that is the
 * one given). The fast backward uses a saved lse only when this holds for the same pointers
 * or when it is given keep (which only this path fills). */
static inline bool kiln_cuda_attn_saves_lse(const void *out, const float *q, const float *k,
                                            const float *v, int N, int HS) {
    return kiln_cuda_attn_fast_is_mma(N, HS) &&
           (((uintptr_t)out | (uintptr_t)q | (uintptr_t)k | (uintptr_t)v) & 15) == 0;
}
/* Alignment of kiln_cuda_attention_fast_seqs' keep and of each region in it. */
#define KILN_ATTN_KEEP_ALIGN 256
/* bytes rounded up to KILN_ATTN_KEEP_ALIGN: a region's size in keep (0 on overflow). */
static inline size_t kiln_cuda_attn_keep_region(size_t bytes) {
    if (bytes > SIZE_MAX - (KILN_ATTN_KEEP_ALIGN - 1)) return 0;
    return (bytes + KILN_ATTN_KEEP_ALIGN - 1) / KILN_ATTN_KEEP_ALIGN * KILN_ATTN_KEEP_ALIGN;
}
/* Bytes of kiln_cuda_attention_fast_seqs' keep for these shapes: the bf16 packed q
 * [B][NH][Npad][HS], then k and v [B][KVH][Npad][HS] (Npad = kiln_cuda_attn_pack_rows(N)),
 * each region starting and ending on a KILN_ATTN_KEEP_ALIGN boundary of the buffer (so the
 * same count as ops.h's kiln_attention_keep_bytes). 0 when a count is not positive, KVH does
 * not divide NH, or the size overflows. */
static inline size_t kiln_cuda_attn_keep_bytes(int B, int N, int NH, int KVH, int HS) {
    if (B <= 0 || N <= 0 || NH <= 0 || KVH <= 0 || HS <= 0 || NH % KVH != 0) return 0;
    const int Npad = kiln_cuda_attn_pack_rows(N);
    if (Npad < 0) return 0;
    /* a head is Npad * HS * 2 bytes < 2^63; a region of q or of k is heads * head */
    const uint64_t head = (uint64_t)Npad * (uint64_t)HS * sizeof(__nv_bfloat16);
    const uint64_t qh = (uint64_t)B * (uint64_t)NH, kh = (uint64_t)B * (uint64_t)KVH;
    const uint64_t lim = (uint64_t)SIZE_MAX / 4;
    if (qh > lim / head || kh > lim / head) return 0;
    const size_t qr = kiln_cuda_attn_keep_region((size_t)(qh * head));
    const size_t kr = kiln_cuda_attn_keep_region((size_t)(kh * head));
    return qr + 2 * kr; /* each under SIZE_MAX / 4 + 255: no overflow */
}
/* ops.h's attention_seqs in fast mode: B sequences of N tokens (rows back to back, n_past 0),
 * each with the bits of kiln_cuda_attention_fast on its own rows. When
 * kiln_cuda_attn_saves_lse holds, one pack and one flash launch serve all B (grid z), and
 * lse (NULL or [B][NH][Npad] floats, Npad = N rounded up to KILN_ATTN_PACK_ROWS) receives
 * each row's log-sum-exp of the scaled scores, m scale + log(l) with the forward's own raw
 * max m and sum l (padding rows 0); otherwise a loop of
 * kiln_cuda_attention_fast and lse untouched.
 * The output (B*N, NH, HS) goes to exactly one of out (f32) and out16 (bf16 bits: each value
 * the round-to-nearest-even bf16 of the f32 that out would hold, tensor.c's
 * kiln_fp32_to_bf16; lse as with out). out16 is taken only by the flash path
 * (kiln_cuda_attn_saves_lse(out16, q, k, v, N, HS)): cudaErrorNotSupported otherwise, nothing
 * enqueued.
 * keep: NULL, or kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS) bytes of device memory
 * (KILN_ATTN_KEEP_ALIGN-byte aligned) that the forward packs q, k, v into (in place of the
 * workspace, which then does not grow) and leaves for kiln_cuda_attention_backward_fast_seqs
 * (its keep): q [B][NH][Npad][HS] at byte 0, k [B][KVH][Npad][HS] at
 * kiln_cuda_attn_keep_region(q's bytes), v after k's region, as kiln_cuda_attn_pack_heads
 * writes them. Only the flash path takes keep (kiln_cuda_attn_saves_lse for the output
 * pointer): cudaErrorNotSupported otherwise, nothing enqueued. out and lse are the same bits
 * with or without keep.
 * rope: NULL, or (host pointer, read during the call) RoPE to apply to q and k (not v) as
 * they are packed: q and k are then the un-rotated values, and out, lse and keep have the
 * bits of kiln_cuda_rope(q, rope->pos, B*N, NH, HS, rope->cos_tab, rope->sin_tab) and the
 * same on k (KVH heads) followed by this call without rope. rope requires keep (the backward
 * cannot pack the rotated q, k again without it).
 * cudaErrorInvalidValue when both or neither of out, out16 are given, for rope without keep
 * or with a NULL pointer, or keep not KILN_ATTN_KEEP_ALIGN-byte aligned; other errors as
 * kiln_cuda_attention_fast. */
cudaError_t kiln_cuda_attention_fast_seqs(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                          uint16_t *out16, float *lse, void *keep,
                                          const kiln_cuda_attn_rope *rope, const float *q,
                                          const float *k, const float *v, int B, int N, int NH,
                                          int KVH, int HS, float scale);
/* Decode of B sequences, one new token each, for CUDA graphs: sequence b's query is
 * q + b*NH*HS, its output out + b*NH*HS, its cache k + b*kv_seq_stride (floats; same for v),
 * its n_past is d_n_past[b] READ ON THE DEVICE (so a captured graph replays for any
 * position); max_T >= d_n_past[b] + 1 sizes the grid (splits beyond a sequence's keys do
 * nothing and the combine skips them). The bits equal kiln_cuda_attention_fast with N = 1
 * and that n_past. No allocation, no host synchronisation: the workspace must already hold
 * (B, 1, NH, HS, max_T) (kiln_cuda_attn_reserve), else cudaErrorInvalidValue. A sequence
 * whose d_n_past[b] + 1 > max_T (or < 0) gets NaN outputs rather than a wrong answer. */
cudaError_t kiln_cuda_attention_decode_dev(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                           const float *q, const float *k, const float *v,
                                           int B, size_t kv_seq_stride, const int32_t *d_n_past,
                                           int max_T, int NH, int KVH, int HS, float scale);

/* A paged KV cache as the split decode reads it (ops.h's kiln_kv_pages; all device memory):
 * decode token b (0 <= b < B) is batch token t = tok[b] (t = b when tok is NULL), its query q
 * + t*NH*HS and output out + t*NH*HS, at position pos[t] of sequence seq[t], whose key p
 * lives in pool row table[seq[t] * max_blocks + p / block_size] * block_size + p %
 * block_size; block_size a positive multiple of KILN_ATTN_SPLIT, so a split lies in one
 * block. */
typedef struct kiln_cuda_attn_pages {
    const int32_t *seq, *pos; /* per batch token */
    const int32_t *tok;       /* (B) batch token of each decode token, or NULL */
    const int32_t *table;     /* (n_seq, max_blocks) */
    int block_size, max_blocks;
} kiln_cuda_attn_pages;
/* decode_dev over a paged pool: for each decode token the bits of kiln_cuda_attention_fast
 * with N = 1, n_past = pos[t] over its sequence's keys stored densely (the same split decode:
 * only where a split's rows are read from differs). window > 0: a sliding window, the token
 * sees keys pos[t] - window < j <= pos[t] only: splits wholly below the window return before
 * reading the table, the keys of the first split below the window are staged as zeros and
 * masked, and the combine merges the token's splits from the one holding its first key (so
 * neither the pool rows nor the table entries below the window are read); 0: none.
 * Positions on the device, no allocation, no host synchronisation (graph capture): the
 * workspace must already hold (B, 1, NH, HS, max_T), else cudaErrorInvalidValue (also for
 * window < 0). A token whose pos[t] + 1 > max_T, pos[t] < 0 or pos[t] past its table row
 * gets NaN outputs. */
cudaError_t kiln_cuda_attention_decode_paged(kiln_cuda_attn *a, cudaStream_t s, float *out,
                                             const float *q, const float *k_pool,
                                             const float *v_pool, const kiln_cuda_attn_pages *pg,
                                             int B, int max_T, int NH, int KVH, int HS,
                                             float scale, int window);

/* The launch of the split decode for B sequences x N tokens over max_T keys, as
 * kiln_cuda_attention_fast (B = 1, max_T = n_past + N) and decode_dev (N = 1) make it: grid
 * (x = KVH * chunks of 16 rows, y = splits, z = B), threads per block, dynamic shared memory
 * in bytes, and whether a combine kernel follows (more than 64 splits). Host only, for
 * benchmarks and diagnostics; the launchers use it, so it cannot drift from them.
 * cudaErrorInvalidValue / cudaErrorInvalidConfiguration as the launch would return. */
typedef struct kiln_cuda_attn_launch {
    unsigned grid[3];
    unsigned block;
    size_t smem;
    int combine;
} kiln_cuda_attn_launch;
cudaError_t kiln_cuda_attn_decode_launch_info(int B, int N, int NH, int KVH, int HS, int max_T,
                                              kiln_cuda_attn_launch *info);

/* =================================================================================================
 * Fast backward (issue 5, item 1) on bf16 tensor cores: FlashAttention-2's backward (Dao
 * 2023, Algorithm 2) made deterministic. Same contract as ops.h's attention_backward:
 * q(N,NH,HS) are the queries of positions n_past..n_past+N-1, k,v(T = n_past+N, KVH, HS),
 * out and dout (N,NH,HS); dq overwritten, dk and dv (T, KVH, HS) overwritten. Device
 * pointers to f32 (the batched entry point also takes out as bf16 bits).
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
 * On an sm_90a device (cuda_matmul.h: kiln_cuda_wgmma_usable) head size 64 runs the main
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
 * ============================================================================================== */

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

#endif /* KILN_CUDA_ATTENTION_H */
