/* loaderd shard source: one shard file -> a stream of lines with (file, line number).
 * The file is read with read(2) into heap buffers (never mmap: a shard truncated by someone else
 * while we read it would raise SIGBUS on the mapped pages past the new end; read(2) just returns
 * fewer bytes). At most the size seen at open is read; a shard that ends early (truncated while
 * being read) or a read error is reported once as LD_SRC_IO. If it starts with a zstd frame magic
 * (28 B5 2F FD, RFC 8878 §3.1.1) or a skippable-frame magic (0x184D2A50..5F little-endian,
 * RFC 8878 §3.1.2) it is decoded with libzstd's streaming API (ZSTD_decompressStream; several
 * concatenated frames and skippable frames are handled by libzstd); otherwise it is plain JSONL.
 * Lines end at '\n'; a trailing '\r' is stripped (CRLF); a last line without '\n' is still a
 * line. Line numbers are 1-based and count every line of the decoded stream (blank lines too).
 * A line longer than the limit (default LD_SOURCE_MAX_LINE bytes, '\r' included) is skipped
 * and reported once as LD_SRC_TOO_LONG (its bytes are never buffered beyond the limit).
 * Corrupt or truncated zstd data is reported once as LD_SRC_ZSTD; a partial line pending at
 * that point is dropped with it, and the source then reports end of shard.
 * A source is used by one thread at a time. */
#ifndef LD_SOURCE_H
#define LD_SOURCE_H
#include <stddef.h>
#include <stdint.h>

#define LD_SOURCE_MAX_LINE ((size_t)16 << 20) /* 16 MiB */

typedef struct ld_source ld_source;

/* Result codes of ld_source_next (besides negative bt_err codes). */
enum {
    LD_SRC_END = 0,      /* no more lines in this shard */
    LD_SRC_LINE = 1,     /* *line / *len / *line_no hold a line */
    LD_SRC_TOO_LONG = 2, /* a line over the limit was skipped; *line_no is its number */
    LD_SRC_ZSTD = 3,     /* corrupt/truncated zstd; *line_no = number of the line it broke; the
                            message is in bt_last_error(); every later call returns LD_SRC_END */
    LD_SRC_IO = 4,       /* read error, or the file shrank below its size at open while being
                            read; *line_no = number of the line it broke (a partial line pending
                            is dropped with it); message in bt_last_error(); then LD_SRC_END */
};

/* Open `path` (copied). max_line: byte limit of one line (0 = LD_SOURCE_MAX_LINE).
 * Errors: BT_ERR_IO (open/fstat/read failed or not a regular file; message names the path),
 * BT_ERR_NOMEM. Holds one fd until ld_source_close (a shard deleted after open stays readable). */
int ld_source_open(ld_source **out, const char *path, size_t max_line);
/* Next line. On LD_SRC_LINE, *line points at `*len` bytes (no '\n', no trailing '\r', not
 * NUL-terminated) valid until the next call or ld_source_close; *line_no is 1-based.
 * Returns LD_SRC_* (>= 0) or BT_ERR_NOMEM. */
int ld_source_next(ld_source *s, const char **line, size_t *len, uint64_t *line_no);
/* 1 if the shard is zstd-compressed. */
int ld_source_is_zstd(const ld_source *s);
/* Call fn(ctx, bytes, n) on every block of raw (undecoded) file bytes as it is read, in file
 * order; set it before the first ld_source_next. The token cache hashes what it tokenized. */
void ld_source_observe(ld_source *s, void (*fn)(void *ctx, const void *p, size_t n), void *ctx);
/* Raw bytes read from the file so far, and the size at open (never read past). */
size_t ld_source_bytes_read(const ld_source *s);
size_t ld_source_size(const ld_source *s);
/* Free everything (NULL is fine). */
void ld_source_close(ld_source *s);

#endif
