/*
 * cpu_backend.c -- the CPU backend: the ops of ops.h on kiln's thread pool, with the inner
 * loops of the SIMD path chosen at creation (cpu_kernels.h).
 *
 * Parallel work is split statically into tasks; each output element belongs to exactly one
 * task and is computed in the order docs/ARITHMETIC.md defines, so results are the same for
 * every thread count and every SIMD path.
 */
#include "../ops.h"
#include "../../base/threadpool.h"
#include "cpu_kernels.h"
#include "cpu_train.h"
#include "backward.h"
#include "kernels_q8act.h"

#include "../mx.h"

#include <stdio.h>
#include <string.h>

typedef struct cpu_ctx {
    kiln_pool *pool;
    const kiln_cpu_kernels *k;
    /* fast mode (kiln_backend_cpu_create_mode): int8 activations for quantized weights at
     * every N, each (row, token) one dot whatever else is in the batch (so the fast mode is
     * batch-invariant; KILN_MODE_FAST_INVARIANT is the same); NULL in the default, exact mode */
    const kiln_q8act_kernels *q8;
    void *q8_buf; /* the quantized activations, grown on demand (never per call) */
    size_t q8_cap;
    /* an exact format (KILN_MODE_MX16 / MX8): every matmul in it; 0 in the other modes. The
     * weights are quantized on first use and kept (mx_w, dropped by forget); the activations
     * go to a scratch per reduction width and kind (mx_x: the widths a model's products have) */
    int mx;
    /* formats per weight (ops.h kiln_weight_formats; a copy, as kiln_format values): a weight
     * in the table takes its format's product, any other the mode's (mx) */
    kiln_weight_formats wf;
    struct mx_weight *mx_w;
    int n_mx_w, cap_mx_w;
    kiln_mx_matrix mx_x[4];
    /* training in an exact format with stochastic rounding (ops.h grad_rounding):
     * the backward's gradient operands rounded stochastically under sr_key, the backward's
     * products counted from 0 (sr_count) to key each one's random numbers */
    int sr_on;
    uint64_t sr_key, sr_count;
    kiln_status err; /* KILN_OK unless poisoned on purpose (kiln_backend_cpu_poison) */
    char msg[256];
} cpu_ctx;

/* A weight in the exact format: the matrix at data (R, C, dtype dt) quantized along C. */
typedef struct mx_weight {
    const void *data;
    size_t nbytes;
    int64_t R, C;
    kiln_dtype dt;
    int transposed; /* m is W^T (C, R) quantized along R: the backward's dx = dy W */
    kiln_mx_matrix m; /* m.kind: the format it was quantized in */
} mx_weight;

static cpu_ctx *ctx_of(kiln_backend *be) { return (cpu_ctx *)be->ctx; }

/* The kiln_mx_kind W's products take (0: the auditable f32 product): its entry in the
 * per-weight table, else the mode's. */
static int kind_of(const cpu_ctx *c, const kiln_tensor *W) {
    return kiln_weight_formats_kind(&c->wf, W->data, c->mx);
}

/* Split [0, n) into n_tasks contiguous ranges whose starts are multiples of align. */
static void split_range(int64_t n, int n_tasks, int task, int64_t align, int64_t *lo,
                        int64_t *hi) {
    int64_t chunk = (n + n_tasks - 1) / n_tasks;
    chunk = (chunk + align - 1) / align * align;
    *lo = (int64_t)task * chunk;
    *hi = *lo + chunk;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* Tasks for a job of `work` multiply-adds: one when it is below min_work (a dispatch costs
 * about a microsecond), else 4 per thread (threads claim them dynamically, which evens out
 * a descheduled thread on a busy machine), at most max_tasks. The split depends only on
 * the shapes and n_threads, and never changes results (each output is one task's work). */
static int n_tasks_for(const cpu_ctx *c, double work, double min_work, int64_t max_tasks) {
    int n = 4 * kiln_pool_n_threads(c->pool);
    if (work < min_work || kiln_pool_n_threads(c->pool) == 1) n = 1;
    if (n > max_tasks) n = (int)(max_tasks > 0 ? max_tasks : 1);
    return n;
}

/* ---- embed ---------------------------------------------------------------------------- */

typedef struct embed_job {
    float *out;
    const kiln_tensor *table;
    const int32_t *ids;
    int N, n_tasks;
    int64_t C;
    size_t row_bytes;
} embed_job;

static void embed_task(void *arg, int task, int thread) {
    const embed_job *j = arg;
    int64_t lo, hi;
    split_range(j->N, j->n_tasks, task, 1, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        const uint8_t *row = (const uint8_t *)j->table->data + (size_t)j->ids[n] * j->row_bytes;
        kiln_dequantize(j->table->dtype, row, j->out + n * j->C, j->C);
    }
}

static size_t row_bytes_of(kiln_dtype dt, int64_t C) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    return (size_t)(C / tr->block_size) * (size_t)tr->type_size;
}

static void cpu_embed(kiln_backend *be, float *out, const kiln_tensor *table, const int32_t *ids,
                      int N) {
    cpu_ctx *c = ctx_of(be);
    int64_t C = table->shape[table->n_dims - 1];
    embed_job j = {out, table, ids, N, 0, C, row_bytes_of(table->dtype, C)};
    j.n_tasks = n_tasks_for(c, (double)N * C, 65536, N);
    kiln_pool_run(c->pool, j.n_tasks, embed_task, &j);
}

/* ---- rmsnorm -------------------------------------------------------------------------- */

typedef struct rmsnorm_job {
    const kiln_cpu_kernels *k;
    float *out;
    const float *x, *w;
    int N, C, n_tasks;
    float eps;
} rmsnorm_job;

static void rmsnorm_task(void *arg, int task, int thread) {
    const rmsnorm_job *j = arg;
    int64_t lo, hi;
    split_range(j->N, j->n_tasks, task, 1, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        const float *x = j->x + n * j->C;
        float acc[KILN_DOT_LANES] = {0};
        j->k->dot_accum(acc, x, x, j->C);
        float r = kiln_rms_scale(kiln_lane16_reduce(acc), j->C, j->eps);
        j->k->scale_mul(j->out + n * j->C, x, r, j->w, j->C);
    }
}

static void cpu_rmsnorm(kiln_backend *be, float *out, const float *x, const float *w, int N,
                        int C, float eps) {
    cpu_ctx *c = ctx_of(be);
    rmsnorm_job j = {c->k, out, x, w, N, C, 0, eps};
    j.n_tasks = n_tasks_for(c, (double)N * C, 32768, N);
    kiln_pool_run(c->pool, j.n_tasks, rmsnorm_task, &j);
}

/* ---- matmul --------------------------------------------------------------------------- */

typedef struct matmul_job {
    const kiln_cpu_kernels *k;
    kiln_mm_args a;
    int64_t R;
    int n_tasks;
} matmul_job;

#define GENERIC_CHUNK 4096 /* elements dequantized at a time: a multiple of every block size */
#define GENERIC_TOKENS 64

/* Any dtype: dequantize a chunk of one row into L1 (kiln_dequantize: the reference bits),
 * then continue the 16 lane accumulators of up to 64 tokens over it. */
static void matmul_generic(const kiln_cpu_kernels *k, const kiln_mm_args *a, int64_t r0,
                           int64_t r1) {
    float buf[GENERIC_CHUNK];
    float acc[GENERIC_TOKENS][KILN_DOT_LANES];
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(a->dtype);
    for (int t0 = 0; t0 < a->N; t0 += GENERIC_TOKENS) {
        int nt = a->N - t0 < GENERIC_TOKENS ? a->N - t0 : GENERIC_TOKENS;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = a->w + (size_t)r * a->row_bytes;
            memset(acc, 0, sizeof acc);
            for (int64_t c0 = 0; c0 < a->C; c0 += GENERIC_CHUNK) {
                int64_t n = a->C - c0 < GENERIC_CHUNK ? a->C - c0 : GENERIC_CHUNK;
                const float *wv;
                if (a->dtype == KILN_DTYPE_F32) {
                    wv = (const float *)row + c0;
                } else {
                    size_t off = (size_t)(c0 / tr->block_size) * (size_t)tr->type_size;
                    kiln_dequantize(a->dtype, row + off, buf, n);
                    wv = buf;
                }
                for (int t = 0; t < nt; t++)
                    k->dot_accum(acc[t], a->x + (int64_t)(t0 + t) * a->ldx + c0, wv, n);
            }
            for (int t = 0; t < nt; t++) {
                float s = kiln_lane16_reduce(acc[t]);
                if (a->bias) s = s + a->bias[r];
                a->out[(int64_t)(t0 + t) * a->ldo + r] = s;
            }
        }
    }
}

