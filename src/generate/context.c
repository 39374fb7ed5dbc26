/*
 * context.c -- an inference context: a model, a backend, a KV cache and scratch sized up
 * front. kiln_decode appends tokens to the cache in chunks of n_batch.
 */
#include "../models/format_rules.h"
#include "../models/model.h"
#include "../tokenizer/tokenizer.h"
#include "generate.h"
#include "sampler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kiln_context_params kiln_context_default_params(void) {
    kiln_context_params p = {0};
    p.n_ctx = 0;
    p.n_batch = 512;
    p.n_threads = 0;
    p.device = -1;
    p.n_seq = 1;
    return p;
}

static void context_destroy(kiln_context *c);

kiln_status kiln_context_enter(const kiln_context *c, const char *fn) {
    KILN_TRY(kiln_handle_check(c, KILN_HANDLE_CONTEXT, fn));
    return kiln_backend_enter(c->be, fn);
}

kiln_status kiln_context_leave(const kiln_context *c, kiln_status st, const char *fn) {
    return kiln_backend_leave(c->be, st, fn);
}

kiln_status kiln_context_status(const kiln_context *c) { return kiln_context_enter(c, "kiln_context_status"); }

kiln_status kiln_debug_poison_context(kiln_context *c) {
    KILN_TRY(kiln_handle_check(c, KILN_HANDLE_CONTEXT, "kiln_debug_poison_context"));
    if (!c->fs.host_memory)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_debug_poison_context: only a CPU context can be poisoned on purpose");
    kiln_backend_cpu_poison(c->be, KILN_ERR_INTERNAL, "poisoned on purpose (kiln_debug_poison_context)");
    return KILN_OK;
}

