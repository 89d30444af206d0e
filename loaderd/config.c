/* loaderd configuration (contract: loaderd/config.h). */
#include "loaderd/config.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <grp.h>
#include <pwd.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "common/bt_json.h"
#include "common/keytab.h"
#include "proto/client.h"

#define MAX_SHARD_FILES 100000
_Static_assert(sizeof(uid_t) == sizeof(unsigned) && sizeof(gid_t) == sizeof(unsigned), "ids are stored as unsigned");

void ld_free_strv(char **v, int n) {
    if (!v) return;
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

uint64_t ld_default_memory_budget(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGE_SIZE);
    uint64_t phys = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : (uint64_t)4 << 30;
    uint64_t b = phys / 4; /* the trainers on the node need the rest */
    return b < ((uint64_t)256 << 20) ? (uint64_t)256 << 20 : b;
}

/* ------------------------------------------------------------------ the keys' own parsers */

#define RESTART BT_KEY_USER        /* a change needs a restart (the socket, the token cache) */
#define CONNS (BT_KEY_USER << 1)   /* a change applies to new connections (else: to new attaches) */

static int parse_socket_mode(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    const char *s = json_string_value(v);
    char *end = NULL;
    unsigned long m = s ? strtoul(s, &end, 8) : 0;
    if (!s || !*s || *end || m > 0777)
        return bt_fail(BT_ERR_INVALID, "\"%s\" must be an octal string such as \"0660\"", path);
    ((ld_config *)dst)->socket_mode = (unsigned)m;
    return BT_OK;
}

static json_t *dump_socket_mode(const bt_key *k, const void *src) {
    char b[16];
    snprintf(b, sizeof b, "%04o", ((const ld_config *)src)->socket_mode);
    return json_string(b);
}

/* A list of directories, each resolved with realpath; one that does not exist is skipped with a
 * warning (it cannot contain anything; a reload picks it up once it exists). */
static int get_roots(json_t *v, const char *path, char ***out, int *n_out, bt_keypath *bad) {
    if (!json_is_array(v)) return bt_fail(BT_ERR_INVALID, "\"%s\" must be a list of directory paths", path);
    size_t n = json_array_size(v);
    if (n > 1024) return bt_fail(BT_ERR_INVALID, "\"%s\" has more than 1024 entries", path);
    char **roots = bt_xcalloc(n ? n : 1, sizeof *roots);
    int k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p = json_string_value(json_array_get(v, i));
        if (!p || p[0] != '/') {
            ld_free_strv(roots, k);
            snprintf(bad->s, sizeof bad->s, "%s[%zu]", path, i);
            return bt_fail(BT_ERR_INVALID, "\"%s\"[%zu] must be an absolute directory path (string)", path, i);
        }
        char *rp = realpath(p, NULL);
        struct stat st;
        if (!rp || stat(rp, &st) != 0 || !S_ISDIR(st.st_mode)) {
            bt_log(BT_LOG_WARN, "loaderd", "config: %s[%zu] %s is not an existing directory (%s): skipped", path, i, p,
                   rp ? "not a directory" : strerror(errno));
            free(rp);
            continue;
        }
        roots[k++] = rp;
    }
    ld_free_strv(*out, *n_out);
    *out = roots;
    *n_out = k;
    return BT_OK;
}

static int parse_data_roots(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_config *c = dst;
    return get_roots(v, path, &c->data_roots, &c->n_data_roots, bad);
}
static int parse_model_roots(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_config *c = dst;
    return get_roots(v, path, &c->model_roots, &c->n_model_roots, bad);
}

static json_t *strv_json(char *const *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_string(v[i]));
    return a;
}
static json_t *dump_data_roots(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return strv_json(c->data_roots, c->n_data_roots);
}
static json_t *dump_model_roots(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return strv_json(c->model_roots, c->n_model_roots);
}
static void release_data_roots(const bt_key *k, void *dst) {
    ld_config *c = dst;
    ld_free_strv(c->data_roots, c->n_data_roots);
    c->data_roots = NULL;
    c->n_data_roots = 0;
}
static void release_model_roots(const bt_key *k, void *dst) {
    ld_config *c = dst;
    ld_free_strv(c->model_roots, c->n_model_roots);
    c->model_roots = NULL;
    c->n_model_roots = 0;
}