static void matmul_task(void *arg, int task, int thread) {
    const matmul_job *j = arg;
    int64_t lo, hi;
    split_range(j->R, j->n_tasks, task, 4, &lo, &hi);
    if (lo >= hi) return;
    if (!j->k->matmul_rows(&j->a, lo, hi)) matmul_generic(j->k, &j->a, lo, hi);
}

/* Fast mode: x quantized once by the calling thread, then rows split over tasks; each
 * output is one task's (docs/ARITHMETIC.md, "Fast mode: 8-bit activations"). */
typedef struct q8_job {
    const kiln_q8act_kernels *q8;
    kiln_q8act_mm m;
    int64_t R;
    int n_tasks;
} q8_job;

static void q8_task(void *arg, int task, int thread) {
    const q8_job *j = arg;
    int64_t lo, hi;
    split_range(j->R, j->n_tasks, task, 4, &lo, &hi);
    if (lo < hi) j->q8->rows(&j->m, lo, hi);
}

/* Whether the int8 path ran (false: not fast mode, unsupported shape, or no memory, and the
 * caller runs the exact path). */
static bool matmul_q8act(cpu_ctx *c, float *out, const float *x, const kiln_tensor *W,
                         const float *bias, int N, int64_t R, int64_t C) {
    if (!c->q8 || N < 1 || !kiln_q8act_supports(W->dtype) || C % 32) return false;
    /* every token through the int8 path at once: each output is one (row, token) dot
     * whatever N is (the kernels' tiles of tokens change no bit) */
    size_t need = kiln_q8act_bytes(N, C);
    if (need == 0) return false;
    if (need > c->q8_cap) {
        void *nb = kiln_malloc(need);
        if (!nb) return false;
        kiln_free(c->q8_buf);
        c->q8_buf = nb;
        c->q8_cap = need;
    }
    kiln_q8act xa;
    kiln_q8act_init(&xa, c->q8_buf, N, C);
    c->q8->quantize(&xa, x, C);
    q8_job j = {c->q8, {&xa, (const uint8_t *)W->data, row_bytes_of(W->dtype, C), W->dtype,
                        bias, out, R}, R, 0};
    j.n_tasks = n_tasks_for(c, (double)N * R * C, 65536, (R + 15) / 16);
    kiln_pool_run(c->pool, j.n_tasks, q8_task, &j);
    return true;
}

/* ---- matmul in an exact format (KILN_MODE_MX16 / MX8; src/ops/mx.h) ------------------------ */

static void mx_poison(cpu_ctx *c, int kind, kiln_status st, const char *what, const kiln_tensor *W) {
    if (c->err != KILN_OK) return;
    c->err = st;
    snprintf(c->msg, sizeof c->msg, "matmul (%s) '%s': %s", kind == KILN_MX8 ? "mx8" : "mx16",
             W->name ? W->name : "?", what);
}

/* W (R, C) in format kind: from the cache, or dequantized to f32 and quantized now (kept
 * until kiln_backends_forget drops it). NULL (poisoned) when memory runs out. */
