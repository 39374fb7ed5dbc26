/*
 * engine.c -- the serving engine (kiln.h "Serving engine", docs/SERVING.md): requests queued
 * from any thread, run by one worker thread that builds each step's batch (decode tokens of
 * running requests, then prefill chunks, up to max_batch_tokens), runs one forward over a
 * paged KV pool, samples, and reports tokens through each request's callback.
 *
 * The pool: blocks of KILN_KV_BLOCK positions with reference counts. A block that a request
 * has filled completely is registered under the identity of the token prefix it ends: its 64
 * tokens and its parent block (the block before it, by index and generation, so a reused
 * parent never matches), hashed into a table. A new request walks its prompt block by block
 * through the table and takes the blocks it finds (shared read-only; a request only writes
 * positions past its shared prefix, which lie in its own blocks). A registered block whose
 * count falls to 0 stays findable on an LRU list until the pool needs it back.
 *
 * Every request's tokens are the ones it gets alone: in the auditable arithmetic a token's
 * logits do not depend on the other tokens of the batch (ops.h, attention_paged and the
 * row-wise products), a shared block holds the bits the request would have computed itself,
 * and each request samples with its own sampler, seeded as kiln_generate's.
 */
#include "../base/handle.h"
#include "../generate/generate.h"
#include "../generate/sampler.h"
#include "../models/format_rules.h"
#include "../models/model.h"
#include "step_cost.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLK KILN_KV_BLOCK
#define DEFAULT_MAX_SEQS 32
#define DEFAULT_MAX_QUEUE 256
#define DEFAULT_KV_CAP ((size_t)8 << 30) /* the default pool's bytes at most */

typedef struct req req;
struct req {
    uint64_t id;
    req *next; /* in the incoming list or the waiting deque */
    req *prev;
    int32_t *tokens;  /* (n_prompt + max_new + 1): the prompt, then the generated ids */
    int n_prompt, n_tokens, max_new, n_gen;
    int n_computed;   /* positions whose K/V (and recurrent state) the pool holds */
    int slot;         /* forward sequence while running, else -1 */
    int32_t *blocks;  /* (max_blocks) pool blocks of positions 0, BLK, 2*BLK, ... */
    int n_blocks;
    int n_cached;     /* prompt positions found in the prefix cache at first admission */
    int admitted_once;
    uint64_t order;   /* admission order: the latest admitted is preempted first */
    kiln_sampler *smp;
    kiln_gen_text text;
    char **stops;     /* NULL-terminated copies */
    float presence, frequency;
    int32_t *counts;  /* (2V) when a penalty is set: times each id was generated, then the
                       * last n_gen at which its penalty was applied */
    int n_registered; /* blocks[0..n_registered) have been offered to the prefix table */
    int queued;       /* counted in stats.queued (submitted, never admitted yet) */
    int logprobs;
    uint8_t *chain;   /* a receipt's logits chain and ids (kiln_request_params), or NULL */
    int32_t *rids;
    int cancel;
    kiln_request_callback cb;
    void *user;
    double t_submit, t_first_forward, t_last;
};

struct kiln_engine {
    kiln_handle_head head; /* base/handle.h: first */
    kiln_model *m;
    kiln_engine_params p;
    int V, max_blocks, pool;
    kiln_backend *be;
    kiln_forward_state fs;
    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu; /* guards incoming, cancels, flags and stats */
    pthread_cond_t wake, ready;
    req *in_head, *in_tail; /* submitted, not yet seen by the worker */
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    int stopping, drain, init_done;
    kiln_status init_status;
    char init_msg[512];
    uint64_t next_id;
    kiln_engine_stats stats;
    /* worker-only from here */
    req *wait_head, *wait_tail;
    req **running; /* (max_seqs) by slot */
    int n_running;
    uint64_t next_order;
    int32_t *ref;       /* (pool) reference counts */
    int32_t *free_list; /* (pool) blocks never registered or evicted */
    int n_free;
    /* the prefix table: per block its key, parent, generation, bucket chain and LRU links */
    uint64_t *key;
    int32_t *parent, *parent_gen, *gen, *chain, *lru_prev, *lru_next, *bucket;
    int32_t *blk_tokens; /* (pool, BLK) the tokens a registered block holds */
    uint8_t *registered;
    int n_buckets, lru_head, lru_tail, n_lru;
    /* a step's batch */
    int32_t *b_ids, *b_pos, *b_seq, *b_out;
    req **b_req; /* (max_seqs) the request of each output row */
    int32_t *b_id; /* (max_seqs) the id the device sampled for each output row */
    float *logits, *dev_logits, *row;
    int *top_scratch;
    kiln_step_cost cost; /* measured step times: the prefill cap (step_cost.h) */
    kiln_weight_formats wf; /* formats per weight (p.format_rules resolved; the backend copies it) */
    /* KILN_SERVE_STEP_LOG: one line a step (step_log_write), for the latency studies */
    FILE *step_log;
    double t_origin;
};

/* ---- small helpers ---------------------------------------------------------------------- */

kiln_engine_params kiln_engine_default_params(void) {
    kiln_engine_params p;
    memset(&p, 0, sizeof p);
    p.device = -1;
    p.max_batch_tokens = 512;
    p.max_seqs = DEFAULT_MAX_SEQS;
    p.max_queue = DEFAULT_MAX_QUEUE;
    p.prefix_cache = 1;
    p.itl_bound = 2.0f;
    return p;
}

kiln_request_params kiln_request_default_params(void) {
    kiln_request_params p;
    memset(&p, 0, sizeof p);
    p.max_tokens = 256;
    p.sampler = kiln_sampler_default_params();
    p.logprobs = -1;
    return p;
}

static uint64_t mix64(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ULL;
    return h ^ (h >> 29);
}

/* the key of a block: its tokens and its parent (index and generation; -1 for the first) */
static uint64_t block_key(const int32_t *toks, int32_t parent, int32_t parent_gen) {
    uint64_t h = mix64(0x6b696c6e, (uint64_t)(uint32_t)parent << 32 | (uint32_t)parent_gen);
    for (int i = 0; i < BLK; i++) h = mix64(h, (uint32_t)toks[i]);
    return h;
}

