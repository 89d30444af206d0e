/* loaderd configuration file (JSON, jansson) and the path policy built on it.
 * Keys (all optional; unknown keys and wrong types are refused naming the key):
 *   "socket"            string  control socket path (default /run/loaderd/loaderd.sock)
 *   "socket_mode"       string  octal file mode set on the socket after bind (default "0660")
 *   "socket_group"      string  group name (or numeric gid) given to the socket; default: none
 *   "data_roots"        [string] directories dataset shards must resolve (realpath) inside;
 *                       default [] (every dataset refused)
 *   "model_roots"       [string] directories tokenizer files may resolve inside, in addition to
 *                       data_roots; default []
 *   "tokenizer_threads" int 1..256, tokenizer workers per job (default 2)
 *   "ring_slots"        int 2..1024, default ring depth per job (default 8)
 *   "max_clients"       int 1..65536, simultaneous connections (default 64)
 *   "max_jobs"          int 1..4096, simultaneous attached jobs (default 32)
 *   "max_request_bytes" int 1024..(64 MiB), longest request line (default 1 MiB)
 *   "max_ring_bytes"    int, largest ring (slots x slot bytes) one attach may ask for
 *                       (default 1 GiB, min 1 MiB)
 *   "max_json_depth"    int 2..1000, deepest nesting accepted in a request (default 32)
 *   "allowed_users"     [string|int] user names or uids allowed to use the socket
 *   "allowed_groups"    [string|int] group names or gids allowed to use the socket (a peer
 *                       matches by its primary gid or any supplementary group, SO_PEERGROUPS);
 *                       both empty (default): anyone who can open the socket file. root and
 *                       loaderd's own uid are always allowed. Names are resolved at load (an
 *                       unknown name is refused, naming the key).
 *   "client_timeout_s"  int 0..86400 (default 60): a connection holding half a request line, or
 *                       one without an attached job that makes no complete (valid) request, for
 *                       this long is closed (slowloris; blank lines and malformed requests do not
 *                       count as activity); 0 disables the timeout
 *   "max_clients_per_uid" int 1..65536 (default 32): simultaneous connections of one peer uid, so
 *                       one user cannot hold every slot
 *   "operator_groups"   [string|int] groups whose members (primary or supplementary gid) are
 *                       operators, like root and loaderd's own uid. Operators always get through:
 *                       past max_clients / max_clients_per_uid they have 8 more connections of
 *                       their own (`status`, `drain` work while hostile peers hold every slot),
 *                       and only they may `drain`.
 *   "memory_budget_bytes" int >= 16 MiB (default: a quarter of the machine's physical memory, at
 *                       least 256 MiB): rings plus pipeline buffers of all jobs together (each
 *                       job: slots x slot bytes + ld_pipeline_mem_estimate); an attach past it is
 *                       refused with the figures; usage in `status` and `metrics`
 *   "token_cache_dir"   string, absolute directory of the token cache (loaderd/tcache.h), created
 *                       if missing; on a shared filesystem, every node's loaderd can use the same
 *                       one and each shard is tokenized once per cluster. Default: none (no
 *                       cache; every epoch tokenizes again). Applies after a restart.
 *   "token_cache_max_bytes" int >= 16 MiB (default 64 GiB): size bound of the entries; the least
 *                       recently used are removed beyond it. Applies after a restart.
 *   "token_cache_wait_s" int 0..86400 (default 1800): longest wait for another loaderd tokenizing a
 *                       shard this one needs before tokenizing it here without the cache.
 *                       Applies after a restart.
 * Roots are resolved with realpath at load; a root that does not exist is skipped with a warning
 * (it cannot contain anything; a reload picks it up once it exists). */
#ifndef LD_CONFIG_H
#define LD_CONFIG_H
#include <stddef.h>
#include <stdint.h>
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
/* Log (bt_log info, component "loaderd") each setting that differs between old and new;
 * returns the number of differences. Settings that only apply at start (socket path, mode,
 * group) are logged as needing a restart. */
int ld_config_log_diff(const ld_config *old_c, const ld_config *new_c);

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
