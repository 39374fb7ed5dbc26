/*
 * cuda_backend.cu -- the CUDA backend: the op table of ops.h over the launchers of the kernel
 * families (cuda_attention.h, cuda_matmul.h, cuda_norm.h, cuda_rope.h, cuda_elementwise.h,
 * cuda_rows.h, cuda_linear_attn.h), device memory, the weight cache, and error poisoning.
 *
 * Contract (docs/CUDA.md):
 *   - Every float * an op takes is device memory (kiln_backend_alloc). ids (embed) and pos
 *     (rope) may be host or device memory; a host array is copied at the call.
 *   - A kiln_tensor weight whose data is device memory is used in place; one whose data is
 *     host memory is uploaded on first use and cached, keyed by its host address range, for
 *     the backend's lifetime (a view inside a cached range reuses it). The host data must
 *     not change while the backend lives.
 *   - All work runs in order on one stream of the backend; ops only enqueue. upload,
 *     download and status wait for it.
 *   - The first failed CUDA call or launch poisons the backend: later ops do nothing, and
 *     status/upload/download return that error with its message until the backend is freed.
 */
#include "cuda_internal.h"
#include "cuda_attention.h"
#include "cuda_elementwise.h"
#include "cuda_linear_attn.h"
#include "cuda_matmul.h"
#include "cuda_mx.h"
#include "cuda_norm.h"
#include "cuda_rope.h"
#include "cuda_rows.h"
#include "cuda_sampling.h"
#include "cuda_train.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct weight_entry {
    const uint8_t *host; /* host range [host, host + nbytes) */
    size_t nbytes;
    uint8_t *dev;
} weight_entry;

/* A pinned staging slot for small uploads (cu_upload): the source is copied into buf and the
 * device copy enqueued from there, so the caller's buffer is free at return without waiting
 * for the stream; ev marks the copy's end, before which buf is not rewritten. */
#define UPLOAD_SLOTS 8
#define UPLOAD_STAGED_MAX ((size_t)4 << 20)
typedef struct upload_slot {
    void *buf;
    size_t cap;
    cudaEvent_t ev;
    bool pending;
} upload_slot;

typedef struct cuda_ctx {
    int device;
    cudaStream_t stream;
    kiln_status err; /* KILN_OK until poisoned */
    char msg[512];
    weight_entry *weights;
    size_t n_weights, cap_weights;
    int32_t *ints; /* staging for host ids / pos */
    size_t cap_ints;
    bool fast; /* fast arithmetic (docs/CUDA.md, "Fast mode") instead of auditable */
    bool invariant; /* with fast: the batch-invariant fast mode (docs/CUDA.md): every product
                     * on kernels whose token outputs never depend on N, attention auditable */
    kiln_cuda_gemm *gemm; /* fast mode: cuBLASLt state, made on first use */
    kiln_cuda_attn *attn; /* fast mode: split-key decode workspace, made on first use */
    double *colsum_ws;    /* fast mode: kiln_cuda_col_sum_fast's partials (rmsnorm dw), */
    size_t cap_colsum_ws; /* grown on demand; in doubles */
    kiln_cuda_sampler *sampler; /* device sampling: made on first use for vocabulary sampler_V */
    int sampler_V;
    int32_t *hist;   /* device copy of the penalty window (cap_hist ids) and the token */
    size_t cap_hist;
    int32_t *h_token; /* pinned host: the sampled id */
    uint64_t gen;     /* bumped when ints or colsum_ws is reallocated (graph_generation) */
    /* embed_backward from host ids: the grouping (kiln_embed_plan) made on the host in h_plan
     * (the plan, then V counts; cap_h_plan ints) and uploaded to d_plan (cap_plan ints) */
    int32_t *h_plan, *d_plan;
    size_t cap_h_plan, cap_plan;
    upload_slot up[UPLOAD_SLOTS]; /* cu_upload's staging, used in turn */
    int up_next;
    /* download_begin / download_end: pinned staging, its event, the open copy's size */
    void *down_buf;
    size_t down_cap, down_open;
    cudaEvent_t down_ev;
    bool down_pending;
    /* fast attention_paged: the K then V rows of a prefill run's sequence whose blocks are not
     * consecutive in the pool, gathered dense (cap_gather floats; grown outside graphs) */
    float *gather;
    size_t cap_gather;
    /* an exact format's mode (KILN_MODE_MX16 / MX8; cuda_mx.h): every matmul and
     * matmul_backward in it, as the CPU backend's. mx is KILN_MX16 / KILN_MX8, 0 otherwise. */
    int mx;
    /* formats per weight (ops.h kiln_weight_formats; a copy, keyed by the address an op is
     * handed): a weight in it takes its format's product, any other the mode's (mx) */
    kiln_weight_formats wf;
    struct mx_weight *mx_w; /* the weights quantized (W, or W^T for dx), made on first use */
    size_t n_mx_w, cap_mx_w;
    void *mx_a, *mx_b;    /* the quantized activations (bytes, grown outside graph capture) */
    size_t cap_mx_a, cap_mx_b;
    void *mx_ws;          /* the split products' sums: zeroed, and left zeroed by each product */
    size_t cap_mx_ws;
    int sr_on;            /* grad_rounding: dy and dy^T quantized stochastically */
    uint64_t sr_key, sr_count;
} cuda_ctx;

/* A recorded graph and the buffer generation it was recorded at. */
typedef struct cu_graph {
    cudaGraphExec_t exec;
    uint64_t gen;
} cu_graph;

static cuda_ctx *ctx_of(kiln_backend *be) { return (cuda_ctx *)be->ctx; }

/* The kiln_mx_kind W's products take (0: the auditable f32 product): its entry in the
 * per-weight table, else the mode's. */
static int kind_of(const cuda_ctx *c, const kiln_tensor *W) {
    return kiln_weight_formats_kind(&c->wf, W->data, c->mx);
}

/* Record the first error (later ones are consequences) and set this thread's message. */
static void poison(cuda_ctx *c, kiln_status st, const char *fmt, ...) KILN_PRINTF(3, 4);
static void poison(cuda_ctx *c, kiln_status st, const char *fmt, ...) {
    if (c->err == KILN_OK) {
        va_list ap;
        va_start(ap, fmt);
        int n = snprintf(c->msg, sizeof c->msg, "cuda backend (device %d): ", c->device);
        if (n > 0 && (size_t)n < sizeof c->msg)
            vsnprintf(c->msg + n, sizeof c->msg - (size_t)n, fmt, ap);
        va_end(ap);
        c->err = st;
    }
    kiln_error(c->err, "%s", c->msg);
}

/* Check a CUDA call; on failure poison and return false. */
static bool check(cuda_ctx *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    poison(c, KILN_ERR_INTERNAL, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return false;
}
#define CK(c, call) check((c), (call), #call)

/* Start of every op: false when poisoned (nothing is enqueued). */
static bool op_begin(cuda_ctx *c) {
    if (c->err != KILN_OK) return false;
    return CK(c, cudaSetDevice(c->device));
}

static bool is_device_ptr(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: clear it */
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

static size_t row_bytes_of(kiln_dtype dt, int64_t C) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    return (size_t)(C / tr->block_size) * (size_t)tr->type_size;
}

/* Device address of the weight bytes [p, p + nbytes): p itself when it is device memory,
 * else the cached copy (uploaded now on first use). NULL when poisoned. */
static const uint8_t *weight_dev(cuda_ctx *c, const void *p, size_t nbytes, const char *name) {
    const uint8_t *h = (const uint8_t *)p;
    for (size_t k = 0; k < c->n_weights; k++) {
        const weight_entry *e = &c->weights[k];
        if (h >= e->host && h < e->host + e->nbytes && nbytes <= (size_t)(e->host + e->nbytes - h))
            return e->dev + (h - e->host);
    }
    if (is_device_ptr(p)) return h;
    if (c->n_weights == c->cap_weights) {
        size_t cap = c->cap_weights ? 2 * c->cap_weights : 64;
        weight_entry *t = (weight_entry *)kiln_realloc(c->weights, cap * sizeof *t);
        if (!t) {
            poison(c, KILN_ERR_NOMEM, "weight cache: out of host memory");
            return NULL;
        }
        c->weights = t;
        c->cap_weights = cap;
    }
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        poison(c, KILN_ERR_NOMEM, "uploading weight '%s' (%zu bytes): cudaMalloc: %s",
               name ? name : "?", nbytes, cudaGetErrorString(e));
        return NULL;
    }
    /* the copy is synchronous for pageable memory; the stream keeps it ordered anyway */
    if (!CK(c, cudaMemcpyAsync(d, p, nbytes, cudaMemcpyHostToDevice, c->stream)) ||
        !CK(c, cudaStreamSynchronize(c->stream))) {
        cudaFree(d);
        return NULL;
    }
    c->weights[c->n_weights++] = (weight_entry){h, nbytes, (uint8_t *)d};
    return (const uint8_t *)d;
}

/* A device copy of n host or device int32s (ids, pos). NULL when poisoned. */
static const int32_t *ints_dev(cuda_ctx *c, const int32_t *p, size_t n) {
    if (is_device_ptr(p)) return p;
    if (n > c->cap_ints) {
        size_t cap = n < 4096 ? 4096 : n;
        c->gen++;
        if (c->ints && !CK(c, cudaFree(c->ints))) return NULL;
        c->ints = NULL;
        c->cap_ints = 0;
        if (!CK(c, cudaMalloc((void **)&c->ints, cap * sizeof(int32_t)))) return NULL;
        c->cap_ints = cap;
    }
    /* Ordered after the previous op that read the staging buffer (same stream); returns once
     * the pageable source has been consumed. */
    if (!CK(c, cudaMemcpyAsync(c->ints, p, n * sizeof(int32_t), cudaMemcpyHostToDevice,
                               c->stream)))
        return NULL;
    return c->ints;
}

static void after_launch(cuda_ctx *c, cudaError_t e, const char *op) {
    if (e != cudaSuccess)
        poison(c, KILN_ERR_INTERNAL, "%s: kernel launch: %s (%s)", op, cudaGetErrorString(e),
               cudaGetErrorName(e));
}

/* ---- the state, for other translation units (cuda_internal.h) ----------------------------- */

cudaStream_t kiln_cuda_stream(kiln_backend *be) { return ctx_of(be)->stream; }

bool kiln_cuda_begin(kiln_backend *be) { return op_begin(ctx_of(be)); }

kiln_status kiln_cuda_fail(kiln_backend *be, kiln_status st, const char *fmt, ...) {
    cuda_ctx *c = ctx_of(be);
    char buf[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    poison(c, st, "%s", buf);
    return c->err;
}

bool kiln_cuda_check(kiln_backend *be, cudaError_t e, const char *what) {
    return check(ctx_of(be), e, what);
}

const uint8_t *kiln_cuda_weight(kiln_backend *be, const kiln_tensor *W, size_t *row_bytes) {
    cuda_ctx *c = ctx_of(be);
    int64_t C = W->shape[W->n_dims - 1];
    int64_t R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    size_t rb = row_bytes_of(W->dtype, C);
    if (row_bytes) *row_bytes = rb;
    return weight_dev(c, W->data, (size_t)R * rb, W->name);
}

bool kiln_cuda_is_fast(const kiln_backend *be) { return ((const cuda_ctx *)be->ctx)->fast; }

/* ---- ops --------------------------------------------------------------------------------- */

static void cu_embed(kiln_backend *be, float *out, const kiln_tensor *table, const int32_t *ids,
                     int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (!kiln_cuda_dtype_supported(table->dtype)) {
        poison(c, KILN_ERR_UNSUPPORTED, "embed: dtype %s", kiln_dtype_name(table->dtype));
        return;
    }
    int64_t C = table->shape[table->n_dims - 1];
    int64_t V = C > 0 ? kiln_tensor_nelements(table) / C : 0;
    size_t rb = row_bytes_of(table->dtype, C);
    const uint8_t *t = weight_dev(c, table->data, (size_t)V * rb, table->name);
    const int32_t *d_ids = t ? ints_dev(c, ids, (size_t)N) : NULL;
    if (!d_ids) return;
    after_launch(c, kiln_cuda_embed(c->stream, out, t, rb, table->dtype, C, d_ids, N), "embed");
}

static void cu_rmsnorm(kiln_backend *be, float *out, const float *x, const float *w, int N,
                       int C, float eps) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_rmsnorm(c->stream, out, x, w, N, C, eps), "rmsnorm");
}

/* ---- the exact block formats (KILN_MODE_MX16 / MX8; cuda_mx.h) ---------------------------- */

/* A weight quantized: W (R, C) along C, or W^T (C, R) along R (transposed, for dx = dy W),
 * keyed by the address the op was handed (host or device) and kept until forget. */
typedef struct mx_weight {
    const uint8_t *key;
    size_t nbytes;
    int64_t R, C;
    kiln_dtype dt;
    int transposed;
    kiln_cuda_mx m;
} mx_weight;

