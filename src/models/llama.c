/*
 * llama.c -- the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3): its parameter
 * roles, and its one forward, which generation and training both run, with the backward
 * beside it.
 *
 *   x = embed(ids)
 *   for each layer:
 *       h = rmsnorm(x) ; q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv
 *       (Qwen3) q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)
 *       q, k = rope(q), rope(k)
 *       x = x + attention(q, K, V) Wo^T          (generation: k, v into the paged cache first)
 *       h = rmsnorm(x) ; x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
 *   logits = rmsnorm(x) Wlm^T                    (training: the fused loss takes rmsnorm(x))
 *
 * The forward (llama_layers) is told where each intermediate goes: one scratch set reused by
 * every layer (generation), or each layer's own saved activations (training, which the
 * backward reads). Generation makes each product on its own; training may make the products
 * of one input in one call and, in fast mode, keep activations in bf16 (ops.h): the same
 * arithmetic where the backend promises the same bits (auditable mode), so a trained model's
 * logits in kiln_generate are the bits training saw.
 */
#include "model.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* ---- parameter roles (arch.h), in transformers' named_parameters() order ---------------- */

enum llama_role {
    LL_EMBED, /* per model */
    LL_WQ, LL_BQ, LL_WK, LL_BK, LL_WV, LL_BV, LL_WO, LL_BO, LL_QNORM, LL_KNORM, /* per layer */
    LL_GATE, LL_BGATE, LL_UP, LL_BUP, LL_DOWN, LL_BDOWN, LL_ATTN_NORM, LL_MLP_NORM,
    LL_NORM, LL_HEAD, /* per model */
    LL_N
};
#define LL_N_LAYER (LL_MLP_NORM - LL_WQ + 1)

#define HF_L "model.layers.%d."
#define GG_L "blk.%d."
#define MAT(rows, cols, cond, heads) rows, cols, cond, KILN_INIT_NORMAL, true, true, heads
#define BIAS(rows, cond, heads) rows, KILN_DIM_ONE, cond, KILN_INIT_ZEROS, true, true, heads
#define NORM(rows, cond) rows, KILN_DIM_ONE, cond, KILN_INIT_ONES, true, true, KILN_DIM_ONE
static const kiln_param_role llama_roles[LL_N] = {
    /* hf name, gguf name, rows, cols, condition, init, per layer, trainable, gguf rope heads */
    [LL_EMBED] = {"model.embed_tokens.weight", "token_embd.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_ALWAYS,
                  KILN_INIT_NORMAL, false, true, KILN_DIM_ONE},
    [LL_WQ] = {HF_L "self_attn.q_proj.weight", GG_L "attn_q.weight", MAT(KILN_DIM_QD, KILN_DIM_C, KILN_COND_ALWAYS, KILN_DIM_NH)},
    [LL_BQ] = {HF_L "self_attn.q_proj.bias", GG_L "attn_q.bias", BIAS(KILN_DIM_QD, KILN_COND_ATTN_BIAS, KILN_DIM_NH)},
    [LL_WK] = {HF_L "self_attn.k_proj.weight", GG_L "attn_k.weight", MAT(KILN_DIM_KD, KILN_DIM_C, KILN_COND_ALWAYS, KILN_DIM_KVH)},
    [LL_BK] = {HF_L "self_attn.k_proj.bias", GG_L "attn_k.bias", BIAS(KILN_DIM_KD, KILN_COND_ATTN_BIAS, KILN_DIM_KVH)},
    [LL_WV] = {HF_L "self_attn.v_proj.weight", GG_L "attn_v.weight", MAT(KILN_DIM_KD, KILN_DIM_C, KILN_COND_ALWAYS, KILN_DIM_ONE)},
    [LL_BV] = {HF_L "self_attn.v_proj.bias", GG_L "attn_v.bias", BIAS(KILN_DIM_KD, KILN_COND_ATTN_BIAS, KILN_DIM_ONE)},
    [LL_WO] = {HF_L "self_attn.o_proj.weight", GG_L "attn_output.weight", MAT(KILN_DIM_C, KILN_DIM_QD, KILN_COND_ALWAYS, KILN_DIM_ONE)},
    [LL_BO] = {HF_L "self_attn.o_proj.bias", GG_L "attn_output.bias", BIAS(KILN_DIM_C, KILN_COND_OUT_BIAS, KILN_DIM_ONE)},
    [LL_QNORM] = {HF_L "self_attn.q_norm.weight", GG_L "attn_q_norm.weight", NORM(KILN_DIM_HS, KILN_COND_QK_NORM)},
    [LL_KNORM] = {HF_L "self_attn.k_norm.weight", GG_L "attn_k_norm.weight", NORM(KILN_DIM_HS, KILN_COND_QK_NORM)},
    [LL_GATE] = {HF_L "mlp.gate_proj.weight", GG_L "ffn_gate.weight", MAT(KILN_DIM_FF, KILN_DIM_C, KILN_COND_ALWAYS, KILN_DIM_ONE)},
    [LL_BGATE] = {HF_L "mlp.gate_proj.bias", GG_L "ffn_gate.bias", BIAS(KILN_DIM_FF, KILN_COND_MLP_BIAS, KILN_DIM_ONE)},
    [LL_UP] = {HF_L "mlp.up_proj.weight", GG_L "ffn_up.weight", MAT(KILN_DIM_FF, KILN_DIM_C, KILN_COND_ALWAYS, KILN_DIM_ONE)},
    [LL_BUP] = {HF_L "mlp.up_proj.bias", GG_L "ffn_up.bias", BIAS(KILN_DIM_FF, KILN_COND_MLP_BIAS, KILN_DIM_ONE)},
    [LL_DOWN] = {HF_L "mlp.down_proj.weight", GG_L "ffn_down.weight", MAT(KILN_DIM_C, KILN_DIM_FF, KILN_COND_ALWAYS, KILN_DIM_ONE)},
    [LL_BDOWN] = {HF_L "mlp.down_proj.bias", GG_L "ffn_down.bias", BIAS(KILN_DIM_C, KILN_COND_MLP_BIAS, KILN_DIM_ONE)},
    [LL_ATTN_NORM] = {HF_L "input_layernorm.weight", GG_L "attn_norm.weight", NORM(KILN_DIM_C, KILN_COND_ALWAYS)},
    [LL_MLP_NORM] = {HF_L "post_attention_layernorm.weight", GG_L "ffn_norm.weight", NORM(KILN_DIM_C, KILN_COND_ALWAYS)},
    [LL_NORM] = {"model.norm.weight", "output_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS,
                 KILN_INIT_ONES, false, true, KILN_DIM_ONE},
    [LL_HEAD] = {"lm_head.weight", "output.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_UNTIED, KILN_INIT_NORMAL, false,
                 true, KILN_DIM_ONE},
};
#undef HF_L
#undef GG_L
#undef MAT
#undef BIAS
#undef NORM

