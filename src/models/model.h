/*
 * model.h -- a loaded model: its description (config, architecture), its weights bound by
 * role (arch.h), its tokenizer, and the forward pass.
 *
 * Weights stay where the file put them (mapped GGUF or safetensors), except what must be
 * changed: small vectors (norms, biases) are widened to f32 once, Q/K rows of GGUF "llama"
 * files are un-permuted back to Hugging Face's rotate-half layout, and with
 * KILN_WEIGHTS_F32 every matrix is dequantized. All of that lives in one arena per model.
 */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include "../formats/gguf.h"
#include "../formats/safetensors.h"
#include "../ops/ops.h"
#include "../formats/model_config.h"
#include "../base/handle.h"
#include "arch.h"

/* Bytes of each tensor name of a model made by kiln_model_create (in its init_block). */
#define KILN_INIT_NAME_BYTES 128

struct kiln_model {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_model_config cfg;
    const kiln_arch_desc *arch; /* its roles table and forward */
    char *path;
    char *arch_name;          /* "llama", "qwen2", ... */
    char *name;               /* general.name or folder name */
    kiln_gguf *gguf;          /* one of gguf / st is set */
    kiln_safetensors *st;
    kiln_tokenizer *tok;

    kiln_wref *refs;        /* (arch->n_roles) the per-model roles' weights, by role index */
    kiln_wref *layer_refs;  /* (L, arch->n_layer_roles) the per-layer roles' */
    const kiln_tensor *tok_embd; /* (V, C) refs[role_embed].mat */
    const float *final_norm;     /* (C) refs[role_final_norm].vec */
    const kiln_tensor *lm_head;  /* (V, C), == tok_embd when tied */
    const float *rope_freq_factors; /* (HS/2) divisors of inv_freq from GGUF rope_freqs, or NULL */

    /* storage the model owns: converted vectors, re-laid tensors (a chunk list) */
    struct kiln_model_chunk *chunks;
    kiln_tensor *owned_tensors; /* tensors whose data lives in chunks */
    float *init_block;          /* weights of a model made by kiln_model_create */
    size_t init_bytes;          /* init_block's size */
    char *names;                /* the created model's tensor names (KILN_INIT_NAME_BYTES each) once
                                 * init_block is given back */
    int n_owned_tensors, cap_owned_tensors;

    /* the tensor listing of the file, for kiln_model_get_tensor_info */
    const kiln_tensor **file_tensors;
    int n_file_tensors;
    uint64_t n_params, weight_bytes;
    kiln_model_params params;
    /* kiln_model_fingerprint's value once computed (fingerprint_done; the weights never
     * change), read and written under model_fingerprint.c's lock */
    uint8_t fingerprint[32];
    int fingerprint_done;
    /* kiln_model_release_weights: the weights the model owned are given back; the model still
     * answers for its config, tokenizer and tensor names, not for its weights */
    int weights_released;
};

/* Give back the memory of the weights the model owns (a created model's initial weights;
 * vectors converted and tensors re-laid at load), every backend forgetting them first, once
 * nothing will read them again: a trainer holding its own copy, the model's only user
 * (kiln_train_release_source). From then on kiln_model_weights_check refuses what would read
 * them (contexts, engines, trainers, teachers, fingerprints); config, tokenizer and names
 * stay. A file's mapped pages are left to the page cache. */
void kiln_model_release_weights(kiln_model *m);
/* A created model's tensor t (in its initial-weight block) read for the last time by a trainer
 * that consumes the model (kiln_train_create_rank with consume): the whole pages t alone covers
 * are given back (madvise(MADV_DONTNEED): they read as zero afterwards) and the model counts as
 * released (kiln_model_weights_check refuses it). Nothing for a loaded model's tensors, nor
 * under an allocator hook (kiln_allocator_is_default). */
