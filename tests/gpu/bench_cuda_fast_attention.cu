/*
 * bench_cuda_fast_attention.cu -- the fast-mode attention (cuda_attention.h) against the
 * auditable kernel (kiln_cuda_attention, cuda_attention.h) in the same run, on the attention
 * shapes of Qwen2.5-0.5B (NH 14, KVH 2, HS 64) and Llama-3.2-3B (NH 24, KVH 8, HS 128):
 *   prefill of N tokens from an empty cache: time and TFLOP/s counting the causal half,
 *     4 * N * N / 2 * HS * NH flops (two matmuls of 2 flops per multiply-add);
 *   decode (N = 1) at a context of ctx keys: time and GB/s of KV bytes read,
 *     2 * ctx * KVH * HS * 4. The caches are rotated over enough copies to miss the L2.
 *   decode_dev in a CUDA graph, as the decode step runs it: 24 calls (one per layer, each
 *     with its own KV cache) captured once; time per call of a replay, GB/s as above.
 * Times: CUDA events around R back-to-back calls, the median of 5 such runs, per call (the
 * auditable prefill at N = 4096: one call).
 * Inputs are random in [-2, 2], generated on the device.
 * Also, for Qwen at ctx 512: the decode's launch (grid, block, dynamic shared memory), the SM
 * clock, and the per-call time of an empty kernel of the same launch, of decode_dev whose
 * blocks all return at once, and of the real decode_dev (where a fixed cost goes).
 * Usage: bench_cuda_fast_attention [--quick]   (--quick: prefill 512, decode 512 and 4096)
 */
#include "ops/cuda/cuda_attention.h"

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <vector>

#include "gpu_test_cuda_check.h"

static __global__ void fill_kernel(float *x, size_t n, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = (seed + i) * 0x9e3779b97f4a7c15ull;
        h ^= h >> 31;
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        x[i] = (float)(h >> 40) * 0x1p-22f - 2.0f; /* [-2, 2) */
    }
}

static void fill(float *x, size_t n, uint64_t seed) {
    fill_kernel<<<2048, 256>>>(x, n, seed);
    CUDA_OK(cudaGetLastError());
}

/* An empty kernel: the launch floor of a grid like the decode's (same grid, block and dynamic
 * shared memory). */
