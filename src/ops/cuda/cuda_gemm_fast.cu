/*
 * cuda_gemm_fast.cu -- the fast mode's matrix products on bf16 tensor cores through cuBLASLt
 * (contract, arithmetic and what determinism rests on: cuda_gemm_fast.h).
 *
 * Layout. kiln's matrices are row-major; cuBLASLt's are column-major. A row-major (r x c)
 * matrix with leading dimension ld is, read column-major, its transpose (c x r) with the same
 * ld. So the row-major product D(M,N) = A'(M,K) B'(K,N) is the column-major product
 * D^T(N,M) = B'^T(N,K) A'^T(K,M): cuBLASLt's first operand is kiln's B, its second kiln's A,
 * with m = N, n = M, k = K, and each transpose flag carries over to its own operand:
 *   kiln's B stored (K,N)  (B' = B)     = column-major (N x K) = B'^T    -> op N
 *   kiln's B stored (N,K)  (B' = B^T)   = column-major (K x N) = B'      -> op T
 *   kiln's A stored (M,K)  (A' = A)     = column-major (K x M) = A'^T    -> op N
 *   kiln's A stored (K,M)  (A' = A^T)   = column-major (M x K) = A'      -> op T
 * The forward linear out(N,R) = x(N,C) W(R,C)^T is the case A = x, B = W stored (R,C), i.e.
 * cuBLASLt's "TN" product (both operands contiguous along k), D = W x^T of (R x N).
 */
#include "cuda_gemm_fast.h"

#include "cuda_common.cuh"

#include <cublasLt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEMM_WORKSPACE_BYTES ((size_t)32 << 20)
#define CONV_THREADS 256
#define GRID_Y_MAX 65535

/* ---- device side: conversions and the bias kernel ----------------------------------------- */


/* The conversions are elementwise (so vectorising cannot change a bit). Thread t of block
 * (bx, by) converts the run of VEC columns starting at c0 = (bx * CONV_THREADS + t) * VEC in
 * rows by, by + gridDim.y, ...: one vector load and store when the run is whole and aligned,
 * else element by element up to the last column. */
#define F32_VEC 4 /* float4 in, 4 bf16 (8 bytes) out */
#define W_VEC 8   /* 8 bf16 (16 bytes) out; divides every block size (32, 256) */

static __device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16); /* little-endian: lo at the lower address */
}

/* f32 -> bf16: unlike the grid of the other conversions (a block row per matrix row, idle
 * threads past a narrow row's end), one thread per run of F32_VEC columns of the whole
 * matrix, numbered row-major (i -> row i / runs, run i % runs), so every thread has work
 * whatever the width. */
static __global__ void f32_to_bf16_kernel(uint16_t *__restrict__ dst, int64_t ld_dst,
                                          const float *__restrict__ src, int64_t ld_src,
                                          int64_t rows, int64_t cols) {
    const int64_t runs = (cols + F32_VEC - 1) / F32_VEC;
    const int64_t i = (int64_t)blockIdx.x * CONV_THREADS + threadIdx.x;
    if (i >= rows * runs) return;
    const int64_t r = i / runs, c0 = (i - r * runs) * F32_VEC;
    const float *sp = src + r * ld_src + c0;
    uint16_t *dp = dst + r * ld_dst + c0;
    if (c0 + F32_VEC <= cols && ((uintptr_t)sp & 15u) == 0 && ((uintptr_t)dp & 7u) == 0) {
        const float4 v = *(const float4 *)sp;
        uint2 o;
        o.x = pack2(kiln_bf16_rne(v.x), kiln_bf16_rne(v.y));
        o.y = pack2(kiln_bf16_rne(v.z), kiln_bf16_rne(v.w));
        *(uint2 *)dp = o;
    } else {
        for (int j = 0; j < F32_VEC && c0 + j < cols; j++) dp[j] = kiln_bf16_rne(sp[j]);
    }
}

template <int DT>
static __global__ void weights_to_bf16_kernel(uint16_t *__restrict__ dst, int64_t ld_dst,
                                              const uint8_t *__restrict__ w, size_t row_bytes,
                                              int64_t R, int64_t C) {
    static_assert(blk<DT>::BS == 1 || blk<DT>::BS % W_VEC == 0, "a run must lie in one block");
    const int64_t c0 = ((int64_t)blockIdx.x * CONV_THREADS + threadIdx.x) * W_VEC;
    if (c0 >= C) return;
    for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        uint16_t *dp = dst + r * ld_dst + c0;
        if (c0 + W_VEC <= C) {
            /* quantized: the run lies in one block (c0 % 8 == 0, BS % 8 == 0), so its header
             * is loaded once for the 8 elements */
            const uint8_t *b = row + (c0 / blk<DT>::BS) * blk<DT>::TS;
            const int e0 = (int)(c0 % blk<DT>::BS);
            uint16_t v[W_VEC];
#pragma unroll
            for (int j = 0; j < W_VEC; j++)
                v[j] = kiln_bf16_rne(deq_blk<DT>(b, e0 + j)); /* plain: b = row + c0*TS, e0 = 0 */
            if (((uintptr_t)dp & 15u) == 0) {
                uint4 o;
                o.x = pack2(v[0], v[1]);
                o.y = pack2(v[2], v[3]);
                o.z = pack2(v[4], v[5]);
                o.w = pack2(v[6], v[7]);
                *(uint4 *)dp = o;
            } else {
#pragma unroll
                for (int j = 0; j < W_VEC; j++) dp[j] = v[j];
            }
        } else { /* the tail of a plain-type row */
            for (int j = 0; j < W_VEC && c0 + j < C; j++)
                dp[j] = kiln_bf16_rne(deq<DT>(row, c0 + j));
        }
    }
}

