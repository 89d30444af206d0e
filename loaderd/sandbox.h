/* loaderd's own sandbox, inside whatever the service manager gives it (scripts/loaderd.service).
 *
 * loaderd never runs another program. Once started it installs a seccomp filter (libseccomp,
 * seccomp(2) SECCOMP_SET_MODE_FILTER with TSYNC: every thread of the process) under which
 * execve(2) and execveat(2) fail with EPERM, so even code injected into loaderd cannot execute a
 * file, and no memfd either (the unit's NoExecPaths= covers files on disk only; systemd cannot
 * refuse execve in the unit itself, it needs it to start the service). The filter also sets
 * no_new_privs (PR_SET_NO_NEW_PRIVS), which loaderd never needs to be without. */
#ifndef LD_SANDBOX_H
#define LD_SANDBOX_H

/* Install the filter for the calling process (all its threads). Returns 0 (BT_OK), or
 * BT_ERR_UNSUPPORTED with the reason in bt_last_error() where the kernel or the runtime refuses
 * seccomp filters (loaderd then logs a warning and goes on: the unit's sandbox still holds). */
int ld_sandbox_no_exec(void);

#endif
