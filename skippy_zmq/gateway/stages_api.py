"""Socket-free: the JSON of `GET /stages` (docs/PROTOCOL.md §9.1), what the web page's pipeline view and any
dashboard poll: each stage (layers, place, health, heartbeat age, memory, lanes, restarts, where a token's time
goes on it) and the gateway's own figures (queue, sessions, prompt-cache hits, tokens per second).

Everything here is read from values the gateway already holds: the engine's latest `Health` snapshot (the
driver's `StageStatus` and `StageFigures` of every stage) and the metrics' live figures. Nothing waits on a
stage or on the engine's queue, so the route answers in the same time whatever the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from skippy_zmq.gateway.openai_api import JsonObject

if TYPE_CHECKING:
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.driver.stage_figures import StageFigures, TokenSplit
    from skippy_zmq.driver.watch import StageStatus

_SPLIT_PARTS = ("queue", "decode", "compute", "encode", "link")


@attrs.frozen
class StageSpan:
    """What a stage serves, from the topology: its half-open layer range and its lanes."""

    index: int
    layer_start: int
    layer_end: int
    lane_count: int

    @classmethod
    def of_topology(cls, topology: TopologyConfig) -> tuple[StageSpan, ...]:
        """Every stage of `topology`, in order."""
        return tuple(cls(stage.index, stage.layer_start, stage.layer_end, stage.lane_count)
                     for stage in topology.stages)


@attrs.frozen
class GatewayFigures:
    """The gateway's own figures at one moment."""

    queue_depth: int = 0  # requests waiting for a lane
    active_sessions: int = 0  # requests holding lanes
    tokens_per_second: float = 0.0  # generated, both APIs, over the last whole seconds (metrics.LiveFigures)
    tokens_total: int = 0
    prompt_cache_hits: int = 0  # requests whose prompt took over a kept session
    prompt_tokens_cached: int = 0  # the positions those requests kept

    def as_json(self) -> JsonObject:
        """Its object in the answer."""
        body = attrs.asdict(self)
        body["tokens_per_second"] = round(self.tokens_per_second, 2)
        return body


def slowest_stage(figures: Sequence[StageFigures]) -> int | None:
    """The stage on which a token spends the most time (its split's total, link included; ties to the lower
    index), or None unless at least two stages have a split: one stage alone is not slower than anything."""
    timed = [(figure.split.total_us, -figure.index) for figure in figures if figure.split is not None]
    return -max(timed)[1] if len(timed) >= 2 else None


def _split_json(split: TokenSplit | None) -> JsonObject | None:
    if split is None:
        return None
    means = (split.queue_us, split.decode_us, split.compute_us, split.encode_us, split.link_us)
    body: JsonObject = {"tokens": split.tokens}
    body.update({f"{part}_us": round(value, 1) for part, value in zip(_SPLIT_PARTS, means, strict=True)})
    body["total_us"] = round(split.total_us, 1)
    return body


def _stage_json(status: StageStatus, figures: StageFigures | None, span: StageSpan | None, now: float,
                slowest: int | None) -> JsonObject:
    """One stage's entry: `status` as /health reports it, with its span and figures (None: not known)."""
    place = status.place
    load = None if figures is None else figures.load
    beat_at = None if figures is None else figures.beat_at
    body: dict[str, Any] = {
        "index": place.index, "id": place.stage_id, "host": place.host, "endpoint": place.endpoint,
        "layer_start": None if span is None else span.layer_start,
        "layer_end": None if span is None else span.layer_end,
        "lane_count": None if span is None else span.lane_count,
        "state": status.state, "detail": status.detail,
        "heartbeat_age_s": None if beat_at is None else round(max(now - beat_at, 0.0), 2),
        "rss_bytes": load.rss_bytes if load is not None and load.rss_bytes else None,
        "lanes_in_use": None if load is None else load.sessions,
        "restarts": status.restarts, "downs": status.downs,
        "down_seconds": round(status.down_seconds_at(now), 1),
        "token_split": _split_json(None if figures is None else figures.split),
        "slowest": place.index == slowest,
    }
    return body


def stages_body(*, status: str, message: str, model: str, stages: Sequence[StageStatus],
                figures: Sequence[StageFigures], spans: Sequence[StageSpan], gateway: GatewayFigures,
                now: float, window_s: int) -> JsonObject:
    """The answer of GET /stages: `status` and `message` as /health words them, every stage of `stages` (the
    driver's view, [] before the engine runs) with its `figures` and `spans` matched by index, the stage a
    token spends most time on, and the `gateway`'s figures; `now` on the clock of the figures' `beat_at`;
    `window_s`: the seconds the token splits and the rate average over."""
    by_index = {figure.index: figure for figure in figures}
    span_of = {span.index: span for span in spans}
    slowest = slowest_stage(figures)
    return {
        "object": "stages", "status": status, "message": message, "model": model, "window_s": window_s,
        "gateway": gateway.as_json(), "slowest_stage": slowest,
        "stages": [_stage_json(stage, by_index.get(stage.place.index), span_of.get(stage.place.index), now,
                               slowest) for stage in stages],
    }
