/*
 * qwen35.c -- Qwen3.5 text models (Qwen3_5ForCausalLM, and the text model of the released
 * multimodal folders): the parameter roles and the one forward, as transformers computes it
 * (docs/models/qwen35-notes.md), with the backward beside it.
 *
 *   x = embed(ids)
 *   for each layer (linear attention, or every full_attention_interval-th: gated attention):
 *       h = rmsnorm(x) (1 + w_in)
 *       linear:  m = h Wqkv^T ; u = silu(causal_conv(m))              (q | k | v, contiguous)
 *                g = -exp(A_log) softplus(h Wa^T + dt_bias) ; beta = sigmoid(h Wb^T)
 *                o = gated_delta(u, g, beta)                       (the recurrent state S)
 *                a = (w_gn rmsnorm_per_head(o)) silu(h Wz^T) Wout^T
 *       full:    q | gate = h Wq^T (per head) ; k, v = h Wk^T, h Wv^T
 *                q, k = rmsnorm_per_head (1 + w_q), (1 + w_k) ; rope on their first rotary_dim dims
 *                a = (attention(q, K, V) * sigmoid(gate)) Wo^T
 *       x = x + a
 *       h = rmsnorm(x) (1 + w_post) ; x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
 *   logits = rmsnorm(x) (1 + w_final) E^T                         (tied in the small models)
 *
 * Generation keeps, per sequence and linear layer, the convolution's last inputs and the state
 * S in the forward state's seq_state (arch.h state_floats), and a KV cache for the full layers
 * only. Training runs the same forward (q35_layers) with each layer's activations saved; the
 * norms' multipliers 1 + w are recomputed from the trainer's w each step (kiln_plus_one).
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum q35_role {
    Q_EMBED, /* per model */
    /* per layer: a linear-attention layer's */
    Q_DT_BIAS, Q_A_LOG, Q_CONV, Q_GNORM, Q_OUT, Q_QKV, Q_Z, Q_B, Q_A,
    /* a full-attention layer's */
    Q_WQ, Q_WK, Q_WV, Q_WO, Q_QNORM, Q_KNORM,
    /* every layer's */
    Q_GATE, Q_UP, Q_DOWN, Q_IN_NORM, Q_POST_NORM,
    Q_NORM, Q_HEAD, /* per model */
    Q_N
};
#define Q_FIRST Q_DT_BIAS
#define Q_N_LAYER (Q_POST_NORM - Q_FIRST + 1)

#define HF_L "model.layers.%d."
#define GG_L "blk.%d."
#define LIN_MAT(rows, cols) rows, cols, KILN_COND_LINEAR, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false, false
#define LIN_VEC(rows, init) rows, KILN_DIM_ONE, KILN_COND_LINEAR, init, true, true, KILN_DIM_ONE, false, false
#define FULL_MAT(rows, cols) rows, cols, KILN_COND_FULL, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false, false
#define MAT(rows, cols) rows, cols, KILN_COND_ALWAYS, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false, false
/* a zero-centred norm: the forward multiplies by 1 + w (starts at 1: w = 0) */
#define NORM(rows, cond) rows, KILN_DIM_ONE, cond, KILN_INIT_ONES, true, true, KILN_DIM_ONE, true, false
static const kiln_param_role q35_roles[Q_N] = {
    /* hf name, gguf name, rows, cols, condition, init, per layer, trainable, gguf rope heads,
     * plus_one, conv_taps */
    [Q_EMBED] = {"model.embed_tokens.weight", "token_embd.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_ALWAYS,
                 KILN_INIT_NORMAL, false, true, KILN_DIM_ONE, false, false},
    [Q_DT_BIAS] = {HF_L "linear_attn.dt_bias", GG_L "ssm_dt.bias", LIN_VEC(KILN_DIM_LNV, KILN_INIT_ONES)},
    [Q_A_LOG] = {HF_L "linear_attn.A_log", GG_L "ssm_a", LIN_VEC(KILN_DIM_LNV, KILN_INIT_ZEROS)},
    [Q_CONV] = {HF_L "linear_attn.conv1d.weight", GG_L "ssm_conv1d.weight", KILN_DIM_LCONV, KILN_DIM_LCK,
                KILN_COND_LINEAR, KILN_INIT_NORMAL, true, true, KILN_DIM_ONE, false, true},
    [Q_GNORM] = {HF_L "linear_attn.norm.weight", GG_L "ssm_norm.weight", LIN_VEC(KILN_DIM_LDV, KILN_INIT_ONES)},
    [Q_OUT] = {HF_L "linear_attn.out_proj.weight", GG_L "ssm_out.weight", LIN_MAT(KILN_DIM_C, KILN_DIM_LVD)},
    [Q_QKV] = {HF_L "linear_attn.in_proj_qkv.weight", GG_L "attn_qkv.weight", LIN_MAT(KILN_DIM_LCONV, KILN_DIM_C)},
    [Q_Z] = {HF_L "linear_attn.in_proj_z.weight", GG_L "attn_gate.weight", LIN_MAT(KILN_DIM_LVD, KILN_DIM_C)},
    [Q_B] = {HF_L "linear_attn.in_proj_b.weight", GG_L "ssm_beta.weight", LIN_MAT(KILN_DIM_LNV, KILN_DIM_C)},
    [Q_A] = {HF_L "linear_attn.in_proj_a.weight", GG_L "ssm_alpha.weight", LIN_MAT(KILN_DIM_LNV, KILN_DIM_C)},
    [Q_WQ] = {HF_L "self_attn.q_proj.weight", GG_L "attn_q.weight", FULL_MAT(KILN_DIM_QD2, KILN_DIM_C)},
    [Q_WK] = {HF_L "self_attn.k_proj.weight", GG_L "attn_k.weight", FULL_MAT(KILN_DIM_KD, KILN_DIM_C)},
    [Q_WV] = {HF_L "self_attn.v_proj.weight", GG_L "attn_v.weight", FULL_MAT(KILN_DIM_KD, KILN_DIM_C)},
    [Q_WO] = {HF_L "self_attn.o_proj.weight", GG_L "attn_output.weight", FULL_MAT(KILN_DIM_C, KILN_DIM_QD)},
    [Q_QNORM] = {HF_L "self_attn.q_norm.weight", GG_L "attn_q_norm.weight", NORM(KILN_DIM_HS, KILN_COND_FULL)},
    [Q_KNORM] = {HF_L "self_attn.k_norm.weight", GG_L "attn_k_norm.weight", NORM(KILN_DIM_HS, KILN_COND_FULL)},
    [Q_GATE] = {HF_L "mlp.gate_proj.weight", GG_L "ffn_gate.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [Q_UP] = {HF_L "mlp.up_proj.weight", GG_L "ffn_up.weight", MAT(KILN_DIM_FF, KILN_DIM_C)},
    [Q_DOWN] = {HF_L "mlp.down_proj.weight", GG_L "ffn_down.weight", MAT(KILN_DIM_C, KILN_DIM_FF)},
    [Q_IN_NORM] = {HF_L "input_layernorm.weight", GG_L "attn_norm.weight", NORM(KILN_DIM_C, KILN_COND_ALWAYS)},
    [Q_POST_NORM] = {HF_L "post_attention_layernorm.weight", GG_L "post_attention_norm.weight",
                     NORM(KILN_DIM_C, KILN_COND_ALWAYS)},
    [Q_NORM] = {"model.norm.weight", "output_norm.weight", KILN_DIM_C, KILN_DIM_ONE, KILN_COND_ALWAYS, KILN_INIT_ONES,
                false, true, KILN_DIM_ONE, true, false},
    [Q_HEAD] = {"lm_head.weight", "output.weight", KILN_DIM_V, KILN_DIM_C, KILN_COND_UNTIED, KILN_INIT_NORMAL, false,
                true, KILN_DIM_ONE, false, false},
};
#undef HF_L
#undef GG_L
#undef LIN_MAT
#undef LIN_VEC
#undef FULL_MAT
#undef MAT
#undef NORM

static kiln_status q35_gguf_config(const kiln_gguf *g, const char *path, kiln_model_config *c) {
    (void)g;
    (void)c;
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: Qwen3.5 GGUF files are not supported yet (use the Hugging Face folder)",
                      path);
}

/* ---- widths ------------------------------------------------------------------------------ */

typedef struct q35_dims {
    int C, HS, NH, KVH, FF, R;     /* R: rotary dims */
    int nk, nv, dk, dv, K;
    size_t QD, KD, CONV, VD;
} q35_dims;

static q35_dims q35_dims_of(const kiln_model_config *c) {
    q35_dims d;
    d.C = c->n_embd, d.HS = c->head_dim, d.NH = c->n_head, d.KVH = c->n_head_kv, d.FF = c->n_ff;
    d.R = kiln_rotary_dim(c);
    d.nk = c->lin_nk, d.nv = c->lin_nv, d.dk = c->lin_dk, d.dv = c->lin_dv, d.K = c->lin_conv;
    d.QD = (size_t)d.NH * d.HS, d.KD = (size_t)d.KVH * d.HS;
    d.VD = (size_t)d.nv * d.dv;
    d.CONV = 2 * (size_t)d.nk * d.dk + d.VD;
    return d;
}