static __global__ void empty_kernel(int *sink) {
    extern __shared__ float empty_sm[];
    if (sink && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
        *sink = (int)empty_sm[0] * 0; /* never runs with sink NULL: keeps the smem declared */
}

/* SM clock: one thread spins `cycles` clock64 cycles and reports how many nanoseconds of
 * %globaltimer went by (MHz = cycles * 1000 / ns). */
static __global__ void clock_kernel(long long cycles, unsigned long long *ns) {
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const long long c0 = clock64();
    while (clock64() - c0 < cycles) {
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    *ns = t1 - t0;
}

struct model_shape { const char *name; int NH, KVH, HS; };

#define GRAPH_LAYERS 24 /* decode_dev calls per captured graph: the layers of a decode step */

static cudaStream_t g_s;
static cudaEvent_t g_e0, g_e1;

/* Median over `runs` runs of the time per call (ms) of R calls of f(i), i = call index,
 * after one warm-up call when warm. */
template <typename F>
static double time_ms(int R, int runs, bool warm, F f) {
    if (warm) f(0);
    CUDA_OK(cudaStreamSynchronize(g_s));
    std::vector<float> t;
    for (int run = 0; run < runs; run++) {
        CUDA_OK(cudaEventRecord(g_e0, g_s));
        for (int i = 0; i < R; i++) f(i);
        CUDA_OK(cudaEventRecord(g_e1, g_s));
        CUDA_OK(cudaEventSynchronize(g_e1));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, g_e0, g_e1));
        t.push_back(ms / R);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char **argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no GPU: skipped\n");
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB; split %d keys\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, KILN_ATTN_SPLIT);
    CUDA_OK(cudaStreamCreate(&g_s));
    CUDA_OK(cudaEventCreate(&g_e0));
    CUDA_OK(cudaEventCreate(&g_e1));
    kiln_cuda_attn *a = NULL;
    CUDA_OK(kiln_cuda_attn_create(&a));
    const model_shape shapes[] = {{"Qwen2.5-0.5B", 14, 2, 64}, {"Llama-3.2-3B", 24, 8, 128}};

    printf("\nprefill (n_past 0): time per call, TFLOP/s = 2*N*N*HS*NH / t\n");
    printf("%-14s %6s | %10s %8s | %12s %8s | %7s\n", "shape", "N", "fast ms", "TFLOP/s",
           "auditable ms", "TFLOP/s", "speedup");
    const int prefill_n[] = {512, 4096};
    for (const model_shape &m : shapes)
        for (int N : prefill_n) {
            if (quick && N > 512) continue;
            const size_t nq = (size_t)N * m.NH * m.HS, nkv = (size_t)N * m.KVH * m.HS;
            float *q, *k, *v, *out;
            CUDA_OK(cudaMalloc(&q, nq * 4));
            CUDA_OK(cudaMalloc(&out, nq * 4));
            CUDA_OK(cudaMalloc(&k, nkv * 4));
            CUDA_OK(cudaMalloc(&v, nkv * 4));
            fill(q, nq, 1);
            fill(k, nkv, 2);
            fill(v, nkv, 3);
            const float scale = 1.0f / sqrtf((float)m.HS);
            const double flops = 2.0 * N * (double)N * m.HS * m.NH;
            const double tf = time_ms(quick ? 5 : 20, 5, true, [&](int) {
                CUDA_OK(kiln_cuda_attention_fast(a, g_s, out, q, k, v, N, 0, m.NH, m.KVH, m.HS,
                                                 scale));
            });
            /* the auditable kernel takes seconds at N = 4096: one call, no warm-up */
            const double ta = time_ms(1, N > 512 ? 1 : 3, N <= 512, [&](int) {
                CUDA_OK(kiln_cuda_attention(g_s, out, q, k, v, N, 0, m.NH, m.KVH, m.HS, scale, 0));
            });
            printf("%-14s %6d | %10.3f %8.2f | %12.3f %8.3f | %6.1fx\n", m.name, N, tf,
                   flops / (tf * 1e-3) / 1e12, ta, flops / (ta * 1e-3) / 1e12, ta / tf);
            CUDA_OK(cudaFree(q));
            CUDA_OK(cudaFree(out));
            CUDA_OK(cudaFree(k));
            CUDA_OK(cudaFree(v));
        }

    /* the decode's launch and where its fixed cost goes, at the smallest shape (Qwen, ctx 512):
     * SM clock, an empty kernel of the same grid, decode_dev where every block returns at once
     * (d_n_past = -1: NaN outputs), and the real decode_dev, each as 24 calls in a graph */
    {
        const model_shape &m = shapes[0];
        const int ctx = 512;
        kiln_cuda_attn_launch li;
        CUDA_OK(kiln_cuda_attn_decode_launch_info(1, 1, m.NH, m.KVH, m.HS, ctx, &li));
        printf("\ndecode launch, %s ctx %d: grid (%u, %u, %u) = %u blocks of %u threads, dynamic "
               "smem %zu B, %s\n", m.name, ctx, li.grid[0], li.grid[1], li.grid[2],
               li.grid[0] * li.grid[1] * li.grid[2], li.block, li.smem,
               li.combine ? "+ combine kernel" : "combine fused");
        unsigned long long *dns;
        CUDA_OK(cudaMalloc(&dns, sizeof *dns));
        const long long cyc = 20000000; /* ~10 ms at 2 GHz */
        clock_kernel<<<1, 1, 0, g_s>>>(cyc, dns); /* warm-up */
        CUDA_OK(cudaGetLastError());
        clock_kernel<<<1, 1, 0, g_s>>>(cyc, dns);
        CUDA_OK(cudaGetLastError());
        unsigned long long ns = 0;
        CUDA_OK(cudaMemcpyAsync(&ns, dns, sizeof ns, cudaMemcpyDeviceToHost, g_s));
        CUDA_OK(cudaStreamSynchronize(g_s));
        CUDA_OK(cudaFree(dns));
        printf("SM clock (clock64 vs globaltimer): %.0f MHz\n",
               ns ? (double)cyc * 1e3 / (double)ns : 0.0);

        const size_t nq = (size_t)m.NH * m.HS, nkv = (size_t)ctx * m.KVH * m.HS;
        float *q, *out, *kv;
        int32_t *pos;
        CUDA_OK(cudaMalloc(&q, nq * 4));
        CUDA_OK(cudaMalloc(&out, nq * 4));
        CUDA_OK(cudaMalloc(&kv, 2 * nkv * GRAPH_LAYERS * 4));
        CUDA_OK(cudaMalloc(&pos, 2 * sizeof(int32_t)));
        fill(q, nq, 6);
        fill(kv, 2 * nkv * GRAPH_LAYERS, 7);
        const int32_t hpos[2] = {ctx - 1, -1}; /* pos: real; pos + 1: every block exits */
        CUDA_OK(cudaMemcpy(pos, hpos, sizeof hpos, cudaMemcpyHostToDevice));
        const float scale = 1.0f / sqrtf((float)m.HS);
        CUDA_OK(kiln_cuda_attn_reserve(a, 1, 1, m.NH, m.HS, ctx));
        CUDA_OK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)li.smem));
        CUDA_OK(cudaStreamSynchronize(g_s));
        const char *what[3] = {"empty kernel, same grid/block/smem", "decode_dev, every block "
                               "exits (n_past -1)", "decode_dev, n_past ctx-1"};
        for (int w = 0; w < 3; w++) {
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CUDA_OK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeThreadLocal));
            cudaError_t ce = cudaSuccess;
            for (int l = 0; l < GRAPH_LAYERS && ce == cudaSuccess; l++) {
                const float *kl = kv + (size_t)l * 2 * nkv;
                if (w == 0) {
                    empty_kernel<<<dim3(li.grid[0], li.grid[1], li.grid[2]), li.block, li.smem,
                                   g_s>>>(NULL);
                    ce = cudaGetLastError();
                } else {
                    ce = kiln_cuda_attention_decode_dev(a, g_s, out, q, kl, kl + nkv, 1, 0,
                                                        w == 1 ? pos + 1 : pos, ctx, m.NH,
                                                        m.KVH, m.HS, scale);
                }
            }
            CUDA_OK(cudaStreamEndCapture(g_s, &graph));
            CUDA_OK(ce);
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            const double tg = time_ms(quick ? 5 : 20, 5, true, [&](int) {
                CUDA_OK(cudaGraphLaunch(exec, g_s));
            }) / GRAPH_LAYERS;
            printf("  %-40s %8.1f us per call (graph of %d)\n", what[w], tg * 1e3, GRAPH_LAYERS);
            CUDA_OK(cudaGraphExecDestroy(exec));
            CUDA_OK(cudaGraphDestroy(graph));
        }
        CUDA_OK(cudaFree(q));
        CUDA_OK(cudaFree(out));
        CUDA_OK(cudaFree(kv));
        CUDA_OK(cudaFree(pos));
    }

    printf("\ndecode (N 1, n_past ctx-1): time per call, GB/s of KV read = 8*ctx*KVH*HS / t\n");
    printf("%-14s %6s %7s %6s | %10s %8s | %12s %8s | %7s\n", "shape", "ctx", "KV MB", "copies",
           "fast us", "GB/s", "auditable us", "GB/s", "speedup");
    const int ctxs[] = {512, 4096, 32768};
    for (const model_shape &m : shapes)
        for (int ctx : ctxs) {
            if (quick && ctx > 4096) continue;
            const size_t nq = (size_t)m.NH * m.HS, nkv = (size_t)ctx * m.KVH * m.HS;
            const double kv_bytes = 2.0 * nkv * 4;
            /* enough copies of (k, v) to exceed the L2 several times, at most 256 */
            int copies = (int)ceil(4.0 * prop.l2CacheSize / kv_bytes);
            copies = std::max(1, std::min(copies, 256));
            float *q, *out, *kv;
            CUDA_OK(cudaMalloc(&q, nq * 4));
            CUDA_OK(cudaMalloc(&out, nq * 4));
            CUDA_OK(cudaMalloc(&kv, 2 * nkv * copies * 4));
            fill(q, nq, 4);
            fill(kv, 2 * nkv * copies, 5);
            const float scale = 1.0f / sqrtf((float)m.HS);
            auto kc = [&](int i) { return kv + (size_t)(i % copies) * 2 * nkv; };
            const double tf = time_ms(quick ? 50 : 200, 5, true, [&](int i) {
                CUDA_OK(kiln_cuda_attention_fast(a, g_s, out, q, kc(i), kc(i) + nkv, 1, ctx - 1,
                                                 m.NH, m.KVH, m.HS, scale));
            });
            const double ta = time_ms(ctx > 4096 ? 5 : 20, 5, true, [&](int i) {
                CUDA_OK(kiln_cuda_attention(g_s, out, q, kc(i), kc(i) + nkv, 1, ctx - 1, m.NH,
                                            m.KVH, m.HS, scale, 0));
            });
            printf("%-14s %6d %7.1f %6d | %10.1f %8.0f | %12.1f %8.0f | %6.1fx\n", m.name, ctx,
                   kv_bytes / 1e6, copies, tf * 1e3, kv_bytes / (tf * 1e-3) / 1e9, ta * 1e3,
                   kv_bytes / (ta * 1e-3) / 1e9, ta / tf);
            CUDA_OK(cudaFree(q));
            CUDA_OK(cudaFree(out));
            CUDA_OK(cudaFree(kv));
        }

    printf("\ndecode_dev in a CUDA graph of %d calls (one per layer, own KV cache each): time "
           "per call\n", GRAPH_LAYERS);
    printf("%-14s %6s %7s | %10s %8s\n", "shape", "ctx", "KV MB", "graph us", "GB/s");
    const int graph_ctxs[] = {512, 4096};
    for (const model_shape &m : shapes)
        for (int ctx : graph_ctxs) {
            const size_t nq = (size_t)m.NH * m.HS, nkv = (size_t)ctx * m.KVH * m.HS;
            const double kv_bytes = 2.0 * nkv * 4;
            float *q, *out, *kv;
            int32_t *pos;
            CUDA_OK(cudaMalloc(&q, nq * 4));
            CUDA_OK(cudaMalloc(&out, nq * 4));
            CUDA_OK(cudaMalloc(&kv, 2 * nkv * GRAPH_LAYERS * 4));
            CUDA_OK(cudaMalloc(&pos, sizeof(int32_t)));
            fill(q, nq, 6);
            fill(kv, 2 * nkv * GRAPH_LAYERS, 7);
            const int32_t last = ctx - 1;
            CUDA_OK(cudaMemcpy(pos, &last, sizeof last, cudaMemcpyHostToDevice));
            const float scale = 1.0f / sqrtf((float)m.HS);
            CUDA_OK(kiln_cuda_attn_reserve(a, 1, 1, m.NH, m.HS, ctx));
            CUDA_OK(cudaStreamSynchronize(g_s));
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CUDA_OK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeThreadLocal));
            cudaError_t ce = cudaSuccess;
            for (int l = 0; l < GRAPH_LAYERS && ce == cudaSuccess; l++) {
                const float *kl = kv + (size_t)l * 2 * nkv;
                ce = kiln_cuda_attention_decode_dev(a, g_s, out, q, kl, kl + nkv, 1, 0, pos, ctx,
                                                    m.NH, m.KVH, m.HS, scale);
            }
            CUDA_OK(cudaStreamEndCapture(g_s, &graph));
            CUDA_OK(ce);
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            const double tg = time_ms(quick ? 5 : 20, 5, true, [&](int) {
                CUDA_OK(cudaGraphLaunch(exec, g_s));
            }) / GRAPH_LAYERS;
            printf("%-14s %6d %7.1f | %10.1f %8.0f\n", m.name, ctx, kv_bytes / 1e6, tg * 1e3,
                   kv_bytes / (tg * 1e-3) / 1e9);
            CUDA_OK(cudaGraphExecDestroy(exec));
            CUDA_OK(cudaGraphDestroy(graph));
            CUDA_OK(cudaFree(q));
            CUDA_OK(cudaFree(out));
            CUDA_OK(cudaFree(kv));
            CUDA_OK(cudaFree(pos));
        }
    kiln_cuda_attn_free(a);
    CUDA_OK(cudaEventDestroy(g_e0));
    CUDA_OK(cudaEventDestroy(g_e1));
    CUDA_OK(cudaStreamDestroy(g_s));
    return 0;
}
