/* sandbox_probe: tries, from inside a systemd sandbox, what loaderd's unit must forbid, and prints
 * one line per attempt:  "<ALLOWED|DENIED> <what> <errno text>".
 *
 *   sandbox_probe [--write PATH]... [--exec PATH]... [--exec-copy DIR] [--exec-memfd PATH]
 *                 [--inet] [--netdevs]
 *
 * --write PATH       create (O_CREAT|O_EXCL) and remove a file PATH/.barq-probe-<pid>
 * --exec PATH        execve(PATH) (a child process; "ALLOWED" when the program ran)
 * --exec-copy DIR    copy /proc/self/exe into DIR, execve it with --noop, remove it
 * --exec-memfd PATH  copy PATH into a memfd and fexecve it (the exec that needs no file system)
 * --inet             socket(AF_INET), socket(AF_INET6), socket(AF_NETLINK)
 * --netdevs          the network interfaces this process sees (/proc/net/dev), as "NETDEVS a,b"
 * --loaderd-filter   from here on, loaderd's own execve filter (ld_sandbox_no_exec, which loaderd
 *                    installs at start): the probe is then loaderd as far as exec goes
 * --noop             exit 0 at once (what the copies run)
 *
 * Used by tests/systemd/check.sh: a unit made from the installed loaderd.service with only its
 * Exec lines replaced runs this under exactly loaderd's sandbox (tests/py/test_systemd.py).
 * Exit status: 0 (the verdicts are in the output), 2 usage. */
#include <getopt.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/bt_common.h"
#include "loaderd/sandbox.h"

extern char **environ;

static void verdict(int allowed, const char *what, const char *arg, int err) {
    printf("%s %s %s %s\n", allowed ? "ALLOWED" : "DENIED", what, arg, allowed ? "-" : strerror(err));
    fflush(stdout);
}

static void try_write(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/.barq-probe-%ld", dir, (long)getpid());
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    int err = errno;
    if (fd >= 0) {
        close(fd);
        unlink(p);
    }
    verdict(fd >= 0, "write", dir, err);
}

/* Runs argv in a child: "allowed" when execve succeeded (the child's status tells: 127 + errno
 * is written back through a pipe on failure). */
static void try_exec_argv(const char *what, const char *label, int exec_fd, char *const argv[]) {
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC)) {
        verdict(0, what, label, errno);
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        if (exec_fd >= 0) fexecve(exec_fd, argv, environ);
        else execve(argv[0], argv, environ);
        int e = errno;
        if (write(pfd[1], &e, sizeof e) != (ssize_t)sizeof e) _exit(126);
        _exit(127);
    }
    close(pfd[1]);
    int e = 0;
    ssize_t n = read(pfd[0], &e, sizeof e);
    close(pfd[0]);
    int st = 0;
    if (pid > 0) waitpid(pid, &st, 0);
    if (pid < 0) verdict(0, what, label, errno);
    else verdict(n != (ssize_t)sizeof e, what, label, e);
}

static int copy_fd(int in, int out) {
    char buf[65536];
    for (;;) {
        ssize_t n = read(in, buf, sizeof buf);
        if (n < 0) return -1;
        if (n == 0) return 0;
        for (ssize_t o = 0; o < n;) {
            ssize_t w = write(out, buf + o, (size_t)(n - o));
            if (w < 0) return -1;
            o += w;
        }
    }
}

static void try_exec_copy(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/.barq-probe-exe-%ld", dir, (long)getpid());
    int in = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    int out = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0700);
    if (in < 0 || out < 0 || copy_fd(in, out)) {
        int err = errno;
        if (in >= 0) close(in);
        if (out >= 0) close(out);
        unlink(p);
        printf("SKIPPED exec-copy %s cannot write a copy: %s\n", dir, strerror(err));
        return;
    }
    close(in);
    close(out);
    char *argv[] = {p, "--noop", NULL};
    try_exec_argv("exec-copy", dir, -1, argv);
    unlink(p);
}

static void try_exec_memfd(const char *path) {
    int in = open(path, O_RDONLY | O_CLOEXEC);
    int mfd = memfd_create("barq-probe", MFD_CLOEXEC);
    if (in < 0 || mfd < 0 || copy_fd(in, mfd)) {
        verdict(0, "exec-memfd", path, errno);
        if (in >= 0) close(in);
        if (mfd >= 0) close(mfd);
        return;
    }
    close(in);
    char *argv[] = {(char *)path, NULL};
    try_exec_argv("exec-memfd", path, mfd, argv);
    close(mfd);
}

static void try_inet(void) {
    static const struct {
        int family;
        const char *name;
    } fam[] = {{AF_INET, "AF_INET"}, {AF_INET6, "AF_INET6"}, {AF_NETLINK, "AF_NETLINK"}};
    for (size_t i = 0; i < sizeof fam / sizeof fam[0]; i++) {
        int fd = socket(fam[i].family, fam[i].family == AF_NETLINK ? SOCK_RAW : SOCK_STREAM, 0);
        int err = errno;
        if (fd >= 0) close(fd);
        verdict(fd >= 0, "socket", fam[i].name, err);
    }
}

static void list_netdevs(void) {
    FILE *f = fopen("/proc/net/dev", "r");
    if (!f) {
        printf("NETDEVS ? %s\n", strerror(errno));
        return;
    }
    char line[512], out[2048] = "";
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!colon || strchr(line, '|')) continue;
        *colon = 0;
        char *name = line;
        while (*name == ' ') name++;
        if (strlen(out) + strlen(name) + 2 < sizeof out) {
            if (n++) strcat(out, ",");
            strcat(out, name);
        }
    }
    fclose(f);
    printf("NETDEVS %s\n", out);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    static const struct option lopts[] = {
        {"noop", no_argument, NULL, 'n'},           {"inet", no_argument, NULL, 'i'},
        {"loaderd-filter", no_argument, NULL, 'f'}, {"netdevs", no_argument, NULL, 'd'},
        {"write", required_argument, NULL, 'w'},    {"exec", required_argument, NULL, 'x'},
        {"exec-copy", required_argument, NULL, 'c'}, {"exec-memfd", required_argument, NULL, 'm'},
        {"help", no_argument, NULL, 'h'},           {NULL, 0, NULL, 0}};
    static const char usage[] = "usage: sandbox_probe [--write PATH]... [--exec PATH]... [--exec-copy DIR] "
                                "[--exec-memfd PATH] [--inet] [--netdevs] [--loaderd-filter] [--noop]\n";
    /* "+": the probes run in the order given, and parsing stops at the first non-option (an error) */
    int c;
    while ((c = getopt_long(argc, argv, "+", lopts, NULL)) != -1) {
        switch (c) {
        case 'n': return 0;
        case 'i': try_inet(); break;
        case 'f': {
            int rc = ld_sandbox_no_exec();
            printf("FILTER %s\n", rc == BT_OK ? "loaderd's execve filter installed" : bt_last_error());
            break;
        }
        case 'd': list_netdevs(); break;
        case 'w': try_write(optarg); break;
        case 'x': {
            char *args[] = {optarg, NULL};
            try_exec_argv("exec", args[0], -1, args);
            break;
        }
        case 'c': try_exec_copy(optarg); break;
        case 'm': try_exec_memfd(optarg); break;
        case 'h': fputs(usage, stdout); return 0;
        default: fputs(usage, stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "sandbox_probe: unexpected argument '%s'\n%s", argv[optind], usage);
        return 2;
    }
    return 0;
}