/* Generation's scratch per token: m, u (CONV), z, o (VD), a, b, g, beta (nv), q | gate (2 QD),
 * gate (QD). */
static size_t q35_scratch_floats(const kiln_model_config *c) {
    const q35_dims d = q35_dims_of(c);
    return 2 * d.CONV + 2 * d.VD + 4 * (size_t)d.nv + 3 * d.QD;
}

/* A sequence's state: per linear layer, the convolution's last K - 1 inputs (K - 1, CONV) and
 * S (nv, dk, dv). */
static size_t q35_layer_state(const q35_dims *d) {
    return (size_t)(d->K - 1) * d->CONV + (size_t)d->nv * d->dk * d->dv;
}
static size_t q35_state_floats(const kiln_model_config *c) {
    const q35_dims d = q35_dims_of(c);
    size_t n = 0;
    for (int l = 0; l < c->n_layer; l++) n += kiln_layer_linear(c, l) ? q35_layer_state(&d) : 0;
    return n;
}

/* ---- the forward ------------------------------------------------------------------------- */

/* Where one layer's intermediates go (each (T, width)): one set every layer reuses
 * (generation) or each layer's own (training). A layer uses the linear or the full set. */
typedef struct q35_acts {
    float *x;                        /* (T,C) the layer's input */
    float *xb1;                      /* (T,C) the input norm's output */
    /* linear */
    float *m, *u;                    /* (T,CONV) in_proj_qkv's output, the convolution's */
    float *z, *o, *on;               /* (T,VD) in_proj_z's; the recurrence's; o normed per head */
    float *y;                        /* (T,VD) on * silu(z), out_proj's input */
    float *pa, *pb, *g, *beta;       /* (T,nv) in_proj_a's, in_proj_b's; the gates */
    /* full */
    float *qg;                       /* (T,2QD) q_proj's output: per head query | gate */
    float *qr, *gate, *kr;           /* (T,QD), (T,QD), (T,KD) */
    float *q, *k, *v;                /* q, k normed and rotated; v */
    float *att, *attg;               /* (T,QD) attention's output; times sigmoid(gate) */
    /* both */
    float *x_mid;                    /* (T,C) x + the mixer's output */
    float *xb2;                      /* (T,C) the post-attention norm's output */
    float *fg, *fu, *hb;             /* (T,FF) gate, up, silu(gate) * up */
} q35_acts;

typedef struct q35_run {
    kiln_backend *be;
    const kiln_model_config *cfg;
    const kiln_tensor *embed;
    const kiln_wref *layer_refs;     /* (L, Q_N_LAYER), norms' vec the multipliers 1 + w */
    const int32_t *ids, *pos;        /* (T) backend memory */
    int T;
    q35_acts *acts;                  /* per_layer: acts[l]; else acts[0] for every layer */
    int per_layer;
    float *x_final;                  /* per_layer: the last layer's output */
    const float *rope_cos, *rope_sin;
    /* training: n_seq sequences of seq rows, runs of them (host); generation: gen */
    int n_seq, seq;
    const kiln_batch_run *train_runs;
    const kiln_fwd_batch *gen;
    const kiln_taps *taps; /* hidden-state taps (arch.h), or NULL */
    const kiln_layer_hook *hook; /* training: the layer events (arch.h), or NULL */
} q35_run;

