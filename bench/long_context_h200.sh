#!/usr/bin/env bash
# The long-context sweep on one H200, in one device call (BENCHMARKS.md "## Long context" / "### H200").
# Writes $OUT/{sparse,sparse_1m,exact}.json and $OUT/log.txt; the plot is drawn afterwards from them.
# Each sweep is a separate process under `timeout`, so a slow 1M row cannot lose the shorter ones.
set -u
OUT=${OUT:-/tmp/lc-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
DEADLINE=${DEADLINE:-455}
left() { echo $((DEADLINE - SECONDS)); }
date -u +%FT%TZ
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,utilization.gpu --format=csv
uptime; free -g | head -2; nproc
python3 -c "import torch, transformers, typer, xxhash, prometheus_client, yaml, safetensors; print('torch', torch.__version__, 'transformers', transformers.__version__, 'typer', typer.__version__)"
python3 bench/long_context_model.py /tmp/lc-model --device cuda || exit 1
echo "model ready at ${SECONDS}s"
COMMON="--model /tmp/lc-model --device cuda --dtype bfloat16 --chunk 4K --device-budget 1G --host-bytes 4G --work-dir /tmp/lc-work"
watch_tiers() {  # progress of a long row: disk tier size and process RSS every 20 s
  while sleep 20; do
    echo "[t=${SECONDS}s] disk $(du -sm /tmp/lc-work 2>/dev/null | cut -f1) MiB, rss $(ps -o rss= -C python3 | sort -n | tail -1) KiB"
  done
}
run_sweep() {  # run_sweep <seconds> <out> <args...>
  local budget=$1 out=$2; shift 2
  if [ "$budget" -lt 30 ]; then echo "skipped $out: ${budget}s left"; return; fi
  echo "== $out (limit ${budget}s) at ${SECONDS}s: bench/long_context.py $COMMON $*"
  timeout "$budget" python3 bench/long_context.py $COMMON "$@" --out "$OUT/$out"
  echo "== $out rc=$? at ${SECONDS}s"
}
run_sweep $(( $(left) - 240 )) sparse.json --mode sparse --lengths 1K,8K,64K,256K
watch_tiers & WATCH=$!
run_sweep $(( $(left) - 50 )) sparse_1m.json --mode sparse --lengths 1M
kill "$WATCH"
run_sweep $(( $(left) )) exact.json --mode exact --lengths 1K,8K,64K
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
ls -la "$OUT"
