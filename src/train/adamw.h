/*
 * adamw.h -- torch.optim.AdamW inside kiln, with storage variants, and gradient-norm clipping
 * with torch.nn.utils.clip_grad_norm_'s bits.
 *
 * The optimizer works on a list of named parameter tensors (it knows nothing of models):
 * each has n elements, the weights the model computes with (f32 or bf16, the caller's
 * memory, updated in place) and an f32 gradient (the caller's). The update is torch's
 * single-tensor AdamW in float32 operation order (docs/ARITHMETIC.md, "AdamW and clipping");
 * every element is updated alone, so the result never depends on the thread count.
 *
 * Storage variants (weights x moments, any combination):
 *   KILN_ADAMW_F32          f32 weights updated in place (the reference)
 *   KILN_ADAMW_BF16_MASTER  bf16 weights, f32 master copy; weights = RNE(master)
 *   KILN_ADAMW_BF16_KAHAN   bf16 weights + bf16 compensation c: the value is w + c
 *   KILN_ADAMW_BF16_SR      bf16 weights, seeded stochastic rounding, nothing else stored
 *   moments f32, or 8-bit blocks of 256 with an f32 absmax per block (log-scale codes).
 *
 * The arithmetic runs on a backend's AdamW ops (src/ops/adamw_op.h); the optimizer keeps the
 * names, the decay flags, the state's layout and its file format. Handles are used from one
 * thread at a time; the pool (may be NULL) parallelises a call of an optimizer made without a
 * backend.
 */
#ifndef KILN_TRAIN_ADAMW_H
#define KILN_TRAIN_ADAMW_H

#include "../base/base.h"
#include "../base/threadpool.h"
#include "../ops/adamw_math.h" /* kiln_adamw_weights, kiln_adamw_moments, KILN_ADAMW_Q8_BLOCK */
#include "../ops/ops.h"

typedef struct kiln_adamw_param {
    const char *name;   /* transformers' name; copied */
    int64_t n;          /* elements, >= 1 */
    void *weights;      /* (n) float for KILN_ADAMW_F32, else (n) uint16_t bf16; caller's */
    float *grad;        /* (n) the caller's; step reads it, clip scales it */
    uint16_t *w16;      /* NULL, or (n) bf16: a device optimizer with f32 weights also writes
                         * the updated weights rounded to bf16 (to nearest even) here, in the
                         * same pass (fast mode's bf16 copy of the weights, which a separate
                         * conversion would read all the weights again to make); elsewhere
                         * KILN_ERR_UNSUPPORTED */
} kiln_adamw_param;

/* One entry of an explicit weight-decay map: parameters not named in the map decay. */
typedef struct kiln_adamw_decay_rule {
    const char *name;
    int decay;          /* 1: weight decay applies, 0: excluded */
} kiln_adamw_decay_rule;

typedef struct kiln_adamw_config {
    /* hyperparameters as torch's Python floats (doubles); see ARITHMETIC.md for where each
     * is rounded to float */
    double lr, beta1, beta2, eps, weight_decay;
    kiln_adamw_weights weights;
    kiln_adamw_moments moments;
    uint64_t seed;                          /* stochastic rounding's seed */
    const kiln_adamw_decay_rule *decay_map; /* NULL: Trainer's default exclusions */
    int n_decay_map;
} kiln_adamw_config;

typedef struct kiln_adamw kiln_adamw;

/* Memory, in bytes, of each part (params: the caller's weights, counted for the report;
 * the others are owned by the optimizer and allocated at create). */
typedef struct kiln_adamw_memory {
    uint64_t params, master, moments, compensation;
    uint64_t owned; /* master + moments + compensation */
} kiln_adamw_memory;

/* torch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01; f32 storage. */
kiln_adamw_config kiln_adamw_default_config(void);

/* Trainer's default: 1 when weight decay applies to a parameter of this name, 0 when the
 * lowercased name matches one of transformers' get_decay_parameter_names patterns
 * ("bias", "layernorm", "rmsnorm", "(^|\.)norm($|\.)", "_norm($|\.)"). */
