/* loaderd configuration file (JSON, jansson) and the path policy built on it.
 * Keys: one row each in the key table of loaderd/config.c (common/keytab.h): name, accepted
 * values, default, meaning. All are optional; an unknown key, a wrong type or a value out of
 * range is refused naming the key. `loaderd --config-keys` prints the table; the README's table
 * lists the same keys (tests/py/test_loaderd_cli.py checks it). Adding a key is adding a row (and
 * its field below). Roots are resolved with realpath at load; a root that does not exist is
 * skipped with a warning (a reload picks it up once it exists). User and group names are
 * resolved at load. */
#ifndef LD_CONFIG_H
#define LD_CONFIG_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

typedef struct {
    char *socket_path;
    unsigned socket_mode;     /* permission bits, e.g. 0660 */
    char *socket_group;       /* NULL: leave the group alone */
    char **data_roots;        /* realpath-resolved, owned */
    int n_data_roots;
    char **model_roots;
    int n_model_roots;
    uint32_t tokenizer_threads;
    uint32_t ring_slots;
    uint32_t max_clients;
    uint32_t max_jobs;
    size_t max_request_bytes;
    uint64_t max_ring_bytes;
    uint32_t max_json_depth;
    uid_t *allowed_uids;      /* resolved "allowed_users", owned */
    int n_allowed_uids;
    gid_t *allowed_gids;      /* resolved "allowed_groups", owned */
    int n_allowed_gids;
    uint32_t client_timeout_s;
    char *token_cache_dir;    /* NULL: no token cache */
    uint64_t token_cache_max_bytes;
    uint32_t token_cache_wait_s;
    uint32_t max_clients_per_uid;
    gid_t *operator_gids;     /* resolved "operator_groups", owned */
    int n_operator_gids;
    uint64_t memory_budget_bytes;
} ld_config;

/* The default memory_budget_bytes: a quarter of physical memory (sysconf), at least 256 MiB. */
uint64_t ld_default_memory_budget(void);

/* Defaults as documented above (allocates socket_path). Free with ld_config_free. */
void ld_config_defaults(ld_config *c);
/* Parse config JSON text over the defaults into *c (owned). On error returns BT_ERR_INVALID
 * (or BT_ERR_FORMAT for malformed JSON) with a message naming the key and the fix in
 * bt_last_error, and leaves *c zeroed. `origin` names the source in messages (file path). */
int ld_config_parse(ld_config *c, const char *json_text, const char *origin);
/* Read and parse a file (BT_ERR_IO if unreadable). */
int ld_config_load(ld_config *c, const char *path);
void ld_config_free(ld_config *c);
/* Log (bt_log info, component "loaderd") each setting that differs between old and new, one line
 * each ("config: ring_slots: 8 -> 4 (applies to new attaches)"); returns the number of
 * differences. Settings that only apply at start (the socket, the token cache) are logged as
 * warnings that need a restart. */
int ld_config_log_diff(const ld_config *old_c, const ld_config *new_c);
/* The key table as Markdown (key, accepted values, default, meaning) on f. */
void ld_config_print_keys(FILE *f);

/* Whether a peer (SO_PEERCRED uid/gid, supplementary groups from SO_PEERGROUPS: `groups`
 * [n_groups], may be NULL/0) may use the control socket under allowed_users/allowed_groups
 * (see above). `self_uid` is loaderd's effective uid. 1 allowed, 0 refused. */
int ld_peer_allowed(const ld_config *c, uid_t uid, gid_t gid, const gid_t *groups, int n_groups, uid_t self_uid);
/* Whether the peer is an operator: root, `self_uid` (loaderd's effective uid), or a member of
 * operator_groups (primary gid or a supplementary group). 1 / 0. */
int ld_peer_is_operator(const ld_config *c, uid_t uid, gid_t gid, const gid_t *groups, int n_groups, uid_t self_uid);

/* Whether an absolute, already resolved path lies inside one of the roots (equal to a root or
 * below it, compared by whole path components). */
int ld_path_in_roots(const char *resolved, char *const *roots, int n_roots);

/* Expand shard glob patterns (glob(3), sorted, no tilde/brace expansion), resolve each match with
 * realpath and require it to be a regular file inside data_roots. On success *out is a
 * malloc'd array of *n_out malloc'd resolved paths, glob-escaped (each is a literal glob
 * pattern matching exactly that file), in pattern order then sorted order, duplicates removed.
 * Errors (BT_ERR_INVALID / BT_ERR_NOTFOUND, message names the pattern): a pattern that matches
 * nothing, a match outside every data root, not a regular file, more than 100000 files. */
int ld_resolve_shards(const ld_config *c, char *const *patterns, int n_patterns, char ***out, int *n_out);
/* Resolve a tokenizer path: realpath, regular file, inside data_roots or model_roots.
 * *out is malloc'd. BT_ERR_NOTFOUND / BT_ERR_INVALID with message.
 * Refusals (issue 10 §3): a path that leads outside the roots (ld_path_where) gets one message,
 * "job: tokenizer \"P\": no file by that name inside model_roots or data_roots (see loaderd's log)",
 * whatever lies there (a secret, a device, a symlink leading out, a dangling link, nothing);
 * the same text for a missing file inside them. ld_resolve_shards likewise: a pattern whose
 * fixed prefix or any match leads outside, or that matches nothing, reads
 * "job: shard pattern \"P\": no file by that name inside data_roots (see loaderd's log)". The details go to
 * loaderd's log only. */
int ld_resolve_tokenizer(const ld_config *c, const char *path, char **out);
void ld_free_strv(char **v, int n);
/* Where the absolute path `path` leads: symbolic links that exist are followed (at most 40),
 * "." and ".." applied, and the components from the first one that does not exist (or cannot
 * be examined) on taken literally — the file an open would reach once the missing parts were
 * created. Unlike realpath it never fails on a missing file, so the policy can place every path
 * inside or outside the roots without saying whether it exists. malloc'd; NULL for a relative
 * path, a symlink loop or a path over PATH_MAX. */
char *ld_path_where(const char *path);
/* Whether the JSON text p[0..n) nests brackets ([ and {, outside strings) at most `max` deep
 * (the "max_json_depth" request limit; jansson's own limit is 2048). Malformed text is left
 * to the parser. */
int ld_json_depth_ok(const char *p, size_t n, unsigned max);

/* Before bind: remove a leftover socket file at `path` that nobody listens on (connect gives
 * ECONNREFUSED). BT_ERR_INVALID when another process listens there or the path exists and is
 * not a socket (never deleted); BT_ERR_IO on other errors. Missing path: BT_OK. */
int ld_socket_clear_stale(const char *path);
/* After bind: chown the socket to socket_group (name or numeric gid) if set, chmod socket_mode.
 * BT_ERR_INVALID (unknown group) / BT_ERR_IO with message. */
int ld_socket_set_perms(const ld_config *c);

#endif