/* out(rows, cols; ldd) += bias(cols), row by row: the bias path when cuBLASLt's epilogue has
 * no algorithm for a problem (or the tests force it). */
static __global__ void add_bias_kernel(float *__restrict__ out, int64_t ldd,
                                       const float *__restrict__ bias, int64_t rows,
                                       int64_t cols) {
    const int64_t c = (int64_t)blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= cols) return;
    const float b = bias[c];
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) out[r * ldd + c] = out[r * ldd + c] + b;
}

/* The grid of the kernels above for a (rows x cols) matrix, vec columns per thread: column
 * runs over x, rows over y (strided past 65535). */
static bool conv_grid(int64_t rows, int64_t cols, int vec, dim3 *grid) {
    const int64_t per_block = (int64_t)CONV_THREADS * vec;
    const int64_t gx = (cols + per_block - 1) / per_block;
    if (rows <= 0 || cols <= 0 || gx > 0x7fffffff) return false;
    *grid = dim3((unsigned)gx, (unsigned)(rows < GRID_Y_MAX ? rows : GRID_Y_MAX), 1);
    return true;
}

cudaError_t kiln_cuda_f32_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst, const float *src,
                                  int64_t ld_src, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (!dst || !src || ld_dst < cols || ld_src < cols) return cudaErrorInvalidValue;
    const int64_t runs = (cols + F32_VEC - 1) / F32_VEC;
    if (rows > INT64_MAX / runs) return cudaErrorInvalidValue;
    const int64_t blocks = (rows * runs + CONV_THREADS - 1) / CONV_THREADS;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    f32_to_bf16_kernel<<<(unsigned)blocks, CONV_THREADS, 0, s>>>(dst, ld_dst, src, ld_src, rows,
                                                                 cols);
    return cudaGetLastError();
}

template <int DT>
static void weights_launch(cudaStream_t s, dim3 grid, uint16_t *dst, int64_t ld_dst,
                           const uint8_t *w, size_t row_bytes, int64_t R, int64_t C) {
    weights_to_bf16_kernel<DT><<<grid, CONV_THREADS, 0, s>>>(dst, ld_dst, w, row_bytes, R, C);
}

cudaError_t kiln_cuda_weights_to_bf16(cudaStream_t s, uint16_t *dst, int64_t ld_dst,
                                      const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                                      int64_t R, int64_t C) {
    if (R <= 0 || C <= 0) return cudaSuccess;
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    dim3 grid;
    if (!dst || !w || !tr || !kiln_cuda_dtype_supported(dt) || ld_dst < C ||
        C % tr->block_size != 0 ||
        row_bytes < (size_t)(C / tr->block_size) * (size_t)tr->type_size ||
        !conv_grid(R, C, W_VEC, &grid))
        return cudaErrorInvalidValue;
    KILN_CUDA_DTYPE_SWITCH(dt, weights_launch, s, grid, dst, ld_dst, w, row_bytes, R, C);
    return cudaGetLastError();
}

/* ---- the handle ------------------------------------------------------------------------------ */

/* One problem as cuBLASLt sees it (column-major): what the cached algorithm was chosen for. */
typedef struct gemm_key {
    int64_t op_a, op_b;        /* cublasOperation_t of cuBLASLt's A and B */
    int64_t m, n, k;           /* D (m x n) = op(A) (m x k) op(B) (k x n) */
    int64_t lda, ldb, ldd;     /* elements */
    int64_t align_a, align_b, align_d; /* alignment class of the pointers (bytes, <= 16) */
    int64_t align_bias;        /* the bias pointer's class; 0: no bias */
    int64_t bias_kernel;       /* the handle's forced bias-kernel mode (tests) */
    int64_t d_bf16;            /* D (and C) bf16 rather than f32 */
    int64_t align_c;           /* C's class when C is not D (a residual added); 0: C is D */
} gemm_key;

typedef struct gemm_plan {
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld; /* C and D share ld (C is D, or a residual of D's shape) */
    cublasLtMatmulAlgo_t algo;
    bool epilogue_bias; /* bias added by cuBLASLt's epilogue; false with a bias: by add_bias */
} gemm_plan;

struct kiln_cuda_gemm {
    int device;
    cublasLtHandle_t lt;
    void *workspace;            /* GEMM_WORKSPACE_BYTES, device */
    uint8_t *scratch;           /* bf16 operand copies, device; 256-byte aligned (cudaMalloc) */
    size_t scratch_bytes;
    void **old_scratch;         /* (n_old) outgrown scratch buffers, freed with the handle */
    int n_old, cap_old;
    size_t old_bytes;           /* their bytes */
    gemm_plan **plans;          /* (n_plans) the algorithm cache */
    int n_plans, cap_plans;
    int force_bias_kernel;
    char err[512];
};

static void set_err(kiln_cuda_gemm *g, const char *fmt, ...) KILN_PRINTF(2, 3);
static void set_err(kiln_cuda_gemm *g, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof g->err, fmt, ap);
    va_end(ap);
}