kiln_status kiln_context_create(kiln_model *m, const kiln_context_params *params,
                                kiln_context **out) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_context_create"));
    KILN_TRY(kiln_model_weights_check(m, "kiln_context_create"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_context_create: out must be set");
    kiln_context_params p = params ? *params : kiln_context_default_params();
    if (p.n_ctx < 0 || p.n_batch < 0 || p.n_threads < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_context_create: n_ctx, n_batch, n_threads must be >= 0");
    if (p.n_ctx == 0) p.n_ctx = m->cfg.n_ctx_train < KILN_DEFAULT_MAX_CTX ? m->cfg.n_ctx_train : KILN_DEFAULT_MAX_CTX;
    if (p.n_ctx > m->cfg.n_ctx_train)
        return kiln_error(KILN_ERR_RANGE, "kiln_context_create: n_ctx %d exceeds the model's context length %d",
                          p.n_ctx, m->cfg.n_ctx_train);
    if (p.n_batch == 0) p.n_batch = 512;
    if (p.n_batch > p.n_ctx) p.n_batch = p.n_ctx;
    if (p.n_threads == 0) p.n_threads = kiln_cpu_count();
    if (p.device < -1)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_context_create: device %d: use -1 (CPU) or a CUDA device index >= 0", p.device);
    if (p.device >= 0 && p.fast_q8_activations)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_context_create: fast_q8_activations is a CPU mode; on CUDA (device %d) ask for the GPU's fast arithmetic with fast = 1", p.device);
    if (p.n_seq == 0) p.n_seq = 1;
    if (p.n_seq < 1 || p.n_seq > 4096)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_context_create: n_seq %d not in [1, 4096]", p.n_seq);
    if (p.n_threads > 256)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_context_create: n_threads %d is more than 256", p.n_threads);
    int mode = 0;
    KILN_TRY(kiln_backend_mode_of(p.device, p.fast || (p.device < 0 && p.fast_q8_activations), p.batch_invariant,
                                  p.format, "kiln_context_create", &mode));
    kiln_context *c = kiln_calloc(1, sizeof *c);
    if (!c) return kiln_error(KILN_ERR_NOMEM, "kiln_context_create: out of memory");
    /* m counts c as a user from here (kiln_model_close refuses while it does) */
    kiln_status ast = kiln_handle_acquire(m, KILN_HANDLE_MODEL, "kiln_context_create");
    if (ast != KILN_OK) {
        kiln_free(c);
        return ast;
    }
    c->model = m;
    c->params = p;
    c->params.format_rules = NULL; /* the caller's string: resolved below, not kept */
    kiln_weight_formats wf = {0};
    kiln_status st = kiln_model_weight_formats(m, p.format_rules, p.format, p.fast, "kiln_context_create",
                                               &wf);
    if (st != KILN_OK) {
        context_destroy(c);
        return st;
    }
    if (p.device >= 0) {
        st = kiln_backend_acquire_formats(p.device, mode, 0, &wf, &c->be);
        if (st != KILN_OK) { /* say which setting asked for CUDA, keep the backend's reason */
            char why[512];
            snprintf(why, sizeof why, "%s", kiln_last_error());
            context_destroy(c);
            return kiln_error(st, "kiln_context_create: device %d (CUDA) unavailable: %s", p.device, why);
        }
    } else {
        st = kiln_backend_acquire_formats(-1, mode, p.n_threads, &wf, &c->be);
    }
    kiln_free(wf.e);
    if (st == KILN_OK) st = kiln_forward_state_init(&c->fs, m, c->be, p.n_ctx, p.n_batch, p.n_seq, 0);
    if (st == KILN_OK) st = kiln_alloc_or_fail((void **)&c->seq_past, (size_t)p.n_seq * sizeof(int), "sequence lengths");
    if (st == KILN_OK) memset(c->seq_past, 0, (size_t)p.n_seq * sizeof(int));
    if (st == KILN_OK) {
        c->graphs = c->be->i->graph_begin && !kiln_env_off("KILN_CUDA_GRAPHS");
        c->host_sampling = kiln_env_off("KILN_DEVICE_SAMPLING");
    }
    if (st == KILN_OK)
        st = kiln_alloc_or_fail((void **)&c->tokens, (size_t)p.n_ctx * sizeof(int32_t), "context token list");
    if (st == KILN_OK)
        st = kiln_alloc_or_fail((void **)&c->b_pos, 2 * (size_t)p.n_batch * sizeof(int32_t), "batch positions");
    if (st == KILN_OK) c->b_seq = c->b_pos + p.n_batch;
    if (st == KILN_OK) st = kiln_handle_register(&c->head, KILN_HANDLE_CONTEXT, "kiln_context_create");
    if (st != KILN_OK) {
        context_destroy(c);
        return st;
    }
    *out = c;
    return KILN_OK;
}

void kiln_context_free(kiln_context *c) {
    if (!c || kiln_handle_unregister(&c->head, KILN_HANDLE_CONTEXT, "kiln_context_free") != KILN_OK) return;
    context_destroy(c);
}

static void context_destroy(kiln_context *c) {
    if (c->graph) c->be->i->graph_free(c->be, c->graph);
    kiln_free(c->b_pos);
    kiln_free(c->seq_past);
    kiln_forward_state_free(&c->fs);
    kiln_free(c->tokens);
    kiln_backend_release(c->be);
    kiln_handle_release(c->model, "kiln_context_free");
    kiln_free(c);
}

int kiln_context_n_past(const kiln_context *c) {
    return kiln_handle_check(c, KILN_HANDLE_CONTEXT, "kiln_context_n_past") == KILN_OK ? c->n_past : 0;
}
int kiln_context_n_ctx(const kiln_context *c) {
    return kiln_handle_check(c, KILN_HANDLE_CONTEXT, "kiln_context_n_ctx") == KILN_OK ? c->fs.n_ctx : 0;
}

/* A model with a recurrent state (Qwen3.5's linear layers) cannot drop its last tokens: only
 * a truncation to 0 (start again) or to where it stands. */
static kiln_status recurrent_rewind(const kiln_context *c, int seq, int n_past, int now) {
    if (!c->fs.state_floats || n_past == 0 || n_past == now) return KILN_OK;
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "kiln_context_truncate: sequence %d of this %s model cannot go back from %d to %d tokens: its "
                      "linear-attention layers keep a recurrent state, not a cache per token (truncate to 0 and "
                      "decode the prefix again)", seq, c->model->arch->name, now, n_past);
}

kiln_status kiln_context_truncate(kiln_context *c, int n_past) {
    KILN_TRY(kiln_context_enter(c, "kiln_context_truncate"));
    if (n_past < 0 || n_past > c->n_past)
        return kiln_error(KILN_ERR_RANGE, "kiln_context_truncate: n_past %d not in [0, %d]", n_past, c->n_past);
    KILN_TRY(recurrent_rewind(c, 0, n_past, c->n_past));
    c->n_past = n_past;
    return KILN_OK;
}

/* A device backend's logits buffer of at least n floats (grown, never shrunk). */
static kiln_status logits_reserve(kiln_context *c, size_t n) {
    if (c->fs.logits_cap >= n) return KILN_OK;
    size_t bytes;
    if (kiln_mul_overflow(n, sizeof(float), &bytes))
        return kiln_error(KILN_ERR_RANGE, "kiln_decode: %zu logits are too many", n);
    float *p = kiln_backend_alloc(c->be, bytes);
    if (!p)
        return kiln_error(KILN_ERR_NOMEM, "kiln_decode: cannot allocate %zu bytes of %s memory for logits",
                          bytes, c->be->i->name);
    kiln_backend_free_buf(c->be, c->fs.logits);
    c->fs.logits = p;
    c->fs.logits_cap = n;
    return KILN_OK;
}

/* Replay the recorded decode step for the B tokens staged in fs.d_batch (recording it first,
 * or again after the logits buffer moved or a workspace it uses grew); logits (B, V) in
 * fs.logits. Same bits as kiln_model_forward on that batch. */
static kiln_status decode_graph(kiln_context *c, int B) {
    kiln_backend *be = c->be;
    const kiln_model_config *cfg = &c->model->cfg;
    kiln_status st = KILN_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (!c->graph || c->graph_B != B || c->graph_logits != c->fs.logits) {
            if (c->graph) be->i->graph_free(be, c->graph);
            c->graph = NULL;
            st = be->i->graph_begin(be, B, cfg->n_head, cfg->head_dim, c->fs.n_ctx);
            if (st != KILN_OK) return st;
            kiln_model_forward_dev(c->model, be, &c->fs, B, c->fs.logits);
            st = be->i->graph_end(be, &c->graph);
            if (st != KILN_OK) return st;
            c->graph_B = B;
            c->graph_logits = c->fs.logits;
        }
        st = be->i->graph_launch(be, c->graph);
        if (st != KILN_ERR_STATE) break;
        be->i->graph_free(be, c->graph); /* stale: a workspace grew since; record again */
        c->graph = NULL;
    }
    return st;
}

