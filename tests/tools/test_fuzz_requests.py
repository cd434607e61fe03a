"""tools/fuzz_requests.py: the mutation table against the gateway's socket-free parsers, outcome
classification, log counting, and a CI-sized campaign against a live `serve`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skippy_zmq.gateway.http import MAX_BODY_BYTES, decode_body
from skippy_zmq.gateway.llama_api import DetokenizeRequest, NativeCompletion, TokenizeRequest, read_json
from skippy_zmq.gateway.openai_api import ApiError, CompletionParams, Endpoint
from skippy_zmq.gateway.zmq_requests import Refused, Submit, read_command
from tests.tools import run_tool
from tools import fuzz_requests as fuzz

SEEDS = range(40)
TRANSPORT_ROWS = {"http_wrong_route"}  # refused by aiohttp's router before any parser sees the body


def _probe(row: Any, seed: int) -> Any:
    return row.make(np.random.default_rng(seed))


# --- the mutation table -------------------------------------------------------------------------


@pytest.mark.parametrize("row", fuzz.MUTATIONS, ids=lambda row: row.name)
def test_every_mutation_kind_makes_what_it_claims(row: Any) -> None:
    failures = [seed for seed in SEEDS if not row.claim(_probe(row, seed))]
    assert failures == [], f"{row.name}: claim false for seeds {failures}"
    assert {_probe(row, seed).api for seed in SEEDS} == {row.api}


def _verdict(probe: Any) -> str:
    """What the gateway's socket-free parsers make of a probe: 200 (parsed) or 4xx."""
    if probe.api == fuzz.ZMQ:
        command = read_command(len(probe.frames), probe.frames[0])
        if isinstance(command, Refused):
            assert 400 <= command.error.status < 500
            return fuzz.CLIENT_ERROR
        if isinstance(command, Submit):
            command.params.sampling()
        return fuzz.OK
    endpoint = Endpoint.CHAT if probe.path.endswith("chat/completions") else Endpoint.COMPLETIONS
    if len(probe.body) > MAX_BODY_BYTES:
        return fuzz.CLIENT_ERROR  # aiohttp's client_max_size: 413
    try:
        body = decode_body(probe.body, dict(probe.headers).get("Content-Encoding"))
        if probe.path in fuzz.LLAMA_PATHS:
            _llama_verdict(probe.path, body)
            return fuzz.OK
        CompletionParams.from_json(endpoint, body).sampling()
    except ApiError as error:
        assert 400 <= error.status < 500
        return fuzz.CLIENT_ERROR
    return fuzz.OK


def _llama_verdict(path: str, body: bytes) -> None:
    """What llama_api's parsers make of a body for one of llama-server's routes (ApiError when refused)."""
    if path == "/completion":
        NativeCompletion.from_json(body).params().sampling()
    elif path == "/tokenize":
        TokenizeRequest.from_body(read_json(body))
    else:
        DetokenizeRequest.from_body(read_json(body))


@pytest.mark.parametrize("row", [row for row in fuzz.MUTATIONS if row.name not in TRANSPORT_ROWS],
                         ids=lambda row: row.name)
def test_the_parsers_give_every_kind_an_outcome_it_expects(row: Any) -> None:
    verdicts = {seed: _verdict(_probe(row, seed)) for seed in SEEDS}
    assert {seed: v for seed, v in verdicts.items() if v not in row.expect} == {}


def test_the_table_has_one_named_row_per_kind_with_a_positive_weight() -> None:
    names = [row.name for row in fuzz.MUTATIONS]
    assert len(names) == len(set(names))
    assert all(row.weight > 0 and row.about and row.expect for row in fuzz.MUTATIONS)
    assert {row.api for row in fuzz.MUTATIONS} == {fuzz.HTTP, fuzz.ZMQ}


def test_a_schedule_visits_every_row_first_then_draws_by_seed() -> None:
    count = len(fuzz.MUTATIONS) + 200
    first = [row.name for row in fuzz.schedule(np.random.default_rng(3), count)]
    assert first[: len(fuzz.MUTATIONS)] == [row.name for row in fuzz.MUTATIONS]
    assert first == [row.name for row in fuzz.schedule(np.random.default_rng(3), count)]
    assert first != [row.name for row in fuzz.schedule(np.random.default_rng(4), count)]


@pytest.mark.parametrize("row", fuzz.MUTATIONS, ids=lambda row: row.name)
def test_a_seed_reproduces_the_same_probe(row: Any) -> None:
    assert _probe(row, 11) == _probe(row, 11)