static bool capturing(cuda_ctx *c) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(c->stream, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

/* *buf with room for need bytes (zero: the new buffer zeroed on the stream). It grows only
 * outside a graph capture (graph_begin sizes it for the graph's step); a growth bumps the
 * buffer generation, so graphs recorded on the old buffer are recorded again. */
static bool mx_reserve(cuda_ctx *c, void **buf, size_t *cap, size_t need, bool zero, const char *what) {
    if (need <= *cap) return true;
    if (capturing(c)) {
        poison(c, KILN_ERR_STATE, "%s: %zu bytes of scratch needed while a graph is recorded", what, need);
        return false;
    }
    if (*buf) {
        if (!CK(c, cudaStreamSynchronize(c->stream))) return false;
        cudaFree(*buf);
        *buf = NULL;
        *cap = 0;
        c->gen++;
    }
    const size_t n = need + need / 4;
    if (!CK(c, cudaMalloc(buf, n))) return false;
    if (zero && !CK(c, cudaMemsetAsync(*buf, 0, n, c->stream))) return false;
    *cap = n;
    return true;
}

/* W (or W^T) in format kind: from the cache, or dequantized to f32 (tensor.c's
 * values: kiln_cuda_embed of every row) and quantized now. NULL when poisoned. */
static const kiln_cuda_mx *mx_weight_of(cuda_ctx *c, int kind, const kiln_tensor *W, const uint8_t *w, size_t rb,
                                        int64_t R, int64_t C, int transposed) {
    const uint8_t *key = (const uint8_t *)W->data;
    for (size_t i = 0; i < c->n_mx_w; i++) {
        const mx_weight *e = &c->mx_w[i];
        if (e->key == key && e->R == R && e->C == C && e->dt == W->dtype && e->transposed == transposed &&
            e->m.kind == kind)
            return &e->m;
    }
    const char *name = W->name ? W->name : "?";
    if (capturing(c)) {
        poison(c, KILN_ERR_STATE, "matmul (mx%d) '%s': first used while a graph is recorded (run the step once "
               "before recording it)", kind, name);
        return NULL;
    }
    if (R > INT_MAX) {
        poison(c, KILN_ERR_UNSUPPORTED, "matmul (mx%d) '%s': %lld rows", kind, name, (long long)R);
        return NULL;
    }
    if (c->n_mx_w == c->cap_mx_w) {
        size_t cap = c->cap_mx_w ? 2 * c->cap_mx_w : 64;
        mx_weight *t = (mx_weight *)kiln_realloc(c->mx_w, cap * sizeof *t);
        if (!t) {
            poison(c, KILN_ERR_NOMEM, "matmul (mx%d) '%s': out of host memory", kind, name);
            return NULL;
        }
        c->mx_w = t;
        c->cap_mx_w = cap;
    }
    mx_weight e;
    memset(&e, 0, sizeof e);
    cudaError_t err = kiln_cuda_mx_alloc(&e.m, kind, transposed ? C : R, transposed ? R : C);
    if (err != cudaSuccess) {
        poison(c, KILN_ERR_NOMEM, "matmul (mx%d) '%s': the quantized weight (%lld x %lld): %s", kind, name,
               (long long)R, (long long)C, cudaGetErrorString(err));
        return NULL;
    }
    const float *src = (const float *)w;
    int64_t ld = (int64_t)(rb / sizeof(float));
    float *tmp = NULL;
    if (W->dtype != KILN_DTYPE_F32) {
        err = cudaMalloc((void **)&tmp, (size_t)R * (size_t)C * sizeof(float));
        if (err == cudaSuccess) err = kiln_cuda_embed(c->stream, tmp, w, rb, W->dtype, C, NULL, (int)R);
        src = tmp;
        ld = C;
    }
    if (err == cudaSuccess)
        err = transposed ? kiln_cuda_mx_quantize(c->stream, &e.m, src, 1, ld, 0, 0, 0)
                         : kiln_cuda_mx_quantize(c->stream, &e.m, src, ld, 1, 0, 0, 0);
    if (tmp) {
        if (err == cudaSuccess) err = cudaStreamSynchronize(c->stream);
        cudaFree(tmp);
    }
    if (err != cudaSuccess) {
        kiln_cuda_mx_free(&e.m);
        poison(c, KILN_ERR_INTERNAL, "matmul (mx%d) '%s': quantizing the weight: %s", kind, name,
               cudaGetErrorString(err));
        return NULL;
    }
    e.key = key;
    e.nbytes = (size_t)R * rb;
    e.R = R;
    e.C = C;
    e.dt = W->dtype;
    e.transposed = transposed;
    c->mx_w[c->n_mx_w++] = e;
    return &c->mx_w[c->n_mx_w - 1].m;
}

/* The quantized (rows, K) activation a (element (j, k) at a[j * s_row + k * s_col]) in kind,
 * in the scratch *buf. false when poisoned. */
static bool mx_activation(cuda_ctx *c, int kind, kiln_cuda_mx *m, void **buf, size_t *cap, const float *a,
                          int64_t rows, int64_t K, int64_t s_row, int64_t s_col, int stochastic, uint64_t tensor_id,
                          const char *what) {
    if (!mx_reserve(c, buf, cap, kiln_cuda_mx_bytes(kind, rows, K), false, what)) return false;
    kiln_cuda_mx_view(m, *buf, kind, rows, K);
    after_launch(c, kiln_cuda_mx_quantize(c->stream, m, a, s_row, s_col, stochastic, c->sr_key, tensor_id), what);
    return c->err == KILN_OK;
}

/* out (N, R) (+)= the product of x and w in the format, then the bias and res
 * (kiln_cuda_mx_matmul). */
static void mx_product(cuda_ctx *c, const kiln_cuda_mx *x, const kiln_cuda_mx *w, float *out, const float *bias,
                       const float *res, int accumulate, const char *what) {
    if (!mx_reserve(c, &c->mx_ws, &c->cap_mx_ws, kiln_cuda_mx_matmul_ws_bytes(x->rows, w->rows, x->nb), true, what))
        return;
    after_launch(c, kiln_cuda_mx_matmul(c->stream, x, w, out, w->rows, bias, res, accumulate, c->mx_ws), what);
}

/* ops.h's matmul in format kind: out(N, R) = mx(x W^T) + bias, the CPU backend's bits. */
static void cu_matmul_mx(cuda_ctx *c, int kind, float *out, const float *x, const kiln_tensor *W, const uint8_t *w,
                         size_t rb, int64_t R, int64_t C, const float *bias, int N) {
    if (C > KILN_MX_MAX_K) {
        poison(c, KILN_ERR_UNSUPPORTED, "matmul (mx%d) '%s': the reduction (%lld) is longer than the format's "
               "limit (262,144)", kind, W->name ? W->name : "?", (long long)C);
        return;
    }
    const kiln_cuda_mx *wm = mx_weight_of(c, kind, W, w, rb, R, C, 0);
    kiln_cuda_mx xm;
    if (!wm || !mx_activation(c, kind, &xm, &c->mx_a, &c->cap_mx_a, x, N, C, C, 1, 0, 0, "matmul (mx)")) return;
    mx_product(c, &xm, wm, out, bias, NULL, 0, "matmul (mx)");
}

/* ops.h's matmul_backward in the format (docs/ARITHMETIC.md, "Training in a format"), the CPU
 * backend's matmul_backward_mx step for step: dbias the auditable column sum; dx (+)= mx(dy
 * W) with dy quantized along R and W^T (cached) along R; dW += mx(dy^T x) with dy^T and x^T
 * quantized along the tokens; dy and dy^T stochastically under grad_rounding (tensor ids
 * sr_id and sr_id + 1). */
static void cu_matmul_backward_mx(cuda_ctx *c, int kind, uint64_t sr_id, float *dx, float *dW, float *dbias, const float *dy,
                                  const float *x, const kiln_tensor *W, const uint8_t *w, size_t rb, int64_t R,
                                  int64_t C, int N, bool accumulate_dx) {
    if (dbias)
        after_launch(c, kiln_cuda_matmul_backward(c->stream, NULL, NULL, dbias, dy, x, w, rb, W->dtype, R, C, N, false),
                     "matmul_backward (mx) dbias");
    if (R > KILN_MX_MAX_K || N > KILN_MX_MAX_K) {
        poison(c, KILN_ERR_UNSUPPORTED, "matmul_backward (mx%d) '%s': the backward's reduction is longer than the "
               "format's limit (262,144)", kind, W->name ? W->name : "?");
        return;
    }
    if (dx && c->err == KILN_OK) {
        const kiln_cuda_mx *wt = mx_weight_of(c, kind, W, w, rb, R, C, 1);
        kiln_cuda_mx q;
        if (!wt || !mx_activation(c, kind, &q, &c->mx_a, &c->cap_mx_a, dy, N, R, R, 1, c->sr_on, sr_id,
                                  "matmul_backward (mx) dy"))
            return;
        mx_product(c, &q, wt, dx, NULL, NULL, accumulate_dx, "matmul_backward (mx) dx");
    }
    if (dW && c->err == KILN_OK) {
        kiln_cuda_mx qd, qx;
        if (!mx_activation(c, kind, &qd, &c->mx_a, &c->cap_mx_a, dy, R, N, 1, R, c->sr_on, sr_id + 1,
                           "matmul_backward (mx) dy^T") ||
            !mx_activation(c, kind, &qx, &c->mx_b, &c->cap_mx_b, x, C, N, 1, C, 0, 0, "matmul_backward (mx) x^T"))
            return;
        mx_product(c, &qd, &qx, dW, NULL, NULL, 1, "matmul_backward (mx) dW");
    }
}

/* ops.h's products' arguments: n in range (a pair is one) and the composition's scratch; else
 * poisoned, false. */
static bool products_args_ok(cuda_ctx *c, const kiln_products *p) {
    if (p && p->n >= 1 && p->n <= KILN_MATMUL_MULTI_MAX && (!p->up || p->n == 1) && (!p->norm_w || p->scratch_x) &&
        (!p->up || (p->scratch_gate && p->scratch_up)))
        return true;
    poison(c, KILN_ERR_INVALID_ARG, "products: %d products (1..%d; a pair is one), scratch for the composition",
           p ? p->n : 0, KILN_MATMUL_MULTI_MAX);
    return false;
}

/* ops.h's products in the format: the composition's bits (rmsnorm, the products, swiglu, add),
 * with x normed and quantized once for all the call's products (kiln_cuda_mx_quantize_norm: no
 * normed copy), each bias and residual added in its product's epilogue (a residual that is
 * the output itself is added after, as the composition does). */
static void products_mx(kiln_backend *be, int kind, const float *x, const kiln_products *p, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int n = p->n;
    const int64_t C = p->W[0]->shape[p->W[0]->n_dims - 1];
    const kiln_tensor *Ws[2] = {p->W[0], p->up};
    const int n_w = p->up ? 2 : n;
    if (n < 1 || n > KILN_MATMUL_MULTI_MAX || (p->up && n != 1)) {
        poison(c, KILN_ERR_INVALID_ARG, "products (mx%d): %d products%s", kind, n, p->up ? " with a pair" : "");
        return;
    }
    if (C > KILN_MX_MAX_K) {
        poison(c, KILN_ERR_UNSUPPORTED, "products (mx%d): the reduction (%lld) is longer than the format's limit "
               "(262,144)", kind, (long long)C);
        return;
    }
    const kiln_cuda_mx *wm[KILN_MATMUL_MULTI_MAX];
    for (int i = 0; i < n_w; i++) {
        const kiln_tensor *W = p->up ? Ws[i] : p->W[i];
        const int64_t Ci = W->shape[W->n_dims - 1], R = Ci > 0 ? kiln_tensor_nelements(W) / Ci : 0;
        if (Ci != C || !kiln_cuda_dtype_supported(W->dtype)) {
            poison(c, KILN_ERR_UNSUPPORTED, "products (mx%d): weight '%s' (%s, width %lld, the input's %lld)", kind,
                   W->name ? W->name : "?", kiln_dtype_name(W->dtype), (long long)Ci, (long long)C);
            return;
        }
        const size_t rb = row_bytes_of(W->dtype, C);
        const uint8_t *w = weight_dev(c, W->data, (size_t)R * rb, W->name);
        if (!w || !(wm[i] = mx_weight_of(c, kind, W, w, rb, R, C, 0))) return;
    }
    kiln_cuda_mx xm;
    if (!mx_reserve(c, &c->mx_a, &c->cap_mx_a, kiln_cuda_mx_bytes(kind, N, C), false, "products (mx)")) return;
    kiln_cuda_mx_view(&xm, c->mx_a, kind, N, C);
    after_launch(c, p->norm_w ? kiln_cuda_mx_quantize_norm(c->stream, &xm, x, p->norm_w, p->eps)
                              : kiln_cuda_mx_quantize(c->stream, &xm, x, C, 1, 0, 0, 0),
                 "products (mx): the input");
    if (c->err != KILN_OK) return;
    if (p->up) {
        const float *bg = p->bias ? p->bias[0] : NULL, *bu = p->bias ? p->bias[1] : NULL;
        mx_product(c, &xm, wm[0], p->scratch_gate, bg, NULL, 0, "products (mx): gate");
        mx_product(c, &xm, wm[1], p->scratch_up, bu, NULL, 0, "products (mx): up");
        const size_t len = (size_t)N * (size_t)wm[0]->rows;
        after_launch(c, kiln_cuda_swiglu(c->stream, p->out[0], p->scratch_gate, p->scratch_up, len), "products (mx): swiglu");
        if (p->res && p->res[0]) after_launch(c, kiln_cuda_add(c->stream, p->out[0], p->res[0], len), "products (mx): add");
        return;
    }
    for (int i = 0; i < n; i++) {
        const float *res = p->res ? p->res[i] : NULL;
        mx_product(c, &xm, wm[i], p->out[i], p->bias ? p->bias[i] : NULL, res == p->out[i] ? NULL : res, 0,
                   "products (mx)");
        if (res && res == p->out[i])
            after_launch(c, kiln_cuda_add(c->stream, p->out[i], res, (size_t)N * (size_t)wm[i]->rows), "products (mx): add");
    }
}

static void cu_products_mx(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    products_mx(be, ctx_of(be)->mx, x, p, N);
}

static void cu_products(kiln_backend *be, const float *x, const kiln_products *p, int N);
static void compose_products(kiln_backend *be, const float *x, const kiln_products *p, int N);

/* ops.h's products with formats per weight: a call whose weights share one format takes that
 * format's products (the auditable ones for f32); one that mixes formats is composed
 * (rmsnorm into scratch_x, then each product in its weight's format): the composition's bits
 * either way. */
static void cu_products_formats(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (!products_args_ok(c, p)) return;
    const int kind = kind_of(c, p->W[0]);
    bool one = !p->up || kind_of(c, p->up) == kind;
    for (int i = 1; one && i < p->n; i++) one = kind_of(c, p->W[i]) == kind;
    if (!one) compose_products(be, x, p, N);
    else if (kind) products_mx(be, kind, x, p, N);
    else cu_products(be, x, p, N);
}

/* ops.h grad_rounding: the key of kiln_mx_backward_key; the backward's products counted from 0. */
static void cu_grad_rounding(kiln_backend *be, int stochastic, uint64_t seed, uint64_t step, uint64_t micro) {
    cuda_ctx *c = ctx_of(be);
    c->sr_on = stochastic && (c->mx || c->wf.n);
    c->sr_key = kiln_mx_backward_key(seed, step, micro);
    c->sr_count = 0;
}

/* Drop the quantized weights keyed in [lo, hi) (forget), after the work that may read them. */
static void mx_forget(cuda_ctx *c, const uint8_t *lo, const uint8_t *hi) {
    size_t kept = 0;
    bool synced = false;
    for (size_t i = 0; i < c->n_mx_w; i++) {
        mx_weight *e = &c->mx_w[i];
        if (e->key < hi && lo < e->key + e->nbytes) {
            if (!synced) {
                (void)cudaStreamSynchronize(c->stream);
                synced = true;
                c->gen++; /* a graph may hold the old copy's address */
            }
            kiln_cuda_mx_free(&e->m);
            continue;
        }
        c->mx_w[kept++] = *e;
    }
    c->n_mx_w = kept;
}

extern "C" int kiln_cuda_weight_format(kiln_backend *be, const void *data) {
    const cuda_ctx *c = ctx_of(be);
    return kiln_weight_formats_kind(&c->wf, data, c->mx);
}

/* Whether fast mode's decode products of Q8_0 / Q4_0 / Q4_1 weights take the int8-activation
 * product (kiln_cuda_q8act_multi_norm: the CPU fast mode's bits, batch-invariant) instead of
 * the f32 kernels: only with KILN_CUDA_Q8ACT=1, read once per process. Not the default: it is
 * slower today (bench/RESULTS.md, 2026-12-06: 0.97x of the f32 kernels' decode on a Q8_0
 * 0.5B shape, 0.86x on the 3B shape's gate product). */
static bool q8act_for(kiln_dtype dt) {
    static const bool on = [] {
        const char *v = getenv("KILN_CUDA_Q8ACT");
        return v && strcmp(v, "1") == 0;
    }();
    return on && kiln_cuda_q8act_supported(dt);
}

/* Whether fast mode's decode products of Q4_K / Q5_K / Q6_K / Q5_0 weights and N tokens take
 * the K-quant int8-activation product (kiln_cuda_kq_multi_norm) instead of the f32 kernel,
 * which dequantizes every weight: for N up to KQ_MAX_N (KILN_CUDA_KQ_MAX_N overrides it, 0
 * turns it off; KILN_CUDA_KQ=0 too; read once). Its per-token work (each token's activation
 * blocks, scales and sums from shared memory for every 32 weights) grows with N: on an H100 a
 * call of 8 tokens took 3.5x the time of one (bench/RESULTS.md, 2026-12-07), so batched decode
 * keeps the f32 kernel until the two are measured side by side at N > 1. */
#define KQ_MAX_N 1
static bool kq_for(kiln_dtype dt, int N) {
    static const int max_n = [] {
        if (kiln_env_off("KILN_CUDA_KQ")) return 0;
        const char *v = getenv("KILN_CUDA_KQ_MAX_N");
        return v && *v ? atoi(v) : KQ_MAX_N;
    }();
    return N <= max_n && kiln_cuda_kq_supported(dt);
}

/* Whether fast mode's decode products of bf16 weights and 2..8 tokens take the tensor cores
 * (kiln_cuda_matvec_mma_multi_norm) instead of the f32 kernel, whose one FMA per weight and
 * token bounds a batch of 8 by the FMA rate: on unless KILN_CUDA_MMV=0 (read once). */
static bool mmv_for(kiln_dtype dt, int N) {
    static const bool on = !kiln_env_off("KILN_CUDA_MMV");
    return on && dt == KILN_DTYPE_BF16 && N >= 2;
}

/* The batch-invariant fast mode's products of any N (kernels whose outputs for a token are the
 * same bits whatever the other tokens): bf16 weights on the tensor cores
 * (kiln_cuda_matvec_mma_multi_norm), Q8_0 / Q4_0 / Q4_1 with 8-bit activations (the CPU fast
 * mode's bits), Q4_K / Q5_K / Q6_K / Q5_0 with 8-bit activations (kiln_cuda_kq_multi_norm, fast
 * decode's own), other dtypes -- or what those do not take -- the auditable f32 kernel. */
static cudaError_t invariant_products(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                      kiln_dtype dt, const float *x, const float *norm_w, float eps,
                                      int64_t C, int N) {
    cudaError_t e = cudaErrorNotSupported;
    if (dt == KILN_DTYPE_BF16) e = kiln_cuda_matvec_mma_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    else if (kiln_cuda_q8act_supported(dt)) e = kiln_cuda_q8act_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    else if (kiln_cuda_kq_supported(dt)) e = kiln_cuda_kq_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    if (e == cudaErrorNotSupported) e = kiln_cuda_matmul_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    return e;
}

/* Fast mode's products of N <= 8 tokens (kiln_cuda_matvec_fast_multi_norm's jobs): the
 * int8-activation product when asked for (q8act_for), the K-quant one (kq_for), the
 * tensor-core kernel for bf16 batches (mmv_for), else -- or where those do not take the call -- the f32 kernel. Its
 * cudaErrorNotSupported (a pair off the aligned path) is the caller's. */
static cudaError_t fast_products(cudaStream_t s, int n, const kiln_cuda_product_job *jobs,
                                 kiln_dtype dt, const float *x, const float *norm_w, float eps,
                                 int64_t C, int N) {
    cudaError_t e = cudaErrorNotSupported;
    if (N > 8) return e;
    if (q8act_for(dt)) e = kiln_cuda_q8act_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    else if (kq_for(dt, N)) e = kiln_cuda_kq_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    else if (mmv_for(dt, N)) e = kiln_cuda_matvec_mma_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    if (e == cudaErrorNotSupported) e = kiln_cuda_matvec_fast_multi_norm(s, n, jobs, dt, x, norm_w, eps, C, N);
    return e;
}

static void cu_matmul(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                      const float *bias, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (!kiln_cuda_dtype_supported(W->dtype)) {
        poison(c, KILN_ERR_UNSUPPORTED, "matmul: weight '%s': dtype %s",
               W->name ? W->name : "?", kiln_dtype_name(W->dtype));
        return;
    }
    int64_t C = W->shape[W->n_dims - 1];
    int64_t R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    size_t rb = row_bytes_of(W->dtype, C);
    const uint8_t *w = weight_dev(c, W->data, (size_t)R * rb, W->name);
    if (!w) return;
    const int kind = kind_of(c, W);
    if (kind) {
        cu_matmul_mx(c, kind, out, x, W, w, rb, R, C, bias, N);
    } else if (!c->fast) {
        after_launch(c, kiln_cuda_matmul(c->stream, out, x, w, rb, W->dtype, R, C, bias, N),
                     "matmul");
    } else if (N <= 8 || c->invariant) {
        /* decode: fixed-order kernels straight on the weights (fast_products); the
         * batch-invariant mode's kernels at any N */
        const kiln_cuda_product_job job = {out, NULL, w, NULL, bias, NULL, rb, R};
        after_launch(c,
                     c->invariant ? invariant_products(c->stream, 1, &job, W->dtype, x, NULL, 0.0f, C, N)
                                  : fast_products(c->stream, 1, &job, W->dtype, x, NULL, 0.0f, C, N),
                     "matmul (fast matvec)");
    } else {
        /* prefill: bf16 tensor cores through cuBLASLt, one fixed algorithm per shape */
        if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return;
        cudaError_t e = kiln_cuda_gemm_linear(c->gemm, c->stream, out, x, w, rb, W->dtype, R, C,
                                              bias, N, 0);
        if (e != cudaSuccess)
            poison(c, KILN_ERR_INTERNAL, "matmul (fast gemm) '%s' %lld x %lld, %d tokens: %s (%s)",
                   W->name ? W->name : "?", (long long)R, (long long)C, N,
                   kiln_cuda_gemm_error(c->gemm), cudaGetErrorName(e));
    }
}

/* cuda_train.h kiln_cuda_matmul_f32: the auditable f32 product whatever the mode or W's
 * entry in the per-weight table (the fused loss's products on its f32 scratch copies). */
extern "C" void kiln_cuda_matmul_f32(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                                     const float *bias, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (W->dtype != KILN_DTYPE_F32) {
        poison(c, KILN_ERR_INVALID_ARG, "matmul (f32) '%s': dtype %s, not f32", W->name ? W->name : "?",
               kiln_dtype_name(W->dtype));
        return;
    }
    const int64_t C = W->shape[W->n_dims - 1], R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    const size_t rb = row_bytes_of(W->dtype, C);
    const uint8_t *w = weight_dev(c, W->data, (size_t)R * rb, W->name);
    if (w) after_launch(c, kiln_cuda_matmul(c->stream, out, x, w, rb, W->dtype, R, C, bias, N), "matmul (f32)");
}

/* ops.h's matmul_multi: fast mode with N > 8 rounds x to bf16 once for all n products
 * (kiln_cuda_gemm_linear_multi: the bits of n separate calls); otherwise n cu_matmul calls. */
/* The checks the multi-product entries share (op names the entry in messages). n outside
 * 1..max: poisoned, -1. Otherwise 1 when one fast call takes all n products (fast_ok, every
 * W of one width *C and a dtype dtype_ok accepts), else 0 (separate calls) -- or, with x16
 * (the input only in bf16, which separate calls cannot take), poisoned, -1. */
static int multi_plan(cuda_ctx *c, const char *op, int n, int max, const kiln_tensor *const *W,
                      bool fast_ok, bool (*dtype_ok)(kiln_dtype), bool x16, int64_t *C) {
    if (n < 1 || n > max) {
        poison(c, KILN_ERR_INVALID_ARG, "%s: %d products (1..%d)", op, n, KILN_MATMUL_MULTI_MAX);
        return -1;
    }
    bool one_call = c->fast && !c->invariant && fast_ok;
    *C = W[0]->shape[W[0]->n_dims - 1];
    for (int i = 0; i < n; i++)
        one_call = one_call && dtype_ok(W[i]->dtype) && W[i]->shape[W[i]->n_dims - 1] == *C;
    if (!one_call && x16) {
        poison(c, KILN_ERR_UNSUPPORTED, "%s_bf16x: '%s': needs fast mode and weights of one "
               "width and a supported dtype", op, W[0]->name ? W[0]->name : "?");
        return -1;
    }
    return one_call ? 1 : 0;
}

/* The n products of x as one launch: kiln_cuda_q8act_multi_norm (fast, N <= 8, Q8_0 / Q4_0 /
 * Q4_1 with KILN_CUDA_Q8ACT=1), kiln_cuda_matvec_fast_multi (fast, N <= 8) or
 * kiln_cuda_matmul_multi (auditable), with residuals res[i] (NULL: none) or, with up (n =
 * 1), as a SwiGLU pair (W[0] the gate, up the up weights, bias[1] the up's bias), on x normed
 * first (rmsnorm's bits) when norm_w is set (the _norm launchers). true when
 * launched (or poisoned: check c->err); false, with nothing enqueued, when one launch cannot
 * take them (fast past 8 tokens, dtypes or widths that differ, an unsupported dtype, a fast
 * pair off the aligned path): the caller runs them separately. */
static bool product_jobs(cuda_ctx *c, int n, float *const *out, const float *const *res,
                         const float *x, const kiln_tensor *const *W, const float *const *bias,
                         const kiln_tensor *up, const float *norm_w, float eps, int N) {
    if (n < 1 || n > KILN_CUDA_PRODUCT_MAX_JOBS || (up && n != 1) || !x ||
        (c->fast && !c->invariant && N > 8))
        return false;
    const kiln_dtype dt = W[0]->dtype;
    const int64_t C = W[0]->shape[W[0]->n_dims - 1];
    if (!kiln_cuda_dtype_supported(dt) || C < 1) return false;
    for (int i = 0; i < n; i++)
        if (W[i]->dtype != dt || W[i]->shape[W[i]->n_dims - 1] != C) return false;
    if (up && (up->dtype != dt || up->shape[up->n_dims - 1] != C ||
               kiln_tensor_nelements(up) != kiln_tensor_nelements(W[0])))
        return false;
    kiln_cuda_product_job jobs[KILN_CUDA_PRODUCT_MAX_JOBS];
    const size_t rb = row_bytes_of(dt, C);
    for (int i = 0; i < n; i++) {
        const int64_t R = kiln_tensor_nelements(W[i]) / C;
        const uint8_t *w = weight_dev(c, W[i]->data, (size_t)R * rb, W[i]->name);
        const uint8_t *wu = up ? weight_dev(c, up->data, (size_t)R * rb, up->name) : NULL;
        if (!w || (up && !wu)) return true; /* poisoned */
        jobs[i] = (kiln_cuda_product_job){out[i], res ? res[i] : NULL, w, wu, bias ? bias[i] : NULL,
                                          up && bias ? bias[1] : NULL, rb, R};
    }
    if (norm_w && C > INT_MAX) return false;
    cudaError_t e = !c->fast     ? kiln_cuda_matmul_multi_norm(c->stream, n, jobs, dt, x, norm_w, eps, C, N)
                    : c->invariant ? invariant_products(c->stream, n, jobs, dt, x, norm_w, eps, C, N)
                                   : fast_products(c->stream, n, jobs, dt, x, norm_w, eps, C, N);
    if (e == cudaErrorNotSupported) return false;
    after_launch(c, e,
                 up ? "matmul_swiglu"
                 : c->fast ? "matmul (fast matvec)" : "matmul");
    return true;
}

/* ops.h's matmul_multi (x f32) and matmul_multi_bf16x (x16 bf16, x NULL: fast mode only, always
 * one GEMM call; out16 / add as ops.h says, NULL with x). */
static void matmul_multi(kiln_backend *be, int n, float *const *out, uint16_t *const *out16,
                         const float *const *add, const float *x, const uint16_t *x16,
                         const kiln_tensor *const *W, const float *const *bias, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int max = KILN_MATMUL_MULTI_MAX < KILN_GEMM_MULTI_MAX ? KILN_MATMUL_MULTI_MAX
                                                                : KILN_GEMM_MULTI_MAX;
    int64_t C = 0;
    const int plan = multi_plan(c, "matmul_multi", n, max, W, N > 8 || x16,
                                kiln_cuda_dtype_supported, x16 != NULL, &C);
    if (plan < 0) return;
    if (plan == 0 && product_jobs(c, n, out, NULL, x, W, bias, NULL, NULL, 0.0f, N))
        return; /* the products in one launch (their bits alone), or poisoned */
    if (c->err != KILN_OK) return;
    if (plan == 0) {
        for (int i = 0; i < n; i++) cu_matmul(be, out[i], x, W[i], bias ? bias[i] : NULL, N);
        return;
    }
    const uint8_t *w[KILN_GEMM_MULTI_MAX];
    size_t rb[KILN_GEMM_MULTI_MAX];
    kiln_dtype dt[KILN_GEMM_MULTI_MAX];
    int64_t R[KILN_GEMM_MULTI_MAX];
    for (int i = 0; i < n; i++) {
        R[i] = C > 0 ? kiln_tensor_nelements(W[i]) / C : 0;
        rb[i] = row_bytes_of(W[i]->dtype, C);
        dt[i] = W[i]->dtype;
        if (!(w[i] = weight_dev(c, W[i]->data, (size_t)R[i] * rb[i], W[i]->name))) return;
    }
    if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return;
    cudaError_t e =
        x16 ? kiln_cuda_gemm_linear_multi_bf16(c->gemm, c->stream, n, out, out16, add, x16, C, w,
                                               rb, dt, R, C, bias, N)
            : kiln_cuda_gemm_linear_multi(c->gemm, c->stream, n, out, x, w, rb, dt, R, C, bias, N);
    if (e != cudaSuccess)
        poison(c, KILN_ERR_INTERNAL,
               "matmul_multi (fast gemm) '%s' and %d more, %d tokens: %s (%s)",
               W[0]->name ? W[0]->name : "?", n - 1, N, kiln_cuda_gemm_error(c->gemm),
               cudaGetErrorName(e));
}

static void cu_matmul_multi(kiln_backend *be, int n, float *const *out, const float *x,
                            const kiln_tensor *const *W, const float *const *bias, int N) {
    matmul_multi(be, n, out, NULL, NULL, x, NULL, W, bias, N);
}

static void cu_matmul_multi_bf16x(kiln_backend *be, int n, float *const *out,
                                  uint16_t *const *out16, const float *const *add,
                                  const uint16_t *x16, const kiln_tensor *const *W,
                                  const float *const *bias, int N) {
    matmul_multi(be, n, out, out16, add, NULL, x16, W, bias, N);
}

static void cu_swiglu(kiln_backend *be, float *out, const float *gate, const float *up, size_t n);
static void cu_add(kiln_backend *be, float *x, const float *y, size_t n);

/* The n products of one input in the composition: one matmul_multi, or with formats (mx modes,
 * formats per weight) one matmul each, so that each takes its own weight's format
 * (matmul_multi's single launch is the auditable f32 kernel's whatever the formats). */
static void compose_matmuls(kiln_backend *be, int n, float *const *out, const float *x,
                            const kiln_tensor *const *W, const float *const *bias, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!c->mx && !c->wf.n) {
        matmul_multi(be, n, out, NULL, NULL, x, NULL, W, bias, N);
        return;
    }
    for (int i = 0; i < n && c->err == KILN_OK; i++) cu_matmul(be, out[i], x, W[i], bias ? bias[i] : NULL, N);
}

