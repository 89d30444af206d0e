#!/usr/bin/env bash
# Data plane per node (run by `make bench`): tokenize + pack CPU-seconds per node for 1, 2 and 4
# simulated nodes x 2 ranks each (tests/tools/bench_dataplane.c: one process per node, started
# together), first and second epoch, for today's per-rank design (every rank tokenizes every
# line), the shared stream (one pipeline per job per node) and the shared stream with a token
# cache directory shared by all nodes. Data: data/bench-dataplane (scripts/make-shards, 8 zstd
# shards of FOLDOC + alpaca chat), SmolLM2 tokenizer, T=2048, B=4, 1 tokenize thread per
# pipeline; median of 3 runs (a fresh, empty cache directory for each run).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${BT_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
tool=$BUILD/tools/bench_dataplane
[ -x "$tool" ] || make --no-print-directory "$tool" >&2
DATA=data/bench-dataplane
python3 scripts/make-shards "$DATA" --shards 8 >&2
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "## Data plane per node (N nodes x 2 ranks)"
echo
echo "$DATA ($(ls $DATA/train-*.jsonl.zst | wc -l) zstd shards, $(du -cb $DATA/train-*.jsonl.zst | tail -1 | cut -f1) bytes), chat format, $(basename "$MODEL") tokenizer, T=2048, B=4, 1 tokenize thread per pipeline; CPU seconds of each node process (all threads: read, hash, tokenize, pack, cache I/O), mean over the nodes, median of 3 runs."
echo "Command: \`$tool --model $MODEL --shards '$DATA/train-*.jsonl.zst' --nodes N --design D [--cache-dir EMPTY_DIR]\`"
echo
echo "| nodes | design | epoch 1 CPU-s / node | epoch 2 CPU-s / node | epoch 1 vs today | epoch 2 vs today | shards tokenized (cluster) | batches identical |"
echo "|---|---|---|---|---|---|---|---|"
median() { sort -g | sed -n 2p; }
for n in 1 2 4; do
  declare -A e1 e2 built sum
  for d in today shared cached; do
    : > "$tmp/r"
    for rep in 1 2 3; do
      rm -rf "$tmp/cache"; mkdir "$tmp/cache"
      "$tool" --model "$MODEL" --shards "$DATA/train-*.jsonl.zst" --nodes $n --design $d --cache-dir "$tmp/cache" \
        --seq-len 2048 --batch 4 --threads 1 >> "$tmp/r"
    done
    e1[$d]=$(field epoch1_cpu_mean < "$tmp/r" | median)
    e2[$d]=$(field epoch2_cpu_mean < "$tmp/r" | median)
    built[$d]=$(field built < "$tmp/r" | head -1)
    sum[$d]=$(field checksum < "$tmp/r" | sort -u | tr '\n' ' ')
  done
  for d in today shared cached; do
    same=yes; [ "${sum[$d]}" = "${sum[today]}" ] || same=NO
    case $d in
      today) tok="8 x $((2 * n)) (every rank)";;
      shared) tok="8 x $n (every node)";;
      *) tok="${built[$d]} (once, into the cache)";;
    esac
    awk -v n=$n -v d=$d -v a="${e1[$d]}" -v b="${e2[$d]}" -v ta="${e1[today]}" -v tb="${e2[today]}" -v t="$tok" -v s=$same \
      'BEGIN { printf "| %d | %s | %.3f | %.3f | %.2fx | %.2fx | %s | %s |\n", n, d, a, b, a / ta, b / tb, t, s }'
  done
  unset e1 e2 built sum
done
echo
echo "today: every rank has a pipeline of its own (the design before issue 14). shared: one pipeline per"
echo "job per node, its ranks take their own rows. cached: shared, plus a token cache directory all nodes"
echo "use (a shared filesystem): each shard is tokenized once in the cluster, later epochs and jobs read it."
echo "Epoch 2 = the same 1-epoch job run again by the same node process. \"batches identical\": every rank's"
echo "batch checksums equal today's."