void kiln_model_give_back_tensor(kiln_model *m, const kiln_tensor *t);
/* KILN_OK, or KILN_ERR_STATE naming call when m's weights were released. */
kiln_status kiln_model_weights_check(const kiln_model *m, const char *call);

/* The file's tensor of that name (GGUF or safetensors; a multimodal folder's
 * "model.language_model.X" answers for "model.X"), or NULL: absent, or a model made by
 * kiln_model_create, which has no file. */
const kiln_tensor *kiln_model_file_tensor(const kiln_model *m, const char *name);

/* One tensor of a model's fingerprint (docs/REPRODUCIBILITY.md, "Fingerprints"). */
typedef struct kiln_fingerprint_entry {
    char name[128];      /* transformers' name (the roles table's hf) */
    kiln_dtype dtype;    /* as stored */
    int n_dims;          /* 1..3 */
    int64_t shape[3];    /* transformers' shape, outermost first; unused entries 1 */
    uint64_t nbytes;     /* bytes hashed */
    uint8_t sha256[32];  /* SHA-256 of the stored bytes in transformers' row order */
} kiln_fingerprint_entry;

/* The model's fingerprint into fp, and (entries non-NULL) its tensors in the fingerprint's
 * order, *entries allocated with kiln_malloc (the caller kiln_frees it), *n_entries their
 * count. Hashes every weight (on m->params.n_threads threads); kiln_model_fingerprint caches
 * the value. */
kiln_status kiln_model_fingerprint_tensors(const kiln_model *m, uint8_t fp[32], kiln_fingerprint_entry **entries,
                                           int *n_entries);
/* The fingerprint of tensors already hashed, e[0..n) sorted by name: SHA-256 of the magic
 * "kiln-fingerprint-v1\n", n as a little-endian u32 and each entry's record (name, NUL, dtype
 * name, NUL, n_dims as u32, the shape as u64s, the data's SHA-256). Sorts e. */
kiln_status kiln_fingerprint_combine(kiln_fingerprint_entry *e, int n, uint8_t fp[32]);

/* Allocate m->refs and m->layer_refs (zeroed: every role absent) for m->arch and m->cfg. */
kiln_status kiln_model_refs_alloc(kiln_model *m);

/* The model's kiln_wref of role r in layer `layer` (ignored for per-model roles). */
static inline kiln_wref *kiln_model_ref(kiln_model *m, const kiln_param_role *r, int layer) {
    return kiln_wref_of(m->arch, m->refs, m->layer_refs, r, layer);
}

/* The n values of vector role r in layer `layer` as transformers' parameter holds them, to dst
 * (host memory): the bound vector, except for a plus_one role (arch.h), whose parameter is w
 * where the model binds 1 + w: the Hugging Face file's own w when the model came from one,
 * else (a GGUF file, which stores 1 + w, or a model created from a config) f32(1 + w) - 1. */
kiln_status kiln_model_vector_param(kiln_model *m, const kiln_param_role *r, int layer, float *dst, int64_t n);

/* The block size of a forward state's KV cache (ops.h kiln_kv_pages): a multiple of
 * KILN_ATTN_BLOCK. */
#define KILN_KV_BLOCK 64

/* A batch for the forward (host memory): n tokens, token i at position pos[i] of sequence
 * seq[i], as ops.h's attention_paged takes them; the tokens of one sequence come in the
 * order of their positions, and a sequence's cache holds its positions below each of its
 * tokens (stored by earlier forwards or earlier in this batch). Logits: of the n_out tokens
 * out[0..n_out) (token indices, increasing), or of every token when out is NULL. */
struct kiln_batch {
    int n;
    const int32_t *ids, *pos, *seq;
    const int32_t *out;
    int n_out;
};
typedef struct kiln_batch kiln_batch;

/* Per-context scratch for the forward pass, sized for n_batch tokens, and the KV cache.
 * Every float * below is memory of the backend the state was made for (docs/CUDA.md,
 * "Memory contract"). */
