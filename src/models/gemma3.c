/*
 * gemma3.c -- Gemma 3 text models (Gemma3ForCausalLM; GGUF general.architecture "gemma3"): the
 * parameter roles and the forward, as transformers computes it (docs/models/gemma3-notes.md).
 *
 *   x = embed(ids) * sqrt(C)                                 (the scale rounded to f32)
 *   for each layer (sliding: attends to the last sliding_window positions, RoPE base
 *   rope_theta_local; full: every earlier position, rope_theta):
 *       h = rmsnorm(x) (1 + w_in)
 *       q, k, v = h Wq^T, h Wk^T, h Wv^T ; q, k = rmsnorm_per_head (1 + w_q), (1 + w_k)
 *       q, k = rope(q), rope(k) ; a = attention(q, K, V) * query_pre_attn_scalar^-1/2 scores
 *       x = x + rmsnorm(a Wo^T) (1 + w_post_attn)
 *       h = rmsnorm(x) (1 + w_pre_ff)
 *       x = x + rmsnorm((gelu_tanh(h Wg^T) * (h Wu^T)) Wd^T) (1 + w_post_ff)
 *   logits = rmsnorm(x) (1 + w_final) E^T                     (the head is the embedding)
 *
 * Every norm multiplies by 1 + w: the model binds that multiplier (arch.h plus_one), so the
 * forward runs the plain rmsnorm op. Training runs the same forward (gemma3_layers) with each
 * layer's activations saved, and the backward beside it; the trainer's parameters are
 * transformers' w, the multipliers recomputed from them each step.
 */
#include "../formats/gguf.h"
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum gemma3_role {
    G3_EMBED, /* per model */
    G3_WQ, G3_WK, G3_WV, G3_WO, G3_QNORM, G3_KNORM, G3_GATE, G3_UP, G3_DOWN, /* per layer */
    G3_IN_NORM, G3_POST_ATTN_NORM, G3_PRE_FF_NORM, G3_POST_FF_NORM,
    G3_NORM, G3_HEAD, /* per model */
    G3_N
};
#define G3_N_LAYER (G3_POST_FF_NORM - G3_WQ + 1)