static void stats_locked(kiln_engine *e, void (*fn)(kiln_engine_stats *, const void *), const void *arg) {
    pthread_mutex_lock(&e->mu);
    fn(&e->stats, arg);
    pthread_mutex_unlock(&e->mu);
}

static const double HIST_BOUNDS[KILN_ENGINE_HIST_BUCKETS] = {
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 10.0, INFINITY};

static void hist_add(uint64_t *hist, double v) {
    for (int i = 0; i < KILN_ENGINE_HIST_BUCKETS; i++)
        if (v <= HIST_BOUNDS[i]) hist[i]++;
}

/* ---- the block pool ---------------------------------------------------------------------- */

static void lru_unlink(kiln_engine *e, int32_t b) {
    int32_t p = e->lru_prev[b], n = e->lru_next[b];
    if (p >= 0) e->lru_next[p] = n; else e->lru_head = n;
    if (n >= 0) e->lru_prev[n] = p; else e->lru_tail = p;
    e->lru_prev[b] = e->lru_next[b] = -1;
    e->n_lru--;
}

static void lru_push(kiln_engine *e, int32_t b) { /* most recently used at the tail */
    e->lru_prev[b] = e->lru_tail;
    e->lru_next[b] = -1;
    if (e->lru_tail >= 0) e->lru_next[e->lru_tail] = b; else e->lru_head = b;
    e->lru_tail = b;
    e->n_lru++;
}

static void unregister_block(kiln_engine *e, int32_t b) {
    int32_t *at = &e->bucket[e->key[b] % (uint64_t)e->n_buckets];
    while (*at != b) at = &e->chain[*at];
    *at = e->chain[b];
    e->registered[b] = 0;
}

/* A free block (count 1), or -1: the free list first, then the least recently used cached one. */
static int32_t block_alloc(kiln_engine *e) {
    int32_t b;
    if (e->n_free) {
        b = e->free_list[--e->n_free];
    } else if (e->lru_head >= 0) {
        b = e->lru_head;
        lru_unlink(e, b);
        unregister_block(e, b);
    } else {
        return -1;
    }
    e->gen[b]++;
    e->ref[b] = 1;
    return b;
}

static void block_release(kiln_engine *e, int32_t b) {
    if (--e->ref[b] > 0) return;
    if (e->registered[b]) lru_push(e, b);
    else e->free_list[e->n_free++] = b;
}

static int blocks_available(const kiln_engine *e) { return e->n_free + e->n_lru; }

/* The registered block holding toks[0..BLK) after parent (-1: at position 0), or -1. */
static int32_t block_find(kiln_engine *e, const int32_t *toks, int32_t parent) {
    int32_t pgen = parent >= 0 ? e->gen[parent] : 0;
    uint64_t k = block_key(toks, parent, pgen);
    for (int32_t b = e->bucket[k % (uint64_t)e->n_buckets]; b >= 0; b = e->chain[b])
        if (e->key[b] == k && e->parent[b] == parent && e->parent_gen[b] == pgen &&
            !memcmp(e->blk_tokens + (size_t)b * BLK, toks, BLK * sizeof(int32_t)))
            return b;
    return -1;
}

/* Register request r's block i (full, computed) unless an equal one is registered already. */
static void block_register(kiln_engine *e, req *r, int i) {
    int32_t b = r->blocks[i], parent = i ? r->blocks[i - 1] : -1;
    const int32_t *toks = r->tokens + (size_t)i * BLK;
    if (e->registered[b] || block_find(e, toks, parent) >= 0) return;
    e->key[b] = block_key(toks, parent, parent >= 0 ? e->gen[parent] : 0);
    e->parent[b] = parent;
    e->parent_gen[b] = parent >= 0 ? e->gen[parent] : 0;
    memcpy(e->blk_tokens + (size_t)b * BLK, toks, BLK * sizeof(int32_t));
    int32_t *head = &e->bucket[e->key[b] % (uint64_t)e->n_buckets];
    e->chain[b] = *head;
    *head = b;
    e->registered[b] = 1;
}

/* ---- requests ----------------------------------------------------------------------------- */

static void req_free(req *r) {
    if (!r) return;
    kiln_sampler_free(r->smp);
    kiln_gen_text_free(&r->text);
    for (char **s = r->stops; s && *s; s++) kiln_free(*s);
    kiln_free(r->stops);
    kiln_free(r->counts);
    kiln_free(r->tokens);
    kiln_free(r->blocks);
    kiln_free(r);
}

static void stat_finish(kiln_engine_stats *s, const void *arg) {
    const char *why = arg;
    if (!strcmp(why, "cancelled")) s->requests_cancelled++;
    else if (!strcmp(why, "error")) s->requests_failed++;
    else s->requests_finished++;
}

static void stats_gauges(kiln_engine *e);

/* Send r's DONE event and free it (its blocks and slot already given back). */
static void req_done(kiln_engine *e, req *r, const char *finish, const char *stop_reason, kiln_status st,
                     const char *msg) {
    kiln_request_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KILN_EVENT_DONE;
    ev.request = r->id;
    ev.finish_reason = finish;
    ev.stop_reason = stop_reason;
    ev.status = st;
    ev.message = msg ? msg : "";
    ev.n_prompt = r->n_prompt;
    ev.n_prompt_cached = r->n_cached;
    ev.n_generated = r->n_gen;
    ev.queue_seconds = r->t_first_forward > 0 ? r->t_first_forward - r->t_submit : 0;
    ev.text = "";
    if (st == KILN_OK && strcmp(finish, "cancelled")) {
        const char *tail = "";
        size_t nt = 0;
        if (kiln_gen_text_flush(&r->text, &tail, &nt) == KILN_OK) {
            ev.tail = tail;
            ev.tail_len = nt;
        }
    }
    if (!ev.tail) ev.tail = "";
    stats_locked(e, stat_finish, finish);
    stats_gauges(e); /* what the caller may read once it has its DONE */
    r->cb(&ev, r->user);
    req_free(r);
}

/* Give back r's blocks and slot (it keeps its tokens, sampler and text). */
static void req_unload(kiln_engine *e, req *r) {
    for (int i = 0; i < r->n_blocks; i++) block_release(e, r->blocks[i]);
    r->n_blocks = 0;
    r->n_computed = 0;
    r->n_registered = 0;
    if (r->slot >= 0) {
        e->running[r->slot] = NULL;
        e->n_running--;
        r->slot = -1;
    }
}

