"""The gateway's Prometheus metrics, served at GET /metrics: the requests it answered, and each
stage as its driver sees it (down, restarts, replays, handshakes; docs/ARCHITECTURE.md, "Observability").
Beside them, llama-server's `llamacpp:*` names for its users' dashboards (`LlamaCounters`), and the live
figures GET /stages shows (`LiveFigures`: tokens per second over the last seconds, prompt-cache hits).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from skippy_zmq.driver.stage_figures import WINDOW_S

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from skippy_zmq.driver.generation import GenerationResult
    from skippy_zmq.driver.watch import StageStatus

RATE_WINDOW_S = WINDOW_S
"""The whole seconds GET /stages' tokens per second averages over: the stages' token splits' window."""
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STAGE_LABELS = ("stage", "index", "host")
_StageValue: TypeAlias = Callable[["StageStatus", float], float]
_STAGE_COUNTERS: tuple[tuple[str, str, _StageValue], ...] = (
    ("skippy_gateway_stage_down", "Times the driver found the stage down (no heartbeat for 3 s, or no message taken)",
     lambda status, now: status.downs),
    ("skippy_gateway_stage_down_seconds", "Seconds the stage was down, the episode under way included",
     lambda status, now: status.down_seconds_at(now)),
    ("skippy_gateway_stage_restarts", "New incarnations of the stage seen (a new process: its sessions were lost)",
     lambda status, now: status.restarts),
    ("skippy_gateway_stage_sessions_replayed", "Sessions replayed because the stage failed (docs/PROTOCOL.md §6)",
     lambda status, now: status.sessions_replayed),
    ("skippy_gateway_stage_sessions_given_up", "Sessions failed because the stage did not come back within "
     "--recovery-timeout", lambda status, now: status.sessions_given_up),
    ("skippy_gateway_stage_link_down", "Times the driver's connection to the stage dropped (stage 0: the one it "
     "sends to)", lambda status, now: status.link_downs),
)
"""The per-stage counters: name, help, value of a `StageStatus` at a time."""


class _StageCollector:
    """The driver's view of each stage (driver/watch.py `StageStatus`), as of the latest scrape."""

    def __init__(self) -> None:
        self.stages: Sequence[StageStatus] = ()
        self.now = 0.0

    def collect(self) -> Iterator[Metric]:
        """The stage gauge and counters, one sample per stage."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("skippy_gateway_stage_up", "1 while the stage heartbeats, 0 while it is down or was "
                               "never heard", labels=_STAGE_LABELS)
        counters = [(CounterMetricFamily(name, text, labels=_STAGE_LABELS), value)
                    for name, text, value in _STAGE_COUNTERS]
        handshakes = CounterMetricFamily(
            "skippy_gateway_stage_handshakes_failed", "The driver's CURVE handshakes with the stage that failed, by "
            "cause (key: its key is not the topology's; auth: it refused the driver's; mechanism: CURVE at one end "
            "only; protocol)",
            labels=(*_STAGE_LABELS, "cause"))
        for status in self.stages:
            labels = [status.place.stage_id, str(status.place.index), status.place.host]
            up.add_metric(labels, 1.0 if status.up else 0.0)
            for family, value in counters:
                family.add_metric(labels, float(value(status, self.now)))
            for cause, count in status.handshakes_failed:
                handshakes.add_metric([*labels, cause], float(count))
        yield up
        yield from (family for family, _ in counters)
        yield handshakes


_LLAMA_METRICS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens_total", "counter", "Prompt tokens computed (those a kept session held are counted apart)."),
    ("prompt_tokens_cached_total", "counter", "Prompt tokens a kept session held: not computed again."),
    ("prompt_seconds_total", "counter", "Prompt processing time: from taking a lane to the first token."),
    ("tokens_predicted_total", "counter", "Generated tokens."),
    ("tokens_predicted_seconds_total", "counter", "Generation time: from the first token to the last."),
    ("n_decode_total", "counter", "Pipeline steps of the requests: one per prompt and one per generated token after "
     "the first that no accepted draft brought (llama-server: llama_decode calls, several sessions in one)."),
    ("n_tokens_max", "counter", "Largest number of positions one request held (prompt and generated tokens)."),
    ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens the verifications carried (n-gram drafts)."),
    ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    ("spec_decode_num_drafts_total", "counter", "Drafts: the steps that carried draft tokens."),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput since the last scrape, tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput since the last scrape, tokens/s."),
    ("requests_processing", "gauge", "Requests holding lanes."),
    ("requests_deferred", "gauge", "Requests waiting for a lane."),
    ("n_busy_slots_per_decode", "gauge", "Requests holding lanes now (llama-server: the average per llama_decode)."),
)
"""llama-server's /metrics names (without the `llamacpp:` prefix), their type and help."""


class LlamaCounters:
    """llama-server's `llamacpp:*` metrics from the ended requests' results, rendered in its text format
    (names ending in `_total` as given, which prometheus_client's counters would rename)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = dict.fromkeys((name for name, _, _ in _LLAMA_METRICS), 0.0)
        # what the throughput gauges average: the requests ended since the last scrape, as llama-server's buckets
        self._bucket = {"prompt_tokens": 0.0, "prompt_s": 0.0, "predicted_tokens": 0.0, "predicted_s": 0.0}

    def ended(self, result: GenerationResult) -> None:
        """Count one ended request (a completion choice or an embedding input)."""
        values = self.values
        prompt_n, predicted_n = len(result.prompt_ids) - result.cached_tokens, len(result.tokens)
        first = result.first_token_s if predicted_n else result.finished_s
        prompt_s = max(first - result.started_s, 0.0) if result.started_s else 0.0  # never took a lane: no times
        predicted_s = max(result.finished_s - first, 0.0) if result.started_s and predicted_n else 0.0
        values["prompt_seconds_total"] += prompt_s
        values["tokens_predicted_seconds_total"] += predicted_s
        bucket = self._bucket
        bucket["prompt_tokens"] += prompt_n
        bucket["prompt_s"] += prompt_s
        bucket["predicted_tokens"] += predicted_n
        bucket["predicted_s"] += predicted_s
        values["prompt_tokens_total"] += prompt_n
        values["prompt_tokens_cached_total"] += result.cached_tokens
        values["tokens_predicted_total"] += predicted_n
        values["n_decode_total"] += (1 if prompt_n else 0) + max(predicted_n - 1 - result.drafts_accepted, 0)
        values["spec_decode_num_draft_tokens_total"] += result.drafts
        values["spec_decode_num_accepted_tokens_total"] += result.drafts_accepted
        values["spec_decode_num_drafts_total"] += result.verifications
        values["n_tokens_max"] = max(values["n_tokens_max"], float(len(result.prompt_ids) + predicted_n))

    def render(self, queue_depth: int, running: int) -> str:
        """The exposition text, with the gauges of this moment; the throughput gauges average the requests ended
        since the previous render (0 when none did), which starts a new window, as llama-server's scrapes do."""
        values, bucket = self.values, self._bucket
        values["prompt_tokens_seconds"] = _rate(bucket["prompt_tokens"], bucket["prompt_s"])
        values["predicted_tokens_seconds"] = _rate(bucket["predicted_tokens"], bucket["predicted_s"])
        self._bucket = dict.fromkeys(bucket, 0.0)
        values["requests_processing"] = values["n_busy_slots_per_decode"] = float(running)
        values["requests_deferred"] = float(queue_depth)
        return "".join(f"# HELP llamacpp:{name} {text}\n# TYPE llamacpp:{name} {kind}\n"
                       f"llamacpp:{name} {_number(values[name])}\n" for name, kind, text in _LLAMA_METRICS)


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)  # every digit, as a counter must keep


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