/* "allowed_users" / "allowed_groups" / "operator_groups": names or numeric ids -> ids (users:
 * getpwnam, groups: getgrnam), replacing (and freeing) what *arr / *n held. */
static int get_ids(json_t *v, const char *path, int is_user, unsigned **arr, int *n_out, bt_keypath *bad) {
    if (!json_is_array(v) || json_array_size(v) > 4096)
        return bt_fail(BT_ERR_INVALID, "\"%s\" must be a list (at most 4096) of %s names or numeric ids", path,
                       is_user ? "user" : "group");
    size_t n = json_array_size(v);
    unsigned *ids = bt_xcalloc(n ? n : 1, sizeof *ids);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        const char *name = json_string_value(x);
        snprintf(bad->s, sizeof bad->s, "%s[%zu]", path, i);
        if (json_is_integer(x) && json_integer_value(x) >= 0 && json_integer_value(x) < 4294967295ll) {
            ids[i] = (unsigned)json_integer_value(x);
        } else if (name && *name) {
            char *end;
            unsigned long num = strtoul(name, &end, 10);
            if (!*end && end != name && num < 4294967295ul) {
                ids[i] = (unsigned)num;
            } else if (is_user) {
                struct passwd *pw = getpwnam(name);
                if (!pw) {
                    free(ids);
                    return bt_fail(BT_ERR_INVALID, "\"%s\"[%zu]: no such user \"%s\" (use an existing name or a uid)",
                                   path, i, name);
                }
                ids[i] = (unsigned)pw->pw_uid;
            } else {
                struct group *gr = getgrnam(name);
                if (!gr) {
                    free(ids);
                    return bt_fail(BT_ERR_INVALID, "\"%s\"[%zu]: no such group \"%s\" (use an existing name or a gid)",
                                   path, i, name);
                }
                ids[i] = (unsigned)gr->gr_gid;
            }
        } else {
            free(ids);
            return bt_fail(BT_ERR_INVALID, "\"%s\"[%zu] must be a %s name or a non-negative id", path, i,
                           is_user ? "user" : "group");
        }
    }
    bad->s[0] = 0;
    free(*arr);
    *arr = ids;
    *n_out = (int)n;
    return BT_OK;
}

static int parse_allowed_users(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_config *c = dst;
    return get_ids(v, path, 1, (unsigned **)&c->allowed_uids, &c->n_allowed_uids, bad);
}
static int parse_allowed_groups(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_config *c = dst;
    return get_ids(v, path, 0, (unsigned **)&c->allowed_gids, &c->n_allowed_gids, bad);
}
static int parse_operator_groups(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    ld_config *c = dst;
    return get_ids(v, path, 0, (unsigned **)&c->operator_gids, &c->n_operator_gids, bad);
}

static json_t *ids_json(const unsigned *v, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}
static json_t *dump_allowed_users(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return ids_json(c->allowed_uids, c->n_allowed_uids);
}
static json_t *dump_allowed_groups(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return ids_json(c->allowed_gids, c->n_allowed_gids);
}
static json_t *dump_operator_groups(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return ids_json(c->operator_gids, c->n_operator_gids);
}
static void release_allowed_users(const bt_key *k, void *dst) {
    ld_config *c = dst;
    free(c->allowed_uids);
    c->allowed_uids = NULL;
    c->n_allowed_uids = 0;
}
static void release_allowed_groups(const bt_key *k, void *dst) {
    ld_config *c = dst;
    free(c->allowed_gids);
    c->allowed_gids = NULL;
    c->n_allowed_gids = 0;
}
static void release_operator_groups(const bt_key *k, void *dst) {
    ld_config *c = dst;
    free(c->operator_gids);
    c->operator_gids = NULL;
    c->n_operator_gids = 0;
}