static void q35_layers(const q35_run *R) {
    const kiln_model_config *c = R->cfg;
    const q35_dims d = q35_dims_of(c);
    kiln_backend *be = R->be;
    const kiln_backend_i *op = be->i;
    const int T = R->T;
    const float eps = c->rms_eps, scale = (float)(1.0 / sqrt((double)d.HS));
    const float lin_scale = (float)(1.0 / sqrt((double)d.dk)); /* transformers' 1 / dk**0.5 */
    /* generation: the states of the linear layers one after another, each layer's as the ops
     * take it: conv (n_seq, K-1, CONV), then S (n_seq, nv, dk, dv) */
    float *state = R->gen ? R->gen->fs->seq_state : NULL;
    const size_t n_seq_state = R->gen ? (size_t)R->gen->fs->n_seq : 0;

    op->embed(be, R->acts[0].x, R->embed, R->ids, T);
    for (int l = 0; l < c->n_layer; l++) {
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_BEGIN);
        const kiln_wref *lw = R->layer_refs + (size_t)l * Q_N_LAYER;
#define W(role) (&lw[(role) - Q_FIRST])
        q35_acts *a = &R->acts[R->per_layer ? l : 0];
        float *x_next = !R->per_layer ? a->x : l + 1 < c->n_layer ? R->acts[l + 1].x : R->x_final;
        op->rmsnorm(be, a->xb1, a->x, W(Q_IN_NORM)->vec, T, d.C, eps);
        if (kiln_layer_linear(c, l)) {
            op->matmul(be, a->m, a->xb1, W(Q_QKV)->mat, NULL, T);
            op->matmul(be, a->z, a->xb1, W(Q_Z)->mat, NULL, T);
            op->matmul(be, a->pb, a->xb1, W(Q_B)->mat, NULL, T);
            op->matmul(be, a->pa, a->xb1, W(Q_A)->mat, NULL, T);
            const kiln_batch_run *runs = R->gen ? R->gen->runs : R->train_runs;
            const int n_runs = R->gen ? R->gen->n_runs : R->n_seq;
            const int32_t *sq = R->gen ? R->gen->seq : NULL, *ps = R->gen ? R->gen->pos : NULL;
            float *cst = state, *sst = state ? state + n_seq_state * (size_t)(d.K - 1) * d.CONV : NULL;
            op->conv1d_silu(be, a->u, a->m, W(Q_CONV)->vec, cst, sq, ps, runs, n_runs, T, (int)d.CONV, d.K);
            op->gdn_gates(be, a->g, a->beta, a->pa, a->pb, W(Q_A_LOG)->vec, W(Q_DT_BIAS)->vec, T, d.nv);
            op->gated_delta(be, a->o, a->u, a->g, a->beta, sst, sq, ps, runs, n_runs, T, d.nk, d.nv, d.dk, d.dv,
                            lin_scale);
            op->rmsnorm(be, a->on, a->o, W(Q_GNORM)->vec, T * d.nv, d.dv, eps);
            op->swiglu(be, a->y, a->z, a->on, (size_t)T * d.VD);
            op->matmul(be, a->x_mid, a->y, W(Q_OUT)->mat, NULL, T);
            if (state) state += n_seq_state * q35_layer_state(&d);
        } else {
            op->matmul(be, a->qg, a->xb1, W(Q_WQ)->mat, NULL, T);
            op->matmul(be, a->kr, a->xb1, W(Q_WK)->mat, NULL, T);
            op->matmul(be, a->v, a->xb1, W(Q_WV)->mat, NULL, T);
            op->split_halves(be, a->qr, a->gate, a->qg, (int64_t)T * d.NH, d.HS);
            op->rmsnorm(be, a->q, a->qr, W(Q_QNORM)->vec, T * d.NH, d.HS, eps);
            op->rmsnorm(be, a->k, a->kr, W(Q_KNORM)->vec, T * d.KVH, d.HS, eps);
            op->rope_partial(be, a->q, R->pos, T, d.NH, d.HS, d.R, R->rope_cos, R->rope_sin);
            op->rope_partial(be, a->k, R->pos, T, d.KVH, d.HS, d.R, R->rope_cos, R->rope_sin);
            if (R->gen) {
                kiln_forward_attend(R->gen, be, l, a->att, a->q, a->k, a->v, d.NH, d.KVH, d.HS, scale, 0);
            } else if (op->attention_seqs) {
                op->attention_seqs(be, a->att, NULL, NULL, NULL, NULL, NULL, NULL, a->q, a->k, a->v, R->n_seq,
                                   R->seq, d.NH, d.KVH, d.HS, scale);
            } else {
                for (int b = 0; b < R->n_seq; b++) {
                    const size_t r = (size_t)b * R->seq;
                    op->attention(be, a->att + r * d.QD, a->q + r * d.QD, a->k + r * d.KD, a->v + r * d.KD, R->seq,
                                  0, d.NH, d.KVH, d.HS, scale, 0);
                }
            }
            op->sigmoid_mul(be, a->attg, a->att, a->gate, (size_t)T * d.QD);
            op->matmul(be, a->x_mid, a->attg, W(Q_WO)->mat, NULL, T);
        }
        /* x_mid = x + the mixer's output: its output + x (IEEE addition commutes) */
        op->add(be, a->x_mid, a->x, (size_t)T * d.C);
        op->rmsnorm(be, a->xb2, a->x_mid, W(Q_POST_NORM)->vec, T, d.C, eps);
        op->matmul(be, a->fg, a->xb2, W(Q_GATE)->mat, NULL, T);
        op->matmul(be, a->fu, a->xb2, W(Q_UP)->mat, NULL, T);
        op->swiglu(be, a->hb, a->fg, a->fu, (size_t)T * d.FF);
        op->matmul(be, x_next, a->hb, W(Q_DOWN)->mat, NULL, T);
        op->add(be, x_next, a->x_mid, (size_t)T * d.C);
        kiln_tap_out(be, R->taps, l, x_next, (size_t)T * d.C);
        kiln_layer_event_at(R->hook, l, KILN_LAYER_FORWARD_END);
#undef W
    }
}

