/*
 * trainer_impl.h -- the trainer's struct, shared by the files of src/train/ that make up the
 * trainer (trainer.c: create, steps, optimizer, checkpoints; trainer_dp.c: the data-parallel
 * ranks). Not for anyone else: the API is include/kiln.h and trainer.h.
 */
#ifndef KILN_TRAIN_TRAINER_IMPL_H
#define KILN_TRAIN_TRAINER_IMPL_H

#include "../models/model.h"
#include "../ops/fused_ce.h"
#include "../dist/comm.h"
#include "adamw.h"
#include "checkpoint.h"

typedef struct kiln_train_dp kiln_train_dp; /* trainer_dp.c: the data-parallel state */

typedef struct train_param {
    char name[96];
    int n_dims;
    int64_t shape[2]; /* (rows, cols) or (n, 1) */
    int64_t n;
    int layer;               /* a per-layer role's layer, else -1 (per-model roles, extras) */
    int64_t flat;            /* its first element in the flat vector (the parameters back to back) */
    int file_dims;           /* its shape in a Hugging Face file (kiln_train_param_file_shape) */
    int64_t file_shape[3];
    kiln_dtype dtype; /* F32, or BF16 for matrices under the bf16 storages */
    void *w;          /* (n) weights the model computes with; backend memory */
    float *g;         /* (n) gradient; backend memory */
    kiln_tensor view;   /* tensor view of w for the ops */
    kiln_tensor view16; /* fast mode with f32 weights: the bf16 copy's view (t->shadow) */
} train_param;

/* Parameter p's elements inside the flat range [lo, hi): [*a, *b) of its own (*a == *b: none). */
static inline void kiln_param_part(const train_param *p, int64_t lo, int64_t hi, int64_t *a, int64_t *b) {
    int64_t x = lo - p->flat, y = hi - p->flat;
    x = x < 0 ? 0 : x > p->n ? p->n : x;
    y = y < 0 ? 0 : y > p->n ? p->n : y;
    *a = x;
    *b = y > x ? y : x;
}

struct kiln_trainer {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_model *model;     /* a user of the model from create to free */
    kiln_model_config cfg;
    kiln_train_params p;
    kiln_backend *be;
    int host; /* the backend's memory is host memory (the cpu backend) */

    train_param *params; /* (n_params) in transformers' named_parameters() order, then the extras */
    int n_params;
    int n_model_params;  /* the model's: params[0 .. n_model_params); the extras follow */
    train_param *tok_embd, *final_norm, *lm_head;
    /* the parameters as the architecture's forward and backward read them (models/arch.h):
     * per-model roles by role index, per-layer roles (L, n_layer_roles); a matrix's view is
     * the bf16 copy where the trainer keeps one (shadow) */
    kiln_wref *refs, *layer_refs;
    void *param_block; /* weights of every parameter */
    size_t param_bytes; /* bytes of param_block */
    /* Fast mode with f32 weights: a bf16 copy of param_block (element for element, so each
     * parameter's copy is at half its byte offset), which the matrix products take in place of
     * rounding every weight to bf16 on every use; the same values (round to nearest even).
     * Refreshed before a forward when stale: after create, an optimizer step, a load or a
     * write of the weights. NULL otherwise. */
    uint16_t *shadow;
    int shadow_stale;
    /* An exact format (kiln_train_params.format): the backend keeps each weight's quantized
     * copies (W for the forward, W^T for the backward) until told to forget them; mx_stale says
     * the weights changed since (set with shadow_stale), and the next forward drops them. */
    int mx;
    int mx_stale;
    int micro; /* the current backward's micro-batch in its step: 0, then + 1 per accumulating one */
    int step_writes_shadow; /* every parameter's optimizer step writes its bf16 copy (w16) */
    float *grad_block;  /* (n_grad) every gradient, each 16-float aligned */
    size_t n_grad;      /* floats in grad_block (a multiple of 16) */

    kiln_adamw *opt_mat; /* matrices (storage per params) */
    kiln_adamw *opt_vec; /* vectors: always f32 */
    int *mat_index, *vec_index; /* param index of each optimizer slot */
    int n_mat, n_vec;

    /* the architecture's activations and backward scratch, sized for max_batch x max_seq rows
     * (models/arch.h): ids, pos, xn, dxn, dx */
    kiln_train_io io;
    int32_t *targets, *positions; /* host arrays (T) */
    int32_t *pos_host; /* device backends: the host copy of pos */
    int32_t *ids_host; /* device backends: the host copy of the pending step's ids (the
                        * embedding's backward groups its rows on the host) */
    int pos_seq, pos_rows; /* pos holds n % pos_seq for rows n < pos_rows (0: nothing yet) */