static int parse_cache_dir(const bt_key *k, json_t *v, void *dst, const char *path, bt_keypath *bad) {
    const char *s = json_string_value(v);
    if (!s || s[0] != '/' || strlen(s) > 3000 || strlen(s) != json_string_length(v))
        return bt_fail(BT_ERR_INVALID, "\"%s\" must be an absolute directory path (string)", path);
    ld_config *c = dst;
    free(c->token_cache_dir);
    c->token_cache_dir = bt_xstrdup(s);
    return BT_OK;
}
static json_t *dump_cache_dir(const bt_key *k, const void *src) {
    const ld_config *c = src;
    return c->token_cache_dir ? json_string(c->token_cache_dir) : json_null();
}
static void release_cache_dir(const bt_key *k, void *dst) {
    ld_config *c = dst;
    free(c->token_cache_dir);
    c->token_cache_dir = NULL;
}

/* ------------------------------------------------------------------ the keys */

/* loaderd's configuration file, one row per key: name, accepted values, default, the field it
 * fills, what it means. Parsing, defaults, the unknown-key refusal, the reload's change log and
 * `loaderd --config-keys` (the README's table) all come from these rows. */
#define C ld_config
static const bt_key config_keys[] = {
    BT_KEY_S("socket", C, socket_path, 1, 107, "\"" BT_DEFAULT_SOCKET "\"", RESTART, "control socket path"),
    BT_KEY_C("socket_mode", C, socket_mode, parse_socket_mode, dump_socket_mode, NULL, "\"0660\"", RESTART,
             "octal file mode set on the socket after bind"),
    BT_KEY_S("socket_group", C, socket_group, 1, 0, NULL, RESTART,
             "group name (or numeric gid) given to the socket; default: none"),
    BT_KEY_C("data_roots", C, data_roots, parse_data_roots, dump_data_roots, release_data_roots, "[]", 0,
             "directories dataset shards must resolve (realpath) inside; none: every dataset refused"),
    BT_KEY_C("model_roots", C, model_roots, parse_model_roots, dump_model_roots, release_model_roots, "[]", 0,
             "directories tokenizer files may resolve inside, in addition to data_roots"),
    BT_KEY_I("tokenizer_threads", C, tokenizer_threads, 1, 256, "2", 0, "tokenizer workers per job (a cap)"),
    BT_KEY_I("ring_slots", C, ring_slots, 2, 1024, "8", 0, "default ring depth per job (batches)"),
    BT_KEY_I("max_clients", C, max_clients, 1, 65536, "64", CONNS, "simultaneous connections"),
    BT_KEY_I("max_clients_per_uid", C, max_clients_per_uid, 1, 65536, "32", CONNS,
             "simultaneous connections of one peer uid, so one user cannot hold every slot"),
    BT_KEY_I("max_jobs", C, max_jobs, 1, 4096, "32", 0, "simultaneous attached jobs"),
    BT_KEY_I("max_request_bytes", C, max_request_bytes, 1024, 64ll << 20, "1048576", CONNS, "longest request line"),
    BT_KEY_I("max_ring_bytes", C, max_ring_bytes, 1ll << 20, 1ll << 40, "1073741824", 0,
             "largest ring (slots x slot bytes) one attach may ask for"),
    BT_KEY_I("memory_budget_bytes", C, memory_budget_bytes, 16ll << 20, 1ll << 50, NULL, 0,
             "rings + pipeline buffers of all jobs + the tokenizers they use (each counted once); an attach past it "
             "is refused with the figures; default: a quarter of physical memory, at least 256 MiB"),
    BT_KEY_I("max_json_depth", C, max_json_depth, 2, 1000, "32", CONNS, "deepest nesting accepted in a request"),
    BT_KEY_C("allowed_users", C, allowed_uids, parse_allowed_users, dump_allowed_users, release_allowed_users, "[]", CONNS,
             "user names or uids allowed to use the socket (with allowed_groups both empty: anyone who can open it; "
             "root and loaderd's own uid always)"),
    BT_KEY_C("allowed_groups", C, allowed_gids, parse_allowed_groups, dump_allowed_groups, release_allowed_groups, "[]", CONNS,
             "group names or gids allowed to use the socket (a peer's primary or any supplementary group)"),
    BT_KEY_C("operator_groups", C, operator_gids, parse_operator_groups, dump_operator_groups, release_operator_groups, "[]",
             CONNS, "groups whose members are operators, like root and loaderd's own uid: they may drain and reload, "
             "and have 8 connections of their own past max_clients / max_clients_per_uid"),
    BT_KEY_I("client_timeout_s", C, client_timeout_s, 0, 86400, "60", CONNS,
             "a connection holding half a request line, or without a job making no complete valid request, for this "
             "long is closed; 0: never"),
    BT_KEY_C("token_cache_dir", C, token_cache_dir, parse_cache_dir, dump_cache_dir, release_cache_dir, NULL, RESTART,
             "absolute directory of the token cache (loaderd/tcache.h), created if missing; shared by every node's "
             "loaderd, a shard is tokenized once per cluster; default: none"),
    BT_KEY_I("token_cache_max_bytes", C, token_cache_max_bytes, 16ll << 20, INT64_MAX, "68719476736", RESTART,
             "size bound of the token cache's entries with their reference log-prob sidecars and part files; the "
             "least recently used go first"),
    BT_KEY_I("token_cache_wait_s", C, token_cache_wait_s, 0, 86400, "1800", RESTART,
             "longest wait for another loaderd tokenizing a shard this one needs"),
    BT_KEY_END,
};
#undef C

