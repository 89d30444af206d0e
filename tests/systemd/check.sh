#!/bin/bash
# The checks of `make test-systemd`, run INSIDE the booted container by barq-check.service
# (tests/py/test_systemd.py builds the root, installs BarqTrain with `make install DESTDIR=...`
# exactly as the README's service section says, boots it with systemd-nspawn and reads
# /results). Every check writes one line to /results/results.tsv:
#     PASS|FAIL <TAB> name <TAB> detail
# and the evidence (command output, journal excerpts) goes to /results/log.txt. Figures the
# README quotes (exposure score, restart time) are written as  INFO <TAB> name <TAB> value.
# At the end the container powers itself off.
set -u
R=/results
: >"$R/results.tsv"
: >"$R/log.txt"
exec 2>>"$R/log.txt"
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
SOCK=/run/loaderd/loaderd.sock
CONF=/etc/loaderd/loaderd.json
ASSETS=/usr/local/libexec/barq-test

log() { printf '%s\n' "$*" >>"$R/log.txt"; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n' '  ' | cut -c1-400)" >>"$R/results.tsv"; }
pass() { record PASS "$1" "$2"; log "== PASS $1: $2"; }
fail() { record FAIL "$1" "$2"; log "== FAIL $1: $2"; }
info() { record INFO "$1" "$2"; log "== INFO $1: $2"; }
run() { log "\$ $*"; "$@" >>"$R/log.txt" 2>&1; }
# run as user U with its groups (setpriv execs: no PAM session, no extra process; util-linux)
as() { local u=$1; shift; setpriv --reuid="$u" --regid="$u" --init-groups --reset-env "$@"; }
mainpid() { systemctl show -p MainPID --value loaderd; }
prop() { systemctl show -p "$1" --value loaderd; }
cursor() { journalctl -u loaderd -n 0 --show-cursor -q 2>/dev/null | sed -n 's/^-- cursor: //p'; }
journal_after() { journalctl -u loaderd --after-cursor="$1" -o cat --no-pager 2>/dev/null; }
wait_for() { # wait_for SECONDS CMD...: poll CMD every 0.2 s until it succeeds
    local end=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -ge $end ] && return 1
        sleep 0.2
    done
}
steps_seen() { grep -c 'step [0-9]*/' /home/alice/long.log; }
more_steps() { [ "$(steps_seen)" -ge "$1" ]; }
went_away_twice() { [ "$(grep -c 'loaderd went away' /home/alice/long.log)" -ge 2 ]; }
finish() {
    journalctl -u loaderd -o short-monotonic --no-pager >"$R/journal-loaderd.txt" 2>&1
    journalctl -b -o short-monotonic --no-pager | tail -n 400 >"$R/journal-tail.txt" 2>&1
    echo done >"$R/done"
    systemctl poweroff --no-block
}
trap finish EXIT

# ---- 1. set-up as the README's service section gives it (make install already ran) --------
run systemd-sysusers
if getent passwd loaderd >/dev/null && getent group loaderd >/dev/null; then
    pass sysusers "$(getent passwd loaderd)"
else
    fail sysusers "systemd-sysusers did not create the loaderd user and group"
fi
run systemctl daemon-reload
t0=$(date +%s.%N)
if run systemctl enable --now loaderd; then
    # Type=notify: `systemctl start` returns only after READY=1, so the socket answers at once
    if out=$(loaderctl status 2>&1); then
        pass ready "socket answered right after systemctl enable --now returned ($(echo "$out" | head -n 1))"
    else
        fail ready "systemctl enable --now returned but the socket did not answer: $out"
    fi
else
    fail ready "systemctl enable --now loaderd failed: $(systemctl status loaderd --no-pager 2>&1 | tail -n 5)"
fi
t_start=$SECONDS
st=$(stat -c '%a %U %G' "$SOCK" 2>&1)
dir=$(stat -c '%a %U %G' /run/loaderd 2>&1)
if [ "$st" = "660 loaderd loaderd" ] && [ "$dir" = "750 loaderd loaderd" ]; then
    pass socket_mode "socket $st, directory $dir"
else
    fail socket_mode "socket: $st, directory: $dir (want 660 loaderd loaderd / 750 loaderd loaderd)"
fi