static void wait_push_front(kiln_engine *e, req *r) {
    r->prev = NULL;
    r->next = e->wait_head;
    if (e->wait_head) e->wait_head->prev = r; else e->wait_tail = r;
    e->wait_head = r;
}

static void wait_push_back(kiln_engine *e, req *r) {
    r->next = NULL;
    r->prev = e->wait_tail;
    if (e->wait_tail) e->wait_tail->next = r; else e->wait_head = r;
    e->wait_tail = r;
}

static void wait_unlink(kiln_engine *e, req *r) {
    if (r->prev) r->prev->next = r->next; else e->wait_head = r->next;
    if (r->next) r->next->prev = r->prev; else e->wait_tail = r->prev;
    r->next = r->prev = NULL;
}

/* r leaves the queue without having run */
static void unqueue(kiln_engine *e, req *r) {
    if (!r->queued) return;
    r->queued = 0;
    pthread_mutex_lock(&e->mu);
    e->stats.queued--;
    pthread_mutex_unlock(&e->mu);
}

/* Blocks r needs to hold positions [0, n). */
static int blocks_for(int n) { return (n + BLK - 1) / BLK; }

static kiln_status req_set_table(kiln_engine *e, req *r, int first) {
    return kiln_forward_state_set_blocks(&e->fs, r->slot, first, r->blocks + first, r->n_blocks - first);
}

/* Admit the waiting request r into a free slot if the pool can hold its prefill: shared
 * prefix blocks from the table, fresh blocks for the rest. 0: it does not fit now. */
static int try_admit(kiln_engine *e, req *r) {
    int slot = 0;
    while (slot < e->p.max_seqs && e->running[slot]) slot++;
    if (slot == e->p.max_seqs) return 0;
    int need = blocks_for(r->n_tokens);
    /* the prefix found in the table, at most up to the last token (which is computed for its
     * logits); a recurrent state cannot start mid-sequence */
    int found = 0;
    int32_t parent = -1;
    if (e->p.prefix_cache) {
        int max_found = (r->n_tokens - 1) / BLK;
        while (found < max_found) {
            int32_t b = block_find(e, r->tokens + (size_t)found * BLK, parent);
            if (b < 0) break;
            r->blocks[found++] = b;
            parent = b;
        }
    }
    /* count blocks still available once the found ones (cached, unreferenced) are taken */
    int taken_from_lru = 0;
    for (int i = 0; i < found; i++) taken_from_lru += e->ref[r->blocks[i]] == 0;
    if (blocks_available(e) - taken_from_lru < need - found) return 0;
    for (int i = 0; i < found; i++) {
        int32_t b = r->blocks[i];
        if (e->ref[b]++ == 0) lru_unlink(e, b);
    }
    r->n_blocks = found;
    while (r->n_blocks < need) r->blocks[r->n_blocks++] = block_alloc(e);
    r->n_computed = found * BLK;
    r->slot = slot;
    e->running[slot] = r;
    e->n_running++;
    r->order = e->next_order++;
    if (!r->admitted_once) {
        r->n_cached = r->n_computed;
        r->admitted_once = 1;
    }
    kiln_status st = req_set_table(e, r, 0);
    if (st != KILN_OK) { /* cannot happen for blocks of the pool; undo */
        req_unload(e, r);
        return 0;
    }
    return 1;
}

/* ---- a step -------------------------------------------------------------------------------- */

/* Preempt the running request admitted last (not keep, when keep has more than it): its
 * blocks and slot are freed and it waits at the head of the queue to be recomputed. */
static int preempt_latest(kiln_engine *e) {
    req *victim = NULL;
    for (int s = 0; s < e->p.max_seqs; s++)
        if (e->running[s] && (!victim || e->running[s]->order > victim->order)) victim = e->running[s];
    if (!victim) return 0;
    req_unload(e, victim);
    wait_push_front(e, victim);
    pthread_mutex_lock(&e->mu);
    e->stats.preemptions++;
    pthread_mutex_unlock(&e->mu);
    return 1;
}

/* Make sure every running request in decode has the block its next position needs,
 * preempting the latest admitted requests while the pool is short. */
static void ensure_decode_blocks(kiln_engine *e) {
    for (;;) {
        req *short_of = NULL;
        for (int s = 0; s < e->p.max_seqs && !short_of; s++) {
            req *r = e->running[s];
            if (r && blocks_for(r->n_tokens) > r->n_blocks) short_of = r;
        }
        if (!short_of) return;
        if (blocks_available(e) > 0) {
            short_of->blocks[short_of->n_blocks++] = block_alloc(e);
            if (req_set_table(e, short_of, short_of->n_blocks - 1) != KILN_OK) { /* never: a pool block */
                req_unload(e, short_of);
                wait_push_front(e, short_of);
            }
        } else if (!preempt_latest(e)) {
            return;
        }
    }
}

/* log-softmax of the logits at id, and the n_top best (logprob descending, id ascending). */
static void fill_logprobs(kiln_engine *e, const float *logits, int32_t id, int n_top, kiln_request_event *ev) {
    const int V = e->V;
    float mx = logits[0];
    for (int v = 1; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) sum += exp((double)logits[v] - mx);
    double lse = mx + log(sum);
    ev->logprob = (float)(logits[id] - lse);
    int k = 0;
    int *top = e->top_scratch;
    for (int v = 0; v < V && n_top > 0; v++) {
        /* insertion into the sorted top list: better = larger logit, then smaller id */
        if (k == n_top && !(logits[v] > logits[top[k - 1]])) continue;
        int at = k < n_top ? k++ : k - 1;
        while (at > 0 && logits[v] > logits[top[at - 1]]) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = v;
    }
    ev->n_top = k;
    for (int i = 0; i < k; i++) {
        ev->top_ids[i] = top[i];
        ev->top_logprobs[i] = (float)(logits[top[i]] - lse);
    }
}

static void stat_token(kiln_engine_stats *s, const void *arg) {
    const double *d = arg; /* {ttft or -1, itl or -1} */
    s->generated_tokens++;
    if (d[0] >= 0) {
        hist_add(s->ttft_hist, d[0]);
        s->ttft_sum += d[0];
        s->ttft_count++;
    }
    if (d[1] >= 0) {
        hist_add(s->itl_hist, d[1]);
        s->itl_sum += d[1];
        s->itl_count++;
    }
}