def test_json_text_writes_huge_literals_and_escapes_lone_surrogates() -> None:
    assert fuzz.json_text({"a\ud800": [fuzz.Literal("9" * 5), "x\udc00"]}) == '{"a\\ud800":[99999,"x\\udc00"]}'
    assert fuzz.huge_integer(b'{"n": ' + b"9" * 4301 + b"}") and not fuzz.huge_integer(b"9" * 4300)
    assert fuzz.invalid_text(b'{"a": "\\ud800"}') and not fuzz.invalid_text(b'{"a": "\\ud83d\\ude00"}')
    assert fuzz.not_utf8_json(b"\xff") and not fuzz.not_utf8_json(b"{}")


# --- outcomes ---------------------------------------------------------------------------------


def test_status_classes() -> None:
    assert [fuzz.status_class(s) for s in (200, 400, 413, 499, 500, 503, None)] == [
        "200", "4xx", "4xx", "4xx", "5xx", "5xx", "none"]


def test_a_zmq_message_is_the_class_of_its_first_answer_unless_one_was_a_5xx() -> None:
    pong, lost = {"type": "pong"}, {"type": "error", "code": 404, "id": "w"}
    assert fuzz._zmq_answer([pong, lost], silent_ok=False).status == 200
    assert fuzz._zmq_answer([{"type": "delta"}, {"type": "final"}], silent_ok=False).status == 200
    assert fuzz._zmq_answer([{"type": "error", "code": 400}], silent_ok=False).status == 400
    assert fuzz._zmq_answer([pong, {"type": "error", "code": 500}], silent_ok=False).status == 500
    assert fuzz._zmq_answer([], silent_ok=True).status == 200  # a cancel has no answer of its own
    assert fuzz._zmq_answer([], silent_ok=False).status is None  # anything else must have one


def test_the_tally_counts_unexpected_outcomes_by_row() -> None:
    rows = {row.name: row for row in fuzz.MUTATIONS}
    tally = fuzz.Tally()
    probe = fuzz.Probe(fuzz.HTTP, b"{}")
    tally.record(rows["http_surrogate_key"], probe, fuzz.Answer(400))
    tally.record(rows["http_surrogate_key"], probe, fuzz.Answer(500, "internal error"))
    tally.record(rows["http_valid"], probe, fuzz.Answer(None, "timed out"))
    assert tally.by_mutation["http_surrogate_key"] == {"sent": 2, "4xx": 1, "5xx": 1, "unexpected": 1}
    assert (tally.total("5xx"), tally.total("none"), tally.unexpected_count) == (1, 1, 2)
    assert [sample["status"] for sample in tally.unexpected] == [500, None]


def test_the_serve_log_counts_raw_and_embedded_tracebacks_and_warnings(tmp_path: Path) -> None:
    log = fuzz.ServeLog(iter(()), tmp_path / "serve.log")
    log.join(5)
    log.take(json.dumps({"component": "gateway", "event": "ready"}) + "\n")
    log.take(json.dumps({"event": "log", "level": "error", "message": "boom\nTraceback (most recent call last):\n"
                                                                        '  File "x.py"\nValueError: x'}) + "\n")
    log.take("Traceback (most recent call last):\n")
    log.take("not json\n")
    assert (log.tracebacks, len(log.warnings), log.not_json) == (2, 1, 2)
    assert log.traceback_excerpt[0].startswith("Traceback") and log.traceback_excerpt[-1] == "ValueError: x"


# --- a campaign against a live serve ---------------------------------------------------------------


@pytest.mark.slow
def test_a_ci_sized_campaign_gets_no_5xx_no_silence_and_no_traceback(tiny_gemma3_path: Path, tmp_path: Path) -> None:
    done = run_tool("fuzz_requests", "--requests", "300", "--seed", "1", "--model", str(tiny_gemma3_path),
                    "--log-dir", str(tmp_path), "--json", "--quiet", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["server_errors"], report["no_answer"], report["unexpected"], report["tracebacks"]) == (0, 0, 0, 0)
    assert report["sent"] == 300 and report["http"] and report["zmq"]
    assert set(report["by_mutation"]) == {row.name for row in fuzz.MUTATIONS}
    assert report["ok_200"] >= 20 and report["client_errors"] >= 150
    assert report["checks"][0] == report["checks"][1] and not report["checks"][0].startswith("check failed")
    assert report["rss_kib"]["before"] and report["rss_kib"]["after"]