/* A CUDA result: true on success, else the message "what: <cuda message>". */
static bool cuda_ok(kiln_cuda_gemm *g, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    set_err(g, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

/* A cuBLASLt status: true on success, else the message "what: CUBLAS_STATUS_...". */
static bool lt_ok(kiln_cuda_gemm *g, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    set_err(g, "cuBLASLt %s: %s (%d)", what, cublasLtGetStatusName(st), (int)st);
    return false;
}

cudaError_t kiln_cuda_gemm_create(int device, kiln_cuda_gemm **out) {
    if (!out) return cudaErrorInvalidValue;
    *out = NULL;
    int prev = 0;
    cudaError_t e = cudaGetDevice(&prev);
    if (e == cudaSuccess) e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        kiln_error(KILN_ERR_UNSUPPORTED, "kiln_cuda_gemm_create: device %d: %s", device,
                   cudaGetErrorString(e));
        return e;
    }
    kiln_cuda_gemm *g = (kiln_cuda_gemm *)kiln_calloc(1, sizeof *g);
    if (!g) {
        cudaSetDevice(prev);
        kiln_error(KILN_ERR_NOMEM, "kiln_cuda_gemm_create: out of host memory");
        return cudaErrorMemoryAllocation;
    }
    g->device = device;
    cublasStatus_t st = cublasLtCreate(&g->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        kiln_error(KILN_ERR_UNSUPPORTED, "kiln_cuda_gemm_create: cublasLtCreate: %s",
                   cublasLtGetStatusName(st));
        kiln_free(g);
        cudaSetDevice(prev);
        return cudaErrorUnknown;
    }
    e = cudaMalloc(&g->workspace, GEMM_WORKSPACE_BYTES);
    if (e != cudaSuccess) {
        kiln_error(KILN_ERR_NOMEM, "kiln_cuda_gemm_create: workspace of %zu bytes: %s",
                   GEMM_WORKSPACE_BYTES, cudaGetErrorString(e));
        g->workspace = NULL;
        kiln_cuda_gemm_free(g);
        cudaSetDevice(prev);
        return e;
    }
    cudaSetDevice(prev);
    *out = g;
    return cudaSuccess;
}

static void plan_destroy(gemm_plan *p) {
    if (!p) return;
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    kiln_free(p);
}

size_t kiln_cuda_gemm_device_bytes(const kiln_cuda_gemm *g) {
    return g ? (g->workspace ? GEMM_WORKSPACE_BYTES : 0) + g->scratch_bytes + g->old_bytes : 0;
}

void kiln_cuda_gemm_free(kiln_cuda_gemm *g) {
    if (!g) return;
    int prev = 0;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    cudaSetDevice(g->device);
    /* Nothing enqueued may still read the workspace or scratch. An error here (a sticky fault
     * of earlier work) cannot be reported from a free; the memory is released regardless. */
    cudaDeviceSynchronize();
    for (int i = 0; i < g->n_plans; i++) plan_destroy(g->plans[i]);
    kiln_free(g->plans);
    if (g->lt) cublasLtDestroy(g->lt);
    if (g->workspace) cudaFree(g->workspace);
    if (g->scratch) cudaFree(g->scratch);
    for (int i = 0; i < g->n_old; i++) cudaFree(g->old_scratch[i]);
    kiln_free(g->old_scratch);
    kiln_free(g);
    if (have_prev) cudaSetDevice(prev);
}

const char *kiln_cuda_gemm_error(const kiln_cuda_gemm *g) { return g ? g->err : ""; }

void kiln_cuda_gemm_set_bias_kernel(kiln_cuda_gemm *g, int on) {
    if (g) g->force_bias_kernel = on != 0;
}

int kiln_cuda_gemm_cached(const kiln_cuda_gemm *g) { return g ? g->n_plans : 0; }

/* The handle's device must be current (the scratch and workspace live there). */
static bool device_ok(kiln_cuda_gemm *g) {
    int d = -1;
    if (!cuda_ok(g, cudaGetDevice(&d), "cudaGetDevice")) return false;
    if (d != g->device) {
        set_err(g, "kiln_cuda_gemm: the current device is %d, the handle's is %d", d, g->device);
        return false;
    }
    return true;
}

/* At least nbytes of scratch. Growth (x2 at least) allocates, which a capturing stream would
 * turn into an error or an invalid graph, so it is refused then; the outgrown buffer is kept
 * until kiln_cuda_gemm_free since enqueued work (or a captured graph) may still read it. */
static cudaError_t scratch_reserve(kiln_cuda_gemm *g, cudaStream_t s, size_t nbytes) {
    if (nbytes <= g->scratch_bytes) return cudaSuccess;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(s, &cs);
    if (!cuda_ok(g, e, "scratch: cudaStreamIsCapturing")) return e;
    if (cs != cudaStreamCaptureStatusNone) {
        set_err(g, "scratch: %zu bytes needed (have %zu) while the stream is capturing: run "
                   "this shape once before capturing", nbytes, g->scratch_bytes);
        return cudaErrorStreamCaptureUnsupported;
    }
    size_t want = g->scratch_bytes * 2 > nbytes ? g->scratch_bytes * 2 : nbytes;
    want = (want + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1); /* whole MiB */
    if (g->scratch && g->n_old == g->cap_old) {
        int cap = g->cap_old ? 2 * g->cap_old : 8;
        void **p = (void **)kiln_realloc(g->old_scratch, (size_t)cap * sizeof *p);
        if (!p) {
            set_err(g, "scratch: out of host memory");
            return cudaErrorMemoryAllocation;
        }
        g->old_scratch = p;
        g->cap_old = cap;
    }
    void *p = NULL;
    e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        set_err(g, "scratch: cudaMalloc of %zu bytes: %s", want, cudaGetErrorString(e));
        return e;
    }
    if (g->scratch) {
        g->old_scratch[g->n_old++] = g->scratch;
        g->old_bytes += g->scratch_bytes;
    }
    g->scratch = (uint8_t *)p;
    g->scratch_bytes = want;
    return cudaSuccess;
}

/* ---- plans: one cached algorithm per problem ------------------------------------------------ */

/* Alignment class of a pointer: its largest power-of-two divisor, capped at 16 bytes (what
 * the tensor-core kernels' vector and TMA loads need). Capping makes every buffer aligned to
 * 16 or more the same class, so the same problem at different (well-aligned) addresses runs
 * the same algorithm and gives the same bits. */
