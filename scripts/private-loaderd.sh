# A private loaderd for the demos (sourced by scripts/demo.sh and scripts/demo-long.sh; needs
# `root` = the repository root): start_loaderd RUN_DIR writes RUN_DIR/loaderd.json (data_roots
# root/data, model_roots root/models), starts build/loaderd in the foreground on
# RUN_DIR/loaderd.sock with its log in RUN_DIR/loaderd.log (EXTRA: more config lines, e.g.
# '"token_cache_dir": "/x",'), waits (up to 10 s, event by event)
# for the socket and sets `sock` and `ld_pid`; stop_loaderd sends SIGTERM and returns loaderd's
# exit status. The EXIT trap stops it (and a status poller in `status_pid`) on any exit.

start_loaderd() {
  local run=$1 extra=${2:-}
  sock="$root/$run/loaderd.sock"
  cat > "$run/loaderd.json" <<JSON
{
  "socket": "$sock",
  "socket_mode": "0660",
  "data_roots": ["$root/data"],
  "model_roots": ["$root/models"],
  $extra
  "tokenizer_threads": 2
}
JSON
  rm -f "$sock"
  build/loaderd --config "$run/loaderd.json" --foreground 2> "$run/loaderd.log" &
  ld_pid=$!
  status_pid=""
  trap _loaderd_cleanup EXIT
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  if [ ! -S "$sock" ]; then
    echo "demo: loaderd did not start; see $run/loaderd.log" >&2
    cat "$run/loaderd.log" >&2
    exit 1
  fi
}

_loaderd_cleanup() {
  [ -n "${status_pid:-}" ] && kill "$status_pid" 2>/dev/null || true
  if [ -n "${ld_pid:-}" ] && kill -0 "$ld_pid" 2>/dev/null; then
    kill -TERM "$ld_pid" 2>/dev/null || true
    wait "$ld_pid" 2>/dev/null || true
  fi
}

stop_loaderd() {
  kill -TERM "$ld_pid"
  wait "$ld_pid"
}
