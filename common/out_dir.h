/* BarqTrain's output destinations: what a writer may replace, write into or overwrite (issue 21
 * §1, §2; docs: README "Where the trainer writes").
 *
 * Rule: nothing BarqTrain did not write is ever deleted or overwritten. A directory that a writer
 * replaces as a whole (adapter, checkpoint: bt_replace_dir) or writes its files into (merged
 * Hugging Face export, run report) must be absent, empty, or hold only that writer's own files
 * plus BarqTrain's marker file BT_OUT_MARKER, which every such writer puts in the directory it
 * builds. A directory written before the marker existed (an earlier BarqTrain) is accepted when it
 * holds only the writer's file names and the kind's `legacy` recogniser knows them by content
 * (e.g. the checkpoint magic, our exact adapter_config.json key set). Anything else is refused
 * with the path and the reason, before any work starts (the commands call bt_out_dir_check up
 * front) and again by bt_replace_dir itself, so that no writer can delete a user's files.
 *
 * The same checks say whether a destination can be created and written at all (an existing file
 * in its place, a read-only filesystem, a parent that is not a directory or not writable), so a
 * run finds out before its first step, not at its first save. */
#ifndef BT_OUT_DIR_H
#define BT_OUT_DIR_H

/* The marker file BarqTrain writes into each output directory it creates (a small JSON object:
 * {"written_by": "BarqTrain", "kind": "<what>", "note": ...}). */
#define BT_OUT_MARKER ".barqtrain"

/* One kind of output directory. Static tables owned by the writer (trainer/io/outputs.h). */
typedef struct bt_out_kind {
    const char *what;             /* "adapter", "checkpoint", "export", "report": messages, marker */
    int (*owns)(const char *name); /* 1 when a file of this name is one the writer leaves there */
    /* NULL, or 1 when the directory `dir` (no marker; every entry a regular file that `owns`
     * accepts) is recognisably an earlier BarqTrain's output of this kind, by content */
    int (*legacy)(const char *dir);
    int replaced; /* 1: replaced as a whole (bt_replace_dir: its parent must be writable too);
                   * 0: files are written into it in place */
    /* NULL, or for a name `owns` accepts that people also use for their own files (README.md):
     * 1 when the file dirfd/name (a regular file) is ours by its content, 0 when it is a user's
     * (then it is foreign: refused, never removed) */
    int (*ours_by_content)(int dirfd, const char *name);
} bt_out_kind;

/* Whether `path` may be used as a `k` output directory (see above): absent, with its nearest
 * existing ancestor a writable directory (the writer creates the missing ones); or an existing,
 * writable directory (not a symbolic link) holding nothing, only the marker, or only files that
 * k->owns accepts with the marker present (or, without it, k->legacy accepting them). Our own
 * temporaries ("<name>.tmp.<pid>[.<n>]", common/atomic_io.h) inside count as ours. Returns 0, or
 * BT_ERR_INVALID (foreign files, not a directory, a link, not recognisably ours) or BT_ERR_IO
 * (cannot be created or written: the errno text, e.g. "Read-only file system") with
 * "<component>: <path>: <reason>" in bt_last_error. Reads the directory; changes nothing. */
int bt_out_dir_check(const char *path, const bt_out_kind *k, const char *component);

/* Write (atomically) the marker file into the directory `dir` (which must exist), naming k->what.
 * Errors: BT_ERR_IO "<component>: <dir>/.barqtrain: ...". */
int bt_out_dir_mark(const char *dir, const bt_out_kind *k, const char *component);

/* 1 when `dir` holds a valid marker (a regular file of at most 4 KiB starting with
 * {"written_by": "BarqTrain"), else 0. */
int bt_out_dir_marked(const char *dir);

/* After bt_replace_dir swapped a new directory in, `old` holds the previous contents: remove the
 * files k owns (and the marker and our temporaries), then the directory. Anything else found
 * there (put in while the save was running) is kept: the directory is renamed to
 * "<old>.kept-<pid>" with a warning naming it. */
void bt_out_dir_remove_old(const char *old, const bt_out_kind *k, const char *component);

/* Whether the regular file `path` may be created or replaced by a writer of whole files (GGUF
 * exports): absent with its parent an existing writable directory; or an existing regular file
 * (not a link) that `ours` (NULL: none) recognises as BarqTrain's output, in a writable
 * directory. BT_ERR_INVALID / BT_ERR_IO with "<component>: <path>: <reason>" otherwise. */
int bt_out_file_check(const char *path, int (*ours)(const char *path), const char *component);

#endif