/* kiln_op_products' composition of p on the backend, op by op: rmsnorm into scratch_x, the
 * products (a pair: gate and up, then SwiGLU), the residual adds. */
static void compose_products(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    cuda_ctx *c = ctx_of(be);
    const int64_t C = p->W[0]->shape[p->W[0]->n_dims - 1];
    const float *xn = x;
    if (p->norm_w) {
        cu_rmsnorm(be, p->scratch_x, x, p->norm_w, N, (int)C, p->eps);
        xn = p->scratch_x;
    }
    if (p->up) {
        float *gu[2] = {p->scratch_gate, p->scratch_up};
        const kiln_tensor *w[2] = {p->W[0], p->up};
        const float *b[2] = {p->bias ? p->bias[0] : NULL, p->bias ? p->bias[1] : NULL};
        compose_matmuls(be, 2, gu, xn, w, b, N);
        if (c->err == KILN_OK)
            cu_swiglu(be, p->out[0], gu[0], gu[1], (size_t)N * (size_t)(kiln_tensor_nelements(p->W[0]) / C));
    } else {
        compose_matmuls(be, p->n, p->out, xn, p->W, p->bias, N);
    }
    for (int i = 0; c->err == KILN_OK && p->res && i < p->n; i++)
        if (p->res[i]) cu_add(be, p->out[i], p->res[i], (size_t)N * (size_t)(kiln_tensor_nelements(p->W[i]) / C));
}

/* Products of one input whose weights differ in dtype -- a Q4_K_M layer's q and k are Q4_K
 * and, in a third of the layers, its v Q6_K; rows not a multiple of 256 fall back to Q5_0 /
 * Q8_0 the same way -- as one launch per dtype (in the order of each dtype's first product),
 * each with the norm in its prologue: the composition's bits (the prologue is rmsnorm's),
 * without its standalone rmsnorm launch and its trip through scratch_x. A group that one
 * launch does not take is composed alone. false, with nothing enqueued, when p is not such a
 * call (a pair, one product, one dtype, widths that differ, fast mode past 8 tokens). */
static bool products_by_dtype(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    cuda_ctx *c = ctx_of(be);
    if (p->up || p->n < 2 || (c->fast && !c->invariant && N > 8)) return false;
    const int64_t C = p->W[0]->shape[p->W[0]->n_dims - 1];
    bool mixed = false;
    for (int i = 0; i < p->n; i++) {
        if (!kiln_cuda_dtype_supported(p->W[i]->dtype) || p->W[i]->shape[p->W[i]->n_dims - 1] != C)
            return false;
        mixed = mixed || p->W[i]->dtype != p->W[0]->dtype;
    }
    if (!mixed) return false;
    bool done[KILN_MATMUL_MULTI_MAX] = {false};
    for (int i = 0; i < p->n && c->err == KILN_OK; i++) {
        if (done[i]) continue;
        float *out[KILN_MATMUL_MULTI_MAX];
        const float *res[KILN_MATMUL_MULTI_MAX], *bias[KILN_MATMUL_MULTI_MAX];
        const kiln_tensor *W[KILN_MATMUL_MULTI_MAX];
        int m = 0;
        for (int j = i; j < p->n; j++) {
            if (done[j] || p->W[j]->dtype != p->W[i]->dtype) continue;
            out[m] = p->out[j];
            res[m] = p->res ? p->res[j] : NULL;
            bias[m] = p->bias ? p->bias[j] : NULL;
            W[m++] = p->W[j];
            done[j] = true;
        }
        if (product_jobs(c, m, out, res, x, W, bias, NULL, p->norm_w, p->eps, N) || c->err != KILN_OK)
            continue;
        kiln_products g = *p;
        g.n = m;
        g.out = out;
        g.res = res;
        g.bias = bias;
        g.W = W;
        compose_products(be, x, &g, N);
    }
    return true;
}

