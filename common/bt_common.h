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
    BT_ERR_DIVERGED = -11,   /* training diverged: non-finite loss, gradients or parameters */
} bt_err;

/* Record a printf-style message as this thread's last error and return `err` (so callers can
 * write `return bt_fail(BT_ERR_FORMAT, "gguf: %s: bad magic", path);`). A leading part written
 * twice by wrapping ("token cache: token cache: x") is kept once; callers that wrap a message in
 * the middle use bt_last_error_in. */
int bt_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* This thread's last error message ("" if none). Valid until the next bt_fail on this thread. */
const char *bt_last_error(void);

/* bt_last_error() without a leading "<part>: " when the message already carries it, for a caller
 * that wraps the message in its own context with the same part name: `bt_fail(rc, "model: %s:
 * %s", path, bt_last_error_in("model"))` gives "model: x.gguf: RoPE ...", not "model: x.gguf:
 * model: RoPE ...". part: the component prefix without ": ". Same lifetime as bt_last_error(). */
const char *bt_last_error_in(const char *part);

/* ---- text that reaches a terminal, a log line or a metric label ----
 * "Unsafe" characters: the C0 controls (U+0000..U+001F: newline, ESC, BEL, ...), DEL, the C1
 * controls (U+0080..U+009F, e.g. U+009B, a one-character CSI) and the bidirectional formatting
 * characters (U+061C, U+200E, U+200F, U+202A..U+202E, U+2066..U+2069: they reorder what a
 * terminal shows, CVE-2021-42574), and every byte that is not part of valid UTF-8 (RFC 3629).
 * A string holding none of them prints as itself: it cannot end a line, forge another, move
 * the cursor, retitle a window (OSC), ring the bell or reorder the text around it. */
/* Offset of the first unsafe character of s[0..n) (n when there is none); *cp (may be NULL) gets
 * its code point, or -1 - byte for a byte of invalid UTF-8. */
size_t bt_text_unsafe(const char *s, size_t n, int32_t *cp);
/* Copy s[0..n) into dst (cap bytes, always NUL-terminated when cap > 0) with each unsafe
 * character made visible: \n \t \r, \xNN for other C0 controls, DEL and invalid bytes, \uNNNN
 * for C1 and bidirectional controls; whole characters only (cut short when dst is full). Returns
 * the bytes written (without the NUL). bt_log applies it to every message. */
size_t bt_escape_text(char *dst, size_t cap, const char *s, size_t n);

enum { BT_LOG_DEBUG = 0, BT_LOG_INFO = 1, BT_LOG_WARN = 2, BT_LOG_ERROR = 3 };
/* Minimum level printed (default BT_LOG_INFO; env BT_LOG_LEVEL=debug|info|warn|error overrides). */
void bt_log_set_level(int level);
/* Log one line to stderr: "<ISO time> <level> <component>: message"; when stderr is journald's
 * stream ($JOURNAL_STREAM, systemd.exec(5)) "<N><component>: message" instead, N the syslog
 * priority (7 debug, 6 info, 4 warn, 3 error: sd-daemon(3)), so `journalctl -p warning` filters by
 * level and the journal's own timestamp is the only one. The message is passed through
 * bt_escape_text (one event is one line, whatever it quotes) and written without a leading part
 * it repeats ("x: x: " or "<component>: "). Thread-safe. */
