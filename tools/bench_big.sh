#!/bin/bash
# Side-by-side decode on a big file (docs/BENCHMARKS.md, "A model that needs the pipeline"): llama-server
# (-t 2, -np LANES, LANES x CTX positions) and skippy-zmq serve (--stages STAGES --lanes LANES --ctx-size CTX)
# on the same MODEL, one server at a time on one port, ROUNDS times.
#   MODEL=/work/models/gemma3-12b-random.gguf bash tools/bench_big.sh
# ORDER=clients (the default): for each client count the two servers run back to back, each started
# for that run, llama-server first in odd rounds and serve first in even ones, so a host that drifts
# within the hour moves both runs of a pair alike. ORDER=servers: each server runs every client count
# in one start (1 client, then LANES), llama-server first: fewer starts, pairs minutes apart.
# llama-server is the build BENCHMARKS.md describes, in $LLAMA_SERVER_DIR (default below).
# SERVE_GGML=llama: serve's stages multiply with that build's ggml libraries too (SKIPPY_ZMQ_GGML_LIB), so
# both servers run one binary of the same kernels; the default is the package's own (llama-cpp-python's).
MODEL=${MODEL:?set MODEL to a GGUF file}
STAGES=${STAGES:-4}; LANES=${LANES:-4}; CTX=${CTX:-2048}; TOKENS=${TOKENS:-32}; ROUNDS=${ROUNDS:-2}
EXTRA=${EXTRA:-}  # more serve options, e.g. "--micro-batches 2"
CLIENTS=${CLIENTS:-"1 $LANES"}
ORDER=${ORDER:-clients}
SERVE_GGML=${SERVE_GGML:-package}
LS=${LLAMA_SERVER_DIR:-/tmp/lsrv/llama_cpp_python-0.3.36/build/bin}
PORT=8099
case $ORDER in clients|servers) ;; *) echo "ORDER=$ORDER; expected clients or servers" >&2; exit 2;; esac
case $SERVE_GGML in package) GGML_ENV=();; llama) GGML_ENV=(SKIPPY_ZMQ_GGML_LIB=$LS);;
  *) echo "SERVE_GGML=$SERVE_GGML; expected package or llama" >&2; exit 2;; esac
wait_health() { for i in $(seq 1 3000); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:$PORT/health)" = 200 ] && return 0; sleep 0.2; done; return 1; }
run_bench() { python3 "$(dirname "$0")/bench_serve.py" --url http://127.0.0.1:$PORT --clients $1 --tokens $TOKENS --requests 1 --timeout 1200 --label "$2"; }
start() {  # llama | serve
  if [ "$1" = llama ]; then
    LD_LIBRARY_PATH=$LS $LS/llama-server -m $MODEL -t 2 -np $LANES -c $((LANES * CTX)) --port $PORT > /tmp/bench_big_llama.log 2>&1 &
  else
    env "${GGML_ENV[@]}" skippy-zmq serve --model $MODEL --stages $STAGES --lanes $LANES --ctx-size $CTX $EXTRA --port $PORT > /tmp/bench_big_serve.log 2>&1 &
  fi
  pid=$!; wait_health || { echo "$1 did not get healthy within 600 s (/tmp/bench_big_$1.log)" >&2; kill $pid; exit 1; }
}
stop() { kill -TERM $pid; wait $pid 2>/dev/null; }
label() { [ "$1" = llama ] && echo "llama-server round $2" || echo "serve $STAGES stages ($SERVE_GGML ggml) round $2"; }
for round in $(seq 1 $ROUNDS); do
  if [ "$ORDER" = servers ]; then
    for server in llama serve; do
      start $server; for c in $CLIENTS; do run_bench $c "$(label $server $round)"; done; stop
    done
  else
    servers="llama serve"; [ $((round % 2)) = 0 ] && servers="serve llama"
    for c in $CLIENTS; do
      for server in $servers; do start $server; run_bench $c "$(label $server $round)"; stop; done
    done
  fi
done