/* ops.h's products: one launch (kiln_cuda_product_job, the norm in its prologue) in auditable
 * mode and in fast decode (N <= 8), one a dtype when the weights' dtypes differ; otherwise
 * (fast past 8 tokens: the GEMMs; a fast pair off the aligned path) kiln_op_products'
 * composition, op by op. */
static void cu_products(kiln_backend *be, const float *x, const kiln_products *p, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (!products_args_ok(c, p)) return;
    if (product_jobs(c, p->n, p->out, p->res, x, p->W, p->bias, p->up, p->norm_w, p->eps, N) ||
        c->err != KILN_OK || products_by_dtype(be, x, p, N))
        return;
    compose_products(be, x, p, N);
}

/* ops.h's rope_kv_store: one launch (cuda_rope.h). */
static void cu_rope_kv_store(kiln_backend *be, float *q, float *k, const float *v, const int32_t *pos,
                             int N, int NH, int KVH, int HS, const float *cos_tab,
                             const float *sin_tab, float *k_pool, float *v_pool,
                             const int32_t *slots) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int32_t *d_pos = ints_dev(c, pos, (size_t)N);
    if (!d_pos) return;
    after_launch(c,
                 kiln_cuda_rope_kv_store(c->stream, q, k, v, d_pos, N, NH, KVH, HS, cos_tab, sin_tab,
                                         k_pool, v_pool, slots),
                 "rope_kv_store");
}

static void cu_rope(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                    const float *cos_tab, const float *sin_tab) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int32_t *d_pos = ints_dev(c, pos, (size_t)N);
    if (!d_pos) return;
    after_launch(c, kiln_cuda_rope(c->stream, x, d_pos, N, H, HS, cos_tab, sin_tab), "rope");
}

/* Whether a sliding window cuts some query's keys (ops.h attention): the fast kernels know no
 * window, so such a call runs the auditable kernels in either mode (its backward too). */
static bool window_cuts(int window, int N, int n_past) {
    return window > 0 && (int64_t)n_past + N > window;
}

static void cu_attention(kiln_backend *be, float *out, const float *q, const float *k,
                         const float *v, int N, int n_past, int NH, int KVH, int HS,
                         float scale, int window) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    if (HS > KILN_CUDA_MAX_HS) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention: head size %d > %d", HS, KILN_CUDA_MAX_HS);
        return;
    }
    if (!c->fast || c->invariant || window_cuts(window, N, n_past)) {
        after_launch(c,
                     kiln_cuda_attention(c->stream, out, q, k, v, N, n_past, NH, KVH, HS, scale,
                                         window),
                     "attention");
        return;
    }
    if (HS > KILN_ATTN_FAST_MAX_HS) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention (fast): head size %d > %d", HS,
               KILN_ATTN_FAST_MAX_HS);
        return;
    }
    if (!c->attn && !CK(c, kiln_cuda_attn_create(&c->attn))) return;
    after_launch(c,
                 kiln_cuda_attention_fast(c->attn, c->stream, out, q, k, v, N, n_past, NH, KVH,
                                          HS, scale),
                 "attention (fast)");
}

static void cu_swiglu(kiln_backend *be, float *out, const float *gate, const float *up,
                      size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_swiglu(c->stream, out, gate, up, n), "swiglu");
}

static void cu_rmsnorm_bf16(kiln_backend *be, uint16_t *out, const float *x, const float *w,
                            int N, int C, float eps) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    /* fast mode: the fast rows' order (cuda_norm.h); auditable: rmsnorm's bits */
    after_launch(c,
                 c->fast ? kiln_cuda_rmsnorm_fast_bf16(c->stream, out, x, w, N, C, eps)
                         : kiln_cuda_rmsnorm_bf16(c->stream, out, x, w, N, C, eps),
                 "rmsnorm_bf16");
}

static void cu_swiglu_bf16(kiln_backend *be, uint16_t *out, const uint16_t *gate,
                           const uint16_t *up, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_swiglu_bf16(c->stream, out, gate, up, n, c->fast), "swiglu_bf16");
}

/* ops.h geglu: kiln_geglu per element, the CPU's bits in both modes (out may alias gate). */
static void cu_geglu(kiln_backend *be, float *out, const float *gate, const float *up, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_geglu(c->stream, out, gate, up, n), "geglu");
}

/* ops.h geglu_backward: kiln_geglu_backward per element, the CPU's bits in both modes. */
static void cu_geglu_backward(kiln_backend *be, float *dgate, float *dup, const float *dout,
                              const float *gate, const float *up, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_geglu_backward(c->stream, dgate, dup, dout, gate, up, n),
                 "geglu_backward");
}

static void cu_add(kiln_backend *be, float *x, const float *y, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_add(c->stream, x, y, n), "add");
}

static void cu_zero(kiln_backend *be, float *x, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || n == 0) return;
    CK(c, cudaMemsetAsync(x, 0, n * sizeof(float), c->stream));
}

static kiln_status cu_copy_d2d(kiln_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    if (nbytes && !CK(c, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, c->stream))) return c->err;
    return KILN_OK;
}

static void cu_bf16_words(kiln_backend *be, uint32_t *words, uint16_t *h, size_t n, int to_words) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_bf16_words(c->stream, words, h, n, to_words != 0), "bf16_words");
}

static void *cu_native_stream(kiln_backend *be) { return (void *)ctx_of(be)->stream; }

static void cu_scale(kiln_backend *be, float *x, float s, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_scale(c->stream, x, s, n), "scale");
}

/* ---- sampling ------------------------------------------------------------------------------ */

static kiln_status cu_sample(kiln_backend *be, const float *logits, int V,
                             const kiln_sampler_params *p, kiln_sample_rng *rng,
                             const int32_t *hist, size_t n_hist, int32_t *id) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    /* the penalty window: the last repeat_last_n ids (all with -1); none when it is off */
    size_t w = p->repeat_penalty == 1.0f ? 0 : n_hist;
    if (p->repeat_last_n >= 0 && w > (size_t)p->repeat_last_n) w = (size_t)p->repeat_last_n;
    if (!c->sampler || c->sampler_V < V) {
        kiln_cuda_sampler_free(c->sampler);
        c->sampler = NULL;
        if (!CK(c, kiln_cuda_sampler_create(V, &c->sampler))) return c->err;
        c->sampler_V = V;
    }
    if (!c->h_token && !CK(c, cudaMallocHost((void **)&c->h_token, sizeof(int32_t)))) return c->err;
    if (w + 1 > c->cap_hist) {
        size_t cap = w + 1 < 4096 ? 4096 : w + 1;
        if (c->hist && !CK(c, cudaFree(c->hist))) return c->err;
        c->hist = NULL;
        c->cap_hist = 0;
        if (!CK(c, cudaMalloc((void **)&c->hist, cap * sizeof(int32_t)))) return c->err;
        c->cap_hist = cap;
    }
    if (w && !CK(c, cudaMemcpyAsync(c->hist + 1, hist + (n_hist - w), w * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, c->stream)))
        return c->err;
    *c->h_token = -1;
    if (!CK(c, kiln_cuda_sample_next(c->sampler, c->stream, p, rng, logits, V, c->hist + 1,
                                     (int)w, c->hist, c->h_token)) ||
        !CK(c, cudaStreamSynchronize(c->stream)))
        return c->err;
    if (*c->h_token < 0 || *c->h_token >= V)
        return kiln_error(KILN_ERR_RANGE, "sampler: the logits hold a NaN (device sampling)");
    *id = *c->h_token;
    return KILN_OK;
}

/* ---- decode graphs ------------------------------------------------------------------------- */

/* Everything a recorded graph may point into that can be reallocated: this context's staging
 * and column-sum buffers and the attention workspace (the GEMM module keeps outgrown scratch
 * until it is freed, so its pointers never dangle). Each count only grows, so does the sum. */
static uint64_t graph_generation(const cuda_ctx *c) {
    return c->gen + kiln_cuda_attn_generation(c->attn);
}

static kiln_status cu_graph_begin(kiln_backend *be, int B, int NH, int HS, int max_T) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    if (c->fast && B > 0) { /* the split-key workspace, sized before recording */
        if (!c->attn && !CK(c, kiln_cuda_attn_create(&c->attn))) return c->err;
        if (!CK(c, kiln_cuda_attn_reserve(c->attn, B, 1, NH, HS, max_T))) return c->err;
    }
    if ((c->mx || c->wf.n) && B > 0) { /* the quantized activations and split sums of a B-token
                                        * step, for the widest and tallest weights quantized so
                                        * far (the step's) */
        size_t xb = 0, ws = 0;
        for (size_t i = 0; i < c->n_mx_w; i++) {
            const mx_weight *e = &c->mx_w[i];
            if (e->transposed) continue;
            const size_t a = kiln_cuda_mx_bytes(e->m.kind, B, e->C);
            xb = a > xb ? a : xb;
            const size_t b = kiln_cuda_mx_matmul_ws_bytes(B, e->R, e->m.nb);
            ws = b > ws ? b : ws;
        }
        if (!mx_reserve(c, &c->mx_a, &c->cap_mx_a, xb, false, "graph_begin") ||
            !mx_reserve(c, &c->mx_ws, &c->cap_mx_ws, ws, true, "graph_begin"))
            return c->err;
    }
    if (!CK(c, cudaStreamSynchronize(c->stream)) ||
        !CK(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal)))
        return c->err;
    return KILN_OK;
}

static kiln_status cu_graph_end(kiln_backend *be, void **graph) {
    cuda_ctx *c = ctx_of(be);
    *graph = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g); /* always end a capture begun */
    if (c->err != KILN_OK) { /* an op failed while recording */
        if (g) cudaGraphDestroy(g);
        return kiln_error(c->err, "%s", c->msg);
    }
    if (!check(c, e, "cudaStreamEndCapture")) return c->err;
    cu_graph *r = (cu_graph *)kiln_calloc(1, sizeof *r);
    if (!r) {
        cudaGraphDestroy(g);
        return kiln_error(KILN_ERR_NOMEM, "cuda backend: out of host memory for a graph");
    }
    e = cudaGraphInstantiate(&r->exec, g, 0);
    cudaGraphDestroy(g);
    if (!check(c, e, "cudaGraphInstantiate")) {
        kiln_free(r);
        return c->err;
    }
    r->gen = graph_generation(c);
    *graph = (void *)r;
    return KILN_OK;
}

static kiln_status cu_graph_launch(kiln_backend *be, void *graph) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    const cu_graph *r = (const cu_graph *)graph;
    if (r->gen != graph_generation(c)) /* not an error of the backend: record it again */
        return kiln_error(KILN_ERR_STATE,
                          "cuda backend: the graph is stale (a workspace it uses was "
                          "reallocated since it was recorded): record it again");
    if (!CK(c, cudaGraphLaunch(r->exec, c->stream))) return c->err;
    return KILN_OK;
}

static void cu_graph_free(kiln_backend *be, void *graph) {
    cuda_ctx *c = ctx_of(be);
    if (!graph) return;
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    cudaGraphExecDestroy(((cu_graph *)graph)->exec);
    kiln_free(graph);
}

/* ---- backward ops (auditable: the CPU's bits) ------------------------------------------- */

static void cu_matmul_backward(kiln_backend *be, float *dx, float *dW, float *dbias,
                               const float *dy, const float *x, const kiln_tensor *W, int N,
                               bool accumulate_dx) {
    cuda_ctx *c = ctx_of(be);
    const int kind = kind_of(c, W);
    const uint64_t sr_id = kind ? 2 * c->sr_count++ : 0; /* counted as the CPU counts, calls that do nothing too */
    if (!op_begin(c) || N <= 0) return;
    if (!kiln_cuda_backward_dtype_supported(W->dtype)) {
        poison(c, KILN_ERR_UNSUPPORTED, "matmul_backward: weight '%s': dtype %s",
               W->name ? W->name : "?", kiln_dtype_name(W->dtype));
        return;
    }
    int64_t C = W->shape[W->n_dims - 1];
    int64_t R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    size_t rb = row_bytes_of(W->dtype, C);
    const uint8_t *w = weight_dev(c, W->data, (size_t)R * rb, W->name);
    if (!w) return;
    if (kind) {
        if (R > 0) cu_matmul_backward_mx(c, kind, sr_id, dx, dW, dbias, dy, x, W, w, rb, R, C, N, accumulate_dx);
        return;
    }
    if (c->fast) { /* dx, dW on bf16 tensor cores, dbias the fast column sum (backward_fast.h) */
        if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return;
        cudaError_t e = kiln_cuda_matmul_backward_fast(c->gemm, c->stream, dx, dW, dbias, dy, x, w,
                                                       rb, W->dtype, R, C, N, accumulate_dx);
        if (e != cudaSuccess)
            poison(c, KILN_ERR_INTERNAL, "matmul_backward (fast) '%s' %lld x %lld, %d tokens: %s (%s)",
                   W->name ? W->name : "?", (long long)R, (long long)C, N,
                   kiln_cuda_gemm_error(c->gemm), cudaGetErrorName(e));
        return;
    }
    after_launch(c, kiln_cuda_matmul_backward(c->stream, dx, dW, dbias, dy, x, w, rb, W->dtype,
                                              R, C, N, accumulate_dx),
                 "matmul_backward");
}

/* ops.h's matmul_backward_multi: fast mode rounds x to bf16 once for all n products
 * (kiln_cuda_matmul_backward_fast_multi: the bits of n separate calls); auditable mode is n
 * cu_matmul_backward calls. */
static void matmul_backward_multi(kiln_backend *be, int n, float *dx, float *const *dW,
                                  float *const *dbias, const float *const *dy,
                                  const uint16_t *const *dy16, const float *x,
                                  const uint16_t *x16, const kiln_tensor *const *W, int N,
                                  bool accumulate_dx) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int max = KILN_MATMUL_MULTI_MAX < KILN_CUDA_MB_MAX ? KILN_MATMUL_MULTI_MAX
                                                             : KILN_CUDA_MB_MAX;
    int64_t C = 0;
    const int plan = multi_plan(c, "matmul_backward_multi", n, max, W, true,
                                kiln_cuda_backward_dtype_supported, x16 != NULL, &C);
    if (plan < 0) return;
    if (plan == 0) {
        for (int i = 0; i < n; i++)
            cu_matmul_backward(be, dx, dW ? dW[i] : NULL, dbias ? dbias[i] : NULL, dy[i], x, W[i],
                               N, i > 0 || accumulate_dx);
        return;
    }
    kiln_cuda_mb_item it[KILN_CUDA_MB_MAX];
    for (int i = 0; i < n; i++) {
        it[i].R = C > 0 ? kiln_tensor_nelements(W[i]) / C : 0;
        it[i].row_bytes = row_bytes_of(W[i]->dtype, C);
        it[i].dt = W[i]->dtype;
        it[i].dW = dW ? dW[i] : NULL;
        it[i].dbias = dbias ? dbias[i] : NULL;
        it[i].dy = dy ? dy[i] : NULL;
        it[i].dy16 = dy16 ? dy16[i] : NULL;
        if (!(it[i].w = weight_dev(c, W[i]->data, (size_t)it[i].R * it[i].row_bytes, W[i]->name)))
            return;
    }
    if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return;
    cudaError_t e =
        x16 ? kiln_cuda_matmul_backward_fast_multi_bf16(c->gemm, c->stream, n, it, dx, x16, C, C,
                                                        N, accumulate_dx)
            : kiln_cuda_matmul_backward_fast_multi(c->gemm, c->stream, n, it, dx, x, C, N,
                                                   accumulate_dx);
    if (e != cudaSuccess)
        poison(c, KILN_ERR_INTERNAL,
               "matmul_backward_multi (fast) '%s' and %d more, %d tokens: %s (%s)",
               W[0]->name ? W[0]->name : "?", n - 1, N, kiln_cuda_gemm_error(c->gemm),
               cudaGetErrorName(e));
}