    /* Fast mode on a device with graphs (ops.h graph_begin; KILN_CUDA_GRAPHS=0 turns them
     * off): a forward's layer work (embed .. final norm) and a backward's (the layers, down to
     * the embedding's gradient) are recorded once per shape, after one plain run at that shape
     * has grown the backend's workspaces, then replayed: the same launches with the same
     * arguments, so the same bits, without the host's launch cost and most of the GPU's idle
     * time between kernels. */
    int graphs;
    int g_nseq, g_seq;          /* the shape the graphs below are for */
    int g_fwd_runs, g_bwd_runs; /* plain runs at that shape */
    void *g_fwd, *g_bwd;
    float *ce_stats; /* (max_seq, 3) the fused loss's pass-1 statistics, forward -> backward */
    float *ce_stats_host; /* kiln_train_step_batch on a device: their host copy (3 x rows) */
    float *ce_keep;  /* CPU: the forward's logits the backward reuses (ce_keep_floats floats;
                      * kiln_train_params.ce_keep_mib), NULL: none */
    size_t ce_keep_floats;
    uint64_t ce_scratch; /* the largest fused-loss scratch of the last step (devices) */
    void *ce_buf;        /* devices: the fused loss's scratch, kept from call to call */
    size_t ce_buf_cap;   /* its bytes: the most a call has needed */

    /* The gradients' state. clip_grads leaves its coefficient pending (grad_coef,
     * in [0, 1]; 1: none) instead of a pass over every gradient: the logical gradients are
     * grad_coef x the stored ones, and the optimizers multiply by it as they read them (the
     * same f32 products, so the same bits). Whatever else reads or adds to the gradients
     * applies it first (apply_grad_coef), get_grad on the copy it returns. grads_finite: the
     * stored gradients are known to be finite (every per-tensor norm of the last norm pass
     * was finite, and nothing has changed them since), so optimizer_step skips its check. */
    float grad_coef;
    int grads_finite;
    /* grads_unusable: a one-call step (kiln_train_step_batch) failed after its gradient work
     * began (a non-finite loss is found only then), so the stored gradients are not the
     * logical ones; the optimizer and the clip refuse them until a step that does not
     * accumulate zeroes them */
    int grads_unusable;

    /* the pending step */
    int pending;      /* 0 none, 1 loss (targets), 2 hidden */
    int T, n_pos; /* T: rows of the pending step = n_seq x seq tokens */
    int n_seq, seq; /* sequences of the pending step and their length */
    kiln_loss_reduction red;
    float scale;
    uint64_t peak_step;

    /* Accumulating steps (begin_grads with accumulate): the embedding's gradient of the
     * micro-step alone (and a tied head's), added to the gradient once at the end of the
     * backward; allocated at the first accumulating step (tok_embd->n floats), kept. */
    float *emb_acc;
    int emb_acc_live; /* the running backward writes the embedding's gradient there */

    /* Data-parallel ranks (trainer_dp.c; NULL: one process). With dp, opt_mat and opt_vec
     * hold only this rank's range of the flat parameter vector (pieces of the parameters,
     * mat_off / vec_off: each slot's first element in its parameter), and the norms, the
     * optimizer step and checkpoints go through the communicator. */
    kiln_train_dp *dp;
    /* Made for one rank of a ZeRO-3 run (kiln_train_create_rank, host memory): only the
     * elements [lean_lo, lean_hi) of the flat vector (and every vector) were written at
     * create; the blocks' other pages were never touched, and the optimizers cover that range */
    int lean;
    int64_t lean_lo, lean_hi;
    /* lean and consuming its model (kiln_train_create_rank with consume): each matrix's pages in
     * the model given back once its elements are copied (kiln_model_give_back_tensor) */
    int consume;
    int64_t *mat_off, *vec_off; /* (n_params) element offset of each optimizer slot */
};


/* trainer.c: (re)make the two optimizers over the elements [lo, hi) of the flat parameter
 * vector (the parameters in order, back to back; lo 0, hi the total: every parameter whole),
 * into *mat and *vec, with mat_index / vec_index / mat_off / vec_off and n_mat / n_vec set
 * for them when set_slots. */
kiln_status kiln_trainer_make_optimizers(kiln_trainer *t, int64_t lo, int64_t hi, kiln_adamw **mat,
                                         kiln_adamw **vec, int set_slots);