/* Whether r's next token can be sampled where its logits are, on the device (the backend's
 * sample op: kiln_sampler_sample's id for the same logits and stream): not when it asks for
 * log-probabilities or has OpenAI's penalties, which need the row on the host. */
static int samples_on_device(const kiln_engine *e, const req *r) {
    return !e->fs.host_memory && e->be->i->sample && r->logprobs < 0 && !r->counts && !r->chain;
}

/* Sample r's next token from its logits row (host memory), or take dev_id, the id the device
 * sampled for it (logits NULL); report it; 1 when r has finished (and is freed). */
static int sample_and_emit(kiln_engine *e, req *r, float *logits, int32_t dev_id) {
    const int V = e->V;
    kiln_request_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = KILN_EVENT_TOKEN;
    ev.request = r->id;
    if (logits && r->counts) { /* OpenAI's penalties, once per distinct generated token */
        int32_t *applied = r->counts + V;
        for (int i = r->n_prompt; i < r->n_tokens; i++) {
            int32_t t = r->tokens[i];
            if (applied[t] == r->n_gen + 1) continue;
            applied[t] = r->n_gen + 1;
            logits[t] -= r->presence + r->frequency * (float)r->counts[t];
        }
    }
    int32_t id = dev_id;
    kiln_status st = logits ? kiln_sampler_sample(r->smp, logits, V, r->tokens, (size_t)r->n_tokens, &id) : KILN_OK;
    if (st != KILN_OK) {
        req_unload(e, r);
        req_done(e, r, "error", "error", st, kiln_last_error());
        return 1;
    }
    if (st == KILN_OK && r->chain) { /* a receipt: this row's digest, the token */
        st = kiln_receipt_chain_step(r->chain + 32 * (size_t)r->n_gen, logits, (size_t)V, r->chain + 32 * (size_t)(r->n_gen + 1));
        r->rids[r->n_gen] = id;
        if (st != KILN_OK) {
            req_unload(e, r);
            req_done(e, r, "error", "error", st, kiln_last_error());
            return 1;
        }
    }
    if (r->logprobs >= 0) fill_logprobs(e, e->row, id, r->logprobs, &ev);
    r->tokens[r->n_tokens++] = id;
    r->n_gen++;
    if (r->counts) r->counts[id]++;
    const char *reason, *piece;
    size_t np;
    st = kiln_gen_text_push(&r->text, id, &reason, &piece, &np);
    if (st != KILN_OK) {
        req_unload(e, r);
        req_done(e, r, "error", "error", st, kiln_last_error());
        return 1;
    }
    double now = kiln_time_seconds();
    double d[2] = {r->n_gen == 1 ? now - r->t_submit : -1, r->n_gen > 1 ? now - r->t_last : -1};
    r->t_last = now;
    stats_locked(e, stat_token, d);
    if (!reason || strcmp(reason, "eos")) { /* an end token has no text and no event */
        ev.id = id;
        ev.text = piece;
        ev.len = np;
        r->cb(&ev, r->user);
    }
    const char *finish = NULL, *stop = NULL;
    if (reason) finish = "stop", stop = reason;
    else if (r->n_gen >= r->max_new) finish = "length", stop = "length";
    else if (r->n_tokens - 1 >= e->fs.n_ctx) finish = "length", stop = "context";
    if (!finish) return 0;
    req_unload(e, r);
    req_done(e, r, finish, stop, KILN_OK, NULL);
    return 1;
}

/* Fail every running request with the forward's error (a device failure poisons the backend:
 * later steps fail the same way, so queued requests end with the error too). */
static void fail_running(kiln_engine *e, kiln_status st) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    for (int s = 0; s < e->p.max_seqs; s++) {
        req *r = e->running[s];
        if (!r) continue;
        req_unload(e, r);
        req_done(e, r, "error", "error", st, msg);
    }
}

/* One line of the step log: the forward's start and end (seconds since the engine started;
 * the end includes a device's sampling, then the host samples and hands the tokens out), its
 * decode rows, prefill tokens, output rows, the prefill cap in force (-1: none), the requests
 * running and waiting. A decode row is a request's one row with a token to sample: a fed-back
 * answer token, or a prompt's last token left alone by a chunk boundary (placed, and costed, as
 * a decode). A decode row's inter-token latency, as the engine gives it, is the time from the
 * previous step's end to this one's. Write errors are not checked: a diagnostic. */
static void step_log_write(kiln_engine *e, double t0, double t1, int n_dec, int n_pre, int n_out, int cap) {
    int n_wait = 0;
    for (const req *r = e->wait_head; r; r = r->next) n_wait++;
    fprintf(e->step_log, "%.6f %.6f %d %d %d %d %d %d\n", t0 - e->t_origin, t1 - e->t_origin, n_dec, n_pre, n_out,
            cap == INT_MAX ? -1 : cap, e->n_running, n_wait);
}

/* Admit waiting requests in order while slots and blocks allow (a preempted one first). */
static void admit_waiting(kiln_engine *e) {
    while (e->wait_head && try_admit(e, e->wait_head)) {
        req *r = e->wait_head;
        wait_unlink(e, r);
        if (r->t_first_forward == 0) r->t_first_forward = kiln_time_seconds();
        if (r->queued) {
            r->queued = 0;
            pthread_mutex_lock(&e->mu);
            e->stats.queued--;
            e->stats.prompt_tokens_cached += (uint64_t)r->n_cached;
            pthread_mutex_unlock(&e->mu);
        }
    }
}