struct kiln_forward_state {
    kiln_backend *be; /* the backend the buffers belong to (not owned) */
    int n_ctx, n_batch;
    /* The KV cache: per layer a pool of n_blocks blocks of KILN_KV_BLOCK positions, each
     * position KVH*HS floats (layer l's pool at l * n_blocks * KILN_KV_BLOCK * KVH*HS), found
     * through pages (ops.h): sequence s's block table is host_table[s * max_blocks ..]. A
     * dense state (pool_blocks 0) gives sequence s blocks s*max_blocks .. (s+1)*max_blocks-1;
     * a pool's owner (the serving engine) assigns blocks with kiln_forward_state_set_blocks. */
    float *k_cache, *v_cache;
    int n_seq, n_blocks, max_blocks;
    int32_t *host_table; /* (n_seq, max_blocks) */
    kiln_kv_pages pages;
    float *rope_cos, *rope_sin; /* (n_ctx, HS/2) */
    float *rope_cos_local, *rope_sin_local; /* (n_ctx, HS/2) with rope_theta_local, or NULL */
    float *x;    /* (n_batch, C) residual stream */
    float *xb;   /* (n_batch, C) normed input */
    float *q;    /* (n_batch, NH*HS) */
    float *att;  /* (n_batch, NH*HS) */
    float *hb;   /* (n_batch, FF) gate, then silu(gate)*up */
    float *hb2;  /* (n_batch, FF) up */
    float *tmp;  /* (n_batch, C) projection outputs before the residual add */
    float *k_new, *v_new; /* (n_batch, KVH*HS) this batch's k and v before they are stored */
    /* The batch in backend memory, for n tokens: ids, positions, sequences and cache rows
     * (slots) back to back, each n int32 (d_batch[0..4n)); h_batch is its host staging. */
    int32_t *d_batch, *h_batch;
    kiln_batch_run *runs; /* (n_batch) host scratch: the runs of the batch */
    /* An architecture's own (arch.h scratch_floats, state_floats): scratch for n_batch tokens,
     * and its sequences' states (n_seq * state_floats floats, laid out as the architecture
     * says), backend memory, zeroed at creation; NULL when it has none. state_pos (host, n_seq): the position each sequence's
     * state has reached -- a recurrent state cannot go back, so a batch must continue a
     * sequence from there or restart it at position 0 (kiln_model_forward checks). */
    float *arch_scratch, *seq_state;
    size_t state_floats;
    int32_t *state_pos;
    /* The KV cache's layers: the model's full-attention layers (all of them, but for an
     * architecture with linear-attention layers, which keep no KV cache). kv_layer[l]: layer
     * l's index in the pools (-1: none). */
    int n_kv_layers;
    int32_t *kv_layer;
    void *block;  /* the single backend allocation all of the above (but host arrays) is carved from */
    size_t bytes;
    /* The weights the forward reads: the model's layers with their f32 vectors (norms,
     * biases, q/k norms) and the final norm in backend memory. On a host-memory backend
     * (cpu) these are the model's own pointers; on a device backend a copy owned here
     * (layer_refs_owned, vectors in wblock). The matrices stay the model's kiln_tensors (a device
     * backend uploads and caches them on first use). */
    const kiln_wref *layer_refs; /* (L, n_layer_roles) */
    const kiln_taps *taps;       /* hidden-state taps of the forwards (NULL: none; the caller's) */
    const float *final_norm;     /* (C) */
    kiln_wref *layer_refs_owned;
    void *wblock;
    /* A device backend's logits buffer (backend memory, logits_cap floats), grown on demand
     * by the context; NULL on a host-memory backend, where logits go to the caller's array. */
    float *logits;
    size_t logits_cap;
    int host_memory; /* the backend's buffers are host memory (the cpu backend) */
};
typedef struct kiln_forward_state kiln_forward_state;

