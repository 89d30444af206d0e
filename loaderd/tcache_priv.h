/* loaderd token cache internals shared by tcache.c (directory, keys, locks, eviction, building,
 * acquire) and tcache_entry.c (entry reader and writer), and the fuzz target. Not a public API;
 * the format is described in loaderd/tcache.h. */
#ifndef LD_TCACHE_PRIV_H
#define LD_TCACHE_PRIV_H
#include <openssl/evp.h>
#include <pthread.h>
#include <sys/types.h>

#include "common/atomic_io.h"
#include "loaderd/tcache.h"

#define TC_HEADER_BYTES 64
#define TC_BLOCK_HEADER_BYTES 48
#define TC_TRAILER_BYTES 72
#define TC_MAX_RAW ((size_t)256 << 20)   /* largest raw block a reader accepts */
#define TC_BLOCK_RECORDS 4096u           /* a writer flushes a block at this many records */
#define TC_BLOCK_BYTES ((size_t)1 << 20) /* ... or at this many raw bytes */
#define TC_MAGIC "BTTKCACH"
#define TC_BLOCK_MAGIC 0x42434254u   /* "BTCB" */
#define TC_TRAILER_MAGIC 0x45434254u /* "BTCE" */
#define TC_VERSION 1u
#define TC_MSG_MAX 119

enum { TC_DOC = 0, TC_BAD = 1, TC_SHARD_ERROR = 2, TC_PREF = 3 };

/* SHA-256 (OpenSSL EVP). */
typedef struct {
    EVP_MD_CTX *md;
} tc_sha;
int tc_sha_init(tc_sha *s); /* BT_ERR_NOMEM */
void tc_sha_update(tc_sha *s, const void *p, size_t n);
void tc_sha_final(tc_sha *s, uint8_t out[32]); /* also frees */
void tc_sha_free(tc_sha *s);
/* update callback shape (bt_tokenizer_digest, ld_source_observe) */
void tc_sha_cb(void *ctx, const void *p, size_t n);

/* "<dir>/v1/<k0k1>/<k>" + suffix (".btc", ".lock"), malloc'd; creates the <k0k1> directory
 * when mkdirs is set (best effort). */
char *tc_path(const ld_tcache *c, const uint8_t key[32], const char *suffix, int mkdirs);

/* Mark a key as read by this process (protects it from eviction) / release it. */
void tc_inuse_add(ld_tcache *c, const uint8_t key[32]);
void tc_inuse_del(ld_tcache *c, const uint8_t key[32]);

/* ---- tcache_entry.c ---- */
enum { TC_OPEN_OK = 0, TC_OPEN_MISSING = 1, TC_OPEN_BAD = 2 };
/* Open and check the entry at path for key: TC_OPEN_OK (*out), TC_OPEN_MISSING, TC_OPEN_BAD
 * (damaged or stale: counted in c's stats and removed). vocab: ids must be below it. */
int tc_reader_open(ld_tcache *c, const char *path, const uint8_t key[32], int32_t vocab, ld_tc_reader **out);

typedef struct {
    bt_atomic_file af;
    tc_sha chain;
    uint8_t *raw, *z;
    size_t raw_len, raw_cap, z_cap;
    uint32_t n_in_block;
    uint64_t n_records, n_blocks, last_line, bytes;
    int failed;
} tc_writer;
/* Start writing the entry for key at path (a temporary file until tc_writer_commit). BT_OK or
 * BT_ERR_IO / BT_ERR_NOMEM (message names the file). */
int tc_writer_open(tc_writer *w, const char *path, const uint8_t key[32], uint64_t shard_size);
/* Append a document (n ids, mask 0/1) or a bad line / shard error (kind TC_BAD / TC_SHARD_ERROR,
 * reason, message truncated to TC_MSG_MAX bytes). line_no must increase. BT_OK or BT_ERR_*. */
int tc_writer_doc(tc_writer *w, uint64_t line_no, const int32_t *ids, const int32_t *mask, size_t n);
int tc_writer_bad(tc_writer *w, int kind, uint64_t line_no, int reason, const char *msg);
/* Append a rendered preference / kto record (ld_format_pref_render's output: rec->n_docs documents
 * concatenated in ids / mask, sum of rec->len tokens). BT_OK or BT_ERR_*. */
int tc_writer_pref(tc_writer *w, uint64_t line_no, const ld_pref_rec *rec, const int32_t *ids, const int32_t *mask);
/* Flush, write the trailer and put the file in place. BT_OK or BT_ERR_IO; releases w. */
int tc_writer_commit(tc_writer *w, uint64_t n_lines, uint64_t n_blank);
void tc_writer_abort(tc_writer *w);

/* ---- tcache.c ---- */
/* Tokenize shard sh into the entry at path (key, shard content SHA-256 and size as hashed for
 * the key) with n_threads workers. BT_OK when written, LD_TC_BYPASS when the shard could not be
 * read to its end, changed meanwhile or the entry could not be written (logged, counted by the
 * caller), BT_ERR_TIMEOUT when *stop was set, another BT_ERR_* on internal failure. */
int tc_build(ld_tcache *c, const ld_tc_shard *sh, const char *path, const uint8_t key[32],
             const uint8_t content[32], uint64_t size, uint32_t n_threads, const _Atomic int *stop);

#endif