static const kiln_mx_matrix *mx_weight_of(cpu_ctx *c, int kind, const kiln_tensor *W, int64_t R, int64_t C,
                                          int transposed) {
    for (int i = 0; i < c->n_mx_w; i++) {
        const mx_weight *e = &c->mx_w[i];
        if (e->data == W->data && e->R == R && e->C == C && e->dt == W->dtype && e->transposed == transposed &&
            (int)e->m.kind == kind)
            return &e->m;
    }
    if (c->n_mx_w == c->cap_mx_w) {
        int cap = c->cap_mx_w ? 2 * c->cap_mx_w : 64;
        mx_weight *nw = kiln_realloc(c->mx_w, (size_t)cap * sizeof *nw);
        if (!nw) return NULL;
        c->mx_w = nw;
        c->cap_mx_w = cap;
    }
    mx_weight *e = &c->mx_w[c->n_mx_w];
    memset(e, 0, sizeof *e);
    const size_t rb = row_bytes_of(W->dtype, C);
    const int copy = W->dtype != KILN_DTYPE_F32 || transposed;
    float *deq = copy ? kiln_malloc((size_t)R * (size_t)C * sizeof(float)) : NULL;
    if (copy && !deq) return NULL;
    for (int64_t r = 0; deq && r < R; r++) {
        if (!transposed) {
            kiln_dequantize(W->dtype, (const uint8_t *)W->data + (size_t)r * rb, deq + r * C, C);
        } else { /* row r of W is column r of W^T (C, R) */
            float row[256];
            for (int64_t c0 = 0; c0 < C; c0 += 256) {
                const int64_t n = C - c0 < 256 ? C - c0 : 256;
                if (W->dtype == KILN_DTYPE_F32)
                    memcpy(row, (const float *)W->data + r * C + c0, (size_t)n * sizeof(float));
                else if (W->dtype == KILN_DTYPE_BF16 || W->dtype == KILN_DTYPE_F16)
                    kiln_dequantize(W->dtype, (const uint8_t *)W->data + (size_t)r * rb + (size_t)c0 * 2, row, n);
                else /* a block format: the whole row at once */
                    break;
                for (int64_t k = 0; k < n; k++) deq[(c0 + k) * R + r] = row[k];
            }
            if (W->dtype != KILN_DTYPE_F32 && W->dtype != KILN_DTYPE_BF16 && W->dtype != KILN_DTYPE_F16) {
                float *full = kiln_malloc((size_t)C * sizeof(float));
                if (!full) {
                    kiln_free(deq);
                    return NULL;
                }
                kiln_dequantize(W->dtype, (const uint8_t *)W->data + (size_t)r * rb, full, C);
                for (int64_t k = 0; k < C; k++) deq[k * R + r] = full[k];
                kiln_free(full);
            }
        }
    }
    kiln_status st = transposed ? kiln_mx_matrix_alloc(&e->m, (kiln_mx_kind)kind, C, R)
                                : kiln_mx_matrix_alloc(&e->m, (kiln_mx_kind)kind, R, C);
    if (st == KILN_OK)
        st = kiln_mx_quantize(&e->m, deq ? deq : (const float *)W->data,
                              transposed ? R : deq ? C : (int64_t)(rb / sizeof(float)), c->pool);
    kiln_free(deq);
    if (st != KILN_OK) {
        kiln_mx_matrix_free(&e->m);
        return NULL;
    }
    e->data = W->data;
    e->nbytes = (size_t)R * rb;
    e->R = R;
    e->C = C;
    e->dt = W->dtype;
    e->transposed = transposed;
    c->n_mx_w++;
    return &e->m;
}

/* The activations' scratch for width C in format kind with room for N rows (rows set to N). */
static kiln_mx_matrix *mx_act(cpu_ctx *c, int kind, int N, int64_t C) {
    kiln_mx_matrix *slot = NULL;
    for (int i = 0; i < 4 && !slot; i++)
        if (c->mx_x[i].mem && c->mx_x[i].K == C && (int)c->mx_x[i].kind == kind) slot = &c->mx_x[i];
    for (int i = 0; i < 4 && !slot; i++)
        if (!c->mx_x[i].mem) slot = &c->mx_x[i];
    if (!slot) slot = &c->mx_x[0]; /* a fifth (width, kind): reuse the first slot */
    if (!slot->mem || slot->K != C || (int)slot->kind != kind || slot->rows < N) {
        int64_t rows = slot->mem && slot->K == C && (int)slot->kind == kind && 2 * slot->rows > N ? 2 * slot->rows : N;
        kiln_mx_matrix_free(slot);
        if (kiln_mx_matrix_alloc(slot, (kiln_mx_kind)kind, rows, C) != KILN_OK) return NULL;
    }
    slot->rows = N; /* a prefix of the rows: the layout is row-major by block */
    return slot;
}

/* out(N,R) = x W^T (+ bias) in exact format kind, then the bias as f32 adds (the product,
 * then + bias[r]: the auditable matmul's order). */
static void matmul_mx(cpu_ctx *c, int kind, float *out, const float *x, const kiln_tensor *W, const float *bias,
                      int N, int64_t R, int64_t C) {
    if (c->err != KILN_OK || N <= 0 || R <= 0) return;
    if (C > KILN_MX_MAX_K) {
        mx_poison(c, kind, KILN_ERR_UNSUPPORTED, "the reduction is longer than the format's limit (262,144)", W);
        return;
    }
    const kiln_mx_matrix *w = mx_weight_of(c, kind, W, R, C, 0);
    kiln_mx_matrix *xa = w ? mx_act(c, kind, N, C) : NULL;
    if (!w || !xa) {
        mx_poison(c, kind, KILN_ERR_NOMEM, "out of memory for the quantized operands", W);
        return;
    }
    kiln_status st = kiln_mx_quantize(xa, x, C, c->pool);
    if (st == KILN_OK) st = kiln_mx_matmul_cpu(xa, w, out, R, c->pool, kiln_mx_path_for(c->k->path, N));
    if (st != KILN_OK) {
        mx_poison(c, kind, st, kiln_last_error(), W);
        return;
    }
    if (bias)
        for (int64_t n = 0; n < N; n++)
            for (int64_t r = 0; r < R; r++) out[n * R + r] = out[n * R + r] + bias[r];
}

/* ops.h grad_rounding: the key of kiln_mx_backward_key; the products counted from 0 */
static void cpu_grad_rounding(kiln_backend *be, int stochastic, uint64_t seed, uint64_t step, uint64_t micro) {
    cpu_ctx *c = ctx_of(be);
    c->sr_on = stochastic && (c->mx || c->wf.n);
    c->sr_key = kiln_mx_backward_key(seed, step, micro);
    c->sr_count = 0;
}

/* ops.h forget: drop the quantized copies of weights in [host, host + nbytes). */
static void cpu_forget(kiln_backend *be, const void *host, size_t nbytes) {
    cpu_ctx *c = ctx_of(be);
    const uintptr_t lo = (uintptr_t)host, hi = lo + nbytes;
    for (int i = 0; i < c->n_mx_w;) {
        mx_weight *e = &c->mx_w[i];
        const uintptr_t a = (uintptr_t)e->data;
        if (a < hi && lo < a + e->nbytes) {
            kiln_mx_matrix_free(&e->m);
            c->mx_w[i] = c->mx_w[--c->n_mx_w];
        } else {
            i++;
        }
    }
}

/* out(N,R) = x W^T (+ bias) in format kind (0: the mode's f32 product, exact or fast). */
static void matmul_in(cpu_ctx *c, int kind, float *out, const float *x, const kiln_tensor *W, const float *bias,
                      int N) {
    int64_t C = W->shape[W->n_dims - 1];
    int64_t R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    if (kind) {
        matmul_mx(c, kind, out, x, W, bias, N, R, C);
        return;
    }
    if (matmul_q8act(c, out, x, W, bias, N, R, C)) return;
    matmul_job j;
    j.k = c->k;
    j.a = (kiln_mm_args){out, R, x, C, (const uint8_t *)W->data, row_bytes_of(W->dtype, C),
                         W->dtype, C, bias, N};
    j.R = R;
    j.n_tasks = n_tasks_for(c, (double)N * R * C, 65536, (R + 15) / 16);
    kiln_pool_run(c->pool, j.n_tasks, matmul_task, &j);
}

static void cpu_matmul(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                       const float *bias, int N) {
    cpu_ctx *c = ctx_of(be);
    matmul_in(c, kind_of(c, W), out, x, W, bias, N);
}