static void cu_matmul_backward_multi(kiln_backend *be, int n, float *dx, float *const *dW,
                                     float *const *dbias, const float *const *dy, const float *x,
                                     const kiln_tensor *const *W, int N, bool accumulate_dx) {
    matmul_backward_multi(be, n, dx, dW, dbias, dy, NULL, x, NULL, W, N, accumulate_dx);
}

static void cu_matmul_backward_multi_bf16x(kiln_backend *be, int n, float *dx, float *const *dW,
                                           float *const *dbias, const float *const *dy,
                                           const uint16_t *const *dy16, const uint16_t *x16,
                                           const kiln_tensor *const *W, int N,
                                           bool accumulate_dx) {
    matmul_backward_multi(be, n, dx, dW, dbias, dy, dy16, NULL, x16, W, N, accumulate_dx);
}

static void cu_matmul_backward_dx16(kiln_backend *be, uint16_t *dx16, float *dW,
                                    const uint16_t *dy16, const uint16_t *x16,
                                    const kiln_tensor *W, int N) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    int64_t C = 0;
    if (multi_plan(c, "matmul_backward_dx16", 1, 1, &W, true,
                   kiln_cuda_backward_dtype_supported, true, &C) < 0)
        return;
    kiln_cuda_mb_item it;
    memset(&it, 0, sizeof it);
    it.R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    it.row_bytes = row_bytes_of(W->dtype, C);
    it.dt = W->dtype;
    it.dW = dW;
    it.dy16 = dy16;
    if (!(it.w = weight_dev(c, W->data, (size_t)it.R * it.row_bytes, W->name))) return;
    if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return;
    cudaError_t e = kiln_cuda_matmul_backward_fast_dx16(c->gemm, c->stream, &it, dx16, x16, C,
                                                         C, N);
    if (e != cudaSuccess)
        poison(c, KILN_ERR_INTERNAL, "matmul_backward_dx16 (fast) '%s', %d tokens: %s (%s)",
               W->name ? W->name : "?", N, kiln_cuda_gemm_error(c->gemm), cudaGetErrorName(e));
}

static void cu_swiglu_backward_bf16_d16(kiln_backend *be, uint16_t *dgate16, uint16_t *dup16,
                                        int64_t ld16, const uint16_t *dout16,
                                        const uint16_t *gate, const uint16_t *up, int64_t rows,
                                        int64_t cols) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_swiglu_backward_bf16_d16(c->stream, dgate16, dup16, ld16, dout16,
                                                       gate, up, rows, cols, c->fast),
                 "swiglu_backward_bf16_d16");
}

static void cu_to_bf16_2d(kiln_backend *be, uint16_t *dst, int64_t ld_dst, const float *src,
                          int64_t ld_src, int64_t rows, int64_t cols) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || rows <= 0 || cols <= 0) return;
    after_launch(c, kiln_cuda_f32_to_bf16(c->stream, dst, ld_dst, src, ld_src, rows, cols),
                 "to_bf16_2d");
}

static void cu_swiglu_backward_bf16(kiln_backend *be, uint16_t *dgate16, uint16_t *dup16,
                                    const float *dout, const uint16_t *gate, const uint16_t *up,
                                    size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_swiglu_backward_bf16(c->stream, dgate16, dup16, dout, gate, up, n,
                                                   c->fast),
                 "swiglu_backward_bf16");
}

static void cu_to_bf16(kiln_backend *be, uint16_t *dst, const float *src, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || n == 0) return;
    const int64_t m = (int64_t)n; /* one row of n */
    after_launch(c, kiln_cuda_f32_to_bf16(c->stream, dst, m, src, m, 1, m), "to_bf16");
}

/* The column-sum scratch, at least len doubles (fast mode). Grown outside any graph capture
 * (a recorded training step has run its shapes once before): the old buffer is freed once the
 * stream is idle, so no queued kernel still reads it, and graphs recorded before go stale
 * (c->gen). NULL (poisoned) on failure. */
static double *colsum_scratch(cuda_ctx *c, size_t len) {
    if (len <= c->cap_colsum_ws) return c->colsum_ws;
    size_t cap = len < 65536 ? 65536 : len + len / 2;
    c->gen++;
    if (c->colsum_ws) {
        if (!CK(c, cudaStreamSynchronize(c->stream)) || !CK(c, cudaFree(c->colsum_ws)))
            return NULL;
    }
    c->colsum_ws = NULL;
    c->cap_colsum_ws = 0;
    if (!CK(c, cudaMalloc((void **)&c->colsum_ws, cap * sizeof(double)))) return NULL;
    c->cap_colsum_ws = cap;
    return c->colsum_ws;
}

/* ops.h's rmsnorm_backward and (dx16 non-NULL: fast mode with dw and w only)
 * rmsnorm_backward_bf16. */
static void rmsnorm_backward(kiln_backend *be, float *dx, uint16_t *dx16, float *dw,
                             const float *dy, const float *x, const float *w, int N, int C,
                             float eps, float *rstd, bool accumulate_dx) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (c->fast && dw && w) { /* dw in the fast column sum's order (cuda_norm.h) */
        const size_t len = kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C);
        double *ws = colsum_scratch(c, len);
        if (!ws) return;
        after_launch(c, kiln_cuda_rmsnorm_backward_fast(c->stream, dx, dx16, dw, dy, x, w, N, C,
                                                        eps, rstd, accumulate_dx, ws, len),
                     "rmsnorm_backward (fast)");
        return;
    }
    if (dx16) {
        poison(c, KILN_ERR_UNSUPPORTED, "rmsnorm_backward_bf16: needs fast mode, dw and w");
        return;
    }
    after_launch(c, kiln_cuda_rmsnorm_backward(c->stream, dx, dw, dy, x, w, N, C, eps, rstd,
                                               accumulate_dx),
                 "rmsnorm_backward");
}

static void cu_rmsnorm_backward(kiln_backend *be, float *dx, float *dw, const float *dy,
                                const float *x, const float *w, int N, int C, float eps,
                                float *rstd, bool accumulate_dx) {
    rmsnorm_backward(be, dx, NULL, dw, dy, x, w, N, C, eps, rstd, accumulate_dx);
}

static void cu_rmsnorm_backward_bf16(kiln_backend *be, float *dx, uint16_t *dx16, float *dw,
                                     const float *dy, const float *x, const float *w, int N,
                                     int C, float eps, float *rstd, bool accumulate_dx) {
    rmsnorm_backward(be, dx, dx16, dw, dy, x, w, N, C, eps, rstd, accumulate_dx);
}

static void cu_rope_backward(kiln_backend *be, float *d, const int32_t *pos, int N, int H,
                             int HS, const float *cos_tab, const float *sin_tab) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int32_t *d_pos = ints_dev(c, pos, (size_t)N);
    if (!d_pos) return;
    after_launch(c, kiln_cuda_rope_backward(c->stream, d, d_pos, N, H, HS, cos_tab, sin_tab),
                 "rope_backward");
}

static void cu_rope_backward_bf16(kiln_backend *be, float *d, uint16_t *d16, int64_t ld16,
                                  bool keep_f32, const int32_t *pos, int N, int H, int HS,
                                  const float *cos_tab, const float *sin_tab) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    const int32_t *d_pos = ints_dev(c, pos, (size_t)N);
    if (!d_pos) return;
    after_launch(c, kiln_cuda_rope_backward_bf16(c->stream, d, d16, ld16, keep_f32 ? 1 : 0, d_pos,
                                                 N, H, HS, cos_tab, sin_tab),
                 "rope_backward_bf16");
}

static void cu_attention_backward(kiln_backend *be, float *dq, float *dk, float *dv,
                                  const float *dout, const float *q, const float *k,
                                  const float *v, const float *out, float *ws, int N,
                                  int n_past, int NH, int KVH, int HS, float scale, int window) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (c->fast && !window_cuts(window, N, n_past) && kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, out, N, n_past,
                                                        NH, KVH, HS)) {
        /* ws holds kiln_attention_backward_ws_floats (ops.h's contract) */
        after_launch(c,
                     kiln_cuda_attention_backward_fast(
                         c->stream, dq, dk, dv, dout, q, k, v, out, ws,
                         kiln_attention_backward_ws_floats(N, n_past, NH, KVH, HS), N, n_past,
                         NH, KVH, HS, scale),
                     "attention_backward (fast)");
        return;
    }
    after_launch(c, kiln_cuda_attention_backward(c->stream, dq, dk, dv, dout, q, k, v, out, ws,
                                                 N, n_past, NH, KVH, HS, scale, window),
                 "attention_backward");
}

/* B sequences of N tokens (ops.h's attention_seqs): fast mode runs them in one set of
 * launches and saves lse; auditable mode is B attention() calls (lse untouched). */
static void cu_attention_seqs(kiln_backend *be, float *out, uint16_t *out16, float *lse,
                              void *keep, const int32_t *rope_pos, const float *rope_cos,
                              const float *rope_sin, const float *q, const float *k,
                              const float *v, int B, int N, int NH, int KVH, int HS,
                              float scale) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || B <= 0 || N <= 0) return;
    if ((keep || rope_pos) && (!out16 || (rope_pos && (!keep || !rope_cos || !rope_sin)))) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention_seqs: keep needs a bf16 output, rope_pos "
               "keep and both tables");
        return;
    }
    /* ops.h's keep size must hold this backend's packed copy */
    if (keep && kiln_cuda_attn_keep_bytes(B, N, NH, KVH, HS) >
                    kiln_attention_keep_bytes(B, N, NH, KVH, HS)) {
        poison(c, KILN_ERR_INTERNAL, "attention_seqs: the packed copy outgrows "
               "kiln_attention_keep_bytes (B %d, N %d, NH %d, KVH %d, HS %d)", B, N, NH, KVH, HS);
        return;
    }
    const size_t qs = (size_t)N * NH * HS, ks = (size_t)N * KVH * HS;
    if (out16 && (!c->fast || c->invariant || out || !kiln_cuda_attn_saves_lse(out16, q, k, v, N, HS))) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention_seqs: a bf16 output needs fast mode, the "
               "flash kernels' head sizes (64, 128), 16-byte alignment and no f32 output "
               "(head size %d, N %d)", HS, N);
        return;
    }
    if (!c->fast || c->invariant || HS > KILN_ATTN_FAST_MAX_HS) {
        for (int b = 0; b < B; b++)
            cu_attention(be, out + b * qs, q + b * qs, k + b * ks, v + b * ks, N, 0, NH, KVH, HS,
                         scale, 0);
        return;
    }
    if (!c->attn && !CK(c, kiln_cuda_attn_create(&c->attn))) return;
    kiln_cuda_attn_rope rope = {NULL, rope_cos, rope_sin};
    if (rope_pos && !(rope.pos = ints_dev(c, rope_pos, (size_t)B * (size_t)N))) return;
    after_launch(c,
                 kiln_cuda_attention_fast_seqs(c->attn, c->stream, out, out16, lse, keep,
                                               rope_pos ? &rope : NULL, q, k, v, B, N, NH, KVH,
                                               HS, scale),
                 "attention_seqs (fast)");
}

/* ops.h's attention_backward_seqs: the fast kernels for all B at once (with the forward's lse)
 * when they take the shape, else B attention_backward calls (ws reused in stream order). */
static void cu_attention_backward_seqs(kiln_backend *be, float *dq, float *dk, float *dv,
                                       const float *dout, const float *q, const float *k,
                                       const float *v, const float *out, const uint16_t *out16,
                                       const float *lse, const void *keep, float *ws, int B,
                                       int N, int NH, int KVH, int HS, float scale) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || B <= 0 || N <= 0) return;
    const void *o = out16 ? (const void *)out16 : (const void *)out;
    if (c->fast && B <= 65535 &&
        kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, o, N, 0, NH, KVH, HS)) {
        after_launch(c,
                     kiln_cuda_attention_backward_fast_seqs(
                         c->stream, dq, dk, dv, dout, q, k, v, out, out16, lse, keep, ws,
                         kiln_attention_backward_seqs_ws_floats(B, N, NH, KVH, HS), B, N, NH,
                         KVH, HS, scale),
                     "attention_backward_seqs (fast)");
        return;
    }
    if (out16 || keep) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention_backward_seqs: a bf16 output or keep needs "
               "fast mode and the fast kernels' shapes (head size %d, N %d)", HS, N);
        return;
    }
    const size_t qs = (size_t)N * NH * HS, ks = (size_t)N * KVH * HS;
    for (int b = 0; b < B; b++)
        cu_attention_backward(be, dq + b * qs, dk + b * ks, dv + b * ks, dout + b * qs,
                              q + b * qs, k + b * ks, v + b * ks, out + b * qs, ws, N, 0, NH,
                              KVH, HS, scale, 0);
}

/* ops.h's attention_backward_seqs16: the fast kernels with the epilogue in their stores when
 * they take the call, else the calls it stands for (the same bits either way; the fused
 * epilogue took the 135M shape's training step +1.9%: bench/RESULTS.md, 2026-12-02, d571da7). */
static void cu_attention_backward_seqs16(kiln_backend *be, float *dq, float *dk, float *dv,
                                         const kiln_attn_grad16 *g, const float *dout,
                                         const float *q, const float *k, const float *v,
                                         const float *out, const uint16_t *out16,
                                         const float *lse, const void *keep, float *ws, int B,
                                         int N, int NH, int KVH, int HS, float scale) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || B <= 0 || N <= 0) return;
    if (!g) {
        poison(c, KILN_ERR_INVALID_ARG, "attention_backward_seqs16: no destination (g NULL)");
        return;
    }
    const void *o = out16 ? (const void *)out16 : (const void *)out;
    const int64_t T = (int64_t)B * N;
    if (c->fast && B <= 65535 &&
        kiln_cuda_attention_backward_fast_ok(dq, dk, dv, dout, q, k, v, o, N, 0, NH, KVH, HS) &&
        kiln_cuda_attention_grad16_ok(g, NH, KVH, HS)) {
        kiln_attn_grad16 gd = *g;
        if (!(gd.pos = ints_dev(c, g->pos, (size_t)T))) return;
        after_launch(c,
                     kiln_cuda_attention_backward_fast_seqs16(
                         c->stream, dq, dk, dv, &gd, dout, q, k, v, out, out16, lse, keep, ws,
                         kiln_attention_backward_seqs_ws_floats(B, N, NH, KVH, HS), B, N, NH,
                         KVH, HS, scale),
                     "attention_backward_seqs16 (fast)");
        return;
    }
    cu_attention_backward_seqs(be, dq, dk, dv, dout, q, k, v, out, out16, lse, keep, ws, B, N, NH,
                               KVH, HS, scale);
    cu_rope_backward_bf16(be, dq, g->dq16, g->ld16, g->keep_f32, g->pos, (int)T, NH, HS,
                          g->cos_tab, g->sin_tab);
    cu_rope_backward_bf16(be, dk, g->dk16, g->ld16, g->keep_f32, g->pos, (int)T, KVH, HS,
                          g->cos_tab, g->sin_tab);
    cu_to_bf16_2d(be, g->dv16, g->ld16, dv, (int64_t)KVH * HS, T, (int64_t)KVH * HS);
}

static void cu_swiglu_backward(kiln_backend *be, float *dgate, float *dup, const float *dout,
                               const float *gate, const float *up, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_swiglu_backward(c->stream, dgate, dup, dout, gate, up, n),
                 "swiglu_backward");
}

static kiln_status cu_upload(kiln_backend *be, void *dst, const void *src, size_t nbytes);

/* embed_backward's plan path: host ids, stream not capturing (the plan changes every call,
 * so it must not be recorded into a graph). The plan is made in host memory and copied to
 * d_plan by upload (staged: the host does not wait for the queue). False: not taken
 * (nothing enqueued, the backend not poisoned) or failed (poisoned: check c->err). */
