"""Serving benchmark: N concurrent streaming clients against any OpenAI-compatible server.

Every client sends fixed prompts (greedy, `ignore_eos`, M tokens each) to `/v1/completions`
with `stream: true`, one request after another, for `--requests` requests. Reported:

- aggregate tok/s: all completion tokens over the run's wall time, from the first request sent
  to the last token received;
- decode-only tok/s: the same tokens less each request's first one, over the same wall time
  less the median time to first token;
- time to first token (TTFT) and inter-token latency (ITL) p50 / p99.

Run it against `skippy-zmq serve` and llama.cpp's `llama-server` side by side (docs/BENCHMARKS.md):

    python3 tools/bench_serve.py --url http://127.0.0.1:8000 --clients 16 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import aiohttp
import attrs

PROMPTS = (
    "The history of the printing press begins",
    "In a small village by the sea, there lived",
    "The most important rule of writing software is",
    "Photosynthesis is the process by which",
    "Once upon a time, in a kingdom far away,",
    "The recipe for a good loaf of bread starts with",
    "A short guide to the night sky: first,",
    "The train left the station at dawn, and",
)


@attrs.define
class RequestTiming:
    """When one streamed request sent, got its first token, and got each later token."""

    sent: float
    token_times: list[float] = attrs.Factory(list)

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token."""
        return self.token_times[0] - self.sent


async def _one_request(session: aiohttp.ClientSession, url: str, model: str | None, prompt: str,
                       tokens: int, timeout_s: float) -> RequestTiming:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
    }
    if model:
        body["model"] = model
    timing = RequestTiming(sent=time.perf_counter())
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(f"{url}/v1/completions", json=body, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    timing.token_times.append(time.perf_counter())
    return timing


async def _client(session: aiohttp.ClientSession, args: argparse.Namespace, index: int) -> list[RequestTiming]:
    timings = []
    for round_index in range(args.requests):
        prompt = PROMPTS[(index + round_index) % len(PROMPTS)]
        timings.append(await _one_request(session, args.url, args.model, prompt, args.tokens, args.timeout))
    return timings


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(timings: list[RequestTiming], started: float, tokens_per_request: int) -> dict[str, float]:
    """The figures the module docstring defines; a streamed chunk counts as one token."""
    finished = max(t.token_times[-1] for t in timings if t.token_times)
    wall = finished - started
    total = sum(len(t.token_times) for t in timings)
    ttfts = [t.ttft for t in timings if t.token_times]
    itls = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    ttft_p50 = statistics.median(ttfts)
    return {
        "requests": len(timings),
        "completion_tokens": total,
        "expected_tokens": len(timings) * tokens_per_request,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "decode_tok_s": round((total - len(ttfts)) / max(wall - ttft_p50, 1e-9), 2),
        "ttft_p50_ms": round(ttft_p50 * 1000, 1),
        "ttft_p99_ms": round(_percentile(ttfts, 0.99) * 1000, 1),
        "itl_p50_ms": round(_percentile(itls, 0.50) * 1000, 1),
        "itl_p99_ms": round(_percentile(itls, 0.99) * 1000, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, float]:
    """Warm up with one request, then run the clients; returns the summary."""
    # One connection per request: llama-server closes a connection after a stream, and a reused
    # one then fails the next request; a fresh one costs both servers the same.
    connector = aiohttp.TCPConnector(limit=args.clients + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _one_request(session, args.url, args.model, PROMPTS[0], 4, args.timeout)
        started = time.perf_counter()
        per_client = await asyncio.gather(*(_client(session, args, i) for i in range(args.clients)))
    return summarize([t for timings in per_client for t in timings], started, args.tokens)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument("--model", default=None, help="model name to send (default: omit the field)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--label", default="", help="a name for this run in the JSON output")
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    print(json.dumps({"label": args.label, "clients": args.clients, "tokens": args.tokens, **summary}))
    return 0 if summary["completion_tokens"] == summary["expected_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