/* One step: admit, build the batch, forward, sample. 0 when there was nothing to run. */
static int engine_step(kiln_engine *e) {
    admit_waiting(e);
    ensure_decode_blocks(e);
    if (!e->n_running) admit_waiting(e); /* everything was preempted: the pool is free now */
    if (!e->n_running) {
        if (e->wait_head) { /* nothing runs and the head does not fit: a pool too small for it */
            req *r = e->wait_head;
            wait_unlink(e, r);
            unqueue(e, r);
            char msg[256];
            snprintf(msg, sizeof msg, "the KV pool (%d blocks of %d positions) cannot hold %d tokens", e->pool, BLK,
                     r->n_tokens);
            req_done(e, r, "error", "error", KILN_ERR_NOMEM, msg);
            return 1;
        }
        return 0;
    }
    /* decode tokens first (one each), then prefill chunks in admission order */
    int n = 0, n_out = 0, budget = e->p.max_batch_tokens, n_dec = 0, cap = INT_MAX;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) { /* decodes placed: bound the prefill that delays them */
            n_dec = n;
            /* bound the prefill by the step the running requests will share once their
             * prompts are in, not by this step's decode part: with few rows decoding and
             * many prompts admitted, a bound on the decode part lets the prompts in a few
             * tokens a step, and where a prefill token costs about a decode row (a CPU) so
             * few rows ever decode that the engine settles there (docs/SERVING.md) */
            cap = kiln_step_cost_prefill_cap(&e->cost, e->p.itl_bound, n_dec, e->n_running);
            if (cap < budget) budget = cap;
        }
        for (;;) { /* pick the next request of this pass by admission order */
            req *best = NULL;
            for (int s = 0; s < e->p.max_seqs; s++) {
                req *r = e->running[s];
                if (!r || r->n_computed == r->n_tokens) continue; /* placed already this step */
                int decode = r->n_tokens - r->n_computed == 1;
                if (decode != (pass == 0)) continue;
                if (!best || r->order < best->order) best = r;
            }
            if (!best || budget == 0) break;
            int chunk = best->n_tokens - best->n_computed;
            if (chunk > budget) chunk = budget;
            for (int i = 0; i < chunk; i++) {
                int p = best->n_computed + i;
                e->b_ids[n + i] = best->tokens[p];
                e->b_pos[n + i] = p;
                e->b_seq[n + i] = best->slot;
            }
            n += chunk;
            budget -= chunk;
            best->n_computed += chunk; /* tentatively; undone on failure */
            if (best->n_computed == best->n_tokens) {
                e->b_out[n_out] = n - 1;
                e->b_req[n_out++] = best;
            }
        }
    }
    kiln_batch b = {n, e->b_ids, e->b_pos, e->b_seq, e->b_out, n_out};
    double t0 = kiln_time_seconds();
    float *out = e->fs.host_memory ? e->logits : e->dev_logits;
    kiln_status st = kiln_model_forward(e->m, e->be, &e->fs, &b, n_out ? out : NULL);
    /* On a device: the rows that sample there stay there (only their ids come back); the
     * others (log-probabilities, penalties) are downloaded to e->logits at their index. */
    for (int o = 0; st == KILN_OK && !e->fs.host_memory && o < n_out; o++) {
        req *r = e->b_req[o];
        const size_t off = (size_t)o * (size_t)e->V;
        if (samples_on_device(e, r))
            st = e->be->i->sample(e->be, e->dev_logits + off, e->V, kiln_sampler_get_params(r->smp),
                                  kiln_sampler_rng(r->smp), r->tokens, (size_t)r->n_tokens, &e->b_id[o]);
        else
            st = kiln_backend_download(e->be, e->logits + off, e->dev_logits + off, (size_t)e->V * sizeof(float));
    }
    if (st == KILN_OK && !e->fs.host_memory && !n_out) st = kiln_backend_status(e->be);
    pthread_mutex_lock(&e->mu);
    e->stats.steps++;
    pthread_mutex_unlock(&e->mu);
    if (st != KILN_OK) {
        fail_running(e, st);
        return 1;
    }
    const double t1 = kiln_time_seconds();
    kiln_step_cost_add(&e->cost, t1 - t0, n_dec, n - n_dec);
    if (e->step_log) step_log_write(e, t0, t1, n_dec, n - n_dec, n_out, cap);
    /* full blocks computed this step join the prefix table */
    if (e->p.prefix_cache)
        for (int s = 0; s < e->p.max_seqs; s++) {
            req *r = e->running[s];
            if (!r) continue;
            for (; r->n_registered < r->n_computed / BLK; r->n_registered++) block_register(e, r, r->n_registered);
        }
    for (int o = 0; o < n_out; o++) {
        req *r = e->b_req[o];
        if (samples_on_device(e, r)) {
            sample_and_emit(e, r, NULL, e->b_id[o]);
            continue;
        }
        float *row = e->logits + (size_t)o * (size_t)e->V;
        if (r->logprobs >= 0) memcpy(e->row, row, (size_t)e->V * sizeof(float)); /* raw logits for logprobs */
        sample_and_emit(e, r, row, -1);
    }
    return 1;
}

/* Take what other threads handed over: new requests to the waiting deque, cancels applied. */
static void take_incoming(kiln_engine *e) {
    pthread_mutex_lock(&e->mu);
    req *in = e->in_head;
    e->in_head = e->in_tail = NULL;
    int nc = e->n_cancels;
    uint64_t cancels[64];
    int take = nc < 64 ? nc : 64;
    if (take) {
        memcpy(cancels, e->cancels, (size_t)take * sizeof *cancels);
        memmove(e->cancels, e->cancels + take, (size_t)(nc - take) * sizeof *cancels);
        e->n_cancels -= take;
    }
    int cancel_all = e->stopping && !e->drain;
    pthread_mutex_unlock(&e->mu);
    while (in) {
        req *next = in->next;
        if (in->max_new == 0) { /* nothing to generate */
            unqueue(e, in);
            req_done(e, in, "length", "length", KILN_OK, NULL);
        } else {
            wait_push_back(e, in);
        }
        in = next;
    }
    for (int c = 0; c < take || cancel_all; c++) {
        for (int s = 0; s < e->p.max_seqs; s++) {
            req *r = e->running[s];
            if (r && (cancel_all || r->id == cancels[c])) {
                req_unload(e, r);
                req_done(e, r, "cancelled", "cancelled", KILN_OK, NULL);
            }
        }
        for (req *r = e->wait_head, *next; r; r = next) {
            next = r->next;
            if (cancel_all || r->id == cancels[c]) {
                wait_unlink(e, r);
                unqueue(e, r);
                req_done(e, r, "cancelled", "cancelled", KILN_OK, NULL);
            }
        }
        if (cancel_all) break;
    }
}