void kiln_backend_cpu_matmul_f32(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                                 const float *bias, int N) {
    matmul_in(ctx_of(be), 0, out, x, W, bias, N);
}

/* ---- rope ----------------------------------------------------------------------------- */

static void cpu_rope(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                     const float *cos_tab, const float *sin_tab) {
    int half = HS / 2;
    for (int n = 0; n < N; n++) {
        const float *ct = cos_tab + (int64_t)pos[n] * half;
        const float *st = sin_tab + (int64_t)pos[n] * half;
        for (int h = 0; h < H; h++) {
            float *v = x + ((int64_t)n * H + h) * HS;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * ct[i] - b * st[i];
                v[i + half] = b * ct[i] + a * st[i];
            }
        }
    }
}

/* ---- attention ------------------------------------------------------------------------ */

typedef struct attn_job {
    const kiln_cpu_kernels *k;
    float *out;
    const float *q, *kc, *vc;
    int N, n_past, NH, KVH, HS, n_tasks;
    int group; /* query heads a work unit takes (attn_plan) */
    float scale;
    /* a paged cache (attention_paged): token i is at position pos[i] of sequence seq[i], its
     * keys found through pg; NULL: a dense cache, token i at n_past + i */
    const kiln_kv_pages *pg;
    const int32_t *seq, *pos;
    int window; /* > 0: only the last window positions (the token's own included) */
} attn_job;

/* Offset in rows of the key block starting at position kb (a multiple of KILN_ATTN_BLOCK) of
 * token i's sequence. */
static int64_t attn_block_row(const attn_job *j, int i, int kb) {
    if (!j->pg) return kb;
    const kiln_kv_pages *pg = j->pg;
    const int32_t block = pg->block_table[(int64_t)j->seq[i] * pg->max_blocks + kb / pg->block_size];
    return (int64_t)block * pg->block_size + kb % pg->block_size;
}

/* Query heads [h0, h0 + ng) of token i, all of one kv head (ng <= ATTN_GROUP_MAX): each head's
 * online softmax over key blocks of KILN_ATTN_BLOCK (docs/ARITHMETIC.md), its operations in
 * the definition's order. The heads go through each key block together: the block's keys and
 * values are read from L1 after the first head, and the heads' sequential chains (the block
 * max, the sum l) are interleaved, independent, so they overlap. An output row doubles as its
 * head's accumulator. */
#define ATTN_GROUP_MAX 8
static void attn_heads(const attn_job *j, int i, int h0, int ng) {
    const kiln_cpu_kernels *k = j->k;
    const int HS = j->HS;
    const int kvh = h0 / (j->NH / j->KVH);
    const int64_t stride = (int64_t)j->KVH * HS;
    const int T = (j->pg ? j->pos[i] : j->n_past + i) + 1; /* causal: keys 0..its position */
    /* a sliding window: keys from lo on, the blocks still aligned at multiples of 64 */
    const int lo = kiln_attn_window_lo(T, j->window);
    float s[ATTN_GROUP_MAX][KILN_ATTN_BLOCK], p[ATTN_GROUP_MAX][KILN_ATTN_BLOCK];
    float m[ATTN_GROUP_MAX], l[ATTN_GROUP_MAX], alpha[ATTN_GROUP_MAX], bm[ATTN_GROUP_MAX];
    const float *q[ATTN_GROUP_MAX];
    float *acc[ATTN_GROUP_MAX];
    for (int g = 0; g < ng; g++) {
        q[g] = j->q + ((int64_t)i * j->NH + h0 + g) * HS;
        acc[g] = j->out + ((int64_t)i * j->NH + h0 + g) * HS;
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < HS; d++) acc[g][d] = 0.0f;
    }
    for (int kb0 = lo / KILN_ATTN_BLOCK * KILN_ATTN_BLOCK; kb0 < T; kb0 += KILN_ATTN_BLOCK) {
        const int kb = kb0 > lo ? kb0 : lo; /* the block's first key */
        int nk = T - kb0 < KILN_ATTN_BLOCK ? T - kb : kb0 + KILN_ATTN_BLOCK - kb;
        const int64_t row = attn_block_row(j, i, kb0) + (kb - kb0);
        const float *kr = j->kc + row * stride + (int64_t)kvh * HS;
        const float *vr = j->vc + row * stride + (int64_t)kvh * HS;
        for (int g = 0; g < ng; g++) {
            k->dots(s[g], q[g], kr, stride, nk, HS);
            bm[g] = -INFINITY;
        }
        for (int t = 0; t < nk; t++)
            for (int g = 0; g < ng; g++) {
                s[g][t] = s[g][t] * j->scale;
                bm[g] = s[g][t] > bm[g] ? s[g][t] : bm[g];
            }
        for (int g = 0; g < ng; g++) {
            const float m_new = bm[g] > m[g] ? bm[g] : m[g];
            alpha[g] = kiln_expf(m[g] - m_new);
            k->exp_sub(p[g], s[g], m_new, nk);
            l[g] = l[g] * alpha[g];
            m[g] = m_new;
        }
        for (int t = 0; t < nk; t++)
            for (int g = 0; g < ng; g++) l[g] = l[g] + p[g][t];
        for (int g = 0; g < ng; g++) k->attn_pv(acc[g], alpha[g], p[g], vr, stride, nk, HS);
    }
    for (int g = 0; g < ng; g++)
        for (int d = 0; d < HS; d++) acc[g][d] = acc[g][d] / l[g];
}

/* The work units: (token, kv head, group of up to gs of its query heads), gs = j->group. */
static void attn_task(void *arg, int task, int thread) {
    (void)thread;
    const attn_job *j = arg;
    const int G = j->NH / j->KVH, gs = j->group, n_groups = (G + gs - 1) / gs;
    int64_t lo, hi;
    split_range((int64_t)j->N * j->KVH * n_groups, j->n_tasks, task, 1, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int i = (int)(u / ((int64_t)j->KVH * n_groups));
        const int rest = (int)(u % ((int64_t)j->KVH * n_groups)), kvh = rest / n_groups, g0 = rest % n_groups * gs;
        attn_heads(j, i, kvh * G + g0, G - g0 < gs ? G - g0 : gs);
    }
}

/* Heads a work unit takes (attn_task) and the tasks for `work`: groups of a kv head's query
 * heads, at most ATTN_GROUP_MAX, halved only while some thread would have no unit. A unit
 * reads its kv head's keys and values once for all its heads, and a decode step at a long
 * context is bound by those reads: splitting a group to balance the threads reads them again
 * (SmolLM2 at 4,096 positions, 3 kv heads on 2 threads: 45 tok/s with whole groups against 36
 * with single heads). */
