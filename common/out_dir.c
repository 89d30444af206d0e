/* Output destinations: ownership and writability checks. See out_dir.h. */
#include "common/out_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/atomic_io.h"
#include "common/bt_common.h"

#define MARKER_MAX 4096
static const char k_marker_head[] = "{\"written_by\": \"BarqTrain\"";

/* `path` without trailing slashes (malloc'd). */
static char *trimmed(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, path, n);
        d[n] = 0;
    }
    return d;
}

/* The directory that holds `path` (malloc'd): "." for a bare name, "/" for "/x". */
static char *parent_of(const char *path) {
    char *p = trimmed(path);
    if (!p) return NULL;
    char *slash = strrchr(p, '/');
    if (!slash) {
        free(p);
        return strdup(".");
    }
    if (slash == p) slash[1] = 0;
    else *slash = 0;
    return p;
}

/* Can we create entries in the directory `dir`? 0, or errno. */
static int dir_writable(const char *dir) {
    return faccessat(AT_FDCWD, dir, W_OK | X_OK, AT_EACCESS) == 0 ? 0 : errno;
}

/* `path` does not exist: its nearest existing ancestor must be a directory we can write into. */
static int check_creatable(const char *path, const char *component) {
    char *anc = parent_of(path);
    int rc = 0;
    for (;;) {
        if (!anc) return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
        struct stat st;
        if (stat(anc, &st) == 0) {
            int e;
            if (!S_ISDIR(st.st_mode))
                rc = bt_fail(BT_ERR_INVALID, "%s: %s: cannot be created: %s is not a directory", component, path, anc);
            else if ((e = dir_writable(anc)))
                rc = bt_fail(BT_ERR_IO, "%s: %s: cannot be created in %s: %s", component, path, anc, strerror(e));
            break;
        }
        if (errno != ENOENT && errno != ENOTDIR) {
            rc = bt_fail(BT_ERR_IO, "%s: %s: cannot be created: %s: %s", component, path, anc, strerror(errno));
            break;
        }
        char *up = parent_of(anc);
        if (up && !strcmp(up, anc)) { /* "/" or "." missing: cannot happen, but never loop */
            free(up);
            rc = bt_fail(BT_ERR_IO, "%s: %s: cannot be created", component, path);
            break;
        }
        free(anc);
        anc = up;
    }
    free(anc);
    return rc;
}

int bt_out_dir_marked(const char *dir) {
    char *p = NULL;
    if (asprintf(&p, "%s/" BT_OUT_MARKER, dir) < 0) return 0;
    int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    free(p);
    if (fd < 0) return 0;
    struct stat st;
    char head[sizeof k_marker_head];
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= MARKER_MAX &&
             read(fd, head, sizeof head - 1) == (ssize_t)(sizeof head - 1) &&
             !memcmp(head, k_marker_head, sizeof head - 1);
    close(fd);
    return ok;
}

int bt_out_dir_mark(const char *dir, const bt_out_kind *k, const char *component) {
    char *p = NULL, *text = NULL;
    if (asprintf(&p, "%s/" BT_OUT_MARKER, dir) < 0) return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
    if (asprintf(&text, "%s, \"kind\": \"%s\", \"note\": \"BarqTrain rewrites this directory at its next save "
                 "and refuses any directory holding files it did not write\"}\n", k_marker_head, k->what) < 0) {
        free(p);
        return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
    }
    bt_atomic_file af;
    int rc = bt_atomic_open(&af, p, component);
    if (!rc && (rc = bt_atomic_write(&af, text, strlen(text)))) bt_atomic_abort(&af);
    else if (!rc) rc = bt_atomic_commit(&af);
    free(text);
    free(p);
    return rc;
}

/* 1 when the regular file dfd/nm is one of k's own: by its name, and by its content where the
 * name alone does not say (k->ours_by_content). */
static int owned(const bt_out_kind *k, int dfd, const char *nm) {
    return k->owns(nm) && (!k->ours_by_content || k->ours_by_content(dfd, nm));
}

/* What a directory holds, as far as kind k is concerned. */
typedef struct {
    int n_ours, n_foreign, marker;
    char first[256]; /* the first foreign entry's name */
} scan_t;

/* Scan dir's entries. Returns 0, or errno when it cannot be read. */
static int scan(const char *dir, const bt_out_kind *k, scan_t *s) {
    memset(s, 0, sizeof *s);
    DIR *d = opendir(dir);
    if (!d) return errno;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *nm = e->d_name;
        if (!strcmp(nm, ".") || !strcmp(nm, "..")) continue;
        struct stat st;
        int reg = fstatat(dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
        if (reg && !strcmp(nm, BT_OUT_MARKER)) s->marker = 1;
        else if (reg && bt_atomic_tmp_name(nm)) continue; /* a write of ours in progress or killed */
        else if (reg && owned(k, dirfd(d), nm)) s->n_ours++;
        else if (s->n_foreign++ == 0) {
            size_t len = strnlen(nm, sizeof s->first - 24);
            memcpy(s->first, nm, len);
            s->first[len] = 0;
            if (!reg) strcat(s->first, " (not a regular file)");
        }
    }
    closedir(d);
    if (s->marker && !bt_out_dir_marked(dir)) { /* a .barqtrain that is not ours */
        if (s->n_foreign++ == 0) snprintf(s->first, sizeof s->first, "%s", BT_OUT_MARKER " (not BarqTrain's marker)");
        s->marker = 0;
    }
    return 0;
}