/* trainer.c: kiln_train_save and kiln_train_load_ex / _load_step of this process alone (at < 0:
 * the newest checkpoint, as a resume opens it; else the checkpoint of step at). */
kiln_status kiln_trainer_save_local(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json,
                                    int keep_last);
kiln_status kiln_trainer_load_local(kiln_trainer *t, const char *dir, int64_t at, uint64_t *step, char **run_json,
                                    char **notes);
/* trainer.c: the state of the opened checkpoint c into t (a set: kiln_trainer_load_set); closes c */
kiln_status kiln_trainer_load_opened(kiln_trainer *t, kiln_ckpt *c, uint64_t *step, char **run_json,
                                     char **notes);
/* trainer.c: the configuration JSON a checkpoint records and a load compares (kiln_malloc'd, or
 * NULL: out of memory) */
char *kiln_trainer_config_json(const kiln_trainer *t);
/* trainer_dp.c: a set of shards (of any rank count) into t: a rank's range, or a process's
 * whole state; every check before anything changes in a process alone (a rank's other ranks
 * may fail after it wrote: the caller stops then). Closes c. */
kiln_status kiln_trainer_load_set(kiln_trainer *t, kiln_ckpt *c, uint64_t *step, char **run_json, char **notes);

/* trainer_dp.c (t->dp set; every rank calls each, in the same order: they are collectives) */
void kiln_trainer_dp_free(kiln_trainer *t);
/* this rank's range [lo, hi) of the flat vector of total elements; staging: bytes of the
 * collectives' buffers */
void kiln_trainer_dp_range(const kiln_trainer *t, int64_t *lo, int64_t *hi, int64_t *total, int64_t *staging);
/* norms (n_params) of the summed gradients, one process's bits, the same on every rank */
kiln_status kiln_trainer_dp_norms(kiln_trainer *t, float *norms);
/* after an optimizer step or a load: stage 2, every rank's updated range of the weights to every
 * rank; stage 3, every gathered unit released (stale) */
kiln_status kiln_trainer_dp_after_update(kiln_trainer *t);
/* every rank's status made one (KILN_OK everywhere, or an error everywhere: this rank's own,
 * or one saying that another rank failed at `what`); the CLI's agreement collective */
kiln_status kiln_trainer_dp_agree(kiln_trainer *t, kiln_status st, const char *what);

/* trainer_dp.c, stage 3 (ZeRO-3, the weights sharded; docs/DISTRIBUTED.md). Without t->dp, or
 * in stage 2, each does nothing (0 / KILN_OK). */
int kiln_trainer_dp_sharded(const kiln_trainer *t);
/* before a forward: the rest's weights (per-model, extras, vectors) gathered unless they are;
 * the layer events' failure state cleared */
kiln_status kiln_trainer_dp_forward_begin(kiln_trainer *t);
/* the first failure of the layer events since forward_begin (their collectives), or KILN_OK */
kiln_status kiln_trainer_dp_layers_status(const kiln_trainer *t);
/* a backward's gradients begin (kiln's count of the rest's gradients held) */
void kiln_trainer_dp_grads_begin(kiln_trainer *t);
/* after a backward (the embedding's gradient written): the rest's gradients summed to their
 * owners, its weights released */
kiln_status kiln_trainer_dp_backward_end(kiln_trainer *t);
/* gradients zeroed: this rank's range (the rest reads as zero, released) */
void kiln_trainer_dp_zero_own_grads(kiln_trainer *t);
/* this rank's range of the gradients times coef */
void kiln_trainer_dp_scale_own_grads(kiln_trainer *t, float coef);
/* the weights changed outside the step (set by the caller): every unit stale */
void kiln_trainer_dp_weights_changed(kiln_trainer *t);
/* parameter i's weights are whole in this rank's memory (always, outside stage 3) */
int kiln_trainer_dp_param_whole(const kiln_trainer *t, int i);
/* kiln's count of the weights' and gradients' bytes this rank holds, now and at the peak */
void kiln_trainer_dp_held(const kiln_trainer *t, uint64_t *w, uint64_t *g, uint64_t *peak_w, uint64_t *peak_g);
/* the checkpoint as a set of shards (checkpoint.h), each rank writing its range; every rank
 * returns the same status */
kiln_status kiln_trainer_dp_save(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json,
                                 int keep_last);
/* a checkpoint opened (rank 0 first: a resume may set newer damaged ones aside), each rank
 * keeping its range: from a set's shards (any rank count), or from one process's state.kiln */
kiln_status kiln_trainer_dp_load(kiln_trainer *t, const char *dir, int64_t at, uint64_t *step, char **run_json,
                                 char **notes);

#endif