# ---- 2. who may use it: a member of the socket's group trains, a non-member is refused -----
groupadd -f trainers
useradd -m -G loaderd,trainers alice
useradd -m -G loaderd bob
useradd -m mallory
out=$(cd /home/alice && timeout 300 setpriv --reuid=alice --regid=alice --init-groups --reset-env trainer train --config /srv/barq/jobs/short.json 2>&1)
rc=$?
log "$out"
if [ $rc -eq 0 ] && echo "$out" | grep -q 'step 3/3 ' && [ -f /home/alice/run-short/adapter_model.safetensors ]; then
    pass member_trains "alice (group loaderd) trained 3 steps through $SOCK: $(echo "$out" | grep -m1 -o 'step 3/3 | loss [0-9.]*')"
else
    fail member_trains "trainer as alice exited $rc: $(echo "$out" | tail -n 3)"
fi
out=$(as mallory loaderctl status 2>&1)
rc=$?
out2=$(cd /tmp && timeout 60 setpriv --reuid=mallory --regid=mallory --init-groups --reset-env trainer train --config /srv/barq/jobs/short.json 2>&1)
rc2=$?
log "$out" "$out2"
if [ $rc -ne 0 ] && echo "$out" | grep -q "Permission denied" && [ $rc2 -ne 0 ] && echo "$out2" | grep -q "$SOCK"; then
    pass non_member_refused "loaderctl: $(echo "$out" | head -n 1) | trainer: $(echo "$out2" | grep -m1 "$SOCK")"
else
    fail non_member_refused "mallory: loaderctl exit $rc ($out), trainer exit $rc2 ($(echo "$out2" | tail -n 2))"
fi

# ---- 3. a running job: STATUS=, a clean stop, the trainer continues after the restart -------
rm -rf /home/alice/run-long
(cd /home/alice && exec setpriv --reuid=alice --regid=alice --init-groups --reset-env trainer train --config /srv/barq/jobs/long.json >/home/alice/long.log 2>&1) &
tpid=$!
if wait_for 120 grep -q 'step 5/' /home/alice/long.log; then
    sleep 6 # STATUS= is sent every 5 s
    out=$(systemctl status loaderd --no-pager 2>&1)
    log "$out"
    line=$(echo "$out" | grep -m1 'Status:')
    if echo "$line" | grep -Eq 'Status: "[1-9][0-9]* job\(s\), [0-9]+ client\(s\), [0-9.]+ tokens/s"'; then
        pass status_line "$(echo "$line" | sed 's/^ *//')"
    else
        fail status_line "systemctl status shows: ${line:-no Status: line}"
    fi
else
    fail status_line "the long job did not reach step 5: $(tail -n 3 /home/alice/long.log)"
fi
before=$(grep -o 'step [0-9]*/' /home/alice/long.log | tail -n 1)
t=$SECONDS
run systemctl stop loaderd
stop_s=$((SECONDS - t))
res=$(prop Result) code=$(prop ExecMainStatus) act=$(prop ActiveState)
if [ "$res" = success ] && [ "$code" = 0 ] && [ "$act" = inactive ] && kill -0 $tpid 2>/dev/null; then
    pass stop_clean "systemctl stop in ${stop_s} s: Result=$res ExecMainStatus=$code, the trainer waits (at $before)"
else
    fail stop_clean "Result=$res ExecMainStatus=$code ActiveState=$act trainer alive: $(kill -0 $tpid 2>/dev/null && echo yes || echo no)"
fi
run systemctl start loaderd
t_start=$SECONDS
n0=$(steps_seen)
if wait_for 120 more_steps $((n0 + 5)); then
    pass job_continues "after the restart: $(grep -m1 -o 'loaderd went away[^:]*' /home/alice/long.log), then $(grep -o 'step [0-9]*/' /home/alice/long.log | tail -n 1)"
else
    fail job_continues "the trainer did not continue after the restart: $(tail -n 4 /home/alice/long.log)"
fi

# ---- 4. the watchdog is fed (no restart for longer than WatchdogSec) and enforced ----------
wd=$(prop WatchdogUSec)
case "$wd" in # "30s" (systemctl show's format)
[0-9]*s) wd_s=${wd%s} wd_s=${wd_s%.*} ;;
*) wd_s=60 ;;
esac
sleep_until=$((t_start + wd_s + 5))
[ $SECONDS -lt $sleep_until ] && sleep $((sleep_until - SECONDS))
pid=$(mainpid) nr=$(prop NRestarts)
if [ "$(prop ActiveState)" = active ] && [ "$nr" = 0 ] && loaderctl status >/dev/null 2>&1; then
    pass watchdog_fed "up $((SECONDS - t_start)) s (WatchdogSec=$wd) without a watchdog restart"
