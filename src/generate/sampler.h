/*
 * sampler.h -- internal hooks into the CPU sampler (src/generate/sampler.c) for samplers that
 * run the same definition elsewhere (the device sampler, src/ops/cuda/cuda_sampling.h).
 * C and C++ (kiln.h carries the extern "C" guard).
 */
#ifndef KILN_SAMPLER_H
#define KILN_SAMPLER_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The parameters s was created with (owned by s). */
const kiln_sampler_params *kiln_sampler_get_params(const kiln_sampler *s);

/* Advance s's xoshiro256** stream by one draw and return u = (x >> 40) * 2^-24 in [0, 1):
 * exactly the u that kiln_sampler_sample would consume for its next non-greedy token. A
 * caller that samples elsewhere with this u keeps s's stream where the CPU keeps it. */
float kiln_sampler_draw_u(kiln_sampler *s);

#ifdef __cplusplus
}
#endif

#endif /* KILN_SAMPLER_H */