int kiln_adamw_default_decay(const char *name);

/* Create over n_params parameters (names unique). Moments start at 0, step at 0; the master
 * copy (BF16_MASTER) is the bf16 weights widened, the compensation (KAHAN) 0. A decay_map
 * naming a parameter that does not exist is an error. */
kiln_status kiln_adamw_create(const kiln_adamw_param *params, int n_params,
                              const kiln_adamw_config *cfg, kiln_adamw **out);
void kiln_adamw_free(kiln_adamw *o); /* NULL is a no-op */

/* kiln_adamw_create on a backend, whose AdamW ops (adamw_op.h) run every call, on its own
 * threads or stream (the pool arguments are ignored): weights and grads of params are backend
 * memory (device pointers for the CUDA backend), and the optimizer's state (moments, master
 * copy, compensation) is allocated in the backend's memory (kiln_backend_alloc). be NULL:
 * kiln_adamw_create; the CPU backend: the same arithmetic on host memory, run by its pool; a
 * backend without the ops: KILN_ERR_UNSUPPORTED. On the CUDA backend every entry point works:
 * step, grads_finite, grad_norm, clip_grads (the clip coefficient computed on the device, applied
 * without a host round trip), describe, get_moments/master/compensation (downloading),
 * state_size/save/load (download/upload), with the CPU's bits (the per-element arithmetic is
 * adamw_math.h, shared with the kernels) -- except grad_norm and clip_grads' norms on a fast
 * CUDA backend, which use a fixed chunked order in double (docs/TRAINING.md, "Fast mode";
 * deterministic, within half an ulp of the exact per-tensor norm). A device optimizer's work
 * is enqueued on the backend's stream (grads_finite, and therefore step,
 * wait for the finite check's result; clip_grads waits only when total_norm or coef is asked
 * for). A device step's update is one kernel launch over every parameter, whatever their
 * number (the tensor table is uploaded at create and at load).
 * Weights and grads that are not device memory are refused (KILN_ERR_INVALID_ARG); at most
 * 65535 parameters on the CUDA backend. The backend must outlive the optimizer. A state
 * saved by a device optimizer loads into a CPU one and vice versa. */
kiln_status kiln_adamw_create_on(kiln_backend *be, const kiln_adamw_param *params,
                                 int n_params, const kiln_adamw_config *cfg, kiln_adamw **out);

/* An optimizer over no parameters (a data-parallel rank whose range of the flat parameter
 * vector holds no parameter of this optimizer's kind): every call succeeds and does nothing
 * (a step only counts), describe says 0 bytes; cfg is checked as create checks it. */
kiln_status kiln_adamw_create_empty(kiln_backend *be, const kiln_adamw_config *cfg, kiln_adamw **out);

void kiln_adamw_set_lr(kiln_adamw *o, double lr);
double kiln_adamw_get_lr(const kiln_adamw *o);
int64_t kiln_adamw_get_step(const kiln_adamw *o); /* torch's state["step"]: updates done */
int kiln_adamw_param_decays(const kiln_adamw *o, int i);

/* KILN_OK when every gradient is finite, else KILN_ERR_RANGE naming the first (lowest
 * parameter index, then element) non-finite one. */
kiln_status kiln_adamw_grads_finite(const kiln_adamw *o, kiln_pool *pool);

/* One AdamW update of every parameter. Checks the gradients first (grads_finite): on a
 * non-finite gradient nothing (weights, moments, step) is touched. */
kiln_status kiln_adamw_step(kiln_adamw *o, kiln_pool *pool);

/* kiln_adamw_step without its check, for a caller that has just had KILN_OK from
 * kiln_adamw_grads_finite on the same gradients (the trainer checks both of its optimizers
 * before updating either): the check reads every gradient once more. */
kiln_status kiln_adamw_step_checked(kiln_adamw *o, kiln_pool *pool);

