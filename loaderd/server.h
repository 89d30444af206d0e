/* loaderd control server: libuv loop on a Unix stream socket speaking newline-delimited JSON
 * (proto/PROTOCOL.md), one producer thread per attached (job, rank) filling a memfd ring,
 * systemd notification (READY/STATUS/WATCHDOG/STOPPING/RELOADING), signals (SIGTERM/SIGINT:
 * stop and exit 0, SIGHUP: reload the configuration file). */
#ifndef LD_SERVER_H
#define LD_SERVER_H

typedef struct {
    const char *config_path;     /* required: JSON configuration (loaderd/config.h) */
    const char *socket_override; /* NULL, or a socket path replacing the config's "socket" */
    int foreground;              /* informational: loaderd never forks either way */
} ld_server_opts;

/* Load the configuration, bind and listen, serve until drained or signalled, release
 * everything (rings closed, producer threads joined, tokenizers freed).
 * Returns the process exit status: 0 after a clean stop (SIGTERM/SIGINT/drain),
 * 1 when start-up failed (message logged: bad config, socket in use, bind failure). */
int ld_server_run(const ld_server_opts *opts);

struct ld_command;
/* loaderd's command table (loaderd/server_proto.h: rows up to one with a NULL name; static), for
 * parsing requests without a server: ld_request_parse in tests and fuzz targets. */
const struct ld_command *ld_server_commands(void);

#endif