static int64_t align_class(const void *p) {
    const uintptr_t u = (uintptr_t)p;
    if (!p) return 0;
    const uintptr_t low = u & (~u + 1);
    return low >= 16 ? 16 : (int64_t)low;
}

static bool key_equal(const gemm_key *a, const gemm_key *b) {
    return a->op_a == b->op_a && a->op_b == b->op_b && a->m == b->m && a->n == b->n &&
           a->k == b->k && a->lda == b->lda && a->ldb == b->ldb && a->ldd == b->ldd &&
           a->align_a == b->align_a && a->align_b == b->align_b && a->align_d == b->align_d &&
           a->align_bias == b->align_bias && a->bias_kernel == b->bias_kernel &&
           a->d_bf16 == b->d_bf16 && a->align_c == b->align_c;
}

/* KILN_GEMM_LOG=1 (a diagnostic): a line a plan on stderr, each result's workspace and the
 * pick. Session 17 found with it that every candidate of the products cuBLASLt precedes with a
 * memset asks for a 4-byte workspace (presumably the counter it zeroes): no pick avoids them. */
static bool heur_log(void) {
    const char *e = getenv("KILN_GEMM_LOG");
    return e && e[0] == '1' && e[1] == '\0';
}

/* Ask the heuristic (best first) for problem p under preference pref; take the first result
 * that succeeded and fits the workspace (the heuristic's second for every product made the
 * 0.5B training step's profile 125.3 -> 127.4 ms: more memsets and a slower split-K head
 * product; bench/RESULTS.md, 2026-12-02, 9bb4328). false (no message) when there is none; a
 * failing call other than "not supported" sets the message and *failed. */
static bool heuristic_pick(kiln_cuda_gemm *g, gemm_plan *p, cublasLtMatmulPreference_t pref,
                           bool *failed) {
    cublasLtMatmulHeuristicResult_t res[8];
    int n = 0;
    memset(res, 0, sizeof res);
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->la, p->lb, p->ld,
                                                       p->ld, pref, 8, res, &n);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
    if (!lt_ok(g, st, "cublasLtMatmulAlgoGetHeuristic")) {
        *failed = true;
        return false;
    }
    int pick = -1;
    for (int i = 0; i < n && i < 8; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= GEMM_WORKSPACE_BYTES) {
            pick = i;
            break;
        }
    if (heur_log()) {
        const gemm_key *k = &p->key;
        fprintf(stderr, "kiln gemm plan: m %lld n %lld k %lld ops %lld/%lld out %s bias %lld; "
                        "workspace of each result (* the pick):",
                (long long)k->m, (long long)k->n, (long long)k->k, (long long)k->op_a,
                (long long)k->op_b, k->d_bf16 ? "bf16" : "f32", (long long)k->align_bias);
        for (int i = 0; i < n && i < 8; i++)
            fprintf(stderr, " %zu%s%s", res[i].workspaceSize, i == pick ? "*" : "",
                    res[i].state == CUBLAS_STATUS_SUCCESS ? "" : "(failed)");
        fprintf(stderr, "\n");
    }
    if (pick < 0) return false;
    p->algo = res[pick].algo;
    return true;
}

#define LT_TRY(call, what)                                                                    \
    do {                                                                                      \
        if (!lt_ok(g, (call), (what))) goto fail;                                             \
    } while (0)

/* Make the plan of key k: descriptors, layouts, and the heuristic's algorithm. Without an
 * algorithm for the bias epilogue it falls back to the plain product + add_bias. */
