/*
 * model.h -- a loaded Llama-family model: its description (config), its weights bound by
 * role, its tokenizer, and the forward pass.
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

typedef struct kiln_layer_weights {
    const float *attn_norm;        /* (C) */
    const kiln_tensor *wq;         /* (NH*HS, C) */
    const kiln_tensor *wk;         /* (KVH*HS, C) */
    const kiln_tensor *wv;         /* (KVH*HS, C) */
    const kiln_tensor *wo;         /* (C, NH*HS) */
    const float *bq, *bk, *bv, *bo; /* (NH*HS), (KVH*HS), (KVH*HS), (C), or NULL */
    const float *q_norm, *k_norm;  /* (HS) Qwen3, or NULL */
    const float *mlp_norm;         /* (C) */
    const kiln_tensor *w_gate;     /* (FF, C) */
    const kiln_tensor *w_up;       /* (FF, C) */
    const kiln_tensor *w_down;     /* (C, FF) */
    const float *b_gate, *b_up, *b_down; /* or NULL */
} kiln_layer_weights;

struct kiln_model {
    kiln_model_config cfg;
    char *path;
    char *arch_name;          /* "llama", "qwen2", ... */
    char *name;               /* general.name or folder name */
    kiln_gguf *gguf;          /* one of gguf / st is set */
    kiln_safetensors *st;
    kiln_tokenizer *tok;

    const kiln_tensor *tok_embd; /* (V, C) */
    const float *final_norm;     /* (C) */
    const kiln_tensor *lm_head;  /* (V, C), == tok_embd when tied */
    kiln_layer_weights *layers;  /* (L) */
    const float *rope_freq_factors; /* (HS/2) divisors of inv_freq from GGUF rope_freqs, or NULL */

    /* storage the model owns: converted vectors, re-laid tensors (a chunk list) */
    struct kiln_model_chunk *chunks;
    kiln_tensor *owned_tensors; /* tensors whose data lives in chunks */
    float *init_block;          /* weights of a model made by kiln_model_create */
    int n_owned_tensors, cap_owned_tensors;

    /* the tensor listing of the file, for kiln_model_get_tensor_info */
    const kiln_tensor **file_tensors;
    int n_file_tensors;
    uint64_t n_params, weight_bytes;
    kiln_model_params params;
};

/* Per-context scratch for the forward pass, sized for n_batch tokens, and the KV cache.
 * Every float * below is memory of the backend the state was made for (docs/CUDA.md,
 * "Memory contract"); pos is host memory (ops accept host positions). */
typedef struct kiln_forward_state {
    kiln_backend *be; /* the backend the buffers belong to (not owned) */
    int n_ctx, n_batch;
    float *k_cache, *v_cache;   /* (L, n_ctx, KVH*HS) each */
    float *rope_cos, *rope_sin; /* (n_ctx, HS/2) */
    float *x;    /* (n_batch, C) residual stream */
    float *xb;   /* (n_batch, C) normed input */
    float *q;    /* (n_batch, NH*HS) */
    float *att;  /* (n_batch, NH*HS) */
    float *hb;   /* (n_batch, FF) gate, then silu(gate)*up */
    float *hb2;  /* (n_batch, FF) up */
    float *tmp;  /* (n_batch, max(C, KVH*HS)) projection outputs before residual / cache */
    int32_t *pos; /* (n_batch) host memory */
    void *block;  /* the single backend allocation all of the above (but pos) is carved from */
    size_t bytes;
    /* The weights the forward reads: the model's layers with their f32 vectors (norms,
     * biases, q/k norms) and the final norm in backend memory. On a host-memory backend
     * (cpu) these are the model's own pointers; on a device backend a copy owned here
     * (layers_owned, vectors in wblock). The matrices stay the model's kiln_tensors (a device
     * backend uploads and caches them on first use). */
    const kiln_layer_weights *layers; /* (L) */
    const float *final_norm;          /* (C) */
    kiln_layer_weights *layers_owned;
    void *wblock;
    /* A device backend's logits buffer (backend memory, logits_cap floats), grown on demand
     * by the context; NULL on a host-memory backend, where logits go to the caller's array. */
    float *logits;
    size_t logits_cap;
    int host_memory; /* the backend's buffers are host memory (the cpu backend) */
    /* Decode graphs (a backend with graph_begin): the step's token id and position in backend
     * memory (d_step[0], d_step[1]), and one row of k and v before they are stored in the
     * cache at that position. NULL when the backend has no graphs. */
    int32_t *d_step;
    float *k_row, *v_row; /* (KVH*HS) each */
    /* Sequences: the KV cache holds n_seq independent sequences, seq_stride floats apart
     * (each (L, n_ctx, KVH*HS)); kiln_model_forward works on sequence `seq` (0 unless the
     * caller sets it). d_step then holds n_seq ids and n_seq positions, k_row / v_row n_seq
     * rows (backends with kv_store and attention_at). */
    int n_seq, seq;
    size_t seq_stride;
} kiln_forward_state;

/* Allocate the state on backend be (which must outlive it): scratch and KV cache through
 * kiln_backend_alloc, zeroed; rope tables computed on the host and uploaded; the f32 weight
 * vectors uploaded (device backends). On the cpu backend the memory is one kiln_calloc and
 * the weights are the model's, as before. */
kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                    int n_ctx, int n_batch);
/* The same with n_seq >= 1 sequences in the KV cache (batched decode). */
kiln_status kiln_forward_state_init_seq(kiln_forward_state *fs, const kiln_model *m, kiln_backend *be,
                                        int n_ctx, int n_batch, int n_seq);
void kiln_forward_state_free(kiln_forward_state *fs);

/* Run N <= n_batch tokens at positions n_past.. through the model on fs->be (be must be
 * fs->be); writes logits of the last token (all_logits = 0) or of every token (N x V) to
 * logits (may be NULL), which is backend memory. The caller has checked ids and lengths;
 * a device backend's failure is reported by kiln_backend_status(be) afterwards. */
void kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                        const int32_t *ids, int N, int n_past, int all_logits, float *logits);

/* The one-token decode step whose token id and position are read from backend memory
 * (fs->d_step[0], fs->d_step[1]) rather than passed: the ops it submits do not depend on the
 * position, so a backend can record them once as a graph (ops.h "decode graphs") and replay
 * them for every token. Same bits as kiln_model_forward(N = 1, n_past = d_step[1]); logits of
 * the token to logits (backend memory). Needs fs->d_step (a backend with kv_store and
 * attention_at). */
void kiln_model_forward_step(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                             float *logits);
/* One token for each of sequences 0..B-1 (B <= fs->n_seq): ids in fs->d_step[0..B), positions
 * in fs->d_step[B..2B) (backend memory); logits (B, V) to logits. Each row has the bits of
 * that sequence's own one-token kiln_model_forward (auditable backends: every op is
 * per-row). Needs kv_store and attention_at. */
void kiln_model_forward_batch(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                              int B, float *logits);

/* Fill rope tables for positions [0, n_ctx) per the config (default, linear, llama3,
 * GGUF rope_freqs factors). */
void kiln_rope_tables_fill(const kiln_model *m, int n_ctx, float *cos_tab, float *sin_tab);

#endif /* KILN_MODEL_H */
