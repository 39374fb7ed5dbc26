/* generate.h -- internal definition of the inference context. */
#ifndef KILN_GENERATE_H
#define KILN_GENERATE_H

#include "../models/model.h"

#define KILN_DEFAULT_MAX_CTX 4096

struct kiln_context {
    kiln_model *model;
    kiln_context_params params;
    kiln_backend *be;
    kiln_forward_state fs;
    int n_past;      /* tokens in the KV cache */
    int32_t *tokens; /* (n_ctx) the ids in the cache, for prefix reuse */
};

#endif