static void stats_gauges(kiln_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stats.running = e->n_running;
    e->stats.kv_blocks_total = e->pool;
    e->stats.kv_blocks_cached = e->n_lru;
    e->stats.kv_blocks_used = e->pool - e->n_free - e->n_lru;
    pthread_mutex_unlock(&e->mu);
}

/* ---- the worker --------------------------------------------------------------------------- */

static kiln_status engine_init_device(kiln_engine *e) {
    const kiln_engine_params *p = &e->p;
    int mode = 0;
    KILN_TRY(kiln_backend_mode_of(p->device, p->fast, p->batch_invariant, p->format, "kiln_engine_create", &mode));
    kiln_status st = kiln_backend_acquire_formats(p->device, mode, p->device >= 0 ? 0 : p->n_threads, &e->wf, &e->be);
    if (st != KILN_OK) return st;
    KILN_TRY(kiln_forward_state_init(&e->fs, e->m, e->be, p->n_ctx, p->max_batch_tokens, p->max_seqs, e->pool));
    if (!e->fs.host_memory) {
        size_t bytes = (size_t)p->max_seqs * (size_t)e->V * sizeof(float);
        e->dev_logits = kiln_backend_alloc(e->be, bytes);
        if (!e->dev_logits)
            return kiln_error(KILN_ERR_NOMEM, "kiln_engine_create: cannot allocate %zu bytes of %s memory for logits",
                              bytes, e->be->i->name);
    }
    return KILN_OK;
}

static void *engine_main(void *arg) {
    kiln_engine *e = arg;
    kiln_status st = engine_init_device(e);
    pthread_mutex_lock(&e->mu);
    e->init_status = st;
    if (st != KILN_OK) snprintf(e->init_msg, sizeof e->init_msg, "%s", kiln_last_error());
    e->init_done = 1;
    pthread_cond_broadcast(&e->ready);
    pthread_mutex_unlock(&e->mu);
    if (st != KILN_OK) return NULL;
    for (;;) {
        take_incoming(e);
        int worked = engine_step(e);
        stats_gauges(e);
        if (worked) continue;
        if (e->step_log) fflush(e->step_log); /* idle: what was logged is on disk */
        pthread_mutex_lock(&e->mu);
        while (!e->in_head && !e->n_cancels && !e->stopping) pthread_cond_wait(&e->wake, &e->mu);
        int stop = e->stopping && !e->in_head && !e->wait_head && !e->n_running;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
    }
    return NULL;
}

/* ---- the public API ------------------------------------------------------------------------ */

static void engine_destroy(kiln_engine *e);

static void *zalloc(size_t n, size_t size, int *ok) {
    void *p = kiln_calloc(n ? n : 1, size);
    if (!p) *ok = 0;
    return p;
}

/* kiln_engine_create failed after its step log was opened: the log, which holds only its
 * header, goes too (nothing half-written is left), then e. */
static void create_failed(kiln_engine *e, const char *log_path) {
    if (e->step_log) {
        fclose(e->step_log);
        e->step_log = NULL;
        remove(log_path);
    }
    engine_destroy(e);
}

