/* trainer.h -- internal accessors of kiln_trainer for other kiln layers (export). */
#ifndef KILN_TRAIN_TRAINER_H
#define KILN_TRAIN_TRAINER_H

#include "../models/model.h"

/* The model the trainer was created from (config, architecture, tokenizer). */
const kiln_model *kiln_trainer_model(const kiln_trainer *t);

#endif