void ld_config_print_keys(FILE *f) { bt_keytab_doc_md(config_keys, "", f); }

void ld_config_defaults(ld_config *c) {
    memset(c, 0, sizeof *c);
    if (bt_keytab_defaults(config_keys, c) != BT_OK) { /* the table's own defaults: tests parse them */
        bt_log(BT_LOG_ERROR, "loaderd", "%s", bt_last_error());
        abort();
    }
    c->memory_budget_bytes = ld_default_memory_budget();
}

void ld_config_free(ld_config *c) {
    bt_keytab_free(config_keys, c);
    memset(c, 0, sizeof *c);
}

int ld_peer_is_operator(const ld_config *c, uid_t uid, gid_t gid, const gid_t *groups, int n_groups, uid_t self_uid) {
    if (uid == 0 || uid == self_uid) return 1;
    for (int i = 0; i < c->n_operator_gids; i++) {
        if (c->operator_gids[i] == gid) return 1;
        for (int k = 0; k < n_groups; k++)
            if (groups[k] == c->operator_gids[i]) return 1;
    }
    return 0;
}

int ld_peer_allowed(const ld_config *c, uid_t uid, gid_t gid, const gid_t *groups, int n_groups, uid_t self_uid) {
    if (c->n_allowed_uids == 0 && c->n_allowed_gids == 0) return 1;
    if (uid == 0 || uid == self_uid) return 1;
    for (int i = 0; i < c->n_allowed_uids; i++)
        if (c->allowed_uids[i] == uid) return 1;
    for (int i = 0; i < c->n_allowed_gids; i++) {
        if (c->allowed_gids[i] == gid) return 1;
        for (int k = 0; k < n_groups; k++)
            if (groups[k] == c->allowed_gids[i]) return 1;
    }
    return 0;
}

int ld_config_parse(ld_config *c, const char *json_text, const char *origin) {
    json_t *root = NULL; /* BOM skipped, duplicate keys refused naming the key (bt_json.h) */
    if (bt_json_loadb(&root, json_text, strlen(json_text), 0, origin)) {
        memset(c, 0, sizeof *c);
        return BT_ERR_FORMAT;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        memset(c, 0, sizeof *c);
        return bt_fail(BT_ERR_INVALID, "%s: the configuration must be a JSON object", origin);
    }
    ld_config_defaults(c);
    int rc = bt_keytab_parse(config_keys, root, c, origin, "", 0, NULL);
    json_decref(root);
    if (rc) ld_config_free(c);
    return rc;
}

