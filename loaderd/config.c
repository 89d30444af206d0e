/* loaderd configuration (contract: loaderd/config.h). */
#include "loaderd/config.h"

#include <errno.h>
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
#include "proto/client.h"

#define MAX_SHARD_FILES 100000
_Static_assert(sizeof(uid_t) == sizeof(unsigned) && sizeof(gid_t) == sizeof(unsigned), "ids are stored as unsigned");

void ld_free_strv(char **v, int n) {
    if (!v) return;
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

void ld_config_defaults(ld_config *c) {
    memset(c, 0, sizeof *c);
    c->socket_path = bt_xstrdup(BT_DEFAULT_SOCKET);
    c->socket_mode = 0660;
    c->tokenizer_threads = 2;
    c->ring_slots = 8;
    c->max_clients = 64;
    c->max_jobs = 32;
    c->max_request_bytes = 1u << 20;
    c->max_ring_bytes = 1ull << 30;
    c->max_json_depth = 32;
    c->client_timeout_s = 60;
    c->token_cache_max_bytes = 64ull << 30;
    c->token_cache_wait_s = 1800;
}

void ld_config_free(ld_config *c) {
    free(c->socket_path);
    free(c->socket_group);
    ld_free_strv(c->data_roots, c->n_data_roots);
    ld_free_strv(c->model_roots, c->n_model_roots);
    free(c->allowed_uids);
    free(c->allowed_gids);
    free(c->token_cache_dir);
    memset(c, 0, sizeof *c);
}

static int get_int(json_t *v, const char *origin, const char *key, long long lo, long long hi, long long *out) {
    if (!json_is_integer(v))
        return bt_fail(BT_ERR_INVALID, "%s: \"%s\" must be an integer in [%lld, %lld]", origin, key, lo, hi);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return bt_fail(BT_ERR_INVALID, "%s: \"%s\" = %lld is outside [%lld, %lld]", origin, key, x, lo, hi);
    *out = x;
    return BT_OK;
}

static int get_roots(json_t *v, const char *origin, const char *key, char ***out, int *n_out) {
    if (!json_is_array(v))
        return bt_fail(BT_ERR_INVALID, "%s: \"%s\" must be a list of directory paths", origin, key);
    size_t n = json_array_size(v);
    if (n > 1024) return bt_fail(BT_ERR_INVALID, "%s: \"%s\" has more than 1024 entries", origin, key);
    char **roots = bt_xcalloc(n ? n : 1, sizeof *roots);
    int k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p = json_string_value(json_array_get(v, i));
        if (!p || p[0] != '/') {
            ld_free_strv(roots, k);
            return bt_fail(BT_ERR_INVALID, "%s: \"%s\"[%zu] must be an absolute directory path (string)", origin,
                           key, i);
        }
        char *rp = realpath(p, NULL);
        struct stat st;
        if (!rp || stat(rp, &st) != 0 || !S_ISDIR(st.st_mode)) {
            bt_log(BT_LOG_WARN, "loaderd", "%s: %s[%zu] %s is not an existing directory (%s): skipped", origin, key,
                   i, p, rp ? "not a directory" : strerror(errno));
            free(rp);
            continue;
        }
        roots[k++] = rp;
    }
    *out = roots;
    *n_out = k;
    return BT_OK;
}

/* "allowed_users" / "allowed_groups": names or numeric ids -> ids (users: getpwnam, groups:
 * getgrnam). `is_user` picks the database. */
