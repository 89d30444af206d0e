/* loaderd: the node's data daemon. Usage:
 *   loaderd --config FILE [--socket PATH] [--foreground] [--check]
 *   loaderd --config-keys | --job-keys
 * Never forks (systemd Type=notify); logs to stderr, which journald collects when run as a
 * service. --check validates the configuration file and exits (0 valid, 1 not). --config-keys /
 * --job-keys print the keys of the configuration file / of a job spec (their key tables:
 * loaderd/config.c, loaderd/job.c) as a Markdown table. Options are read with getopt_long. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common/bt_common.h"
#include "loaderd/config.h"
#include "loaderd/job.h"
#include "loaderd/server.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: loaderd --config FILE [--socket PATH] [--foreground] [--check]\n"
            "       loaderd --config-keys | --job-keys\n"
            "  --config FILE   JSON configuration (see scripts/loaderd.example.json)\n"
            "  --socket PATH   control socket, overrides the config's \"socket\"\n"
            "  --foreground    interactive run (loaderd never forks; logs go to stderr either way)\n"
            "  --check         validate the configuration and exit\n"
            "  --config-keys   print the configuration file's keys (Markdown table) and exit\n"
            "  --job-keys      print the job spec's keys (Markdown table) and exit\n"
            "signals: SIGTERM/SIGINT stop cleanly (exit 0), SIGHUP reloads the configuration\n");
}

int main(int argc, char **argv) {
    enum { OPT_CONFIG = 256, OPT_SOCKET, OPT_FOREGROUND, OPT_CHECK, OPT_CONFIG_KEYS, OPT_JOB_KEYS };
    static const struct option longopts[] = {
        {"config", required_argument, NULL, OPT_CONFIG},
        {"socket", required_argument, NULL, OPT_SOCKET},
        {"foreground", no_argument, NULL, OPT_FOREGROUND},
        {"check", no_argument, NULL, OPT_CHECK},
        {"config-keys", no_argument, NULL, OPT_CONFIG_KEYS},
        {"job-keys", no_argument, NULL, OPT_JOB_KEYS},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    ld_server_opts o = {0};
    int check = 0, opt;
    opterr = 0; /* our own messages below */
    /* "-": arguments that are not options come back in order (as 1), so a stray one is named */
    while ((opt = getopt_long(argc, argv, "-:h", longopts, NULL)) != -1) {
        switch (opt) {
        case OPT_CONFIG: o.config_path = optarg; break;
        case OPT_SOCKET: o.socket_override = optarg; break;
        case OPT_FOREGROUND: o.foreground = 1; break;
        case OPT_CHECK: check = 1; break;
        case OPT_CONFIG_KEYS: ld_config_print_keys(stdout); return 0;
        case OPT_JOB_KEYS: ld_job_print_keys(stdout); return 0;
        case 'h': usage(stdout); return 0;
        default: /* 1: not an option; '?': unknown; ':': its argument is missing */
            fprintf(stderr, "loaderd: unknown or incomplete argument '%s'\n", opt == 1 ? optarg : argv[optind - 1]);
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