int ld_config_load(ld_config *c, const char *path) {
    memset(c, 0, sizeof *c);
    char *buf = NULL;
    /* the operator's file: a symlink is fine here; but never a FIFO or device: SIGHUP reloads it
     * on the event loop, which must not block in open(2) or read(2) (bt_open_file) */
    int fd = bt_open_file(path, BT_OPEN_LINKS_OK, NULL);
    if (fd < 0) return bt_fail(BT_ERR_IO, "config %s", bt_last_error());
    int rc = bt_read_fd(fd, path, 4u << 20, &buf, NULL);
    close(fd);
    if (rc) return bt_fail(rc == BT_ERR_RANGE ? BT_ERR_INVALID : rc, "config %s", bt_last_error());
    rc = ld_config_parse(c, buf, path);
    free(buf);
    return rc;
}

static void log_change(const bt_key *k, const char *old_text, const char *new_text, void *ctx) {
    const char *note = (k->flags & RESTART) ? "takes effect after a restart"
                       : (k->flags & CONNS) ? "applies to new connections" : "applies to new attaches";
    bt_log((k->flags & RESTART) ? BT_LOG_WARN : BT_LOG_INFO, "loaderd", "config: %s: %s -> %s (%s)", k->name,
           old_text, new_text, note);
}

int ld_config_log_diff(const ld_config *o, const ld_config *n) { return bt_keytab_diff(config_keys, o, n, log_change, NULL); }

int ld_path_in_roots(const char *resolved, char *const *roots, int n_roots) {
    for (int i = 0; i < n_roots; i++) {
        const char *r = roots[i];
        size_t n = strlen(r);
        if (n == 1 && r[0] == '/') return 1;
        if (!strncmp(resolved, r, n) && (resolved[n] == 0 || resolved[n] == '/')) return 1;
    }
    return 0;
}

/* Copy of `p` with glob metacharacters backslash-escaped. */
static char *glob_escape(const char *p) {
    size_t n = strlen(p);
    char *o = bt_xmalloc(2 * n + 1), *w = o;
    for (; *p; p++) {
        if (strchr("*?[]\\", *p)) *w++ = '\\';
        *w++ = *p;
    }
    *w = 0;
    return o;
}

static int cmp_strp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Sort v[0, n) and drop duplicates (freed); returns the new count. */
static int sort_unique(char **v, int n) {
    if (n < 2) return n;
    qsort(v, (size_t)n, sizeof *v, cmp_strp);
    int k = 1;
    for (int i = 1; i < n; i++) {
        if (strcmp(v[i], v[k - 1]) == 0) free(v[i]);
        else v[k++] = v[i];
    }
    return k;
}

char *ld_path_where(const char *path) {
    if (!path || path[0] != '/') return NULL;
    size_t cap = strlen(path) + PATH_MAX + 2;
    char *out = bt_xmalloc(PATH_MAX + 1), *rest = bt_xmalloc(cap), *tmp = bt_xmalloc(cap);
    size_t olen = 0; /* out[0, olen): the resolved prefix, "" standing for "/" */
    out[0] = 0;
    snprintf(rest, cap, "%s", path);
    int links = 0, exists = 1;
    char *r = rest;
    for (;;) {
        while (*r == '/') r++;
        if (!*r) break;
        char *end = strchr(r, '/');
        size_t n = end ? (size_t)(end - r) : strlen(r);
        if (n == 1 && r[0] == '.') {
            r += n;
            continue;
        }
        if (n == 2 && r[0] == '.' && r[1] == '.') {
            while (olen > 0 && out[olen - 1] != '/') olen--;
            if (olen > 0) olen--; /* drop the '/' too */
            out[olen] = 0;
            r += n;
            continue;
        }
        if (olen + 1 + n > PATH_MAX) goto fail;
        size_t prev = olen;
        out[olen++] = '/';
        memcpy(out + olen, r, n);
        olen += n;
        out[olen] = 0;
        r += n;
        struct stat st;
        if (!exists) continue;
        if (lstat(out, &st) != 0) { /* missing or not examinable: the rest is taken literally */
            exists = 0;
            continue;
        }
        if (!S_ISLNK(st.st_mode)) continue;
        if (++links > 40) goto fail; /* the kernel's ELOOP limit */
        ssize_t k = readlink(out, tmp, PATH_MAX);
        if (k <= 0 || k >= PATH_MAX) goto fail;
        tmp[k] = 0;
        size_t tl = (size_t)k, rl = strlen(r);
        if (tl + 1 + rl + 1 > cap) goto fail;
        tmp[tl] = '/';
        memcpy(tmp + tl + 1, r, rl + 1); /* link target, then what was left */
        memcpy(rest, tmp, tl + 1 + rl + 1);
        r = rest;
        olen = tmp[0] == '/' ? 0 : prev; /* absolute target: from "/"; relative: from the link's dir */
        out[olen] = 0;
    }
    free(rest);
    free(tmp);
    if (olen == 0) snprintf(out, PATH_MAX + 1, "/");
    return out;
fail:
    free(out);
    free(rest);
    free(tmp);
    return NULL;
}