#define HF_L "model.layers.%d."
#define GG_L "blk.%d."
#define MAT(rows, cols) rows, cols, KILN_COND_ALWAYS, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false
/* the multiplier 1 + w starts at 1 (transformers initialises w to 0) */
#define NORM(rows) rows, KILN_DIM_ONE, KILN_COND_ALWAYS, KILN_INIT_ONES, true, true, KILN_DIM_ONE, true
static const kiln_param_role gemma3_roles[G3_N] = {
    /* hf name, gguf name, rows, cols, condition, init, per layer, trainable, gguf rope heads,
     * plus_one */
    [G3_EMBED] = {"model.embed_tokens.weight", "token_embd.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_ALWAYS,
                  KILN_INIT_NORMAL, false, true, KILN_DIM_ONE, false},
    [G3_WQ] = {HF_L "self_attn.q_proj.weight", GG_L "attn_q.weight", MAT(KILN_DIM_QD, KILN_DIM_C)},
    [G3_WK] = {HF_L "self_attn.k_proj.weight", GG_L "attn_k.weight", MAT(KILN_DIM_KD, KILN_DIM_C)},
    [G3_WV] = {HF_L "self_attn.v_proj.weight", GG_L "attn_v.weight", MAT(KILN_DIM_KD, KILN_DIM_C)},
    [G3_WO] = {HF_L "self_attn.o_proj.weight", GG_L "attn_output.weight", MAT(KILN_DIM_C, KILN_DIM_QD)},
    [G3_QNORM] = {HF_L "self_attn.q_norm.weight", GG_L "attn_q_norm.weight", NORM(KILN_DIM_HS)},
    [G3_KNORM] = {HF_L "self_attn.k_norm.weight", GG_L "attn_k_norm.weight", NORM(KILN_DIM_HS)},
    [G3_GATE] = {HF_L "mlp.gate_proj.weight", GG_L "ffn_gate.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [G3_UP] = {HF_L "mlp.up_proj.weight", GG_L "ffn_up.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [G3_DOWN] = {HF_L "mlp.down_proj.weight", GG_L "ffn_down.weight", MAT(KILN_DIM_C, KILN_DIM_FF)},
    [G3_IN_NORM] = {HF_L "input_layernorm.weight", GG_L "attn_norm.weight", NORM(KILN_DIM_C)},
    [G3_POST_ATTN_NORM] = {HF_L "post_attention_layernorm.weight", GG_L "post_attention_norm.weight",
                           NORM(KILN_DIM_C)},
    [G3_PRE_FF_NORM] = {HF_L "pre_feedforward_layernorm.weight", GG_L "ffn_norm.weight", NORM(KILN_DIM_C)},
    [G3_POST_FF_NORM] = {HF_L "post_feedforward_layernorm.weight", GG_L "post_ffw_norm.weight", NORM(KILN_DIM_C)},
    [G3_NORM] = {"model.norm.weight", "output_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS,
                 KILN_INIT_ONES, false, true, KILN_DIM_ONE, true},
    [G3_HEAD] = {"lm_head.weight", "output.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_UNTIED, KILN_INIT_NORMAL,
                 false, true, KILN_DIM_ONE, false},
};
#undef HF_L
#undef GG_L
#undef MAT
#undef NORM

/* What a gemma3 GGUF leaves to Gemma3TextConfig's defaults (the notes, "The 270M GGUF"): the
 * sliding layers' RoPE base, every sixth layer full, query_pre_attn_scalar; the window is in the
 * file. */
static kiln_status gemma3_gguf_config(const kiln_gguf *g, const char *path, kiln_model_config *c) {
    uint32_t w = 0;
    int found = 0;
    KILN_TRY(kiln_gguf_get_u32(g, "gemma3.attention.sliding_window", &w, &found));
    if (!found) return kiln_error(KILN_ERR_FORMAT, "%s: missing metadata key 'gemma3.attention.sliding_window'", path);
    if (w > (1u << 30)) return kiln_error(KILN_ERR_FORMAT, "%s: gemma3.attention.sliding_window %u is out of range", path, w);
    if (c->n_layer > KILN_MAX_LAYER_KINDS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %d layers: at most %d with sliding windows", path, c->n_layer,
                          KILN_MAX_LAYER_KINDS);
    c->sliding_window = (int)w;
    memset(c->sliding_layers, 0, sizeof c->sliding_layers);
    for (int l = 0; l < c->n_layer; l++)
        if ((l + 1) % 6 != 0) c->sliding_layers[l / 8] |= (uint8_t)(1u << (l % 8));
    c->rope_theta_local = 10000.0f;
    c->query_pre_attn_scalar = 256.0f;
    c->bos_id = 2;
    c->eos_id = 1;
    return KILN_OK;
}

/* ---- the forward ------------------------------------------------------------------------- */

/* Where one layer's intermediates go (each (T, width)): one set every layer reuses
 * (generation) or each layer's own (training, read by the backward). */
typedef struct g3_acts {
    float *x;           /* (T,C) the layer's input */
    float *xb1;         /* (T,C) the input norm's output */
    float *qr, *kr;     /* (T,QD), (T,KD) q, k before their norms */
    float *q, *k, *v;   /* (T,QD), (T,KD), (T,KD) q, k normed and rotated */
    float *att;         /* (T,QD) attention output */
    float *o;           /* (T,C) att Wo^T, the post-attention norm's input */
    float *x_mid;       /* (T,C) x + norm(o) */
    float *xb2;         /* (T,C) the pre-MLP norm's output */
    float *gate, *up;   /* (T,FF) */
    float *hb;          /* (T,FF) gelu_tanh(gate) * up */
    float *d;           /* (T,C) hb Wd^T, the post-MLP norm's input */
} g3_acts;

/* One forward of T rows through the embedding and the layers, for generation and training. */
typedef struct g3_run {
    kiln_backend *be;
    const kiln_model_config *cfg;
    const kiln_tensor *embed;
    const kiln_wref *layer_refs; /* (L, G3_N_LAYER), the norms' vec the multipliers 1 + w */
    const int32_t *ids, *pos;    /* (T) backend memory */
    int T;
    g3_acts *acts;               /* per_layer: acts[l]; else acts[0] for every layer, x in place */
    int per_layer;
    float *x_final;              /* per_layer: the last layer's output */
    const float *rope_cos, *rope_sin, *rope_cos_local, *rope_sin_local; /* (positions, HS/2) */
    /* attention: training, n_seq sequences of seq rows over their own rows; generation (gen),
     * through the paged cache (kiln_forward_attend) */
    int n_seq, seq;
    const kiln_fwd_batch *gen;
    const kiln_taps *taps; /* hidden-state taps (arch.h), or NULL */
    const kiln_layer_hook *hook; /* training: the layer events (arch.h), or NULL */
} g3_run;

static float g3_scale(const kiln_model_config *c) {
    const double qpas = c->query_pre_attn_scalar > 0.0f ? (double)c->query_pre_attn_scalar : (double)c->head_dim;
    return (float)(1.0 / sqrt(qpas));
}

static void gemma3_layers(const g3_run *R) {
    const kiln_model_config *c = R->cfg;
    kiln_backend *be = R->be;
    const kiln_backend_i *op = be->i;
    const int C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff, T = R->T;
    const size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    const float eps = c->rms_eps, scale = g3_scale(c);

    op->embed(be, R->acts[0].x, R->embed, R->ids, T);
    op->scale(be, R->acts[0].x, (float)sqrt((double)C), (size_t)T * C); /* hidden_size**0.5 in f32 */
    for (int l = 0; l < c->n_layer; l++) {
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_BEGIN);
        const kiln_wref *lw = R->layer_refs + (size_t)l * G3_N_LAYER;
#define W(role) (&lw[(role) - G3_WQ])
        g3_acts *a = &R->acts[R->per_layer ? l : 0];
        float *x_next = !R->per_layer ? a->x : l + 1 < c->n_layer ? R->acts[l + 1].x : R->x_final;
        const int slides = kiln_layer_slides(c, l), window = slides ? c->sliding_window : 0;
        const float *cs = slides && R->rope_cos_local ? R->rope_cos_local : R->rope_cos;
        const float *sn = slides && R->rope_sin_local ? R->rope_sin_local : R->rope_sin;

        /* attention block: x_mid = x + norm(attention(...) Wo^T) */
        op->rmsnorm(be, a->xb1, a->x, W(G3_IN_NORM)->vec, T, C, eps);
        op->matmul(be, a->qr, a->xb1, W(G3_WQ)->mat, NULL, T);
        op->matmul(be, a->kr, a->xb1, W(G3_WK)->mat, NULL, T);
        op->matmul(be, a->v, a->xb1, W(G3_WV)->mat, NULL, T);
        op->rmsnorm(be, a->q, a->qr, W(G3_QNORM)->vec, T * NH, HS, eps);
        op->rmsnorm(be, a->k, a->kr, W(G3_KNORM)->vec, T * KVH, HS, eps);
        op->rope(be, a->q, R->pos, T, NH, HS, cs, sn);
        op->rope(be, a->k, R->pos, T, KVH, HS, cs, sn);
        if (R->gen) {
            kiln_forward_attend(R->gen, be, l, a->att, a->q, a->k, a->v, NH, KVH, HS, scale, window);
        } else {
            for (int b = 0; b < R->n_seq; b++) {
                const size_t r = (size_t)b * R->seq;
                op->attention(be, a->att + r * QD, a->q + r * QD, a->k + r * KD, a->v + r * KD, R->seq, 0, NH,
                              KVH, HS, scale, window);
            }
        }
        op->matmul(be, a->o, a->att, W(G3_WO)->mat, NULL, T);
        op->rmsnorm(be, a->x_mid, a->o, W(G3_POST_ATTN_NORM)->vec, T, C, eps);
        op->add(be, a->x_mid, a->x, (size_t)T * C); /* norm(o) + x: the bits of x + norm(o) */

        /* MLP block: x_next = x_mid + norm(geglu(gate, up) Wd^T) */
        op->rmsnorm(be, a->xb2, a->x_mid, W(G3_PRE_FF_NORM)->vec, T, C, eps);
        op->matmul(be, a->gate, a->xb2, W(G3_GATE)->mat, NULL, T);
        op->matmul(be, a->up, a->xb2, W(G3_UP)->mat, NULL, T);
        op->geglu(be, a->hb, a->gate, a->up, (size_t)T * FF);
        op->matmul(be, a->d, a->hb, W(G3_DOWN)->mat, NULL, T);
        op->rmsnorm(be, x_next, a->d, W(G3_POST_FF_NORM)->vec, T, C, eps);
        op->add(be, x_next, a->x_mid, (size_t)T * C);
        kiln_tap_out(be, R->taps, l, x_next, (size_t)T * C);
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_END);
#undef W
    }
}