static bool embed_backward_planned(kiln_backend *be, float *dtable, const float *dy,
                                   const int32_t *ids, int N, int V, int C) {
    cuda_ctx *c = ctx_of(be);
    cudaStreamCaptureStatus cs;
    if (is_device_ptr(ids) || cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone)
        return false;
    const size_t need = 3 * (size_t)N + 1;
    if (need > c->cap_plan) {
        if (c->d_plan && !CK(c, cudaFree(c->d_plan))) return false; /* waits for its readers */
        c->d_plan = NULL;
        c->cap_plan = 0;
        if (!CK(c, cudaMalloc((void **)&c->d_plan, need * sizeof(int32_t)))) return false;
        c->cap_plan = need;
    }
    if (need + (size_t)V > c->cap_h_plan) { /* the host plan, then V counts */
        int32_t *h = (int32_t *)kiln_realloc(c->h_plan, (need + (size_t)V) * sizeof(int32_t));
        if (!h) {
            poison(c, KILN_ERR_NOMEM, "embed_backward: out of host memory (%d tokens, %d ids)",
                   N, V);
            return false;
        }
        c->h_plan = h;
        c->cap_h_plan = need + (size_t)V;
    }
    const int G = kiln_embed_plan(ids, N, V, c->h_plan, c->h_plan + need);
    const size_t used = 2 * (size_t)G + 1 + (size_t)c->h_plan[2 * G];
    if (cu_upload(be, c->d_plan, c->h_plan, used * sizeof(int32_t)) != KILN_OK) return false;
    after_launch(c, kiln_cuda_embed_backward_plan(c->stream, dtable, dy, c->d_plan, G, C),
                 "embed_backward");
    return true;
}

static void cu_embed_backward(kiln_backend *be, float *dtable, const float *dy,
                              const int32_t *ids, int N, int V, int C) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (embed_backward_planned(be, dtable, dy, ids, N, V, C) || c->err != KILN_OK) return;
    const int32_t *d_ids = ints_dev(c, ids, (size_t)N);
    if (!d_ids) return;
    after_launch(c, kiln_cuda_embed_backward(c->stream, dtable, dy, d_ids, N, V, C),
                 "embed_backward");
}

/* ---- memory -------------------------------------------------------------------------------- */

static void *cu_alloc(kiln_backend *be, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    if (c->err != KILN_OK) {
        kiln_error(c->err, "%s", c->msg);
        return NULL;
    }
    if (!CK(c, cudaSetDevice(c->device))) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* an out-of-memory is not sticky: the backend stays usable */
        kiln_error(KILN_ERR_NOMEM, "cuda backend (device %d): cannot allocate %zu bytes: %s",
                   c->device, nbytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cu_free_buf(kiln_backend *be, void *p) {
    cuda_ctx *c = ctx_of(be);
    if (!p) return;
    cudaSetDevice(c->device);
    cudaFree(p); /* a failure here is a consequence of an earlier poison, or harmless */
}

static kiln_status cu_copy(kiln_backend *be, void *dst, const void *src, size_t nbytes,
                           cudaMemcpyKind kind, const char *what) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    if (nbytes &&
        (!check(c, cudaMemcpyAsync(dst, src, nbytes, kind, c->stream), what) ||
         !check(c, cudaStreamSynchronize(c->stream), what)))
        return c->err;
    return KILN_OK;
}

/* Small uploads from pageable host memory go through a pinned slot and return without
 * waiting for the stream (a plain pageable copy waits for every kernel queued before it, and
 * the device then idles while the host launches the next work). Large ones, and any while
 * the stream is being captured, are copied and waited for. */
static kiln_status cu_upload(kiln_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    cudaStreamCaptureStatus cs;
    if (nbytes == 0 || nbytes > UPLOAD_STAGED_MAX || c->err != KILN_OK ||
        cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone || is_device_ptr(src))
        return cu_copy(be, dst, src, nbytes, cudaMemcpyHostToDevice, "upload");
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    upload_slot *u = &c->up[c->up_next];
    c->up_next = (c->up_next + 1) % UPLOAD_SLOTS;
    if (u->pending && !CK(c, cudaEventSynchronize(u->ev))) return c->err;
    u->pending = false;
    if (!u->ev && !CK(c, cudaEventCreateWithFlags(&u->ev, cudaEventDisableTiming))) return c->err;
    if (nbytes > u->cap) {
        if (u->buf && !CK(c, cudaFreeHost(u->buf))) return c->err;
        u->buf = NULL;
        u->cap = 0;
        size_t cap = nbytes < 65536 ? 65536 : nbytes;
        if (!CK(c, cudaMallocHost(&u->buf, cap))) return c->err;
        u->cap = cap;
    }
    memcpy(u->buf, src, nbytes);
    if (!CK(c, cudaMemcpyAsync(dst, u->buf, nbytes, cudaMemcpyHostToDevice, c->stream)) ||
        !CK(c, cudaEventRecord(u->ev, c->stream)))
        return c->err;
    u->pending = true;
    return KILN_OK;
}

static void cu_own_memory(kiln_backend *be, uint64_t *held, uint64_t *transient_peak,
                          bool reset_peak) {
    cuda_ctx *c = ctx_of(be);
    uint64_t h = (uint64_t)c->cap_ints * 4 + (uint64_t)c->cap_colsum_ws * 8 +
                 (uint64_t)c->cap_plan * 4 + (uint64_t)c->cap_hist * 4 +
                 (uint64_t)c->cap_gather * 4 + kiln_cuda_gemm_device_bytes(c->gemm) +
                 kiln_cuda_attn_device_bytes(c->attn);
    uint64_t tp = 0;
    if (cudaSetDevice(c->device) == cudaSuccess) {
        cudaMemPool_t pool;
        unsigned long long v = 0; /* the attributes are 64-bit counts */
        const bool have_pool = cudaDeviceGetDefaultMemPool(&pool, c->device) == cudaSuccess;
        if (have_pool && cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v) == cudaSuccess)
            tp += v;
        v = 0;
        if (cudaDeviceGetGraphMemAttribute(c->device, cudaGraphMemAttrUsedMemHigh, &v) ==
            cudaSuccess)
            tp += v;
        if (reset_peak) { /* 0 is the only value these attributes take: "the current use" */
            unsigned long long zero = 0;
            if (have_pool) (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
            (void)cudaDeviceSetGraphMemAttribute(c->device, cudaGraphMemAttrUsedMemHigh, &zero);
        }
    }
    (void)cudaGetLastError(); /* an unsupported attribute is not an error of the backend */
    if (held) *held = h;
    if (transient_peak) *transient_peak = tp;
}

static kiln_status cu_download(kiln_backend *be, void *dst, const void *src, size_t nbytes) {
    return cu_copy(be, dst, src, nbytes, cudaMemcpyDeviceToHost, "download");
}

/* The copy lands in pinned memory behind an event: download_end waits for the event, so the
 * work enqueued after the begin keeps the device busy while the host takes the bytes. */
static kiln_status cu_download_begin(kiln_backend *be, const void *src, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    if (c->down_pending)
        return kiln_error(KILN_ERR_STATE, "cuda backend: download_begin while a download is open");
    cudaStreamCaptureStatus cs;
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    if (!CK(c, cudaStreamIsCapturing(c->stream, &cs))) return c->err;
    if (cs != cudaStreamCaptureStatusNone)
        return kiln_error(KILN_ERR_STATE, "cuda backend: download_begin inside a graph capture");
    if (!c->down_ev && !CK(c, cudaEventCreateWithFlags(&c->down_ev, cudaEventDisableTiming)))
        return c->err;
    if (nbytes > c->down_cap) {
        if (c->down_buf && !CK(c, cudaFreeHost(c->down_buf))) return c->err;
        c->down_buf = NULL;
        c->down_cap = 0;
        size_t cap = nbytes < 65536 ? 65536 : nbytes;
        if (!CK(c, cudaMallocHost(&c->down_buf, cap))) return c->err;
        c->down_cap = cap;
    }
    if (nbytes &&
        (!CK(c, cudaMemcpyAsync(c->down_buf, src, nbytes, cudaMemcpyDeviceToHost, c->stream)) ||
         !CK(c, cudaEventRecord(c->down_ev, c->stream))))
        return c->err;
    c->down_open = nbytes;
    c->down_pending = true;
    return KILN_OK;
}

static kiln_status cu_download_end(kiln_backend *be, void *dst, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    if (!c->down_pending)
        return kiln_error(KILN_ERR_STATE, "cuda backend: download_end without download_begin");
    c->down_pending = false;
    if (nbytes > c->down_open)
        return kiln_error(KILN_ERR_INVALID_ARG, "cuda backend: download_end of %zu bytes, %zu begun",
                          nbytes, c->down_open);
    if (!op_begin(c)) return kiln_error(c->err, "%s", c->msg);
    if (c->down_open && !CK(c, cudaEventSynchronize(c->down_ev))) return c->err;
    if (nbytes) memcpy(dst, c->down_buf, nbytes);
    return KILN_OK;
}

static kiln_status cu_status(kiln_backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (op_begin(c)) CK(c, cudaStreamSynchronize(c->stream));
    if (c->err != KILN_OK) return kiln_error(c->err, "%s", c->msg);
    return KILN_OK;
}

/* cu_status without the wait: cudaStreamQuery says "not ready" while work runs, and returns
 * a fault the device has already reported (sticky: every later call would see it too). */
static kiln_status cu_poll(kiln_backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (op_begin(c)) {
        const cudaError_t e = cudaStreamQuery(c->stream);
        if (e != cudaErrorNotReady)
            check(c, e, "cudaStreamQuery");
        else if (cudaPeekAtLastError() == cudaErrorNotReady)
            (void)cudaGetLastError(); /* "not ready" is an answer, not an error to keep */
    }
    if (c->err != KILN_OK) return kiln_error(c->err, "%s", c->msg);
    return KILN_OK;
}

/* ---- batches over a paged KV cache (ops.h: kv_store_rows, attention_paged, get_rows) ------ */

static void cu_kv_store_rows(kiln_backend *be, float *k_pool, float *v_pool, const float *k_rows,
                             const float *v_rows, const int32_t *slots, int N,
                             size_t row_floats) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_kv_store_rows(c->stream, k_pool, v_pool, k_rows, v_rows, slots, N,
                                            row_floats),
                 "kv_store_rows");
}

static void cu_get_rows(kiln_backend *be, float *out, const float *x, const int32_t *idx, int n,
                        int C) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || n <= 0) return;
    const int32_t *d_idx = ints_dev(c, idx, (size_t)n);
    if (!d_idx) return;
    after_launch(c, kiln_cuda_get_rows(c->stream, out, x, d_idx, n, C), "get_rows");
}

/* The gather scratch, at least len floats (fast attention_paged). Grown outside graph
 * captures only (poisoned inside one): the old buffer is freed once the stream is idle, and
 * graphs recorded before go stale (c->gen), as colsum_scratch. NULL when poisoned. */
static float *gather_scratch(cuda_ctx *c, size_t len) {
    if (len <= c->cap_gather) return c->gather;
    cudaStreamCaptureStatus cs;
    if (!CK(c, cudaStreamIsCapturing(c->stream, &cs))) return NULL;
    if (cs != cudaStreamCaptureStatusNone) {
        poison(c, KILN_ERR_STATE, "attention_paged (fast): the gather scratch must grow to %zu "
               "floats inside a graph capture (run the batch once before recording it)", len);
        return NULL;
    }
    c->gen++;
    if (c->gather) {
        if (!CK(c, cudaStreamSynchronize(c->stream)) || !CK(c, cudaFree(c->gather))) return NULL;
    }
    c->gather = NULL;
    c->cap_gather = 0;
    if (!CK(c, cudaMalloc((void **)&c->gather, len * sizeof(float)))) return NULL;
    c->cap_gather = len;
    return c->gather;
}

/* Whether run r of a fast batch goes to the prefill kernels: more than one token, and the
 * host copy of the block table to choose between the pool rows and a gather. Otherwise its
 * tokens are decode tokens (the split decode, each on its own). */
static bool paged_prefill_run(const kiln_kv_pages *pg, const kiln_batch_run *r) {
    return r->n > 1 && pg->host_table != NULL;
}

/* Whether sequence seq's blocks b0 .. nb - 1 follow one another in the pool (host table). */
static bool paged_consecutive(const kiln_kv_pages *pg, int seq, int b0, int nb) {
    const int32_t *row = pg->host_table + (int64_t)seq * pg->max_blocks;
    for (int j = b0 + 1; j < nb; j++)
        if (row[j] != row[b0] + (j - b0)) return false;
    return true;
}

/* The first block a prefill run needs: the one holding its first query's first key under a
 * sliding window (window 0: block 0). The run's keys are read from there on. */
static int paged_first_block(const kiln_kv_pages *pg, const kiln_batch_run *r, int window) {
    const int lo = window > 0 && r->pos0 + 1 > window ? r->pos0 + 1 - window : 0;
    return lo / pg->block_size;
}

/* Fast attention_paged. Decode tokens (every token when runs or host_table is NULL, else the
 * tokens of runs of one) go to one launch of the split decode over the block table
 * (kiln_cuda_attention_decode_paged: positions read on the device, graph-safe). A prefill run
 * (paged_prefill_run) goes to kiln_cuda_attention_fast_window as a dense call of n queries
 * over its sequence's keys kb..pos0+n-1 at n_past = pos0 - kb, kb the first position of
 * block paged_first_block (0 without a window; the window is relative to each query, so the
 * call sees the same keys): the pool rows themselves when those keys' blocks are consecutive
 * (no copy), else a gather of them into c->gather. Table entries of blocks wholly below a
 * window are never read. */
/* The keys of prefill run u as dense rows: from the first block its window reaches (b0) to its
 * last token, the pool rows in place when those blocks are consecutive, else gathered into gk
 * (its values after its keys; room for 2 x rows x kvrow floats). *kp, *vp: the rows; returns
 * the position of the first (b0 x block_size). */
static int run_keys(cuda_ctx *c, const kiln_kv_pages *pg, const kiln_batch_run *u, int window,
                    const float *k_pool, const float *v_pool, float *gk, size_t kvrow,
                    const float **kp, const float **vp) {
    const int T = u->pos0 + u->n, nb = (T - 1) / pg->block_size + 1;
    const int b0 = paged_first_block(pg, u, window);
    const int kb = b0 * pg->block_size, rows = T - kb; /* keys kb .. T - 1 */
    if (paged_consecutive(pg, u->seq, b0, nb)) { /* the pool rows in place */
        const size_t row0 = (size_t)pg->host_table[(int64_t)u->seq * pg->max_blocks + b0] * pg->block_size;
        *kp = k_pool + row0 * kvrow;
        *vp = v_pool + row0 * kvrow;
    } else {
        float *gv = gk + (size_t)rows * kvrow;
        after_launch(c,
                     kiln_cuda_gather_pages(c->stream, gk, gv, k_pool, v_pool,
                                            pg->block_table + (int64_t)u->seq * pg->max_blocks + b0,
                                            pg->block_size, rows, kvrow),
                     "attention_paged (gather)");
        *kp = gk;
        *vp = gv;
    }
    return kb;
}

