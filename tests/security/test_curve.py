"""CURVE keys, admission decisions, and CURVE on real sockets and an in-process pipeline."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.errors import ConfigError, SecurityError
from skippy_zmq.security.admission import MAX_KEYS_COUNTED, MAX_WINDOWS, Admission, ZapDecision
from skippy_zmq.security.curve import (
    RETURN_DOMAIN,
    STAGE_DOMAIN,
    ZAP_ENDPOINT,
    CurveSetup,
    ZapHandler,
    curve_client,
)
from skippy_zmq.security.keys import DRIVER, KeyPair, KeyStore, is_loopback, key_names, keygen
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.replies import Reply, decode_reply, encode_reply
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import ThreadedPipeline, write_topology

WAIT_S = 10.0
FORGED_STAGE = 7

TOPOLOGY = """
topology_id = "t"
model = "m.gguf"
[security]
curve = true
keys_dir = "keys"
{clients}
[driver]
return_bind = "tcp://127.0.0.1:7000"
[[stages]]
id = "stage-0"
index = 0
layer_start = 0
layer_end = 1
pull_bind = "tcp://127.0.0.1:7001"
[[stages]]
id = "stage-1"
index = 1
layer_start = 1
layer_end = 2
pull_bind = "tcp://127.0.0.1:7002"
"""


def topology(tmp_path: Path, clients: bool = True) -> TopologyConfig:
    path = tmp_path / "t.toml"
    path.write_text(TOPOLOGY.format(clients='clients_dir = "clients"' if clients else ""))
    return TopologyConfig.from_toml(path)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what}")
        time.sleep(0.01)


# --- key files -------------------------------------------------------------------------------


def test_keygen_makes_every_pair_owner_only_and_keeps_existing_keys(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    assert keygen(topo) == ["driver", "stage-0", "stage-1"]
    store = KeyStore.of(topo.security)
    assert store.keys_dir == tmp_path / "keys"
    for name in key_names(topo):
        assert store.secret_path(name).stat().st_mode & 0o777 == 0o600
        assert store.public_path(name).stat().st_mode & 0o777 == 0o644
        pair = store.pair(name)
        assert pair.public == store.public(name) and pair.secret is not None
    assert store.secret_path("driver").parent.stat().st_mode & 0o777 == 0o700
    before = store.secret_path("stage-1").read_bytes()
    store.secret_path("stage-0").unlink()
    store.public_path("stage-0").unlink()
    assert keygen(topo) == ["stage-0"]  # only the missing pair is made
    assert store.secret_path("stage-1").read_bytes() == before
    assert len({store.public(n) for n in key_names(topo)}) == 3


def test_half_a_pair_is_an_error_not_a_silent_overwrite(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    keygen(topo)
    store = KeyStore.of(topo.security)
    store.secret_path("driver").unlink()
    with pytest.raises(SecurityError, match="without its other half"):
        keygen(topo)


def test_a_client_pair_is_admitted_through_clients_dir(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    store = KeyStore.of(topo.security)
    assert store.clients() == frozenset()
    public, secret, admitted = store.ensure_client("alice")
    assert admitted == tmp_path / "clients" / "alice.key"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert store.clients() == frozenset({KeyPair.load(public, secret=False).public})
    with pytest.raises(SecurityError, match="plain file name"):
        store.ensure_client("../evil")
    other = tmp_path / "without-clients"
    other.mkdir()
    no_clients = KeyStore.of(topology(other, clients=False).security)
    with pytest.raises(SecurityError, match="clients_dir"):
        no_clients.ensure_client("bob")


def test_secret_files_must_be_owner_only_and_missing_files_say_how_to_make_them(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    store = KeyStore.of(topo.security)
    with pytest.raises(SecurityError, match="skippy-zmq keygen --topology"):
        store.pair("driver")
    keygen(topo)
    store.secret_path("driver").chmod(0o640)
    with pytest.raises(SecurityError, match="mode 0640"):
        store.pair("driver")
    with pytest.raises(SecurityError, match="no secret-key line"):
        KeyPair.load(store.public_path("driver"), secret=True)


def test_curve_on_without_keys_dir_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(TOPOLOGY.format(clients="").replace('keys_dir = "keys"', ""))
    with pytest.raises(ConfigError, match="needs keys_dir"):
        TopologyConfig.from_toml(path)


def test_each_stage_admits_only_its_upstream_and_the_driver_admits_every_stage(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    keygen(topo)
    store = KeyStore.of(topo.security)
    stage0, stage1 = (CurveSetup.for_stage(topo, s) for s in topo.stages)
    assert stage0.admitted == {STAGE_DOMAIN: frozenset({store.public(DRIVER)})}
    assert stage1.admitted == {STAGE_DOMAIN: frozenset({store.public("stage-0")})}
    assert set(stage0.peers) == {DRIVER, "stage-1"} and set(stage1.peers) == {DRIVER}
    driver = CurveSetup.for_driver(topo)
    assert driver.admitted == {RETURN_DOMAIN: frozenset({store.public("stage-0"), store.public("stage-1")})}
    assert set(driver.peers) == {"stage-0"}


def test_loopback_endpoints() -> None:
    assert is_loopback("tcp://127.0.0.1:5000") and is_loopback("tcp://localhost:1")
    assert is_loopback("tcp://[::1]:5") and is_loopback("ipc:///tmp/x") and is_loopback("inproc://x")
    assert not is_loopback("tcp://0.0.0.0:5000") and not is_loopback("tcp://*:5")
    assert not is_loopback("tcp://10.0.0.2:5000") and not is_loopback("tcp://stage-1:5711")


# --- admission decisions ---------------------------------------------------------------------


def test_admission_admits_only_curve_peers_with_an_admitted_key() -> None:
    good_public, _ = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    admission = Admission({STAGE_DOMAIN: frozenset({good_public})})
    good, other = z85.decode(good_public), z85.decode(other_public)
    decision = admission.decide(STAGE_DOMAIN, "1.2.3.4", b"CURVE", [good])
    assert decision.admitted and decision.status == b"200" and decision.user_id == good_public.decode()
    refusals = [
        admission.decide(STAGE_DOMAIN, "1.2.3.4", b"CURVE", [other]),
        admission.decide(STAGE_DOMAIN, "1.2.3.4", b"NULL", []),
        admission.decide(RETURN_DOMAIN, "1.2.3.4", b"CURVE", [good]),
        admission.decide(STAGE_DOMAIN, "1.2.3.4", b"CURVE", [good[:5]]),
    ]
    assert [d.admitted for d in refusals] == [False] * 4
    assert {d.status for d in refusals} == {b"400"}
    assert refusals[0].text == "public key not admitted"
    assert "not CURVE" in refusals[1].text and "unknown ZAP domain" in refusals[2].text
    assert admission.refused == {STAGE_DOMAIN: 3, RETURN_DOMAIN: 1}


def _random_key() -> bytes:
    return z85.decode(zmq.curve_keypair()[0])


def test_a_refused_peer_is_logged_once_per_interval_with_a_count() -> None:
    now = [100.0]
    admission = Admission({STAGE_DOMAIN: frozenset()}, log_interval_s=60.0, clock=lambda: now[0])
    key = _random_key()
    logs = [admission.decide(STAGE_DOMAIN, "a", b"CURVE", [key]).log for _ in range(5)]
    assert logs == [True, False, False, False, False]
    assert admission.decide(STAGE_DOMAIN, "b", b"CURVE", [key]).log  # another address: its own line
    assert admission.decide(RETURN_DOMAIN, "a", b"CURVE", [key]).log  # another domain: its own line
    now[0] += 60.0
    again = admission.decide(STAGE_DOMAIN, "a", b"CURVE", [key])
    assert (again.log, again.suppressed, again.keys, again.summary) == (True, 4, 1, False)


def test_refusals_are_rate_limited_per_address_across_keys_and_summed_up_with_their_keys() -> None:
    now = [100.0]
    admission = Admission({STAGE_DOMAIN: frozenset()}, log_interval_s=60.0, clock=lambda: now[0])
    keys = [_random_key() for _ in range(202)]
    decisions = [admission.decide(STAGE_DOMAIN, "10.0.0.9", b"CURVE", [key]) for key in keys]
    decisions += [admission.decide(STAGE_DOMAIN, "10.0.0.9", b"CURVE", [keys[0]]) for _ in range(3)]
    decisions.append(admission.decide(STAGE_DOMAIN, "10.0.0.9", b"NULL", []))  # no key: not a distinct key
    assert [d.log for d in decisions].count(True) == 1 and decisions[0].log  # 206 refusals, one line
    assert admission.refused == {STAGE_DOMAIN: 206}
    now[0] += 59.9
    assert admission.summaries() == []  # not before the interval has passed
    now[0] += 0.1
    assert admission.summaries() == []  # the table is looked through at most once a second
    now[0] += 0.9
    (summary,) = admission.summaries()
    assert (summary.domain, summary.address, summary.suppressed, summary.keys) == (STAGE_DOMAIN, "10.0.0.9", 205, 202)
    decision = summary.decision()
    assert (decision.log, decision.summary, decision.admitted, decision.suppressed, decision.keys) == (
        True, True, False, 205, 202)
    assert decision.text == "205 more refused handshakes (202 distinct CURVE keys)"
    now[0] += 1.0
    assert admission.summaries() == []  # each once
    # the summary opened a new interval: the next refusal is counted, not logged, until it passes
    assert not admission.decide(STAGE_DOMAIN, "10.0.0.9", b"CURVE", [keys[1]]).log
    now[0] += 60.0
    assert [(s.suppressed, s.keys) for s in admission.summaries()] == [(1, 1)]
    now[0] += 60.0
    assert admission.summaries() == []  # a quiet address is forgotten
    assert admission.decide(STAGE_DOMAIN, "10.0.0.9", b"CURVE", [keys[2]]).suppressed == 0


def test_the_distinct_key_count_and_the_address_table_are_bounded() -> None:
    now = [0.0]
    admission = Admission({STAGE_DOMAIN: frozenset()}, log_interval_s=60.0, clock=lambda: now[0])
    for _ in range(MAX_KEYS_COUNTED + 6):
        admission.decide(STAGE_DOMAIN, "a", b"CURVE", [_random_key()])
    for index in range(MAX_WINDOWS + 1):
        admission.decide(STAGE_DOMAIN, f"10.1.{index // 256}.{index % 256}", b"CURVE", [b"k" * 32])
    now[0] += 60.0
    # the flood of addresses restarted the table: "a" was forgotten with the others
    assert admission.summaries() == []
    for _ in range(MAX_KEYS_COUNTED + 6):
        admission.decide(STAGE_DOMAIN, "b", b"CURVE", [_random_key()])
    now[0] += 60.0
    (summary,) = admission.summaries()
    assert (summary.suppressed, summary.keys) == (MAX_KEYS_COUNTED + 5, MAX_KEYS_COUNTED)
    assert summary.decision().text == f"{MAX_KEYS_COUNTED + 5} more refused handshakes (at least {MAX_KEYS_COUNTED} distinct CURVE keys)"


def test_the_zap_handler_hands_over_summaries_of_unlogged_refusals() -> None:
    now = [0.0]
    admission = Admission({STAGE_DOMAIN: frozenset()}, log_interval_s=60.0, clock=lambda: now[0])
    seen: list[tuple[str, str, str, ZapDecision]] = []
    context: zmq.Context[Any] = zmq.Context()
    zap = ZapHandler(context, admission, lambda *call: seen.append(call))
    asker = context.socket(zmq.REQ)
    asker.setsockopt(zmq.LINGER, 0)
    try:
        asker.connect(ZAP_ENDPOINT)
        for index in range(3):  # what libzmq sends (RFC 27) for three handshakes with three keys
            asker.send_multipart([b"1.0", str(index).encode(), STAGE_DOMAIN.encode(), b"10.0.0.9", b"", b"CURVE",
                                  _random_key()])
            assert asker.poll(int(WAIT_S * 1000)), "no ZAP answer"
            assert asker.recv_multipart()[2] == b"400"
        assert [call[3].log for call in seen] == [True, False, False]
        now[0] += 60.0
        wait_until(lambda: len(seen) == 4, "the summary of the two unlogged refusals")
        domain, address, key, summary = seen[3]
        assert (domain, address, key, summary.summary, summary.suppressed, summary.keys) == (
            STAGE_DOMAIN, "10.0.0.9", "", True, 2, 2)
    finally:
        asker.close(linger=0)
        zap.close()
        context.term()


# --- real sockets ----------------------------------------------------------------------------


@pytest.fixture
def curve_server(tmp_path: Path) -> Iterator[tuple[zmq.Context[Any], zmq.Socket[Any], ZapHandler, str, CurveSetup]]:
    topo = topology(tmp_path)
    keygen(topo)
    setup = CurveSetup.for_stage(topo, topo.stages[1])  # admits stage-0's key only
    context: zmq.Context[Any] = zmq.Context()
    zap = ZapHandler(context, setup.admission())
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    setup.serve(pull, STAGE_DOMAIN)
    pull.bind("tcp://127.0.0.1:*")
    try:
        yield context, pull, zap, pull.getsockopt_string(zmq.LAST_ENDPOINT), CurveSetup.for_stage(topo, topo.stages[0])
    finally:
        pull.close(linger=0)
        zap.close()
        context.term()


def _push(context: zmq.Context[Any], endpoint: str, setup: Callable[[zmq.Socket[Any]], None] | None) -> zmq.Socket[Any]:
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 0)
    if setup is not None:
        setup(push)
    push.connect(endpoint)
    return push


def test_only_the_admitted_sender_gets_through(curve_server: Any) -> None:
    context, pull, zap, endpoint, stage0 = curve_server
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = KeyPair(stranger_public, stranger_secret)
    server_public = stage0.peers["stage-1"]
    plain = _push(context, endpoint, None)
    wrong = _push(context, endpoint, lambda s: curve_client(s, stranger, server_public))
    good = _push(context, endpoint, lambda s: stage0.connect_to(s, "stage-1"))
    try:
        wait_until(lambda: zap.admission.refused.get(STAGE_DOMAIN, 0) >= 1, "the stranger's handshake is refused")
        for push in (plain, wrong):
            with contextlib.suppress(zmq.Again):  # queued or refused locally: either way it must not arrive
                push.send(b"forged")
        good.send(b"legit", flags=0)
        assert pull.poll(int(WAIT_S * 1000))
        assert pull.recv() == b"legit"
        assert not pull.poll(300)  # the forged messages never arrive
        assert zap.admission.admitted_count == {STAGE_DOMAIN: 1}
    finally:
        for push in (plain, wrong, good):
            push.close(linger=0)


def test_a_curve_pipeline_generates_the_plain_pipeline_tokens_and_refuses_strangers(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    request = GenerationRequest(prompt="Hello there", max_tokens=8, sampling=SamplingParams(ignore_eos=True))
    results = []
    for curve in (False, True):
        directory = tmp_path / ("curve" if curve else "plain")
        directory.mkdir()
        with (ThreadedPipeline(directory, tiny_llama_path, TINY_LLAMA_LAYERS, 2, curve=curve) as pipe,
              PipelineTransport(pipe.topology, pipe.tokenizer) as client):
            assert (client.curve is not None) == curve
            client.wait_ready(WAIT_S)
            results.append(client.generate([request])[0])
            if curve:
                _strangers_are_refused(pipe, client)
    assert results[0].error is None and results[1].error is None
    assert results[1].tokens == results[0].tokens and len(results[0].tokens) == 8


def _strangers_are_refused(pipe: ThreadedPipeline, client: PipelineTransport) -> None:
    """A stranger's key reaches neither stage 1 nor the driver's return socket."""
    stage1 = pipe.workers[1]
    before = dict(stage1.metrics.counts)
    public, secret = zmq.curve_keypair()
    context: zmq.Context[Any] = zmq.Context()
    server1 = KeyStore.of(pipe.topology.security).public("stage-1")
    server_driver = KeyStore.of(pipe.topology.security).public(DRIVER)
    into_stage = _push(context, pipe.topology.stages[1].pull_connect,
                       lambda s: curve_client(s, KeyPair(public, secret), server1))
    into_driver = _push(context, pipe.topology.driver.return_connect,
                        lambda s: curve_client(s, KeyPair(public, secret), server_driver))
    try:
        wait_until(lambda: stage1.metrics.counts.get("errors.handshake_refused", 0) >= 1,
                   "stage 1 counts the refused handshake")
        wait_until(lambda: client.handshakes_refused >= 1, "the driver counts the refused handshake")
        with contextlib.suppress(zmq.Again):
            into_driver.send_multipart(encode_reply(Reply.heartbeat(FORGED_STAGE, 0)))
        with contextlib.suppress(zmq.Again):
            into_stage.send(b"forged")
        seen: set[int] = set()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # stages heartbeat every 0.2 s: the socket stays busy
            if client.returns.poll(50):
                seen.add(decode_reply(client.returns.recv_multipart()).stage_index)
        assert seen <= {0, 1}, seen  # the forged heartbeat of a "stage 7" never arrived
        after = stage1.metrics.counts
        assert {k: v for k, v in after.items() if k.startswith("messages.")} == {
            k: v for k, v in before.items() if k.startswith("messages.")
        }
    finally:
        into_stage.close(linger=0)
        into_driver.close(linger=0)
        context.term()


def test_a_curve_topology_written_by_the_helpers_has_keys(tmp_path: Path, tiny_llama_path: Path) -> None:
    path = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2, curve=True)
    topo = TopologyConfig.from_toml(path)
    assert topo.security.curve and KeyStore.of(topo.security).pair(DRIVER).secret is not None


@pytest.mark.slow
def test_worker_processes_serve_a_curve_topology_and_generate_through_the_cli(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    import subprocess
    import sys

    from skippy_zmq.launch.processes import LocalPipeline

    path = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2, curve=True)
    with LocalPipeline(path) as pipeline:
        assert pipeline.topology.security.curve
        done = subprocess.run(
            [sys.executable, "-m", "skippy_zmq.cli", "generate", "--topology", str(path), "--temperature", "0",
             "--max-tokens", "6", "--json", "--ready-timeout", "30", "Hello there"],
            check=False, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert '"error": null' in done.stdout and '"finish_reason": "length"' in done.stdout


@pytest.mark.slow
def test_a_worker_refuses_to_start_without_its_secret_key(tmp_path: Path, tiny_llama_path: Path) -> None:
    import subprocess
    import sys

    path = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2, curve=True)
    KeyStore.of(TopologyConfig.from_toml(path).security).secret_path("stage-1").chmod(0o644)
    done = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "worker", "--topology", str(path), "--stage",
                           "stage-1"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "stage-1.key_secret: secret key file has mode 0644" in done.stderr


def _prefill(session_id: int) -> list[Any]:
    """A complete one-chunk prompt for a fresh session, as an attacker would send it."""
    from skippy_zmq.wire.messages import MessageKind, StageMessage, StateHeader, encode_message

    tokens = [2, 300, 301]
    header = StateHeader.for_kind(MessageKind.PREFILL_FINAL_EMBD, prompt_token_count=len(tokens))
    message = StageMessage(kind=MessageKind.PREFILL_FINAL_EMBD, pos_start=0, token_count=len(tokens),
                           state=header, request_id=session_id, session_id=session_id, tokens=tokens)
    return list(encode_message(message))


def _two_prompts(pipeline: Any, tokenizer: Any) -> list[Any]:
    requests = [GenerationRequest(prompt=p, max_tokens=4, sampling=SamplingParams(ignore_eos=True))
                for p in ("one", "two")]
    with PipelineTransport(pipeline.topology, tokenizer, SchedulerSettings(recovery_timeout_s=0)) as client:
        client.wait_ready(30.0)
        return client.generate(requests)


@pytest.mark.slow
def test_the_lockout_attack_fails_with_curve_and_expires_without_it(tmp_path: Path, tiny_llama_path: Path) -> None:
    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.tokens.tokenizer import Tokenizer
    from tests.pipeline_helpers import RawPeer

    tokenizer = Tokenizer.from_gguf(tiny_llama_path)
    # With CURVE: the attacker's own key reaches no stage; both lanes serve the legitimate client.
    (tmp_path / "curve").mkdir()
    secured = write_topology(tmp_path / "curve", tiny_llama_path, TINY_LLAMA_LAYERS, 2, lane_count=2, curve=True)
    with LocalPipeline(secured) as pipeline:
        context: zmq.Context[Any] = zmq.Context()
        public, secret = zmq.curve_keypair()
        server = KeyStore.of(pipeline.topology.security).public("stage-0")
        attacker = _push(context, pipeline.topology.stages[0].pull_connect,
                         lambda s: curve_client(s, KeyPair(public, secret), server))
        try:
            for session_id in (901, 902, 903, 904):
                with contextlib.suppress(zmq.Again):
                    attacker.send_multipart(_prefill(session_id))
            results = _two_prompts(pipeline, tokenizer)
        finally:
            attacker.close(linger=0)
            context.term()
        assert [r.error for r in results] == [None, None]
    # Without CURVE the attack takes both lanes, but only until prefill_ttl_s.
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = write_topology(plain_dir, tiny_llama_path, TINY_LLAMA_LAYERS, 2, lane_count=2)
    plain.write_text(plain.read_text().replace("lane_count = 2\n", "lane_count = 2\nprefill_ttl_s = 4\n"))
    with LocalPipeline(plain) as pipeline:
        peer = RawPeer(pipeline)
        try:
            for session_id in (901, 902):
                peer.send(0, _prefill(session_id))
                assert peer.reply().session_id == session_id  # computed: the lane is taken
        finally:
            peer.close()
        attacked = time.monotonic()
        locked = _two_prompts(pipeline, tokenizer)  # no lane is free: the driver waits and starts over
        assert [r.error for r in locked] == [None, None]
        # They could only run once the stages freed the attacker's idle prefills (prefill_ttl_s 4).
        assert time.monotonic() - attacked >= 3.5


# --- review fixes: fail closed, reserved ids, key names ----------------------------------------


def test_a_curve_server_without_an_answering_zap_handler_admits_no_one(tmp_path: Path) -> None:
    topo = topology(tmp_path)
    keygen(topo)
    setup = CurveSetup.for_stage(topo, topo.stages[1])
    sender = CurveSetup.for_stage(topo, topo.stages[0])  # the legitimate sender's own key
    context: zmq.Context[Any] = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    setup.serve(pull, STAGE_DOMAIN)  # no ZapHandler on this context: libzmq must refuse, not admit
    pull.bind("tcp://127.0.0.1:*")
    push = _push(context, pull.getsockopt_string(zmq.LAST_ENDPOINT), lambda s: sender.connect_to(s, "stage-1"))
    try:
        with contextlib.suppress(zmq.Again):
            push.send(b"would be admitted by a handler")
        assert not pull.poll(500)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


def test_an_ack_for_a_real_request_0_is_not_a_heartbeat() -> None:
    from skippy_zmq.wire.messages import MessageKind
    from skippy_zmq.wire.replies import ReplyKind

    beat = Reply.heartbeat(1, 0, incarnation=77)
    assert beat.is_heartbeat and beat.incarnation == 77
    ack = Reply(kind=ReplyKind.ACK, request_id=0, session_id=77, stage_index=1, answered=MessageKind.STOP)
    assert not ack.is_heartbeat and ack.incarnation == 0


def test_stage_ids_must_be_plain_key_names_with_curve(tmp_path: Path) -> None:
    for bad in ("driver", "../x", ".hidden"):
        path = tmp_path / "t.toml"
        path.write_text(TOPOLOGY.format(clients="").replace('id = "stage-1"', f'id = "{bad}"'))
        with pytest.raises(ConfigError, match="names its key files"):
            TopologyConfig.from_toml(path)
    with pytest.raises(SecurityError, match="plain file name"):
        KeyStore(tmp_path).public_path("../../etc/passwd")


def test_a_client_pair_admitted_in_place_when_clients_dir_is_the_pairs_dir(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(TOPOLOGY.format(clients='clients_dir = "keys/clients"'))
    store = KeyStore.of(TopologyConfig.from_toml(path).security)
    public, _secret, admitted = store.ensure_client("bob")
    assert admitted == public
    assert store.clients() == frozenset({KeyPair.load(public, secret=False).public})
