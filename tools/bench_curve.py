"""Benchmark: what CurveZMQ costs a single session's decode, measured side by side.

Two local pipelines of the same model and split run at once: one plain, one with
`[security] curve = true` (keys made by `skippy_zmq.security.keygen`). Rounds alternate
between them (plain, curve, plain, curve, ...), each one greedy generation of `--tokens`
tokens for one session, so machine noise hits both alike. Prints decode tok/s per round, the
medians and the ratio curve/plain (docs/BENCHMARKS.md).

    python3 tools/bench_curve.py [--model gemma3-270m-q4_k_m] [--stages 3] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import write_local_topology
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from skippy_zmq.security.keys import keygen
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer

PROMPT = "The history of the printing press begins"
SECURITY = '\n[security]\ncurve = true\nkeys_dir = "keys"\n'


def _topology(model: str, n_layer: int, stages: int, directory: Path, curve: bool) -> Path:
    directory.mkdir()
    path = write_local_topology(model, n_layer, stages, codec="raw-f32-v1", policy="fixed", directory=directory)
    if curve:
        path.write_text(path.read_text() + SECURITY)
        keygen(TopologyConfig.from_toml(path))
    return path


def _decode_rate(client: PipelineTransport, tokens: int) -> float:
    request = GenerationRequest(prompt=PROMPT, max_tokens=tokens, sampling=SamplingParams(ignore_eos=True))
    [result] = client.generate([request])
    if result.error is not None:
        raise SystemExit(f"generation failed: {result.error}")
    rate = result.stats()["decode_tokens_per_s"]
    assert isinstance(rate, float)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3_270M_ALIAS)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    path = resolve_model(args.model)
    hparams = ModelHParams.from_gguf(path)
    tokenizer = Tokenizer.from_gguf(path)
    rates: dict[str, list[float]] = {"plain": [], "curve": []}
    with tempfile.TemporaryDirectory(prefix="skippy-bench-curve-") as scratch:
        paths = {name: _topology(str(path), hparams.n_layer, args.stages, Path(scratch) / name, name == "curve")
                 for name in rates}
        with LocalPipeline(paths["plain"]) as plain, LocalPipeline(paths["curve"]) as curve:
            clients = {name: PipelineTransport(pipe.topology, tokenizer)
                       for name, pipe in (("plain", plain), ("curve", curve))}
            try:
                for client in clients.values():
                    client.wait_ready(60.0)
                    _decode_rate(client, 8)  # warm-up: first-touch pages, BLAS threads
                for _ in range(args.rounds):
                    for name, client in clients.items():
                        rates[name].append(_decode_rate(client, args.tokens))
            finally:
                for client in clients.values():
                    client.close()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    report: dict[str, Any] = {
        "model": args.model, "stages": args.stages, "tokens": args.tokens, "rounds": args.rounds,
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.python_version()}".strip(),
        "decode_tok_s": rates, "median_tok_s": medians,
        "curve_over_plain": round(medians["curve"] / medians["plain"], 4),
    }
    if args.as_json:
        print(json.dumps(report))
        return
    for name, values in rates.items():
        print(f"{name:5}: " + " ".join(f"{v:6.1f}" for v in values) + f"   median {medians[name]:.1f} tok/s")
    print(f"curve / plain: {report['curve_over_plain']:.3f} (single session, {args.stages} stages, "
          f"{args.tokens} tokens, {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