static kiln_status llama_train_init(kiln_train_io *io);
static void llama_train_forward(kiln_train_io *io, int n_seq, int seq);
static void llama_train_backward(kiln_train_io *io, int n_seq, int seq);
static void llama_train_free(kiln_train_io *io);

static void llama_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                          const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                          float *logits);

#define LLAMA_FAMILY(id_, name_, type_, cls_, permuted_, qkv_bias_, qk_norm_)                    \
    {.id = id_, .name = name_, .hf_model_type = type_, .hf_class = cls_, .gguf_qk_permuted = permuted_, \
     .always_qkv_bias = qkv_bias_, .always_qk_norm = qk_norm_, .roles = llama_roles, .n_roles = LL_N,   \
     .first_layer_role = LL_WQ, .n_layer_roles = LL_N_LAYER, .role_embed = LL_EMBED,                  \
     .role_final_norm = LL_NORM, .role_head = LL_HEAD, .forward = llama_forward,                      \
     .train_init = llama_train_init, .train_forward = llama_train_forward,                           \
     .train_backward = llama_train_backward, .train_free = llama_train_free}
/* GGUF "llama" and "mistral" files store q/k rows permuted for llama.cpp's interleaved RoPE
 * (convert_hf_to_gguf's permute); "qwen2" and "qwen3" keep Hugging Face's rotate-half rows. */
const kiln_arch_desc kiln_arch_llama =
    LLAMA_FAMILY(KILN_ARCH_LLAMA, "llama", "llama", "LlamaForCausalLM", true, false, false);
const kiln_arch_desc kiln_arch_mistral =
    LLAMA_FAMILY(KILN_ARCH_MISTRAL, "mistral", "mistral", "MistralForCausalLM", true, false, false);
const kiln_arch_desc kiln_arch_qwen2 =
    LLAMA_FAMILY(KILN_ARCH_QWEN2, "qwen2", "qwen2", "Qwen2ForCausalLM", false, true, false);
const kiln_arch_desc kiln_arch_qwen3 =
    LLAMA_FAMILY(KILN_ARCH_QWEN3, "qwen3", "qwen3", "Qwen3ForCausalLM", false, false, true);

/* ---- a layer's weights, activations and training state ----------------------------------- */

/* One layer's roles (NULL: absent). */
typedef struct llama_w {
    const kiln_wref *wq, *bq, *wk, *bk, *wv, *bv, *wo, *bo, *q_norm, *k_norm;
    const kiln_wref *gate, *b_gate, *up, *b_up, *down, *b_down, *attn_norm, *mlp_norm;
} llama_w;

static const kiln_wref *present(const kiln_wref *r) { return r->mat || r->vec ? r : NULL; }

static llama_w llama_layer(const kiln_wref *layer_refs, int l) {
    const kiln_wref *b = layer_refs + (size_t)l * LL_N_LAYER;
#define R(role) present(&b[(role) - LL_WQ])
    llama_w w = {R(LL_WQ),   R(LL_BQ),    R(LL_WK), R(LL_BK),  R(LL_WV),   R(LL_BV),    R(LL_WO),        R(LL_BO),
                 R(LL_QNORM), R(LL_KNORM), R(LL_GATE), R(LL_BGATE), R(LL_UP), R(LL_BUP), R(LL_DOWN), R(LL_BDOWN),
                 R(LL_ATTN_NORM), R(LL_MLP_NORM)};
#undef R
    return w;
}

#define VEC(p) ((p) ? (p)->vec : NULL)
#define GRAD(p) ((p) ? (p)->grad : NULL)

/* Saved activations of one layer, each (T, width). */
typedef struct layer_acts {
    float *x;     /* (T,C) layer input */
    float *xb1;   /* (T,C) attn norm out */
    float *qr;    /* (T,QD) q before the q norm (== q without one) */
    float *kr;    /* (T,KD) */
    float *q;     /* (T,QD) q after norm and rope */
    float *k;     /* (T,KD) */
    float *v;     /* (T,KD) */
    float *att;   /* (T,QD) attention output */
    float *x_mid; /* (T,C) residual after attention */
    float *xb2;   /* (T,C) mlp norm out */
    float *gate;  /* (T,FF) */
    float *up;    /* (T,FF) */
    float *hb;    /* (T,FF) silu(gate)*up */
    float *lse;   /* attention_seqs' saved statistics (kiln_attention_lse_floats), or NULL */
    /* with bf16 activations (acts16) xb1, xb2, hb, gate and up are kept only in bf16, here,
     * and att too when the backend's attention writes it (att16); the f32 pointers above are
     * then NULL */
    uint16_t *xb1_16, *xb2_16, *hb16, *gate16, *up16, *att16;
    /* with att16: the attention's own copy of q, k, v for the backward (ops.h attention_seqs'
     * keep, kiln_attention_keep_bytes), RoPE applied by the attention; q, k, v then point at
     * training state's shared scratch (qs, ks, vs), which holds them only until the attention */
    void *keep;
} layer_acts;

/* A training step's activations and the backward's scratch (kiln_train_io.priv). */
typedef struct llama_train {
    layer_acts *acts;    /* (L) */
    float *x_final;      /* (T,C) the last layer's output */
    /* Fast mode on a backend with the bf16-activation ops (ops.h rmsnorm_bf16, ...), C and FF
     * multiples of 8: mixed precision as PyTorch's bf16 autocast keeps it. The products'
     * inputs are written in bf16 by their producers (the values the products would round them
     * to); the gate/up products write their results in bf16 and SwiGLU reads those; the
     * attention output is bf16 (att16) where the backend's attention can write it; the
     * residual adds run in the products' epilogues; the backward norms hand the next products
     * a bf16 copy of dx (dx16). The residual stream, q, k, v and every gradient stay f32. */
    int acts16;
    uint16_t *dx16;      /* acts16: (T,C) the bf16 copy of dx */
    float *qs, *ks, *vs; /* with kept attention inputs: (T,QD), (T,KD), (T,KD) scratch */
    float *dxb, *datt, *dq, *dqr, *dk, *dkr, *dv, *dgate, *dup, *dhb, *rstd, *ws; /* backward scratch */
    float *rope_cos, *rope_sin; /* (max_seq, HS/2) */
    void *block;         /* the backend memory all of the above is carved from */
} llama_train;

/* ---- matrix products -------------------------------------------------------------------- */

/* The n matrices P[i] as one product (backward): their weight views lie back to back in one
 * dtype with one width C, and their gradients too, so one GEMM of sum(rows) x C does the
 * work of n (fewer, larger products). *out: the stacked view (P[0]'s name); false: not so
 * laid out (the caller runs n products). */
static bool stacked_view(const kiln_wref *const *P, int n, kiln_tensor *out) {
    const kiln_tensor *v0 = P[0]->mat;
    if (v0->n_dims != 2 || (v0->dtype != KILN_DTYPE_BF16 && v0->dtype != KILN_DTYPE_F32)) return false;
    const int64_t C = v0->shape[1];
    const size_t es = v0->dtype == KILN_DTYPE_BF16 ? 2 : 4;
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        const kiln_tensor *v = P[i]->mat;
        if (v->n_dims != 2 || v->dtype != v0->dtype || v->shape[1] != C ||
            (const uint8_t *)v->data != (const uint8_t *)v0->data + (size_t)rows * (size_t)C * es ||
            !P[i]->grad || P[i]->grad != P[0]->grad + rows * C)
            return false;
        rows += v->shape[0];
    }
    *out = *v0;
    out->shape[0] = rows;
    out->nbytes = (size_t)rows * (size_t)C * es;
    return true;
}

/* The ops' views of n weights and biases (bias[i] NULL: none). */
static void product_views(int n, const kiln_wref *const *W, const kiln_wref *const *bias, const kiln_tensor **wv,
                          const float **bv) {
    for (int i = 0; i < n; i++) {
        wv[i] = W[i]->mat;
        bv[i] = VEC(bias[i]);
    }
}

/* bf16 activations (acts16): n products of x16, each into out16[i] (bf16; out16 NULL:
 * out[i] f32) and plus add[i] (f32, NULL: none; ops.h matmul_multi_bf16x). */
static void matmul_n16(kiln_backend *be, int n, float *const *out, uint16_t *const *out16,
                       const float *const *add, const uint16_t *x16, const kiln_wref *const *W,
                       const kiln_wref *const *bias, int N) {
    const kiln_tensor *wv[KILN_MATMUL_MULTI_MAX];
    const float *bv[KILN_MATMUL_MULTI_MAX];
    product_views(n, W, bias, wv, bv);
    be->i->matmul_multi_bf16x(be, n, out, out16, add, x16, wv, bv, N);
}

/* n products of one input, out[i] = x @ W[i]^T + bias[i], the input in f32 (x) or bf16 (x16,
 * x NULL): with multi, one matmul_multi(_bf16x) call where the backend has it (the same
 * bits), else n matmul calls. */
static void matmul_n(kiln_backend *be, int multi, int n, float *const *out, const float *x, const uint16_t *x16,
                     const kiln_wref *const *W, const kiln_wref *const *bias, int N) {
    if (x16) {
        matmul_n16(be, n, out, NULL, NULL, x16, W, bias, N);
        return;
    }
    const kiln_tensor *wv[KILN_MATMUL_MULTI_MAX];
    const float *bv[KILN_MATMUL_MULTI_MAX];
    product_views(n, W, bias, wv, bv);
    if (multi && be->i->matmul_multi)
        be->i->matmul_multi(be, n, out, x, wv, bv, N);
    else
        for (int i = 0; i < n; i++) be->i->matmul(be, out[i], x, wv[i], bv[i], N);
}

/* The backward of matmul_n: dx (+)= sum of dy[i] @ W[i] in order, each W[i]'s and bias[i]'s
 * gradients accumulated: one matmul_backward_multi call where the backend has it (the same
 * bits), else n matmul_backward calls (the first with accumulate_dx). */
static void matmul_backward_n(kiln_backend *be, int n, float *dx, const float *const *dy,
                              const uint16_t *const *dy16, const float *x, const uint16_t *x16,
                              const kiln_wref *const *W, const kiln_wref *const *bias, int N, bool accumulate_dx) {
    const kiln_tensor *wv[KILN_MATMUL_MULTI_MAX];
    float *dw[KILN_MATMUL_MULTI_MAX], *db[KILN_MATMUL_MULTI_MAX];
    for (int i = 0; i < n; i++) {
        wv[i] = W[i]->mat;
        dw[i] = W[i]->grad;
        db[i] = GRAD(bias[i]);
    }
    if (x16)
        be->i->matmul_backward_multi_bf16x(be, n, dx, dw, db, dy, dy16, x16, wv, N, accumulate_dx);
    else if (be->i->matmul_backward_multi)
        be->i->matmul_backward_multi(be, n, dx, dw, db, dy, x, wv, N, accumulate_dx);
    else
        for (int i = 0; i < n; i++)
            be->i->matmul_backward(be, dx, dw[i], db[i], dy[i], x, wv[i], N, i > 0 || accumulate_dx);
}

/* ---- the forward ------------------------------------------------------------------------- */

/* One forward of T token rows through the embedding and the layers, for generation and for
 * training alike; R says where each intermediate goes and how attention finds its keys. */