kiln_status kiln_engine_create(kiln_model *m, const kiln_engine_params *params, kiln_engine **out) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_engine_create"));
    KILN_TRY(kiln_model_weights_check(m, "kiln_engine_create"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_create: out must be set");
    kiln_engine_params p = params ? *params : kiln_engine_default_params();
    if (p.n_ctx < 0 || p.max_batch_tokens < 0 || p.max_seqs < 0 || p.kv_blocks < 0 || p.max_queue < 0 ||
        p.n_threads < 0 || p.device < -1 || !(p.itl_bound >= 0) || p.itl_bound > 1e6)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_create: n_ctx, max_batch_tokens, max_seqs, kv_blocks, "
                          "max_queue, n_threads and itl_bound must be >= 0, device >= -1");
    int mode = 0;
    KILN_TRY(kiln_backend_mode_of(p.device, p.fast, p.batch_invariant, p.format, "kiln_engine_create", &mode));
    if (p.n_ctx == 0) p.n_ctx = m->cfg.n_ctx_train < KILN_DEFAULT_MAX_CTX ? m->cfg.n_ctx_train : KILN_DEFAULT_MAX_CTX;
    if (p.n_ctx > m->cfg.n_ctx_train)
        return kiln_error(KILN_ERR_RANGE, "kiln_engine_create: n_ctx %d exceeds the model's context length %d", p.n_ctx,
                          m->cfg.n_ctx_train);
    if (p.max_batch_tokens == 0) p.max_batch_tokens = 512;
    if (p.max_seqs == 0) p.max_seqs = DEFAULT_MAX_SEQS;
    if (p.max_queue == 0) p.max_queue = DEFAULT_MAX_QUEUE;
    if (p.max_seqs > 1024)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_create: max_seqs %d is more than 1024", p.max_seqs);
    if (p.max_batch_tokens < p.max_seqs) p.max_batch_tokens = p.max_seqs; /* every decode fits a step */
    if (m->arch->state_floats) p.prefix_cache = 0; /* a recurrent state has no per-token cache to share */
    const kiln_model_config *c = &m->cfg;
    int max_blocks = blocks_for(p.n_ctx);
    size_t kv_layers = 0;
    for (int l = 0; l < c->n_layer; l++) kv_layers += !kiln_layer_linear(c, l);
    size_t block_bytes = kv_layers * 2 * (size_t)c->n_head_kv * (size_t)c->head_dim * BLK * sizeof(float);
    size_t all = (size_t)p.max_seqs * (size_t)max_blocks;
    size_t pool = (size_t)p.kv_blocks;
    if (!pool) {
        size_t cap = p.kv_memory ? p.kv_memory : DEFAULT_KV_CAP;
        pool = block_bytes ? cap / block_bytes : all;
        if (!p.kv_memory && pool > all) pool = all;
    }
    if (pool < (size_t)max_blocks && pool < all) {
        if (p.kv_blocks || p.kv_memory)
            return kiln_error(KILN_ERR_RANGE, "kiln_engine_create: a KV pool of %zu blocks (%zu bytes each) cannot hold "
                              "one request of n_ctx %d (%d blocks): raise kv_blocks / kv_memory or lower n_ctx",
                              pool, block_bytes, p.n_ctx, max_blocks);
    }
    if (pool < 1) pool = 1;
    if (pool > INT32_MAX / BLK) pool = INT32_MAX / BLK;
    kiln_engine *e = kiln_calloc(1, sizeof *e);
    if (!e) return kiln_error(KILN_ERR_NOMEM, "kiln_engine_create: out of memory");
    /* m counts e as a user from here (kiln_model_close refuses while it does) */
    kiln_status ast = kiln_handle_acquire(m, KILN_HANDLE_MODEL, "kiln_engine_create");
    if (ast != KILN_OK) {
        kiln_free(e);
        return ast;
    }
    e->m = m;
    e->p = p;
    e->p.format_rules = NULL; /* the caller's string: resolved here, not kept */
    kiln_status rst = kiln_model_weight_formats(m, p.format_rules, p.format, p.fast, "kiln_engine_create",
                                                &e->wf);
    if (rst != KILN_OK) {
        engine_destroy(e);
        return rst;
    }
    e->V = c->n_vocab;
    e->max_blocks = max_blocks;
    e->pool = (int)pool;
    e->lru_head = e->lru_tail = -1;
    e->n_buckets = e->pool * 2 + 1;
    int ok = 1;
    e->running = zalloc((size_t)p.max_seqs, sizeof *e->running, &ok);
    e->ref = zalloc(pool, sizeof *e->ref, &ok);
    e->free_list = zalloc(pool, sizeof *e->free_list, &ok);
    e->key = zalloc(pool, sizeof *e->key, &ok);
    e->parent = zalloc(pool, sizeof *e->parent, &ok);
    e->parent_gen = zalloc(pool, sizeof *e->parent_gen, &ok);
    e->gen = zalloc(pool, sizeof *e->gen, &ok);
    e->chain = zalloc(pool, sizeof *e->chain, &ok);
    e->lru_prev = zalloc(pool, sizeof *e->lru_prev, &ok);
    e->lru_next = zalloc(pool, sizeof *e->lru_next, &ok);
    e->registered = zalloc(pool, 1, &ok);
    e->bucket = zalloc((size_t)e->n_buckets, sizeof *e->bucket, &ok);
    e->blk_tokens = p.prefix_cache ? zalloc(pool * BLK, sizeof *e->blk_tokens, &ok) : NULL;
    size_t NB = (size_t)p.max_batch_tokens;
    e->b_ids = zalloc(4 * NB, sizeof(int32_t), &ok);
    e->b_req = zalloc((size_t)p.max_seqs, sizeof *e->b_req, &ok);
    e->b_id = zalloc((size_t)p.max_seqs, sizeof *e->b_id, &ok);
    e->logits = zalloc((size_t)p.max_seqs * (size_t)e->V, sizeof(float), &ok);
    e->row = zalloc((size_t)e->V, sizeof(float), &ok);
    e->top_scratch = zalloc(KILN_MAX_TOP_LOGPROBS + 1, sizeof(int), &ok);
    if (!ok) {
        engine_destroy(e);
        return kiln_error(KILN_ERR_NOMEM, "kiln_engine_create: out of memory for the engine's tables");
    }
    e->b_pos = e->b_ids + NB;
    e->b_seq = e->b_pos + NB;
    e->b_out = e->b_seq + NB;
    for (int i = 0; i < e->pool; i++) {
        e->free_list[i] = e->pool - 1 - i; /* block 0 first */
        e->lru_prev[i] = e->lru_next[i] = -1;
    }
    e->n_free = e->pool;
    for (int i = 0; i < e->n_buckets; i++) e->bucket[i] = -1;
    for (int i = 0; i < KILN_ENGINE_HIST_BUCKETS; i++) e->stats.hist_bounds[i] = HIST_BOUNDS[i];
    e->stats.kv_blocks_total = e->pool;
    const char *log_path = getenv("KILN_SERVE_STEP_LOG");
    if (log_path && *log_path) {
        e->step_log = fopen(log_path, "w");
        if (!e->step_log) {
            engine_destroy(e);
            return kiln_error(KILN_ERR_IO, "kiln_engine_create: cannot open KILN_SERVE_STEP_LOG %s: %s", log_path,
                              strerror(errno));
        }
        fputs("# t_begin t_end n_decode n_prefill n_out prefill_cap running waiting\n", e->step_log);
    }
    e->t_origin = kiln_time_seconds();
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->ready, NULL);
    /* the worker acquires the backend and owns the forward state: a device's current context
     * is per thread */
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        create_failed(e, log_path);
        return kiln_error(KILN_ERR_NOMEM, "kiln_engine_create: cannot start the worker thread");
    }
    e->thread_started = 1;
    pthread_mutex_lock(&e->mu);
    while (!e->init_done) pthread_cond_wait(&e->ready, &e->mu);
    kiln_status st = e->init_status;
    pthread_mutex_unlock(&e->mu);
    if (st != KILN_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", e->init_msg);
        create_failed(e, log_path);
        return kiln_error(st, "%s", msg);
    }
    st = kiln_handle_register(&e->head, KILN_HANDLE_ENGINE, "kiln_engine_create");
    if (st != KILN_OK) {
        create_failed(e, log_path);
        return st;
    }
    *out = e;
    return KILN_OK;
}

static void engine_stop(kiln_engine *e, int drain) {
    if (!e->thread_started) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    e->drain = drain;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    e->thread_started = 0;
}

void kiln_engine_shutdown(kiln_engine *e, int drain) {
    if (e && kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_shutdown") == KILN_OK) engine_stop(e, drain);
}

void kiln_engine_free(kiln_engine *e) {
    if (!e || kiln_handle_unregister(&e->head, KILN_HANDLE_ENGINE, "kiln_engine_free") != KILN_OK) return;
    engine_destroy(e);
}

/* Stop the worker (cancelling what is left) and free everything e holds, its model's use too. */
static void engine_destroy(kiln_engine *e) {
    engine_stop(e, 0);
    if (e->step_log) fclose(e->step_log);
    if (e->be) {
        kiln_forward_state_free(&e->fs);
        if (e->dev_logits) kiln_backend_free_buf(e->be, e->dev_logits);
        kiln_backend_release(e->be);
    }
    kiln_free(e->wf.e);
    kiln_free(e->running);
    kiln_free(e->ref);
    kiln_free(e->free_list);
    kiln_free(e->key);
    kiln_free(e->parent);
    kiln_free(e->parent_gen);
    kiln_free(e->gen);
    kiln_free(e->chain);
    kiln_free(e->lru_prev);
    kiln_free(e->lru_next);
    kiln_free(e->registered);
    kiln_free(e->bucket);
    kiln_free(e->blk_tokens);
    kiln_free(e->b_ids);
    kiln_free(e->b_req);
    kiln_free(e->b_id);
    kiln_free(e->logits);
    kiln_free(e->row);
    kiln_free(e->top_scratch);
    kiln_free(e->cancels);
    if (e->init_done || e->thread_started) {
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->wake);
        pthread_cond_destroy(&e->ready);
    }
    kiln_handle_release(e->m, "kiln_engine_free");
    kiln_free(e);
}