static void attn_plan(const cpu_ctx *c, attn_job *j, double work) {
    const int G = j->NH / j->KVH, threads = kiln_pool_n_threads(c->pool);
    int gs = G < ATTN_GROUP_MAX ? G : ATTN_GROUP_MAX;
    while (gs > 1 && (int64_t)j->N * j->KVH * ((G + gs - 1) / gs) < (int64_t)threads) gs = (gs + 1) / 2;
    j->group = gs;
    j->n_tasks = n_tasks_for(c, work, 16384, (int64_t)j->N * j->KVH * ((G + gs - 1) / gs));
}

static void cpu_attention(kiln_backend *be, float *out, const float *q, const float *k,
                          const float *v, int N, int n_past, int NH, int KVH, int HS,
                          float scale, int window) {
    cpu_ctx *c = ctx_of(be);
    attn_job j = {c->k, out, q, k, v, N, n_past, NH, KVH, HS, 0, 1, scale, NULL, NULL, NULL, window};
    attn_plan(c, &j, (double)N * NH * HS * (n_past + N));
    kiln_pool_run(c->pool, j.n_tasks, attn_task, &j);
}

/* ---- elementwise ---------------------------------------------------------------------- */

typedef struct ew_job {
    const kiln_cpu_kernels *k;
    float *out;
    const float *a, *b;
    size_t n;
    int n_tasks;
} ew_job;

static void swiglu_task(void *arg, int task, int thread) {
    const ew_job *j = arg;
    int64_t lo, hi;
    split_range((int64_t)j->n, j->n_tasks, task, 64, &lo, &hi);
    if (lo < hi) j->k->swiglu(j->out + lo, j->a + lo, j->b + lo, (size_t)(hi - lo));
}

static void add_task(void *arg, int task, int thread) {
    const ew_job *j = arg;
    int64_t lo, hi;
    split_range((int64_t)j->n, j->n_tasks, task, 64, &lo, &hi);
    if (lo < hi) j->k->add(j->out + lo, j->a + lo, (size_t)(hi - lo));
}

static void cpu_swiglu(kiln_backend *be, float *out, const float *gate, const float *up,
                       size_t n) {
    cpu_ctx *c = ctx_of(be);
    ew_job j = {c->k, out, gate, up, n, 0};
    j.n_tasks = n_tasks_for(c, (double)n * 8, 65536, (int64_t)(n / 64) + 1);
    kiln_pool_run(c->pool, j.n_tasks, swiglu_task, &j);
}

static void cpu_add(kiln_backend *be, float *x, const float *y, size_t n) {
    cpu_ctx *c = ctx_of(be);
    ew_job j = {c->k, x, y, NULL, n, 0};
    j.n_tasks = n_tasks_for(c, (double)n, 65536, (int64_t)(n / 64) + 1);
    kiln_pool_run(c->pool, j.n_tasks, add_task, &j);
}

/* ---- backward (backward_portable.c) ------------------------------------------------------ */

/* t(cols, rows) = a(rows, cols)^T, strips of 32 columns of a as the pool's tasks. */
typedef struct transpose_job {
    float *t;
    const float *a;
    int64_t rows, cols;
} transpose_job;

static void transpose_task(void *ctx, int task, int thread) {
    (void)thread;
    const transpose_job *j = ctx;
    const int64_t j0 = (int64_t)task * 32, j1 = j0 + 32 < j->cols ? j0 + 32 : j->cols;
    for (int64_t i0 = 0; i0 < j->rows; i0 += 32)
        for (int64_t i = i0; i < j->rows && i < i0 + 32; i++)
            for (int64_t c = j0; c < j1; c++) j->t[c * j->rows + i] = j->a[i * j->cols + c];
}

static void transpose_f32(kiln_pool *pool, float *t, const float *a, int64_t rows, int64_t cols) {
    transpose_job j = {t, a, rows, cols};
    kiln_pool_run(pool, (int)((cols + 31) / 32), transpose_task, &j);
}

/* The backward of matmul in the backend's exact format (docs/ARITHMETIC.md, "Exact block
 * formats": training), each product one mx product along its own reduction axis:
 *   dx(N, C)  = dy(N, R) W(R, C):   dy quantized along R, W^T (cached like W) along R;
 *   dW(R, C) += dy^T x:             dy^T (R, N) and x^T (C, N) quantized along N;
 * each rounded once to f32, then (accumulate_dx, dW) added to the destination as f32 adds.
 * With stochastic rounding on (ops.h grad_rounding) dy and dy^T are quantized
 * stochastically, tensor ids 2i and 2i + 1 for the backward's i-th product; W^T and x^T to
 * nearest even. dbias: the f32 sum over the tokens, as the exact path. */
static void matmul_backward_mx(cpu_ctx *c, int kind, float *dx, float *dW, float *dbias, const float *dy,
                               const float *x, const kiln_tensor *W, int N, bool accumulate_dx) {
    const int64_t C = W->shape[W->n_dims - 1], R = C > 0 ? kiln_tensor_nelements(W) / C : 0;
    /* this product's tensor ids under stochastic rounding: 2i for dy, 2i + 1 for dy^T */
    const uint64_t sr_id = 2 * c->sr_count++;
    if (c->err != KILN_OK || N <= 0 || R <= 0) return;
    if (dbias) kiln_cpu_matmul_backward(c->pool, c->k, NULL, NULL, dbias, dy, x, W, N, false);
    if (R > KILN_MX_MAX_K || N > KILN_MX_MAX_K) {
        mx_poison(c, kind, KILN_ERR_UNSUPPORTED, "the backward's reduction is longer than the format's limit (262,144)", W);
        return;
    }
    kiln_status st = KILN_OK;
    if (dx) {
        const kiln_mx_matrix *wt = mx_weight_of(c, kind, W, R, C, 1);
        kiln_mx_matrix q = {0};
        st = !wt ? KILN_ERR_NOMEM : kiln_mx_matrix_alloc(&q, (kiln_mx_kind)kind, N, R);
        if (st == KILN_OK)
            st = c->sr_on ? kiln_mx_quantize_stochastic(&q, dy, R, c->sr_key, sr_id, c->pool)
                          : kiln_mx_quantize(&q, dy, R, c->pool);
        const kiln_cpu_path p = kiln_mx_path_for(c->k->path, N);
        if (st == KILN_OK)
            st = accumulate_dx ? kiln_mx_matmul_add_cpu(&q, wt, dx, C, c->pool, p)
                               : kiln_mx_matmul_cpu(&q, wt, dx, C, c->pool, p);
        kiln_mx_matrix_free(&q);
    }
    if (dW && st == KILN_OK) {
        kiln_mx_matrix qd = {0}, qx = {0};
        float *t = kiln_malloc(((size_t)R + (size_t)C) * (size_t)N * sizeof(float));
        st = t ? kiln_mx_matrix_alloc(&qd, (kiln_mx_kind)kind, R, N) : KILN_ERR_NOMEM;
        if (st == KILN_OK) st = kiln_mx_matrix_alloc(&qx, (kiln_mx_kind)kind, C, N);
        if (st == KILN_OK) {
            transpose_f32(c->pool, t, dy, N, R);
            transpose_f32(c->pool, t + (size_t)R * N, x, N, C);
            st = c->sr_on ? kiln_mx_quantize_stochastic(&qd, t, N, c->sr_key, sr_id + 1, c->pool)
                          : kiln_mx_quantize(&qd, t, N, c->pool);
        }
        if (st == KILN_OK) st = kiln_mx_quantize(&qx, t + (size_t)R * N, N, c->pool);
        if (st == KILN_OK) st = kiln_mx_matmul_add_cpu(&qd, &qx, dW, C, c->pool, kiln_mx_path_for(c->k->path, R));
        kiln_mx_matrix_free(&qd);
        kiln_mx_matrix_free(&qx);
        kiln_free(t);
    }
    if (st != KILN_OK)
        mx_poison(c, kind, st, st == KILN_ERR_NOMEM ? "out of memory for the backward's quantized operands" : kiln_last_error(),
                  W);
}

