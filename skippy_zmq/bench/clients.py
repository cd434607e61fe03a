"""The serving workload: concurrent streaming clients of an OpenAI-compatible `/v1/completions`, and the
figures of one run (aggregate tok/s, time to first token, inter-token latency, requests failed).

Every client sends its prompts (greedy, `ignore_eos`, the same number of tokens each) one request after
another. A request's tokens are the `usage.completion_tokens` of its stream's last chunk (asked for with
`stream_options.include_usage`), else its chunks with text: a byte-level BPE server holds a token whose
piece ends inside a UTF-8 character and sends it with the next, so chunks undercount tokens. Latencies
are taken between chunks with text. The figures:

- aggregate tok/s: every completion token over the run's wall time, from the first request sent to
  the last token received;
- decode tok/s: the same tokens less each request's first one, over the same wall time less the
  median time to first token;
- time to first token (TTFT) and inter-token latency (ITL), p50 and p99 (`report.percentile`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import attrs

from skippy_zmq.bench.report import percentile
from skippy_zmq.errors import BenchError

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
"""The default prompts; client c's request r sends PROMPTS[(c + r) % 8], so concurrent clients differ."""
GROUNDED_PROMPTS = (
    "Months: January, February, March, April, May, June, July, August, September, October, November, December.\n"
    "The months again, in order: January, February,",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\n# The same function with total renamed to result:\ndef mean(values):\n",
    "Passage: The lighthouse stood on the northern cliff for two hundred years, guiding the fishing boats home "
    "through fog and storm. Its keeper, an old man named Tomas, climbed the ninety steps every evening to light "
    "the lamp.\n\nThe passage, quoted word for word: \"The lighthouse stood",
    "<tr><td>1</td><td>apple</td><td>red</td></tr>\n<tr><td>2</td><td>pear</td><td>green</td></tr>\n"
    "<tr><td>3</td><td>plum</td><td>purple</td></tr>\n<tr><td>4</td><td>lemon</td><td>yellow</td></tr>\n<tr><td>",
    '{"id": 1, "name": "Ada", "role": "engineer", "active": true}\n{"id": 2, "name": "Grace", "role": '
    '"admiral", "active": true}\n{"id": 3, "name": "Alan", "role": "mathematician", "active": false}\n{"id": 4, '
    '"name": "',
    "Steps: 1. Preheat the oven to 180 degrees. 2. Mix the flour, sugar and butter. 3. Add two eggs and stir. "
    "4. Pour into a tin and bake for forty minutes.\nSummary of the steps: 1. Preheat the oven",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n"
    "        return f\"Point({self.x}, {self.y})\"\n\n\nclass Vector:\n    def __init__(self, x, y):\n",
    "Q: What is the capital of France? A: Paris.\nQ: What is the capital of Spain? A: Madrid.\nQ: What is the "
    "capital of Italy? A: Rome.\nQ: What is the capital of France? A:",
)
"""Input-grounded prompts (`bench serve --texts grounded`): a list continued, code repeated with a change, a
passage quoted, table rows and records continued; what speculative decoding's drafts are for."""
TEXTS = {"stories": PROMPTS, "grounded": GROUNDED_PROMPTS}
"""The prompt sets `bench serve --texts` names."""
WARMUP_TOKENS = 4
"""Tokens of the one request each run sends first, unmeasured (connections, graphs of a new layout)."""


@attrs.frozen
class Workload:
    """What one run sends: `clients` concurrent clients, each `requests` requests of `tokens` tokens."""

    clients: int
    tokens: int
    requests: int = 1
    prompts: tuple[str, ...] = PROMPTS
    timeout_s: float = 600.0  # one request, from sending to its last token

    def prompt(self, client: int, request: int) -> str:
        """The prompt of a client's request."""
        return self.prompts[(client + request) % len(self.prompts)]

    def body(self, prompt: str, tokens: int) -> dict[str, Any]:
        """The request body: greedy, streaming, exactly `tokens` tokens."""
        return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}


@attrs.define
class RequestTiming:
    """When one streamed request was sent and got each token; `error` when it failed."""

    sent: float
    token_times: list[float] = attrs.Factory(list)  # when each chunk with text came
    error: str | None = None
    usage_tokens: int | None = None  # the server's own count, from its stream's usage chunk

    @property
    def tokens(self) -> int:
        """The request's completion tokens: the server's count where it gave one, else its text chunks."""
        return len(self.token_times) if self.usage_tokens is None else self.usage_tokens


_DONE = object()
"""What `_chunk` returns at `data: [DONE]`."""


def _chunk(line: bytes) -> Any:
    """The JSON one line of a completion stream carries; None for a line without data, _DONE at `[DONE]`."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


def _texts(chunk: Any) -> int:
    """The choices with text in one chunk."""
    choices = chunk.get("choices", []) if isinstance(chunk, dict) else []
    return sum(1 for choice in choices if isinstance(choice, dict) and choice.get("text"))


def _usage(chunk: Any) -> int | None:
    """The chunk's `usage.completion_tokens`, or None."""
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    count = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _error(chunk: Any) -> str | None:
    """The message of an error event (`{"error": {...}}`, what a server streams when a request fails
    after its 200), or None."""
    error = chunk.get("error") if isinstance(chunk, dict) else None
    if error is None:
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message if message is not None else error)[:300]


def text_chunks(line: bytes) -> int | None:
    """Tokens one line of a completion stream carries (the choices with text); None at `data: [DONE]`."""
    chunk = _chunk(line)
    return None if chunk is _DONE else 0 if chunk is None else _texts(chunk)


