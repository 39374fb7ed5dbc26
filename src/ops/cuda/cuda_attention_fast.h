/*
 * cuda_attention_fast.h -- fast-mode causal grouped-query attention on the GPU (issue 4, item
 * 3). Same semantics as ops.h's attention op: q(N,NH,HS) are the queries of positions
 * n_past..n_past+N-1; k,v(T,KVH,HS) hold positions 0..n_past+N-1; query head h reads kv head
 * h / (NH/KVH); out(N,NH,HS) = softmax(q.k * scale) v over keys 0..n_past+n (causal).
 * All pointers are device pointers to f32 (but out16, bf16 bit patterns). Included from .cu
 * files only (C++ linkage).
 *
 * Which kernel runs (kiln_cuda_attention_fast; the switch is kiln_cuda_attn_fast_is_mma):
 *   - N <= KILN_ATTN_DECODE_MAX_N (8): the split decode. The keys are cut into fixed splits
 *     of KILN_ATTN_SPLIT (64) keys; one block of 256 threads per (split, kv head, chunk of
 *     <= 16 query rows, sequence) copies the split's K and V to shared memory (cp.async),
 *     computes the scores of all its rows and keys in parallel, the split's max m and sum l
 *     per row and the unnormalised acc(HS); the row's splits are then merged in increasing
 *     split order. When the grid has at most 64 splits (max_T <= 4096) this happens in the
 *     same launch: a chunk whose rows see one split writes out directly, otherwise the last
 *     of its blocks to finish (an arrival counter in the workspace, signalling only, reset
 *     by that block) merges the partials; above 64 splits a combine kernel does. f32
 *     throughout, kiln_expf. A row's operations are fixed by its q, its keys and the split
 *     size -- never by the grid, the block order, or which block or kernel merges -- so the
 *     result is deterministic and kiln_cuda_attention_decode_dev (any B, max_T) has the bits
 *     of this call with N = 1 (tested).
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
 */
#ifndef KILN_CUDA_ATTENTION_FAST_H
#define KILN_CUDA_ATTENTION_FAST_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

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
/* The op: any N >= 1 (split decode for N <= 8, flash kernel above: see the top of this file).
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

#endif /* KILN_CUDA_ATTENTION_FAST_H */
