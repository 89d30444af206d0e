/* The two small deterministic generators BarqTrain uses everywhere (header-only; usable from
 * CUDA device code too, so CPU and GPU dropout masks come from the same function).
 * - splitmix64 (Steele, Lea & Flood 2014; Vigna's https://prng.di.unimi.it/splitmix64.c):
 *   bt_hash64(x) is its output for state x, i.e. the finaliser applied to x + golden ratio;
 *   it also serves as a counter-based generator (hash of a counter).
 * - xoshiro256** (Blackman & Vigna 2018, https://prng.di.unimi.it/xoshiro256starstar.c):
 *   bt_xoshiro256ss_next advances a 4-word state and returns the next output. */
#ifndef BT_COMMON_RNG_H
#define BT_COMMON_RNG_H
#include <stdint.h>

#ifdef __CUDACC__
#define BT_RNG_FN static inline __host__ __device__
#else
#define BT_RNG_FN static inline
#endif

#define BT_GOLDEN64 0x9e3779b97f4a7c15ULL

/* splitmix64 output for state x (the state itself is not advanced). */
BT_RNG_FN uint64_t bt_hash64(uint64_t x) {
    x += BT_GOLDEN64;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* splitmix64 next(): returns the output for *state and advances it. */
BT_RNG_FN uint64_t bt_splitmix64_next(uint64_t *state) {
    uint64_t r = bt_hash64(*state);
    *state += BT_GOLDEN64;
    return r;
}

/* xoshiro256** next() on state s[4] (must not be all zero). */
BT_RNG_FN uint64_t bt_xoshiro256ss_next(uint64_t s[4]) {
    const uint64_t x = s[1] * 5;
    const uint64_t res = ((x << 7) | (x >> 57)) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return res;
}

#undef BT_RNG_FN
#endif