/* arch.h's forward: N tokens staged in fs->d_batch through gemma3_layers in the forward
 * state's scratch (q and k normed and rotated in place; the o product and its norm in tmp,
 * which then holds x_mid; the down product in xb, free by then), then the final norm and the
 * head on the wanted rows. */
static void gemma3_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                           const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                           float *logits) {
    const kiln_fwd_batch g = kiln_fwd_batch_of(fs, N, runs, n_runs, max_T);
    g3_acts a = {0};
    a.x = fs->x;
    a.xb1 = a.xb2 = a.d = fs->xb;
    a.qr = a.q = fs->q;
    a.kr = a.k = fs->k_new;
    a.v = fs->v_new;
    a.att = fs->att;
    a.o = a.x_mid = fs->tmp;
    a.gate = a.hb = fs->hb;
    a.up = fs->hb2;
    g3_run R = {0};
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
    R.rope_cos_local = fs->rope_cos_local;
    R.rope_sin_local = fs->rope_sin_local;
    R.gen = &g;
    R.taps = fs->taps;
    gemma3_layers(&R);
    kiln_forward_logits(m, be, fs, N, out, n_out, logits);
}

/* ---- training ------------------------------------------------------------------------------ */

/* The training state (kiln_train_io.priv). The trainer's parameter of a norm is transformers'
 * w; the forward multiplies by 1 + w, which each training forward computes (kiln_norm_mult:
 * nm's refs and layer_refs bind the multipliers, the gradients stay the parameters'). */
typedef struct g3_train {
    g3_acts *acts;               /* (L) */
    float *x_final;              /* (T,C) */
    kiln_norm_mult nm;
    float *dd, *dxb, *datt, *dq, *dk, *dv, *dqr, *dkr, *dgate, *dup, *dhb, *rstd, *ws; /* backward scratch */
    float *rope_cos, *rope_sin, *rope_cos_local, *rope_sin_local; /* (max_seq, HS/2) */
    void *block;
} g3_train;

static void gemma3_train_free(kiln_train_io *io) {
    g3_train *t = io ? io->priv : NULL;
    if (!t) return;
    if (t->block) kiln_backend_free_buf(io->be, t->block);
    kiln_norm_mult_free(&t->nm);
    kiln_free(t->acts);
    kiln_free(t);
    io->priv = NULL;
}

/* The rope tables of both layer kinds for max_seq positions, filled on the host (in place on a
 * host-memory backend, else staged and uploaded). */
static kiln_status g3_upload_tables(kiln_train_io *io, g3_train *t, int S, int HS) {
    float *dst[4] = {t->rope_cos, t->rope_sin, t->rope_cos_local, t->rope_sin_local};
    if (io->be->i->host_memory) {
        kiln_rope_tables_fill(io->model, S, dst[0], dst[1]);
        kiln_rope_tables_fill_kind(io->model, S, 1, dst[2], dst[3]);
        return KILN_OK;
    }
    const size_t tab = (size_t)S * HS / 2;
    float *host = kiln_malloc((tab ? tab : 1) * 4 * sizeof(float));
    if (!host) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the rope tables");
    kiln_rope_tables_fill(io->model, S, host, host + tab);
    kiln_rope_tables_fill_kind(io->model, S, 1, host + 2 * tab, host + 3 * tab);
    kiln_status st = KILN_OK;
    for (int i = 0; i < 4 && st == KILN_OK; i++)
        st = kiln_backend_upload(io->be, dst[i], host + (size_t)i * tab, tab * sizeof(float));
    kiln_free(host);
    return st;
}