int bt_out_dir_check(const char *path, const bt_out_kind *k, const char *component) {
    char *d = trimmed(path);
    if (!d) return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
    const char *verb = k->replaced ? "replace" : "write into";
    struct stat st;
    int rc = 0, e;
    if (lstat(d, &st) != 0) {
        rc = errno == ENOENT || errno == ENOTDIR ? check_creatable(d, component)
                             : bt_fail(BT_ERR_IO, "%s: %s: %s", component, d, strerror(errno));
        goto out;
    }
    if (S_ISLNK(st.st_mode)) {
        rc = bt_fail(BT_ERR_INVALID, "%s: %s is a symbolic link: BarqTrain %ss its %s directory itself and "
                     "never follows a link to do it; name the directory it points to (or a new one)",
                     component, d, verb, k->what);
        goto out;
    }
    if (!S_ISDIR(st.st_mode)) {
        rc = bt_fail(BT_ERR_INVALID, "%s: %s exists and is not a directory: the %s needs a directory there "
                     "(choose another path; BarqTrain never overwrites a file it did not write)",
                     component, d, k->what);
        goto out;
    }
    if ((e = dir_writable(d))) {
        rc = bt_fail(BT_ERR_IO, "%s: %s: cannot write into it: %s", component, d, strerror(e));
        goto out;
    }
    if (k->replaced) {
        char *par = parent_of(d);
        if (!par) {
            rc = bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
            goto out;
        }
        if ((e = dir_writable(par)))
            rc = bt_fail(BT_ERR_IO, "%s: %s: cannot replace it: its directory %s: %s", component, d, par,
                         strerror(e));
        free(par);
        if (rc) goto out;
    }
    scan_t s;
    if ((e = scan(d, k, &s))) {
        rc = bt_fail(BT_ERR_IO, "%s: %s: cannot read it: %s", component, d, strerror(e));
        goto out;
    }
    if (s.n_foreign) {
        rc = bt_fail(BT_ERR_INVALID, "%s: %s holds %d entr%s that BarqTrain did not write (\"%s\"%s): refusing to "
                     "%s it, which would delete or overwrite them; choose a new or empty directory for the %s",
                     component, d, s.n_foreign, s.n_foreign == 1 ? "y" : "ies", s.first,
                     s.n_foreign > 1 ? ", ..." : "", verb, k->what);
        goto out;
    }
    if (s.n_ours && !s.marker && !(k->legacy && k->legacy(d)))
        rc = bt_fail(BT_ERR_INVALID, "%s: %s holds files named like a BarqTrain %s but no " BT_OUT_MARKER " marker, "
                     "and their contents are not recognisably BarqTrain's: refusing to %s it; choose a new or "
                     "empty directory (or remove them yourself)", component, d, k->what, verb);
out:
    free(d);
    return rc;
}

void bt_out_dir_remove_old(const char *old, const bt_out_kind *k, const char *component) {
    DIR *d = opendir(old);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *nm = e->d_name;
        struct stat st;
        if (!strcmp(nm, ".") || !strcmp(nm, "..")) continue;
        if (fstatat(dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
        if (!strcmp(nm, BT_OUT_MARKER) || bt_atomic_tmp_name(nm) || owned(k, dirfd(d), nm))
            unlinkat(dirfd(d), nm, 0);
    }
    closedir(d);
    if (rmdir(old) == 0 || errno == ENOENT) return;
    char *kept = NULL;
    if (asprintf(&kept, "%s.kept-%d", old, (int)getpid()) < 0) return;
    if (rename(old, kept) == 0)
        bt_log(BT_LOG_WARN, component, "%s: files BarqTrain did not write appeared in the %s directory while it "
               "was being saved; they were not deleted: see %s", old, k->what, kept);
    else
        bt_log(BT_LOG_WARN, component, "%s: holds files BarqTrain did not write; left in place", old);
    free(kept);
}

int bt_out_file_check(const char *path, int (*ours)(const char *path), const char *component) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno != ENOENT && errno != ENOTDIR) return bt_fail(BT_ERR_IO, "%s: %s: %s", component, path, strerror(errno));
        char *par = parent_of(path);
        if (!par) return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
        int rc = 0, e;
        if (stat(par, &st) != 0)
            rc = bt_fail(BT_ERR_IO, "%s: %s: cannot be created: %s: %s", component, path, par, strerror(errno));
        else if (!S_ISDIR(st.st_mode))
            rc = bt_fail(BT_ERR_INVALID, "%s: %s: cannot be created: %s is not a directory", component, path, par);
        else if ((e = dir_writable(par)))
            rc = bt_fail(BT_ERR_IO, "%s: %s: cannot be created in %s: %s", component, path, par, strerror(e));
        free(par);
        return rc;
    }
    if (S_ISLNK(st.st_mode))
        return bt_fail(BT_ERR_INVALID, "%s: %s is a symbolic link: BarqTrain never writes through a link; name "
                       "the file itself (or a new one)", component, path);
    if (S_ISDIR(st.st_mode))
        return bt_fail(BT_ERR_INVALID, "%s: %s is a directory: this export writes one file; name a file",
                       component, path);
    if (!S_ISREG(st.st_mode) || !ours || !ours(path))
        return bt_fail(BT_ERR_INVALID, "%s: %s exists and was not written by BarqTrain: refusing to overwrite it; "
                       "choose a new file name (or remove it yourself)", component, path);
    char *par = parent_of(path);
    if (!par) return bt_fail(BT_ERR_NOMEM, "%s: out of memory", component);
    int e = dir_writable(par), rc = 0;
    if (e) rc = bt_fail(BT_ERR_IO, "%s: %s: cannot replace it: its directory %s: %s", component, path, par, strerror(e));
    free(par);
    return rc;
}
