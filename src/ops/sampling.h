/*
 * sampling.h -- the random stream of kiln's sampler (docs/ARITHMETIC.md, "Sampling"), in the
 * ops layer so that a backend's device sampler (the table's sample op, ops.h) draws exactly
 * what the CPU sampler (src/generate/sampler.c) draws, without knowing the sampler object:
 * xoshiro256** seeded with four splitmix64 outputs of the seed, and u = (x >> 40) * 2^-24 in
 * [0, 1) (24 random bits: exact in float32). C and C++.
 */
#ifndef KILN_OPS_SAMPLING_H
#define KILN_OPS_SAMPLING_H

#include <stdint.h>

/* xoshiro256**'s state. */
typedef struct kiln_sample_rng {
    uint64_t s[4];
} kiln_sample_rng;

/* splitmix64: advance *x and return its next output. */
static inline uint64_t kiln_sample_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The stream of a sampler created with this seed. */
static inline void kiln_sample_rng_seed(kiln_sample_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = kiln_sample_splitmix64(&x);
}

static inline uint64_t kiln_sample_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256**: the next 64 bits. */
static inline uint64_t kiln_sample_rng_next(kiln_sample_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = kiln_sample_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = kiln_sample_rotl(s[3], 45);
    return result;
}

/* The next u in [0, 1): the one draw a non-greedy token consumes. */
static inline float kiln_sample_rng_u(kiln_sample_rng *r) {
    return (float)(kiln_sample_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

#endif /* KILN_OPS_SAMPLING_H */