else
    fail watchdog_fed "ActiveState $(prop ActiveState), NRestarts $nr after $((SECONDS - t_start)) s"
fi
t=$SECONDS
kill -STOP "$pid"
if wait_for 150 bash -c "[ \"\$(systemctl show -p MainPID --value loaderd)\" != $pid ] && [ \"\$(systemctl show -p MainPID --value loaderd)\" != 0 ] && loaderctl status"; then
    took=$((SECONDS - t))
    if journalctl -u loaderd -o cat --no-pager | grep -q 'Watchdog timeout'; then
        pass watchdog_restarts "a loaderd stopped with SIGSTOP was restarted by systemd after ${took} s (WatchdogSec=$wd); NRestarts=$(prop NRestarts)"
        info watchdog_restart_s "$took"
    else
        fail watchdog_restarts "restarted after ${took} s but the journal has no 'Watchdog timeout'"
    fi
else
    fail watchdog_restarts "not restarted within 150 s of SIGSTOP (MainPID $(mainpid), state $(prop ActiveState))"
    kill -CONT "$pid" 2>/dev/null
fi
# the long job rides over the second restart as well, then stops on SIGINT with its state saved
wait_for 60 went_away_twice
n0=$(steps_seen)
wait_for 90 more_steps $((n0 + 3))
kill -INT $tpid
wait $tpid
trc=$?
steps=$(grep -o 'step [0-9]*/' /home/alice/long.log | tr -dc '0-9\n' | tr '\n' ' ')
log "steps of the long job: $steps"
if [ $trc -eq 75 ] && [ -f /home/alice/run-long/adapter_model.safetensors ] &&
    echo "$steps" | awk '{for (i = 2; i <= NF; i++) if ($i != $(i-1) + 1) exit 1}'; then
    pass job_state_intact "steps 1..$(echo "$steps" | awk '{print $NF}') without a gap or a repeat over two loaderd restarts; SIGINT: exit 75, adapter and checkpoint saved"
else
    fail job_state_intact "trainer exit $trc, steps: $(echo "$steps" | cut -c1-200), adapter: $(ls /home/alice/run-long 2>&1 | tr '\n' ' ')"
fi

# ---- 5. systemctl reload: what changed is logged; a broken config keeps the running one ----
cp "$CONF" /root/loaderd.json.orig
c=$(cursor)
sed -i 's/"ring_slots": 8/"ring_slots": 6/; s/"allowed_groups": \[\]/"allowed_groups": ["trainers"]/' "$CONF"
if run systemctl reload loaderd; then
    j=$(journal_after "$c")
    log "$j"
    if echo "$j" | grep -q 'ring_slots: 8 -> 6' && echo "$j" | grep -q 'allowed_groups'; then
        pass reload_logs_changes "$(echo "$j" | grep -m1 'ring_slots') / $(echo "$j" | grep -m1 'allowed_groups')"
    else
        fail reload_logs_changes "journal after the reload: $(echo "$j" | tail -n 4)"
    fi
else
    fail reload_logs_changes "systemctl reload loaderd failed: $(systemctl status loaderd --no-pager 2>&1 | tail -n 4)"
fi
# bob may reach the socket (group loaderd) but is not in allowed_groups: loaderd says why
out=$(as bob loaderctl status 2>&1)
rc=$?
log "$out"
if [ $rc -ne 0 ] && echo "$out" | grep -q 'allowed' && as alice loaderctl status >/dev/null 2>&1; then
    pass refused_with_reason "bob: $(echo "$out" | head -n 1); alice (in allowed_groups) still gets through"
else
    fail refused_with_reason "bob: exit $rc: $out"
fi
pid=$(mainpid)
c=$(cursor)
printf '{"socket": "/run/loaderd/loaderd.sock", "ring_slots": ' >"$CONF"
systemctl reload loaderd >>"$R/log.txt" 2>&1
rrc=$?
sleep 1
j=$(journal_after "$c")
log "$j"
if [ "$(prop ActiveState)" = active ] && [ "$(mainpid)" = "$pid" ] && loaderctl status >/dev/null 2>&1 &&
    echo "$j" | grep -qi 'keeping the running configuration\|kept'; then
    pass reload_broken_keeps "systemctl reload exit $rrc; loaderd (pid $pid) kept running: $(echo "$j" | grep -m1 -i 'keep')"
