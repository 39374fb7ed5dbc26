/*
 * test_linear_ce.c -- the public fused linear cross-entropy (include/kiln.h, kiln_linear_ce_*)
 * on the CPU: its outputs are kiln_fused_ce's (src/train/fused_ce.h) bit for bit for the same
 * parameters (whose own tests are test_fused_ce.c and tests/python/test_fused_ce.py), the
 * defaults, the loss alone, a strided and a bf16 hidden (the bits of the same values back to
 * back in f32), and the errors: bad handles and parameters, fast mode on the CPU,
 * a target out of range with the outputs left untouched. A CUDA device is either refused with
 * KILN_ERR_UNSUPPORTED (no GPU, or a build without CUDA) or usable; both are accepted here (the
 * GPU cases are tests/python/test_linear_ce_api.py's).
 */
#include "ops/ops.h"
#include "base/tensor.h"
#include "ops/fused_ce.h"
#include "test_util.h"

#include <math.h>

static uint32_t g_rng = 12345u;
static float rnd_f(float lo, float hi) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(g_rng >> 8) / 16777216.0f;
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

enum { N = 37, H = 24, V = 101 };

static void test_same_as_internal(kiln_linear_ce *ce) {
    static float h[N * H], w[V * H], dh[N * H], dw[V * H], rl[N];
    static float dh2[N * H], dw2[V * H], rl2[N];
    int32_t tg[N];
    uint8_t mask[N];
    for (int i = 0; i < N * H; i++) h[i] = rnd_f(-1, 1);
    for (int i = 0; i < V * H; i++) w[i] = rnd_f(-2, 2);
    for (int n = 0; n < N; n++) {
        tg[n] = n % 5 == 1 ? -100 : (int32_t)((n * 37) % V);
        mask[n] = n % 7 != 3;
    }
    for (int i = 0; i < V * H; i++) dw[i] = dw2[i] = 0.5f; /* added to */

    kiln_linear_ce_params p = kiln_linear_ce_default_params();
    p.N = N, p.H = H, p.V = V;
    p.hidden = h, p.weight = w, p.targets = tg, p.mask = mask;
    p.reduction = KILN_LOSS_SUM, p.scale = 0.25f, p.chunk = 13;
    p.dhidden = dh, p.dweight = dw, p.row_loss = rl;
    kiln_linear_ce_result r;
    CHECK(kiln_linear_ce_compute(ce, &p, &r) == KILN_OK);

    kiln_backend *be = NULL;
    CHECK(kiln_backend_cpu_create(0, &be) == KILN_OK);
    kiln_fused_ce_params q = kiln_fused_ce_default_params();
    q.N = N, q.H = H, q.V = V;
    q.hidden = h, q.weight = w, q.weight_dtype = KILN_DTYPE_F32, q.targets = tg, q.mask = mask;
    q.reduction = KILN_CE_REDUCTION_SUM, q.scale = 0.25f, q.chunk = 13;
    q.dhidden = dh2, q.dweight = dw2, q.row_loss = rl2;
    kiln_fused_ce_result r2;
    CHECK(kiln_fused_ce(be, &q, &r2) == KILN_OK);
    kiln_backend_free(be);
    CHECK(bits_of(r.loss) == bits_of(r2.loss));
    CHECK(r.loss_f64 == r2.loss_f64 && r.n_supervised == r2.n_supervised);
    CHECK(r.scratch_bytes == r2.scratch_bytes);
    CHECK(!memcmp(dh, dh2, sizeof dh) && !memcmp(dw, dw2, sizeof dw) && !memcmp(rl, rl2, sizeof rl));
    CHECK(isfinite(r.loss) && r.n_supervised > 0);
    const float loss0 = r.loss;

    /* the loss alone: the same loss, nothing else asked for */
    kiln_linear_ce_params l = p;
    l.dhidden = NULL, l.dweight = NULL, l.row_loss = NULL;
    kiln_linear_ce_result r3;
    CHECK(kiln_linear_ce_compute(ce, &l, &r3) == KILN_OK);
    CHECK(bits_of(r3.loss) == bits_of(r.loss));
    CHECK(kiln_linear_ce_compute(ce, &l, NULL) == KILN_OK); /* out may be NULL */

    /* a target out of range: KILN_ERR_RANGE naming it, the outputs untouched */
    memcpy(dh2, dh, sizeof dh);
    memcpy(dw2, dw, sizeof dw);
    const int32_t t4 = tg[4];
    tg[4] = V;
    mask[4] = 1;
    CHECK_ERR(kiln_linear_ce_compute(ce, &p, &r), KILN_ERR_RANGE, "position 4");
    CHECK(!memcmp(dh, dh2, sizeof dh) && !memcmp(dw, dw2, sizeof dw));
    CHECK(r.loss == 0.0f && r.n_supervised == 0); /* out cleared on error */
    tg[4] = t4;

    /* row_block is ignored on the CPU: the vocabulary walk's bits */
    kiln_linear_ce_params rb = l;
    rb.row_block = 64;
    rb.weight_bf16 = 0;
    CHECK(kiln_linear_ce_compute(ce, &rb, &r3) == KILN_OK);
    CHECK(bits_of(r3.loss) == bits_of(loss0));

    /* bad parameters */
    kiln_linear_ce_params bad = l;
    bad.reduction = (kiln_loss_reduction)7;
    CHECK_ERR(kiln_linear_ce_compute(ce, &bad, &r), KILN_ERR_INVALID_ARG, "reduction");
    bad = l;
    bad.row_block = -1;
    CHECK_ERR(kiln_linear_ce_compute(ce, &bad, &r), KILN_ERR_INVALID_ARG, "row_block");
    bad = l;
    bad.hidden = NULL;
    CHECK(kiln_linear_ce_compute(ce, &bad, &r) == KILN_ERR_INVALID_ARG);
    bad = l;
    for (int n = 0; n < N; n++) mask[n] = 0;
    CHECK_ERR(kiln_linear_ce_compute(ce, &bad, &r), KILN_ERR_INVALID_ARG, "no supervised");
    CHECK_ERR(kiln_linear_ce_compute(NULL, &l, &r), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_linear_ce_compute(ce, NULL, &r), KILN_ERR_INVALID_ARG, "NULL");
}

