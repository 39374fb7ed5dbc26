/*
 * bench_cuda_fused_ce.cu -- time and memory of kiln's fused linear cross-entropy
 * (kiln_fused_ce, src/train/fused_ce.h) on the CUDA backend, auditable and fast, at the
 * issue-5 benchmark shape: V = 151936, H = 896, N = 8192 rows (Qwen2.5-0.5B's head over
 * 4 x 2048 positions).
 *
 * For each mode (auditable: kiln_backend_cuda_create_mode(0, 0); fast: (0, 1), which runs the
 * bf16 path of fused_ce.c; fast-composition, only when asked for: the fast backend with
 * kiln_cuda_ce_set_legacy(1), the composition of the backend's matmul and matmul_backward that
 * the bf16 path replaced, same bits, for comparison), each weight
 * dtype (f32, bf16) and each pass ("fwd": the loss alone, dhidden = dweight = NULL, pass 1
 * only; "fwd+bwd": loss, dhidden (overwritten) and dweight (accumulated), as training calls
 * it), one untimed call and then --reps timed calls, each timed on the host around the call
 * (kiln_fused_ce returns once its outputs are complete) after a cudaDeviceSynchronize;
 * the median is printed. Memory:
 *   - scratch_bytes: kiln's own accounting (kiln_fused_ce_result.scratch_bytes: the whole
 *     scratch the call allocated and freed; kiln_fused_ce_scratch_bytes gives the same);
 *   - dev_extra_bytes: the device's view, a host thread polling cudaMemGetInfo every ~100 us
 *     during the calls: (free memory before the first call) - (the least free memory seen).
 *     Polling can miss a short-lived allocation, so this is a lower bound of the true peak.
 * The caller's buffers (hidden N x H f32, weight V x H, dhidden N x H f32, dweight V x H f32,
 * targets on the host) are allocated before and are not in either figure; io_bytes prints
 * their device bytes. Data: hidden uniform in [-1, 1), weight uniform in [-1/32, 1/32)
 * (logits of order 1), targets uniform in [0, V), all from a fixed hash (seeded).
 *
 * In fast mode one more case: the row-block walk (bench_rows below; walk=rows), the form the
 * training step calls, which bench_train_gpu.py sets beside PyTorch's.
 *
 * One line per case, parsed by bench/bench_train_gpu.py:
 *   RESULT mode=fast wdtype=bf16 pass=fwd+bwd walk=vocab N=8192 H=896 V=151936 chunk=4096
 *          ms=12.345 scratch_bytes=... dev_extra_bytes=... io_bytes=... loss=...
 *   RESULT mode=fast wdtype=bf16 pass=fwd+bwd walk=rows ... chunk=0 row_block=2048 ...
 * (one line each), "SKIP mode=... reason=..." when a mode cannot run, then "ALL OK" (every
 * case ran, every loss finite) or "FAILED n".
 *
 * Usage: bench_cuda_fused_ce [--N 8192] [--H 896] [--V 151936] [--chunk 0] [--reps 3]
 *                            [--modes auditable,fast[,fast-composition]] [--quick]
 *   --quick: N 1024 and 1 rep. Exit 77 without a GPU (a benchmark: nothing to check here).
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern "C" {
#include "base/base.h"
#include "ops/ops.h"
#include "ops/fused_ce.h"
}
#include "ops/cuda/cuda_train.h" /* kiln_cuda_ce_set_legacy */

#include "gpu_test_cuda_check.h"

static int g_fail = 0;

static __device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* x[i] = amp * u, u uniform in [-1, 1) from hash(seed, i); grid-stride, any n. */
static __global__ void fill_uniform(float *x, size_t n, float amp, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
        x[i] = amp * ((float)(int32_t)h * 0x1p-31f);
    }
}

/* y[i] = bf16(x[i]), round to nearest even (the inputs are finite). */
static __global__ void to_bf16(uint16_t *y, const float *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t u = __float_as_uint(x[i]);
        u += 0x7fffu + ((u >> 16) & 1u);
        y[i] = (uint16_t)(u >> 16);
    }
}

static void launch_fill(float *x, size_t n, float amp, uint64_t seed) {
    fill_uniform<<<1024, 256>>>(x, n, amp, seed);
    CUDA_OK(cudaGetLastError());
}

