/* Crash-safe file and directory replacement, shared by the GGUF and safetensors writers, the
 * PEFT adapter writer and the checkpoint writer.
 *
 * A file is written to "<path>.tmp.<pid>" next to its destination, fsync'ed, closed and renamed
 * over <path>; the parent directory is then fsync'ed (best effort) so the rename is durable.
 * Readers see the old file or the new one, never a torn one. A directory is built under a
 * temporary name by the caller and swapped in with bt_replace_dir.
 *
 * Every error message is prefixed with the caller's `component` ("gguf writer", "adapter", ...),
 * e.g. "safetensors writer: out.st.tmp.42: fsync: No space left on device". `component` must
 * outlive the call (and, for bt_atomic_file, the handle): pass a string literal. */
#ifndef BT_ATOMIC_IO_H
#define BT_ATOMIC_IO_H
#include <stddef.h>

typedef struct {
    int fd;                /* open temporary file, -1 when none */
    char *tmp;             /* "<path>.tmp.<pid>" (owned) */
    char *path;            /* destination (owned copy) */
    const char *component; /* error-message prefix (borrowed) */
} bt_atomic_file;

/* Create (truncating) "<path>.tmp.<pid>", mode 0644, for writing. On success `af` owns the open
 * file until bt_atomic_commit or bt_atomic_abort. On failure returns BT_ERR_IO ("<component>:
 * <tmp>: <strerror>") and leaves `af` empty (bt_atomic_abort on it is a no-op). */
int bt_atomic_open(bt_atomic_file *af, const char *path, const char *component);

/* Append n bytes from p (retries short writes and EINTR). BT_ERR_IO ("<component>: <tmp>: write:
 * <strerror>") on failure; `af` stays open: the caller then calls bt_atomic_abort. */
int bt_atomic_write(bt_atomic_file *af, const void *p, size_t n);

/* fsync, close and rename the temporary file over the destination, then fsync the parent
 * directory (best effort). Always releases `af`; on failure (BT_ERR_IO: "<component>: <tmp>:
 * fsync|close: ..." or "<component>: rename <tmp> -> <path>: ...") the temporary file is removed
 * and the destination is untouched. */
int bt_atomic_commit(bt_atomic_file *af);

/* Close and remove the temporary file and release `af`; the destination is untouched. Safe on an
 * empty or already released handle. */
void bt_atomic_abort(bt_atomic_file *af);

/* Open `path` (a directory when is_dir) and fsync it; EINVAL from fsync (filesystems that cannot
 * sync that object) counts as success. BT_ERR_IO ("<component>: open|fsync <path>: ...") else. */
int bt_fsync_path(const char *path, int is_dir, const char *component);

/* fsync the directory that holds `path` ("." for a bare name, "/" for "/x"). Errors as
 * bt_fsync_path. */
int bt_fsync_parent(const char *path, const char *component);

/* mkdir -p: create `path` and its missing parents (mode 0755); existing directories are fine.
 * BT_ERR_IO ("<component>: mkdir <prefix>: <strerror>") otherwise. */
int bt_mkdir_p(const char *path, const char *component);

/* Remove a file or directory tree (like rm -rf, not following symlinks); missing is fine.
 * Best effort: errors are ignored. */
void bt_rm_tree(const char *path);

/* Put the finished directory tmp_dir in place at dst_dir (no trailing '/'). If dst_dir exists it
 * must be a directory that a `kind` writer may replace (common/out_dir.h bt_out_dir_check: empty,
 * or holding only that kind's files and BarqTrain's marker; never a link, never a user's files):
 * it is swapped atomically with renameat2(RENAME_EXCHANGE) and the old contents removed (only the
 * files the kind owns: bt_out_dir_remove_old); where the filesystem lacks RENAME_EXCHANGE, dst_dir
 * is renamed to "<dst_dir>.old-<pid>" and tmp_dir renamed to dst_dir (a brief gap), then the old
 * one is removed the same way. If dst_dir does not exist tmp_dir is simply renamed. Does not fsync
 * the parent (call bt_fsync_parent(dst_dir, ...) for durability). On failure returns
 * BT_ERR_INVALID (bt_out_dir_check's refusal: "<component>: <dst> holds 2 entries that BarqTrain
 * did not write ..."), BT_ERR_IO ("<component>: <dst> exists and is not a directory",
 * "<component>: replace <dst>: ...", "<component>: rename <tmp> -> <dst>: ...") or BT_ERR_NOMEM
 * and leaves tmp_dir for the caller to remove. */
struct bt_out_kind;
int bt_replace_dir(const char *tmp_dir, const char *dst_dir, const struct bt_out_kind *kind,
                   const char *component);

/* Whether the temporary `path` (a name of ours, below) may be removed as BarqTrain's own: a
 * regular file, an empty directory, or a directory holding BarqTrain's marker (every temporary
 * directory of a save gets it first: common/out_dir.h). A directory without it is never ours. */
int bt_tmp_is_ours(const char *path);

/* Whether `name` (a file name inside a destination directory) is one of bt_atomic_open's
 * temporaries, "<x>.tmp.<pid>[.<n>]" with a non-empty x. */
int bt_atomic_tmp_name(const char *name);

/* ---- leftovers of saves killed mid-write (issue 10 §7) ----
 * Our temporary names, next to a destination D (a file or a directory; B = basename of D):
 *   B.tmp-<pid>[.tmp-<pid>]   directories built by the adapter and checkpoint writers
 *   B.old-<pid>               a replaced directory not yet removed (bt_replace_dir fallback)
 *   B.tmp.<pid>[.<n>]         files written by bt_atomic_open (and the export's config.json)
 * and, inside a destination directory D, files "<name>.tmp.<pid>[.<n>]" (exports write their
 * files into D). A writer holds an exclusive flock(2) on its temporary file or directory until
 * it is renamed into place, so a live save is recognised whatever host or pid namespace it
 * runs in. A directory is only ever recognised as a temporary of ours when bt_tmp_is_ours says so
 * (empty, or holding BarqTrain's marker). */

/* Create the temporary directory `tmp` (a leftover of the same name is removed first when
 * bt_tmp_is_ours: it can only come from a dead process with our pid; else -1, refused) and
 * return an fd holding an exclusive flock on it (close it once the directory has been renamed
 * into place), or -1 with BT_ERR_IO in bt_last_error ("<component>: mkdir <tmp>: ...",
 * "<component>: <tmp> exists and was not written by BarqTrain: ..."). */
int bt_tmpdir_create(const char *tmp, const char *component);
/* Take the same lock on an existing temporary directory built by someone else's writer (the
 * checkpoint writer locks the directory the adapter writer built). -1 when it cannot be opened. */
int bt_tmpdir_lock(const char *tmp);

/* Remove the leftovers of killed saves of `dst` (names above): an entry is removed only if it
 * has our exact name pattern, belongs to our effective uid, is not a symlink, is ours by
 * bt_tmp_is_ours (a directory: empty or marked), nobody holds its lock, and either the pid in
 * its name is not a live process on this host (or is our own pid: this is called before we
 * write anything) or it was last modified over an hour ago (a save on another host of a shared
 * filesystem). Anything else is never touched. Each removal is logged (bt_log info,
 * `component`). Returns the number removed. */
int bt_clean_stale_temps(const char *dst, const char *component);

#endif
