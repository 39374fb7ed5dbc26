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
#include "config.h"

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

/* Per-context scratch for the forward pass, sized for n_batch tokens, and the KV cache. */
typedef struct kiln_forward_state {
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
    int32_t *pos; /* (n_batch) */
    void *block;  /* the single allocation all of the above is carved from */
    size_t bytes;
} kiln_forward_state;

kiln_status kiln_forward_state_init(kiln_forward_state *fs, const kiln_model *m, int n_ctx,
                                    int n_batch);
void kiln_forward_state_free(kiln_forward_state *fs);

/* Run N <= n_batch tokens at positions n_past.. through the model; writes logits of the
 * last token (all_logits = 0) or of every token (N x V) to logits (may be NULL). The
 * caller has checked ids and lengths. */
void kiln_model_forward(const kiln_model *m, kiln_backend *be, kiln_forward_state *fs,
                        const int32_t *ids, int N, int n_past, int all_logits, float *logits);

/* Fill rope tables for positions [0, n_ctx) per the config (default, linear, llama3,
 * GGUF rope_freqs factors). */
void kiln_rope_tables_fill(const kiln_model *m, int n_ctx, float *cos_tab, float *sin_tab);

#endif /* KILN_MODEL_H */