/* Allocate the state on backend be (which must outlive it) for n_seq >= 1 sequences of up to
 * n_ctx positions and batches of up to n_batch tokens, over a KV pool of pool_blocks blocks
 * (0: dense, n_seq * ceil(n_ctx / KILN_KV_BLOCK) blocks, each sequence its own): scratch and KV cache through
 * kiln_backend_alloc, zeroed; the block table and rope tables computed on the host and
 * uploaded; the f32 weight vectors uploaded (device backends). The backend must have the
 * batch ops (kv_store_rows, attention_paged, get_rows) and scale (and geglu for an
 * architecture that uses it). */
kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                    int n_ctx, int n_batch, int n_seq, int pool_blocks);
void kiln_forward_state_free(kiln_forward_state *fs);
/* Point entries first..first+n-1 of sequence seq's block table at blocks[0..n) (pool indices),
 * on the host and in backend memory. KILN_ERR_RANGE for entries or blocks out of range. */
kiln_status kiln_forward_state_set_blocks(kiln_forward_state *fs, int seq, int first, const int32_t *blocks, int n);

/* The cache row of position pos of sequence seq (its block table's). */
static inline int32_t kiln_forward_slot(const kiln_forward_state *fs, int seq, int pos) {
    int32_t block = fs->host_table[(size_t)seq * fs->max_blocks + pos / KILN_KV_BLOCK];
    return block * KILN_KV_BLOCK + pos % KILN_KV_BLOCK;
}

/* Run batch b (1 <= b->n <= n_batch tokens; ids, positions and sequences checked by the
 * caller) through the model on fs->be: logits (b->n_out or b->n rows of V) to logits (backend
 * memory; may be NULL: none). The runs of the batch are found on the host and handed to the
 * attention. KILN_OK, or the error staging the batch met; a device backend's failure in the
 * forward itself is reported by kiln_backend_status(be) afterwards. */
kiln_status kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                               const kiln_batch *b, float *logits);
/* The forward of a batch of B tokens already in backend memory (fs->d_batch: ids, positions,
 * sequences and slots, B each), every token's logits (B, V) to logits: the ops it submits do
 * not depend on the tokens, so a backend can record them once as a graph (ops.h "decode
 * graphs") and replay them for every step after uploading the next batch. Each token is its
 * own run (a decode step); the bits of kiln_model_forward on the same batch. */
void kiln_model_forward_dev(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int B,
                            float *logits);
/* Before kiln_model_forward_dev (or a replay of its graph) on B tokens of sequences seq[b] at
 * positions pos[b] (host): move the sequences' recurrent states' positions, refusing a step
 * that does not continue a sequence's state (kiln_model_forward checks its batches itself).
 * KILN_OK for an architecture without a recurrent state. */
kiln_status kiln_forward_state_advance_steps(kiln_forward_state *fs, const int32_t *seq, const int32_t *pos, int B);
/* The end of an architecture's generation forward: the logits of the rows out[0..n_out) (all N
 * when out is NULL) of the residual stream fs->x, through the final norm (fs->final_norm)
 * and the output head, to logits (backend memory; NULL: nothing). */
void kiln_forward_logits(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs, int N,
                         const int32_t *out, int n_out, float *logits);
/* A generation forward's batch as an architecture's layers take it: N tokens staged in
 * fs->d_batch (their ids, positions, sequence ids and cache rows, N each, backend memory) and
 * the runs (host, or NULL in a recorded graph) and max_T that attention_paged takes. */
