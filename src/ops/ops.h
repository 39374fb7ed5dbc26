/*
 * ops.h -- the operations of a Llama-family forward pass, behind a backend table.
 *
 * A backend is a table of function pointers (like ggml_backend_i): the CPU backend is the
 * reference, a CUDA backend will be its equal. Callers ask supports_op() before dispatching.
 * Buffers (float *) live in the backend's memory. Every op's arithmetic order is defined in
 * docs/ARITHMETIC.md so that results never depend on the thread count, and so that a GPU can
 * reproduce them bit for bit.
 *
 * Shapes use the names of models/config.h: N tokens in the batch, C model width, R output
 * rows, NH/KVH query/key-value heads, HS head size, T cached positions.
 */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include "../base/tensor.h"

typedef enum kiln_op {
    KILN_OP_EMBED = 0,
    KILN_OP_RMSNORM,
    KILN_OP_MATMUL,
    KILN_OP_ROPE,
    KILN_OP_ATTENTION,
    KILN_OP_SWIGLU,
    KILN_OP_ADD,
    KILN_OP_COUNT
} kiln_op;

typedef struct kiln_backend kiln_backend;

typedef struct kiln_backend_i {
    const char *name; /* "cpu", "cuda" */
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
     * Query head h reads kv head h / (NH/KVH). out(N,NH,HS) = softmax(q.k * scale) v. */
    void (*attention)(kiln_backend *be, float *out, const float *q, const float *k,
                      const float *v, int N, int n_past, int NH, int KVH, int HS, float scale);
    /* out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). out may alias gate. */
    void (*swiglu)(kiln_backend *be, float *out, const float *gate, const float *up, size_t n);
    /* x[i] += y[i]. */
    void (*add)(kiln_backend *be, float *x, const float *y, size_t n);
} kiln_backend_i;

struct kiln_backend {
    const kiln_backend_i *i;
    int n_threads;
    void *ctx; /* backend private state (thread pool, streams, ...) */
};

/* The CPU backend with n_threads workers (0 = all cores). Results are bit-identical for any
 * n_threads. */
kiln_status kiln_backend_cpu_create(int n_threads, kiln_backend **out);
void kiln_backend_free(kiln_backend *be);

#endif /* KILN_OPS_H */