/* One token of sequence seq at position pos through the decode graph; logits downloaded
 * unless on_device. */
static kiln_status decode_step_graph(kiln_context *c, int32_t seq, int32_t pos, int32_t id, float *logits,
                                     int on_device) {
    size_t V = (size_t)c->model->cfg.n_vocab;
    KILN_TRY(logits_reserve(c, V));
    kiln_batch b = {1, &id, &pos, &seq, NULL, 0};
    KILN_TRY(kiln_forward_state_advance_steps(&c->fs, &seq, &pos, 1));
    KILN_TRY(kiln_forward_stage(&c->fs, &b));
    kiln_status st = decode_graph(c, 1);
    if (st != KILN_OK || on_device) return st; /* on_device: the logits stay in fs.logits */
    return logits ? kiln_backend_download(c->be, logits, c->fs.logits, V * sizeof(float))
                  : kiln_backend_status(c->be);
}

/* The positions and sequence of n tokens of sequence seq after past cached ones, in
 * c->b_pos / c->b_seq (n <= n_batch). */
static void batch_fill(kiln_context *c, int seq, int n, int past) {
    for (int i = 0; i < n; i++) {
        c->b_pos[i] = past + i;
        c->b_seq[i] = seq;
    }
}

/* kiln_decode; on_device (device backends, !all_logits): the last token's logits are left in
 * fs.logits (backend memory) and not downloaded, and a device failure is reported by the next
 * synchronising call (the tokens are counted as cached: the backend is poisoned then anyway,
 * so the context is unusable). */
