"""Tests of skippy_zmq.gateway.stages_api, the JSON of GET /stages: its shape for any figures (hypothesis),
worked examples, and the route in-process over a fake engine (the API key, CORS, never touching the queue)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.driver.generation import GenerationResult
from skippy_zmq.driver.stage_figures import StageFigures, TokenSplit
from skippy_zmq.driver.watch import StagePlace, StageStatus
from skippy_zmq.gateway.cors import CorsPolicy
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.stages_api import GatewayFigures, StageSpan, slowest_stage, stages_body
from skippy_zmq.gateway.state import AttachedEngine, GatewayState
from skippy_zmq.wire.replies import StageLoad
from tests.gateway.fakes import TOKENIZER, FakeEngine
from tests.gateway.test_http import KEY, make_backend, run_client

STAGE_KEYS = {"index", "id", "host", "endpoint", "layer_start", "layer_end", "lane_count", "state", "detail",
              "heartbeat_age_s", "rss_bytes", "lanes_in_use", "restarts", "downs", "down_seconds", "token_split",
              "slowest"}
SPLIT_KEYS = {"tokens", "queue_us", "decode_us", "compute_us", "encode_us", "link_us", "total_us"}
GATEWAY_KEYS = {"queue_depth", "active_sessions", "tokens_per_second", "tokens_total", "prompt_cache_hits",
                "prompt_tokens_cached"}


def status(index: int, state: str = "up", restarts: int = 0) -> StageStatus:
    return StageStatus(StagePlace(index, f"stage-{index}", f"tcp://10.0.0.{index + 1}:57{index}0"), state,
                       "" if state == "up" else "down (no heartbeat for 4.0 s): check it", restarts=restarts)


def split(compute_us: float, link_us: float = 0.0, tokens: int = 10) -> TokenSplit:
    return TokenSplit(tokens, 5.0, 1.0, compute_us, 2.0, link_us)


def body(stages: list[StageStatus], figures: list[StageFigures], now: float = 100.0,
         spans: tuple[StageSpan, ...] = ()) -> dict[str, Any]:
    return stages_body(status="ok", message="ready", model="tiny", stages=stages, figures=figures,
                       spans=spans or tuple(StageSpan(s.place.index, 4 * s.place.index, 4 * s.place.index + 4, 8)
                                            for s in stages),
                       gateway=GatewayFigures(1, 2, 12.345, 99, 3, 40), now=now, window_s=10)


def test_a_worked_example() -> None:
    stages = [status(0), status(1, "down", restarts=2)]
    figures = [StageFigures(0, 99.25, StageLoad(300 << 20, 3), split(900.0, link_us=40.0)),
               StageFigures(1, 95.0, StageLoad(0, 0), split(600.0))]
    answer = body(stages, figures)
    assert answer["gateway"] == {"queue_depth": 1, "active_sessions": 2, "tokens_per_second": 12.35,
                                 "tokens_total": 99, "prompt_cache_hits": 3, "prompt_tokens_cached": 40}
    assert (answer["object"], answer["status"], answer["model"], answer["window_s"]) == ("stages", "ok", "tiny", 10)
    first, second = answer["stages"]
    assert first == {"index": 0, "id": "stage-0", "host": "10.0.0.1", "endpoint": "tcp://10.0.0.1:5700",
                     "layer_start": 0, "layer_end": 4, "lane_count": 8, "state": "up", "detail": "",
                     "heartbeat_age_s": 0.75, "rss_bytes": 300 << 20, "lanes_in_use": 3, "restarts": 0, "downs": 0,
                     "down_seconds": 0.0, "token_split": {"tokens": 10, "queue_us": 5.0, "decode_us": 1.0,
                                                          "compute_us": 900.0, "encode_us": 2.0, "link_us": 40.0,
                                                          "total_us": 948.0},
                     "slowest": True}
    assert answer["slowest_stage"] == 0 and not second["slowest"]
    assert (second["state"], second["restarts"], second["heartbeat_age_s"]) == ("down", 2, 5.0)
    assert (second["rss_bytes"], second["lanes_in_use"]) == (None, 0)  # 0 bytes: the stage could not read it


@pytest.mark.parametrize(("figures", "slowest"), [
    ([], None),
    ([StageFigures(0, 1.0, None, split(5.0))], None),  # one stage alone is not slower than anything
    ([StageFigures(0, 1.0, None, split(5.0)), StageFigures(1)], None),
    ([StageFigures(0, 1.0, None, split(5.0)), StageFigures(1, 1.0, None, split(4.0, link_us=2.0))], 1),
    ([StageFigures(0, 1.0, None, split(6.0)), StageFigures(1, 1.0, None, split(6.0))], 0),  # ties: the first
    ([StageFigures(2, 1.0, None, split(1.0)), StageFigures(0, 1.0, None, split(3.0)), StageFigures(1)], 0),
])
def test_the_slowest_stage_is_the_one_a_token_spends_most_time_on(figures: list[StageFigures],
                                                                   slowest: int | None) -> None:
    assert slowest_stage(figures) == slowest


def test_before_a_heartbeat_or_a_token_every_figure_is_null_not_zero() -> None:
    answer = body([status(0, "never_heard")], [StageFigures(0)])
    (stage,) = answer["stages"]
    assert [stage[key] for key in ("heartbeat_age_s", "rss_bytes", "lanes_in_use", "token_split")] == [None] * 4
    starting = stages_body(status="starting", message="starting: loading", model="m", stages=(), figures=(), spans=(),
                           gateway=GatewayFigures(), now=0.0, window_s=10)
    assert (starting["stages"], starting["slowest_stage"], starting["gateway"]["tokens_per_second"]) == ([], None, 0)


figures_strategy = st.builds(
    StageFigures, st.integers(0, 3), st.none() | st.floats(0, 1e6),
    st.none() | st.builds(StageLoad, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
    st.none() | st.builds(TokenSplit, st.integers(1, 10**6), *[st.floats(0, 1e9)] * 5))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(["up", "down", "never_heard"]), min_size=0, max_size=4),
       st.lists(figures_strategy, max_size=4), st.floats(0, 2e6))
def test_any_figures_give_the_same_shape_in_plain_json(states: list[str], figures: list[StageFigures],
                                                       now: float) -> None:
    stages = [status(index, state) for index, state in enumerate(states)]
    answer = json.loads(json.dumps(body(stages, figures, now), allow_nan=False))
    assert set(answer["gateway"]) == GATEWAY_KEYS
    assert [stage["index"] for stage in answer["stages"]] == list(range(len(states)))
    for stage in answer["stages"]:
        assert set(stage) == STAGE_KEYS
        assert stage["heartbeat_age_s"] is None or stage["heartbeat_age_s"] >= 0
        assert stage["token_split"] is None or set(stage["token_split"]) == SPLIT_KEYS
        assert stage["slowest"] == (stage["index"] == answer["slowest_stage"])
    slowest = answer["slowest_stage"]
    assert slowest is None or slowest in {figure.index for figure in figures if figure.split is not None}


def two_stage_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.stages = (status(0), status(1))
    engine.figures = (StageFigures(0, 0.0, StageLoad(1 << 30, 2), split(100.0)), StageFigures(1))
    return engine


def attached(engine: FakeEngine) -> GatewayState:
    backend = GatewayState("/models/tiny-model.gguf")
    backend.attach(AttachedEngine(engine, TOKENIZER, spans=(StageSpan(0, 0, 3, 4), StageSpan(1, 3, 7, 4))))  # type: ignore[arg-type]
    return backend


def test_the_route_answers_from_snapshots_with_the_key_cors_and_nosniff() -> None:
    engine = two_stage_engine()
    metrics = GatewayMetrics(clock=lambda: 50.5)
    metrics.first_token(0.1)
    metrics.inter_token(0.2, 20)  # 21 tokens in second 50: not whole yet, so not in the rate

    async def scenario(client: TestClient[Any, Any]) -> None:
        refused = await client.get("/stages")
        assert refused.status == 401
        response = await client.get("/stages", headers={"Authorization": f"Bearer {KEY}",
                                                         "Origin": "http://dash.example"})
        assert response.status == 200
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["Access-Control-Allow-Origin"] == "http://dash.example"
        answer = await response.json()
        assert [(s["id"], s["layer_start"], s["layer_end"], s["lane_count"], s["lanes_in_use"]) for s in
                answer["stages"]] == [("stage-0", 0, 3, 4, 2), ("stage-1", 3, 7, 4, None)]
        assert answer["gateway"]["queue_depth"] == 3 and answer["gateway"]["active_sessions"] == 1
        assert (answer["gateway"]["tokens_total"], answer["gateway"]["tokens_per_second"]) == (21, 0.0)
        other = await client.get("/stages", headers={"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in other.headers

    run_client(attached(engine), scenario, metrics, api_key=KEY, cors=CorsPolicy.parse("http://dash.example"))
    assert engine.submitted == [] and engine.cancelled == []  # a report: nothing queued, nothing waited for


def test_while_starting_the_route_says_so_with_no_stages() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        answer = await (await client.get("/stages")).json()
        assert (answer["status"], answer["stages"], answer["gateway"]["queue_depth"]) == ("starting", [], 0)

    run_client(make_backend(), scenario)


def test_the_tokens_per_second_are_the_last_whole_seconds_of_both_apis() -> None:
    now = [100.2]
    metrics = GatewayMetrics(clock=lambda: now[0])
    for second in range(100, 112):
        now[0] = second + 0.5
        metrics.first_token(0.1)
        metrics.inter_token(0.01, 9)  # 10 tokens each second
    now[0] = 112.0
    assert metrics.live.tokens_per_second() == 10.0  # seconds 102..111
    now[0] = 118.0
    assert metrics.live.tokens_per_second() == 4.0  # seconds 108..111 of 108..117
    assert metrics.live.tokens_total == 120


def test_a_request_that_kept_positions_is_a_prompt_cache_hit() -> None:
    metrics = GatewayMetrics()
    metrics.finished(0.5, 8, 2, [GenerationResult(prompt="p", prompt_ids=[1] * 8, cached_tokens=6),
                                 GenerationResult(prompt="q", prompt_ids=[1] * 4)])
    assert (metrics.live.cache_hits, metrics.live.cached_tokens) == (1, 6)