/* Where the fixed (wildcard-free) directory prefix of `pat` leads (ld_path_where: existing
 * symlinks followed, missing parts literal) must lie inside a data root, checked before
 * globbing; else the refusal is the same as for a pattern that matches nothing. */
static int pattern_prefix_in_roots(const ld_config *c, const char *pat) {
    size_t n = strcspn(pat, "*?[\\");
    char *pre = bt_xmalloc(n + 2);
    memcpy(pre, pat, n);
    pre[n] = 0;
    if (pat[n]) { /* cut back to the directory holding the first wildcard */
        char *sl = strrchr(pre, '/');
        sl[sl == pre ? 1 : 0] = 0; /* pat[0] == '/', so there is one */
    }
    char *where = ld_path_where(pre);
    int in = where && ld_path_in_roots(where, c->data_roots, c->n_data_roots);
    if (!in)
        bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: fixed prefix %s leads to %s, outside every data root",
               pat, pre, where ? where : "(a symlink loop or an over-long path)");
    free(where);
    free(pre);
    return in;
}

/* The one reply to a shard pattern or tokenizer that names nothing usable outside the roots:
 * identical whether the path exists, is a device, a secret, a symlink leading out, or nothing
 * (issue 10 §3); loaderd's log has the details. */
static int refuse_outside(const char *what, const char *path, const char *roots) {
    return bt_fail(BT_ERR_NOTFOUND, "job: %s \"%s\": no file by that name inside %s (see loaderd's log)", what,
                   path, roots);
}

