#!/bin/bash
# Micro-batches on pinned stages (docs/BENCHMARKS.md, "Pipelined micro-batches, stages on cores of their
# own"): a 2-stage plan of Gemma 3 270M with 32 lanes, each worker pinned to a core with one thread,
# then serve with --micro-batches K for K = 1, 2, 1, 2, each timed by bench_serve.py (32 clients x 64 tokens).
set -u
TOPOLOGY=${TOPOLOGY:-/tmp/skippy-micro-batches.toml}
PORT=${PORT:-8099}
HERE=$(dirname "$0")
skippy-zmq plan --model gemma3-270m-q4_k_m --stages 2 --base-port 5810 > "$TOPOLOGY"
sed -i 's/^lane_count = .*/lane_count = 32/' "$TOPOLOGY"
taskset -c 0 skippy-zmq worker --topology "$TOPOLOGY" --stage stage-0 --threads 1 > /tmp/skippy-mb-w0.log 2>&1 &
w0=$!
taskset -c 1 skippy-zmq worker --topology "$TOPOLOGY" --stage stage-1 --threads 1 > /tmp/skippy-mb-w1.log 2>&1 &
w1=$!
trap 'kill $w0 $w1 2>/dev/null' EXIT
sleep 4
for K in 1 2 1 2; do
  skippy-zmq serve --topology "$TOPOLOGY" --micro-batches $K --port $PORT > /tmp/skippy-mb-serve.log 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$PORT/health)" = 200 ] && break; sleep 0.2; done
  python3 "$HERE/bench_serve.py" --url http://127.0.0.1:$PORT --clients 32 --tokens 64 --label "K=$K"
  kill -TERM $pid; wait $pid 2>/dev/null
  sleep 2
done