typedef struct llama_run {
    kiln_backend *be;
    const kiln_model_config *cfg;
    const kiln_tensor *embed;     /* the embedding table */
    const kiln_wref *layer_refs;  /* (L, LL_N_LAYER) */
    const int32_t *ids, *pos;     /* (T) backend memory */
    int T;
    /* Where the intermediates go: training gives every layer its own acts[l] (saved for the
     * backward) and the last layer's output goes to x_final; generation gives one set that
     * every layer reuses (acts[0], x updated in place: x_final NULL). */
    layer_acts *acts;
    int per_layer;
    float *x_final;
    int multi;  /* products of one input as one matmul_multi call where the backend has it */
    int acts16; /* bf16 activations (training, fast mode) */
    const float *rope_cos, *rope_sin;
    /* Attention. Training: n_seq sequences of seq rows, each attending to its own rows
     * (positions 0..seq-1). Generation (gen): through the paged cache (kiln_forward_attend). */
    int n_seq, seq;
    const kiln_fwd_batch *gen;
    const kiln_taps *taps; /* hidden-state taps (arch.h), or NULL */
    const kiln_layer_hook *hook; /* training: the layer events (arch.h), or NULL */
} llama_run;

/* out = x W^T (+ bias) + res: one products call (kiln_op_products: the bits of matmul, then add). */
static void products_res(kiln_backend *be, float *out, const float *x, const kiln_wref *W, const kiln_wref *bias,
                         const float *res, int T) {
    float *o[1] = {out};
    const float *r[1] = {res}, *b[1] = {VEC(bias)};
    const kiln_tensor *w[1] = {W->mat};
    const kiln_products p = {.n = 1, .out = o, .res = r, .W = w, .bias = b};
    kiln_op_products(be, x, &p, T);
}

static void llama_layers(const llama_run *R) {
    const kiln_model_config *c = R->cfg;
    kiln_backend *be = R->be;
    const kiln_backend_i *op = be->i;
    int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    int T = R->T, n_seq = R->n_seq, seq = R->seq;
    size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    float eps = c->rms_eps, scale = (float)(1.0 / sqrt((double)HS));
    op->embed(be, R->acts[0].x, R->embed, R->ids, T);
    for (int l = 0; l < c->n_layer; l++) {
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_BEGIN);
        const llama_w lw = llama_layer(R->layer_refs, l), *w = &lw;
        layer_acts *a = &R->acts[R->per_layer ? l : 0];
        float *x_next = !R->per_layer ? a->x : l + 1 < c->n_layer ? R->acts[l + 1].x : R->x_final;
        float *qkv[3] = {a->qr, a->kr, a->v};
        const kiln_wref *wqkv[3] = {w->wq, w->wk, w->wv}, *bqkv[3] = {w->bq, w->bk, w->bv};
        if (R->gen) { /* the normed input is not kept: the norm in the products where the backend fuses it */
            const kiln_tensor *wm[3] = {w->wq->mat, w->wk->mat, w->wv->mat};
            const float *bv[3] = {VEC(w->bq), VEC(w->bk), VEC(w->bv)};
            const kiln_products p = {.n = 3, .out = qkv, .W = wm, .bias = bv, .norm_w = VEC(w->attn_norm),
                                     .eps = eps, .scratch_x = a->xb1};
            kiln_op_products(be, a->x, &p, T);
        } else {
            if (R->acts16)
                op->rmsnorm_bf16(be, a->xb1_16, a->x, VEC(w->attn_norm), T, C, eps);
            else
                op->rmsnorm(be, a->xb1, a->x, VEC(w->attn_norm), T, C, eps);
            matmul_n(be, R->multi, 3, qkv, a->xb1, a->xb1_16, wqkv, bqkv, T);
        }
        if (w->q_norm) op->rmsnorm(be, a->q, a->qr, VEC(w->q_norm), T * NH, HS, eps);
        if (w->k_norm) op->rmsnorm(be, a->k, a->kr, VEC(w->k_norm), T * KVH, HS, eps);
        if (R->gen) { /* generation: rotate q, k, store k, v in the cache, attend through its block table */
            kiln_forward_attend_rope(R->gen, be, l, a->att, a->q, a->k, a->v, NH, KVH, HS, scale, 0, R->rope_cos,
                                     R->rope_sin);
        } else {
            if (!a->keep) { /* else the attention applies RoPE as it keeps its copy of q, k, v */
                op->rope(be, a->q, R->pos, T, NH, HS, R->rope_cos, R->rope_sin);
                op->rope(be, a->k, R->pos, T, KVH, HS, R->rope_cos, R->rope_sin);
            }
            if (op->attention_seqs && op->attention_backward_seqs) { /* all sequences at once */
                op->attention_seqs(be, a->att, a->att16, a->lse, a->keep, a->keep ? R->pos : NULL, R->rope_cos,
                                   R->rope_sin, a->q, a->k, a->v, n_seq, seq, NH, KVH, HS, scale);
            } else {
                for (int b = 0; b < n_seq; b++) {
                    size_t r = (size_t)b * seq;
                    op->attention(be, a->att + r * QD, a->q + r * QD, a->k + r * KD, a->v + r * KD, seq, 0, NH,
                                  KVH, HS, scale, 0);
                }
            }
        }
        const kiln_wref *nob[2] = {NULL, NULL};
        if (a->att16) { /* x_mid = x + o, the add in the product's epilogue */
            const kiln_wref *wo[1] = {w->wo}, *bo[1] = {w->bo};
            const float *res[1] = {a->x};
            matmul_n16(be, 1, &a->x_mid, NULL, res, a->att16, wo, bo, T);
        } else { /* x_mid = o + x: IEEE addition commutes, so the bits of x + o, with no copy */
            products_res(be, a->x_mid, a->att, w->wo, w->bo, a->x, T);
        }
        if (R->acts16)
            op->rmsnorm_bf16(be, a->xb2_16, a->x_mid, VEC(w->mlp_norm), T, C, eps);
        else if (!R->gen) /* generation: normed in the gate/up products below */
            op->rmsnorm(be, a->xb2, a->x_mid, VEC(w->mlp_norm), T, C, eps);
        const kiln_wref *wgu[2] = {w->gate, w->up}, *bgu[2] = {w->b_gate, w->b_up};
        if (R->acts16) { /* gate, up in bf16; x_next = x_mid + down(h) in the epilogue */
            uint16_t *gu16[2] = {a->gate16, a->up16};
            matmul_n16(be, 2, NULL, gu16, NULL, a->xb2_16, wgu, nob, T);
            op->swiglu_bf16(be, a->hb16, a->gate16, a->up16, (size_t)T * FF);
            const kiln_wref *wd[1] = {w->down};
            const float *res[1] = {a->x_mid};
            matmul_n16(be, 1, &x_next, NULL, res, a->hb16, wd, nob, T);
        } else { /* x_next = down(h) + x_mid (x_next may be the layer's input x: read by now) */
            if (R->gen) { /* the normed input, gate and up are not kept: one fused op where the backend has it */
                float *out[1] = {a->hb};
                const kiln_tensor *wg[1] = {w->gate->mat};
                const float *b[2] = {VEC(w->b_gate), VEC(w->b_up)};
                const kiln_products p = {.n = 1, .out = out, .W = wg, .bias = b, .up = w->up->mat,
                                         .norm_w = VEC(w->mlp_norm), .eps = eps, .scratch_x = a->xb2,
                                         .scratch_gate = a->gate, .scratch_up = a->up};
                kiln_op_products(be, a->x_mid, &p, T);
            } else {
                float *gu[2] = {a->gate, a->up};
                matmul_n(be, R->multi, 2, gu, a->xb2, NULL, wgu, bgu, T);
                op->swiglu(be, a->hb, a->gate, a->up, (size_t)T * FF);
            }
            products_res(be, x_next, a->hb, w->down, w->b_down, a->x_mid, T);
        }
        kiln_tap_out(be, R->taps, l, x_next, (size_t)T * C);
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_END);
    }
}