static void attention_paged_fast(cuda_ctx *c, float *out, const float *q, const float *k_pool,
                                 const float *v_pool, const kiln_kv_pages *pg,
                                 const int32_t *seq, const int32_t *pos,
                                 const kiln_batch_run *runs, int n_runs, int N, int max_T, int NH,
                                 int KVH, int HS, float scale, int window) {
    if (HS > KILN_ATTN_FAST_MAX_HS) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention_paged (fast): head size %d > %d", HS,
               KILN_ATTN_FAST_MAX_HS);
        return;
    }
    const size_t qrow = (size_t)NH * HS, kvrow = (size_t)KVH * HS;
    int n_dec = N, n_pre = 0;
    size_t gather_need = 0;
    if (runs) {
        n_dec = 0;
        for (int r = 0; r < n_runs; r++) {
            const kiln_batch_run *u = &runs[r];
            if (u->first < 0 || u->n < 1 || u->first > N - u->n || u->pos0 < 0 ||
                u->pos0 > INT_MAX - u->n || u->seq < 0) {
                poison(c, KILN_ERR_INVALID_ARG, "attention_paged: run %d (first %d, n %d, seq "
                       "%d, pos0 %d) outside the batch of %d tokens", r, u->first, u->n, u->seq,
                       u->pos0, N);
                return;
            }
            if (!paged_prefill_run(pg, u)) {
                n_dec += u->n;
                continue;
            }
            n_pre++;
            const int T = u->pos0 + u->n, nb = (T - 1) / pg->block_size + 1;
            if (nb > pg->max_blocks) {
                poison(c, KILN_ERR_INVALID_ARG, "attention_paged: run %d reaches position %d, "
                       "past %d blocks of %d", r, T - 1, pg->max_blocks, pg->block_size);
                return;
            }
            const int b0 = paged_first_block(pg, u, window);
            const size_t rows = (size_t)T - (size_t)b0 * pg->block_size; /* keys read */
            if (!paged_consecutive(pg, u->seq, b0, nb) && 2 * rows * kvrow > gather_need)
                gather_need = 2 * rows * kvrow;
        }
        if (n_pre == 0) n_dec = N; /* every token on its own, as without runs */
    }
    if (!c->attn && !CK(c, kiln_cuda_attn_create(&c->attn))) return;
    cudaStreamCaptureStatus cs;
    if (!CK(c, cudaStreamIsCapturing(c->stream, &cs))) return;
    /* workspaces first, so that no launch below finds one reallocated under an earlier one;
     * inside a capture graph_begin has sized the decode's (and a prefill there must fit) */
    if (cs == cudaStreamCaptureStatusNone) {
        if (n_dec > 0 && !CK(c, kiln_cuda_attn_reserve(c->attn, n_dec, 1, NH, HS, max_T)))
            return;
        for (int r = 0; r < n_runs && n_pre; r++)
            if (paged_prefill_run(pg, &runs[r]) && runs[r].n <= KILN_ATTN_DECODE_MAX_N &&
                !CK(c, kiln_cuda_attn_reserve(c->attn, 1, runs[r].n, NH, HS,
                                              runs[r].pos0 + runs[r].n)))
                return;
    }
    float *gk = NULL;
    if (gather_need && !(gk = gather_scratch(c, gather_need))) return;

    if (n_dec > 0) {
        /* the decode tokens: all N, one range of the batch, or a list uploaded */
        kiln_cuda_attn_pages dp = {seq, pos, NULL, pg->block_table, pg->block_size,
                                   pg->max_blocks};
        int lo = 0;
        int32_t *list = NULL;
        if (n_pre) {
            list = (int32_t *)kiln_malloc((size_t)n_dec * sizeof(int32_t));
            if (!list) {
                poison(c, KILN_ERR_NOMEM, "attention_paged: out of host memory");
                return;
            }
            int k = 0;
            for (int r = 0; r < n_runs; r++)
                if (!paged_prefill_run(pg, &runs[r]))
                    for (int t = 0; t < runs[r].n; t++) list[k++] = runs[r].first + t;
            lo = list[0];
            if (list[n_dec - 1] - lo == n_dec - 1) { /* one range: no list to upload */
                kiln_free(list);
                list = NULL;
            }
        }
        if (list) {
            lo = 0;
            dp.tok = ints_dev(c, list, (size_t)n_dec);
            kiln_free(list); /* ints_dev has consumed it */
            if (!dp.tok) return;
        }
        dp.seq += lo;
        dp.pos += lo;
        after_launch(c,
                     kiln_cuda_attention_decode_paged(c->attn, c->stream, out + lo * qrow,
                                                      q + lo * qrow, k_pool, v_pool, &dp, n_dec,
                                                      max_T, NH, KVH, HS, scale, window),
                     "attention_paged (fast decode)");
        if (c->err != KILN_OK) return;
    }
    for (int r = 0; r < n_runs && n_pre; r++) {
        const kiln_batch_run *u = &runs[r];
        if (!paged_prefill_run(pg, u)) continue;
        const float *kp, *vp;
        const int kb = run_keys(c, pg, u, window, k_pool, v_pool, gk, kvrow, &kp, &vp);
        after_launch(c,
                     kiln_cuda_attention_fast_window(c->attn, c->stream, out + u->first * qrow,
                                                     q + u->first * qrow, kp, vp, u->n,
                                                     u->pos0 - kb, NH, KVH, HS, scale, window),
                     "attention_paged (fast prefill)");
        if (c->err != KILN_OK) return;
    }
}

/* The shortest prefill run that auditable attention_paged takes as one dense call (the tiled
 * kernels' threshold: kiln_cuda_attention runs 4 tokens or more on them). */
#define PAGED_DENSE_MIN_RUN 4

/* The tokens [lo, hi) of a batch, each on its own over the block table (auditable). */
static void paged_tokens(cuda_ctx *c, float *out, const float *q, const float *k_pool, const float *v_pool,
                         const kiln_kv_pages *pg, const int32_t *seq, const int32_t *pos, int lo, int hi, int NH,
                         int KVH, int HS, float scale, int window) {
    if (hi <= lo || c->err != KILN_OK) return;
    const size_t qrow = (size_t)NH * HS;
    after_launch(c,
                 kiln_cuda_attention_paged(c->stream, out + lo * qrow, q + lo * qrow, k_pool, v_pool,
                                           pg->block_table, pg->block_size, pg->max_blocks, seq + lo, pos + lo,
                                           hi - lo, NH, KVH, HS, scale, window),
                 "attention_paged");
}

/* Auditable attention_paged with prefill runs taken together. A run of at least
 * PAGED_DENSE_MIN_RUN tokens (with the host table) is one dense kiln_cuda_attention call of
 * its queries over its sequence's keys kb .. pos0 + n - 1 at n_past = pos0 - kb, kb the first
 * position of block paged_first_block (0 without a window; no query of the run sees a key
 * below it): the pool rows in place when those blocks are consecutive, else gathered. kb is a
 * multiple of the block size and so of KILN_ATTN_BLOCK: the online softmax's key blocks and
 * each query's window fall on the same keys as for the token alone, so every token gets the
 * bits ops.h asks for (attention(N = 1, n_past = pos) over its keys stored densely). The other
 * tokens go to the per-token kernel, a range of the batch at a time. */
static void attention_paged_runs(cuda_ctx *c, float *out, const float *q, const float *k_pool,
                                 const float *v_pool, const kiln_kv_pages *pg, const int32_t *seq,
                                 const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N, int NH,
                                 int KVH, int HS, float scale, int window) {
    const size_t qrow = (size_t)NH * HS, kvrow = (size_t)KVH * HS;
    size_t gather_need = 0;
    for (int r = 0; r < n_runs; r++) {
        const kiln_batch_run *u = &runs[r];
        if (u->first < 0 || u->n < 1 || u->first > N - u->n || u->pos0 < 0 || u->pos0 > INT_MAX - u->n ||
            u->seq < 0 || (r > 0 && u->first < runs[r - 1].first + runs[r - 1].n)) {
            poison(c, KILN_ERR_INVALID_ARG, "attention_paged: run %d (first %d, n %d, seq %d, pos0 %d) outside "
                   "the batch of %d tokens or out of order", r, u->first, u->n, u->seq, u->pos0, N);
            return;
        }
        if (u->n < PAGED_DENSE_MIN_RUN) continue;
        const int T = u->pos0 + u->n, nb = (T - 1) / pg->block_size + 1;
        if (nb > pg->max_blocks) {
            poison(c, KILN_ERR_INVALID_ARG, "attention_paged: run %d reaches position %d, past %d blocks of %d", r,
                   T - 1, pg->max_blocks, pg->block_size);
            return;
        }
        const int b0 = paged_first_block(pg, u, window);
        const size_t rows = (size_t)T - (size_t)b0 * pg->block_size;
        if (!paged_consecutive(pg, u->seq, b0, nb) && 2 * rows * kvrow > gather_need) gather_need = 2 * rows * kvrow;
    }
    float *gk = NULL;
    if (gather_need && !(gk = gather_scratch(c, gather_need))) return;
    int next = 0; /* the first token not yet launched */
    for (int r = 0; r < n_runs && c->err == KILN_OK; r++) {
        const kiln_batch_run *u = &runs[r];
        if (u->n < PAGED_DENSE_MIN_RUN) continue;
        paged_tokens(c, out, q, k_pool, v_pool, pg, seq, pos, next, u->first, NH, KVH, HS, scale, window);
        next = u->first + u->n;
        const float *kp, *vp;
        const int kb = run_keys(c, pg, u, window, k_pool, v_pool, gk, kvrow, &kp, &vp);
        if (c->err != KILN_OK) return;
        after_launch(c,
                     kiln_cuda_attention(c->stream, out + u->first * qrow, q + u->first * qrow, kp, vp, u->n,
                                         u->pos0 - kb, NH, KVH, HS, scale, window),
                     "attention_paged (a prefill run)");
    }
    paged_tokens(c, out, q, k_pool, v_pool, pg, seq, pos, next, N, NH, KVH, HS, scale, window);
}

static void cu_attention_paged(kiln_backend *be, float *out, const float *q, const float *k_pool,
                               const float *v_pool, const kiln_kv_pages *pg, const int32_t *seq,
                               const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                               int max_T, int NH, int KVH, int HS, float scale, int window) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (window < 0) {
        poison(c, KILN_ERR_INVALID_ARG, "attention_paged: window %d < 0", window);
        return;
    }
    if (!pg || pg->block_size <= 0 || pg->block_size % KILN_ATTN_BLOCK != 0 ||
        pg->max_blocks <= 0) {
        poison(c, KILN_ERR_INVALID_ARG, "attention_paged: block_size %d (a positive multiple of "
               "%d) and max_blocks %d", pg ? pg->block_size : 0, KILN_ATTN_BLOCK,
               pg ? pg->max_blocks : 0);
        return;
    }
    if (c->fast && !c->invariant) {
        attention_paged_fast(c, out, q, k_pool, v_pool, pg, seq, pos, runs, runs ? n_runs : 0, N,
                             max_T, NH, KVH, HS, scale, window);
        return;
    }
    if (HS > KILN_CUDA_MAX_HS) {
        poison(c, KILN_ERR_UNSUPPORTED, "attention_paged: head size %d > %d", HS,
               KILN_CUDA_MAX_HS);
        return;
    }
    /* a prefill run as one dense call (its tokens' own bits: a token's bits never depend on the
     * batch), the other tokens each on its own */
    if (runs && n_runs > 0 && pg->host_table) {
        attention_paged_runs(c, out, q, k_pool, v_pool, pg, seq, pos, runs, n_runs, N, NH, KVH, HS, scale,
                             window);
        return;
    }
    paged_tokens(c, out, q, k_pool, v_pool, pg, seq, pos, 0, N, NH, KVH, HS, scale, window);
}

/* ---- Qwen3.5's ops (cuda_linear_attn.h): the CPU's bits in both modes --------------------- */

/* The batch of conv1d_silu / gated_delta (ops.h): runs inside the N tokens, or none (one token a
 * run, seq and pos on the device, a state to read them into). Poisons and returns false
 * otherwise. */
static bool la_batch_ok(cuda_ctx *c, const char *op, const float *state, const int32_t *seq,
                        const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N) {
    if (!runs) {
        if (!state || !seq || !pos) {
            poison(c, KILN_ERR_INVALID_ARG, "%s: runs NULL needs a state, seq and pos", op);
            return false;
        }
        return true;
    }
    if (n_runs < 0) {
        poison(c, KILN_ERR_INVALID_ARG, "%s: %d runs", op, n_runs);
        return false;
    }
    for (int r = 0; r < n_runs; r++)
        if (runs[r].first < 0 || runs[r].n < 0 || runs[r].first > N - runs[r].n) {
            poison(c, KILN_ERR_INVALID_ARG, "%s: run %d (tokens %d..%d) outside the batch of %d",
                   op, r, runs[r].first, runs[r].first + runs[r].n - 1, N);
            return false;
        }
    return true;
}

/* Gated DeltaNet's head shapes (ops.h: value heads a multiple of key heads; the reference's
 * head-size limits). */
static bool gdn_heads_ok(cuda_ctx *c, const char *op, int nk, int nv, int dk, int dv) {
    if (nk <= 0 || nv <= 0 || nv % nk != 0 || dk <= 0 || dv <= 0) {
        poison(c, KILN_ERR_INVALID_ARG, "%s: %d key heads, %d value heads, dk %d, dv %d", op, nk,
               nv, dk, dv);
        return false;
    }
    if (dk > KILN_CUDA_GDN_MAX_HEAD || dv > KILN_CUDA_GDN_MAX_HEAD) {
        poison(c, KILN_ERR_UNSUPPORTED, "%s: head sizes dk %d, dv %d (at most %d)", op, dk, dv,
               KILN_CUDA_GDN_MAX_HEAD);
        return false;
    }
    return true;
}

static void cu_conv1d_silu(kiln_backend *be, float *out, const float *x, const float *w,
                           float *state, const int32_t *seq, const int32_t *pos,
                           const kiln_batch_run *runs, int n_runs, int N, int CH, int K) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (K < 1 || K > KILN_CUDA_CONV_MAX_K || CH <= 0) {
        poison(c, KILN_ERR_INVALID_ARG, "conv1d_silu: K %d (1..%d), CH %d", K,
               KILN_CUDA_CONV_MAX_K, CH);
        return;
    }
    if (!la_batch_ok(c, "conv1d_silu", state, seq, pos, runs, n_runs, N)) return;
    after_launch(c,
                 kiln_cuda_conv1d_silu(c->stream, out, x, w, state, seq, pos, runs, n_runs, N, CH,
                                       K),
                 "conv1d_silu");
}

static void cu_gated_delta(kiln_backend *be, float *out, const float *qkv, const float *g,
                           const float *beta, float *state, const int32_t *seq,
                           const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                           int nk, int nv, int dk, int dv, float scale) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || N <= 0) return;
    if (!gdn_heads_ok(c, "gated_delta", nk, nv, dk, dv) ||
        !la_batch_ok(c, "gated_delta", state, seq, pos, runs, n_runs, N))
        return;
    after_launch(c,
                 kiln_cuda_gated_delta(c->stream, out, qkv, g, beta, state, seq, pos, runs, n_runs,
                                       N, nk, nv, dk, dv, scale),
                 "gated_delta");
}

static void cu_gdn_gates(kiln_backend *be, float *g, float *beta, const float *a, const float *b,
                         const float *A_log, const float *dt_bias, int N, int nv) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_gdn_gates(c->stream, g, beta, a, b, A_log, dt_bias, N, nv),
                 "gdn_gates");
}

static void cu_sigmoid_mul(kiln_backend *be, float *out, const float *x, const float *gate,
                           size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_sigmoid_mul(c->stream, out, x, gate, n), "sigmoid_mul");
}

static void cu_split_halves(kiln_backend *be, float *a, float *b, const float *x, int64_t rows,
                            int n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_split_halves(c->stream, a, b, x, rows, n), "split_halves");
}

static void cu_join_halves(kiln_backend *be, float *x, const float *a, const float *b,
                           int64_t rows, int n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_join_halves(c->stream, x, a, b, rows, n), "join_halves");
}

/* rope_partial and its transpose; pos host or device memory, as rope's. */
static void rope_partial(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                         int rot, const float *cos_tab, const float *sin_tab, int transpose) {
    cuda_ctx *c = ctx_of(be);
    const char *op = transpose ? "rope_partial_backward" : "rope_partial";
    if (!op_begin(c) || N <= 0 || H <= 0) return;
    if (rot < 0 || rot % 2 != 0 || rot > HS) {
        poison(c, KILN_ERR_INVALID_ARG, "%s: rot %d (even, at most HS %d)", op, rot, HS);
        return;
    }
    const int32_t *d_pos = ints_dev(c, pos, (size_t)N);
    if (!d_pos) return;
    after_launch(c,
                 kiln_cuda_rope_partial(c->stream, x, d_pos, N, H, HS, rot, cos_tab, sin_tab,
                                        transpose),
                 op);
}

static void cu_rope_partial(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                            int rot, const float *cos_tab, const float *sin_tab) {
    rope_partial(be, x, pos, N, H, HS, rot, cos_tab, sin_tab, 0);
}

static void cu_rope_partial_backward(kiln_backend *be, float *d, const int32_t *pos, int N, int H,
                                     int HS, int rot, const float *cos_tab,
                                     const float *sin_tab) {
    rope_partial(be, d, pos, N, H, HS, rot, cos_tab, sin_tab, 1);
}