else
    fail reload_broken_keeps "reload exit $rrc, state $(prop ActiveState), pid $(mainpid) (was $pid): $(echo "$j" | tail -n 3)"
fi
cp /root/loaderd.json.orig "$CONF"
run systemctl reload loaderd

# ---- 6. the sandbox: loaderd's own process, then a probe under the very same unit ----------
pid=$(mainpid)
st=$(grep -E '^(NoNewPrivs|Seccomp|CapEff):' /proc/$pid/status | tr -s '\t ' ' ' | tr '\n' ' ')
devs=$(awk -F: 'NR > 2 {gsub(/ /, "", $1); print $1}' /proc/$pid/net/dev | tr '\n' ' ')
rootmnt=$(awk '$5 == "/" {print $6}' /proc/$pid/mountinfo)
log "loaderd $pid: $st; netdevs: $devs; / $rootmnt"
if echo "$st" | grep -q 'NoNewPrivs: 1' && echo "$st" | grep -q 'Seccomp: 2' &&
    echo "$st" | grep -q 'CapEff: 0000000000000000' && [ "$devs" = "lo " ]; then
    pass sandbox_process "loaderd: $st; network devices: $devs; / mounted $rootmnt"
else
    fail sandbox_process "loaderd: $st; network devices: $devs"
fi
# The probe unit: the installed loaderd.service with its Exec/notify lines replaced (and its runtime
# directory kept when it stops), nothing else.
frag=$(prop FragmentPath)
{
    grep -vE '^(Type|NotifyAccess|ExecStart|ExecStartPre|ExecReload|WatchdogSec|Restart|RestartSec|Description)=' "$frag" |
        sed '/^\[Install\]/,$d'
    echo "Type=oneshot"
    # the probe shares RuntimeDirectory=loaderd: keep it (and loaderd's socket) when the probe ends
    echo "RuntimeDirectoryPreserve=yes"
    echo "ExecPaths=$ASSETS/sandbox_probe"
    echo "ExecStart=$ASSETS/sandbox_probe --write / --write /etc --write /usr --write /usr/local/bin --write /var/lib --write /var/log --write /home --write /root --write /srv/barq/data --write /srv/barq/models --write /run/loaderd --write /var/cache/loaderd --inet --netdevs --exec /bin/sh --exec /usr/bin/true --exec-copy /var/cache/loaderd --exec-copy /run/loaderd --exec-copy /tmp --exec-copy /dev/shm --exec-memfd /usr/bin/true --loaderd-filter --exec-memfd /usr/bin/true --exec $ASSETS/sandbox_probe"
} >/run/systemd/system/loaderd-sandbox-probe.service
log "$(cat /run/systemd/system/loaderd-sandbox-probe.service)"
run systemctl daemon-reload
c=$(journalctl -u loaderd-sandbox-probe -n 0 --show-cursor -q 2>/dev/null | sed -n 's/^-- cursor: //p')
run systemctl start loaderd-sandbox-probe
p=$(journalctl -u loaderd-sandbox-probe ${c:+--after-cursor="$c"} -o cat --no-pager | grep -E '^(ALLOWED|DENIED|SKIPPED|NETDEVS|FILTER) ')
log "$p"
cp /run/systemd/system/loaderd-sandbox-probe.service "$R/" 2>/dev/null
bad_w=$(echo "$p" | awk '$1 == "ALLOWED" && $2 == "write" && $3 != "/run/loaderd" && $3 != "/var/cache/loaderd" {print $3}' | tr '\n' ' ')
ok_w=$(echo "$p" | awk '$1 == "ALLOWED" && $2 == "write" {print $3}' | tr '\n' ' ')
if [ -z "$bad_w" ] && [ "$ok_w" = "/run/loaderd /var/cache/loaderd " ]; then
    pass sandbox_writes "writable only: $ok_w; refused: $(echo "$p" | awk '$1 == "DENIED" && $2 == "write" {printf "%s ", $3}')"