static cudaError_t plan_create(kiln_cuda_gemm *g, const gemm_key *k, gemm_plan **out) {
    gemm_plan *p = (gemm_plan *)kiln_calloc(1, sizeof *p);
    cublasLtMatmulPreference_t pref = NULL;
    bool failed = false, found = false;
    if (!p) {
        set_err(g, "plan: out of host memory");
        return cudaErrorMemoryAllocation;
    }
    p->key = *k;
    {
        const int32_t op_a = (int32_t)k->op_a, op_b = (int32_t)k->op_b;
        /* layouts describe the operands as stored: op N: (rows x cols) = (m x k) / (k x n);
         * op T: the transposes (k x m) / (n x k). */
        const uint64_t ra = (uint64_t)(op_a == CUBLAS_OP_N ? k->m : k->k);
        const uint64_t ca = (uint64_t)(op_a == CUBLAS_OP_N ? k->k : k->m);
        const uint64_t rb = (uint64_t)(op_b == CUBLAS_OP_N ? k->k : k->n);
        const uint64_t cb = (uint64_t)(op_b == CUBLAS_OP_N ? k->n : k->k);
        LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate");
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                              sizeof op_a),
               "set TRANSA");
        LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                              sizeof op_b),
               "set TRANSB");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, ra, ca, k->lda),
               "cublasLtMatrixLayoutCreate(A)");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, rb, cb, k->ldb),
               "cublasLtMatrixLayoutCreate(B)");
        LT_TRY(cublasLtMatrixLayoutCreate(&p->ld, k->d_bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                          (uint64_t)k->m, (uint64_t)k->n, k->ldd),
               "cublasLtMatrixLayoutCreate(D)");

        const uint64_t ws = GEMM_WORKSPACE_BYTES;
        /* Split-K only with a separate, ordered reduction (cuda_gemm_fast.h, "Determinism"). */
        const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                 CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
        const uint32_t al_a = (uint32_t)k->align_a, al_b = (uint32_t)k->align_b,
                       al_d = (uint32_t)k->align_d,
                       al_c = (uint32_t)(k->align_c ? k->align_c : k->align_d);
        LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws),
               "set MAX_WORKSPACE_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                    &schemes, sizeof schemes),
               "set REDUCTION_SCHEME_MASK");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                    &al_a, sizeof al_a),
               "set MIN_ALIGNMENT_A_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                    &al_b, sizeof al_b),
               "set MIN_ALIGNMENT_B_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                    &al_c, sizeof al_c),
               "set MIN_ALIGNMENT_C_BYTES");
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                    &al_d, sizeof al_d),
               "set MIN_ALIGNMENT_D_BYTES");

        if (k->align_bias && !k->bias_kernel) {
            /* The heuristic reads the bias pointer's value for its alignment (it does not
             * dereference it). Show it a pointer of exactly the key's class, inside our
             * 256-aligned workspace, so the algorithm suits every bias of that class; the
             * real pointer is set at each call. */
            const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
            const void *probe = (const uint8_t *)g->workspace + k->align_bias;
            LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                  sizeof epi),
                   "set EPILOGUE");
            LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &probe, sizeof probe),
                   "set BIAS_POINTER");
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
            p->epilogue_bias = found;
            if (!found) { /* back to the plain product; add_bias does the bias */
                const cublasLtEpilogue_t plain = CUBLASLT_EPILOGUE_DEFAULT;
                const void *none = NULL;
                LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &plain, sizeof plain),
                       "set EPILOGUE");
                LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &none, sizeof none),
                       "set BIAS_POINTER");
            }
        }
        if (!found) {
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
        }
        if (!found) {
            /* Should not happen for bf16 x bf16 -> f32; last resort: allow every reduction
             * scheme (still ordered: INPLACE reduces through counters, cuBLASLt.h). */
            const uint32_t all = CUBLASLT_REDUCTION_SCHEME_MASK;
            LT_TRY(cublasLtMatmulPreferenceSetAttribute(
                       pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &all, sizeof all),
                   "set REDUCTION_SCHEME_MASK");
            found = heuristic_pick(g, p, pref, &failed);
            if (failed) goto fail;
        }
        if (!found) {
            set_err(g, "cuBLASLt: no algorithm for bf16 x bf16 -> %s m=%lld n=%lld k=%lld "
                       "ops %d/%d ld %lld/%lld/%lld alignments %lld/%lld/%lld",
                    k->d_bf16 ? "bf16" : "f32", (long long)k->m, (long long)k->n,
                    (long long)k->k, op_a, op_b,
                    (long long)k->lda, (long long)k->ldb, (long long)k->ldd,
                    (long long)k->align_a, (long long)k->align_b, (long long)k->align_d);
            goto fail;
        }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    *out = p;
    return cudaSuccess;
fail:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    plan_destroy(p);
    return cudaErrorUnknown;
}

/* The cached plan of key k, made now on first use. */
static cudaError_t plan_get(kiln_cuda_gemm *g, const gemm_key *k, gemm_plan **out) {
    for (int i = 0; i < g->n_plans; i++)
        if (key_equal(&g->plans[i]->key, k)) {
            *out = g->plans[i];
            return cudaSuccess;
        }
    if (g->n_plans == g->cap_plans) {
        int cap = g->cap_plans ? 2 * g->cap_plans : 32;
        gemm_plan **pp = (gemm_plan **)kiln_realloc(g->plans, (size_t)cap * sizeof *pp);
        if (!pp) {
            set_err(g, "plan cache: out of host memory");
            return cudaErrorMemoryAllocation;
        }
        g->plans = pp;
        g->cap_plans = cap;
    }
    gemm_plan *p = NULL;
    cudaError_t e = plan_create(g, k, &p);
    if (e != cudaSuccess) return e;
    g->plans[g->n_plans++] = p;
    *out = p;
    return cudaSuccess;
}

/* ---- the product ------------------------------------------------------------------------------ */

/* Where a product's result goes: D (f32, or bf16 when d_bf16: the RNE rounding of the f32
 * result, cuBLASLt's epilogue conversion), and what is added to it in the epilogue: with
 * accumulate, D's old value; else add (NULL: nothing), an f32 matrix of D's shape and leading
 * dimension (D = add + A'B', one f32 rounding of the sum; add may be D). bf16 D takes
 * neither. */
typedef struct gemm_out {
    void *D;
    bool d_bf16;
    const float *add;
    int accumulate;
} gemm_out;

static gemm_out out_f32(float *D, int accumulate) {
    gemm_out o = {D, false, NULL, accumulate};
    return o;
}

/* Row-major D(M,N) (+)= A'(M,K) B'(K,N) (+ bias(N) per row of D) on bf16 operands (layout
 * mapping: file comment), D and the added matrix as o says. Arguments already checked; M, N,
 * K >= 1. */
