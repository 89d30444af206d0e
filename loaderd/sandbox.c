/* loaderd's execve filter (contract: loaderd/sandbox.h). */
#include "loaderd/sandbox.h"

#include <errno.h>
#include <seccomp.h>
#include <string.h>

#include "common/bt_common.h"

int ld_sandbox_no_exec(void) {
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    if (!ctx) return bt_fail(BT_ERR_UNSUPPORTED, "seccomp_init failed");
    int rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1);
    if (!rc) rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(execve), 0);
    if (!rc) rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(execveat), 0);
    if (!rc) rc = seccomp_load(ctx);
    seccomp_release(ctx);
    if (rc) return bt_fail(BT_ERR_UNSUPPORTED, "seccomp filter refusing execve: %s", strerror(-rc));
    return BT_OK;
}