/* ---- generation ------------------------------------------------------------------------- */

/* arch.h's forward: N tokens staged in fs->d_batch through llama_layers in the forward
 * state's scratch, then the final norm and the head on the rows whose logits are wanted. */
static void llama_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                          const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                          float *logits) {
    const kiln_fwd_batch g = kiln_fwd_batch_of(fs, N, runs, n_runs, max_T);
    /* every layer in the same scratch: q and k normed and rotated in place, the gate's buffer
     * reused for silu(gate) * up */
    layer_acts a = {0};
    a.x = fs->x;
    a.xb1 = a.xb2 = fs->xb;
    a.qr = a.q = fs->q;
    a.kr = a.k = fs->k_new;
    a.v = fs->v_new;
    a.att = fs->att;
    a.x_mid = fs->tmp;
    a.gate = a.hb = fs->hb;
    a.up = fs->hb2;
    llama_run R = {0};
    R.be = be;
    R.cfg = &m->cfg;
    R.embed = m->tok_embd;
    R.layer_refs = fs->layer_refs;
    R.ids = g.ids;
    R.pos = g.pos;
    R.T = N;
    R.acts = &a;
    R.rope_cos = fs->rope_cos;
    R.rope_sin = fs->rope_sin;
    R.multi = 1; /* q, k, v in one matmul_multi call (the bits of three) */
    R.gen = &g;
    R.taps = fs->taps;
    llama_layers(&R);
    kiln_forward_logits(m, be, fs, N, out, n_out, logits);
}

/* ---- training: the activations ------------------------------------------------------------ */

static void llama_train_free(kiln_train_io *io) {
    llama_train *t = io ? io->priv : NULL;
    if (!t) return;
    if (t->block) kiln_backend_free_buf(io->be, t->block);
    kiln_free(t->acts);
    kiln_free(t);
    io->priv = NULL;
}

/* Every activation of a training step of max_batch sequences of max_seq tokens, and the
 * backward's scratch, carved from one block of backend memory (each region 256-byte aligned:
 * ops.h attention_seqs' keep). */