static int get_ids(json_t *v, const char *origin, const char *key, int is_user, unsigned **out, int *n_out) {
    if (!json_is_array(v) || json_array_size(v) > 4096)
        return bt_fail(BT_ERR_INVALID, "%s: \"%s\" must be a list (at most 4096) of %s names or numeric ids", origin,
                       key, is_user ? "user" : "group");
    size_t n = json_array_size(v);
    unsigned *ids = bt_xcalloc(n ? n : 1, sizeof *ids);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        const char *name = json_string_value(x);
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
                    return bt_fail(BT_ERR_INVALID, "%s: \"%s\"[%zu]: no such user \"%s\" (use an existing name or a uid)",
                                   origin, key, i, name);
                }
                ids[i] = (unsigned)pw->pw_uid;
            } else {
                struct group *gr = getgrnam(name);
                if (!gr) {
                    free(ids);
                    return bt_fail(BT_ERR_INVALID, "%s: \"%s\"[%zu]: no such group \"%s\" (use an existing name or a gid)",
                                   origin, key, i, name);
                }
                ids[i] = (unsigned)gr->gr_gid;
            }
        } else {
            free(ids);
            return bt_fail(BT_ERR_INVALID, "%s: \"%s\"[%zu] must be a %s name or a non-negative id", origin, key, i,
                           is_user ? "user" : "group");
        }
    }
    *out = ids;
    *n_out = (int)n;
    return BT_OK;
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

static int parse_obj(ld_config *c, json_t *root, const char *origin) {
    const char *key;
    json_t *v;
    long long x;
    int rc;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "socket")) {
            const char *s = json_string_value(v);
            if (!s || s[0] == 0 || strlen(s) >= 108)
                return bt_fail(BT_ERR_INVALID, "%s: \"socket\" must be a socket path string of 1..107 bytes", origin);
            free(c->socket_path);
            c->socket_path = bt_xstrdup(s);
        } else if (!strcmp(key, "socket_mode")) {
            const char *s = json_string_value(v);
            char *end = NULL;
            unsigned long m = s ? strtoul(s, &end, 8) : 0;
            if (!s || !*s || *end || m > 0777)
                return bt_fail(BT_ERR_INVALID, "%s: \"socket_mode\" must be an octal string such as \"0660\"",
                               origin);
            c->socket_mode = (unsigned)m;
        } else if (!strcmp(key, "socket_group")) {
            const char *s = json_string_value(v);
            if (!s || !*s) return bt_fail(BT_ERR_INVALID, "%s: \"socket_group\" must be a group name", origin);
            free(c->socket_group);
            c->socket_group = bt_xstrdup(s);
        } else if (!strcmp(key, "data_roots")) {
            ld_free_strv(c->data_roots, c->n_data_roots);
            c->data_roots = NULL;
            c->n_data_roots = 0;
            if ((rc = get_roots(v, origin, key, &c->data_roots, &c->n_data_roots))) return rc;
        } else if (!strcmp(key, "model_roots")) {
            ld_free_strv(c->model_roots, c->n_model_roots);
            c->model_roots = NULL;
            c->n_model_roots = 0;
            if ((rc = get_roots(v, origin, key, &c->model_roots, &c->n_model_roots))) return rc;
        } else if (!strcmp(key, "tokenizer_threads")) {
            if ((rc = get_int(v, origin, key, 1, 256, &x))) return rc;
            c->tokenizer_threads = (uint32_t)x;
        } else if (!strcmp(key, "ring_slots")) {
            if ((rc = get_int(v, origin, key, 2, 1024, &x))) return rc;
            c->ring_slots = (uint32_t)x;
        } else if (!strcmp(key, "max_clients")) {
            if ((rc = get_int(v, origin, key, 1, 65536, &x))) return rc;
            c->max_clients = (uint32_t)x;
        } else if (!strcmp(key, "max_jobs")) {
            if ((rc = get_int(v, origin, key, 1, 4096, &x))) return rc;
            c->max_jobs = (uint32_t)x;
        } else if (!strcmp(key, "max_request_bytes")) {
            if ((rc = get_int(v, origin, key, 1024, 64ll << 20, &x))) return rc;
            c->max_request_bytes = (size_t)x;
        } else if (!strcmp(key, "max_ring_bytes")) {
            if ((rc = get_int(v, origin, key, 1ll << 20, 1ll << 40, &x))) return rc;
            c->max_ring_bytes = (uint64_t)x;
        } else if (!strcmp(key, "max_json_depth")) {
            if ((rc = get_int(v, origin, key, 2, 1000, &x))) return rc;
            c->max_json_depth = (uint32_t)x;
        } else if (!strcmp(key, "allowed_users")) {
            unsigned *ids = NULL;
            int n = 0;
            if ((rc = get_ids(v, origin, key, 1, &ids, &n))) return rc;
            free(c->allowed_uids);
            c->allowed_uids = (uid_t *)ids;
            c->n_allowed_uids = n;
        } else if (!strcmp(key, "allowed_groups")) {
            unsigned *ids = NULL;
            int n = 0;
            if ((rc = get_ids(v, origin, key, 0, &ids, &n))) return rc;
            free(c->allowed_gids);
            c->allowed_gids = (gid_t *)ids;
            c->n_allowed_gids = n;
        } else if (!strcmp(key, "client_timeout_s")) {
            if ((rc = get_int(v, origin, key, 0, 86400, &x))) return rc;
            c->client_timeout_s = (uint32_t)x;
        } else if (!strcmp(key, "token_cache_dir")) {
            const char *s = json_string_value(v);
            if (!s || s[0] != '/' || strlen(s) > 3000)
                return bt_fail(BT_ERR_INVALID, "%s: \"token_cache_dir\" must be an absolute directory path (string)",
                               origin);
            free(c->token_cache_dir);
            c->token_cache_dir = bt_xstrdup(s);
        } else if (!strcmp(key, "token_cache_max_bytes")) {
            if ((rc = get_int(v, origin, key, 16ll << 20, LLONG_MAX, &x))) return rc;
            c->token_cache_max_bytes = (uint64_t)x;
        } else if (!strcmp(key, "token_cache_wait_s")) {
            if ((rc = get_int(v, origin, key, 0, 86400, &x))) return rc;
            c->token_cache_wait_s = (uint32_t)x;
        } else {
            return bt_fail(BT_ERR_INVALID,
                           "%s: unknown key \"%s\" (known: socket, socket_mode, socket_group, data_roots, "
                           "model_roots, tokenizer_threads, ring_slots, max_clients, max_jobs, max_request_bytes, "
                           "max_ring_bytes, max_json_depth, allowed_users, allowed_groups, client_timeout_s, "
                           "token_cache_dir, token_cache_max_bytes, token_cache_wait_s)",
                           origin, key);
        }
    }
    return BT_OK;
}

int ld_config_parse(ld_config *c, const char *json_text, const char *origin) {
    json_error_t e;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &e);
    if (!root) {
        memset(c, 0, sizeof *c);
        return bt_fail(BT_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", origin, e.line, e.column, e.text);
    }
    if (!json_is_object(root)) {
        json_decref(root);
        memset(c, 0, sizeof *c);
        return bt_fail(BT_ERR_INVALID, "%s: the configuration must be a JSON object", origin);
    }
    ld_config_defaults(c);
    int rc = parse_obj(c, root, origin);
    json_decref(root);
    if (rc) ld_config_free(c);
    return rc;
}

int ld_config_load(ld_config *c, const char *path) {
    memset(c, 0, sizeof *c);
    FILE *f = fopen(path, "rb");
    if (!f) return bt_fail(BT_ERR_IO, "config %s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = bt_xmalloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (n > (4u << 20)) {
            fclose(f);
            free(buf);
            return bt_fail(BT_ERR_INVALID, "config %s: larger than 4 MiB", path);
        }
        if (cap - n < 2) buf = bt_xrealloc(buf, cap *= 2);
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return bt_fail(BT_ERR_IO, "config %s: read error", path);
    }
    buf[n] = 0;
    int rc = ld_config_parse(c, buf, path);
    free(buf);
    return rc;
}

static void join_roots(char *out, size_t n, char *const *roots, int k) {
    out[0] = 0;
    size_t used = 0;
    for (int i = 0; i < k && used < n; i++)
        used += (size_t)snprintf(out + used, n - used, "%s%s", i ? "," : "", roots[i]);
    if (k == 0) snprintf(out, n, "(none)");
}

static int diff_roots(const char *key, char *const *a, int na, char *const *b, int nb) {
    int same = na == nb;
    for (int i = 0; same && i < na; i++) same = !strcmp(a[i], b[i]);
    if (same) return 0;
    char sa[1024], sb[1024];
    join_roots(sa, sizeof sa, a, na);
    join_roots(sb, sizeof sb, b, nb);
    bt_log(BT_LOG_INFO, "loaderd", "config: %s: %s -> %s", key, sa, sb);
    return 1;
}

