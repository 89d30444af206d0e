/* loaderd: the node's data daemon. Usage:
 *   loaderd --config FILE [--socket PATH] [--foreground] [--check]
 * Never forks (systemd Type=notify); logs to stderr, which journald collects when run as a
 * service. --check validates the configuration file and exits (0 valid, 1 not). */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common/bt_common.h"
#include "loaderd/config.h"
#include "loaderd/server.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: loaderd --config FILE [--socket PATH] [--foreground] [--check]\n"
            "  --config FILE   JSON configuration (see scripts/loaderd.example.json)\n"
            "  --socket PATH   control socket, overrides the config's \"socket\"\n"
            "  --foreground    interactive run (loaderd never forks; logs go to stderr either way)\n"
            "  --check         validate the configuration and exit\n"
            "signals: SIGTERM/SIGINT stop cleanly (exit 0), SIGHUP reloads the configuration\n");
}

int main(int argc, char **argv) {
    ld_server_opts o = {0};
    int check = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) o.config_path = argv[++i];
        else if (!strcmp(argv[i], "--socket") && i + 1 < argc) o.socket_override = argv[++i];
        else if (!strcmp(argv[i], "--foreground")) o.foreground = 1;
        else if (!strcmp(argv[i], "--check")) check = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "loaderd: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!o.config_path) {
        fprintf(stderr, "loaderd: --config FILE is required\n");
        usage(stderr);
        return 2;
    }
    if (check) {
        ld_config c;
        if (ld_config_load(&c, o.config_path)) {
            fprintf(stderr, "loaderd: %s\n", bt_last_error());
            return 1;
        }
        printf("%s: ok (socket %s, %d data root(s), %d model root(s))\n", o.config_path, c.socket_path,
               c.n_data_roots, c.n_model_roots);
        ld_config_free(&c);
        return 0;
    }
    signal(SIGPIPE, SIG_IGN); /* a client that hangs up mid-reply must not kill the daemon */
    return ld_server_run(&o);
}