static kiln_status llama_train_init(kiln_train_io *io) {
    const kiln_model_config *c = &io->model->cfg;
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    llama_train *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    io->priv = t;
    /* T: rows (tokens of the largest batch), S: positions of one sequence */
    size_t S = (size_t)io->max_seq, T = S * (size_t)io->max_batch, C = (size_t)c->n_embd, FF = (size_t)c->n_ff;
    size_t HS = (size_t)c->head_dim, QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS;
    int L = c->n_layer, qk = 0;
    for (int l = 0; l < L; l++) qk |= llama_layer(io->layer_refs, l).q_norm != NULL;
    t->acts = kiln_calloc((size_t)L, sizeof *t->acts);
    if (!t->acts) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    enum { PER_LAYER = 21, N_SCRATCH = 22 };
    /* a backend with batched attention saves each layer's softmax statistics for the backward */
    const int seqs = op->attention_seqs && op->attention_backward_seqs;
    /* bf16 activations: f32 -> bf16 conversions 451 -> 211 a 135M step (5.4 -> 1.7 ms), the
     * activations 16% smaller (bench/RESULTS.md, 2026-12-01, d044469) */
    t->acts16 = io->fast && !op->host_memory && op->rmsnorm_bf16 && op->swiglu_bf16 && op->matmul_multi_bf16x &&
                op->matmul_backward_multi_bf16x && op->swiglu_backward_bf16 && op->rmsnorm_backward_bf16 &&
                C % 8 == 0 && FF % 8 == 0;
    const size_t f32_in = t->acts16 ? 0 : 1, b16_in = t->acts16 ? 1 : 0; /* where xb1, xb2, hb live */
    /* the attention output in bf16: the batched attention's flash kernels (head size 64 or
     * 128, ops.h attention_seqs' out16; a shape a backend refuses would fail the step) */
    const int att16 = t->acts16 && seqs && (HS == 64 || HS == 128) && QD % 8 == 0;
    const size_t att_f32 = att16 ? 0 : 1, att_b16 = att16 ? 1 : 0;
    /* and then the attention keeps its own copy of q, k, v (RoPE applied by it): the trainer
     * holds them in scratch only until the attention has run */
    const size_t keep = att16 ? (kiln_attention_keep_bytes(io->max_batch, (int)S, c->n_head, c->n_head_kv, (int)HS) +
                                 3) / 4
                              : 0;
    const size_t qkv_saved = keep ? 0 : 1;
    size_t lse = seqs ? kiln_attention_lse_floats(io->max_batch, (int)S, c->n_head) : 0;
    size_t ws = kiln_attention_backward_ws_floats((int)S, 0, c->n_head, c->n_head_kv, (int)HS);
    if (seqs) {
        size_t wb = kiln_attention_backward_seqs_ws_floats(io->max_batch, (int)S, c->n_head, c->n_head_kv, (int)HS);
        if (wb > ws) ws = wb;
    }
    int n = L * PER_LAYER + 2 + N_SCRATCH;
    float ***slots = kiln_calloc((size_t)n, sizeof *slots);
    size_t *sizes = kiln_calloc((size_t)n, sizeof *sizes);
    if (!slots || !sizes) {
        kiln_free(slots);
        kiln_free(sizes);
        return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    }
    int k = 0;
    for (int l = 0; l < L; l++) {
        layer_acts *a = &t->acts[l];
        /* the bf16 ones in floats: C and FF are multiples of 8 when they are used */
        float **ps[PER_LAYER] = {&a->x,   &a->xb1, &a->qr, &a->kr, &a->q,   &a->k,   &a->v,
                                 &a->att, &a->x_mid, &a->xb2, &a->gate, &a->up, &a->hb, &a->lse,
                                 (float **)&a->xb1_16, (float **)&a->xb2_16, (float **)&a->hb16,
                                 (float **)&a->gate16, (float **)&a->up16, (float **)&a->att16,
                                 (float **)&a->keep};
        size_t ss[PER_LAYER] = {T * C,               f32_in * T * C,      qk ? T * QD : 0,     qk ? T * KD : 0,
                                qkv_saved * T * QD,  qkv_saved * T * KD,  qkv_saved * T * KD,  att_f32 * T * QD,
                                T * C,               f32_in * T * C,      f32_in * T * FF,     f32_in * T * FF,
                                f32_in * T * FF,     lse,                 b16_in * T * C / 2,  b16_in * T * C / 2,
                                b16_in * T * FF / 2, b16_in * T * FF / 2, b16_in * T * FF / 2, att_b16 * T * QD / 2,
                                keep};
        for (int i = 0; i < PER_LAYER; i++) {
            slots[k] = ps[i];
            sizes[k++] = ss[i];
        }
    }
    slots[k] = &t->x_final, sizes[k++] = T * C;
    slots[k] = &io->xn, sizes[k++] = T * C;
    size_t NHT = T * (size_t)c->n_head;
    /* pos and ids: in the block (backend memory); a device fills them by uploads */
    size_t ints = T;
    /* with acts16, dgate holds T x 2FF bf16 (the gate and up gradients, side by side or one
     * after the other; the q, k, v products' dy in the attention's backward) and dup nothing */
    const size_t dg_n = T * FF, du_n = t->acts16 ? 0 : T * FF;
    float **sp[N_SCRATCH] = {&io->dx, &t->dxb, &io->dxn, &t->datt, &t->dq, &t->dqr, &t->dk, &t->dkr,
                             &t->dv, &t->dgate, &t->dup, &t->dhb, &t->rstd, &t->ws, &t->rope_cos, &t->rope_sin,
                             (float **)&io->pos, (float **)&io->ids, (float **)&t->dx16, &t->qs, &t->ks, &t->vs};
    size_t sz[N_SCRATCH] = {T * C, T * C, T * C, T * QD, T * QD, qk ? T * QD : 0, T * KD, qk ? T * KD : 0, T * KD,
                            dg_n, du_n, T * FF, NHT > T * (size_t)c->n_head_kv ? NHT : T,
                            ws,
                            S * HS / 2, S * HS / 2, ints, ints, b16_in * T * C / 2, (1 - qkv_saved) * T * QD,
                            (1 - qkv_saved) * T * KD, (1 - qkv_saved) * T * KD};
    for (int i = 0; i < N_SCRATCH; i++) {
        slots[k] = sp[i];
        sizes[k++] = sz[i];
    }
    kiln_status st = kiln_backend_alloc_carved(be, k, (float **const *)slots, sizes, &t->block, &io->bytes, "trainer",
                                               "activations");
    kiln_free(slots);
    kiln_free(sizes);
    if (st != KILN_OK) return st;
    for (int l = 0; l < L; l++) {
        layer_acts *a = &t->acts[l];
        if (!qk) {
            a->qr = a->q;
            a->kr = a->k;
        }
        if (!lse) a->lse = NULL;
        if (t->acts16) {
            a->xb1 = a->xb2 = a->hb = a->gate = a->up = NULL;
        } else {
            a->xb1_16 = a->xb2_16 = a->hb16 = a->gate16 = a->up16 = NULL;
        }
        if (att16)
            a->att = NULL;
        else
            a->att16 = NULL;
        if (keep) { /* q, k, v in the shared scratch (qr, kr: q, k without q/k norms) */
            a->q = t->qs;
            a->k = t->ks;
            a->v = t->vs;
            if (!qk) {
                a->qr = a->q;
                a->kr = a->k;
            }
        } else {
            a->keep = NULL;
        }
    }
    if (!t->acts16) t->dx16 = NULL;
    if (!keep) t->qs = t->ks = t->vs = NULL;
    if (!qk) {
        t->dqr = t->dq;
        t->dkr = t->dk;
    }
    /* the rope tables: computed on the host (uploaded to a device) */
    if (op->host_memory) {
        kiln_rope_tables_fill(io->model, (int)S, t->rope_cos, t->rope_sin);
        return KILN_OK;
    }
    size_t tab = S * HS / 2;
    float *host = kiln_malloc((tab ? tab : 1) * 2 * sizeof(float));
    if (!host) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the rope tables");
    kiln_rope_tables_fill(io->model, (int)S, host, host + tab);
    st = kiln_backend_upload(be, t->rope_cos, host, tab * sizeof(float));
    if (st == KILN_OK) st = kiln_backend_upload(be, t->rope_sin, host + tab, tab * sizeof(float));
    kiln_free(host);
    return st;
}

/* ---- training ---------------------------------------------------------------------------- */

/* n_seq sequences of seq rows (io->ids, io->pos) through the layers, each layer's activations
 * saved; io->xn = the final norm of the last layer's output. */
