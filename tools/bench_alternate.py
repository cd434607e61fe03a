"""Side by side with the servers running at once: llama-server and skippy-zmq serve take turns per run.

`bench_pair.sh` and `bench_big.sh` start one server, run every client count, stop it, then
do the same for the other: minutes apart, and this project's hosts drift by a fifth within an
hour (docs/BENCHMARKS.md, "A model that needs the pipeline"). Here every server the comparison
needs is started first and left running; then, for each round and each client count, the
baseline and the candidate each run the same `tools/bench_serve.py` workload one right after the
other, the order swapped every round (A B, B A, ...). An idle server computes nothing, so only
its memory stays occupied while the other one runs. Each pair's ratio is quoted on its own, and
the median over rounds summarizes.

The small model, as `bench_pair.sh` pairs it (llama-server `-np 8` for 1 and 8 clients, `-np 16`
for 16 and 32; `serve --stages 1 --lanes 16`):

    python3 tools/bench_alternate.py --rounds 3

The 12B-shaped file over four stages (issue 17's comparison). Mapped, llama-server holds the file's
pages and its repacked copies of the Q4_K matrices (14.4 GB), which beside serve's 7.7 GB evicts the
stages' pages on a 24 GiB host; with `--load-mode none` it reads the file into one copy of its own
(both together: 15,260 MiB used, `free -m`). docs/BENCHMARKS.md ("A model that needs the pipeline") says what such runs
gave:

    python3 tools/bench_alternate.py --model /work/models/gemma3-12b-random.gguf --clients 1,4 \
        --llama-np 4,4 --llama-ctx 8192 --llama-args="--load-mode none" \
        --serve-args "--stages 4 --lanes 4 --ctx-size 2048" --tokens 32 --requests 1 --rounds 3 --timeout 1200

Prints one JSON line per run, then one per client count with the ratios (candidate over
baseline, aggregate tok/s) of every round and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve
from measure_serve_memory import _get as http_status

DEFAULT_LLAMA_DIR = "/tmp/lsrv/llama_cpp_python-0.3.36/build/bin"


def _wait_healthy(name: str, url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode} before {url}/health answered 200")
        if http_status(f"{url}/health", 2.0) == 200:
            return
        time.sleep(0.2)
    raise SystemExit(f"{name} did not answer 200 on {url}/health within {timeout_s:.0f} s")


@contextlib.contextmanager
def _servers(commands: dict[str, tuple[list[str], str]], log_dir: Path, timeout_s: float) -> Iterator[None]:
    """Start every command (name -> argv, base URL), wait for each to be healthy, stop all at the end."""
    started: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[IO[bytes]] = []
    try:
        for name, (argv, url) in commands.items():
            log = (log_dir / f"bench_alternate_{name}.log").open("wb")
            logs.append(log)
            # One at a time: two model loads at once would slow both starts and skew nothing else.
            started[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            _wait_healthy(name, url, started[name], timeout_s)
            print(json.dumps({"started": name, "argv": argv}), flush=True)
        yield
    finally:
        for process in started.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in started.items():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"{name} ignored SIGTERM for 30 s; killing it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        for log in logs:
            log.close()


def _bench(url: str, clients: int, args: argparse.Namespace, label: str) -> dict[str, float]:
    namespace = argparse.Namespace(url=url, model=None, clients=clients, tokens=args.tokens,
                                   requests=args.requests, timeout=args.timeout)
    summary = asyncio.run(bench_serve.run(namespace))
    print(json.dumps({"label": label, "clients": clients, "tokens": args.tokens, **summary}), flush=True)
    if summary["completion_tokens"] != summary["expected_tokens"]:
        raise SystemExit(f"{label} at {clients} clients returned {summary['completion_tokens']} tokens, "
                         f"expected {summary['expected_tokens']}")
    return summary


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the packaged Gemma 3 270M)")
    parser.add_argument("--clients", default="1,8,16,32", help="client counts, comma-separated")
    parser.add_argument("--llama-np", default="8,8,16,16", help="llama-server -np for each client count")
    parser.add_argument("--llama-ctx", type=int, default=8192, help="llama-server -c (all slots together)")
    parser.add_argument("--llama-dir", default=os.environ.get("LLAMA_SERVER_DIR", DEFAULT_LLAMA_DIR))
    parser.add_argument("--serve-args", default="--stages 1 --lanes 16", help="options for skippy-zmq serve")
    parser.add_argument("--llama-args", default="", help="more llama-server options, e.g. '--load-mode none'")
    parser.add_argument("--kernel", default=os.environ.get("KERNEL", "ggml"), help="SKIPPY_ZMQ_KERNEL for serve")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    parser.add_argument("--base-port", type=int, default=8100)
    args = parser.parse_args(argv)
    clients, nps = _int_list(args.clients), _int_list(args.llama_np)
    if len(clients) != len(nps):
        parser.error(f"--clients has {len(clients)} counts but --llama-np has {len(nps)}; give one -np per count")
    if args.model is None:
        from skippy_zmq.model.catalog import ensure_gemma3_270m

        args.model = str(ensure_gemma3_270m())
    llama_dir = Path(args.llama_dir)
    if not (llama_dir / "llama-server").is_file():
        parser.error(f"no llama-server in {llama_dir} (--llama-dir); docs/BENCHMARKS.md has the build")

    commands: dict[str, tuple[list[str], str]] = {}
    serve_url = f"http://127.0.0.1:{args.base_port}"
    commands["serve"] = (
        ["env", f"SKIPPY_ZMQ_KERNEL={args.kernel}", "skippy-zmq", "serve", "--model", args.model,
         *shlex.split(args.serve_args), "--port", str(args.base_port)],
        serve_url,
    )
    llama_urls: dict[int, str] = {}
    for offset, np_ in enumerate(sorted(set(nps)), start=1):
        port = args.base_port + offset
        llama_urls[np_] = f"http://127.0.0.1:{port}"
        commands[f"llama-np{np_}"] = (
            ["env", f"LD_LIBRARY_PATH={llama_dir}", str(llama_dir / "llama-server"), "-m", args.model, "-t", "2",
             "-np", str(np_), "-c", str(args.llama_ctx), *shlex.split(args.llama_args), "--port", str(port)],
            llama_urls[np_],
        )

    ratios: dict[int, list[float]] = {count: [] for count in clients}
    with _servers(commands, Path("/tmp"), args.start_timeout):
        for round_index in range(args.rounds):
            for count, np_ in zip(clients, nps, strict=True):
                pair = [(f"llama-server np{np_}", llama_urls[np_]), (f"serve {args.kernel}", serve_url)]
                if round_index % 2:
                    pair.reverse()
                results = {label: _bench(url, count, args, f"{label} round {round_index + 1}")
                           for label, url in pair}
                base = results[f"llama-server np{np_}"]["aggregate_tok_s"]
                ratios[count].append(round(results[f"serve {args.kernel}"]["aggregate_tok_s"] / base, 3))
    for count in clients:
        print(json.dumps({"clients": count, "ratios": ratios[count],
                          "median_ratio": round(statistics.median(ratios[count]), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