/* hidden_stride reads rows of a wider buffer in place, and hidden_bf16 widens bf16 rows: the
 * bits of the same values given back to back in f32. A stride below H is refused naming it. */
static void test_stride_and_bf16(kiln_linear_ce *ce) {
    enum { LD = H + 9, OFF = 4 };
    static float wide[N * LD], dense[N * H], widened[N * H], w[V * H];
    static float dh1[N * H], dh2[N * H], dw1[V * H], dw2[V * H];
    static uint16_t wide16[N * LD];
    int32_t tg[N];
    for (int i = 0; i < N * LD; i++) wide[i] = rnd_f(-1, 1);
    for (int i = 0; i < V * H; i++) w[i] = rnd_f(-2, 2);
    for (int n = 0; n < N; n++) tg[n] = n % 4 == 2 ? -1 : (int32_t)((n * 11) % V);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < H; j++) {
            dense[n * H + j] = wide[n * LD + OFF + j];
            wide16[n * LD + OFF + j] = kiln_fp32_to_bf16(wide[n * LD + OFF + j]);
            widened[n * H + j] = kiln_bf16_to_fp32(wide16[n * LD + OFF + j]);
        }
    for (int pass = 0; pass < 2; pass++) { /* f32, then bf16 */
        memset(dw1, 0, sizeof dw1);
        memset(dw2, 0, sizeof dw2);
        kiln_linear_ce_params p = kiln_linear_ce_default_params();
        p.N = N, p.H = H, p.V = V, p.weight = w, p.targets = tg, p.chunk = 17;
        p.dhidden = dh1, p.dweight = dw1;
        p.hidden_stride = LD;
        if (pass == 0) {
            p.hidden = wide + OFF;
        } else {
            p.hidden = wide16 + OFF;
            p.hidden_bf16 = 1;
        }
        kiln_linear_ce_result r1, r2;
        CHECK(kiln_linear_ce_compute(ce, &p, &r1) == KILN_OK);
        kiln_linear_ce_params q = p;
        q.hidden = pass == 0 ? dense : widened;
        q.hidden_stride = 0, q.hidden_bf16 = 0, q.dhidden = dh2, q.dweight = dw2;
        CHECK(kiln_linear_ce_compute(ce, &q, &r2) == KILN_OK);
        CHECK(bits_of(r1.loss) == bits_of(r2.loss));
        CHECK(!memcmp(dh1, dh2, sizeof dh1) && !memcmp(dw1, dw2, sizeof dw1));
        p.hidden_stride = H - 1;
        CHECK_ERR(kiln_linear_ce_compute(ce, &p, &r1), KILN_ERR_INVALID_ARG, "hidden_stride");
    }
}

int main(void) {
    kiln_linear_ce_params d = kiln_linear_ce_default_params();
    CHECK(d.hidden_stride == 0 && d.hidden_bf16 == 0);
    CHECK(d.N == 0 && d.hidden == NULL && d.weight_bf16 == 0 && d.reduction == KILN_LOSS_MEAN);
    CHECK(d.scale == 1.0f && d.chunk == 0 && d.row_block == 0 && d.dhidden == NULL);

    kiln_linear_ce *ce = NULL;
    CHECK_ERR(kiln_linear_ce_create(-1, 1, &ce), KILN_ERR_UNSUPPORTED, "fast mode needs a CUDA device");
    CHECK(ce == NULL);
    CHECK_ERR(kiln_linear_ce_create(-2, 0, &ce), KILN_ERR_INVALID_ARG, "device -2");
    CHECK_ERR(kiln_linear_ce_create(-1, 0, NULL), KILN_ERR_INVALID_ARG, "out is NULL");
    kiln_status st = kiln_linear_ce_create(0, 0, &ce); /* CUDA device 0: refused or usable */
    CHECK(st == KILN_OK || st == KILN_ERR_UNSUPPORTED);
    CHECK((st == KILN_OK) == (ce != NULL));
    kiln_linear_ce_free(ce);
    kiln_linear_ce_free(NULL);

    CHECK(kiln_linear_ce_create(-1, 0, &ce) == KILN_OK && ce);
    if (ce) test_same_as_internal(ce);
    if (ce) test_stride_and_bf16(ce);
    kiln_linear_ce_free(ce);
    return test_finish("test_linear_ce");
}