kiln_model *kiln_engine_model(kiln_engine *e) {
    return kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_model") == KILN_OK ? e->m : NULL;
}

int kiln_engine_n_ctx(kiln_engine *e) {
    return kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_n_ctx") == KILN_OK ? e->fs.n_ctx : 0;
}

static req *req_create(kiln_engine *e, const kiln_request_params *p) {
    req *r = kiln_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->slot = -1;
    size_t room = (size_t)(e->fs.n_ctx + 1);
    r->tokens = kiln_malloc(room * sizeof(int32_t));
    r->blocks = kiln_malloc((size_t)e->max_blocks * sizeof(int32_t) + sizeof(int32_t));
    size_t n_stops = 0;
    while (p->stop_strings && p->stop_strings[n_stops]) n_stops++;
    r->stops = kiln_calloc(n_stops + 1, sizeof(char *));
    if (!r->tokens || !r->blocks || !r->stops) goto fail;
    for (size_t i = 0; i < n_stops; i++) {
        size_t n = strlen(p->stop_strings[i]);
        if (!(r->stops[i] = kiln_malloc(n + 1))) goto fail;
        memcpy(r->stops[i], p->stop_strings[i], n + 1);
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        r->counts = kiln_calloc(2 * (size_t)e->V, sizeof(int32_t));
        if (!r->counts) goto fail;
    }
    return r;
fail:
    req_free(r);
    return NULL;
}

kiln_status kiln_engine_submit(kiln_engine *e, const kiln_request_params *p, uint64_t *id) {
    KILN_TRY(kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_submit"));
    if (!p || !id) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: NULL argument");
    if (!p->prompt || p->n_prompt == 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: the prompt is empty");
    if (!p->on_event) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: on_event must be set");
    if (p->max_tokens < 0) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: max_tokens must be >= 0");
    if (p->logprobs < -1 || p->logprobs > KILN_MAX_TOP_LOGPROBS)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: logprobs %d not in [-1, %d]", p->logprobs,
                          KILN_MAX_TOP_LOGPROBS);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: presence_penalty and frequency_penalty must be finite");
    if (!p->logits_chain != !p->receipt_ids)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: logits_chain and receipt_ids go together");
    if (p->logits_chain && (p->presence_penalty != 0 || p->frequency_penalty != 0))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_engine_submit: a receipt takes no presence or frequency penalty "
                          "(kiln verify cannot replay them)");
    if (p->n_prompt >= (size_t)e->fs.n_ctx)
        return kiln_error(KILN_ERR_RANGE, "kiln_engine_submit: a prompt of %zu tokens leaves no room in the context of %d",
                          p->n_prompt, e->fs.n_ctx);
    for (size_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= e->V)
            return kiln_error(KILN_ERR_RANGE, "kiln_engine_submit: token id %d at index %zu is out of range [0, %d)",
                              p->prompt[i], i, e->V);
    req *r = req_create(e, p);
    if (!r) return kiln_error(KILN_ERR_NOMEM, "kiln_engine_submit: out of memory for the request");
    kiln_status st = kiln_sampler_create(&p->sampler, &r->smp);
    if (st == KILN_OK) st = kiln_gen_text_init(&r->text, e->m, (const char *const *)r->stops, p->ignore_eos);
    if (st != KILN_OK) {
        req_free(r);
        return st;
    }
    memcpy(r->tokens, p->prompt, p->n_prompt * sizeof(int32_t));
    r->n_prompt = r->n_tokens = (int)p->n_prompt;
    r->max_new = p->max_tokens;
    r->presence = p->presence_penalty;
    r->frequency = p->frequency_penalty;
    r->logprobs = p->logprobs;
    r->chain = p->logits_chain;
    r->rids = p->receipt_ids;
    r->cb = p->on_event;
    r->user = p->user;
    r->t_submit = kiln_time_seconds();
    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        req_free(r);
        return kiln_error(KILN_ERR_STATE, "kiln_engine_submit: the engine is shutting down");
    }
    if (e->stats.queued >= e->p.max_queue) {
        e->stats.requests_rejected++;
        pthread_mutex_unlock(&e->mu);
        req_free(r);
        return kiln_error(KILN_ERR_BUSY, "kiln_engine_submit: %d requests are waiting already (max_queue)", e->p.max_queue);
    }
    r->id = ++e->next_id;
    *id = r->id;
    e->stats.requests_submitted++;
    e->stats.queued++;
    e->stats.prompt_tokens += p->n_prompt;
    r->queued = 1;
    r->next = NULL;
    if (e->in_tail) e->in_tail->next = r; else e->in_head = r;
    e->in_tail = r;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    return KILN_OK;
}

void kiln_engine_cancel(kiln_engine *e, uint64_t id) {
    if (kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_cancel") != KILN_OK) return;
    pthread_mutex_lock(&e->mu);
    if (e->n_cancels == e->cap_cancels) {
        int cap = e->cap_cancels ? 2 * e->cap_cancels : 16;
        uint64_t *c = kiln_realloc(e->cancels, (size_t)cap * sizeof *c);
        if (!c) { /* out of memory: the request runs to its end */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->cancels = c;
        e->cap_cancels = cap;
    }
    e->cancels[e->n_cancels++] = id;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

void kiln_engine_get_stats(kiln_engine *e, kiln_engine_stats *out) {
    if (!out || kiln_handle_check(e, KILN_HANDLE_ENGINE, "kiln_engine_get_stats") != KILN_OK) return;
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}
