/* Shared helpers of the libFuzzer targets in tests/fuzz (built by `make fuzz`, run by
 * tests/fuzz/run.sh). The tokenizer comes from $BT_MODEL (default
 * models/SmolLM2-135M-Instruct.Q4_1.gguf relative to the working directory): the real model
 * vocabulary, loaded once per process. A violated invariant calls fuzz_fail, which prints the
 * message and aborts so libFuzzer records the input as a crash. */
#ifndef BT_FUZZ_COMMON_H
#define BT_FUZZ_COMMON_H
#include <stdio.h>
#include <stdlib.h>

#include "common/bt_common.h"
#include "common/tokenizer.h"

#define FUZZ_DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static inline void fuzz_fail(const char *what) {
    fprintf(stderr, "fuzz invariant violated: %s\n", what);
    abort();
}

/* The model's tokenizer (exits with a message when it cannot be loaded: a setup error, not a
 * finding). */
static inline const bt_tokenizer *fuzz_tokenizer(void) {
    static bt_tokenizer *tok;
    if (!tok) {
        const char *path = getenv("BT_MODEL");
        if (!path || !*path) path = FUZZ_DEFAULT_MODEL;
        bt_log_set_level(BT_LOG_ERROR);
        if (bt_tokenizer_load(&tok, path)) {
            fprintf(stderr, "fuzz: cannot load the tokenizer from %s (set BT_MODEL): %s\n", path, bt_last_error());
            exit(2);
        }
    }
    return tok;
}

#endif