/* Every activation of a step of max_batch sequences of max_seq tokens, the multipliers and the
 * backward's scratch, from one block of backend memory. */
static kiln_status gemma3_train_init(kiln_train_io *io) {
    const kiln_model_config *c = &io->model->cfg;
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    if (!op->geglu || !op->geglu_backward)
        return kiln_error(KILN_ERR_UNSUPPORTED, "trainer: gemma3 needs the backend's geglu and geglu_backward ops");
    g3_train *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    io->priv = t;
    const int L = c->n_layer;
    const size_t S = (size_t)io->max_seq, T = S * (size_t)io->max_batch, C = (size_t)c->n_embd, FF = (size_t)c->n_ff;
    const size_t HS = (size_t)c->head_dim, QD = (size_t)c->n_head * HS, KD = (size_t)c->n_head_kv * HS;
    t->acts = kiln_calloc((size_t)L, sizeof *t->acts);
    if (!t->acts) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    const size_t n_mult = kiln_norm_mult_floats(io);
    float *mult = NULL, *ones = NULL;
    enum { PER_LAYER = 15, N_OTHER = 25 };
    const size_t nrows = T * (size_t)c->n_head > T ? T * (size_t)c->n_head : T;
    const size_t ws = kiln_attention_backward_ws_floats((int)S, 0, c->n_head, c->n_head_kv, (int)HS);
    const size_t n = (size_t)L * PER_LAYER + N_OTHER;
    float ***slots = kiln_calloc(n, sizeof *slots);
    size_t *sizes = kiln_calloc(n, sizeof *sizes);
    if (!slots || !sizes) {
        kiln_free(slots);
        kiln_free(sizes);
        return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    }
    size_t k = 0;
    for (int l = 0; l < L; l++) {
        g3_acts *a = &t->acts[l];
        float **ps[PER_LAYER] = {&a->x, &a->xb1,   &a->qr,  &a->kr,   &a->q,  &a->k,  &a->v, &a->att,
                                 &a->o, &a->x_mid, &a->xb2, &a->gate, &a->up, &a->hb, &a->d};
        const size_t ss[PER_LAYER] = {T * C, T * C, T * QD, T * KD, T * QD, T * KD, T * KD, T * QD,
                                      T * C, T * C, T * C,  T * FF, T * FF, T * FF, T * C};
        for (int i = 0; i < PER_LAYER; i++) slots[k] = ps[i], sizes[k++] = ss[i];
    }
    /* ids, pos: int32 in float-sized slots */
    float **po[N_OTHER] = {&t->x_final, &io->xn,  &io->dx,    &io->dxn,  &t->dd,   &t->dxb,  &t->datt,
                           &t->dq,      &t->dk,   &t->dv,     &t->dqr,   &t->dkr,  &t->dgate, &t->dup,
                           &t->dhb,     &t->rstd, &t->ws,     &mult,     &ones,    (float **)&io->ids,
                           (float **)&io->pos, &t->rope_cos, &t->rope_sin, &t->rope_cos_local, &t->rope_sin_local};
    const size_t so[N_OTHER] = {T * C,  T * C,  T * C,  T * C,  T * C,  T * C,     T * QD,    T * QD,     T * KD,
                                T * KD, T * QD, T * KD, T * FF, T * FF, T * FF,    nrows,     ws,         n_mult,
                                n_mult, T,      T,      S * HS / 2, S * HS / 2, S * HS / 2, S * HS / 2};
    for (int i = 0; i < N_OTHER; i++) slots[k] = po[i], sizes[k++] = so[i];
    kiln_status st = kiln_backend_alloc_carved(be, (int)k, (float **const *)slots, sizes, &t->block, &io->bytes,
                                               "trainer", "activations");
    kiln_free(slots);
    kiln_free(sizes);
    KILN_TRY(st);

    KILN_TRY(kiln_norm_mult_bind(&t->nm, io, mult, ones));
    return g3_upload_tables(io, t, (int)S, (int)HS);
}