static void llama_train_forward(kiln_train_io *io, int n_seq, int seq) {
    llama_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    llama_run R = {0};
    R.be = io->be;
    R.cfg = c;
    R.embed = io->refs[LL_EMBED].mat;
    R.layer_refs = io->layer_refs;
    R.ids = io->ids;
    R.pos = io->pos;
    R.T = n_seq * seq;
    R.acts = t->acts;
    R.per_layer = 1;
    R.x_final = t->x_final;
    R.multi = 1;
    R.acts16 = t->acts16;
    R.rope_cos = t->rope_cos;
    R.rope_sin = t->rope_sin;
    R.n_seq = n_seq;
    R.seq = seq;
    R.taps = io->taps;
    R.hook = io->hook;
    llama_layers(&R);
    io->be->i->rmsnorm(io->be, io->xn, t->x_final, io->refs[LL_NORM].vec, R.T, c->n_embd, c->rms_eps);
}

/* ---- the backward ----------------------------------------------------------------------- */

/* The layer work of a backward, from d loss / d xn (dxn) down to the embedding's gradient,
 * for the pending step's n_seq sequences of seq tokens. */
static void llama_train_backward(kiln_train_io *io, int n_seq, int seq) {
    llama_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    kiln_backend *be = io->be;
    const kiln_wref *final_norm = &io->refs[LL_NORM];
    const kiln_backend_i *op = be->i;
    int T = n_seq * seq, C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    float eps = c->rms_eps, scale = (float)(1.0 / sqrt((double)HS));
    /* dx = d loss / d x_final, from d xn (acts16: and its bf16 copy dx16, which the products
     * take as dy) */
    if (t->acts16)
        op->rmsnorm_backward_bf16(be, io->dx, t->dx16, final_norm->grad, io->dxn, t->x_final, final_norm->vec,
                                  T, C, eps, t->rstd, false);
    else
        op->rmsnorm_backward(be, io->dx, final_norm->grad, io->dxn, t->x_final, final_norm->vec, T, C, eps,
                             t->rstd, false);
    for (int l = c->n_layer - 1; l >= 0; l--) {
        const llama_w lw = llama_layer(io->layer_refs, l), *w = &lw;
        const layer_acts *a = &t->acts[l];
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_BEGIN);
        kiln_tap_grad(be, io->taps, l, io->dx, (size_t)T * C); /* d loss / d this layer's output, more */
        /* MLP: x_next = x_mid + down(silu(gate) * up) */
        const kiln_wref *nob[2] = {NULL, NULL};
        const uint16_t *dx16s[1] = {t->dx16};
        const bool mlp16 = t->acts16 && op->matmul_backward_dx16 && op->swiglu_backward_bf16_d16;
        uint16_t *dhb16 = (uint16_t *)t->dhb; /* mlp16: the down projection's dx in bf16 */
        if (mlp16) {
            op->matmul_backward_dx16(be, dhb16, w->down->grad, t->dx16, a->hb16, w->down->mat, T);
        } else if (t->acts16) {
            const float *dxs[1] = {io->dx};
            const kiln_wref *wd[1] = {w->down};
            matmul_backward_n(be, 1, t->dhb, dxs, dx16s, NULL, a->hb16, wd, nob, T, false);
        } else {
            op->matmul_backward(be, t->dhb, w->down->grad, NULL, io->dx, a->hb, w->down->mat, T, false);
        }
        const kiln_wref *wgu[2] = {w->gate, w->up};
        kiln_tensor gu;
        if (mlp16 && stacked_view(wgu, 2, &gu)) {
            /* dgate | dup side by side, rows of 2FF: the dy of the stacked gate/up product */
            uint16_t *dgu = (uint16_t *)t->dgate;
            op->swiglu_backward_bf16_d16(be, dgu, dgu + FF, 2 * (int64_t)FF, dhb16, a->gate16, a->up16, T, FF);
            const kiln_tensor *wv[1] = {&gu};
            float *dw[1] = {w->gate->grad}, *db[1] = {NULL};
            const uint16_t *dy16[1] = {dgu};
            op->matmul_backward_multi_bf16x(be, 1, t->dxb, dw, db, NULL, dy16, a->xb2_16, wv, T, false);
        } else if (t->acts16) { /* dgate, dup in bf16, one after the other: only products read them */
            uint16_t *dg16 = (uint16_t *)t->dgate, *du16 = dg16 + (size_t)T * FF;
            if (mlp16)
                op->swiglu_backward_bf16_d16(be, dg16, du16, FF, dhb16, a->gate16, a->up16, T, FF);
            else
                op->swiglu_backward_bf16(be, dg16, du16, t->dhb, a->gate16, a->up16, (size_t)T * FF);
            const uint16_t *dgu16[2] = {dg16, du16};
            matmul_backward_n(be, 2, t->dxb, NULL, dgu16, NULL, a->xb2_16, wgu, nob, T, false);
        } else {
            op->swiglu_backward(be, t->dgate, t->dup, t->dhb, a->gate, a->up, (size_t)T * FF);
            const float *dgu[2] = {t->dgate, t->dup};
            matmul_backward_n(be, 2, t->dxb, dgu, NULL, a->xb2, NULL, wgu, nob, T, false);
        }
        if (t->acts16)
            op->rmsnorm_backward_bf16(be, io->dx, t->dx16, w->mlp_norm->grad, t->dxb, a->x_mid, VEC(w->mlp_norm), T, C,
                                      eps, t->rstd, true);
        else
            op->rmsnorm_backward(be, io->dx, w->mlp_norm->grad, t->dxb, a->x_mid, VEC(w->mlp_norm), T, C, eps, t->rstd,
                                 true);
        /* attention: x_mid = x + o(attention(rope(q), rope(k), v)) */
        if (a->att16) {
            const float *dxs[1] = {io->dx};
            const kiln_wref *wo[1] = {w->wo}, *bo[1] = {w->bo};
            matmul_backward_n(be, 1, t->datt, dxs, dx16s, NULL, a->att16, wo, bo, T, false);
        } else {
            op->matmul_backward(be, t->datt, w->wo->grad, GRAD(w->bo), io->dx, a->att, w->wo->mat, T, false);
        }
        const kiln_wref *wqkv[3] = {w->wq, w->wk, w->wv}, *bqkv[3] = {w->bq, w->bk, w->bv};
        kiln_tensor qkv;
        /* the rotation and the products' bf16 rounding in one pass (f32 kept for a bias's
         * sum), in the MLP's dgate memory (T x 2FF bf16), free until the next layer's MLP:
         * the bits of rope_backward, then the products rounding dq, dk, dv. With the three
         * weights (and gradients) back to back, dq | dk | dv side by side (rows of QD + 2KD)
         * are the dy of one stacked product; else one after the other, three products. */
        const bool grad16 = t->acts16 && op->rope_backward_bf16 && op->to_bf16_2d && !w->q_norm && !w->k_norm &&
                            QD + 2 * KD <= 2 * (size_t)FF;
        const bool stack = grad16 && stacked_view(wqkv, 3, &qkv);
        uint16_t *dq16 = (uint16_t *)t->dgate;
        uint16_t *dk16 = stack ? dq16 + QD : dq16 + (size_t)T * QD;
        uint16_t *dv16 = stack ? dk16 + KD : dk16 + (size_t)T * KD;
        const bool keep_f32 = w->bq || w->bk || w->bv; /* the biases' sums read the f32 values */
        if (grad16 && op->attention_seqs && op->attention_backward_seqs16 && stack) {
            /* the attention's own stores do the rotation and the rounding (the same bits) */
            const kiln_attn_grad16 g = {dq16, dk16, dv16, (int64_t)(QD + 2 * KD), keep_f32, io->pos, t->rope_cos,
                                        t->rope_sin};
            op->attention_backward_seqs16(be, t->dq, t->dk, t->dv, &g, t->datt, a->keep ? NULL : a->q,
                                          a->keep ? NULL : a->k, a->keep ? NULL : a->v, a->att, a->att16, a->lse,
                                          a->keep, t->ws, n_seq, seq, NH, KVH, HS, scale);
        } else {
            if (op->attention_seqs && op->attention_backward_seqs)
                op->attention_backward_seqs(be, t->dq, t->dk, t->dv, t->datt, a->keep ? NULL : a->q,
                                            a->keep ? NULL : a->k, a->keep ? NULL : a->v, a->att, a->att16, a->lse,
                                            a->keep, t->ws, n_seq, seq, NH, KVH, HS, scale);
            else
                for (int b = 0; b < n_seq; b++) { /* per sequence; ws is reused in stream order */
                    size_t r = (size_t)b * seq;
                    op->attention_backward(be, t->dq + r * QD, t->dk + r * KD, t->dv + r * KD, t->datt + r * QD,
                                           a->q + r * QD, a->k + r * KD, a->v + r * KD, a->att + r * QD, t->ws, seq,
                                           0, NH, KVH, HS, scale, 0);
                }
            if (grad16) {
                const int64_t ld = stack ? (int64_t)(QD + 2 * KD) : 0;
                op->rope_backward_bf16(be, t->dq, dq16, stack ? ld : (int64_t)QD, w->bq != NULL, io->pos, T, NH, HS,
                                       t->rope_cos, t->rope_sin);
                op->rope_backward_bf16(be, t->dk, dk16, stack ? ld : (int64_t)KD, w->bk != NULL, io->pos, T, KVH,
                                       HS, t->rope_cos, t->rope_sin);
                op->to_bf16_2d(be, dv16, stack ? ld : (int64_t)KD, t->dv, KD, T, KD);
            }
        }
        if (grad16) {
            if (stack) {
                const kiln_tensor *wv[1] = {&qkv};
                float *dw[1] = {w->wq->grad}, *db[1] = {NULL};
                const uint16_t *dy16[1] = {dq16};
                op->matmul_backward_multi_bf16x(be, 1, t->dxb, dw, db, NULL, dy16, a->xb1_16, wv, T, false);
                if (w->bq || w->bk || w->bv) { /* the biases' sums alone, from the f32 gradients */
                    const kiln_tensor *bw[3] = {w->wq->mat, w->wk->mat, w->wv->mat};
                    float *nodw[3] = {NULL, NULL, NULL};
                    float *dbs[3] = {GRAD(w->bq), GRAD(w->bk), GRAD(w->bv)};
                    const float *dys[3] = {t->dq, t->dk, t->dv};
                    op->matmul_backward_multi_bf16x(be, 3, NULL, nodw, dbs, dys, NULL, a->xb1_16, bw, T, false);
                }
            } else {
                const float *dqkv[3] = {t->dq, t->dk, t->dv};
                const uint16_t *dqkv16[3] = {dq16, dk16, dv16};
                matmul_backward_n(be, 3, t->dxb, dqkv, dqkv16, a->xb1, a->xb1_16, wqkv, bqkv, T, false);
            }
        } else {
            op->rope_backward(be, t->dq, io->pos, T, NH, HS, t->rope_cos, t->rope_sin);
            op->rope_backward(be, t->dk, io->pos, T, KVH, HS, t->rope_cos, t->rope_sin);
            if (w->q_norm)
                op->rmsnorm_backward(be, t->dqr, w->q_norm->grad, t->dq, a->qr, VEC(w->q_norm), T * NH, HS, eps, t->rstd,
                                     false);
            if (w->k_norm)
                op->rmsnorm_backward(be, t->dkr, w->k_norm->grad, t->dk, a->kr, VEC(w->k_norm), T * KVH, HS, eps, t->rstd,
                                     false);
            const float *dqkv[3] = {t->dqr, t->dkr, t->dv};
            matmul_backward_n(be, 3, t->dxb, dqkv, NULL, a->xb1, a->xb1_16, wqkv, bqkv, T, false);
        }
        if (t->acts16 && l > 0) /* layer 0's dx goes to the embedding alone */
            op->rmsnorm_backward_bf16(be, io->dx, t->dx16, w->attn_norm->grad, t->dxb, a->x, VEC(w->attn_norm), T, C,
                                      eps, t->rstd, true);
        else
            op->rmsnorm_backward(be, io->dx, w->attn_norm->grad, t->dxb, a->x, VEC(w->attn_norm), T, C, eps, t->rstd,
                                 true);
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_END);
    }
    /* the embedding's backward follows, outside the recorded graph (kiln_train_backward) */
}