typedef struct kiln_fwd_batch {
    kiln_forward_state *fs;
    int N;
    const int32_t *ids, *pos, *seq, *slots;
    const kiln_batch_run *runs;
    int n_runs, max_T;
} kiln_fwd_batch;
static inline kiln_fwd_batch kiln_fwd_batch_of(kiln_forward_state *fs, int N, const kiln_batch_run *runs,
                                               int n_runs, int max_T) {
    const int32_t *d = fs->d_batch;
    kiln_fwd_batch g = {fs, N, d, d + N, d + 2 * N, d + 3 * N, runs, n_runs, max_T};
    return g;
}
/* Layer `layer`'s attention over the paged cache (its pools: fs->kv_layer[layer]): the batch's k, v rows (N, KVH*HS) stored at
 * their cache rows, then out = attention_paged of q (N, NH*HS) with scale and window (0: none). */
void kiln_forward_attend(const kiln_fwd_batch *g, kiln_backend *be, int layer, float *out, const float *q,
                         const float *k, const float *v, int NH, int KVH, int HS, float scale, int window);
/* The same with RoPE first: q and k rotated in place at the batch's positions (ops.h rope, tables
 * cos_tab/sin_tab), fused with the store where the backend has rope_kv_store. */
void kiln_forward_attend_rope(const kiln_fwd_batch *g, kiln_backend *be, int layer, float *out, float *q, float *k,
                              const float *v, int NH, int KVH, int HS, float scale, int window, const float *cos_tab,
                              const float *sin_tab);
/* Stage batch b in fs->h_batch (ids, positions, sequences, slots) and upload it to
 * fs->d_batch (on a host-memory backend the two are one buffer). */
kiln_status kiln_forward_stage(kiln_forward_state *fs, const kiln_batch *b);

/* dx(T,C) = the sum of dy[i] @ W[i] for i < n (n <= KILN_MATMUL_MULTI_MAX, in order), each
 * weight's gradient (W[i]->grad) accumulated: matmul_backward_multi where the backend has it
 * (one pass over x), else n matmul_backward calls (train_common.c). */
void kiln_products_backward(kiln_backend *be, int n, float *dx, float *const *dy, const float *x,
                            const kiln_wref *const *W, int T);

/* The multipliers 1 + w of the zero-centred norms (arch.h plus_one) a training forward binds
 * (train_common.c): refs / layer_refs are copies of the io's with those vectors pointing into
 * mult (n floats, backend memory), recomputed from the parameters w by kiln_norm_mult_update
 * before each forward; ones: n floats the bind fills with 1. */
typedef struct kiln_norm_mult {
    kiln_wref *refs, *layer_refs;
    float *mult, *ones;
    size_t n;
} kiln_norm_mult;
/* The floats of io's multipliers (mult's and ones' size). */
size_t kiln_norm_mult_floats(const kiln_train_io *io);
kiln_status kiln_norm_mult_bind(kiln_norm_mult *nm, const kiln_train_io *io, float *mult, float *ones);
void kiln_norm_mult_update(kiln_norm_mult *nm, const kiln_train_io *io);
void kiln_norm_mult_free(kiln_norm_mult *nm);

/* Fill rope tables for positions [0, n_ctx) per the config (default, linear, llama3,
 * GGUF rope_freqs factors). */
void kiln_rope_tables_fill(const kiln_model *m, int n_ctx, float *cos_tab, float *sin_tab);
/* The same for the full layers (local 0) or, local 1, the sliding layers' base
 * (cfg.rope_theta_local, unscaled). */
void kiln_rope_tables_fill_kind(const kiln_model *m, int n_ctx, int local, float *cos_tab, float *sin_tab);

/* Free everything a model holds, registered or not (its creators' failure paths; and
 * kiln_model_close once the registry has let the model go). */
void kiln_model_destroy(kiln_model *m);
/* Register a finished model (and mark its tokenizer as the model's); destroys it on failure. */
kiln_status kiln_model_publish(kiln_model *m, const char *fn);

/* model_init.c: n normal(0, std) floats, Box-Muller over splitmix64 from *rng (advanced): the
 * draws kiln_model_create initialises weights with. */
void kiln_fill_normal(float *dst, int64_t n, float std, uint64_t *rng);

#endif /* KILN_MODEL_H */
