/* trainer.h -- internal accessors of kiln_trainer for the rest of train/ (export_hf.c), the CLI. */
#ifndef KILN_TRAIN_TRAINER_H
#define KILN_TRAIN_TRAINER_H

#include "../models/model.h"
#include "../dist/comm.h"

/* The model the trainer was created from (config, architecture, tokenizer). */
const kiln_model *kiln_trainer_model(const kiln_trainer *t);
/* The source model's weights given back (kiln_model_release_weights: a created model's
 * initial weights, a loaded one's converted tensors) now that the trainer holds its own copy
 * of every weight. KILN_ERR_STATE when the model has another user (a context, a teacher,
 * another trainer), which still reads them. The model then refuses new contexts, trainers and
 * fingerprints; the trainer's export, checkpoints and evaluation are its own. */
kiln_status kiln_train_release_source(kiln_trainer *t);
/* kiln_train_param_file_shape is public (include/kiln.h). */
/* The API boundary of a trainer call: t a live trainer (base/handle.h) whose backend is not
 * poisoned (KILN_ERR_POISONED otherwise), errors naming call. */
kiln_status kiln_trainer_enter(const kiln_trainer *t, const char *call);

/* kiln_train_load, and *notes (may be NULL) gets why newer checkpoints were passed over and
 * which were set aside (kiln_ckpt_open_for_resume; kiln_malloc'd text, one line each, or NULL
 * when none was), for the caller to show. */
kiln_status kiln_train_load_ex(kiln_trainer *t, const char *dir, uint64_t *step, char **run_json, char **notes);
/* kiln_train_load of the checkpoint of step `at` in dir (not the newest; nothing set aside):
 * an audit's replay starts there. */
kiln_status kiln_train_load_step(kiln_trainer *t, const char *dir, uint64_t at, char **run_json);

/* ---- a loss of the caller's own over a step's final hidden states (distillation) ---------- */

/* What a custom loss sees of a step of T = n_seq x seq rows: the final-norm hidden states and
 * the output head, and where its gradients go. Every pointer is memory of the trainer's
 * backend (be). */
typedef struct kiln_train_head {
    kiln_backend *be;
    int n_seq, seq, T, C, V;
    const int32_t *ids;       /* (T) host: the step's token ids */
    const float *hidden;      /* (T, C) the final norm's output */
    const kiln_tensor *weight; /* (V, C) the head as the forward reads it (f32 or bf16) */
    float *dhidden;           /* (T, C) overwrite with d loss / d hidden */
    float *dweight;           /* (V, C) f32: add d loss / d head */
} kiln_train_head;

/* Computes the step's loss from h (its value to *loss) and writes its gradients as
 * kiln_train_head says. An error leaves the step's gradients unusable. */
typedef kiln_status (*kiln_train_loss_fn)(void *ctx, const kiln_train_head *h, float *loss);

/* A training step with loss fn instead of the model's cross-entropy: the forward of the
 * n_seq x seq ids (checked as kiln_train_step_batch checks them), fn, then the backward, the
 * gradients accumulated or overwritten as kiln_train_step_batch's accumulate says. On fn's
 * failure, or the backward's, the gradients are marked unusable (the next step must not
 * accumulate) and the error is returned prefixed with call. */
kiln_status kiln_train_custom_step(kiln_trainer *t, const char *call, const int32_t *ids, int n_seq, int seq,
                                   kiln_train_loss_fn fn, void *ctx, int accumulate, float *loss);
/* The parameters of the model (the first of the trainer's list; the extras of
 * kiln_train_params follow them). */
int kiln_train_n_model_params(const kiln_trainer *t);
/* Parameter `name` (the model's or an extra): its tensor as the ops read it (f32, or bf16 under
 * the bf16 storages) and its gradient (f32), both backend memory; KILN_ERR_INVALID_ARG naming
 * it when the trainer has none. */
kiln_status kiln_trainer_param_view(kiln_trainer *t, const char *name, const kiln_tensor **w, float **grad);
/* The hidden-state taps of the next steps' forwards and backwards (models/arch.h; the caller's,
 * NULL: none). */
void kiln_trainer_set_taps(kiln_trainer *t, const kiln_taps *taps);
/* The trainer's backend (the teacher of a distillation runs on it). */
kiln_backend *kiln_trainer_backend(const kiln_trainer *t);
/* The trainer's max_seq and max_batch. */
void kiln_trainer_limits(const kiln_trainer *t, int *max_seq, int *max_batch);
/* Whether the trainer runs the fast arithmetic (kiln_train_params.fast: not the CPU's bits). */
int kiln_trainer_fast(const kiln_trainer *t);