else
    fail sandbox_writes "writable outside the state/cache directories: '$bad_w' (writable: '$ok_w')"
fi
net_ok=$(echo "$p" | awk '$2 == "socket" && $1 == "ALLOWED"' | wc -l)
ndev=$(echo "$p" | sed -n 's/^NETDEVS //p')
if [ "$net_ok" = 0 ] && [ "$ndev" = lo ] && [ -n "$p" ]; then
    pass sandbox_network "AF_INET/AF_INET6/AF_NETLINK sockets refused; interfaces: $ndev"
else
    fail sandbox_network "sockets allowed: $net_ok; interfaces: ${ndev:-?}"
fi
# unit alone (before --loaderd-filter): every exec of a file outside ExecPaths= is refused; a memfd
# is not a file, systemd cannot stop that one. With loaderd's own filter (--loaderd-filter, what
# loaderd installs at start) nothing executes at all, not even a program ExecPaths= allows.
pre=$(echo "$p" | sed '/^FILTER /,$d')
post=$(echo "$p" | sed -n '/^FILTER /,$p')
files_bad=$(echo "$pre" | awk '$1 == "ALLOWED" && ($2 == "exec" || $2 == "exec-copy") {printf "%s %s; ", $2, $3}')
files_n=$(echo "$pre" | awk '$1 == "DENIED" && ($2 == "exec" || $2 == "exec-copy")' | wc -l)
memfd_unit=$(echo "$pre" | awk '$2 == "exec-memfd" {print $1}')
post_bad=$(echo "$post" | awk '$1 == "ALLOWED" && $2 ~ /^exec/ {printf "%s %s; ", $2, $3}')
post_n=$(echo "$post" | awk '$1 == "DENIED" && $2 ~ /^exec/' | wc -l)
if [ -z "$files_bad" ] && [ "$files_n" -eq 6 ] && echo "$post" | grep -q "^FILTER loaderd's execve filter installed" &&
    [ -z "$post_bad" ] && [ "$post_n" -eq 2 ]; then
    pass sandbox_exec "unit: 6 of 6 file execs refused ($(echo "$pre" | awk '$1 == "DENIED" && $2 ~ /^exec/ {printf "%s %s, ", $2, $3}')memfd: $memfd_unit); with loaderd's filter: a memfd and even an ExecPaths= program refused ($(echo "$post" | awk '$1 == "DENIED" {printf "%s %s %s %s; ", $2, $3, $4, $5}'))"
else
    fail sandbox_exec "unit: allowed ${files_bad:-none}, refused $files_n of 6; with loaderd's filter: allowed ${post_bad:-none}, refused $post_n of 2 ($(echo "$post" | head -n 1))"
fi
# loaderd's own refusal of execve (a seccomp filter it installs itself, so that even a memfd
# cannot be executed): reported by loaderd
if loaderctl status --json | grep -q '"no_exec": *true'; then
    pass loaderd_no_exec "loaderd reports its own execve filter in status (sandbox.no_exec)"
else
    fail loaderd_no_exec "loaderctl status --json: no \"no_exec\": true"
fi

# ---- 7. the journal, and the unit's exposure score --------------------------------------------
j=$(journalctl -u loaderd -o cat --no-pager)
jw=$(journalctl -u loaderd -p warning -o cat --no-pager)
if echo "$j" | grep -q "listening on $SOCK" && echo "$jw" | grep -q 'keeping the running configuration' &&
    ! echo "$jw" | grep -q "listening on $SOCK"; then
    pass journal "loaderd's lines are in the journal with their priorities (journalctl -p warning shows the failed reload, not the info lines)"
else
    fail journal "journal: $(echo "$j" | grep -c .) line(s); -p warning: $(echo "$jw" | head -n 3)"
fi
sec=$(systemd-analyze security loaderd --no-pager 2>&1)
echo "$sec" >"$R/security.txt"
score=$(echo "$sec" | sed -n 's/.*Overall exposure level for loaderd.service: \([0-9.]*\).*/\1/p')
if [ -n "$score" ]; then
    info exposure "$score"
    pass exposure "systemd-analyze security loaderd: $score ($(echo "$sec" | grep -o 'Overall exposure level.*' | sed 's/.*: //'))"
else
    fail exposure "no score: $(echo "$sec" | tail -n 2)"
fi
info systemd_version "$(systemctl --version | head -n 1)"
exit 0