/* arch.h's forward: N tokens staged in fs->d_batch through q35_layers in the forward state's
 * scratch (in place where the ops allow), then the final norm and the head. */
static void q35_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                        const kiln_batch_run *runs, int n_runs, int max_T, const int32_t *out, int n_out,
                        float *logits) {
    const q35_dims d = q35_dims_of(&m->cfg);
    const kiln_fwd_batch g = kiln_fwd_batch_of(fs, N, runs, n_runs, max_T);
    const size_t NB = (size_t)fs->n_batch;
    float *sc = fs->arch_scratch;
    q35_acts a = {0};
    a.x = fs->x;
    a.xb1 = a.xb2 = fs->xb;
    a.m = sc, sc += NB * d.CONV;
    a.u = sc, sc += NB * d.CONV;
    a.z = a.y = sc, sc += NB * d.VD;
    a.o = a.on = sc, sc += NB * d.VD;
    a.pa = sc, sc += NB * d.nv;
    a.pb = sc, sc += NB * d.nv;
    a.g = sc, sc += NB * d.nv;
    a.beta = sc, sc += NB * d.nv;
    a.qg = sc, sc += NB * 2 * d.QD;
    a.gate = sc;
    a.qr = a.q = fs->q;
    a.kr = a.k = fs->k_new;
    a.v = fs->v_new;
    a.att = a.attg = fs->att;
    a.x_mid = fs->tmp;
    a.fg = a.hb = fs->hb;
    a.fu = fs->hb2;
    q35_run R = {0};
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
    R.gen = &g;
    R.taps = fs->taps;
    q35_layers(&R);
    kiln_forward_logits(m, be, fs, N, out, n_out, logits);
}

/* ---- training ------------------------------------------------------------------------------ */

/* The training state (kiln_train_io.priv): each layer's activations, the multipliers of the
 * zero-centred norms, the backward's scratch, the rope tables and the runs of a step. */
typedef struct q35_train {
    q35_acts *acts;       /* (L) */
    float *x_final;       /* (T,C) */
    kiln_norm_mult nm;
    kiln_batch_run *runs; /* (max_batch) host: sequence b is rows b*seq .. */
    float *dxb, *dhb, *dfu, *dy, *don, *dout_o, *du, *dm, *dg, *dbeta, *dpa, *dpb;
    float *dattg, *dgate, *dq, *dk, *dv, *dqr, *dkr, *dqg, *rstd, *ws;
    float *rope_cos, *rope_sin; /* (max_seq, R/2) */
    void *block;
} q35_train;

static void q35_train_free(kiln_train_io *io) {
    q35_train *t = io ? io->priv : NULL;
    if (!t) return;
    if (t->block) kiln_backend_free_buf(io->be, t->block);
    kiln_norm_mult_free(&t->nm);
    kiln_free(t->acts);
    kiln_free(t->runs);
    kiln_free(t);
    io->priv = NULL;
}

/* A list of regions to carve from one backend block. */
typedef struct q35_carve {
    float ***slots;
    size_t *sizes;
    int n, cap;
} q35_carve;

static void carve(q35_carve *c, float **slot, size_t floats) {
    if (c->n < c->cap) c->slots[c->n] = slot, c->sizes[c->n] = floats;
    c->n++;
}

/* Every activation of a step of max_batch sequences of max_seq tokens, the multipliers and the
 * backward's scratch, from one block of backend memory. */
static kiln_status q35_train_init(kiln_train_io *io) {
    const kiln_model_config *c = &io->model->cfg;
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    if (!op->gated_delta_backward || !op->conv1d_silu_backward || !op->gdn_gates_backward ||
        !op->sigmoid_mul_backward || !op->rope_partial_backward || !op->join_halves)
        return kiln_error(KILN_ERR_UNSUPPORTED, "trainer: qwen35 needs the %s backend's linear-attention ops",
                          op->name);
    q35_train *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    io->priv = t;
    const q35_dims d = q35_dims_of(c);
    const int L = c->n_layer;
    const size_t S = (size_t)io->max_seq, B = (size_t)io->max_batch, T = S * B, C = (size_t)d.C, FF = (size_t)d.FF;
    const size_t NV = (size_t)d.nv;
    t->acts = kiln_calloc((size_t)L, sizeof *t->acts);
    t->runs = kiln_calloc(B, sizeof *t->runs);
    q35_carve cv = {0};
    cv.cap = L * 20 + 40;
    cv.slots = kiln_calloc((size_t)cv.cap, sizeof *cv.slots);
    cv.sizes = kiln_calloc((size_t)cv.cap, sizeof *cv.sizes);
    if (!t->acts || !t->runs || !cv.slots || !cv.sizes) {
        kiln_free(cv.slots);
        kiln_free(cv.sizes);
        return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    }
    for (int l = 0; l < L; l++) {
        q35_acts *a = &t->acts[l];
        carve(&cv, &a->x, T * C);
        carve(&cv, &a->xb1, T * C);
        if (kiln_layer_linear(c, l)) {
            carve(&cv, &a->m, T * d.CONV);
            carve(&cv, &a->u, T * d.CONV);
            carve(&cv, &a->z, T * d.VD);
            carve(&cv, &a->o, T * d.VD);
            carve(&cv, &a->on, T * d.VD);
            carve(&cv, &a->y, T * d.VD);
            carve(&cv, &a->pa, T * NV);
            carve(&cv, &a->pb, T * NV);
            carve(&cv, &a->g, T * NV);
            carve(&cv, &a->beta, T * NV);
        } else {
            carve(&cv, &a->qg, T * 2 * d.QD);
            carve(&cv, &a->qr, T * d.QD);
            carve(&cv, &a->gate, T * d.QD);
            carve(&cv, &a->kr, T * d.KD);
            carve(&cv, &a->q, T * d.QD);
            carve(&cv, &a->k, T * d.KD);
            carve(&cv, &a->v, T * d.KD);
            carve(&cv, &a->att, T * d.QD);
            carve(&cv, &a->attg, T * d.QD);
        }
        carve(&cv, &a->x_mid, T * C);
        carve(&cv, &a->xb2, T * C);
        carve(&cv, &a->fg, T * FF);
        carve(&cv, &a->fu, T * FF);
        carve(&cv, &a->hb, T * FF);
    }
    const size_t nrows = T * (size_t)(d.NH > d.nv ? d.NH : d.nv);
    size_t ws = kiln_gated_delta_backward_ws_floats((int)B, (int)S, d.nk, d.nv, d.dk, d.dv);
    const size_t aws = kiln_attention_backward_seqs_ws_floats((int)B, (int)S, d.NH, d.KVH, d.HS);
    if (aws > ws) ws = aws;
    const size_t n_mult = kiln_norm_mult_floats(io);
    float *mult = NULL, *ones = NULL;
    carve(&cv, &t->x_final, T * C);
    carve(&cv, &io->xn, T * C);
    carve(&cv, &io->dx, T * C);
    carve(&cv, &io->dxn, T * C);
    carve(&cv, &t->dxb, T * C);
    carve(&cv, &t->dhb, T * FF);
    carve(&cv, &t->dfu, T * FF);
    carve(&cv, &t->dy, T * d.VD);
    carve(&cv, &t->don, T * d.VD);
    carve(&cv, &t->dout_o, T * d.VD);
    carve(&cv, &t->du, T * d.CONV);
    carve(&cv, &t->dm, T * d.CONV);
    carve(&cv, &t->dg, T * NV);
    carve(&cv, &t->dbeta, T * NV);
    carve(&cv, &t->dpa, T * NV);
    carve(&cv, &t->dpb, T * NV);
    carve(&cv, &t->dattg, T * d.QD);
    carve(&cv, &t->dgate, T * d.QD);
    carve(&cv, &t->dq, T * d.QD);
    carve(&cv, &t->dk, T * d.KD);
    carve(&cv, &t->dv, T * d.KD);
    carve(&cv, &t->dqr, T * d.QD);
    carve(&cv, &t->dkr, T * d.KD);
    carve(&cv, &t->dqg, T * 2 * d.QD);
    carve(&cv, &t->rstd, nrows);
    carve(&cv, &t->ws, ws);
    carve(&cv, &mult, n_mult);
    carve(&cv, &ones, n_mult);
    carve(&cv, (float **)&io->ids, T); /* int32 in float-sized slots */
    carve(&cv, (float **)&io->pos, T);
    carve(&cv, &t->rope_cos, S * (size_t)d.R / 2);
    carve(&cv, &t->rope_sin, S * (size_t)d.R / 2);
    kiln_status st = cv.n > cv.cap ? kiln_error(KILN_ERR_INTERNAL, "trainer: qwen35 carves %d regions of %d", cv.n, cv.cap)
                                   : kiln_backend_alloc_carved(be, cv.n, (float **const *)cv.slots, cv.sizes,
                                                               &t->block, &io->bytes, "trainer", "activations");
    kiln_free(cv.slots);
    kiln_free(cv.sizes);
    KILN_TRY(st);
    KILN_TRY(kiln_norm_mult_bind(&t->nm, io, mult, ones));
    /* the rope tables of max_seq positions */
    const size_t tab = S * (size_t)d.R / 2;
    if (be->i->host_memory) {
        kiln_rope_tables_fill(io->model, (int)S, t->rope_cos, t->rope_sin);
        return KILN_OK;
    }
    float *host = kiln_malloc((tab ? tab : 1) * 2 * sizeof(float));
    if (!host) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the rope tables");
    kiln_rope_tables_fill(io->model, (int)S, host, host + tab);
    st = kiln_backend_upload(be, t->rope_cos, host, tab * sizeof(float));
    if (st == KILN_OK) st = kiln_backend_upload(be, t->rope_sin, host + tab, tab * sizeof(float));
    kiln_free(host);
    return st;
}