class LiveFigures:
    """What GET /stages shows of the gateway's own work (docs/PROTOCOL.md §9.1): tokens generated per second
    over the last `window_s` whole seconds (both APIs' tokens, as they are handed out), and the requests whose
    prompt took over a kept session (prompt-cache hits) with the positions they kept. Event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: int = RATE_WINDOW_S) -> None:
        self._clock = clock
        self.window_s = window_s
        self._seconds: deque[list[int]] = deque()  # [second, tokens], oldest first
        self.tokens_total = 0
        self.cache_hits = 0
        self.cached_tokens = 0

    def tokens(self, count: int) -> None:
        """`count` tokens handed out now."""
        second = int(self._clock())
        if not self._seconds or self._seconds[-1][0] != second:
            self._seconds.append([second, 0])
            while self._seconds[0][0] < second - self.window_s:
                self._seconds.popleft()
        self._seconds[-1][1] += count
        self.tokens_total += count

    def ended(self, result: GenerationResult) -> None:
        """One ended request (a choice or an embedding input): a prompt-cache hit when it kept positions."""
        if result.cached_tokens:
            self.cache_hits += 1
            self.cached_tokens += result.cached_tokens

    def tokens_per_second(self) -> float:
        """Tokens per second over the last `window_s` whole seconds (the one under way is not whole yet)."""
        second = int(self._clock())
        return sum(count for at, count in self._seconds if second - self.window_s <= at < second) / self.window_s


class GatewayMetrics:
    """Requests by route and status, queue depth, running sessions, latencies, token counts, cap refusals,
    cut-off request-API clients."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the live figures' (`LiveFigures`)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        registry = self.registry
        self._requests = Counter(
            "skippy_gateway_requests", "Requests answered, by route and HTTP status (zmq: the request API)",
            ["route", "status"], registry=registry,
        )
        self._queue_depth = Gauge("skippy_gateway_queue_depth", "Requests waiting for a lane", registry=registry)
        self._running = Gauge("skippy_gateway_running_sessions", "Requests holding lanes", registry=registry)
        self._ttft = Histogram(
            "skippy_gateway_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=_TTFT_BUCKETS, registry=registry,
        )
        self._inter_token = Histogram(
            "skippy_gateway_inter_token_seconds", "Time between consecutive tokens of a request",
            buckets=_INTER_TOKEN_BUCKETS, registry=registry,
        )
        self._request_seconds = Histogram(
            "skippy_gateway_request_seconds", "From a generation request's arrival to its last token",
            buckets=_REQUEST_BUCKETS, registry=registry,
        )
        self._cap_refused = Counter(
            "skippy_gateway_client_cap_refused", "Requests refused because their client had --max-client-requests "
            "in flight, by API (http, zmq)", ["api"], registry=registry,
        )
        self._handshakes_refused = Counter(
            "skippy_gateway_handshakes_refused", "CURVE handshakes refused by the ZAP handler, by domain "
            "(skippy.return: the driver's return socket, skippy.requests: the request API)", ["domain"],
            registry=registry,
        )
        self._cut_off = Counter(
            "skippy_gateway_zmq_clients_cut_off", "Request-API clients cut off for having more queued than their "
            "send budget, or for not reading it (docs/PROTOCOL.md §8.1)", registry=registry,
        )
        self._prompt_tokens = Counter("skippy_gateway_prompt_tokens", "Prompt tokens submitted", registry=registry)
        self._completion_tokens = Counter(
            "skippy_gateway_completion_tokens", "Completion tokens generated", registry=registry
        )
        self._stages = _StageCollector()
        registry.register(self._stages)
        self.llama = LlamaCounters()
        self.live = LiveFigures(clock)
        self.started_unix = int(time.time())  # the Process-Start-Time-Unix header llama-server's /metrics has

    def request(self, route: str, status: int) -> None:
        """Count one answered request."""
        self._requests.labels(route=route, status=str(status)).inc()

    def client_cap_refused(self, api: str) -> None:
        """Count one request refused by the per-client cap of `api` ("http" or "zmq")."""
        self._cap_refused.labels(api=api).inc()

    def handshake_refused(self, domain: str) -> None:
        """Count one CURVE handshake the gateway refused (a peer without an admitted key)."""
        self._handshakes_refused.labels(domain=domain).inc()

    def client_cut_off(self) -> None:
        """Count one request-API client cut off by its send budget."""
        self._cut_off.inc()

    def first_token(self, seconds: float) -> None:
        """Observe a time to first token (one token handed out)."""
        self._ttft.observe(seconds)
        self.live.tokens(1)

    def inter_token(self, seconds: float, tokens: int) -> None:
        """Observe `tokens` tokens that arrived `seconds` after the previous ones (the gap is shared)."""
        for _ in range(tokens):
            self._inter_token.observe(seconds / tokens)
        self.live.tokens(tokens)

    def finished(self, seconds: float, prompt_tokens: int, completion_tokens: int,
                 results: Sequence[GenerationResult] = ()) -> None:
        """Observe one ended generation: its duration and token counts, and its `results` (one per choice or
        embedding input) for the llamacpp:* metrics."""
        self._request_seconds.observe(seconds)
        self._prompt_tokens.inc(prompt_tokens)
        self._completion_tokens.inc(completion_tokens)
        for result in results:
            self.llama.ended(result)
            self.live.ended(result)

    def choices_ended(self, seconds: float, results: Sequence[GenerationResult]) -> None:
        """Observe one ended generation of `results` (one per choice): the prompt once, every choice's tokens."""
        self.finished(seconds, len(results[0].prompt_ids), sum(len(result.tokens) for result in results), results)

    def render(self, queue_depth: int, running: int, stages: Sequence[StageStatus] = (),
               now: float = 0.0) -> tuple[bytes, str]:
        """The exposition text after sampling the engine's gauges and its stages (as of `now`, on
        the engine's clock), and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._queue_depth.set(queue_depth)
        self._running.set(running)
        self._stages.stages, self._stages.now = stages, now
        body: Any = generate_latest(self.registry)
        return bytes(body) + self.llama.render(queue_depth, running).encode(), str(CONTENT_TYPE_LATEST)
