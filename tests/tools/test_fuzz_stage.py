"""tools/fuzz_stage.py: the mutation table, reply classification, and a CI-sized campaign against live workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.launch.topology import topology_toml
from skippy_zmq.wire.messages import MessageKind, decode_message
from skippy_zmq.wire.replies import Reply, ReplyKind
from tests.tools import run_tool
from tools import fuzz_stage as fuzz

N_EMBD, N_VOCAB = 64, 600


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> TopologyConfig:
    """A 2-stage topology (layers 0..4 and 4..7); nothing listens on its ports."""
    path = tmp_path_factory.mktemp("fuzz") / "topology.toml"
    path.write_text(topology_toml(model="unused.gguf", ranges=[(0, 4), (4, 7)], topology_id="fuzz-test",
                                  ports=[5801, 5802, 5803]))
    return TopologyConfig.from_toml(path)


def _target(topology: TopologyConfig, index: int) -> Any:
    return fuzz.Target.of(topology, index, N_EMBD, N_VOCAB)


def _frames(row: Any, target: Any, seed: int) -> list[bytes]:
    return [bytes(frame) for frame in row.make(np.random.default_rng(seed), target, 1000 + seed)]


# --- the mutation table -------------------------------------------------------------------------


@pytest.mark.parametrize("stage_index", [0, 1])
@pytest.mark.parametrize("row", fuzz.MUTATIONS, ids=lambda row: row.name)
def test_every_mutation_kind_makes_what_it_claims(topology: TopologyConfig, row: Any, stage_index: int) -> None:
    target = _target(topology, stage_index)
    failures = [seed for seed in range(40) if not row.claim(_frames(row, target, seed), target)]
    assert failures == [], f"{row.name}: claim false for seeds {failures}"


def test_the_table_has_one_named_row_per_kind_with_a_positive_weight() -> None:
    names = [row.name for row in fuzz.MUTATIONS]
    assert len(names) == len(set(names))
    assert all(row.weight > 0 and row.about for row in fuzz.MUTATIONS)


def test_a_schedule_visits_every_row_first_then_draws_by_seed() -> None:
    count = len(fuzz.MUTATIONS) + 200
    first = [row.name for row in fuzz.schedule(np.random.default_rng(3), count)]
    again = [row.name for row in fuzz.schedule(np.random.default_rng(3), count)]
    other = [row.name for row in fuzz.schedule(np.random.default_rng(4), count)]
    assert first[: len(fuzz.MUTATIONS)] == [row.name for row in fuzz.MUTATIONS]
    assert first == again
    assert first != other


@pytest.mark.parametrize("row", fuzz.MUTATIONS, ids=lambda row: row.name)
def test_a_seed_reproduces_the_same_frames(topology: TopologyConfig, row: Any) -> None:
    target = _target(topology, 1)
    assert _frames(row, target, 11) == _frames(row, target, 11)


def test_a_valid_message_is_accepted_and_reaches_the_runtime_for_both_stages(topology: TopologyConfig) -> None:
    for index in (0, 1):
        target = _target(topology, index)
        for seed in range(20):
            message = decode_message(_frames(fuzz.MUTATIONS[0], target, seed))
            assert fuzz.admitted(message, target)
            assert (message.activation is not None) == (index > 0 and message.kind.carries_tokens)


def test_reseal_lets_a_changed_field_pass_the_checksum(topology: TopologyConfig) -> None:
    target = _target(topology, 1)
    frames = fuzz.to_frames(fuzz.valid_message(np.random.default_rng(0), target, 5, kind=MessageKind.DECODE_EMBD))
    frames[0][fuzz.OFF_POS : fuzz.OFF_POS + 4] = (-1).to_bytes(4, "little", signed=True)
    assert not fuzz.checksum_matches([bytes(f) for f in frames])
    resealed = [bytes(f) for f in fuzz.reseal(frames)]
    assert fuzz.checksum_matches(resealed)
    assert fuzz.decoded(resealed) is None  # refused by the pos_start rule behind the checksum


# --- outcomes -----------------------------------------------------------------------------------

REJECTED = ('stage 1 "stage-1" (layers 4..7): rejected message (request 9 session 3): stage message has 2 frames; '
            "expected at least 4")
FAILED = ('stage 1 "stage-1" (layers 4..7): request 12 session 1592655872 (DECODE_EMBD): decode at pos_start 9 but '
          "session 1592655872 holds only 5 positions")


def test_an_error_text_becomes_the_template_of_its_check() -> None:
    assert fuzz.error_cause(REJECTED) == "stage message has N frames; expected at least N"
    assert fuzz.error_cause(FAILED) == "decode at pos_start N but session N holds only N positions"
    other_values = REJECTED.replace("2 frames", "3 frames").replace("request 9", "request 70")
    assert fuzz.error_cause(other_values) == fuzz.error_cause(REJECTED)
    codec = "stage 1 \"s\" (layers 4..7): rejected message (request 1 session 2): got f16-rne-v1, dims [64, 2] (3..5)"
    assert fuzz.error_cause(codec) == "got f16-rne-v1, dims […] (N..N)"
    internal = 'stage 0 "a" (layers 0..4): request 1 session 2 (STOP): internal error ValueError: bad 0x1f'
    assert fuzz.error_cause(internal) == "internal error ValueError: bad N"


def _reply(kind: ReplyKind, stage_index: int, error: str = "", request_id: int = 7, session_id: int = 3) -> Reply:
    return Reply(kind=kind, request_id=request_id, session_id=session_id, stage_index=stage_index, error=error)


def test_a_reply_is_refused_accepted_or_forwarded_by_its_kind_and_stage() -> None:
    assert fuzz.Outcome.of_reply(_reply(ReplyKind.ERROR, 1, REJECTED), 1) == fuzz.Outcome(
        fuzz.REFUSED, "stage message has N frames; expected at least N")
    forwarded = fuzz.Outcome.of_reply(_reply(ReplyKind.ERROR, 1, FAILED), 0)
    assert forwarded.category == fuzz.ACCEPTED
    assert forwarded.detail.startswith("forwarded, then refused by stage 1")
    assert fuzz.Outcome.of_reply(_reply(ReplyKind.ACK, 1), 1) == fuzz.Outcome(fuzz.ACCEPTED, "ACK")
    token = Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=7, session_id=3, stage_index=1, predicted_token=5)
    assert fuzz.Outcome.of_reply(token, 0) == fuzz.Outcome(fuzz.ACCEPTED, "PREDICTED_TOKEN")


def test_the_ledger_matches_replies_by_the_ids_a_stage_echoes(topology: TopologyConfig) -> None:
    target = _target(topology, 1)
    ledger = fuzz.Ledger(1, frame_limit=1 << 20)
    valid = fuzz.to_frames(fuzz.valid_message(np.random.default_rng(0), target, 5, kind=MessageKind.PREFILL_EMBD,
                                              session_id=77))
    ledger.record("valid", [bytes(f) for f in valid])
    ledger.record("random_bytes", [b"junk"])
    ledger.record("random_bytes", [b"more junk"])
    ledger.record("big_frame", [bytes(2 << 20)])
    ledger.record("stop", [bytes(f) for f in fuzz.to_frames(fuzz._control(MessageKind.STOP, 6, 78))])
    assert ledger.resolve(_reply(ReplyKind.ERROR, 1, REJECTED, request_id=0, session_id=0))
    assert ledger.resolve(_reply(ReplyKind.ERROR, 1, FAILED, request_id=0, session_id=0))
    assert ledger.resolve(_reply(ReplyKind.ACK, 1, request_id=6, session_id=78))
    assert not ledger.resolve(_reply(ReplyKind.ACK, 1, request_id=6, session_id=78))  # answered already
    outcomes = ledger.outcomes()
    assert outcomes[0] == ("valid", fuzz.Outcome(fuzz.NO_REPLY, "PREFILL_EMBD"))
    assert [o.detail for _, o in outcomes[1:3]] == [fuzz.error_cause(REJECTED), fuzz.error_cause(FAILED)]
    assert outcomes[3][1].category == fuzz.REFUSED and "ZMQ_MAXMSGSIZE" in outcomes[3][1].detail
    assert outcomes[4] == ("stop", fuzz.Outcome(fuzz.ACCEPTED, "ACK"))
    tally = ledger.tally()
    assert (tally["sent"], tally[fuzz.REFUSED], tally[fuzz.ACCEPTED], tally[fuzz.NO_REPLY]) == (5, 3, 1, 1)
    assert tally["unmatched_replies"] == 1
    assert tally["by_mutation"]["random_bytes"] == {"sent": 2, fuzz.REFUSED: 2, fuzz.ACCEPTED: 0, fuzz.NO_REPLY: 0}
    assert ledger.take_sessions() == {77, 0, 78}
    assert ledger.take_sessions() == set()


def test_the_log_watch_counts_tracebacks_stray_lines_and_reads_the_exit_counters() -> None:
    logs = fuzz.LogWatch("stage-1")
    stopped = {"ts": 1, "component": "stage-1", "event": "stopped", "counts": {"errors.WireError": 4, "errors": 4}}
    logs.write('{"ts": 1, "component": "stage-1", "event": "ready"}\n')
    logs.write("Traceback (most recent call last):\n")
    logs.write('  File "x.py", line 1, in <module>\n')
    logs.write("ValueError: boom\n")
    logs.write(json.dumps({**stopped, "component": "stage-0", "counts": {}}) + "\n")
    logs.write(json.dumps(stopped) + "\n")
    assert logs.tracebacks == 1
    assert logs.traceback_excerpt == ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                                      "ValueError: boom"]
    assert logs.non_json_lines == 3
    assert logs.exit_counts == {"errors.WireError": 4, "errors": 4}


# --- a campaign against live workers -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage_index", [0, 1])
def test_a_ci_sized_campaign_finds_no_crash_hang_or_traceback(tiny_gemma3_path: Path, tmp_path: Path,
                                                             stage_index: int) -> None:
    done = run_tool("fuzz_stage", "--messages", "300", "--check-every", "100", "--seed", "1", "--target-stage",
                    str(stage_index), "--model", str(tiny_gemma3_path), "--hang-timeout", "20", "--log-dir",
                    str(tmp_path), "--json", "--quiet", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["crashes"], report["hangs"], report["tracebacks"]) == (0, 0, 0)
    assert report["sent"] == 300 and not report["interrupted"]
    assert report["checks"]["run"] == report["checks"]["equal"] == 4  # before, and after 100, 200, 300
    assert len(report["checks"]["tokens"]) == 8
    assert set(report["by_mutation"]) == {row.name for row in fuzz.MUTATIONS}
    assert all(counts["sent"] >= 1 for counts in report["by_mutation"].values())
    assert report[fuzz.REFUSED] >= 200 and report[fuzz.ACCEPTED] >= 1
    assert report["refused_by_cause"] and all(cause.strip() for cause in report["refused_by_cause"])
    assert report["errors_by_class"]  # the stage's own counters, by exception class
    assert report["rss_kib"]["before"] and report["rss_kib"]["after"]