static void cpu_matmul_backward(kiln_backend *be, float *dx, float *dW, float *dbias,
                                const float *dy, const float *x, const kiln_tensor *W, int N,
                                bool accumulate_dx) {
    cpu_ctx *c = ctx_of(be);
    const int kind = kind_of(c, W);
    if (kind) {
        matmul_backward_mx(c, kind, dx, dW, dbias, dy, x, W, N, accumulate_dx);
        return;
    }
    kiln_cpu_matmul_backward(c->pool, c->k, dx, dW, dbias, dy, x, W, N, accumulate_dx);
}

static void cpu_rmsnorm_backward(kiln_backend *be, float *dx, float *dw, const float *dy,
                                 const float *x, const float *w, int N, int C, float eps,
                                 float *rstd, bool accumulate_dx) {
    cpu_ctx *c = ctx_of(be);
    kiln_cpu_rmsnorm_backward(c->pool, c->k, dx, dw, dy, x, w, N, C, eps, rstd, accumulate_dx);
}

static void cpu_rope_backward(kiln_backend *be, float *d, const int32_t *pos, int N, int H,
                              int HS, const float *cos_tab, const float *sin_tab) {
    kiln_cpu_rope_backward(ctx_of(be)->pool, d, pos, N, H, HS, cos_tab, sin_tab);
}

static void cpu_attention_backward(kiln_backend *be, float *dq, float *dk, float *dv,
                                   const float *dout, const float *q, const float *k,
                                   const float *v, const float *out, float *ws, int N,
                                   int n_past, int NH, int KVH, int HS, float scale, int window) {
    cpu_ctx *c = ctx_of(be);
    kiln_cpu_attention_backward(c->pool, c->k, dq, dk, dv, dout, q, k, v, out, ws, N, n_past,
                                NH, KVH, HS, scale, window);
}

static void cpu_swiglu_backward(kiln_backend *be, float *dgate, float *dup, const float *dout,
                                const float *gate, const float *up, size_t n) {
    cpu_ctx *c = ctx_of(be);
    kiln_cpu_swiglu_backward(c->pool, c->k, dgate, dup, dout, gate, up, n);
}

static void cpu_geglu_backward(kiln_backend *be, float *dgate, float *dup, const float *dout,
                               const float *gate, const float *up, size_t n) {
    kiln_cpu_geglu_backward(ctx_of(be)->pool, dgate, dup, dout, gate, up, n);
}

static void cpu_embed_backward(kiln_backend *be, float *dtable, const float *dy,
                               const int32_t *ids, int N, int V, int C) {
    kiln_cpu_embed_backward(ctx_of(be)->pool, dtable, dy, ids, N, V, C);
}

/* ---- the table -------------------------------------------------------------------------- */