static void q35_train_forward(kiln_train_io *io, int n_seq, int seq) {
    q35_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    kiln_norm_mult_update(&t->nm, io);
    for (int b = 0; b < n_seq; b++) t->runs[b] = (kiln_batch_run){b * seq, seq, b, 0};
    q35_run R = {0};
    R.be = io->be;
    R.cfg = c;
    R.embed = t->nm.refs[Q_EMBED].mat;
    R.layer_refs = t->nm.layer_refs;
    R.ids = io->ids;
    R.pos = io->pos;
    R.T = n_seq * seq;
    R.acts = t->acts;
    R.per_layer = 1;
    R.x_final = t->x_final;
    R.rope_cos = t->rope_cos;
    R.rope_sin = t->rope_sin;
    R.n_seq = n_seq;
    R.seq = seq;
    R.train_runs = t->runs;
    R.taps = io->taps;
    R.hook = io->hook;
    q35_layers(&R);
    io->be->i->rmsnorm(io->be, io->xn, t->x_final, t->nm.refs[Q_NORM].vec, R.T, c->n_embd, c->rms_eps);
}

/* From d loss / d xn (io->dxn) to d loss / d embedding rows (io->dx), every gradient added. */
static void q35_train_backward(kiln_train_io *io, int n_seq, int seq) {
    q35_train *t = io->priv;
    const kiln_model_config *c = &io->model->cfg;
    const q35_dims d = q35_dims_of(c);
    kiln_backend *be = io->be;
    const kiln_backend_i *op = be->i;
    const int T = n_seq * seq;
    const float eps = c->rms_eps, scale = (float)(1.0 / sqrt((double)d.HS));
    const float lin_scale = (float)(1.0 / sqrt((double)d.dk));
    const kiln_wref *fn = &t->nm.refs[Q_NORM];
    op->rmsnorm_backward(be, io->dx, fn->grad, io->dxn, t->x_final, fn->vec, T, d.C, eps, t->rstd, false);
    for (int l = c->n_layer - 1; l >= 0; l--) {
        const kiln_wref *lw = t->nm.layer_refs + (size_t)l * Q_N_LAYER;
#define W(role) (&lw[(role) - Q_FIRST])
        const q35_acts *a = &t->acts[l];
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_BEGIN);
        kiln_tap_grad(be, io->taps, l, io->dx, (size_t)T * d.C); /* d loss / d this layer's output, more */
        /* MLP: x_next = x_mid + (silu(fg) * fu) Wd^T */
        op->matmul_backward(be, t->dhb, W(Q_DOWN)->grad, NULL, io->dx, a->hb, W(Q_DOWN)->mat, T, false);
        op->swiglu_backward(be, t->dhb, t->dfu, t->dhb, a->fg, a->fu, (size_t)T * d.FF);
        const kiln_wref *gu[2] = {W(Q_GATE), W(Q_UP)};
        float *dgu[2] = {t->dhb, t->dfu};
        kiln_products_backward(be, 2, t->dxb, dgu, a->xb2, gu, T);
        op->rmsnorm_backward(be, io->dx, W(Q_POST_NORM)->grad, t->dxb, a->x_mid, W(Q_POST_NORM)->vec, T, d.C, eps,
                             t->rstd, true);
        /* the mixer: x_mid = x + mixer(xb1); io->dx is d x_mid */
        if (kiln_layer_linear(c, l)) {
            op->matmul_backward(be, t->dy, W(Q_OUT)->grad, NULL, io->dx, a->y, W(Q_OUT)->mat, T, false);
            op->swiglu_backward(be, t->dy, t->don, t->dy, a->z, a->on, (size_t)T * d.VD); /* dz in dy */
            op->rmsnorm_backward(be, t->dout_o, W(Q_GNORM)->grad, t->don, a->o, W(Q_GNORM)->vec, T * d.nv, d.dv, eps,
                                 t->rstd, false);
            op->gated_delta_backward(be, t->du, t->dg, t->dbeta, t->dout_o, a->u, a->g, a->beta, t->ws, n_seq, seq,
                                     d.nk, d.nv, d.dk, d.dv, lin_scale);
            op->gdn_gates_backward(be, t->dpa, t->dpb, W(Q_A_LOG)->grad, W(Q_DT_BIAS)->grad, t->dg, t->dbeta, a->pa,
                                   a->pb, W(Q_A_LOG)->vec, W(Q_DT_BIAS)->vec, T, d.nv);
            op->conv1d_silu_backward(be, t->dm, W(Q_CONV)->grad, t->du, a->m, W(Q_CONV)->vec, n_seq, seq,
                                     (int)d.CONV, d.K);
            const kiln_wref *ws4[4] = {W(Q_QKV), W(Q_Z), W(Q_B), W(Q_A)};
            float *d4[4] = {t->dm, t->dy, t->dpb, t->dpa};
            kiln_products_backward(be, 4, t->dxb, d4, a->xb1, ws4, T);
        } else {
            op->matmul_backward(be, t->dattg, W(Q_WO)->grad, NULL, io->dx, a->attg, W(Q_WO)->mat, T, false);
            op->sigmoid_mul_backward(be, t->dattg, t->dgate, t->dattg, a->att, a->gate, (size_t)T * d.QD);
            if (op->attention_backward_seqs) {
                op->attention_backward_seqs(be, t->dq, t->dk, t->dv, t->dattg, a->q, a->k, a->v, a->att, NULL, NULL,
                                            NULL, t->ws, n_seq, seq, d.NH, d.KVH, d.HS, scale);
            } else {
                for (int b = 0; b < n_seq; b++) {
                    const size_t r = (size_t)b * seq;
                    op->attention_backward(be, t->dq + r * d.QD, t->dk + r * d.KD, t->dv + r * d.KD,
                                           t->dattg + r * d.QD, a->q + r * d.QD, a->k + r * d.KD, a->v + r * d.KD,
                                           a->att + r * d.QD, t->ws, seq, 0, d.NH, d.KVH, d.HS, scale, 0);
                }
            }
            op->rope_partial_backward(be, t->dq, io->pos, T, d.NH, d.HS, d.R, t->rope_cos, t->rope_sin);
            op->rope_partial_backward(be, t->dk, io->pos, T, d.KVH, d.HS, d.R, t->rope_cos, t->rope_sin);
            op->rmsnorm_backward(be, t->dqr, W(Q_QNORM)->grad, t->dq, a->qr, W(Q_QNORM)->vec, T * d.NH, d.HS, eps,
                                 t->rstd, false);
            op->rmsnorm_backward(be, t->dkr, W(Q_KNORM)->grad, t->dk, a->kr, W(Q_KNORM)->vec, T * d.KVH, d.HS, eps,
                                 t->rstd, false);
            op->join_halves(be, t->dqg, t->dqr, t->dgate, (int64_t)T * d.NH, d.HS);
            const kiln_wref *ws3[3] = {W(Q_WQ), W(Q_WK), W(Q_WV)};
            float *d3[3] = {t->dqg, t->dkr, t->dv};
            kiln_products_backward(be, 3, t->dxb, d3, a->xb1, ws3, T);
        }
        op->rmsnorm_backward(be, io->dx, W(Q_IN_NORM)->grad, t->dxb, a->x, W(Q_IN_NORM)->vec, T, d.C, eps, t->rstd,
                             true);
        kiln_layer_event_at(io->hook, l, KILN_LAYER_BACKWARD_END);
#undef W
    }
}

const kiln_arch_desc kiln_arch_qwen35 = {
    .id = KILN_ARCH_QWEN35,
    .name = "qwen35",
    .hf_model_type = "qwen3_5_text",
    .hf_class = "Qwen3_5ForCausalLM",
    .always_qk_norm = true,
    .roles = q35_roles,
    .n_roles = Q_N,
    .first_layer_role = Q_FIRST,
    .n_layer_roles = Q_N_LAYER,
    .role_embed = Q_EMBED,
    .role_final_norm = Q_NORM,
    .role_head = Q_HEAD,
    .forward = q35_forward,
    .gguf_config = q35_gguf_config,
    .scratch_floats = q35_scratch_floats,
    .state_floats = q35_state_floats,
    .train_init = q35_train_init,
    .train_forward = q35_train_forward,
    .train_backward = q35_train_backward,
    .train_free = q35_train_free,
};