def usage_tokens(line: bytes) -> int | None:
    """The `usage.completion_tokens` one line of a completion stream carries, or None."""
    chunk = _chunk(line)
    return None if chunk is None or chunk is _DONE else _usage(chunk)


@attrs.frozen
class RunSummary:
    """The figures of one run (the module docstring defines them); latencies in milliseconds."""

    requests: int
    failed: int
    completion_tokens: int
    expected_tokens: int
    wall_s: float
    aggregate_tok_s: float
    decode_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    first_error: str | None = None

    @classmethod
    def of(cls, timings: Sequence[RequestTiming], started: float, ended: float, tokens: int) -> RunSummary:
        """The summary of requests of `tokens` tokens each, run from `started` (the last answer came by `ended`)."""
        streamed = [t for t in timings if t.token_times]
        finished = max((t.token_times[-1] for t in streamed), default=ended)
        wall = max(finished - started, 1e-9)
        total = sum(t.tokens for t in timings)
        ttfts = [t.token_times[0] - t.sent for t in streamed]
        itls = [b - a for t in streamed for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
        ttft_median = statistics.median(ttfts) if ttfts else 0.0
        errors = [t.error for t in timings if t.error is not None]
        return cls(
            requests=len(timings), failed=len(errors), completion_tokens=total, expected_tokens=len(timings) * tokens,
            wall_s=wall, aggregate_tok_s=total / wall,
            decode_tok_s=(total - len(streamed)) / max(wall - ttft_median, 1e-9),
            ttft_p50_ms=percentile(ttfts, 0.50) * 1e3, ttft_p99_ms=percentile(ttfts, 0.99) * 1e3,
            itl_p50_ms=percentile(itls, 0.50) * 1e3, itl_p99_ms=percentile(itls, 0.99) * 1e3,
            first_error=errors[0] if errors else None,
        )

    @property
    def short(self) -> bool:
        """Fewer tokens came than were asked for (failed requests, or a server that stopped early)."""
        return self.completion_tokens < self.expected_tokens

    def problem(self) -> str | None:
        """Why this run's figures do not count (failed requests, or fewer tokens than asked for), or None."""
        if not (self.failed or self.short):
            return None
        return (f"{self.failed} of {self.requests} requests failed, {self.completion_tokens} of "
                f"{self.expected_tokens} tokens" + (f" (first error: {self.first_error})" if self.first_error else ""))

    def as_json(self) -> dict[str, Any]:
        """The figures as a JSON row holds them, rounded to what the clocks resolve."""
        return {
            "requests": self.requests, "failed": self.failed, "completion_tokens": self.completion_tokens,
            "expected_tokens": self.expected_tokens, "wall_s": round(self.wall_s, 3),
            "aggregate_tok_s": round(self.aggregate_tok_s, 2), "decode_tok_s": round(self.decode_tok_s, 2),
            "ttft_p50_ms": round(self.ttft_p50_ms, 1), "ttft_p99_ms": round(self.ttft_p99_ms, 1),
            "itl_p50_ms": round(self.itl_p50_ms, 1), "itl_p99_ms": round(self.itl_p99_ms, 1),
            "first_error": self.first_error,
        }


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> RequestTiming:
    """One streamed completion; a failure is recorded in the timing, not raised."""
    timing = RequestTiming(sent=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return timing
            async for line in response.content:
                chunk = _chunk(line)  # each line parsed once
                if chunk is _DONE:
                    break
                if chunk is None:
                    continue
                failure = _error(chunk)
                if failure is not None:
                    timing.error = f"error event: {failure}"
                    break
                now = time.perf_counter()
                timing.token_times += [now] * _texts(chunk)
                used = _usage(chunk)
                if used is not None:
                    timing.usage_tokens = used
    except TimeoutError:
        timing.error = f"no complete answer within --timeout {timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a line that is not UTF-8 JSON
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def _client(session: aiohttp.ClientSession, url: str, workload: Workload, client: int) -> list[RequestTiming]:
    return [await _stream(session, url, workload.body(workload.prompt(client, r), workload.tokens), workload.timeout_s)
            for r in range(workload.requests)]


async def run_workload(url: str, workload: Workload, *, on_start: Callable[[], None] | None = None) -> RunSummary:
    """Warm up with one short request (a failure raises BenchError), then run every client at once;
    `on_start` is called between the two (a benchmark reads its counters there, the warm-up left out)."""
    # One connection per request: llama-server closes a connection after a stream, and a reused
    # one then fails the next request; a fresh one costs both servers the same.
    connector = aiohttp.TCPConnector(limit=workload.clients + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        warmup = await _stream(session, url, workload.body(workload.prompts[0], WARMUP_TOKENS), workload.timeout_s)
        if warmup.error is not None:
            raise BenchError(f"the warm-up request to {url}/v1/completions failed: {warmup.error}")
        if on_start is not None:
            on_start()
        started = time.perf_counter()
        per_client = await asyncio.gather(*(_client(session, url, workload, c) for c in range(workload.clients)))
        ended = time.perf_counter()
    return RunSummary.of([t for timings in per_client for t in timings], started, ended, workload.tokens)


def run(url: str, workload: Workload, *, on_start: Callable[[], None] | None = None) -> RunSummary:
    """`run_workload` on a loop of its own."""
    return asyncio.run(run_workload(url, workload, on_start=on_start))