/* ---- data-parallel ranks (trainer_dp.c; docs/DISTRIBUTED.md, "Data-parallel training") -----
 * Every call below, and clip_grads, grad_sq_norm, the optimizer step, save and load of a rank's
 * trainer, is a collective: every rank calls it, in the same order. */

/* Make t one rank of the run c joins (c outlives t): its optimizer state is remade over this
 * rank's range of the flat parameter vector only. zero_stage 2: the gradients and the AdamW
 * state sharded, every rank keeping the whole weights; 3: the weights too (each layer's gathered
 * for its forward and its backward, its gradients summed to their owners layer by layer; what
 * a rank does not own is given back to the system). Call after create, before any optimizer
 * step or load. A host communicator of one rank leaves t as it is. GPU ranks: a GPU trainer
 * with the nccl communicator on its device (kiln_comm_open_nccl), which makes t a rank even with
 * one rank (one GPU runs the path of N); ZeRO-2 only (stage 3 is KILN_ERR_UNSUPPORTED: a GPU
 * gives no memory back page by page), and no load (resume a GPU run's set on the CPU).
 * KILN_ERR_UNSUPPORTED too for stochastic rounding and 8-bit moments (their arithmetic depends
 * on an element's index in its tensor), and a CPU trainer with a device communicator or the
 * other way round.
 * Stage 3: a step is kiln_train_step_batch or kiln_train_custom_step (each agrees with the
 * other ranks at its start and after its loss, so that a failure on one rank stops every rank
 * at the same point), or kiln_train_dp_idle_step on a rank without a micro-batch; a forward
 * alone (kiln_train_forward_batch, an evaluation) is a collective too; the weights are whole in
 * a rank's memory only between kiln_train_dp_gather_params and the next step, optimizer step or
 * kiln_train_dp_release_params (kiln_train_get_param refuses them otherwise). */
kiln_status kiln_train_dp_attach(kiln_trainer *t, kiln_comm *c, int zero_stage);
/* kiln_trainer_create, then kiln_train_dp_attach when c has more than one rank (or is a device
 * communicator): with ZeRO-3 on
 * the CPU the trainer is made for its rank from the start (only the rank's range of the
 * weights is written and its optimizers cover that range; the pages of the rest are never
 * touched), so no rank ever holds the whole training state. consume (made lean, and the model's
 * only user): the trainer consumes a created model's initial weights as it copies them, each
 * matrix's pages given back once read (kiln_model_give_back_tensor), so that they are never
 * whole beside the trainer; the model refuses contexts and trainers from then on (a caller that
 * may make a trainer from it again, as a resume on other settings does, passes 0 and calls
 * kiln_train_release_source once it is done with the model). */
kiln_status kiln_train_create_rank(kiln_model *m, const kiln_train_params *p, kiln_comm *c, int zero_stage,
                                   int consume, kiln_trainer **out);
/* After this rank's micro-step(s): the gradients summed over the ranks (rank order from +0),
 * this rank keeping its range of the sum (the rest of its gradient buffers is stale). Stage 3
 * did that layer by layer in the step: nothing to do. */
kiln_status kiln_train_dp_reduce_grads(kiln_trainer *t);
/* A rank without a micro-batch this step, stage 2: its contribution to the sum is zero. */
kiln_status kiln_train_dp_zero_grads(kiln_trainer *t);
/* A rank without a micro-batch this step: the other ranks' step's collectives with a zero
 * contribution (stage 2: kiln_train_dp_zero_grads). st: this rank's failure before the step
 * (KILN_OK: none), which stage 3's first agreement hands to every rank. */
kiln_status kiln_train_dp_idle_step(kiln_trainer *t, kiln_status st);
/* Stage 3: every weight whole on every rank (for an export or a fingerprint), until the next
 * step, optimizer step or kiln_train_dp_release_params. Stage 2, one process: nothing. */
kiln_status kiln_train_dp_gather_params(kiln_trainer *t);
kiln_status kiln_train_dp_release_params(kiln_trainer *t);
/* Every rank's status made one (a collective): KILN_OK on every rank, or an error on every rank
 * (this rank's own, or one saying that `what` failed on another rank). Without attach: st. */
kiln_status kiln_train_dp_agree(kiln_trainer *t, kiln_status st, const char *what);
/* A line on what this rank holds (kiln's count): stage 3, the most bytes of weights and
 * gradients it has held since attach, of the whole; "" without attach. */
kiln_status kiln_train_dp_describe(const kiln_trainer *t, char *buf, size_t cap);
/* The ZeRO stage of a rank (2 or 3), 0 without attach. */
int kiln_train_dp_stage(const kiln_trainer *t);
/* The run's rank count and this rank (1 and 0 without attach). */
int kiln_train_dp_size(const kiln_trainer *t);
int kiln_train_dp_rank(const kiln_trainer *t);

#endif
