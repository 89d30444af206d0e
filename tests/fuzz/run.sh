#!/usr/bin/env bash
# `make fuzz`: run every libFuzzer target in BUILD_DIR (default build/fuzz/bin) for FUZZ_SECONDS
# (default 30) each, from the repository root (the targets load $BT_MODEL, default
# models/SmolLM2-135M-Instruct.Q4_1.gguf). Corpora persist in build/fuzz/corpus/<target>
# (seeded from tests/fuzz/seeds when present plus a few generated seeds); crashes land in
# build/fuzz/crashes/<target>-*. Exit 1 if any target found a crash, leak or invariant failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-build/fuzz/bin}
secs=${FUZZ_SECONDS:-30}
export BT_MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
root=build/fuzz
mkdir -p "$root/corpus" "$root/crashes"

seed() { # seed TARGET NAME BYTES(printf format)
  mkdir -p "$root/corpus/$1"
  printf "$3" > "$root/corpus/$1/seed-$2"
}
seed fuzz_control status '\x20{"v":1,"op":"status"}\n{"v":1,"op":"jobs"}'
seed fuzz_control attach '\x20{"v":1,"op":"attach","rank":1,"world_size":2,"resume":null,"job":{"name":"x","shards":["/d/*.jsonl"]}}'
seed fuzz_control report '\x20{"v":1,"op":"report","job_id":3,"step":9,"loss":1.5,"tokens_per_s":null}\n{"v":1,"op":"detach"}'
seed fuzz_jsonl_sample chat '\x01{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi?"},{"role":"assistant","content":"Hello!"}]}'
seed fuzz_jsonl_sample alpaca '\x42{"instruction":"Add","input":"2 and 3","output":"5"}'
seed fuzz_jsonl_sample text '\x00{"text":"Plain text \\u00e9\\u4e2d 123 <|im_end|>"}'
seed fuzz_tokenizer mixed '\x01Hello <|im_start|>user\nwörld 12345 \xf0\x9f\x98\x80  \t end'
seed fuzz_tokenizer bad '\x00\xff\xfe\xc3( \xe2\x82 tail'
seed fuzz_yaml_config job 'model: m.gguf\ndata:\n  shards: &s [a/*.jsonl]\n  seq_len: 0x200\neval: {shards: *s}\noptim:\n  lr: 1e-3\n'
seed fuzz_tcache_entry doc '\x01\x00\x05\x00\x01\x03\x01\x02\x03\x02\x01\x02'
seed fuzz_tcache_entry bad '\x02\x01\x02\x00\x02\x05\x00\x01\x01\x04\x02\x00\x05oops!'
seed fuzz_zstd_source plain '\x24\x00\x00{"text":"a"}\r\n\n{"text":"b"}\nlast'
seed fuzz_zstd_source zstd '\x25\x00\x00{"text":"a"}\n{"text":"bb"}\n{"text":"ccc"}\n'
seed fuzz_zstd_source cut '\x26\x80\x11{"text":"a"}\n{"text":"bb"}\n{"text":"ccc"}\n'

fail=0
ran=0
for t in "$bin"/fuzz_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  ran=$((ran + 1))
  mkdir -p "$root/corpus/$name"
  [ -d "tests/fuzz/seeds/$name" ] && cp -n "tests/fuzz/seeds/$name"/* "$root/corpus/$name/" 2>/dev/null
  echo "fuzz: $name for ${secs}s" >&2
  log="$root/$name.log"
  if "$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
      -artifact_prefix="$root/crashes/$name-" "$root/corpus/$name" > "$log" 2>&1; then
    echo "fuzz: $name ok: $(grep -E '^#[0-9]+.*DONE|stat::number_of_executed_units' "$log" | tail -1)" >&2
  else
    echo "fuzz: $name FAILED (log $log, artifacts $root/crashes/$name-*)" >&2
    tail -40 "$log" >&2
    fail=1
  fi
done
[ "$ran" -gt 0 ] || { echo "fuzz: no targets in $bin (build them with make fuzz)" >&2; exit 1; }
exit $fail