int ld_resolve_shards(const ld_config *c, char *const *patterns, int n_patterns, char ***out, int *n_out) {
    *out = NULL;
    *n_out = 0;
    if (n_patterns <= 0) return bt_fail(BT_ERR_INVALID, "job: \"shards\" must list at least one path or glob");
    if (c->n_data_roots == 0)
        return bt_fail(BT_ERR_INVALID, "job: no data_roots are configured in loaderd, so no dataset is allowed "
                                       "(add the dataset directory to \"data_roots\" and reload)");
    char **files = NULL;
    int n = 0, cap = 0, rc = BT_OK;
    for (int i = 0; i < n_patterns && !rc; i++) {
        const char *pat = patterns[i];
        if (pat[0] != '/') {
            rc = bt_fail(BT_ERR_INVALID, "job: shard pattern \"%s\" must be an absolute path", pat);
            break;
        }
        if (!pattern_prefix_in_roots(c, pat)) { /* same refusal whether or not anything matches */
            rc = refuse_outside("shard pattern", pat, "data_roots");
            break;
        }
        glob_t g;
        int gr = glob(pat, GLOB_ERR, NULL, &g);
        if (gr == GLOB_NOMATCH) {
            bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s matches no file", pat);
            rc = refuse_outside("shard pattern", pat, "data_roots");
            globfree(&g);
            break;
        }
        if (gr != 0) {
            rc = bt_fail(BT_ERR_IO, "job: shard pattern \"%s\": cannot expand (%s)", pat,
                         gr == GLOB_NOSPACE ? "out of memory" : "read error");
            globfree(&g);
            break;
        }
        for (size_t k = 0; k < g.gl_pathc && !rc; k++) {
            /* the message goes back to the client: never name what the glob found or where it
             * leads outside the data roots, nor whether anything is there (a dangling link
             * leading out reads like one to an existing file); the log keeps the details */
            char *where = ld_path_where(g.gl_pathv[k]);
            if (!where || !ld_path_in_roots(where, c->data_roots, c->n_data_roots)) {
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: match %s leads to %s, outside every data root",
                       pat, g.gl_pathv[k], where ? where : "(a symlink loop or an over-long path)");
                free(where);
                rc = refuse_outside("shard pattern", pat, "data_roots");
                break;
            }
            free(where);
            char *rp = realpath(g.gl_pathv[k], NULL);
            struct stat st;
            if (!rp || stat(rp, &st) != 0) {
                int e = errno;
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: match %s: %s", pat, g.gl_pathv[k], strerror(e));
                rc = bt_fail(BT_ERR_NOTFOUND, "job: shard pattern \"%s\" matches an unreadable path (%s)", pat,
                             strerror(e));
            } else if (!ld_path_in_roots(rp, c->data_roots, c->n_data_roots)) { /* raced: changed meanwhile */
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: match %s resolves to %s, outside every data root",
                       pat, g.gl_pathv[k], rp);
                rc = refuse_outside("shard pattern", pat, "data_roots");
            } else if (bt_text_unsafe(rp, strlen(rp), NULL) < strlen(rp)) { /* would reach logs and terminals */
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s matches %s: a name holding a control character",
                       pat, rp);
                rc = bt_fail(BT_ERR_INVALID, "job: shard pattern \"%s\" matches a file whose name holds a control "
                             "character (or is not UTF-8): rename it; names and paths may not hold control "
                             "characters", pat);
            } else if (!S_ISREG(st.st_mode)) {
                rc = bt_fail(BT_ERR_INVALID, "job: shard %s is not a regular file", rp);
            } else if (bt_pseudo_fs(rp)) { /* /proc, /sys, ...: sizes say nothing (0 for most) */
                rc = bt_fail(BT_ERR_INVALID, "job: shard %s is not a regular file (on %s, a pseudo filesystem: its "
                             "files are views of kernel state, not data)", rp, bt_pseudo_fs(rp));
            } else {
                /* duplicates go at the end (sort + unique; the pipeline sorts the paths again, so
                 * the order does not matter); compact early to bound memory */
                if (n == cap) files = bt_xrealloc(files, (size_t)(cap = cap ? cap * 2 : 16) * sizeof *files);
                files[n++] = glob_escape(rp);
                if (n >= 2 * MAX_SHARD_FILES && (n = sort_unique(files, n)) > MAX_SHARD_FILES)
                    rc = bt_fail(BT_ERR_INVALID, "job: more than %d shard files", MAX_SHARD_FILES);
            }
            free(rp);
        }
        globfree(&g);
    }
    if (!rc && (n = sort_unique(files, n)) > MAX_SHARD_FILES)
        rc = bt_fail(BT_ERR_INVALID, "job: more than %d shard files", MAX_SHARD_FILES);
    if (rc) {
        ld_free_strv(files, n);
        return rc;
    }
    *out = files;
    *n_out = n;
    return BT_OK;
}