/* The following steps use coef * g for each stored gradient g (one f32 product: the bits of
 * multiplying the gradients first, as clip_grads does), leaving the stored gradients as they
 * are; coef 1 (the default) turns it off. For a caller that defers a clip coefficient: coef
 * must be in [0, 1] (so that coef * g is finite exactly where g is, and grads_finite's
 * answer holds for the products); else KILN_ERR_INVALID_ARG and nothing changes. */
kiln_status kiln_adamw_set_grad_scale(kiln_adamw *o, float coef);

/* A line such as "adamw: bf16 weights + f32 master, 8-bit moments: ..." with the memory of
 * each part (written to buf when buf != NULL, truncated to cap) and the figures in *mem
 * (when mem != NULL). */
void kiln_adamw_describe(const kiln_adamw *o, char *buf, size_t cap, kiln_adamw_memory *mem);

/* Read back state for tests and export: the moments of parameter i dequantized to f32
 * (m, v: n floats each, either may be NULL), the master copy (NULL unless BF16_MASTER) and
 * the compensation (NULL unless KAHAN). For a device optimizer (kiln_adamw_create_on with
 * the CUDA backend) get_moments downloads into the caller's host arrays, and master /
 * compensation download into a host mirror the optimizer owns: the pointer stays valid until
 * the next master/compensation call for the same parameter or kiln_adamw_free; NULL, with the
 * error set, when the download fails. */
kiln_status kiln_adamw_get_moments(const kiln_adamw *o, int i, float *m, float *v);
const float *kiln_adamw_master(const kiln_adamw *o, int i);
const uint16_t *kiln_adamw_compensation(const kiln_adamw *o, int i);

/* Host optimizers with f32 moments (NULL otherwise, or when the array does not exist): slot
 * i's state array in place, n floats: which 0 the first moment m, 1 the second v, 2 the
 * master copy (BF16_MASTER); kiln_adamw_state_comp the Kahan compensation (n bf16). For the
 * data-parallel trainer, which moves shards of the state between ranks. */
float *kiln_adamw_state_f32(kiln_adamw *o, int i, int which);
uint16_t *kiln_adamw_state_comp(kiln_adamw *o, int i);

/* Write parameter i's moments (n floats each, both given; finite, v >= 0, as a step leaves
 * them): f32 moments stored exactly, 8-bit moments quantized per block as the step stores them
 * (lossy; a dequantized read of 8-bit moments quantizes back to the same codes and scales
 * only where the block's absmax element is one of its values, so do not rely on a round trip).
 * Checked before anything is written; a device optimizer uploads. */
kiln_status kiln_adamw_set_moments(kiln_adamw *o, int i, const float *m, const float *v);
/* Write parameter i's master copy (n floats; BF16_MASTER) or Kahan compensation (n bf16;
 * KAHAN): copied on the host, uploaded by a device optimizer. KILN_ERR_STATE when the storage
 * keeps no such array. For loading a set of shards into a GPU trainer. */
kiln_status kiln_adamw_set_master(kiln_adamw *o, int i, const float *master);
kiln_status kiln_adamw_set_compensation(kiln_adamw *o, int i, const uint16_t *comp);

/* Set the step count (torch's state["step"]: updates done), 0 <= step <= 2^24 (torch keeps
 * it as a float32 tensor, exact up to there); the next step's bias corrections use step + 1. */
kiln_status kiln_adamw_set_step(kiln_adamw *o, int64_t step);

/* Whether a per-parameter weight decay wd (n_params values; a negative entry stands for the
 * parameter's own) can be applied: the optimizer's
 * own (kiln_adamw_param_decays x its weight_decay) always; any other where the weight AdamW
 * updates is an f32 array (KILN_ADAMW_F32: the weights; BF16_MASTER: the master copy), as
 * kiln_adamw_step_decay does it. KILN_ERR_UNSUPPORTED naming the parameter otherwise, and
 * KILN_ERR_INVALID_ARG for a value that is not finite. */
