/* BarqTrain common: error codes, thread-local error messages, logging, timing.
 * Every library function in BarqTrain returns 0 (BT_OK) on success or a negative bt_err,
 * and on failure leaves a human-readable message retrievable with bt_last_error()
 * (thread-local, overwritten by the next failure on the same thread). */
#ifndef BT_COMMON_H
#define BT_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <stdarg.h>

typedef enum {
    BT_OK = 0,
    BT_ERR_IO = -1,          /* open/read/write/mmap failed (errno text in the message) */
    BT_ERR_FORMAT = -2,      /* malformed file or message: lying header, truncation, bad magic */
    BT_ERR_NOMEM = -3,       /* allocation failed */
    BT_ERR_RANGE = -4,       /* offset/size/index out of range */
    BT_ERR_UNSUPPORTED = -5, /* valid but not supported (unknown dtype, version) */
    BT_ERR_INVALID = -6,     /* invalid argument or configuration value */
    BT_ERR_NOTFOUND = -7,    /* missing key / tensor / file */
    BT_ERR_TIMEOUT = -8,     /* wait timed out */
    BT_ERR_CLOSED = -9,      /* peer closed / stream ended */
    BT_ERR_CANCELLED = -10,  /* stopped on request (a signal, another rank's failure) */
} bt_err;

/* Static name of an error code ("io", "format", ...). Never NULL. */
const char *bt_strerror(int err);

/* Record a printf-style message as this thread's last error and return `err` (so callers can
 * write `return bt_fail(BT_ERR_FORMAT, "gguf: %s: bad magic", path);`). */
int bt_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* This thread's last error message ("" if none). Valid until the next bt_fail on this thread. */
const char *bt_last_error(void);

enum { BT_LOG_DEBUG = 0, BT_LOG_INFO = 1, BT_LOG_WARN = 2, BT_LOG_ERROR = 3 };
/* Minimum level printed (default BT_LOG_INFO; env BT_LOG_LEVEL=debug|info|warn|error overrides). */
void bt_log_set_level(int level);
/* Log one line to stderr: "<ISO time> <level> <component>: message". Thread-safe. */
void bt_log(int level, const char *component, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Monotonic clock in seconds (CLOCK_MONOTONIC). */
double bt_now(void);

/* Allocation helpers that abort with a message on OOM (use for small bookkeeping only;
 * large tensors use bt_aligned_alloc and check for NULL). */
void *bt_xmalloc(size_t n);
void *bt_xcalloc(size_t n, size_t size);
void *bt_xrealloc(void *p, size_t n);
char *bt_xstrdup(const char *s);
/* 64-byte aligned, zero-filled allocation; NULL on failure. Free with free(). */
void *bt_aligned_alloc(size_t n);

/* FNV-1a 64-bit hash (http://www.isthe.com/chongo/tech/comp/fnv/), chainable via `h`
 * (start with BT_FNV64_INIT). */
#define BT_FNV64_INIT 0xcbf29ce484222325ULL
uint64_t bt_fnv1a64(uint64_t h, const void *data, size_t n);

/* Read-only memory map of a whole file. size 0 files map to data == NULL, size == 0. */
typedef struct {
    const uint8_t *data;
    size_t size;
} bt_map;
/* Map `path` (a regular file) read-only, MAP_PRIVATE; the fd is closed before returning.
 * *m owns the mapping until bt_map_close. Errors: BT_ERR_IO (open/fstat/mmap failed, or not a
 * regular file; message names the path), *m left empty. A file truncated by someone else while
 * mapped raises SIGBUS on access past its new end: use it for model/tokenizer files, never for
 * data that others may rewrite (loaderd/source.c reads shards with read(2) for that reason). */
int bt_map_open(bt_map *m, const char *path);
/* Unmap (an empty or already closed map is fine) and reset *m. */
void bt_map_close(bt_map *m);

#endif