static cudaError_t gemm_rowmajor(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                                 int64_t M, int64_t N, int64_t K, const uint16_t *A,
                                 int64_t lda, const uint16_t *B, int64_t ldb, gemm_out o,
                                 int64_t ldd, const float *bias) {
    void *D = o.D;
    const void *Cm = o.add && !o.accumulate ? (const void *)o.add : (const void *)D;
    gemm_key k;
    memset(&k, 0, sizeof k);
    k.op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt's A is kiln's B */
    k.op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt's B is kiln's A */
    k.m = N;
    k.n = M;
    k.k = K;
    k.lda = ldb;
    k.ldb = lda;
    k.ldd = ldd;
    k.align_a = align_class(B);
    k.align_b = align_class(A);
    k.align_d = align_class(D);
    k.align_bias = align_class(bias);
    k.bias_kernel = bias ? g->force_bias_kernel : 0;
    k.d_bf16 = o.d_bf16;
    k.align_c = Cm != D ? align_class(Cm) : 0;
    gemm_plan *p = NULL;
    cudaError_t e = plan_get(g, &k, &p);
    if (e != cudaSuccess) return e;
    if (p->epilogue_bias &&
        !lt_ok(g, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &bias, sizeof bias),
               "set BIAS_POINTER"))
        return cudaErrorUnknown;
    const float alpha = 1.0f, beta = o.accumulate || o.add ? 1.0f : 0.0f;
    /* C: D itself when accumulating (in place), the residual o.add, or (beta = 0, not read)
     * D; C and D share a layout. */
    if (!lt_ok(g, cublasLtMatmul(g->lt, p->desc, &alpha, B, p->la, A, p->lb, &beta, Cm, p->ld, D,
                                 p->ld, &p->algo, g->workspace, GEMM_WORKSPACE_BYTES, s),
               "cublasLtMatmul"))
        return cudaErrorUnknown;
    if (bias && !p->epilogue_bias) { /* f32 D only (a bf16 D takes no bias) */
        float *Df = (float *)D;
        dim3 grid;
        if (!conv_grid(M, N, 1, &grid)) {
            set_err(g, "bias: bad shape %lld x %lld", (long long)M, (long long)N);
            return cudaErrorInvalidValue;
        }
        add_bias_kernel<<<grid, CONV_THREADS, 0, s>>>(Df, ldd, bias, M, N);
        e = cudaGetLastError();
        if (!cuda_ok(g, e, "add_bias launch")) return e;
    }
    return cudaSuccess;
}

/* Bytes of a (rows x ld) bf16 matrix rounded up to 256 (the next region's alignment); false
 * past 2^48 bytes (a caller's bug, not a size anyone allocates). */
static bool region_bytes(int64_t rows, int64_t ld, size_t *out) {
    const int64_t limit = (int64_t)1 << 47; /* elements: 2^48 bytes */
    if (rows < 0 || ld < 0 || (rows > 0 && ld > limit / rows)) return false;
    *out = ((size_t)(rows * ld) * 2u + 255u) & ~(size_t)255u;
    return true;
}

/* Leading dimension of a bf16 copy in scratch: cols rounded up to 8 elements (16 bytes), so
 * every row starts 16-byte aligned (the padding is never read: k stops at cols). */
static int64_t padded_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* The checks shared by the two linear entries (x: f32 or bf16, only tested for NULL). */
static cudaError_t linear_check(kiln_cuda_gemm *g, const void *out, const void *x, const uint8_t *w,
                                size_t row_bytes, kiln_dtype dt, int64_t C, int N) {
    const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
    if (!out || !x || !w) {
        set_err(g, "linear: NULL %s", !out ? "out" : !x ? "x" : "w");
        return cudaErrorInvalidValue;
    }
    if (C < 1 || N < 1) {
        set_err(g, "linear: C = %lld, N = %d", (long long)C, N);
        return cudaErrorInvalidValue;
    }
    if (!tr || !kiln_cuda_dtype_supported(dt)) {
        set_err(g, "linear: dtype %d not supported", (int)dt);
        return cudaErrorInvalidValue;
    }
    if (C % tr->block_size != 0 ||
        row_bytes < (size_t)(C / tr->block_size) * (size_t)tr->type_size) {
        set_err(g, "linear: %s weight rows of C = %lld in %zu bytes", tr->name, (long long)C,
                row_bytes);
        return cudaErrorInvalidValue;
    }
    if (dt == KILN_DTYPE_BF16 && (row_bytes % 2 != 0 || ((uintptr_t)w & 1u) != 0)) {
        set_err(g, "linear: bf16 weight not 2-byte aligned (row_bytes %zu)", row_bytes);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

/* Whether a bf16 weight is used in place: rows start 16-byte aligned (the tensor-core
 * kernels' vector loads; contiguous GGUF rows with C % 8 == 0 always are). Otherwise it is
 * copied (exactly: bf16 -> f32 -> bf16 is the identity) into scratch with padded rows, rather
 * than leaving cuBLASLt a layout it may have no fast (or no) algorithm for. */
static bool bf16_in_place(kiln_dtype dt, const uint8_t *w, size_t row_bytes) {
    return dt == KILN_DTYPE_BF16 && ((uintptr_t)w & 15u) == 0 && row_bytes % 16 == 0;
}

/* The linear after x is bf16 at xb (ldx), into out (gemm_out): W converted into scratch at
 * w_off unless it is bf16 used in place. */
static cudaError_t linear_run(kiln_cuda_gemm *g, cudaStream_t s, gemm_out out, const uint16_t *xb,
                              int64_t ldx, const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                              int64_t R, int64_t C, const float *bias, int N, size_t w_off) {
    const uint16_t *wb;
    int64_t ldw;
    if (bf16_in_place(dt, w, row_bytes)) {
        wb = (const uint16_t *)w;
        ldw = (int64_t)(row_bytes / 2);
    } else {
        uint16_t *dst = (uint16_t *)(g->scratch + w_off);
        ldw = padded_ld(C);
        cudaError_t e = kiln_cuda_weights_to_bf16(s, dst, ldw, w, row_bytes, dt, R, C);
        if (!cuda_ok(g, e, "linear: weights_to_bf16")) return e;
        wb = dst;
    }
    return gemm_rowmajor(g, s, 0, 1, N, R, C, xb, ldx, wb, ldw, out, R, bias);
}

cudaError_t kiln_cuda_gemm_linear(kiln_cuda_gemm *g, cudaStream_t s, float *out, const float *x,
                                  const uint8_t *w, size_t row_bytes, kiln_dtype dt, int64_t R,
                                  int64_t C, const float *bias, int N, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0) return cudaSuccess;
    cudaError_t e = linear_check(g, out, x, w, row_bytes, dt, C, N);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    const int64_t ldx = padded_ld(C);
    size_t x_bytes = 0, w_bytes = 0;
    if (!region_bytes(N, ldx, &x_bytes) ||
        (!bf16_in_place(dt, w, row_bytes) && !region_bytes(R, padded_ld(C), &w_bytes))) {
        set_err(g, "linear: shape too large (N %d, R %lld, C %lld)", N, (long long)R,
                (long long)C);
        return cudaErrorInvalidValue;
    }
    e = scratch_reserve(g, s, x_bytes + w_bytes);
    if (e != cudaSuccess) return e;
    uint16_t *xb = (uint16_t *)g->scratch;
    e = kiln_cuda_f32_to_bf16(s, xb, ldx, x, C, N, C);
    if (!cuda_ok(g, e, "linear: f32_to_bf16(x)")) return e;
    return linear_run(g, s, out_f32(out, accumulate), xb, ldx, w, row_bytes, dt, R, C, bias, N,
                      x_bytes);
}

cudaError_t kiln_cuda_gemm_linear_bf16(kiln_cuda_gemm *g, cudaStream_t s, float *out,
                                       const uint16_t *xb, int64_t ldx, const uint8_t *w,
                                       size_t row_bytes, kiln_dtype dt, int64_t R, int64_t C,
                                       const float *bias, int N, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0) return cudaSuccess;
    cudaError_t e = linear_check(g, out, xb, w, row_bytes, dt, C, N);
    if (e != cudaSuccess) return e;
    if (ldx < C) {
        set_err(g, "linear_bf16: ldx %lld < C %lld", (long long)ldx, (long long)C);
        return cudaErrorInvalidValue;
    }
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    size_t w_bytes = 0;
    if (!bf16_in_place(dt, w, row_bytes)) {
        if (!region_bytes(R, padded_ld(C), &w_bytes)) {
            set_err(g, "linear_bf16: shape too large (R %lld, C %lld)", (long long)R,
                    (long long)C);
            return cudaErrorInvalidValue;
        }
        e = scratch_reserve(g, s, w_bytes);
        if (e != cudaSuccess) return e;
    }
    return linear_run(g, s, out_f32(out, accumulate), xb, ldx, w, row_bytes, dt, R, C, bias, N, 0);
}