/* The least free device memory seen by a polling thread between start() and stop(). */
struct FreePoller {
    std::atomic<bool> run{false};
    std::atomic<size_t> min_free{SIZE_MAX};
    std::thread th;
    int device = 0;
    void start() {
        run = true;
        th = std::thread([this] {
            if (cudaSetDevice(device) != cudaSuccess) return;
            while (run.load()) {
                size_t f = 0, t = 0;
                if (cudaMemGetInfo(&f, &t) == cudaSuccess && f < min_free.load()) min_free = f;
                std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
        });
    }
    void stop() {
        run = false;
        if (th.joinable()) th.join();
    }
};

struct Buffers {
    float *hidden = nullptr, *w32 = nullptr, *dh = nullptr, *dw = nullptr;
    uint16_t *w16 = nullptr;
    size_t io_bytes = 0;
};

static void *dalloc(kiln_backend *be, size_t n, size_t *total) {
    void *p = kiln_backend_alloc(be, n);
    if (!p) {
        fprintf(stderr, "device allocation of %zu bytes failed: %s\n", n, kiln_last_error());
        exit(1);
    }
    *total += n;
    return p;
}

struct Case {
    const char *wdtype;
    bool backward;
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* One untimed call of kiln_fused_ce, then reps timed ones, each timed on the host after a
 * cudaDeviceSynchronize; wait: each call also waits for the work it enqueued
 * (kiln_backend_status: a no_wait call returns before it ends). *r: the last call's result;
 * *ms: the median (left unset when a call fails). */
static kiln_status timed_calls(kiln_backend *be, const kiln_fused_ce_params &p, int reps,
                               bool wait, kiln_fused_ce_result *r, double *ms) {
    std::vector<double> t;
    memset(r, 0, sizeof *r);
    kiln_status st = KILN_OK;
    for (int i = 0; i <= reps && st == KILN_OK; i++) { /* i == 0: untimed */
        CUDA_OK(cudaDeviceSynchronize());
        auto t0 = std::chrono::steady_clock::now();
        st = kiln_fused_ce(be, &p, r);
        if (st == KILN_OK && wait) st = kiln_backend_status(be);
        auto t1 = std::chrono::steady_clock::now();
        if (i > 0) t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    if (st == KILN_OK) *ms = median(t);
    return st;
}

/* Fast mode's row-block walk (kiln_fused_ce_params.row_block), in the one form that takes it:
 * the training step's one call (no_wait with row_stats_out, the caller's scratch; bf16 weight
 * read in place; dhidden and dweight). Each timed call is waited for (kiln_backend_status);
 * the loss comes from the downloaded row statistics (kiln_fused_ce_loss_from_stats). The
 * scratch is the caller's here, so the device view sees no allocation: the memory figure is
 * kiln's accounting (scratch_bytes), which must equal kiln_fused_ce_row_block_bytes, else the
 * call did not take the row walk and the case is a failure. */
#define BENCH_ROW_BLOCK 2048
static void bench_rows(kiln_backend *be, const Buffers &b, int64_t N, int64_t H, int64_t V,
                       int reps, const std::vector<int32_t> &targets) {
    if (H % 8 != 0 || N <= 8) { /* not a failure: the walk's form needs 16-byte weight rows */
        printf("SKIP mode=fast wdtype=bf16 pass=fwd+bwd walk=rows reason=the row-block walk "
               "needs H a multiple of 8 and N > 8\n");
        return;
    }
    const size_t want = kiln_fused_ce_row_block_bytes(N, H, V, BENCH_ROW_BLOCK, 1, 1, 0);
    float *rs = (float *)kiln_backend_alloc(be, (size_t)N * 3 * 4);
    void *scr = want ? kiln_backend_alloc(be, want) : nullptr;
    if (!rs || !scr) {
        printf("SKIP mode=fast wdtype=bf16 pass=fwd+bwd walk=rows reason=%s\n",
               want ? "scratch allocation failed" : "no row-block scratch size for this shape");
        g_fail++;
        if (rs) kiln_backend_free_buf(be, rs);
        if (scr) kiln_backend_free_buf(be, scr);
        return;
    }
    kiln_fused_ce_params p = kiln_fused_ce_default_params();
    p.N = N;
    p.H = H;
    p.V = V;
    p.hidden = b.hidden;
    p.weight = b.w16;
    p.weight_dtype = KILN_DTYPE_BF16;
    p.targets = targets.data();
    p.reduction = KILN_CE_REDUCTION_MEAN;
    p.scale = 1.0f;
    p.dhidden = b.dh;
    p.dweight = b.dw;
    p.row_stats_out = rs;
    p.no_wait = 1;
    p.scratch = scr;
    p.scratch_cap = want;
    p.row_block = BENCH_ROW_BLOCK;
    double ms = 0.0;
    kiln_fused_ce_result r;
    kiln_status st = timed_calls(be, p, reps, true, &r, &ms);
    std::vector<float> hs((size_t)N * 3);
    kiln_fused_ce_result lr;
    memset(&lr, 0, sizeof lr);
    if (st == KILN_OK) st = kiln_backend_download(be, hs.data(), rs, hs.size() * 4);
    if (st == KILN_OK) st = kiln_fused_ce_loss_from_stats(&p, hs.data(), &lr);
    if (st != KILN_OK || !r.loss_pending || r.scratch_bytes != want) {
        printf("SKIP mode=fast wdtype=bf16 pass=fwd+bwd walk=rows reason=%s\n",
               st != KILN_OK ? kiln_last_error()
                             : "the call did not take the row-block walk (scratch or pending loss)");
        g_fail++;
    } else {
        if (!std::isfinite(lr.loss)) g_fail++;
        printf("RESULT mode=fast wdtype=bf16 pass=fwd+bwd walk=rows N=%lld H=%lld V=%lld "
               "chunk=0 row_block=%d ms=%.3f scratch_bytes=%zu dev_extra_bytes=0 io_bytes=%zu "
               "loss=%.6f\n",
               (long long)N, (long long)H, (long long)V, BENCH_ROW_BLOCK, ms,
               r.scratch_bytes, (size_t)N * H * 8 + (size_t)V * H * 6, (double)lr.loss);
        fflush(stdout);
    }
    kiln_backend_free_buf(be, rs);
    kiln_backend_free_buf(be, scr);
}

/* One mode: every (weight dtype, pass) case; prints a RESULT line each. legacy: the fast
 * backend through the composition (kiln_cuda_ce_set_legacy). */
static void bench_mode(int fast, int legacy, int64_t N, int64_t H, int64_t V, int64_t chunk,
                       int reps, const std::vector<int32_t> &targets) {
    const char *mode = legacy ? "fast-composition" : fast ? "fast" : "auditable";
    kiln_cuda_ce_set_legacy(legacy);
    kiln_backend *be = nullptr;
    if (kiln_backend_cuda_create_mode(0, fast, &be) != KILN_OK) {
        printf("SKIP mode=%s reason=%s\n", mode, kiln_last_error());
        g_fail++;
        kiln_cuda_ce_set_legacy(0);
        return;
    }
    Buffers b;
    const size_t nh = (size_t)N * (size_t)H, nw = (size_t)V * (size_t)H;
    b.hidden = (float *)dalloc(be, nh * 4, &b.io_bytes);
    b.w32 = (float *)dalloc(be, nw * 4, &b.io_bytes);
    b.w16 = (uint16_t *)dalloc(be, nw * 2, &b.io_bytes);
    b.dh = (float *)dalloc(be, nh * 4, &b.io_bytes);
    b.dw = (float *)dalloc(be, nw * 4, &b.io_bytes);
    launch_fill(b.hidden, nh, 1.0f, 11);
    launch_fill(b.w32, nw, 1.0f / 32.0f, 12);
    to_bf16<<<1024, 256>>>(b.w16, b.w32, nw);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemset(b.dh, 0, nh * 4));
    CUDA_OK(cudaMemset(b.dw, 0, nw * 4));
    CUDA_OK(cudaDeviceSynchronize());

    const Case cases[] = {{"f32", false}, {"f32", true}, {"bf16", false}, {"bf16", true}};
    for (const Case &c : cases) {
        bool bf = !strcmp(c.wdtype, "bf16");
        kiln_fused_ce_params p = kiln_fused_ce_default_params();
        p.N = N;
        p.H = H;
        p.V = V;
        p.hidden = b.hidden;
        p.weight = bf ? (const void *)b.w16 : (const void *)b.w32;
        p.weight_dtype = bf ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
        p.targets = targets.data();
        p.mask = nullptr;
        p.reduction = KILN_CE_REDUCTION_MEAN;
        p.scale = 1.0f;
        p.chunk = chunk;
        p.dhidden = c.backward ? b.dh : nullptr;
        p.dweight = c.backward ? b.dw : nullptr;
        /* io: the weight of this dtype, hidden, and the gradients when computed */
        size_t io = nh * 4 + nw * (bf ? 2 : 4) + (c.backward ? nh * 4 + nw * 4 : 0);

        CUDA_OK(cudaDeviceSynchronize());
        size_t free0 = 0, total = 0;
        CUDA_OK(cudaMemGetInfo(&free0, &total));
        FreePoller poll;
        poll.start();
        double ms = 0.0;
        kiln_fused_ce_result r;
        kiln_status st = timed_calls(be, p, reps, false, &r, &ms);
        poll.stop();
        if (st == KILN_OK) st = kiln_backend_status(be);
        if (st != KILN_OK) {
            printf("SKIP mode=%s wdtype=%s pass=%s reason=%s\n", mode, c.wdtype,
                   c.backward ? "fwd+bwd" : "fwd", kiln_last_error());
            g_fail++;
            break; /* a device failure poisons the backend: the other cases cannot run */
        }
        size_t minf = poll.min_free.load();
        size_t extra = minf < free0 ? free0 - minf : 0;
        if (!std::isfinite(r.loss)) g_fail++;
        printf("RESULT mode=%s wdtype=%s pass=%s walk=vocab N=%lld H=%lld V=%lld chunk=%lld ms=%.3f "
               "scratch_bytes=%zu dev_extra_bytes=%zu io_bytes=%zu loss=%.6f\n",
               mode, c.wdtype, c.backward ? "fwd+bwd" : "fwd", (long long)N, (long long)H,
               (long long)V, (long long)(chunk ? chunk : KILN_FUSED_CE_DEFAULT_CHUNK), ms,
               r.scratch_bytes, extra, io, (double)r.loss);
        fflush(stdout);
    }
    if (fast && !legacy) bench_rows(be, b, N, H, V, reps, targets);
    kiln_backend_free_buf(be, b.hidden);
    kiln_backend_free_buf(be, b.w32);
    kiln_backend_free_buf(be, b.w16);
    kiln_backend_free_buf(be, b.dh);
    kiln_backend_free_buf(be, b.dw);
    kiln_backend_free(be);
    kiln_cuda_ce_set_legacy(0);
}

int main(int argc, char **argv) {
    int64_t N = 8192, H = 896, V = 151936, chunk = 0;
    int reps = 3;
    std::string modes = "auditable,fast";
    for (int a = 1; a < argc; a++) {
        bool more = a + 1 < argc;
        if (!strcmp(argv[a], "--N") && more) N = atoll(argv[++a]);
        else if (!strcmp(argv[a], "--H") && more) H = atoll(argv[++a]);
        else if (!strcmp(argv[a], "--V") && more) V = atoll(argv[++a]);
        else if (!strcmp(argv[a], "--chunk") && more) chunk = atoll(argv[++a]);
        else if (!strcmp(argv[a], "--reps") && more) reps = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--modes") && more) modes = argv[++a];
        else if (!strcmp(argv[a], "--quick")) {
            N = 1024;
            reps = 1;
        } else {
            fprintf(stderr, "usage: %s [--N n] [--H h] [--V v] [--chunk c] [--reps r] "
                            "[--modes auditable,fast,fast-composition] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (N < 1 || H < 1 || V < 2 || chunk < 0 || reps < 1 || N > (1 << 24) || H > (1 << 16) ||
        V > (1 << 24)) {
        fprintf(stderr, "bad sizes: N %lld H %lld V %lld chunk %lld reps %d\n", (long long)N,
                (long long)H, (long long)V, (long long)chunk, reps);
        return 2;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    std::vector<int32_t> targets((size_t)N);
    uint64_t s = 0x5eedull;
    for (auto &t : targets) { /* splitmix64 */
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        t = (int32_t)(z % (uint64_t)V);
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("bench_cuda_fused_ce: %s; N %lld H %lld V %lld chunk %lld, reps %d; logits would be "
           "%.2f GiB (f32)\n", prop.name, (long long)N, (long long)H, (long long)V,
           (long long)(chunk ? chunk : KILN_FUSED_CE_DEFAULT_CHUNK), reps,
           (double)N * (double)V * 4.0 / 1073741824.0);
    std::vector<std::string> want; /* the comma-separated names, matched whole */
    for (size_t a = 0; a <= modes.size();) {
        size_t b = modes.find(',', a);
        if (b == std::string::npos) b = modes.size();
        want.push_back(modes.substr(a, b - a));
        a = b + 1;
    }
    for (const char *m : {"auditable", "fast", "fast-composition"})
        if (std::find(want.begin(), want.end(), m) != want.end())
            bench_mode(strcmp(m, "auditable") != 0, !strcmp(m, "fast-composition"), N, H, V,
                       chunk, reps, targets);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