static void join_ids(char *out, size_t n, const unsigned *ids, int k) {
    size_t used = 0;
    out[0] = 0;
    for (int i = 0; i < k && used < n; i++) used += (size_t)snprintf(out + used, n - used, "%s%u", i ? "," : "", ids[i]);
    if (k == 0) snprintf(out, n, "(anyone)");
}

static int diff_ids(const char *key, const unsigned *a, int na, const unsigned *b, int nb) {
    int same = na == nb;
    for (int i = 0; same && i < na; i++) same = a[i] == b[i];
    if (same) return 0;
    char sa[512], sb[512];
    join_ids(sa, sizeof sa, a, na);
    join_ids(sb, sizeof sb, b, nb);
    bt_log(BT_LOG_INFO, "loaderd", "config: %s: %s -> %s (applies to new connections)", key, sa, sb);
    return 1;
}

int ld_config_log_diff(const ld_config *o, const ld_config *n) {
    int d = 0;
    if (strcmp(o->socket_path, n->socket_path)) {
        bt_log(BT_LOG_WARN, "loaderd", "config: socket: %s -> %s (takes effect after a restart)", o->socket_path,
               n->socket_path);
        d++;
    }
    if (o->socket_mode != n->socket_mode) {
        bt_log(BT_LOG_WARN, "loaderd", "config: socket_mode: %04o -> %04o (takes effect after a restart)",
               o->socket_mode, n->socket_mode);
        d++;
    }
    const char *og = o->socket_group ? o->socket_group : "(none)", *ng = n->socket_group ? n->socket_group : "(none)";
    if (strcmp(og, ng)) {
        bt_log(BT_LOG_WARN, "loaderd", "config: socket_group: %s -> %s (takes effect after a restart)", og, ng);
        d++;
    }
    const char *ot = o->token_cache_dir ? o->token_cache_dir : "(none)", *nt = n->token_cache_dir ? n->token_cache_dir : "(none)";
    if (strcmp(ot, nt) || o->token_cache_max_bytes != n->token_cache_max_bytes ||
        o->token_cache_wait_s != n->token_cache_wait_s) {
        bt_log(BT_LOG_WARN, "loaderd", "config: token cache: %s, %llu bytes, wait %u s -> %s, %llu bytes, wait %u s "
               "(takes effect after a restart)", ot, (unsigned long long)o->token_cache_max_bytes, o->token_cache_wait_s,
               nt, (unsigned long long)n->token_cache_max_bytes, n->token_cache_wait_s);
        d++;
    }
    d += diff_roots("data_roots", o->data_roots, o->n_data_roots, n->data_roots, n->n_data_roots);
    d += diff_roots("model_roots", o->model_roots, o->n_model_roots, n->model_roots, n->n_model_roots);
#define DIFF_U(field)                                                                                          \
    if ((unsigned long long)o->field != (unsigned long long)n->field) {                                        \
        bt_log(BT_LOG_INFO, "loaderd", "config: " #field ": %llu -> %llu (applies to new attaches)",           \
               (unsigned long long)o->field, (unsigned long long)n->field);                                    \
        d++;                                                                                                   \
    }
    DIFF_U(tokenizer_threads)
    DIFF_U(ring_slots)
    DIFF_U(max_clients)
    DIFF_U(max_jobs)
    DIFF_U(max_request_bytes)
    DIFF_U(max_ring_bytes)
    DIFF_U(max_json_depth)
    DIFF_U(client_timeout_s)
#undef DIFF_U
    d += diff_ids("allowed_users", o->allowed_uids, o->n_allowed_uids, n->allowed_uids, n->n_allowed_uids);
    d += diff_ids("allowed_groups", o->allowed_gids, o->n_allowed_gids, n->allowed_gids, n->n_allowed_gids);
    return d;
}

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

/* Whether the fixed (wildcard-free) directory prefix of `pat` lies inside a data root, checked
 * before globbing: the realpath of its longest existing leading part must be inside a root.
 * Otherwise "matches no file" vs "outside" would tell a client what exists outside the roots. */
static int pattern_prefix_in_roots(const ld_config *c, const char *pat) {
    size_t n = strcspn(pat, "*?[\\");
    char *pre = bt_xmalloc(n + 2);
    memcpy(pre, pat, n);
    pre[n] = 0;
    if (pat[n]) { /* cut back to the directory holding the first wildcard */
        char *sl = strrchr(pre, '/');
        sl[sl == pre ? 1 : 0] = 0; /* pat[0] == '/', so there is one */
    }
    int in = 0;
    for (;;) {
        char *rp = realpath(pre, NULL);
        if (rp) {
            in = ld_path_in_roots(rp, c->data_roots, c->n_data_roots);
            if (!in)
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: fixed prefix %s resolves to %s, outside every "
                                               "data root", pat, pre, rp);
            free(rp);
            break;
        }
        char *sl = strrchr(pre, '/');
        if (!sl || (sl == pre && pre[1] == 0)) break; /* "/" cannot fail; be safe anyway */
        sl[sl == pre ? 1 : 0] = 0;
    }
    free(pre);
    return in;
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
            rc = bt_fail(BT_ERR_INVALID, "job: shard pattern \"%s\" reaches outside every data root", pat);
            break;
        }
        glob_t g;
        int gr = glob(pat, GLOB_ERR, NULL, &g);
        if (gr == GLOB_NOMATCH) {
            rc = bt_fail(BT_ERR_NOTFOUND, "job: shard pattern \"%s\" matches no file", pat);
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
            char *rp = realpath(g.gl_pathv[k], NULL);
            struct stat st;
            /* the message goes back to the client: never name what the glob found or where it
             * resolves outside the data roots (that would list directories the client may not
             * read); the log line keeps the details for the operator */
            if (!rp || stat(rp, &st) != 0) {
                int e = errno;
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: match %s: %s", pat, g.gl_pathv[k], strerror(e));
                rc = bt_fail(BT_ERR_NOTFOUND, "job: shard pattern \"%s\" matches an unreadable path (%s)", pat,
                             strerror(e));
            } else if (!ld_path_in_roots(rp, c->data_roots, c->n_data_roots)) {
                bt_log(BT_LOG_WARN, "loaderd", "job: shard pattern %s: match %s resolves to %s, outside every data root",
                       pat, g.gl_pathv[k], rp);
                rc = bt_fail(BT_ERR_INVALID, "job: shard pattern \"%s\" matches a file outside every data root", pat);
            } else if (!S_ISREG(st.st_mode)) {
                rc = bt_fail(BT_ERR_INVALID, "job: shard %s is not a regular file", rp);
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
    char *rp = realpath(path, NULL);
    struct stat st;
    if (!rp || stat(rp, &st) != 0) {
        int e = errno;
        free(rp);
        return bt_fail(BT_ERR_NOTFOUND, "job: tokenizer %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        free(rp);
        return bt_fail(BT_ERR_INVALID, "job: tokenizer %s is not a regular file", path);
    }
    if (!ld_path_in_roots(rp, c->model_roots, c->n_model_roots) &&
        !ld_path_in_roots(rp, c->data_roots, c->n_data_roots)) {
        bt_log(BT_LOG_WARN, "loaderd", "job: tokenizer %s resolves to %s, outside model_roots and data_roots", path, rp);
        int rc = bt_fail(BT_ERR_INVALID, "job: tokenizer %s lies outside model_roots and data_roots", path);
        free(rp);
        return rc;
    }
    *out = rp;
    return BT_OK;
}

int ld_socket_clear_stale(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? BT_OK : bt_fail(BT_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISSOCK(st.st_mode)) return bt_fail(BT_ERR_INVALID, "%s exists and is not a socket: refusing to replace it", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return bt_fail(BT_ERR_IO, "socket: %s", strerror(errno));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0) return bt_fail(BT_ERR_INVALID, "%s: another loaderd is already listening there", path);
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