static bool cpu_supports_op(const kiln_backend *be, kiln_op op, kiln_dtype wtype) {
    (void)be;
    if (op < 0 || op >= KILN_OP_COUNT) return false;
    if (op == KILN_OP_MATMUL_BACKWARD)
        return wtype == KILN_DTYPE_F32 || wtype == KILN_DTYPE_BF16 || wtype == KILN_DTYPE_F16;
    if (op != KILN_OP_MATMUL && op != KILN_OP_EMBED) return true;
    switch (wtype) {
    case KILN_DTYPE_F32: case KILN_DTYPE_F16: case KILN_DTYPE_BF16: case KILN_DTYPE_Q8_0:
    case KILN_DTYPE_Q4_0: case KILN_DTYPE_Q4_1: case KILN_DTYPE_Q5_0: case KILN_DTYPE_Q5_1:
    case KILN_DTYPE_Q4_K: case KILN_DTYPE_Q5_K: case KILN_DTYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

static void cpu_free(kiln_backend *be) {
    cpu_ctx *c = ctx_of(be);
    if (c) {
        kiln_pool_free(c->pool);
        kiln_free(c->q8_buf);
        for (int i = 0; i < c->n_mx_w; i++) kiln_mx_matrix_free(&c->mx_w[i].m);
        kiln_free(c->mx_w);
        for (int i = 0; i < 4; i++) kiln_mx_matrix_free(&c->mx_x[i]);
        kiln_free(c->wf.e);
    }
    kiln_free(c);
    kiln_free(be);
}

/* ---- memory: host memory through kiln's allocator --------------------------------------- */

static void *cpu_alloc(kiln_backend *be, size_t nbytes) {
    (void)be;
    void *p = kiln_malloc(nbytes);
    if (!p) kiln_error(KILN_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes", nbytes);
    return p;
}

static void cpu_free_buf(kiln_backend *be, void *p) {
    (void)be;
    kiln_free(p);
}

static kiln_status cpu_copy(kiln_backend *be, void *dst, const void *src, size_t nbytes) {
    (void)be;
    if (nbytes) memcpy(dst, src, nbytes);
    return KILN_OK;
}

static kiln_status cpu_status(kiln_backend *be) {
    const cpu_ctx *c = ctx_of(be);
    return c->err == KILN_OK ? KILN_OK : kiln_error(c->err, "cpu backend: %s", c->msg);
}

void kiln_backend_cpu_poison(kiln_backend *be, kiln_status st, const char *msg) {
    if (!be || be->i->status != cpu_status || st == KILN_OK) return;
    cpu_ctx *c = ctx_of(be);
    if (c->err != KILN_OK) return; /* the first failure is the one kept */
    c->err = st;
    snprintf(c->msg, sizeof c->msg, "%s", msg ? msg : "poisoned");
}

static void cpu_zero(kiln_backend *be, float *x, size_t n) {
    (void)be;
    if (n) memset(x, 0, n * sizeof(float));
}

static void cpu_scale(kiln_backend *be, float *x, float s, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) x[i] = x[i] * s;
}

/* ops.h's batch ops on host memory. */
static void cpu_kv_store_rows(kiln_backend *be, float *k_pool, float *v_pool, const float *k_rows,
                              const float *v_rows, const int32_t *slots, int N, size_t row_floats) {
    (void)be;
    for (int n = 0; n < N; n++) {
        size_t off = (size_t)slots[n] * row_floats;
        memcpy(k_pool + off, k_rows + (size_t)n * row_floats, row_floats * sizeof(float));
        memcpy(v_pool + off, v_rows + (size_t)n * row_floats, row_floats * sizeof(float));
    }
}

static void cpu_attention_paged(kiln_backend *be, float *out, const float *q, const float *k_pool,
                                const float *v_pool, const kiln_kv_pages *pg, const int32_t *seq,
                                const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                                int max_T, int NH, int KVH, int HS, float scale, int window) {
    cpu_ctx *c = ctx_of(be);
    (void)runs;
    (void)n_runs;
    attn_job j = {c->k, out, q, k_pool, v_pool, N, 0, NH, KVH, HS, 0, 1, scale, pg, seq, pos, window};
    attn_plan(c, &j, (double)N * NH * HS * max_T);
    kiln_pool_run(c->pool, j.n_tasks, attn_task, &j);
}

static void geglu_task(void *arg, int task, int thread) {
    const ew_job *j = arg;
    (void)thread;
    int64_t lo, hi;
    split_range((int64_t)j->n, j->n_tasks, task, 64, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) j->out[i] = kiln_geglu(j->a[i], j->b[i]);
}

static void cpu_geglu(kiln_backend *be, float *out, const float *gate, const float *up, size_t n) {
    cpu_ctx *c = ctx_of(be);
    ew_job j = {c->k, out, gate, up, n, 0};
    j.n_tasks = n_tasks_for(c, (double)n * 16, 65536, (int64_t)(n / 64 + 1));
    kiln_pool_run(c->pool, j.n_tasks, geglu_task, &j);
}

static void cpu_get_rows(kiln_backend *be, float *out, const float *x, const int32_t *idx, int n, int C) {
    (void)be;
    for (int i = 0; i < n; i++) memcpy(out + (size_t)i * C, x + (size_t)idx[i] * C, (size_t)C * sizeof(float));
}

/* Qwen3.5's ops (cpu_linear_attn.c). */
static void cpu_conv1d_silu(kiln_backend *be, float *out, const float *x, const float *w, float *state,
                            const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                            int CH, int K) {
    kiln_cpu_conv1d_silu(ctx_of(be)->pool, out, x, w, state, seq, pos, runs, n_runs, N, CH, K);
}
static void cpu_gated_delta(kiln_backend *be, float *out, const float *qkv, const float *g, const float *beta,
                            float *state, const int32_t *seq, const int32_t *pos, const kiln_batch_run *runs,
                            int n_runs, int N, int nk, int nv, int dk, int dv, float scale) {
    kiln_cpu_gated_delta(ctx_of(be)->pool, out, qkv, g, beta, state, seq, pos, runs, n_runs, N, nk, nv, dk, dv,
                         scale);
}
static void cpu_gdn_gates(kiln_backend *be, float *g, float *beta, const float *a, const float *b,
                          const float *A_log, const float *dt_bias, int N, int nv) {
    (void)be;
    kiln_cpu_gdn_gates(g, beta, a, b, A_log, dt_bias, N, nv);
}
static void cpu_sigmoid_mul(kiln_backend *be, float *out, const float *x, const float *gate, size_t n) {
    (void)be;
    kiln_cpu_sigmoid_mul(out, x, gate, n);
}
static void cpu_split_halves(kiln_backend *be, float *a, float *b, const float *x, int64_t rows, int n) {
    (void)be;
    kiln_cpu_split_halves(a, b, x, rows, n);
}
static void cpu_join_halves(kiln_backend *be, float *x, const float *a, const float *b, int64_t rows, int n) {
    (void)be;
    kiln_cpu_join_halves(x, a, b, rows, n);
}
static void cpu_rope_partial(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS, int rot,
                             const float *cos_tab, const float *sin_tab) {
    (void)be;
    kiln_cpu_rope_partial(x, pos, N, H, HS, rot, cos_tab, sin_tab, 0);
}
static void cpu_rope_partial_backward(kiln_backend *be, float *d, const int32_t *pos, int N, int H, int HS, int rot,
                                      const float *cos_tab, const float *sin_tab) {
    (void)be;
    kiln_cpu_rope_partial(d, pos, N, H, HS, rot, cos_tab, sin_tab, 1);
}
static void cpu_conv1d_silu_backward(kiln_backend *be, float *dx, float *dw, const float *dout, const float *x,
                                     const float *w, int n_seq, int T, int CH, int K) {
    kiln_cpu_conv1d_silu_backward(ctx_of(be)->pool, dx, dw, dout, x, w, n_seq, T, CH, K);
}
static void cpu_gated_delta_backward(kiln_backend *be, float *dqkv, float *dg, float *dbeta, const float *dout,
                                     const float *qkv, const float *g, const float *beta, float *ws, int n_seq,
                                     int T, int nk, int nv, int dk, int dv, float scale) {
    kiln_cpu_gated_delta_backward(ctx_of(be)->pool, dqkv, dg, dbeta, dout, qkv, g, beta, ws, n_seq, T, nk, nv, dk,
                                  dv, scale);
}
static void cpu_gdn_gates_backward(kiln_backend *be, float *da, float *db, float *dA_log, float *ddt_bias,
                                   const float *dg, const float *dbeta, const float *a, const float *b,
                                   const float *A_log, const float *dt_bias, int N, int nv) {
    (void)be;
    kiln_cpu_gdn_gates_backward(da, db, dA_log, ddt_bias, dg, dbeta, a, b, A_log, dt_bias, N, nv);
}
static void cpu_sigmoid_mul_backward(kiln_backend *be, float *dx, float *dgate, const float *dout, const float *x,
                                     const float *gate, size_t n) {
    (void)be;
    kiln_cpu_sigmoid_mul_backward(dx, dgate, dout, x, gate, n);
}

/* AdamW (cpu_adamw.c) on the backend's pool. */
static size_t cpu_adamw_workspace(kiln_backend *be, const kiln_adamw_table *tab) {
    (void)be;
    return kiln_cpu_adamw_workspace(tab);
}
static kiln_status cpu_adamw_prepare(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                     int init) {
    return kiln_cpu_adamw_prepare(ctx_of(be)->pool, tab, ws, init);
}
static kiln_status cpu_adamw_step(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                  const kiln_adamw_scalars *s) {
    return kiln_cpu_adamw_step(ctx_of(be)->pool, tab, ws, s);
}
static kiln_status cpu_adamw_nonfinite(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                       int64_t *bad) {
    return kiln_cpu_adamw_nonfinite(ctx_of(be)->pool, tab, ws, bad);
}
static kiln_status cpu_adamw_grad_norm(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                       float *norms, float *sq, float *total) {
    return kiln_cpu_adamw_grad_norm(ctx_of(be)->pool, tab, ws, norms, sq, total);
}
static kiln_status cpu_adamw_clip(kiln_backend *be, const kiln_adamw_table *tab, void *ws,
                                  float max_norm_f, float *total, float *coef) {
    return kiln_cpu_adamw_clip(ctx_of(be)->pool, tab, ws, max_norm_f, total, coef);
}

static const kiln_backend_i cpu_iface = {
    .name = "cpu",
    .host_memory = true,
    .free = cpu_free,
    .supports_op = cpu_supports_op,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .matmul_backward = cpu_matmul_backward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rope_backward = cpu_rope_backward,
    .attention_backward = cpu_attention_backward,
    .swiglu_backward = cpu_swiglu_backward,
    .embed_backward = cpu_embed_backward,
    .alloc = cpu_alloc,
    .free_buf = cpu_free_buf,
    .upload = cpu_copy,
    .download = cpu_copy,
    .status = cpu_status,
    .forget = cpu_forget,
    .grad_rounding = cpu_grad_rounding,
    .kv_store_rows = cpu_kv_store_rows,
    .attention_paged = cpu_attention_paged,
    .get_rows = cpu_get_rows,
    .geglu = cpu_geglu,
    .geglu_backward = cpu_geglu_backward,
    .zero = cpu_zero,
    .scale = cpu_scale,
    .fused_ce_workspace = kiln_cpu_fused_ce_workspace,
    .fused_ce = kiln_cpu_fused_ce,
    .fused_kd = kiln_cpu_fused_kd,
    .adamw_workspace = cpu_adamw_workspace,
    .adamw_prepare = cpu_adamw_prepare,
    .adamw_step = cpu_adamw_step,
    .adamw_nonfinite = cpu_adamw_nonfinite,
    .adamw_grad_norm = cpu_adamw_grad_norm,
    .adamw_clip = cpu_adamw_clip,
    .conv1d_silu = cpu_conv1d_silu,
    .gated_delta = cpu_gated_delta,
    .gdn_gates = cpu_gdn_gates,
    .sigmoid_mul = cpu_sigmoid_mul,
    .split_halves = cpu_split_halves,
    .join_halves = cpu_join_halves,
    .rope_partial = cpu_rope_partial,
    .rope_partial_backward = cpu_rope_partial_backward,
    .conv1d_silu_backward = cpu_conv1d_silu_backward,
    .gated_delta_backward = cpu_gated_delta_backward,
    .gdn_gates_backward = cpu_gdn_gates_backward,
    .sigmoid_mul_backward = cpu_sigmoid_mul_backward,
};

static const kiln_cpu_kernels *kernels_for(kiln_cpu_path p) {
#if defined(KILN_CPU_HAVE_X86)
    if (p == KILN_CPU_PATH_AVX512) return &kiln_cpu_kernels_avx512;
    if (p == KILN_CPU_PATH_AVX2) return &kiln_cpu_kernels_avx2;
#else
    (void)p;
#endif
    return &kiln_cpu_kernels_portable;
}

kiln_status kiln_backend_cpu_create(int n_threads, kiln_backend **out) {
    return kiln_backend_cpu_create_mode(n_threads, 0, out);
}

kiln_status kiln_backend_cpu_create_mode(int n_threads, int fast_q8, kiln_backend **out) {
    return kiln_backend_cpu_create_formats(n_threads, fast_q8, NULL, out);
}

kiln_status kiln_backend_cpu_create_formats(int n_threads, int fast_q8, const kiln_weight_formats *t,
                                            kiln_backend **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_cpu_create: out is NULL");
    *out = NULL;
    if (n_threads < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_cpu_create: n_threads %d < 0",
                          n_threads);
    kiln_backend *be = kiln_calloc(1, sizeof *be);
    cpu_ctx *c = kiln_calloc(1, sizeof *c);
    if (!be || !c) {
        kiln_free(be);
        kiln_free(c);
        return kiln_error(KILN_ERR_NOMEM, "kiln_backend_cpu_create: out of memory");
    }
    kiln_status st = kiln_pool_create(n_threads, &c->pool);
    if (st != KILN_OK) {
        kiln_free(be);
        kiln_free(c);
        return kiln_error_prefix(st, "kiln_backend_cpu_create");
    }
    c->k = kernels_for(kiln_cpu_select_path());
    if (t && t->n) {
        c->wf.e = kiln_malloc((size_t)t->n * sizeof *t->e);
        if (!c->wf.e) {
            kiln_pool_free(c->pool);
            kiln_free(be);
            kiln_free(c);
            return kiln_error(KILN_ERR_NOMEM, "kiln_backend_cpu_create: out of memory");
        }
        memcpy(c->wf.e, t->e, (size_t)t->n * sizeof *t->e);
        c->wf.n = t->n;
    }
    if (fast_q8 == KILN_MODE_MX16 || fast_q8 == KILN_MODE_MX8) {
        c->mx = fast_q8 == KILN_MODE_MX16 ? KILN_MX16 : KILN_MX8;
    } else if (fast_q8) {
        c->q8 = &kiln_q8act_kernels_portable;
#if defined(KILN_CPU_HAVE_X86)
        if (c->k->path != KILN_CPU_PATH_PORTABLE) c->q8 = &kiln_q8act_kernels_avx2;
        if (c->k->path == KILN_CPU_PATH_AVX512 && kiln_cpu_get_features()->avx512vnni) c->q8 = &kiln_q8act_kernels_vnni;
#endif
    }
    be->i = &cpu_iface;
    be->n_threads = kiln_pool_n_threads(c->pool);
    be->ctx = c;
    *out = be;
    return KILN_OK;
}

kiln_cpu_path kiln_backend_cpu_path(const kiln_backend *be) {
    return ((const cpu_ctx *)be->ctx)->k->path;
}

kiln_pool *kiln_backend_cpu_pool(kiln_backend *be) { return ctx_of(be)->pool; }

int kiln_backend_cpu_weight_format(const kiln_backend *be, const void *data) {
    const cpu_ctx *c = be->ctx;
    return kiln_weight_formats_kind(&c->wf, data, c->mx);
}
