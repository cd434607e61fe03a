#!/bin/bash
# One round of the side-by-side serving benchmark (docs/BENCHMARKS.md, "With the ggml kernel"): llama-server
# and skippy-zmq serve on the same file, one at a time on one port, alternating per pair of client counts.
# llama-server is the build BENCHMARKS.md describes, in $LLAMA_SERVER_DIR (default below).
MODEL=$(python3 -c "from skippy_zmq.model.catalog import ensure_gemma3_270m; print(ensure_gemma3_270m())")
LS=${LLAMA_SERVER_DIR:-/tmp/lsrv/llama_cpp_python-0.3.36/build/bin}
PORT=8099
wait_health() { for i in $(seq 1 600); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$PORT/health)" = 200 ] && return 0; sleep 0.2; done; return 1; }
run_bench() { python3 "$(dirname "$0")/bench_serve.py" --url http://127.0.0.1:$PORT --clients $1 --tokens 64 --requests 2 --label "$2"; }
for np in 8 16; do
  LD_LIBRARY_PATH=$LS $LS/llama-server -m $MODEL -t 2 -np $np -c 8192 --port $PORT > /tmp/lsrv/server.log 2>&1 &
  pid=$!; wait_health
  if [ $np = 8 ]; then run_bench 1 "llama-server np8"; run_bench 8 "llama-server np8"; else run_bench 16 "llama-server np16"; run_bench 32 "llama-server np16"; fi
  kill $pid; wait $pid 2>/dev/null
  SKIPPY_ZMQ_KERNEL=${KERNEL:-ggml} skippy-zmq serve --stages 1 --lanes 16 --port $PORT > /tmp/lsrv/serve.log 2>&1 &
  pid=$!; wait_health
  if [ $np = 8 ]; then run_bench 1 "serve ${KERNEL:-ggml}"; run_bench 8 "serve ${KERNEL:-ggml}"; else run_bench 16 "serve ${KERNEL:-ggml}"; run_bench 32 "serve ${KERNEL:-ggml}"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
done