/* kiln_cuda_gemm_linear_multi (x f32, rounded into the scratch's start) or, with x NULL,
 * kiln_cuda_gemm_linear_multi_bf16 (xb16 bf16 at ldx16, used in place; the W copies start
 * the scratch; out16 / add as it says, NULL for the f32 entry). */
static cudaError_t linear_multi(kiln_cuda_gemm *g, cudaStream_t s, int n, float *const *out,
                                uint16_t *const *out16, const float *const *add,
                                const float *x, const uint16_t *xb16, int64_t ldx16,
                                const uint8_t *const *w, const size_t *row_bytes,
                                const kiln_dtype *dt, const int64_t *R, int64_t C,
                                const float *const *bias, int N) {
    if (!g) return cudaErrorInvalidValue;
    if (n < 1 || n > KILN_GEMM_MULTI_MAX || (!out && !out16) || !w || !row_bytes || !dt || !R) {
        set_err(g, "linear_multi: n = %d or a NULL array", n);
        return cudaErrorInvalidValue;
    }
    gemm_out o[KILN_GEMM_MULTI_MAX];
    for (int i = 0; i < n; i++) {
        uint16_t *o16 = out16 ? out16[i] : NULL;
        const float *ad = add ? add[i] : NULL;
        if (o16 && (ad || (bias && bias[i]))) {
            set_err(g, "linear_multi_bf16: product %d: a bf16 output takes no %s", i,
                    ad ? "residual" : "bias");
            return cudaErrorInvalidValue;
        }
        o[i].D = o16 ? (void *)o16 : (void *)(out ? out[i] : NULL);
        o[i].d_bf16 = o16 != NULL;
        o[i].add = ad;
        o[i].accumulate = 0;
        if (o16 && ((uintptr_t)o16 & 15u) != 0) {
            set_err(g, "linear_multi_bf16: product %d: bf16 output not 16-byte aligned", i);
            return cudaErrorInvalidValue;
        }
    }
    if (N <= 0) return cudaSuccess;
    if (!x && ldx16 < C) {
        set_err(g, "linear_multi_bf16: ldx %lld < C %lld", (long long)ldx16, (long long)C);
        return cudaErrorInvalidValue;
    }
    const int64_t ldx = x ? padded_ld(C) : ldx16;
    size_t x_bytes = 0, w_max = 0;
    for (int i = 0; i < n; i++) { /* every argument checked before anything is enqueued */
        if (R[i] <= 0) continue;
        cudaError_t e = linear_check(g, o[i].D, x ? (const void *)x : (const void *)xb16, w[i],
                                     row_bytes[i], dt[i], C, N);
        if (e != cudaSuccess) return e;
        size_t wb = 0;
        if (!bf16_in_place(dt[i], w[i], row_bytes[i]) && !region_bytes(R[i], padded_ld(C), &wb)) {
            set_err(g, "linear_multi: shape too large (R %lld, C %lld)", (long long)R[i],
                    (long long)C);
            return cudaErrorInvalidValue;
        }
        if (wb > w_max) w_max = wb;
    }
    if (x && !region_bytes(N, ldx, &x_bytes)) {
        set_err(g, "linear_multi: shape too large (N %d, C %lld)", N, (long long)C);
        return cudaErrorInvalidValue;
    }
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    cudaError_t e = x_bytes + w_max ? scratch_reserve(g, s, x_bytes + w_max) : cudaSuccess;
    if (e != cudaSuccess) return e;
    const uint16_t *xb = xb16;
    if (x) {
        uint16_t *dst = (uint16_t *)g->scratch; /* where kiln_cuda_gemm_linear puts it */
        e = kiln_cuda_f32_to_bf16(s, dst, ldx, x, C, N, C);
        if (!cuda_ok(g, e, "linear_multi: f32_to_bf16(x)")) return e;
        xb = dst;
    }
    for (int i = 0; i < n && e == cudaSuccess; i++)
        if (R[i] > 0)
            e = linear_run(g, s, o[i], xb, ldx, w[i], row_bytes[i], dt[i], R[i], C,
                           bias ? bias[i] : NULL, N, x_bytes);
    return e;
}