static void cu_conv1d_silu_backward(kiln_backend *be, float *dx, float *dw, const float *dout,
                                    const float *x, const float *w, int n_seq, int T, int CH,
                                    int K) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || n_seq <= 0 || T <= 0) return;
    if (K < 1 || K > KILN_CUDA_CONV_MAX_K || CH <= 0) {
        poison(c, KILN_ERR_INVALID_ARG, "conv1d_silu_backward: K %d (1..%d), CH %d", K,
               KILN_CUDA_CONV_MAX_K, CH);
        return;
    }
    after_launch(c,
                 kiln_cuda_conv1d_silu_backward(c->stream, dx, dw, dout, x, w, n_seq, T, CH, K),
                 "conv1d_silu_backward");
}

static void cu_gated_delta_backward(kiln_backend *be, float *dqkv, float *dg, float *dbeta,
                                    const float *dout, const float *qkv, const float *g,
                                    const float *beta, float *ws, int n_seq, int T, int nk,
                                    int nv, int dk, int dv, float scale) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c) || n_seq <= 0 || T <= 0) return;
    if (!gdn_heads_ok(c, "gated_delta_backward", nk, nv, dk, dv)) return;
    if (!kiln_cuda_gated_delta_backward_fits(dk, dv)) {
        poison(c, KILN_ERR_UNSUPPORTED, "gated_delta_backward: head sizes dk %d x dv %d do not "
               "fit the walk's shared memory on this device", dk, dv);
        return;
    }
    after_launch(c,
                 kiln_cuda_gated_delta_backward(c->stream, dqkv, dg, dbeta, dout, qkv, g, beta, ws,
                                                n_seq, T, nk, nv, dk, dv, scale),
                 "gated_delta_backward");
}

static void cu_gdn_gates_backward(kiln_backend *be, float *da, float *db, float *dA_log,
                                  float *ddt_bias, const float *dg, const float *dbeta,
                                  const float *a, const float *b, const float *A_log,
                                  const float *dt_bias, int N, int nv) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c,
                 kiln_cuda_gdn_gates_backward(c->stream, da, db, dA_log, ddt_bias, dg, dbeta, a,
                                              b, A_log, dt_bias, N, nv),
                 "gdn_gates_backward");
}

static void cu_sigmoid_mul_backward(kiln_backend *be, float *dx, float *dgate, const float *dout,
                                    const float *x, const float *gate, size_t n) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return;
    after_launch(c, kiln_cuda_sigmoid_mul_backward(c->stream, dx, dgate, dout, x, gate, n),
                 "sigmoid_mul_backward");
}

/* ---- the table ----------------------------------------------------------------------------- */

static bool cu_supports_op(const kiln_backend *be, kiln_op op, kiln_dtype wtype) {
    (void)be;
    switch (op) {
    case KILN_OP_EMBED: case KILN_OP_MATMUL:
        return kiln_cuda_dtype_supported(wtype);
    case KILN_OP_RMSNORM: case KILN_OP_ROPE: case KILN_OP_ATTENTION: case KILN_OP_SWIGLU:
    case KILN_OP_ADD:
        return true;
    case KILN_OP_MATMUL_BACKWARD:
        return kiln_cuda_backward_dtype_supported(wtype);
    case KILN_OP_RMSNORM_BACKWARD: case KILN_OP_ROPE_BACKWARD: case KILN_OP_ATTENTION_BACKWARD:
    case KILN_OP_SWIGLU_BACKWARD: case KILN_OP_EMBED_BACKWARD:
        return true;
    default:
        return false;
    }
}

static void cu_free(kiln_backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        for (size_t k = 0; k < c->n_weights; k++) cudaFree(c->weights[k].dev);
        kiln_free(c->weights);
        if (c->ints) cudaFree(c->ints);
        kiln_free(c->h_plan);
        if (c->d_plan) cudaFree(c->d_plan);
        for (int k = 0; k < UPLOAD_SLOTS; k++) {
            if (c->up[k].buf) cudaFreeHost(c->up[k].buf);
            if (c->up[k].ev) cudaEventDestroy(c->up[k].ev);
        }
        if (c->down_buf) cudaFreeHost(c->down_buf);
        if (c->down_ev) cudaEventDestroy(c->down_ev);
        if (c->colsum_ws) cudaFree(c->colsum_ws);
        if (c->gather) cudaFree(c->gather);
        kiln_cuda_gemm_free(c->gemm);
        kiln_cuda_sampler_free(c->sampler);
        if (c->hist) cudaFree(c->hist);
        if (c->h_token) cudaFreeHost(c->h_token);
        kiln_cuda_attn_free(c->attn);
        for (size_t k = 0; k < c->n_mx_w; k++) kiln_cuda_mx_free(&c->mx_w[k].m);
        kiln_free(c->mx_w);
        if (c->mx_a) cudaFree(c->mx_a);
        if (c->mx_b) cudaFree(c->mx_b);
        if (c->mx_ws) cudaFree(c->mx_ws);
        kiln_free(c->wf.e);
        if (c->stream) cudaStreamDestroy(c->stream);
        kiln_free(c);
    }
    kiln_free(be);
}

/* ops.h forget: drop the cached copies of weights overlapping [host, host + nbytes) (their
 * host memory is going away). Waits for the work that may read them. */
static void cu_forget(kiln_backend *be, const void *host, size_t nbytes) {
    cuda_ctx *c = ctx_of(be);
    cudaSetDevice(c->device);
    const uint8_t *lo = (const uint8_t *)host, *hi = lo + nbytes;
    size_t kept = 0;
    int synced = 0;
    for (size_t k = 0; k < c->n_weights; k++) {
        weight_entry *e = &c->weights[k];
        if (e->host < hi && lo < e->host + e->nbytes) {
            if (!synced) {
                (void)cudaStreamSynchronize(c->stream);
                synced = 1;
            }
            cudaFree(e->dev);
            continue;
        }
        c->weights[kept++] = *e;
    }
    c->n_weights = kept;
    mx_forget(c, lo, hi);
}

/* Device or managed memory (the training ops' checks of what they were handed). */
static bool cu_holds(const kiln_backend *be, const void *p) {
    (void)be;
    return kiln_cuda_train_is_device(p);
}

static const kiln_backend_i cuda_iface = {
    /* .name = */ "cuda",
    /* .host_memory = */ false,
    /* .free = */ cu_free,
    /* .supports_op = */ cu_supports_op,
    /* .embed = */ cu_embed,
    /* .rmsnorm = */ cu_rmsnorm,
    /* .matmul = */ cu_matmul,
    /* .rope = */ cu_rope,
    /* .attention = */ cu_attention,
    /* .swiglu = */ cu_swiglu,
    /* .add = */ cu_add,
    /* .matmul_backward = */ cu_matmul_backward,
    /* .rmsnorm_backward = */ cu_rmsnorm_backward,
    /* .rope_backward = */ cu_rope_backward,
    /* .attention_backward = */ cu_attention_backward,
    /* .swiglu_backward = */ cu_swiglu_backward,
    /* .embed_backward = */ cu_embed_backward,
    /* .alloc = */ cu_alloc,
    /* .free_buf = */ cu_free_buf,
    /* .upload = */ cu_upload,
    /* .download = */ cu_download,
    /* .status = */ cu_status,
    /* .graph_begin = */ cu_graph_begin,
    /* .graph_end = */ cu_graph_end,
    /* .graph_launch = */ cu_graph_launch,
    /* .graph_free = */ cu_graph_free,
    /* .zero = */ cu_zero,
    /* .scale = */ cu_scale,
    /* .sample = */ cu_sample,
    /* .attention_seqs = */ cu_attention_seqs,
    /* .attention_backward_seqs = */ cu_attention_backward_seqs,
    /* .matmul_multi = */ cu_matmul_multi,
    /* .matmul_backward_multi = */ cu_matmul_backward_multi,
    /* .to_bf16 = */ cu_to_bf16,
    /* .rmsnorm_bf16 = */ cu_rmsnorm_bf16,
    /* .swiglu_bf16 = */ cu_swiglu_bf16,
    /* .matmul_multi_bf16x = */ cu_matmul_multi_bf16x,
    /* .matmul_backward_multi_bf16x = */ cu_matmul_backward_multi_bf16x,
    /* .swiglu_backward_bf16 = */ cu_swiglu_backward_bf16,
    /* .rmsnorm_backward_bf16 = */ cu_rmsnorm_backward_bf16,
    /* .rope_backward_bf16 = */ cu_rope_backward_bf16,
    /* .to_bf16_2d = */ cu_to_bf16_2d,
    /* .matmul_backward_dx16 = */ cu_matmul_backward_dx16,
    /* .swiglu_backward_bf16_d16 = */ cu_swiglu_backward_bf16_d16,
    /* .own_memory = */ cu_own_memory,
    /* .download_begin = */ cu_download_begin,
    /* .download_end = */ cu_download_end,
    /* .attention_backward_seqs16 = */ cu_attention_backward_seqs16,
    /* .poll = */ cu_poll,
    /* .kv_store_rows = */ cu_kv_store_rows,
    /* .attention_paged = */ cu_attention_paged,
    /* .get_rows = */ cu_get_rows,
    /* .forget = */ cu_forget,
    /* .geglu = */ cu_geglu,
    /* .fused_ce_workspace = */ kiln_cuda_fused_ce_workspace,
    /* .fused_ce = */ kiln_cuda_fused_ce,
    /* .fused_kd = */ kiln_cuda_fused_kd,
    /* .adamw_workspace = */ kiln_cuda_adamw_op_workspace,
    /* .adamw_prepare = */ kiln_cuda_adamw_op_prepare,
    /* .adamw_step = */ kiln_cuda_adamw_op_step,
    /* .adamw_nonfinite = */ kiln_cuda_adamw_op_nonfinite,
    /* .adamw_grad_norm = */ kiln_cuda_adamw_op_grad_norm,
    /* .adamw_clip = */ kiln_cuda_adamw_op_clip,
    /* .holds = */ cu_holds,
    /* .geglu_backward = */ cu_geglu_backward,
    /* .conv1d_silu = */ cu_conv1d_silu,
    /* .gated_delta = */ cu_gated_delta,
    /* .gdn_gates = */ cu_gdn_gates,
    /* .sigmoid_mul = */ cu_sigmoid_mul,
    /* .split_halves = */ cu_split_halves,
    /* .join_halves = */ cu_join_halves,
    /* .rope_partial = */ cu_rope_partial,
    /* .rope_partial_backward = */ cu_rope_partial_backward,
    /* .conv1d_silu_backward = */ cu_conv1d_silu_backward,
    /* .gated_delta_backward = */ cu_gated_delta_backward,
    /* .gdn_gates_backward = */ cu_gdn_gates_backward,
    /* .sigmoid_mul_backward = */ cu_sigmoid_mul_backward,
    /* .products = */ cu_products,
    /* .rope_kv_store = */ cu_rope_kv_store,
    /* .grad_rounding = */ NULL, /* no exact formats on this backend yet */
    /* .copy = */ cu_copy_d2d,
    /* .bf16_words = */ cu_bf16_words,
    /* .native_stream = */ cu_native_stream,
};

/* An exact format's mode: products in the format (cu_products_mx), no multi-product entries
 * (the model makes separate matmul and matmul_backward calls, which run in the format), and
 * grad_rounding. */
static kiln_backend_i make_mx_iface() {
    kiln_backend_i i = cuda_iface;
    i.matmul_multi = NULL;
    i.matmul_backward_multi = NULL;
    i.products = cu_products_mx;
    i.grad_rounding = cu_grad_rounding;
    return i;
}
static const kiln_backend_i cuda_iface_mx = make_mx_iface();

/* Formats per weight (ops.h kiln_weight_formats): the mx table with the products that look up
 * each weight's format. */
static kiln_backend_i make_formats_iface() {
    kiln_backend_i i = cuda_iface_mx;
    i.products = cu_products_formats;
    return i;
}
static const kiln_backend_i cuda_iface_formats = make_formats_iface();

extern "C" kiln_status kiln_cuda_device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
        (void)cudaGetLastError();
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_device_memory: no CUDA device %d (%d present)", device, count);
    }
    int prev = 0;
    size_t f = 0, t = 0;
    cudaGetDevice(&prev);
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMemGetInfo(&f, &t);
    cudaSetDevice(prev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_device_memory: device %d: %s", device, cudaGetErrorString(e));
    }
    *free_bytes = f;
    *total_bytes = t;
    return KILN_OK;
}

extern "C" kiln_status kiln_backend_cuda_create(int device, kiln_backend **out) {
    return kiln_backend_cuda_create_mode(device, 0, out);
}

extern "C" kiln_status kiln_backend_cuda_create_mode(int device, int mode, kiln_backend **out) {
    return kiln_backend_cuda_create_formats(device, mode, NULL, out);
}

extern "C" kiln_status kiln_backend_cuda_create_formats(int device, int mode, const kiln_weight_formats *t,
                                                        kiln_backend **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_cuda_create: out is NULL");
    if (t && !t->n) t = NULL;
    if (t && mode != KILN_MODE_AUDITABLE && mode != KILN_MODE_MX16 && mode != KILN_MODE_MX8)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_cuda_create: formats per weight are an auditable "
                          "arithmetic (mode %d)", mode);
    *out = NULL;
    if (device < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_cuda_create: device %d < 0",
                          device);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_backend_cuda_create: no usable CUDA device: %s (%s)",
                          cudaGetErrorString(e), cudaGetErrorName(e));
    }
    if (device >= count)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_backend_cuda_create: device %d requested, %d present", device,
                          count);
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_backend_cuda_create: device %d: %s",
                          device, cudaGetErrorString(e));
    if (prop.major < 9)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_backend_cuda_create: device %d (%s) has compute capability "
                          "%d.%d; kiln's CUDA code is built for 9.0 and later",
                          device, prop.name, prop.major, prop.minor);
    kiln_backend *be = (kiln_backend *)kiln_calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)kiln_calloc(1, sizeof *c);
    if (!be || !c) {
        kiln_free(be);
        kiln_free(c);
        return kiln_error(KILN_ERR_NOMEM, "kiln_backend_cuda_create: out of memory");
    }
    c->device = device;
    c->fast = mode == KILN_MODE_FAST || mode == KILN_MODE_FAST_INVARIANT;
    c->invariant = mode == KILN_MODE_FAST_INVARIANT;
    c->mx = mode == KILN_MODE_MX16 ? KILN_MX16 : mode == KILN_MODE_MX8 ? KILN_MX8 : 0;
    be->i = t ? &cuda_iface_formats : c->mx ? &cuda_iface_mx : &cuda_iface;
    if (t) {
        c->wf.e = (kiln_weight_format *)kiln_malloc((size_t)t->n * sizeof *t->e);
        if (!c->wf.e) {
            kiln_free(be);
            kiln_free(c);
            return kiln_error(KILN_ERR_NOMEM, "kiln_backend_cuda_create: out of memory");
        }
        memcpy(c->wf.e, t->e, (size_t)t->n * sizeof *t->e);
        c->wf.n = t->n;
    }
    be->n_threads = 1;
    be->ctx = c;
    if (!CK(c, cudaSetDevice(device)) ||
        !CK(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking))) {
        kiln_status st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_backend_cuda_create: %s", c->msg);
        c->stream = NULL;
        cu_free(be);
        return st;
    }
    if (!CK(c, kiln_cuda_attention_setup())) {
        kiln_status st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_backend_cuda_create: %s", c->msg);
        cu_free(be);
        return st;
    }
    /* fast mode: settle now, outside any graph capture, whether the attention kernels take
     * their wgmma variants (cuda_matmul.h: a self-check on first use per device) */
    if (c->fast) (void)kiln_cuda_wgmma_usable(c->stream);
    *out = be;
    return KILN_OK;
}

/* ---- for cuda_fused_ce.cu (declared there) ------------------------------------------------- */

/* The GEMM handle the fast matmul uses, made on first use; NULL when poisoned. */
kiln_cuda_gemm *kiln_cuda_backend_gemm(kiln_backend *be);
kiln_cuda_gemm *kiln_cuda_backend_gemm(kiln_backend *be) {
    cuda_ctx *c = ctx_of(be);
    if (!op_begin(c)) return NULL;
    if (!c->gemm && !CK(c, kiln_cuda_gemm_create(c->device, &c->gemm))) return NULL;
    return c->gemm;
}