static kiln_status decode(kiln_context *c, int seq, const int32_t *ids, int n, int all_logits,
                          float *logits, int on_device) {
    if (!ids && n > 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_decode: NULL argument");
    if (n <= 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_decode: n must be > 0 (got %d)", n);
    if (seq < 0 || seq >= c->fs.n_seq)
        return kiln_error(KILN_ERR_RANGE, "kiln_decode_seq: sequence %d not in [0, %d)", seq, c->fs.n_seq);
    /* sequence 0 keeps its ids (prefix reuse) */
    int *past = seq == 0 ? &c->n_past : &c->seq_past[seq];
    const kiln_model *m = c->model;
    int V = m->cfg.n_vocab;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V)
            return kiln_error(KILN_ERR_RANGE, "kiln_decode: token id %d at index %d is out of range [0, %d)",
                              ids[i], i, V);
    if (n > c->fs.n_ctx - *past)
        return kiln_error(KILN_ERR_RANGE,
                          "kiln_decode: %d tokens after %d cached ones exceed the context length %d",
                          n, *past, c->fs.n_ctx);
    if (n == 1 && c->graphs && c->warm) {
        kiln_status st = decode_step_graph(c, seq, *past, ids[0], logits, on_device);
        if (st != KILN_OK) return st;
        if (seq == 0) c->tokens[c->n_past] = ids[0];
        *past += 1;
        return KILN_OK;
    }
    for (int done = 0; done < n;) {
        int chunk = n - done < c->fs.n_batch ? n - done : c->fs.n_batch;
        int last = done + chunk == n;
        float *out = NULL;
        if (logits && all_logits) out = logits + (size_t)done * V;
        else if (logits && last) out = logits;
        /* rows of logits this chunk produces */
        size_t rows = out ? (all_logits ? (size_t)chunk : 1) : 0;
        float *dev_out = out;
        if (out && !c->fs.host_memory) {
            kiln_status st = logits_reserve(c, rows * (size_t)V);
            if (st != KILN_OK) return st;
            dev_out = c->fs.logits;
        }
        batch_fill(c, seq, chunk, *past);
        int32_t last_row = chunk - 1;
        kiln_batch b = {chunk, ids + done, c->b_pos, c->b_seq, all_logits ? NULL : &last_row, 1};
        kiln_status st = kiln_model_forward(m, c->be, &c->fs, &b, dev_out);
        if (st != KILN_OK) return st;
        if (on_device && last) {
            /* the caller samples from fs.logits on the device (which synchronises) */
        } else if (!c->fs.host_memory) {
            /* download waits for the forward and reports a failure that poisoned the backend;
             * then this chunk is not counted as cached */
            st = out ? kiln_backend_download(c->be, out, dev_out, rows * (size_t)V * sizeof(float))
                     : kiln_backend_status(c->be);
            if (st != KILN_OK) return st;
        }
        if (seq == 0) memcpy(c->tokens + c->n_past, ids + done, (size_t)chunk * sizeof(int32_t));
        *past += chunk;
        done += chunk;
        c->warm = 1;
    }
    return KILN_OK;
}

kiln_status kiln_decode(kiln_context *c, const int32_t *ids, int n, int all_logits, float *logits) {
    KILN_TRY(kiln_context_enter(c, "kiln_decode"));
    return kiln_context_leave(c, decode(c, 0, ids, n, all_logits, logits, 0), "kiln_decode");
}

kiln_status kiln_decode_seq(kiln_context *c, int seq, const int32_t *ids, int n, int all_logits,
                            float *logits) {
    KILN_TRY(kiln_context_enter(c, "kiln_decode_seq"));
    return kiln_context_leave(c, decode(c, seq, ids, n, all_logits, logits, 0), "kiln_decode_seq");
}

int kiln_context_seq_n_past(const kiln_context *c, int seq) {
    if (kiln_handle_check(c, KILN_HANDLE_CONTEXT, "kiln_context_seq_n_past") != KILN_OK) return 0;
    if (seq < 0 || seq >= c->fs.n_seq) return 0;
    return seq == 0 ? c->n_past : c->seq_past[seq];
}

kiln_status kiln_context_seq_truncate(kiln_context *c, int seq, int n_past) {
    KILN_TRY(kiln_context_enter(c, "kiln_context_seq_truncate"));
    if (seq < 0 || seq >= c->fs.n_seq)
        return kiln_error(KILN_ERR_RANGE, "kiln_context_seq_truncate: sequence %d not in [0, %d)", seq, c->fs.n_seq);
    if (seq == 0) return kiln_context_truncate(c, n_past);
    if (n_past < 0 || n_past > c->seq_past[seq])
        return kiln_error(KILN_ERR_RANGE, "kiln_context_seq_truncate: n_past %d not in [0, %d]", n_past, c->seq_past[seq]);
    KILN_TRY(recurrent_rewind(c, seq, n_past, c->seq_past[seq]));
    c->seq_past[seq] = n_past;
    return KILN_OK;
}

static kiln_status decode_batch(kiln_context *c, const int32_t *ids, int B, float *logits);

kiln_status kiln_decode_batch(kiln_context *c, const int32_t *ids, int B, float *logits) {
    KILN_TRY(kiln_context_enter(c, "kiln_decode_batch"));
    return kiln_context_leave(c, decode_batch(c, ids, B, logits), "kiln_decode_batch");
}

static kiln_status decode_batch(kiln_context *c, const int32_t *ids, int B, float *logits) {
    if (!ids) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_decode_batch: NULL argument");
    kiln_backend *be = c->be;
    if (B < 1 || B > c->fs.n_seq || B > c->fs.n_batch)
        return kiln_error(KILN_ERR_RANGE, "kiln_decode_batch: B %d not in [1, min(n_seq %d, n_batch %d)]", B,
                          c->fs.n_seq, c->fs.n_batch);
    const kiln_model_config *cfg = &c->model->cfg;
    int V = cfg->n_vocab;
    kiln_status st = KILN_OK;
    for (int b = 0; b < B && st == KILN_OK; b++) {
        int past = b == 0 ? c->n_past : c->seq_past[b];
        if (ids[b] < 0 || ids[b] >= V)
            st = kiln_error(KILN_ERR_RANGE, "kiln_decode_batch: token id %d of sequence %d is out of range [0, %d)",
                            ids[b], b, V);
        else if (past >= c->fs.n_ctx)
            st = kiln_error(KILN_ERR_RANGE, "kiln_decode_batch: sequence %d is full (%d tokens)", b, past);
        c->b_pos[b] = past;
        c->b_seq[b] = b;
    }
    float *dev_out = logits;
    if (st == KILN_OK && !c->fs.host_memory) {
        st = logits_reserve(c, (size_t)B * (size_t)V);
        dev_out = c->fs.logits;
    }
    float *host_tmp = NULL;
    if (st == KILN_OK && c->fs.host_memory && !logits) { /* the forward always writes logits */
        host_tmp = kiln_malloc((size_t)B * (size_t)V * sizeof(float));
        if (!host_tmp) st = kiln_error(KILN_ERR_NOMEM, "kiln_decode_batch: out of memory for logits");
        dev_out = host_tmp;
    }
    kiln_batch batch = {B, ids, c->b_pos, c->b_seq, NULL, 0};
    if (st == KILN_OK && c->graphs && c->warm) {
        /* recorded once per batch size (and logits buffer), replayed */
        st = kiln_forward_state_advance_steps(&c->fs, c->b_seq, c->b_pos, B);
        if (st == KILN_OK) st = kiln_forward_stage(&c->fs, &batch);
        if (st == KILN_OK) st = decode_graph(c, B);
    } else if (st == KILN_OK) {
        st = kiln_model_forward(c->model, be, &c->fs, &batch, dev_out);
    }
    if (st == KILN_OK && !c->fs.host_memory)
        st = logits ? kiln_backend_download(be, logits, dev_out, (size_t)B * (size_t)V * sizeof(float))
                    : kiln_backend_status(be);
    if (st == KILN_OK) {
        for (int b = 0; b < B; b++) {
            if (b == 0) c->tokens[c->n_past++] = ids[0];
            else c->seq_past[b]++;
        }
        c->warm = 1;
    }
    kiln_free(host_tmp);
    return st;
}

kiln_status kiln_decode_and_sample(kiln_context *c, const int32_t *ids, int n, kiln_sampler *smp,
                                   const int32_t *hist, size_t n_hist, float *logits,
                                   const kiln_logits_hook *hook, int32_t *id) {
    kiln_backend *be = c->be;
    int V = c->model->cfg.n_vocab;
    if (c->fs.host_memory || !be->i->sample || c->host_sampling) {
        KILN_TRY(decode(c, 0, ids, n, 0, logits, 0));
        if (hook) KILN_TRY(hook->fn(hook->user, logits, V));
        return kiln_sampler_sample(smp, logits, V, hist, n_hist, id);
    }
    /* the logits stay on the device; only the id comes back (and, for a hook, the row) */
    float *dummy = logits; /* non-NULL: decode writes the last token's logits to fs.logits */
    KILN_TRY(decode(c, 0, ids, n, 0, dummy, 1));
    if (hook) {
        KILN_TRY(kiln_backend_download(be, logits, c->fs.logits, (size_t)V * sizeof(float)));
        KILN_TRY(hook->fn(hook->user, logits, V));
    }
    return be->i->sample(be, c->fs.logits, c->model->cfg.n_vocab, kiln_sampler_get_params(smp),
                         kiln_sampler_rng(smp), hist, n_hist, id);
}
