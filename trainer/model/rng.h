/* Small deterministic RNGs for the trainer (header-only).
 * - bt_rng: xoshiro256** (Blackman & Vigna 2018, https://prng.di.unimi.it/xoshiro256starstar.c),
 *   seeded through splitmix64 (same page), for parameter initialisation.
 * - bt_hash64 (common/rng.h): splitmix64 used as a counter-based generator, for dropout masks
 *   that must be regenerated identically in backward (and in activation-checkpoint recompute)
 *   without storing them. */
#ifndef BT_TRAINER_RNG_H
#define BT_TRAINER_RNG_H
#include <math.h>
#include <stdint.h>

#include "common/rng.h"

typedef struct {
    uint64_t s[4];
} bt_rng;

static inline void bt_rng_seed(bt_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) {
        x += 0x9e3779b97f4a7c15ULL;
        r->s[i] = bt_hash64(x);
    }
}

static inline uint64_t bt_rng_next(bt_rng *r) { return bt_xoshiro256ss_next(r->s); }

/* Uniform in [0, 1) with 24 random bits. */
static inline float bt_rng_uniform(bt_rng *r) {
    return (float)(bt_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

/* Standard normal (Box-Muller, one of the pair). */
static inline float bt_rng_normal(bt_rng *r) {
    double u1 = ((double)(bt_rng_next(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0,1] */
    double u2 = (double)(bt_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif
