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
    c->max_clients_per_uid = 32;
    c->memory_budget_bytes = ld_default_memory_budget();
}

uint64_t ld_default_memory_budget(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGE_SIZE);
    uint64_t phys = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : (uint64_t)4 << 30;
    uint64_t b = phys / 4; /* the trainers on the node need the rest */
    return b < ((uint64_t)256 << 20) ? (uint64_t)256 << 20 : b;
}

void ld_config_free(ld_config *c) {
    free(c->socket_path);
    free(c->socket_group);
    ld_free_strv(c->data_roots, c->n_data_roots);
    ld_free_strv(c->model_roots, c->n_model_roots);
    free(c->allowed_uids);
    free(c->allowed_gids);
    free(c->token_cache_dir);
    free(c->operator_gids);
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

/* get_ids into *arr / *n, replacing (and freeing) what they held. */
static int set_ids(json_t *v, const char *origin, const char *key, int is_user, unsigned **arr, int *n) {
    unsigned *ids = NULL;
    int k = 0, rc = get_ids(v, origin, key, is_user, &ids, &k);
    if (rc) return rc;
    free(*arr);
    *arr = ids;
    *n = k;
    return BT_OK;
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
            if ((rc = set_ids(v, origin, key, 1, (unsigned **)&c->allowed_uids, &c->n_allowed_uids))) return rc;
        } else if (!strcmp(key, "allowed_groups")) {
            if ((rc = set_ids(v, origin, key, 0, (unsigned **)&c->allowed_gids, &c->n_allowed_gids))) return rc;
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
        } else if (!strcmp(key, "max_clients_per_uid")) {
            if ((rc = get_int(v, origin, key, 1, 65536, &x))) return rc;
            c->max_clients_per_uid = (uint32_t)x;
        } else if (!strcmp(key, "operator_groups")) {
            if ((rc = set_ids(v, origin, key, 0, (unsigned **)&c->operator_gids, &c->n_operator_gids))) return rc;
        } else if (!strcmp(key, "memory_budget_bytes")) {
            if ((rc = get_int(v, origin, key, 16ll << 20, 1ll << 50, &x))) return rc;
            c->memory_budget_bytes = (uint64_t)x;
        } else {
            return bt_fail(BT_ERR_INVALID,
                           "%s: unknown key \"%s\" (known: socket, socket_mode, socket_group, data_roots, "
                           "model_roots, tokenizer_threads, ring_slots, max_clients, max_clients_per_uid, max_jobs, "
                           "max_request_bytes, max_ring_bytes, memory_budget_bytes, max_json_depth, allowed_users, "
                           "allowed_groups, operator_groups, client_timeout_s, token_cache_dir, "
                           "token_cache_max_bytes, token_cache_wait_s)",
                           origin, key);
        }
    }
    return BT_OK;
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
    int rc = parse_obj(c, root, origin);
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
    DIFF_U(max_clients_per_uid)
    DIFF_U(memory_budget_bytes)
#undef DIFF_U
    d += diff_ids("allowed_users", o->allowed_uids, o->n_allowed_uids, n->allowed_uids, n->n_allowed_uids);
    d += diff_ids("allowed_groups", o->allowed_gids, o->n_allowed_gids, n->allowed_gids, n->n_allowed_gids);
    d += diff_ids("operator_groups", o->operator_gids, o->n_operator_gids, n->operator_gids, n->n_operator_gids);
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
