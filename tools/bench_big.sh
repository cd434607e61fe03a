#!/bin/bash
# Side-by-side decode on a big file (docs/BENCHMARKS.md, "A model that needs the pipeline"): llama-server
# (-t 2, -np LANES, LANES x CTX positions) and skippy-zmq serve (--stages STAGES --lanes LANES --ctx-size CTX)
# on the same MODEL, one at a time on one port, 1 client then LANES clients, ROUNDS times alternating.
#   MODEL=/work/models/gemma3-12b-random.gguf bash tools/bench_big.sh
# llama-server is the build BENCHMARKS.md describes, in $LLAMA_SERVER_DIR (default below).
MODEL=${MODEL:?set MODEL to a GGUF file}
STAGES=${STAGES:-4}; LANES=${LANES:-4}; CTX=${CTX:-2048}; TOKENS=${TOKENS:-32}; ROUNDS=${ROUNDS:-2}
EXTRA=${EXTRA:-}  # more serve options, e.g. "--micro-batches 2"
CLIENTS=${CLIENTS:-"1 $LANES"}
LS=${LLAMA_SERVER_DIR:-/tmp/lsrv/llama_cpp_python-0.3.36/build/bin}
PORT=8099
wait_health() { for i in $(seq 1 3000); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$PORT/health)" = 200 ] && return 0; sleep 0.2; done; return 1; }
run_bench() { python3 "$(dirname "$0")/bench_serve.py" --url http://127.0.0.1:$PORT --clients $1 --tokens $TOKENS --requests 1 --timeout 1200 --label "$2"; }
for round in $(seq 1 $ROUNDS); do
  LD_LIBRARY_PATH=$LS $LS/llama-server -m $MODEL -t 2 -np $LANES -c $((LANES * CTX)) --port $PORT > /tmp/bench_big_llama.log 2>&1 &
  pid=$!; wait_health || { echo "llama-server did not get healthy" >&2; kill $pid; exit 1; }
  for c in $CLIENTS; do run_bench $c "llama-server round $round"; done
  kill $pid; wait $pid 2>/dev/null
  skippy-zmq serve --model $MODEL --stages $STAGES --lanes $LANES --ctx-size $CTX $EXTRA --port $PORT > /tmp/bench_big_serve.log 2>&1 &
  pid=$!; wait_health || { echo "serve did not get healthy" >&2; kill $pid; exit 1; }
  for c in $CLIENTS; do run_bench $c "serve $STAGES stages round $round"; done
  kill -TERM $pid; wait $pid 2>/dev/null
done