kiln_status kiln_adamw_check_decay(const kiln_adamw *o, const double *wd);

/* kiln_adamw_step_checked with parameter i's weight decay wd[i] (torch's param group
 * weight_decay) in place of the optimizer's decay rule. Where wd differs from the optimizer's
 * own, the decay runs as a pass before the update: the f32 array the update reads (weights, or
 * master copy) multiplied by float(1 - lr * wd[i]) (where wd[i] != 0), then the update without
 * decay: the same binary32 product the update makes (torch's param.mul_(1 - lr * wd) before
 * its Adam step), so the same bits. The caller has checked the gradients and
 * kiln_adamw_check_decay. */
kiln_status kiln_adamw_step_decay(kiln_adamw *o, kiln_pool *pool, const double *wd);

/* ---- state save / restore ---------------------------------------------------------------
 * The state is: magic "KILNADMW", version, storage configuration, seed, hyperparameters,
 * step, the parameter list (names, sizes, decay flags), then per parameter the moments and
 * the master copy or compensation, then "ADMWEND\0". Little-endian hosts only. */
typedef kiln_status (*kiln_adamw_write_fn)(void *ctx, const void *data, size_t n);

/* Bytes save writes. */
uint64_t kiln_adamw_state_size(const kiln_adamw *o);
kiln_status kiln_adamw_save(const kiln_adamw *o, kiln_adamw_write_fn write, void *ctx);
/* Restore from a saved state (size bytes). Refused, with nothing changed, when the storage
 * configuration or the parameter list (names, sizes, order) differs, or the data is
 * malformed. Hyperparameters (lr, betas, eps, weight decay, decay flags) are restored as
 * torch's load_state_dict does. */
kiln_status kiln_adamw_load(kiln_adamw *o, const void *data, size_t size);

/* ---- gradient norm and clipping (torch.nn.utils.clip_grad_norm_, norm_type 2) ------------ */

/* torch's float32 2-norm of one tensor on the CPU: 8 lanes, docs/ARITHMETIC.md. */
float kiln_grad_norm_torch(const float *g, int64_t n);

/* kiln_adamw_sumsq8 (torch's 8-lane sum of squares of one tensor) fed in pieces: a tensor's
 * elements given in increasing order, in any split, end with the same bits as the whole
 * tensor at once, so a tensor cut between data-parallel ranks gets its one-process sum when
 * each rank passes the state on to the next (docs/DISTRIBUTED.md, "The gradient norm"). */
typedef struct kiln_sumsq8_state {
    float acc[8]; /* the lanes of the full groups of 8 */
    float sum;    /* once combined: the lanes' sum, then the tail elements added */
    int32_t combined;
} kiln_sumsq8_state;
void kiln_sumsq8_begin(kiln_sumsq8_state *st);
/* g: (len) elements e0 .. e0 + len - 1 of a tensor of n elements. When they end the tensor
 * st->sum is its sum of squares. */
void kiln_sumsq8_feed(kiln_sumsq8_state *st, const float *g, int64_t e0, int64_t len, int64_t n);

/* Per-tensor norms (norms: n_params floats, may be NULL) and the total norm, the norm of the
 * per-tensor norms, as torch computes them. *sq_norm (may be NULL) gets the total norm's sum
 * of squares before the square root (its grad_sq_norm). */
kiln_status kiln_adamw_grad_norm(const kiln_adamw *o, kiln_pool *pool, float *norms,
                                 float *total, float *sq_norm);
/* clip_coef_clamped = min((1 / (total + 1e-6f)) * max_norm, 1), torch's bits. */
float kiln_clip_coef(float total_norm, double max_norm);
/* Compute the total norm, then multiply every gradient by the clamped coefficient (always,
 * as torch does). Outputs may be NULL. */
kiln_status kiln_adamw_clip_grads(kiln_adamw *o, kiln_pool *pool, double max_norm,
                                  float *total_norm, float *coef);

#endif /* KILN_TRAIN_ADAMW_H */
