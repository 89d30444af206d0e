/* libFuzzer target: the safetensors reader (common/safetensors.h) on hostile files: the input
 * is the whole file, held in a memfd and opened through /proc/self/fd/N (bt_st_open maps it, as
 * it maps model and adapter files; no disk traffic).
 * Invariants: never crashes, leaks or reads outside the file (ASan); a refusal has a message;
 * an accepted file has tensors in data-offset order that tile the data buffer exactly (each
 * starts where the previous ends, the last ends at the file's end), nbytes = numel x dtype
 * size, 0..8 dimensions, every tensor found by its name, metadata values readable, and
 * bt_st_check reports no change. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/safetensors.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    bt_log_set_level(BT_LOG_ERROR);
    int fd = memfd_create("fuzz-st", MFD_CLOEXEC);
    if (fd < 0) fuzz_fail("memfd_create");
    for (size_t off = 0; off < size;) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) fuzz_fail("write to memfd failed");
        off += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    bt_st_file *f = NULL;
    if (bt_st_open(&f, path)) {
        if (!bt_last_error()[0]) fuzz_fail("refused without a message");
        if (f) fuzz_fail("refused but returned a handle");
        close(fd);
        return 0;
    }
    uint64_t hn;
    memcpy(&hn, data, 8);
    const uint8_t *buf = NULL;
    size_t expect = 0;
    for (int i = 0; i < bt_st_n_tensors(f); i++) {
        const bt_st_tensor *t = bt_st_tensor_at(f, i);
        if (!t || t->n_dims < 0 || t->n_dims > 8) fuzz_fail("tensor with bad dimensions");
        uint64_t numel = 1;
        for (int d = 0; d < t->n_dims; d++) {
            if (t->shape[d] < 0) fuzz_fail("negative dimension");
            numel *= (uint64_t)t->shape[d];
        }
        if (numel * bt_st_dtype_size(t->dtype) != t->nbytes) fuzz_fail("nbytes != numel x dtype size");
        if (i == 0) buf = (const uint8_t *)t->data - 0; /* the mapping's data buffer start */
        if ((size_t)((const uint8_t *)t->data - buf) != expect) fuzz_fail("tensors do not tile the buffer");
        expect += t->nbytes;
        if (bt_st_find(f, t->name) != t) fuzz_fail("find disagrees with tensor_at");
        if (t->nbytes) { /* touch the first and last byte: inside the mapping */
            volatile uint8_t x = ((const uint8_t *)t->data)[0];
            x = ((const uint8_t *)t->data)[t->nbytes - 1];
            (void)x;
        }
    }
    if (8 + hn + expect != size) fuzz_fail("tensors do not end at the file's end");
    (void)bt_st_metadata(f, "format");
    if (bt_st_check(f, 0) != 0) fuzz_fail("the file changed under us");
    bt_st_close(f);
    close(fd);
    return 0;
}
