/*
 * test_cuda_colsum_fast.cu -- the fast mode's column sums (cuda_norm.h's
 * kiln_cuda_col_sum_fast: dbias and RMSNorm dw in a chunked order summed in double) and their
 * two users, and the fast RMSNorm backward's rows kernel, against host double-precision
 * references.
 *
 *   cases: N in {1, 7, 300, 2048, 8193} x W in {1, 33, 576, 896, 4864} x the three modes
 *   (plain sum; a * b; a * f32(b * s[n])), rows ld = W + 5 apart (padding NaN) for W in
 *   {33, 896} at odd N, random values of mixed magnitudes added into random old values.
 *   Per case:
 *     - every column within the bound of cuda_norm.h, with the host's own rounding
 *       on top: |got - ref| <= 2^-24 |ref| + (N + 300) 2^-52 S + 1e-37, where ref is the
 *       sum in double (old + terms in row order) and S = |old| + sum |terms|; the largest
 *       err / S is printed (the brief's normalised figure; far below 1e-5);
 *     - out's 64 floats past W keep their NaN-poison bits (never written);
 *     - a second run (scratch at another address, both scratches filled with NaN bits
 *       first) gives the same bits, and so does a run on copies of a and b placed 4 bytes
 *       past 16-byte alignment (scalar loads where the first run used float4 ones);
 *   integer data (small integers, s a power of two: every sum exact in f32) must give the
 *   exact result, bit for bit: no row or column lost or counted twice, for N in {7, 8193}
 *   x W in {33, 896} x the three modes.
 *   users: kiln_cuda_matmul_backward_fast's dbias (alone, and with dx and dW, whose buffer
 *   it shares) equals kiln_cuda_col_sum_fast on dy.
 *   rmsnorm rows (kiln_cuda_rmsnorm_backward_fast, dw skipped): C in {1, 3, 4, 32, 33, 63,
 *   64, 128, 129, 576, 577, 896, 1024, 1025, 2048, 5000, 8192, 8196, 12289} (every variant:
 *   8, 16 or 32 lanes per row, a block per row cached or streamed, float4 and scalar loads)
 *   x N in {1, 7, 300} x {w, w NULL} x {accumulate, not} x {dx separate, dx = dy}: every dx
 *   and rstd within cuda_norm.h's bound (with margin: (3h + 16) 2^-24 r (|g| + |x| U)
 *   + 2^-24 |ref|, rstd (h/2 + 4) 2^-24 r) of a float64 reference from the same f32 inputs;
 *   dx starts NaN when not accumulating (every element written), 64 NaN guards past dx and
 *   rstd stay untouched; a second run and a run on inputs one float past 16-byte alignment
 *   give the same bits. One row of x is all zero (r = 1/sqrt(eps)).
 *   the whole op (N 2048, C 576): with dw, dx and rstd are the rows call's bits and dw equals
 *   kiln_cuda_col_sum_fast on (dy, x, that rstd); through the backend table, a fast backend's
 *   rmsnorm_backward and matmul_backward (dbias) give those bits, an auditable one the exact
 *   kernels' bits.
 *   dw in one pass (the launcher with dw for 64 < C <= 1024: rmsnorm_bwd_dw_fast_kernel)
 *   against the two kernels it stands for (the launcher without dw, then
 *   kiln_cuda_col_sum_fast on (dy, x, its rstd)): dx, dx16 and rstd bit for bit, dw within a
 *   last bit (counted), for C in {65, 576, 896, 1000, 1024, 899} x N in {7, 300, 2048, 8193}
 *   x {accumulate, not} x {dx16, none}, aligned and one float past; timed against the two
 *   kernels at 8192 x 896 and 16384 x 576.
 *   argument errors (no GPU needed): ld < W, NULL a or scratch, sc without b, scratch too
 *   small are refused with cudaErrorInvalidValue; the scratch length is K * W, K <= 256;
 *   rmsnorm_backward_fast refuses dx or rstd NULL and dw without scratch.
 *   timing (cudaEvent, mean of 20): the exact col_lanes kernel (kiln_cuda_col_sum_exact)
 *   against the fast sum at N = 8192 for W = 576 (mode 2, RMSNorm dw), 896 and 4864
 *   (mode 0, dbias), and 114688 rows of 64 (mode 2, per-head q/k norms); the rmsnorm rows,
 *   exact (kiln_cuda_rmsnorm_backward, dw skipped) against fast, at N 8192 x C 576 and 896
 *   (accumulate) and 73728 rows of 64 (per-head norms).
 *
 * Usage: test_cuda_colsum_fast [--no-big] [--seed N] (--no-big skips the timing). Exit 0 with
 * "ALL OK", 1 with "FAILED n", 77 without a GPU (after the checks that need none).
 */
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ops/cuda/cuda_matmul.h"
#include "ops/cuda/cuda_norm.h"
extern "C" {
#include "base/base.h"
#include "base/tensor.h"
#include "ops/ops.h"
}

#define GPU_TEST_SEED 0xc015c015ull
#include "gpu_test_check.h"

#include "gpu_test_cuda_check.h"

static cudaStream_t g_s;
static double g_worst = 0.0; /* max over the random cases of err / S */

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float nan_poison() {
    const uint32_t u = 0x7fc0dead;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

template <typename T> static T *dev_upload(const std::vector<T> &h, size_t extra = 0) {
    T *d = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&d, (h.size() + extra) * sizeof(T) + 1));
    if (!h.empty())
        CUDA_FATAL(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
template <typename T> static std::vector<T> dev_download(const T *d, size_t n) {
    std::vector<T> h(n);
    if (n) CUDA_FATAL(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
static bool same_bits(const std::vector<float> &x, const std::vector<float> &y) {
    return x.size() == y.size() && (x.empty() || !memcmp(x.data(), y.data(), x.size() * 4));
}

/* Two column sums of the same exact double products in two orders: the same but for rare
 * last bits. Returns the number of elements that differ (-1: a size differs, or one differs
 * by more than one f32 ulp, or is not finite where the other is). */
static long dw_differences(const std::vector<float> &x, const std::vector<float> &y) {
    if (x.size() != y.size()) return -1;
    long n = 0;
    for (size_t i = 0; i < x.size(); i++) {
        if (!memcmp(&x[i], &y[i], 4)) continue;
        if (!std::isfinite(x[i]) || !std::isfinite(y[i])) return -1;
        if (fabs((double)x[i] - (double)y[i]) > (double)nextafterf(fabsf(y[i]), INFINITY) -
                                                     (double)fabsf(y[i]))
            return -1;
        n++;
    }
    return n;
}

/* ---- one case ------------------------------------------------------------------------------ */

/* Host data of a case: a, b (N rows, ld apart; columns W..ld-1 NaN), s(N), old(W). */
struct Data {
    int N = 0, mode = 0;
    int64_t W = 0, ld = 0;
    std::vector<float> a, b, s, old;
};

static void make_data(Data &D, int N, int64_t W, int64_t ld, int mode, bool ints) {
    D.N = N;
    D.W = W;
    D.ld = ld;
    D.mode = mode;
    const size_t n = (size_t)N * (size_t)ld;
    D.a.assign(n, nan_poison());
    D.b.assign(mode >= 1 ? n : 0, nan_poison());
    D.s.assign(mode == 2 ? (size_t)N : 0, 0.0f);
    D.old.resize((size_t)W);
    for (int r = 0; r < N; r++)
        for (int64_t c = 0; c < W; c++) {
            const size_t i = (size_t)r * (size_t)ld + (size_t)c;
            if (ints) {
                D.a[i] = (float)((int)(rnd64() % 17) - 8);
                if (mode >= 1) D.b[i] = (float)((int)(rnd64() % 9) - 4);
            } else { /* magnitudes 2^-6 .. 2^6, so the terms do not all look alike */
                D.a[i] = ldexpf(rndu(), (int)(rnd64() % 13) - 6);
                if (mode >= 1) D.b[i] = ldexpf(rndu(), (int)(rnd64() % 5) - 2);
            }
        }
    for (int r = 0; r < N && mode == 2; r++)
        D.s[(size_t)r] = ints ? ldexpf(1.0f, (int)(rnd64() % 3) - 1) : 0.25f + fabsf(rndu());
    for (int64_t c = 0; c < W; c++)
        D.old[(size_t)c] = ints ? (float)((int)(rnd64() % 201) - 100) : 4.0f * rndu();
}

/* ref[c] = old[c] + sum over rows in order (double), S[c] = |old| + sum |terms|. The term's
 * bv is formed in f32 exactly as the contract says (b * s rounded once). */
static void host_ref(const Data &D, std::vector<double> &ref, std::vector<double> &S) {
    ref.assign((size_t)D.W, 0.0);
    S.assign((size_t)D.W, 0.0);
    for (int64_t c = 0; c < D.W; c++) {
        ref[(size_t)c] = D.old[(size_t)c];
        S[(size_t)c] = fabs((double)D.old[(size_t)c]);
    }
    for (int r = 0; r < D.N; r++) {
        const float *ar = D.a.data() + (size_t)r * (size_t)D.ld;
        const float *br = D.mode >= 1 ? D.b.data() + (size_t)r * (size_t)D.ld : nullptr;
        for (int64_t c = 0; c < D.W; c++) {
            float bv = 1.0f;
            if (D.mode == 1) bv = br[c];
            if (D.mode == 2) bv = br[c] * D.s[(size_t)r];
            const double t = (double)ar[c] * (double)bv; /* exact */
            ref[(size_t)c] += t;
            S[(size_t)c] += fabs(t);
        }
    }
}

/* Device copies and one call of the fast sum into old + 64 NaN guards; scratch filled with
 * NaN bits first, placed `shift` doubles into a larger allocation. Returns out(W + 64). */
struct Dev {
    float *a = nullptr, *b = nullptr, *s = nullptr;
};
static bool run_fast(const Data &D, const Dev &d, int shift, std::vector<float> &got) {
    std::vector<float> o(D.old);
    o.resize((size_t)D.W + 64, nan_poison());
    float *d_out = dev_upload(o);
    const size_t len = kiln_cuda_col_sum_fast_scratch_len(D.N, D.W);
    double *d_ws = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&d_ws, (len + (size_t)shift) * sizeof(double)));
    CUDA_FATAL(cudaMemset(d_ws, 0xff, (len + (size_t)shift) * sizeof(double)));
    const cudaError_t e = kiln_cuda_col_sum_fast(g_s, d_out, d.a, d.b, d.s, D.ld, D.N, D.W,
                                                 d_ws + shift, len);
    bool ok = e == cudaSuccess;
    if (!ok) FAIL("kiln_cuda_col_sum_fast: %s", cudaGetErrorString(e));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    got = dev_download(d_out, o.size());
    CUDA_FATAL(cudaFree(d_out));
    CUDA_FATAL(cudaFree(d_ws));
    return ok;
}

static void test_case(int N, int64_t W, int64_t ld, int mode, bool ints) {
    Data D;
    make_data(D, N, W, ld, mode, ints);
    std::vector<double> ref, S;
    host_ref(D, ref, S);
    Dev d;
    d.a = dev_upload(D.a);
    if (mode >= 1) d.b = dev_upload(D.b);
    if (mode == 2) d.s = dev_upload(D.s);
    /* the same values one float past 16-byte alignment: the scalar loads instead of float4
     * (where W allows those), which must not change the order */
    Dev d1;
    float *shifted[2] = {nullptr, nullptr};
    for (int k = 0; k < (mode >= 1 ? 2 : 1); k++) {
        const std::vector<float> &h = k == 0 ? D.a : D.b;
        CUDA_FATAL(cudaMalloc((void **)&shifted[k], (h.size() + 1) * 4));
        CUDA_FATAL(cudaMemcpy(shifted[k] + 1, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    d1.a = shifted[0] + 1;
    d1.b = mode >= 1 ? shifted[1] + 1 : nullptr;
    d1.s = d.s;
    std::vector<float> got[3];
    const int fails0 = g_fail;
    const bool ran =
        run_fast(D, d, 0, got[0]) && run_fast(D, d, 5, got[1]) && run_fast(D, d1, 0, got[2]);
    double worst = 0.0;
    if (ran) {
        int bad_cols = 0, first_bad = -1;
        for (int64_t c = 0; c < W; c++) {
            const double g = got[0][(size_t)c], r = ref[(size_t)c], sc = S[(size_t)c];
            const double err = fabs(g - r);
            bool ok;
            if (ints) {
                ok = g == r; /* every partial sum is an exact small integer times 2^-1 .. 2 */
            } else {
                const double tol = 0x1p-24 * fabs(r) + (double)(N + 300) * 0x1p-52 * sc + 1e-37;
                ok = err <= tol; /* false for NaN */
                if (sc > 0.0 && err / sc > worst) worst = err / sc;
            }
            if (!ok) {
                if (first_bad < 0) first_bad = (int)c;
                bad_cols++;
            }
        }
        if (bad_cols)
            FAIL("N=%d W=%lld mode %d: %d columns off the %s; first c=%d got %.9g want %.17g "
                 "(S %.3g)",
                 N, (long long)W, mode, bad_cols, ints ? "exact sum" : "bound", first_bad,
                 (double)got[0][(size_t)first_bad], ref[(size_t)first_bad], S[(size_t)first_bad]);
        for (size_t g = (size_t)W; g < got[0].size(); g++)
            if (bits(got[0][g]) != bits(nan_poison())) {
                FAIL("N=%d W=%lld mode %d: out[%zu] past W written", N, (long long)W, mode, g);
                break;
            }
        if (!same_bits(got[0], got[1]))
            FAIL("N=%d W=%lld mode %d: second run (other scratch address) differs", N,
                 (long long)W, mode);
        if (!same_bits(got[0], got[2]))
            FAIL("N=%d W=%lld mode %d: inputs 4 bytes past alignment give other bits", N,
                 (long long)W, mode);
    }
    if (!ints && worst > g_worst) g_worst = worst;
    printf("N=%-5d W=%-4lld ld=%-4lld mode %d %s: max err/S %.2e  %s\n", N, (long long)W,
           (long long)ld, mode, ints ? "integers" : "random  ", worst,
           g_fail == fails0 ? "OK" : "FAILED");
    cudaFree(d.a);
    cudaFree(d.b);
    cudaFree(d.s);
    cudaFree(shifted[0]);
    cudaFree(shifted[1]);
}

/* ---- the users: matmul_backward_fast's dbias, rmsnorm_backward_fast, the backend table ---- */

/* kiln_cuda_col_sum_fast on device inputs into a copy of old (the expected bits). */
static std::vector<float> fast_sum_of(const float *a, const float *b, const float *s,
                                      int64_t ld, int N, int64_t W, const std::vector<float> &old) {
    float *d_out = dev_upload(old);
    const size_t len = kiln_cuda_col_sum_fast_scratch_len(N, W);
    double *d_ws = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&d_ws, len * sizeof(double) + 8));
    CUDA_FATAL(kiln_cuda_col_sum_fast(g_s, d_out, a, b, s, ld, N, W, d_ws, len));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    std::vector<float> h = dev_download(d_out, old.size());
    cudaFree(d_out);
    cudaFree(d_ws);
    return h;
}

static void test_matmul_dbias(kiln_cuda_gemm *g, kiln_backend *fast_be, kiln_backend *aud_be) {
    const int fails0 = g_fail;
    const int N = 300;
    const int64_t R = 896, C = 64;
    std::vector<float> dy((size_t)N * R), x((size_t)N * C), w((size_t)R * C), db0((size_t)R);
    for (float &f : dy) f = rndu();
    for (float &f : x) f = rndu();
    for (float &f : w) f = rndu();
    for (float &f : db0) f = rndu();
    float *d_dy = dev_upload(dy), *d_x = dev_upload(x), *d_w = dev_upload(w);
    const std::vector<float> want = fast_sum_of(d_dy, nullptr, nullptr, R, N, R, db0);

    /* the launcher: dbias alone, then with dx and dW (the partials share their buffer) */
    for (int with_products = 0; with_products < 2; with_products++) {
        float *d_db = dev_upload(db0);
        float *d_dx = nullptr, *d_dW = nullptr;
        CUDA_FATAL(cudaMalloc((void **)&d_dx, (size_t)N * C * 4));
        CUDA_FATAL(cudaMalloc((void **)&d_dW, (size_t)R * C * 4));
        CUDA_FATAL(cudaMemset(d_dW, 0, (size_t)R * C * 4));
        const cudaError_t e = kiln_cuda_matmul_backward_fast(
            g, g_s, with_products ? d_dx : nullptr, with_products ? d_dW : nullptr, d_db, d_dy,
            d_x, (const uint8_t *)d_w, (size_t)C * 4, KILN_DTYPE_F32, R, C, N, false);
        if (e != cudaSuccess) FAIL("matmul_backward_fast: %s", cudaGetErrorString(e));
        CUDA_FATAL(cudaStreamSynchronize(g_s));
        if (!same_bits(dev_download(d_db, (size_t)R), want))
            FAIL("matmul_backward_fast%s: dbias is not kiln_cuda_col_sum_fast's bits",
                 with_products ? " (with dx, dW)" : "");
        cudaFree(d_db);
        cudaFree(d_dx);
        cudaFree(d_dW);
    }

    /* the backend table, dbias only: fast -> the fast sum, auditable -> the exact kernel */
    std::vector<float> want_exact;
    {
        float *d_db = dev_upload(db0);
        CUDA_FATAL(kiln_cuda_col_sum_exact(g_s, d_db, d_dy, nullptr, nullptr, R, N, R));
        CUDA_FATAL(cudaStreamSynchronize(g_s));
        want_exact = dev_download(d_db, (size_t)R);
        cudaFree(d_db);
    }
    kiln_tensor W;
    memset(&W, 0, sizeof W);
    W.name = "W";
    W.dtype = KILN_DTYPE_F32;
    W.n_dims = 2;
    for (int k = 0; k < KILN_MAX_DIMS; k++) W.shape[k] = 1;
    W.shape[0] = R;
    W.shape[1] = C;
    W.data = w.data(); /* host: the backend uploads it */
    W.nbytes = w.size() * 4;
    kiln_backend *bes[2] = {fast_be, aud_be};
    for (int k = 0; k < 2; k++) {
        float *d_db = dev_upload(db0);
        bes[k]->i->matmul_backward(bes[k], nullptr, nullptr, d_db, d_dy, d_x, &W, N, false);
        OK_OR_FAIL(kiln_backend_status(bes[k]));
        CUDA_FATAL(cudaDeviceSynchronize());
        if (!same_bits(dev_download(d_db, (size_t)R), k == 0 ? want : want_exact))
            FAIL("backend matmul_backward (%s): dbias is not the %s bits",
                 k == 0 ? "fast" : "auditable", k == 0 ? "fast sum's" : "exact kernel's");
        cudaFree(d_db);
    }
    printf("matmul_backward dbias (N=%d R=%lld): launcher and backends  %s\n", N, (long long)R,
           g_fail == fails0 ? "OK" : "FAILED");
    cudaFree(d_dy);
    cudaFree(d_x);
    cudaFree(d_w);
}

/* kiln_cuda_col_sum_fast_multi: each job the bits of its single call (vector and scalar
 * loads, odd widths and leading dimensions, 1..4 jobs), the multi launcher's biases (q, k, v
 * alone: one call, the bits of three), and the refusals. */
static void test_col_sum_multi(kiln_cuda_gemm *g) {
    const int fails0 = g_fail;
    struct Set {
        int N, n, shift; /* shift: a[0] starts this many floats in (scalar loads) */
        int64_t W[4], pad;
    } sets[] = {{8192, 3, 0, {896, 128, 128}, 0}, {300, 3, 0, {33, 576, 7}, 5},
                {1, 2, 0, {64, 896}, 0},          {2048, 4, 0, {4864, 128, 128, 896}, 0},
                {1000, 3, 1, {896, 128, 128}, 0}, {8193, 1, 0, {896}, 0}};
    int cases = 0;
    for (const Set &S : sets) {
        float *out[4], *a_base[4];
        const float *a[4];
        int64_t ld[4];
        std::vector<float> old[4], want[4];
        for (int i = 0; i < S.n; i++) {
            ld[i] = S.W[i] + S.pad;
            std::vector<float> h((size_t)S.N * ld[i] + 4), o((size_t)S.W[i]);
            for (float &f : h) f = rndu();
            for (float &f : o) f = rndu();
            a_base[i] = dev_upload(h);
            a[i] = a_base[i] + (i == 0 ? S.shift : 0);
            old[i] = o;
            want[i] = fast_sum_of(a[i], nullptr, nullptr, ld[i], S.N, S.W[i], o);
            out[i] = dev_upload(o);
        }
        const size_t len = kiln_cuda_col_sum_fast_multi_scratch_len(S.n, S.W, S.N);
        double *ws = nullptr;
        CUDA_FATAL(cudaMalloc((void **)&ws, len * sizeof(double) + 8));
        const cudaError_t e = kiln_cuda_col_sum_fast_multi(g_s, S.n, out, a, ld, S.W, S.N, ws, len);
        if (e != cudaSuccess) FAIL("col_sum_fast_multi: %s", cudaGetErrorString(e));
        CUDA_FATAL(cudaStreamSynchronize(g_s));
        for (int i = 0; i < S.n; i++) {
            if (!same_bits(dev_download(out[i], (size_t)S.W[i]), want[i]))
                FAIL("col_sum_fast_multi N=%d job %d (W %lld ld %lld): not the single call's bits",
                     S.N, i, (long long)S.W[i], (long long)ld[i]);
            cases++;
        }
        /* the launcher: bias sums alone (no products), one multi call for all items */
        if (S.pad == 0 && S.shift == 0) {
            kiln_cuda_mb_item it[4];
            float *db[4];
            memset(it, 0, sizeof it);
            for (int i = 0; i < S.n; i++) {
                db[i] = dev_upload(old[i]);
                it[i].dbias = db[i];
                it[i].dy = a[i];
                it[i].dt = KILN_DTYPE_F32;
                it[i].R = S.W[i];
            }
            const cudaError_t e2 = kiln_cuda_matmul_backward_fast_multi(g, g_s, S.n, it, nullptr,
                                                                        nullptr, 64, S.N, false);
            if (e2 != cudaSuccess) FAIL("matmul_backward_fast_multi (biases): %s", cudaGetErrorString(e2));
            CUDA_FATAL(cudaStreamSynchronize(g_s));
            for (int i = 0; i < S.n; i++) {
                if (!same_bits(dev_download(db[i], (size_t)S.W[i]), want[i]))
                    FAIL("matmul_backward_fast_multi N=%d bias %d: not the single sum's bits", S.N, i);
                cudaFree(db[i]);
            }
        }
        for (int i = 0; i < S.n; i++) {
            cudaFree(a_base[i]);
            cudaFree(out[i]);
        }
        cudaFree(ws);
    }
    /* refusals (nothing launched) */
    {
        float *o[5] = {nullptr};
        const float *a[5] = {nullptr};
        int64_t ld[5] = {8, 8, 8, 8, 8}, W[5] = {8, 8, 8, 8, 8};
        double *ws = nullptr;
        CUDA_FATAL(cudaMalloc((void **)&ws, 4096));
        float *d = nullptr;
        CUDA_FATAL(cudaMalloc((void **)&d, 4096));
        for (int i = 0; i < 5; i++) o[i] = d, a[i] = d;
        if (kiln_cuda_col_sum_fast_multi(g_s, 0, o, a, ld, W, 8, ws, 512) != cudaErrorInvalidValue ||
            kiln_cuda_col_sum_fast_multi(g_s, 5, o, a, ld, W, 8, ws, 512) != cudaErrorInvalidValue)
            FAIL("col_sum_fast_multi: job counts 0 and 5 not refused");
        ld[1] = 7;
        if (kiln_cuda_col_sum_fast_multi(g_s, 2, o, a, ld, W, 8, ws, 512) != cudaErrorInvalidValue)
            FAIL("col_sum_fast_multi: ld < W not refused");
        ld[1] = 8;
        if (kiln_cuda_col_sum_fast_multi(g_s, 2, o, a, ld, W, 8, ws, 15) != cudaErrorInvalidValue)
            FAIL("col_sum_fast_multi: a short scratch not refused");
        cudaFree(ws);
        cudaFree(d);
    }
    printf("column sums of several matrices in one launch: %d jobs the single calls' bits, the "
           "launcher's biases too, refusals  %s\n",
           cases, g_fail == fails0 ? "OK" : "FAILED");
}

/* ---- rmsnorm backward (fast): the rows kernel against float64, then dw and the table ------ */

/* The header's h (cuda_norm.h): the longest path of a term through the row sums. */
static int rms_depth(int C) { return C <= 1024 ? 15 : (C + 1023) / 1024 + 10; }

/* Host data of a rows case: x, dy (N,C), w(C), old dx (N,C). Mixed magnitudes (x in 2^-4 ..
 * 2^4 by rows and elements), row 2 of x all zero when N > 2 (r = 1/sqrt(eps), u = 0). */
struct RmsData {
    int N = 0, C = 0;
    std::vector<float> x, dy, w, old;
};
static const float kRmsEps = 1e-6f;

static void rms_make(RmsData &R, int N, int C) {
    R.N = N;
    R.C = C;
    const size_t n = (size_t)N * (size_t)C;
    R.x.resize(n);
    R.dy.resize(n);
    R.old.resize(n);
    R.w.resize((size_t)C);
    for (int r = 0; r < N; r++) {
        const int row_e = (int)(rnd64() % 5) - 2;
        for (int c = 0; c < C; c++) {
            const size_t i = (size_t)r * C + c;
            R.x[i] = r == 2 ? 0.0f : ldexpf(rndu(), row_e + (int)(rnd64() % 5) - 2);
            R.dy[i] = ldexpf(rndu(), (int)(rnd64() % 5) - 4);
            R.old[i] = rndu();
        }
    }
    for (float &f : R.w) f = 1.0f + 0.5f * rndu();
}

/* ref = old (acc) + r (g - x u) in double from the f32 inputs, g = dy * w exactly; tol the
 * header's bound with margin: (3h + 16) 2^-24 r (|g| + |x| U) + 2^-24 |ref| (the accumulate's
 * rounding) + 1e-35; the scale r (|g| + |x| U) for the printed figure. rref, rtol per row. */
struct RmsRef {
    std::vector<double> ref, tol, scale, rref, rtol;
};
static void rms_ref(const RmsData &R, const float *w, bool acc, const std::vector<float> &old,
                    RmsRef &F) {
    const int N = R.N, C = R.C, h = rms_depth(C);
    const size_t n = (size_t)N * C;
    F.ref.resize(n);
    F.tol.resize(n);
    F.scale.resize(n);
    F.rref.resize((size_t)N);
    F.rtol.resize((size_t)N);
    std::vector<double> g((size_t)C);
    for (int r = 0; r < N; r++) {
        const float *xr = R.x.data() + (size_t)r * C, *dyr = R.dy.data() + (size_t)r * C;
        double ss = 0.0, d = 0.0, sa = 0.0;
        for (int c = 0; c < C; c++) {
            g[c] = (double)dyr[c] * (w ? (double)w[c] : 1.0);
            ss += (double)xr[c] * xr[c];
            d += g[c] * xr[c];
            sa += fabs(g[c] * xr[c]);
        }
        const double rr = 1.0 / sqrt(ss / C + (double)kRmsEps);
        const double u = rr * rr * d / C, U = rr * rr * sa / C;
        F.rref[(size_t)r] = rr;
        F.rtol[(size_t)r] = (h / 2.0 + 4.0) * 0x1p-24 * rr;
        for (int c = 0; c < C; c++) {
            const size_t i = (size_t)r * C + c;
            const double v = rr * (g[c] - xr[c] * u);
            F.ref[i] = (acc ? (double)old[i] : 0.0) + v;
            F.scale[i] = rr * (fabs(g[c]) + fabs((double)xr[c]) * U);
            F.tol[i] = (3.0 * h + 16.0) * 0x1p-24 * F.scale[i] + 0x1p-24 * fabs(F.ref[i]) + 1e-35;
        }
    }
}

/* A device buffer holding h at `shift` floats past a 256-byte-aligned start, then 64 NaN
 * guards; *base is what to free. */
static float *rms_buf(const std::vector<float> &h, int shift, float **base) {
    std::vector<float> v((size_t)shift, nan_poison());
    v.insert(v.end(), h.begin(), h.end());
    v.resize(v.size() + 64, nan_poison());
    *base = dev_upload(v);
    return *base + shift;
}

/* One kiln_cuda_rmsnorm_backward_fast call with dw skipped. alias: dx is dy's buffer (which
 * then starts as dy); else dx starts as old (acc) or NaN (every element must be written).
 * rstd starts NaN. Returns dx and rstd with their 64 guards. Unless alias, the call also
 * writes dx16 (shifted like dx, so both load paths run), which must be the bf16 rounding of
 * every dx element, its guards untouched. */
static bool rms_run(const RmsData &R, bool use_w, bool acc, bool alias, int shift,
                    std::vector<float> &dx, std::vector<float> &rstd) {
    const size_t n = (size_t)R.N * R.C;
    float *bx, *bdy, *bw = nullptr, *bdx = nullptr, *brs;
    float *d_x = rms_buf(R.x, shift, &bx), *d_dy = rms_buf(R.dy, shift, &bdy);
    float *d_w = use_w ? rms_buf(R.w, shift, &bw) : nullptr;
    float *d_dx = alias ? d_dy
                        : rms_buf(acc ? R.old : std::vector<float>(n, nan_poison()), shift, &bdx);
    float *d_rstd = rms_buf(std::vector<float>((size_t)R.N, nan_poison()), 0, &brs);
    uint16_t *b16 = nullptr, *d16 = nullptr;
    if (!alias) { /* n + 64 guards, 0xffff everywhere, at shift elements */
        CUDA_FATAL(cudaMalloc((void **)&b16, (n + 64 + (size_t)shift) * 2));
        CUDA_FATAL(cudaMemset(b16, 0xff, (n + 64 + (size_t)shift) * 2));
        d16 = b16 + shift;
    }
    const cudaError_t e = kiln_cuda_rmsnorm_backward_fast(
        g_s, d_dx, d16, nullptr, d_dy, d_x, d_w, R.N, R.C, kRmsEps, d_rstd, acc, nullptr, 0);
    if (e != cudaSuccess) FAIL("rmsnorm_backward_fast N=%d C=%d: %s", R.N, R.C,
                               cudaGetErrorString(e));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    dx = dev_download(d_dx, n + 64);
    rstd = dev_download(d_rstd, (size_t)R.N + 64);
    if (d16) {
        std::vector<uint16_t> h16(n + 64);
        CUDA_FATAL(cudaMemcpy(h16.data(), d16, (n + 64) * 2, cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (size_t i = 0; i < n + 64; i++)
            bad += h16[i] != (i < n ? kiln_fp32_to_bf16(dx[i]) : (uint16_t)0xffff);
        if (bad)
            FAIL("rmsnorm_backward_fast N=%d C=%d shift %d: %zu dx16 values are not the bf16 of "
                 "dx (or a guard was written)", R.N, R.C, shift, bad);
        cudaFree(b16);
    }
    cudaFree(bx);
    cudaFree(bdy);
    cudaFree(bw);
    cudaFree(bdx);
    cudaFree(brs);
    return e == cudaSuccess;
}

/* Checks one run against F; returns the largest err / tol seen (dx and rstd), and raises
 * *units to the largest dx err / (2^-24 scale) (units NULL: not measured; with accumulate the
 * final addition's rounding is relative to |old + v|, not to the scale). */
static double rms_check(const char *what, const RmsData &R, const RmsRef &F,
                        const std::vector<float> &dx, const std::vector<float> &rstd,
                        double *units) {
    const size_t n = (size_t)R.N * R.C;
    double worst = 0.0;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        const double err = fabs((double)dx[i] - F.ref[i]);
        if (!(err <= F.tol[i])) { /* NaN: an element never written */
            if (!bad++) first = i;
            continue;
        }
        worst = fmax(worst, err / F.tol[i]);
        if (units && F.scale[i] > 0.0) *units = fmax(*units, err / (0x1p-24 * F.scale[i]));
    }
    if (bad)
        FAIL("rmsnorm rows N=%d C=%d %s: %zu of %zu dx off the bound; first [%zu] got %.9g "
             "want %.17g (tol %.3g)",
             R.N, R.C, what, bad, n, first, (double)dx[first], F.ref[first], F.tol[first]);
    bad = 0;
    for (int r = 0; r < R.N; r++) {
        const double err = fabs((double)rstd[(size_t)r] - F.rref[(size_t)r]);
        if (!(err <= F.rtol[(size_t)r])) {
            if (!bad++) first = (size_t)r;
            continue;
        }
        worst = fmax(worst, err / F.rtol[(size_t)r]);
    }
    if (bad)
        FAIL("rmsnorm rows N=%d C=%d %s: %zu rstd off the bound; first row %zu got %.9g want "
             "%.17g",
             R.N, R.C, what, bad, first, (double)rstd[first], F.rref[first]);
    for (size_t i = n; i < dx.size(); i++)
        if (bits(dx[i]) != bits(nan_poison())) {
            FAIL("rmsnorm rows N=%d C=%d %s: dx written past N*C", R.N, R.C, what);
            break;
        }
    for (size_t i = (size_t)R.N; i < rstd.size(); i++)
        if (bits(rstd[i]) != bits(nan_poison())) {
            FAIL("rmsnorm rows N=%d C=%d %s: rstd written past N", R.N, R.C, what);
            break;
        }
    return worst;
}

/* Per C, for N in {1, 7, 300}: six variants (w or NULL, accumulate or not, dx separate or
 * aliasing dy) each within the bound; a second run, and a run on inputs one float past
 * alignment (scalar loads), give the first run's bits. */
static double g_rms_worst = 0.0, g_rms_units = 0.0;
static void test_rms_rows(int C) {
    const int fails0 = g_fail;
    double worst = 0.0, units = 0.0;
    for (int N : {1, 7, 300}) {
        RmsData R;
        rms_make(R, N, C);
        struct {
            bool w, acc, alias;
            const char *name;
        } vs[] = {
            {true, false, false, "w"},           {true, true, false, "w acc"},
            {false, true, false, "no w, acc"},   {false, false, false, "no w"},
            {true, false, true, "w, dx = dy"},   {false, true, true, "no w, acc, dx = dy"},
        };
        for (const auto &v : vs) {
            RmsRef F;
            rms_ref(R, v.w ? R.w.data() : nullptr, v.acc, v.alias ? R.dy : R.old, F);
            std::vector<float> dx, rstd;
            if (!rms_run(R, v.w, v.acc, v.alias, 0, dx, rstd)) continue;
            worst = fmax(worst, rms_check(v.name, R, F, dx, rstd, v.acc ? nullptr : &units));
            if (v.w && v.acc && !v.alias) { /* determinism: again, and misaligned */
                std::vector<float> dx2, rstd2, dx3, rstd3;
                if (rms_run(R, true, true, false, 0, dx2, rstd2) &&
                    (!same_bits(dx, dx2) || !same_bits(rstd, rstd2)))
                    FAIL("rmsnorm rows N=%d C=%d: a second run gives other bits", N, C);
                if (rms_run(R, true, true, false, 1, dx3, rstd3) &&
                    (!same_bits(dx, dx3) || !same_bits(rstd, rstd3)))
                    FAIL("rmsnorm rows N=%d C=%d: inputs 4 bytes past alignment give other "
                         "bits",
                         N, C);
            }
        }
    }
    g_rms_worst = fmax(g_rms_worst, worst);
    g_rms_units = fmax(g_rms_units, units);
    printf("rmsnorm rows C=%-5d (N 1, 7, 300 x 6 variants): max err/bound %.3f, max dx err "
           "%.1f u*scale (no accumulate; h %d)  %s\n",
           C, worst, units, rms_depth(C), g_fail == fails0 ? "OK" : "FAILED");
}

/* The whole op with dw (N = 2048, C = 576): dx and rstd are the rows kernel's bits (the call
 * with dw skipped), dw is kiln_cuda_col_sum_fast on (dy, x, that rstd) but for rare last bits
 * (the one-pass kernel's order); through the backend table the fast backend gives those, the
 * auditable one the exact kernel's bits. */
static void test_rmsnorm(kiln_backend *fast_be, kiln_backend *aud_be) {
    const int fails0 = g_fail;
    const int N = 2048, C = 576;
    const float eps = 1e-6f;
    std::vector<float> dy((size_t)N * C), x((size_t)N * C), w((size_t)C), dw0((size_t)C),
        dx0((size_t)N * C);
    for (float &f : dy) f = rndu();
    for (float &f : x) f = 3.0f * rndu();
    for (float &f : w) f = 1.0f + 0.25f * rndu();
    for (float &f : dw0) f = rndu();
    for (float &f : dx0) f = rndu();
    float *d_dy = dev_upload(dy), *d_x = dev_upload(x), *d_w = dev_upload(w);
    float *d_rstd = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&d_rstd, (size_t)N * 4));

    /* the exact op: dx and dw (the CPU's bits) */
    float *d_dx = dev_upload(dx0), *d_dw = dev_upload(dw0);
    CUDA_FATAL(kiln_cuda_rmsnorm_backward(g_s, d_dx, d_dw, d_dy, d_x, d_w, N, C, eps, d_rstd,
                                          true));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    const std::vector<float> ex_dx = dev_download(d_dx, dx0.size()),
                             ex_dw = dev_download(d_dw, dw0.size());
    /* the fast rows alone: dx and rstd; the expected fast dw from that rstd */
    CUDA_FATAL(cudaMemcpy(d_dx, dx0.data(), dx0.size() * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(kiln_cuda_rmsnorm_backward_fast(g_s, d_dx, nullptr, nullptr, d_dy, d_x, d_w, N, C,
                                               eps, d_rstd, true, nullptr, 0));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    const std::vector<float> fa_dx = dev_download(d_dx, dx0.size()),
                             fa_rstd = dev_download(d_rstd, (size_t)N);
    const std::vector<float> want_dw = fast_sum_of(d_dy, d_x, d_rstd, C, N, C, dw0);
    cudaFree(d_dx);
    cudaFree(d_dw);

    /* the launcher with dw */
    {
        float *d_dx2 = dev_upload(dx0), *d_dw2 = dev_upload(dw0);
        CUDA_FATAL(cudaMemset(d_rstd, 0xff, (size_t)N * 4));
        const size_t len = kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C);
        double *d_ws = nullptr;
        CUDA_FATAL(cudaMalloc((void **)&d_ws, len * sizeof(double)));
        if (kiln_cuda_rmsnorm_backward_fast(g_s, d_dx2, nullptr, d_dw2, d_dy, d_x, d_w, N, C, eps,
                                            d_rstd, true, d_ws, len - 1) != cudaErrorInvalidValue)
            FAIL("rmsnorm_backward_fast: a scratch one double short is not refused");
        const cudaError_t e = kiln_cuda_rmsnorm_backward_fast(g_s, d_dx2, nullptr, d_dw2, d_dy,
                                                              d_x, d_w, N, C, eps, d_rstd, true,
                                                              d_ws, len);
        if (e != cudaSuccess) FAIL("rmsnorm_backward_fast: %s", cudaGetErrorString(e));
        CUDA_FATAL(cudaStreamSynchronize(g_s));
        if (!same_bits(dev_download(d_dx2, dx0.size()), fa_dx))
            FAIL("rmsnorm_backward_fast: dx with dw is not the rows kernel's bits");
        if (!same_bits(dev_download(d_rstd, (size_t)N), fa_rstd))
            FAIL("rmsnorm_backward_fast: rstd with dw is not the rows kernel's bits");
        if (dw_differences(dev_download(d_dw2, dw0.size()), want_dw) < 0)
            FAIL("rmsnorm_backward_fast: dw is not kiln_cuda_col_sum_fast's sums (to the last "
                 "bit)");
        cudaFree(d_dx2);
        cudaFree(d_dw2);
        cudaFree(d_ws);
    }

    /* the backend table: fast -> the fast rows and the fast dw; auditable -> the exact bits */
    kiln_backend *bes[2] = {fast_be, aud_be};
    for (int k = 0; k < 2; k++) {
        float *d_dx2 = dev_upload(dx0), *d_dw2 = dev_upload(dw0);
        bes[k]->i->rmsnorm_backward(bes[k], d_dx2, d_dw2, d_dy, d_x, d_w, N, C, eps, d_rstd, true);
        OK_OR_FAIL(kiln_backend_status(bes[k]));
        CUDA_FATAL(cudaDeviceSynchronize());
        const char *name = k == 0 ? "fast" : "auditable";
        if (!same_bits(dev_download(d_dx2, dx0.size()), k == 0 ? fa_dx : ex_dx))
            FAIL("backend rmsnorm_backward (%s): dx is not the %s bits", name,
                 k == 0 ? "fast rows kernel's" : "exact kernel's");
        const std::vector<float> got_dw = dev_download(d_dw2, dw0.size());
        if (k == 0 ? dw_differences(got_dw, want_dw) < 0 : !same_bits(got_dw, ex_dw))
            FAIL("backend rmsnorm_backward (%s): dw is not the %s", name,
                 k == 0 ? "fast sum's (to the last bit)" : "exact kernel's bits");
        cudaFree(d_dx2);
        cudaFree(d_dw2);
    }
    printf("rmsnorm_backward (N=%d C=%d): launcher with dw and backends  %s\n", N, C,
           g_fail == fails0 ? "OK" : "FAILED");
    cudaFree(d_dy);
    cudaFree(d_x);
    cudaFree(d_w);
    cudaFree(d_rstd);
}

/* ---- dw in one pass: the fused rows + column sums against the two kernels --------------------- */

/* One launcher call with dw (fused), or the two kernels it stands for (the launcher without
 * dw, then kiln_cuda_col_sum_fast on dy, x and that rstd); outputs downloaded. shift 1: every
 * input and output one float past 16-byte alignment (the scalar loads). */
struct DwOut {
    std::vector<float> dx, rstd, dw;
    std::vector<uint16_t> dx16;
};
static bool dw_run(int N, int C, bool acc, bool with16, int shift, bool fused,
                   const std::vector<float> &dy, const std::vector<float> &x,
                   const std::vector<float> &w, const std::vector<float> &dx0,
                   const std::vector<float> &dw0, DwOut &o) {
    const size_t n = (size_t)N * C;
    float *bdy = nullptr, *bx = nullptr, *bw = nullptr, *bdx = nullptr, *bdw = nullptr, *brs = nullptr;
    uint16_t *b16 = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&bdy, (n + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&bx, (n + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&bw, ((size_t)C + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&bdx, (n + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&bdw, ((size_t)C + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&brs, ((size_t)N + 4) * 4));
    CUDA_FATAL(cudaMalloc((void **)&b16, (n + 8) * 2));
    float *d_dy = bdy + shift, *d_x = bx + shift, *d_w = bw + shift, *d_dx = bdx + shift;
    float *d_dw = bdw + shift, *d_rs = brs + shift;
    uint16_t *d16 = with16 ? b16 + 4 * shift : nullptr; /* 8 bytes past: the scalar stores */
    CUDA_FATAL(cudaMemcpy(d_dy, dy.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(cudaMemcpy(d_x, x.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(cudaMemcpy(d_w, w.data(), (size_t)C * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(cudaMemcpy(d_dx, dx0.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(cudaMemcpy(d_dw, dw0.data(), (size_t)C * 4, cudaMemcpyHostToDevice));
    CUDA_FATAL(cudaMemset(brs, 0xff, ((size_t)N + 4) * 4));
    CUDA_FATAL(cudaMemset(b16, 0xff, (n + 8) * 2));
    const size_t len = kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C);
    double *ws = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&ws, len * sizeof(double)));
    CUDA_FATAL(cudaMemset(ws, 0xff, len * sizeof(double)));
    cudaError_t e = kiln_cuda_rmsnorm_backward_fast(g_s, d_dx, d16, fused ? d_dw : nullptr, d_dy,
                                                    d_x, d_w, N, C, kRmsEps, d_rs, acc, ws, len);
    if (e == cudaSuccess && !fused)
        e = kiln_cuda_col_sum_fast(g_s, d_dw, d_dy, d_x, d_rs, C, N, C, ws, len);
    bool ok = e == cudaSuccess;
    if (!ok) FAIL("rmsnorm dw N=%d C=%d (%s): %s", N, C, fused ? "fused" : "two kernels",
                  cudaGetErrorString(e));
    CUDA_FATAL(cudaStreamSynchronize(g_s));
    if (ok) {
        o.dx = dev_download(d_dx, n);
        o.rstd = dev_download(d_rs, (size_t)N);
        o.dw = dev_download(d_dw, (size_t)C);
        o.dx16 = with16 ? dev_download(d16, n) : std::vector<uint16_t>();
    }
    for (void *p : {(void *)bdy, (void *)bx, (void *)bw, (void *)bdx, (void *)bdw, (void *)brs,
                    (void *)b16, (void *)ws})
        cudaFree(p);
    return ok;
}

/* The fused pass (rmsnorm_bwd_dw_fast_kernel + the combine) against the two kernels, for C in
 * {65 (one slot a lane, scalar), 576, 896, 1000, 1024, 899 (scalar)} x N in {7, 300, 2048,
 * 8193, 40000 (chunks of more than 16 rows)} x {accumulate or not} x {dx16 or not} x
 * {aligned, one float past}: dx, its bf16 copy and rstd the same bits; dw the same sums but
 * for rare last bits (another order of the same exact double products; counted); the fused
 * pass twice the same bits. The calls it does not take (C <= 64, C > 1024) are unchanged. */
/* Random inputs of an N x C case: dy, x (3x wider), w near 1, the old dx and dw. */
struct DwIn {
    std::vector<float> dy, x, w, dx0, dw0;
    DwIn(int N, int C) {
        const size_t n = (size_t)N * C;
        dy.resize(n), x.resize(n), w.resize((size_t)C), dx0.resize(n), dw0.resize((size_t)C);
        for (float &f : dy) f = rndu();
        for (float &f : x) f = 3.0f * rndu();
        for (float &f : w) f = 1.0f + 0.25f * rndu();
        for (float &f : dx0) f = rndu();
        for (float &f : dw0) f = rndu();
    }
};
static bool dw_run(int N, int C, bool acc, bool with16, int shift, bool fused, const DwIn &in,
                   DwOut &o) {
    return dw_run(N, C, acc, with16, shift, fused, in.dy, in.x, in.w, in.dx0, in.dw0, o);
}

static void test_rms_dw_fused() {
    const int fails0 = g_fail;
    int cases = 0;
    long dw_diff = 0, dw_total = 0;
    for (int C : {65, 576, 896, 1000, 1024, 899})
        for (int N : {7, 300, 2048, 8193, 40000}) {
            if (N == 40000 && C != 896) continue;
            const DwIn in(N, C);
            for (int v = 0; v < 4; v++) {
                const bool acc = v & 1, with16 = (v & 2) != 0;
                const int shift = (N + v) % 3 == 0 ? 1 : 0;
                DwOut a, a2, b;
                if (!dw_run(N, C, acc, with16, shift, true, in, a) ||
                    !dw_run(N, C, acc, with16, shift, true, in, a2) ||
                    !dw_run(N, C, acc, with16, shift, false, in, b))
                    continue;
                cases++;
                const char *what = nullptr;
                const long d = dw_differences(a.dw, b.dw);
                if (!same_bits(a.dx, b.dx)) what = "dx is not the two kernels' bits";
                else if (!same_bits(a.rstd, b.rstd)) what = "rstd is not the two kernels' bits";
                else if (a.dx16 != b.dx16) what = "dx16 is not the two kernels' bits";
                else if (d < 0) what = "dw differs from the two kernels' by more than an ulp";
                else if (!same_bits(a.dx, a2.dx) || !same_bits(a.dw, a2.dw) ||
                         !same_bits(a.rstd, a2.rstd) || a.dx16 != a2.dx16)
                    what = "two runs differ";
                if (what)
                    FAIL("rmsnorm dw fused N=%d C=%d acc %d dx16 %d shift %d: %s", N, C, (int)acc,
                         (int)with16, shift, what);
                if (d > 0) dw_diff += d;
                dw_total += C;
            }
        }
    printf("rmsnorm backward with dw in one pass: %d cases; dx, dx16, rstd the two kernels' "
           "bits, twice the same bits; dw %ld of %ld values one ulp off the two kernels' %s\n",
           cases, dw_diff, dw_total, g_fail == fails0 ? "OK" : "FAILED");
}

/* The two variants' times in ms[0], ms[1] (cudaEvent around reps launches on g_s, after one
 * warm-up launch): setup(which) once before each variant's launches, run(which) per launch. */
template <class Setup, class Run>
static void time_two(int reps, float ms[2], Setup setup, Run run) {
    cudaEvent_t t0, t1;
    CUDA_FATAL(cudaEventCreate(&t0));
    CUDA_FATAL(cudaEventCreate(&t1));
    for (int which = 0; which < 2; which++) {
        setup(which);
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
            if (r == 0) CUDA_FATAL(cudaEventRecord(t0, g_s));
            run(which);
        }
        CUDA_FATAL(cudaEventRecord(t1, g_s));
        CUDA_FATAL(cudaEventSynchronize(t1));
        CUDA_FATAL(cudaEventElapsedTime(&ms[which], t0, t1));
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
}

/* q, k, v's bias sums at the 0.5B shape (N 8192; 896, 128, 128 columns): three single calls
 * against one multi call (cudaEvent, mean of 50). */
static void time_bias_multi() {
    const int N = 8192, n = 3;
    const int64_t W[3] = {896, 128, 128};
    float *out[3], *av[3];
    const float *a[3];
    for (int i = 0; i < n; i++) {
        std::vector<float> h((size_t)N * W[i]), o((size_t)W[i], 0.0f);
        for (float &f : h) f = rndu();
        av[i] = dev_upload(h);
        a[i] = av[i];
        out[i] = dev_upload(o);
    }
    const size_t len = kiln_cuda_col_sum_fast_multi_scratch_len(n, W, N);
    double *ws = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&ws, len * sizeof(double) + 8));
    const int reps = 50;
    float ms[2];
    time_two(
        reps, ms, [](int) {},
        [&](int which) {
            if (which == 0)
                for (int i = 0; i < n; i++)
                    CUDA_FATAL(kiln_cuda_col_sum_fast(g_s, out[i], a[i], nullptr, nullptr, W[i],
                                                      N, W[i], ws, len));
            else
                CUDA_FATAL(kiln_cuda_col_sum_fast_multi(g_s, n, out, a, W, W, N, ws, len));
        });
    printf("time bias sums N=%d (896, 128, 128): three calls %.1f us, one multi call %.1f us\n", N,
           1e3 * ms[0] / reps, 1e3 * ms[1] / reps);
    for (int i = 0; i < n; i++) {
        cudaFree(av[i]);
        cudaFree(out[i]);
    }
    cudaFree(ws);
}

/* Zeroed device buffers of an N x C RMSNorm backward with dw (for the timings): run() makes
 * one launcher call (accumulating dx, with dx16), run_two() the two kernels it stands for. */
struct RmsDwBufs {
    int N, C;
    float *x = nullptr, *dy = nullptr, *dx = nullptr, *w = nullptr, *rs = nullptr, *dw = nullptr;
    uint16_t *d16 = nullptr;
    double *ws = nullptr;
    size_t len = 0;
    RmsDwBufs(int n_rows, int cols) : N(n_rows), C(cols) {
        const size_t n = (size_t)N * (size_t)C;
        CUDA_FATAL(cudaMalloc((void **)&x, n * 4));
        CUDA_FATAL(cudaMalloc((void **)&dy, n * 4));
        CUDA_FATAL(cudaMalloc((void **)&dx, n * 4));
        CUDA_FATAL(cudaMalloc((void **)&d16, n * 2));
        CUDA_FATAL(cudaMalloc((void **)&w, (size_t)C * 4));
        CUDA_FATAL(cudaMalloc((void **)&dw, (size_t)C * 4));
        CUDA_FATAL(cudaMalloc((void **)&rs, (size_t)N * 4));
        for (float *p : {x, dy, dx}) CUDA_FATAL(cudaMemset(p, 0, n * 4));
        CUDA_FATAL(cudaMemset(w, 0, (size_t)C * 4));
        CUDA_FATAL(cudaMemset(dw, 0, (size_t)C * 4));
        len = kiln_cuda_rmsnorm_backward_fast_scratch_len(N, C);
        CUDA_FATAL(cudaMalloc((void **)&ws, len * sizeof(double)));
    }
    ~RmsDwBufs() {
        for (void *p : {(void *)x, (void *)dy, (void *)dx, (void *)d16, (void *)w, (void *)dw,
                        (void *)rs, (void *)ws})
            cudaFree(p);
    }
    void run() const {
        CUDA_FATAL(kiln_cuda_rmsnorm_backward_fast(g_s, dx, d16, dw, dy, x, w, N, C, 1e-6f, rs,
                                                   true, ws, len));
    }
    void run_two() const {
        CUDA_FATAL(kiln_cuda_rmsnorm_backward_fast(g_s, dx, d16, nullptr, dy, x, w, N, C, 1e-6f,
                                                   rs, true, ws, len));
        CUDA_FATAL(kiln_cuda_col_sum_fast(g_s, dw, dy, x, rs, C, N, C, ws, len));
    }
};

/* The launcher with dw at N x C against the two kernels it stands for (cudaEvent, mean of
 * 20). */
static void time_rms_dw(int N, int C) {
    const RmsDwBufs b(N, C);
    const int reps = 20;
    float ms[2] = {0, 0};
    time_two(reps, ms, [](int) {}, [&](int which) {
        if (which == 0) b.run_two();
        else b.run();
    });
    printf("timing rmsnorm backward with dw N=%d C=%d acc + dx16: two kernels %.1f us, one pass "
           "%.1f us, x%.2f\n", N, C, 1e3 * ms[0] / reps, 1e3 * ms[1] / reps, ms[0] / ms[1]);
}

/* ---- argument errors (before anything is enqueued: no GPU needed) -------------------------- */

static void host_checks() {
    float *p = (float *)(uintptr_t)0x1000; /* never dereferenced: every call is refused */
    double *ws = (double *)(uintptr_t)0x2000;
    const size_t big = (size_t)1 << 40;
    struct {
        const char *what;
        cudaError_t got;
    } c[] = {
        {"ld < W", kiln_cuda_col_sum_fast(0, p, p, nullptr, nullptr, 7, 4, 8, ws, big)},
        {"a NULL", kiln_cuda_col_sum_fast(0, p, nullptr, nullptr, nullptr, 8, 4, 8, ws, big)},
        {"out NULL", kiln_cuda_col_sum_fast(0, nullptr, p, nullptr, nullptr, 8, 4, 8, ws, big)},
        {"scratch NULL", kiln_cuda_col_sum_fast(0, p, p, nullptr, nullptr, 8, 4, 8, nullptr, big)},
        {"sc without b", kiln_cuda_col_sum_fast(0, p, p, nullptr, p, 8, 4, 8, ws, big)},
        {"scratch short",
         kiln_cuda_col_sum_fast(0, p, p, nullptr, nullptr, 8, 4, 8, ws,
                                kiln_cuda_col_sum_fast_scratch_len(4, 8) - 1)},
        {"exact: ld < W", kiln_cuda_col_sum_exact(0, p, p, nullptr, nullptr, 7, 4, 8)},
        {"rmsnorm: dx NULL", kiln_cuda_rmsnorm_backward_fast(0, nullptr, nullptr, nullptr, p, p, p,
                                                             4, 8, 1e-6f, p, false, nullptr, 0)},
        {"rmsnorm: rstd NULL", kiln_cuda_rmsnorm_backward_fast(0, p, nullptr, nullptr, p, p, p, 4,
                                                               8, 1e-6f, nullptr, false, nullptr,
                                                               0)},
        {"rmsnorm: dw without scratch",
         kiln_cuda_rmsnorm_backward_fast(0, p, nullptr, p, p, p, p, 4, 8, 1e-6f, p, false, nullptr,
                                         0)},
    };
    for (const auto &k : c)
        if (k.got != cudaErrorInvalidValue)
            FAIL("argument check '%s': got %s, want cudaErrorInvalidValue", k.what,
                 cudaGetErrorName(k.got));
    if (kiln_cuda_col_sum_fast(0, p, p, nullptr, nullptr, 8, 0, 8, nullptr, 0) != cudaSuccess ||
        kiln_cuda_col_sum_fast(0, p, p, nullptr, nullptr, 8, 4, 0, nullptr, 0) != cudaSuccess)
        FAIL("N = 0 or W = 0 is not a no-op");
    if (kiln_cuda_col_sum_fast_scratch_len(0, 8) != 0 ||
        kiln_cuda_col_sum_fast_scratch_len(8, 0) != 0)
        FAIL("scratch length for an empty problem is not 0");
    const int Ns[] = {1, 7, 64, 65, 300, 2048, 8193, 114688, 1 << 24};
    const int64_t Ws[] = {1, 33, 64, 576, 896, 4864, 151936};
    for (int N : Ns)
        for (int64_t W : Ws) {
            const size_t len = kiln_cuda_col_sum_fast_scratch_len(N, W);
            const size_t K = len / (size_t)W;
            if (len % (size_t)W != 0 || K < 1 || K > 256 || (N <= 64 && K != 1))
                FAIL("scratch length %zu for N=%d W=%lld is not K * W with 1 <= K <= 256", len,
                     N, (long long)W);
        }
}

/* ---- timing -------------------------------------------------------------------------------- */

static void time_shape(int N, int64_t W, int mode) {
    const size_t n = (size_t)N * (size_t)W;
    float *a = nullptr, *b = nullptr, *s = nullptr, *out = nullptr;
    double *ws = nullptr;
    const size_t len = kiln_cuda_col_sum_fast_scratch_len(N, W);
    CUDA_FATAL(cudaMalloc((void **)&a, n * 4));
    CUDA_FATAL(cudaMemset(a, 0, n * 4));
    if (mode >= 1) {
        CUDA_FATAL(cudaMalloc((void **)&b, n * 4));
        CUDA_FATAL(cudaMemset(b, 0, n * 4));
    }
    if (mode == 2) {
        CUDA_FATAL(cudaMalloc((void **)&s, (size_t)N * 4));
        CUDA_FATAL(cudaMemset(s, 0, (size_t)N * 4));
    }
    CUDA_FATAL(cudaMalloc((void **)&out, (size_t)W * 4));
    CUDA_FATAL(cudaMemset(out, 0, (size_t)W * 4));
    CUDA_FATAL(cudaMalloc((void **)&ws, len * sizeof(double)));
    const int reps = 20;
    float ms[2] = {0, 0};
    time_two(reps, ms, [](int) {}, [&](int which) {
        if (which == 0) CUDA_FATAL(kiln_cuda_col_sum_exact(g_s, out, a, b, s, W, N, W));
        else CUDA_FATAL(kiln_cuda_col_sum_fast(g_s, out, a, b, s, W, N, W, ws, len));
    });
    const double us_ex = 1e3 * ms[0] / reps, us_fa = 1e3 * ms[1] / reps;
    const double bytes = (double)n * 4.0 * (mode >= 1 ? 2.0 : 1.0);
    printf("timing N=%d W=%lld mode %d: exact col_lanes %.1f us (%.0f GB/s), fast %.1f us "
           "(%.0f GB/s, K=%zu chunks), x%.1f\n",
           N, (long long)W, mode, us_ex, bytes / (us_ex * 1e3), us_fa, bytes / (us_fa * 1e3),
           len / (size_t)W, us_ex / us_fa);
    cudaFree(a);
    cudaFree(b);
    cudaFree(s);
    cudaFree(out);
    cudaFree(ws);
}

/* The rows of rmsnorm backward (dw skipped): the exact kernel (kiln_cuda_rmsnorm_backward)
 * against the fast one; bytes = x, dy read, dx written (and read: accumulate), rstd, w. */
static void time_rms_rows(int N, int C, bool acc) {
    const size_t n = (size_t)N * (size_t)C;
    float *x = nullptr, *dy = nullptr, *dx = nullptr, *w = nullptr, *rs = nullptr;
    CUDA_FATAL(cudaMalloc((void **)&x, n * 4));
    CUDA_FATAL(cudaMalloc((void **)&dy, n * 4));
    CUDA_FATAL(cudaMalloc((void **)&dx, n * 4));
    CUDA_FATAL(cudaMalloc((void **)&w, (size_t)C * 4));
    CUDA_FATAL(cudaMalloc((void **)&rs, (size_t)N * 4));
    CUDA_FATAL(cudaMemset(x, 0, n * 4));
    CUDA_FATAL(cudaMemset(dy, 0, n * 4));
    CUDA_FATAL(cudaMemset(dx, 0, n * 4));
    CUDA_FATAL(cudaMemset(w, 0, (size_t)C * 4));
    const int reps = 20;
    float ms[2] = {0, 0};
    time_two(reps, ms, [](int) {}, [&](int which) {
        if (which == 0)
            CUDA_FATAL(kiln_cuda_rmsnorm_backward(g_s, dx, nullptr, dy, x, w, N, C, 1e-6f, rs,
                                                  acc));
        else
            CUDA_FATAL(kiln_cuda_rmsnorm_backward_fast(g_s, dx, nullptr, nullptr, dy, x, w, N, C,
                                                       1e-6f, rs, acc, nullptr, 0));
    });
    const double us_ex = 1e3 * ms[0] / reps, us_fa = 1e3 * ms[1] / reps;
    const double bytes = (double)n * 4.0 * (acc ? 4.0 : 3.0) + 4.0 * ((double)N + C);
    printf("timing rmsnorm rows N=%d C=%d%s: exact %.1f us (%.0f GB/s), fast %.1f us "
           "(%.0f GB/s), x%.1f\n",
           N, C, acc ? " acc" : "", us_ex, bytes / (us_ex * 1e3), us_fa, bytes / (us_fa * 1e3),
           us_ex / us_fa);
    cudaFree(x);
    cudaFree(dy);
    cudaFree(dx);
    cudaFree(w);
    cudaFree(rs);
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    bool big = true;
    for (int k = 1; k < argc; k++) {
        if (!strcmp(argv[k], "--no-big")) big = false;
        else if (!strcmp(argv[k], "--seed") && k + 1 < argc) g_rng = strtoull(argv[++k], 0, 10);
    }
    host_checks();
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no GPU: skipped (%s)\n", g_fail ? "FAILED" : "host checks OK");
        return g_fail ? 1 : 77;
    }
    kiln_backend *fast_be = nullptr, *aud_be = nullptr;
    if (kiln_backend_cuda_create_mode(0, 1, &fast_be) != KILN_OK ||
        kiln_backend_cuda_create_mode(0, 0, &aud_be) != KILN_OK) {
        printf("no usable GPU (%s): skipped\n", kiln_last_error());
        return 77;
    }
    CUDA_FATAL(cudaSetDevice(0));
    CUDA_FATAL(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
    kiln_cuda_gemm *gemm = nullptr;
    CUDA_FATAL(kiln_cuda_gemm_create(0, &gemm));

    const int Ns[] = {1, 7, 300, 2048, 8193};
    const int64_t Ws[] = {1, 33, 576, 896, 4864};
    for (int N : Ns)
        for (int64_t W : Ws)
            for (int mode = 0; mode < 3; mode++) {
                const int64_t ld = (W == 33 || W == 896) && N % 2 == 1 ? W + 5 : W;
                test_case(N, W, ld, mode, false);
            }
    for (int N : {7, 8193})
        for (int64_t W : {(int64_t)33, (int64_t)896})
            for (int mode = 0; mode < 3; mode++) test_case(N, W, W + (N == 7 ? 5 : 0), mode, true);
    printf("random cases: max err / (|old| + sum |terms|) = %.2e (stated bound 1e-5)\n", g_worst);
    if (g_worst > 1e-5) FAIL("the normalised error %.2e exceeds 1e-5", g_worst);

    test_matmul_dbias(gemm, fast_be, aud_be);
    test_col_sum_multi(gemm);
    for (int C : {1, 3, 4, 32, 33, 63, 64, 128, 129, 576, 577, 896, 1024, 1025, 2048, 5000, 8192,
                  8196, 12289})
        test_rms_rows(C);
    printf("rmsnorm rows: max err/bound %.3f (must be <= 1), max dx err %.1f u*scale (stated "
           "(5h/2 + 15))\n",
           g_rms_worst, g_rms_units);
    test_rmsnorm(fast_be, aud_be);
    test_rms_dw_fused();
    if (big) {
        time_rms_dw(8192, 896);
        time_bias_multi();
        time_rms_dw(16384, 576);
        time_shape(8192, 576, 2);
        time_shape(8192, 896, 0);
        time_shape(8192, 4864, 0);
        time_shape(114688, 64, 2);
        time_rms_rows(8192, 576, true);
        time_rms_rows(8192, 896, true);
        time_rms_rows(8192 * 9, 64, false);
    }

    kiln_cuda_gemm_free(gemm);
    cudaStreamDestroy(g_s);
    kiln_backend_free(aud_be);
    kiln_backend_free(fast_be);
    if (g_fail) {
        printf("FAILED %d\n", g_fail);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
