"""The serving workload: stream lines, a run's figures, and runs against a fake server in this process."""

from __future__ import annotations

import math

import pytest

from skippy_zmq.bench.clients import PROMPTS, RequestTiming, RunSummary, Workload, run, text_chunks, usage_tokens
from skippy_zmq.errors import BenchError
from tests.bench.fakes import FakeOpenAI


@pytest.mark.parametrize(("line", "expected"), [
    (b'data: {"choices": [{"text": " the"}]}\n', 1),
    (b'data: {"choices": [{"text": ""}]}\n', 0),  # an empty chunk is no token
    (b'data: {"choices": [{"text": "a"}, {"text": "b"}]}\n', 2),
    (b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n', 0),
    (b"\n", 0),
    (b": keep-alive\n", 0),
    (b"data: [DONE]\n", None),
    (b"data:[DONE]", None),
])
def test_a_stream_line_carries_its_tokens(line: bytes, expected: int | None) -> None:
    assert text_chunks(line) == expected


@pytest.mark.parametrize(("line", "expected"), [
    (b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n', 4),
    (b'data: {"choices": [{"text": "a"}]}\n', None),
    (b'data: {"choices": [], "usage": {"completion_tokens": true}}\n', None),
    (b"data: [DONE]\n", None),
    (b": keep-alive\n", None),
])
def test_a_stream_line_may_carry_the_servers_token_count(line: bytes, expected: int | None) -> None:
    assert usage_tokens(line) == expected


def test_the_servers_count_wins_over_the_chunks() -> None:
    # Two tokens held for one character come in one chunk: the chunks say 2, the server 3.
    timings = [RequestTiming(sent=0.0, token_times=[0.1, 0.3], usage_tokens=3)]
    summary = RunSummary.of(timings, started=0.0, ended=0.4, tokens=3)
    assert summary.completion_tokens == 3 and not summary.short
    assert summary.aggregate_tok_s == pytest.approx(3 / 0.3)


def test_a_line_that_is_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        text_chunks(b"data: {oops\n")


def test_clients_rotate_over_the_prompts() -> None:
    workload = Workload(clients=2, tokens=3, requests=2)
    assert [workload.prompt(c, r) for c in range(2) for r in range(2)] == [PROMPTS[0], PROMPTS[1], PROMPTS[1],
                                                                            PROMPTS[2]]
    assert Workload(clients=1, tokens=1, prompts=("only",)).prompt(5, 7) == "only"
    assert workload.body("p", 3) == {"prompt": "p", "max_tokens": 3, "temperature": 0, "stream": True,
                                     "ignore_eos": True, "stream_options": {"include_usage": True}}


def test_the_figures_of_a_run() -> None:
    timings = [
        RequestTiming(sent=0.0, token_times=[0.1, 0.2, 0.3]),
        RequestTiming(sent=0.0, token_times=[0.3, 0.5, 0.7]),
    ]
    summary = RunSummary.of(timings, started=0.0, ended=0.8, tokens=3)
    assert summary.requests == 2 and summary.failed == 0 and not summary.short
    assert summary.completion_tokens == summary.expected_tokens == 6
    assert summary.wall_s == pytest.approx(0.7)  # to the last token, not to `ended`
    assert summary.aggregate_tok_s == pytest.approx(6 / 0.7)
    assert summary.decode_tok_s == pytest.approx(4 / (0.7 - 0.2))  # median TTFT 0.2
    assert summary.ttft_p50_ms == pytest.approx(100.0)  # nearest rank of (100, 300): the lower
    assert summary.ttft_p99_ms == pytest.approx(300.0)
    assert summary.itl_p50_ms == pytest.approx(100.0)  # rank 2 of 100, 100, 200, 200
    assert summary.itl_p99_ms == pytest.approx(200.0)
    row = summary.as_json()
    assert row["aggregate_tok_s"] == 8.57 and row["first_error"] is None


def test_failed_requests_are_counted_and_the_first_error_kept() -> None:
    timings = [RequestTiming(sent=0.0, token_times=[0.1, 0.2]), RequestTiming(sent=0.0, error="HTTP 500: x"),
               RequestTiming(sent=0.0, token_times=[0.1], error="no complete answer")]
    summary = RunSummary.of(timings, started=0.0, ended=1.0, tokens=2)
    assert (summary.failed, summary.completion_tokens, summary.expected_tokens) == (2, 3, 6)
    assert summary.short and summary.first_error == "HTTP 500: x"


def test_a_run_where_nothing_came_has_no_latencies() -> None:
    summary = RunSummary.of([RequestTiming(sent=0.0, error="refused")], started=0.0, ended=0.5, tokens=4)
    assert summary.aggregate_tok_s == 0.0 and summary.wall_s == 0.5
    assert math.isnan(summary.ttft_p50_ms) and math.isnan(summary.itl_p99_ms)


def test_a_run_against_a_streaming_server() -> None:
    with FakeOpenAI(delay_s=0.001) as server:
        summary = run(server.url, Workload(clients=3, tokens=5, requests=2, timeout_s=10))
    assert (summary.requests, summary.failed, summary.completion_tokens, summary.expected_tokens) == (6, 0, 30, 30)
    assert summary.aggregate_tok_s > 0 and summary.ttft_p50_ms > 0 and summary.itl_p50_ms > 0
    warmup, *measured = server.bodies
    assert warmup["max_tokens"] == 4
    assert all(b["max_tokens"] == 5 and b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in measured)
    assert sorted(b["prompt"] for b in measured) == sorted([PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2],
                                                            PROMPTS[2], PROMPTS[3]])


def test_a_request_answered_500_counts_as_failed() -> None:
    with FakeOpenAI(fail_request=2) as server:
        summary = run(server.url, Workload(clients=1, tokens=2, requests=2, timeout_s=10))
    assert (summary.failed, summary.completion_tokens) == (1, 2)
    assert summary.first_error is not None and summary.first_error.startswith("HTTP 500: ")


def test_a_request_whose_stream_carries_an_error_event_counts_as_failed() -> None:
    with FakeOpenAI(error_event=2) as server:
        summary = run(server.url, Workload(clients=1, tokens=3, requests=2, timeout_s=10))
    assert (summary.failed, summary.completion_tokens) == (1, 4)  # the failed one's token still counts as sent
    assert summary.first_error == "error event: F16 activation value is out of range"


def test_a_request_past_its_timeout_counts_as_failed() -> None:
    with FakeOpenAI(delay_s=0.2) as server:
        summary = run(server.url, Workload(clients=1, tokens=20, requests=1, timeout_s=1.5))
    assert summary.failed == 1 and summary.first_error == "no complete answer within --timeout 1.5 s"


def test_a_failed_warmup_stops_the_run() -> None:
    with FakeOpenAI(fail_request=1) as server, \
            pytest.raises(BenchError, match=r"the warm-up request to .* failed: HTTP 500"):
        run(server.url, Workload(clients=1, tokens=2, timeout_s=10))


def test_on_start_is_called_once_after_the_warmup_and_before_the_measured_requests() -> None:
    with FakeOpenAI() as server:
        seen: list[int] = []
        summary = run(server.url, Workload(clients=2, tokens=3, timeout_s=10), on_start=lambda: seen.append(len(server.bodies)))
    assert seen == [1]  # the warm-up answered, no measured request sent yet
    assert summary.completion_tokens == 6 and len(server.bodies) == 3
