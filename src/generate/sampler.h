/*
 * sampler.h -- internal hooks into the CPU sampler (src/generate/sampler.c) for samplers that
 * run the same definition elsewhere: a backend's sample op (ops.h) takes the parameters and
 * the random stream (ops/sampling.h) these return. C and C++ (kiln.h carries the extern "C"
 * guard).
 */
#ifndef KILN_SAMPLER_H
#define KILN_SAMPLER_H

#include "../ops/sampling.h"
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

/* s's stream (owned by s), for a sampler elsewhere that draws from it as kiln_sampler_sample
 * would (ops.h, sample). */
kiln_sample_rng *kiln_sampler_rng(kiln_sampler *s);

#ifdef __cplusplus
}
#endif

#endif /* KILN_SAMPLER_H */
