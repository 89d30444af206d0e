/* loaderd control server: the running configuration (internals: loaderd/server_priv.h; the file's
 * keys: loaderd/config.h). Loading it with the --socket override, reloading it (SIGHUP and the
 * "reload" op) and the references that keep a configuration alive while an attach prepared with
 * it is on the thread pool. Loop thread only. */
#include <stdlib.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "common/bt_common.h"
#include "loaderd/server_priv.h"

void ld_cfg_put(cfg_ref *r) {
    if (r && --r->refs == 0) {
        ld_config_free(&r->c);
        free(r);
    }
}

int ld_cfg_load(server *s, cfg_ref **out) {
    cfg_ref *r = bt_xcalloc(1, sizeof *r);
    int rc = ld_config_load(&r->c, s->config_path);
    if (rc) {
        free(r);
        return rc;
    }
    if (s->socket_override) {
        free(r->c.socket_path);
        r->c.socket_path = bt_xstrdup(s->socket_override);
    }
    r->refs = 1;
    *out = r;
    return BT_OK;
}

int ld_srv_reload(server *s, int *changed) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* MONOTONIC_USEC: required by Type=notify-reload (systemd >= 253), ignored before */
    sd_notifyf(0, "RELOADING=1\nSTATUS=reloading %s\nMONOTONIC_USEC=%llu", s->config_path,
               (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull);
    cfg_ref *n = NULL;
    int rc = ld_cfg_load(s, &n);
    *changed = 0;
    if (rc) {
        rc = bt_fail(BT_ERR_INVALID, "reload of %s failed, keeping the running configuration: %s", s->config_path,
                     bt_last_error());
        bt_log(BT_LOG_ERROR, LOGC, "%s", bt_last_error());
        s->reload_failures_total++;
    } else {
        *changed = ld_config_log_diff(&s->cfg->c, &n->c);
        bt_log(BT_LOG_INFO, LOGC, "reloaded %s: %d setting(s) changed", s->config_path, *changed);
        ld_cfg_put(s->cfg);
        s->cfg = n;
        s->reloads_total++;
        s->t_reload = bt_now();
    }
    sd_notifyf(0, "READY=1\nSTATUS=listening on %s (config %s)", s->socket_path, rc ? "reload failed" : "reloaded");
    return rc;
}
