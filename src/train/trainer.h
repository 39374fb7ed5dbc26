/* trainer.h -- internal accessors of kiln_trainer for the rest of train/ (export_hf.c), the CLI. */
#ifndef KILN_TRAIN_TRAINER_H
#define KILN_TRAIN_TRAINER_H

#include "../models/model.h"

/* The model the trainer was created from (config, architecture, tokenizer). */
const kiln_model *kiln_trainer_model(const kiln_trainer *t);
/* kiln_train_param_file_shape is public (include/kiln.h). */
/* The API boundary of a trainer call: t a live trainer (base/handle.h) whose backend is not
 * poisoned (KILN_ERR_POISONED otherwise), errors naming call. */
kiln_status kiln_trainer_enter(const kiln_trainer *t, const char *call);

/* kiln_train_load, and *notes (may be NULL) gets why newer checkpoints were passed over and
 * which were set aside (kiln_ckpt_open_for_resume; kiln_malloc'd text, one line each, or NULL
 * when none was), for the caller to show. */
kiln_status kiln_train_load_ex(kiln_trainer *t, const char *dir, uint64_t *step, char **run_json, char **notes);

#endif