int ld_resolve_tokenizer(const ld_config *c, const char *path, char **out) {
    *out = NULL;
    if (!path || path[0] != '/') return bt_fail(BT_ERR_INVALID, "job: \"tokenizer\" must be an absolute file path");
    /* first where it leads (existing links followed, missing parts literal): outside the roots
     * is one refusal whatever is or is not there; only inside them are the details told */
    char *where = ld_path_where(path);
    int in = where && (ld_path_in_roots(where, c->model_roots, c->n_model_roots) ||
                       ld_path_in_roots(where, c->data_roots, c->n_data_roots));
    if (!in) {
        bt_log(BT_LOG_WARN, "loaderd", "job: tokenizer %s leads to %s, outside model_roots and data_roots", path,
               where ? where : "(a symlink loop or an over-long path)");
        free(where);
        return refuse_outside("tokenizer", path, "model_roots or data_roots");
    }
    free(where);
    char *rp = realpath(path, NULL);
    struct stat st;
    if (!rp || stat(rp, &st) != 0) {
        int e = errno;
        free(rp);
        bt_log(BT_LOG_WARN, "loaderd", "job: tokenizer %s: %s", path, strerror(e));
        return e == ENOENT ? refuse_outside("tokenizer", path, "model_roots or data_roots")
                           : bt_fail(BT_ERR_NOTFOUND, "job: tokenizer %s: %s", path, strerror(e));
    }
    if (!ld_path_in_roots(rp, c->model_roots, c->n_model_roots) &&
        !ld_path_in_roots(rp, c->data_roots, c->n_data_roots)) { /* changed since ld_path_where */
        bt_log(BT_LOG_WARN, "loaderd", "job: tokenizer %s resolves to %s, outside model_roots and data_roots", path, rp);
        free(rp);
        return refuse_outside("tokenizer", path, "model_roots or data_roots");
    }
    if (bt_text_unsafe(rp, strlen(rp), NULL) < strlen(rp)) { /* would reach logs and terminals */
        bt_log(BT_LOG_WARN, "loaderd", "job: tokenizer %s resolves to %s: a name holding a control character", path, rp);
        free(rp);
        return bt_fail(BT_ERR_INVALID, "job: tokenizer %s resolves to a file whose name holds a control character (or "
                       "is not UTF-8): rename it; names and paths may not hold control characters", path);
    }
    if (!S_ISREG(st.st_mode) || bt_pseudo_fs(rp)) {
        const char *fs = S_ISREG(st.st_mode) ? bt_pseudo_fs(rp) : NULL;
        free(rp);
        return bt_fail(BT_ERR_INVALID, "job: tokenizer %s is not a regular file%s%s%s", path, fs ? " (on " : "",
                       fs ? fs : "", fs ? ", a pseudo filesystem)" : "");
    }
    *out = rp;
    return BT_OK;
}

int ld_socket_clear_stale(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? BT_OK : bt_fail(BT_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISSOCK(st.st_mode)) return bt_fail(BT_ERR_INVALID, "%s exists and is not a socket: refusing to replace it", path);
    /* non-blocking: a listener whose backlog is full (a hung process) must not hang us here with
     * SIGTERM unanswered; EAGAIN means someone listens */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return bt_fail(BT_ERR_IO, "socket: %s", strerror(errno));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0 || e == EAGAIN || e == EINPROGRESS)
        return bt_fail(BT_ERR_INVALID, "%s: another loaderd is already listening there", path);
    if (e != ECONNREFUSED) return bt_fail(BT_ERR_IO, "%s: probing the old socket: %s", path, strerror(e));
    bt_log(BT_LOG_INFO, "loaderd", "removing stale socket %s", path);
    if (unlink(path) != 0 && errno != ENOENT) return bt_fail(BT_ERR_IO, "unlink %s: %s", path, strerror(errno));
    return BT_OK;
}

int ld_socket_set_perms(const ld_config *c) {
    if (c->socket_group) {
        char *end;
        long gid = strtol(c->socket_group, &end, 10);
        if (*end) {
            struct group *g = getgrnam(c->socket_group);
            gid = g ? (long)g->gr_gid : -1;
        }
        if (gid < 0) return bt_fail(BT_ERR_INVALID, "socket_group \"%s\": no such group", c->socket_group);
        if (chown(c->socket_path, (uid_t)-1, (gid_t)gid) != 0)
            return bt_fail(BT_ERR_IO, "chown %s to group %s: %s", c->socket_path, c->socket_group, strerror(errno));
    }
    if (chmod(c->socket_path, c->socket_mode) != 0)
        return bt_fail(BT_ERR_IO, "chmod %s %04o: %s", c->socket_path, c->socket_mode, strerror(errno));
    return BT_OK;
}

int ld_json_depth_ok(const char *p, size_t n, unsigned max) {
    unsigned d = 0;
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (in_str) {
            if (esc) esc = 0;
            else if (ch == '\\') esc = 1;
            else if (ch == '"') in_str = 0;
        } else if (ch == '"') {
            in_str = 1;
        } else if (ch == '[' || ch == '{') {
            if (++d > max) return 0;
        } else if ((ch == ']' || ch == '}') && d) {
            d--;
        }
    }
    return 1;
}