static void gemma3_train_forward(kiln_train_io *io, int n_seq, int seq) {
    g3_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    kiln_norm_mult_update(&t->nm, io);
    g3_run R = {0};
    R.be = io->be;
    R.cfg = c;
    R.embed = io->refs[G3_EMBED].mat;
    R.layer_refs = t->nm.layer_refs;
    R.ids = io->ids;
    R.pos = io->pos;
    R.T = n_seq * seq;
    R.acts = t->acts;
    R.per_layer = 1;
    R.x_final = t->x_final;
    R.rope_cos = t->rope_cos;
    R.rope_sin = t->rope_sin;
    R.rope_cos_local = t->rope_cos_local;
    R.rope_sin_local = t->rope_sin_local;
    R.n_seq = n_seq;
    R.seq = seq;
    R.taps = io->taps;
    R.hook = io->hook;
    gemma3_layers(&R);
    io->be->i->rmsnorm(io->be, io->xn, t->x_final, t->nm.refs[G3_NORM].vec, R.T, c->n_embd, c->rms_eps);
}

/* From d loss / d xn (io->dxn) to d loss / d embedding rows (io->dx), every gradient added. */
static void gemma3_train_backward(kiln_train_io *io, int n_seq, int seq) {
    g3_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    const int T = n_seq * seq, C = c->n_embd, HS = c->head_dim, NH = c->n_head, KVH = c->n_head_kv, FF = c->n_ff;
    const size_t QD = (size_t)NH * HS, KD = (size_t)KVH * HS;
    const float eps = c->rms_eps, scale = g3_scale(c);
    const kiln_wref *fn = &t->nm.refs[G3_NORM];
    op->rmsnorm_backward(be, io->dx, fn->grad, io->dxn, t->x_final, fn->vec, T, C, eps, t->rstd, false);
    for (int l = c->n_layer - 1; l >= 0; l--) {
        const kiln_wref *lw = t->nm.layer_refs + (size_t)l * G3_N_LAYER;
#define W(role) (&lw[(role) - G3_WQ])
        const g3_acts *a = &t->acts[l];
        const int slides = kiln_layer_slides(c, l), window = slides ? c->sliding_window : 0;
        const float *cs = slides ? t->rope_cos_local : t->rope_cos, *sn = slides ? t->rope_sin_local : t->rope_sin;
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_BEGIN);
        kiln_tap_grad(be, io->taps, l, io->dx, (size_t)T * C); /* d loss / d this layer's output, more */
        /* MLP: x_next = x_mid + norm(d), d = geglu(gate, up) Wd^T */
        op->rmsnorm_backward(be, t->dd, W(G3_POST_FF_NORM)->grad, io->dx, a->d, W(G3_POST_FF_NORM)->vec, T, C, eps,
                             t->rstd, false);
        op->matmul_backward(be, t->dhb, W(G3_DOWN)->grad, NULL, t->dd, a->hb, W(G3_DOWN)->mat, T, false);
        op->geglu_backward(be, t->dgate, t->dup, t->dhb, a->gate, a->up, (size_t)T * FF);
        const kiln_wref *gu[2] = {W(G3_GATE), W(G3_UP)};
        float *dgu[2] = {t->dgate, t->dup};
        kiln_products_backward(be, 2, t->dxb, dgu, a->xb2, gu, T);
        op->rmsnorm_backward(be, io->dx, W(G3_PRE_FF_NORM)->grad, t->dxb, a->x_mid, W(G3_PRE_FF_NORM)->vec, T, C,
                             eps, t->rstd, true);
        /* attention: x_mid = x + norm(o), o = attention(rope(norm(q)), rope(norm(k)), v) Wo^T */
        op->rmsnorm_backward(be, t->dd, W(G3_POST_ATTN_NORM)->grad, io->dx, a->o, W(G3_POST_ATTN_NORM)->vec, T, C,
                             eps, t->rstd, false);
        op->matmul_backward(be, t->datt, W(G3_WO)->grad, NULL, t->dd, a->att, W(G3_WO)->mat, T, false);
        for (int b = 0; b < n_seq; b++) { /* per sequence; ws is reused in stream order */
            const size_t r = (size_t)b * seq;
            op->attention_backward(be, t->dq + r * QD, t->dk + r * KD, t->dv + r * KD, t->datt + r * QD,
                                   a->q + r * QD, a->k + r * KD, a->v + r * KD, a->att + r * QD, t->ws, seq, 0, NH,
                                   KVH, HS, scale, window);
        }
        op->rope_backward(be, t->dq, io->pos, T, NH, HS, cs, sn);
        op->rope_backward(be, t->dk, io->pos, T, KVH, HS, cs, sn);
        op->rmsnorm_backward(be, t->dqr, W(G3_QNORM)->grad, t->dq, a->qr, W(G3_QNORM)->vec, T * NH, HS, eps, t->rstd,
                             false);
        op->rmsnorm_backward(be, t->dkr, W(G3_KNORM)->grad, t->dk, a->kr, W(G3_KNORM)->vec, T * KVH, HS, eps,
                             t->rstd, false);
        const kiln_wref *qkv[3] = {W(G3_WQ), W(G3_WK), W(G3_WV)};
        float *dqkv[3] = {t->dqr, t->dkr, t->dv};
        kiln_products_backward(be, 3, t->dxb, dqkv, a->xb1, qkv, T);
        op->rmsnorm_backward(be, io->dx, W(G3_IN_NORM)->grad, t->dxb, a->x, W(G3_IN_NORM)->vec, T, C, eps, t->rstd,
                             true);
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_END);
#undef W
    }
    /* x = embed * sqrt(C): the embedding rows' gradient is dx * sqrt(C) (the embedding's
     * backward follows in the trainer) */
    op->scale(be, io->dx, (float)sqrt((double)C), (size_t)T * C);
}

const kiln_arch_desc kiln_arch_gemma3 = {
    .id = KILN_ARCH_GEMMA3,
    .name = "gemma3",
    .hf_model_type = "gemma3_text",
    .hf_class = "Gemma3ForCausalLM",
    .always_qk_norm = true,
    .roles = gemma3_roles,
    .n_roles = G3_N,
    .first_layer_role = G3_WQ,
    .n_layer_roles = G3_N_LAYER,
    .role_embed = G3_EMBED,
    .role_final_norm = G3_NORM,
    .role_head = G3_HEAD,
    .forward = gemma3_forward,
    .gguf_config = gemma3_gguf_config,
    .uses_geglu = true,
    .sliding_windows = true,
    .train_init = gemma3_train_init,
    .train_forward = gemma3_train_forward,
    .train_backward = gemma3_train_backward,
    .train_free = gemma3_train_free,
};