cudaError_t kiln_cuda_gemm_linear_multi(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                        float *const *out, const float *x,
                                        const uint8_t *const *w, const size_t *row_bytes,
                                        const kiln_dtype *dt, const int64_t *R, int64_t C,
                                        const float *const *bias, int N) {
    if (g && !x && N > 0) {
        set_err(g, "linear_multi: NULL x");
        return cudaErrorInvalidValue;
    }
    return linear_multi(g, s, n, out, NULL, NULL, x, NULL, 0, w, row_bytes, dt, R, C, bias, N);
}

cudaError_t kiln_cuda_gemm_linear_multi_bf16(kiln_cuda_gemm *g, cudaStream_t s, int n,
                                             float *const *out, uint16_t *const *out16,
                                             const float *const *add, const uint16_t *xb,
                                             int64_t ldx,
                                             const uint8_t *const *w, const size_t *row_bytes,
                                             const kiln_dtype *dt, const int64_t *R, int64_t C,
                                             const float *const *bias, int N) {
    if (g && !xb && N > 0) {
        set_err(g, "linear_multi_bf16: NULL x");
        return cudaErrorInvalidValue;
    }
    return linear_multi(g, s, n, out, out16, add, NULL, xb, ldx, w, row_bytes, dt, R, C, bias,
                        N);
}

/* The checks shared by the two general products. */
static cudaError_t gemm_check(kiln_cuda_gemm *g, int trans_a, int trans_b, int64_t M, int64_t N,
                              int64_t K, const void *A, int64_t lda, const void *B, int64_t ldb,
                              const void *D, int64_t ldd) {
    if (!A || !B || !D) {
        set_err(g, "gemm: NULL %s", !A ? "A" : !B ? "B" : "D");
        return cudaErrorInvalidValue;
    }
    if (K < 1) {
        set_err(g, "gemm: K = %lld (must be >= 1)", (long long)K);
        return cudaErrorInvalidValue;
    }
    const int64_t min_lda = trans_a ? M : K, min_ldb = trans_b ? K : N;
    if (lda < min_lda || ldb < min_ldb || ldd < N) {
        set_err(g, "gemm: leading dimensions lda %lld (>= %lld), ldb %lld (>= %lld), ldd %lld "
                   "(>= %lld)",
                (long long)lda, (long long)min_lda, (long long)ldb, (long long)min_ldb,
                (long long)ldd, (long long)N);
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

cudaError_t kiln_cuda_gemm_bf16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                                int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                const uint16_t *B, int64_t ldb, float *D, int64_t ldd,
                                int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, A, lda, B, ldb,
                         out_f32(D, accumulate), ldd, NULL);
}

cudaError_t kiln_cuda_gemm_bf16_out16(kiln_cuda_gemm *g, cudaStream_t s, int trans_a,
                                      int trans_b, int64_t M, int64_t N, int64_t K,
                                      const uint16_t *A, int64_t lda, const uint16_t *B,
                                      int64_t ldb, uint16_t *D, int64_t ldd) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    gemm_out o = {D, true, NULL, 0};
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, A, lda, B, ldb, o, ldd, NULL);
}

cudaError_t kiln_cuda_gemm_f32(kiln_cuda_gemm *g, cudaStream_t s, int trans_a, int trans_b,
                               int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                               const float *B, int64_t ldb, float *D, int64_t ldd, int accumulate) {
    if (!g) return cudaErrorInvalidValue;
    if (M <= 0 || N <= 0) return cudaSuccess;
    cudaError_t e = gemm_check(g, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, ldd);
    if (e != cudaSuccess) return e;
    if (!device_ok(g)) return cudaErrorInvalidDevice;
    /* The operands as stored: A (a_rows x a_cols), B (b_rows x b_cols). */
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    const int64_t lda2 = padded_ld(a_cols), ldb2 = padded_ld(b_cols);
    size_t a_bytes = 0, b_bytes = 0;
    if (!region_bytes(a_rows, lda2, &a_bytes) || !region_bytes(b_rows, ldb2, &b_bytes)) {
        set_err(g, "gemm_f32: shape too large (M %lld, N %lld, K %lld)", (long long)M,
                (long long)N, (long long)K);
        return cudaErrorInvalidValue;
    }
    e = scratch_reserve(g, s, a_bytes + b_bytes);
    if (e != cudaSuccess) return e;
    uint16_t *ab = (uint16_t *)g->scratch, *bb = (uint16_t *)(g->scratch + a_bytes);
    e = kiln_cuda_f32_to_bf16(s, ab, lda2, A, lda, a_rows, a_cols);
    if (!cuda_ok(g, e, "gemm_f32: f32_to_bf16(A)")) return e;
    e = kiln_cuda_f32_to_bf16(s, bb, ldb2, B, ldb, b_rows, b_cols);
    if (!cuda_ok(g, e, "gemm_f32: f32_to_bf16(B)")) return e;
    return gemm_rowmajor(g, s, trans_a != 0, trans_b != 0, M, N, K, ab, lda2, bb, ldb2,
                         out_f32(D, accumulate), ldd, NULL);
}