void bt_log(int level, const char *component, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Monotonic clock in seconds (CLOCK_MONOTONIC). */
double bt_now(void);
/* CPU seconds this process has used so far, user + system, all threads (clock_gettime
 * CLOCK_PROCESS_CPUTIME_ID); 0 when the clock fails. Beside a wall time it tells what a phase
 * cost when other processes share the CPUs (its wall time grows with their load, this much less). */
double bt_cpu_s(void);

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

/* ---- reading files that others may change under us ----
 * Model files (GGUF, safetensors) are large and are memory-mapped; everything small (JSON
 * configs, tokenizer.json, checkpoints' trainer_state.bin) is read into private memory with
 * bt_read_file. Either way a file that is truncated, overwritten in place or replaced by
 * someone else while we read it gives a clear error for that request or run and can never
 * kill the process (issue 10 §1): a read past a new end of a mapping would raise SIGBUS; a
 * process-wide SIGBUS handler (installed by bt_map_open when it is not the current one,
 * chained to the disposition it replaced for every other address) maps zero pages over the
 * rest of the mapping, marks it, and lets the read go on; bt_map_check then reports the
 * change. Readers call it before they use what they read (bt_gguf_check, bt_st_check). */

/* The one safe open of a file to read (every file loaderd reads, every model file the trainer
 * reads): O_RDONLY | O_CLOEXEC | O_NONBLOCK, so a FIFO put where a file was expected never
 * hangs the open (nor the thread, nor the event loop, nor a SIGTERM waiting for them); then only
 * a regular file is kept: a directory, FIFO, socket or device is refused, and so is a file on a
 * pseudo filesystem (procfs, sysfs, debugfs, tracefs, cgroupfs, ...: views of kernel state whose
 * sizes say nothing of what a read returns, e.g. 0 bytes for /proc/self/status; magic numbers
 * from <linux/magic.h>). Symbolic links: with BT_OPEN_LINKS_OK followed (an operator's own
 * file, e.g. loaderd's --config); with BT_OPEN_NO_LINKS refused in every component; otherwise
 * as bt_open_refuse_symlinks says (loaderd turns refusal on: every path it opens was resolved
 * and checked against its roots before, so a link found at open time was swapped in afterwards
 * to lead the read elsewhere). Refusal: openat2 RESOLVE_NO_SYMLINKS (Linux >= 5.6; O_NOFOLLOW on
 * the last component where openat2 is missing).
 * Returns the fd (and *st_out when not NULL: its fstat), or -1 with errno set (ELOOP for a
 * refused link, EISDIR / ENXIO for what is not a regular file, else open's) and the reason in
 * bt_last_error() ("<path>: not a regular file (a FIFO)", "<path>: not a regular file (on procfs,
 * a pseudo filesystem ...)", "<path>: No such file or directory", ...; BT_ERR_IO). */
enum { BT_OPEN_LINKS_OK = 1u, BT_OPEN_NO_LINKS = 2u };
struct stat;
int bt_open_file(const char *path, unsigned flags, struct stat *st_out);
/* bt_open_file(path, 0, NULL). */
int bt_open_ro(const char *path);
/* Process-wide switch for bt_open_file without a link flag (default off: links followed). */
void bt_open_refuse_symlinks(int on);
/* Name of the pseudo filesystem `path` lies on ("procfs", "sysfs", ...; the list bt_open_file
 * refuses), NULL for any other filesystem or when it cannot be stat'ed. Static string. Checks
 * made before a file is opened (loaderd's attach) use it to refuse with the same reason. */
const char *bt_pseudo_fs(const char *path);

/* Read-only memory map of a whole file. size 0 files map to data == NULL, size == 0. */
typedef struct {
    const uint8_t *data;
    size_t size;
    int fd;        /* kept open to notice in-place changes (fstat); -1 when closed */
    int guard;     /* 1 + slot in the SIGBUS guard table, 0 when none */
    char *path;    /* for messages (owned) */
    int64_t mtime_ns; /* st_mtim at open */
} bt_map;
/* Map `path` (a regular file) read-only, MAP_PRIVATE, guarded against SIGBUS (above).
 * *m owns the mapping (and one fd) until bt_map_close. Errors: BT_ERR_IO (open/fstat/mmap
 * failed, or not a regular file; message names the path), BT_ERR_NOMEM (more than 4096 files
 * mapped at once), *m left empty.
 * Test hook: bt_test_pause_point(path) once mapped. Opened with bt_open_file (so only a
 * regular file on a real filesystem; links as bt_open_refuse_symlinks says). */
int bt_map_open(bt_map *m, const char *path);
/* Test hook (a no-op unless both variables are set): when $BT_TEST_MAP_PAUSE_DIR names a
 * directory holding the FIFOs "mapped" and "resume" and `path` contains
 * $BT_TEST_MAP_PAUSE_MATCH, writes "<path>\n" to "mapped" and waits for one byte on "resume".
 * bt_map_open calls it once a file is mapped and loaderd's shard reader once a shard is open,
 * so process-level tests truncate or replace the file in between, deterministically; the
 * adapter and checkpoint writers call it with their temporary directory just before it is
 * renamed into place, so tests SIGKILL a save mid-write. */
void bt_test_pause_point(const char *path);
/* Whether the file changed under the mapping since bt_map_open: a page past a new end was
 * touched (it read as zeros), or the file's size or mtime differ now (truncated, rewritten or
 * overwritten in place; a file replaced by rename is not a change: we hold the old one).
 * Returns `rc` when it did not (callers pass the result of their reading, so a parse error
 * stays theirs), else BT_ERR_IO with "<path>: changed while being read (...): nothing read from
 * it is used; retry once the file is complete" — the change, not what the zeros led to, is
 * the error. An empty or closed map returns rc. */
int bt_map_check(const bt_map *m, int rc);
/* Unmap and close (an all-zero, failed or already closed map is fine) and reset *m. */
void bt_map_close(bt_map *m);

/* Read a whole regular file into a malloc'd buffer (*out, NUL-terminated for text use; *len
 * bytes excluding the NUL) with read(2). Its size is checked (fstat) before anything is read or
 * allocated: files over max_bytes are refused with BT_ERR_RANGE naming the limit, so a huge or
 * sparse file never costs its size in memory. Every caller names the largest file it expects
 * (max_bytes 0 is BT_ERR_INVALID: there is no unbounded whole-file read). BT_ERR_IO when it
 * cannot be opened/read, is not a regular file, or shrank/grew/changed while being read (the
 * message says so). *out = NULL on error. */
int bt_read_file(const char *path, size_t max_bytes, char **out, size_t *len);
/* The same from an open fd (not closed; read from its current offset, which should be 0);
 * `path` names it in messages. */
int bt_read_fd(int fd, const char *path, size_t max_bytes, char **out, size_t *len);

/* 1 if every one of the n floats is finite; else 0 and *first (may be NULL) = the index of the
 * first nan/inf. Writers use it so that no non-finite tensor is ever written (issue 10 §4). */
int bt_all_finite_f32(const float *x, size_t n, size_t *first);

#endif
