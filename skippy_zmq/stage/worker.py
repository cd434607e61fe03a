"""The transport of one stage: PULL, poll, batching window, heartbeats, PUSH.

Every decision (admission, sessions, positions, compute, sampling, control kinds) is made by
`skippy_zmq.stage_core.StageCore`; the worker only moves bytes between its sockets and the
core (docs/PROTOCOL.md §5). It never dies or hangs on a bad message: the core answers it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import attrs
import zmq

from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.defaults import REST_OF_PASS_S
from skippy_zmq.errors import StageError
from skippy_zmq.link import LinkShape
from skippy_zmq.security.admission import ZapDecision
from skippy_zmq.security.curve import STAGE_DOMAIN, CurveGuard, CurveSetup
from skippy_zmq.security.keys import DRIVER, is_loopback
from skippy_zmq.stage.core import (
    Answer,
    Forward,
    Inbound,
    StageCore,
    rest_of_pass_s,
    split_batch,
    takes_more,
)
from skippy_zmq.stage.delay_line import LINE_CAPACITY, DelayLine
from skippy_zmq.stage.sessions import StageRuntimeLike
from skippy_zmq.tcp import keep_alive
from skippy_zmq.telemetry import EventLog, StageMetrics
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.pooling import RankHead
from skippy_zmq.wire.frames import MAX_ACTIVATION_BYTES
from skippy_zmq.wire.messages import MAX_SIDEBAND_VALUES, StageMessage, encode_message
from skippy_zmq.wire.replies import Reply, StageLoad, encode_reply
from skippy_zmq.wire.trace import now_us

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer

SEND_HWM = 16
"""Messages queued per link before a sender blocks: a slow stage pushes back upstream."""
RECV_HWM = 16
SEND_TIMEOUT_MS = 30_000
"""How long a downstream send may block on a full queue before the message fails by name."""
REPLY_HWM = 256
"""Replies queued for the driver; past that (no driver listens, or it is stuck) a reply is
dropped at once, counted and logged, and the stage's loop never waits for it."""
HEARTBEAT_S = 1.0
BATCH_WINDOW_S = 0.003
"""Longest wait for other sessions' decode steps to join a batch (only while some are live)."""
POLL_MS = 100
MAX_FRAME_BYTES = max(MAX_ACTIVATION_BYTES, 4 * MAX_SIDEBAND_VALUES) + 64 * 1024
"""The wire's own bound on one frame; a stage sets a tighter one from its model (below)."""
FRAME_SLACK_BYTES = 64 * 1024


def max_frame_bytes(ctx_size: int, n_embd: int) -> int:
    """ZMQ_MAXMSGSIZE of a stage's PULL socket (docs/PROTOCOL.md §10, Bounds): libzmq applies
    it to every frame as it arrives and drops the connection of a peer that sends more. No
    legitimate frame is larger than a whole context of f32 activations plus headers."""
    return min(MAX_FRAME_BYTES, ctx_size * max(n_embd, 1) * 4 + FRAME_SLACK_BYTES)


def _resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm), 0 where it cannot be read (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _stage_load(core: StageCore) -> StageLoad:
    """What a heartbeat says of the stage's load (docs/PROTOCOL.md §2.4): a heartbeat thread's read of the
    session table's size, taken without the serve loop's help (one dict length: no lock needed)."""
    return StageLoad(_resident_bytes(), len(core.sessions), core.runtime.invariant)


class StopRequest:
    """A stop flag that signal handlers may set: a plain attribute store takes no lock, so a
    second signal arriving while the first is handled cannot deadlock (unlike Event.set)."""

    def __init__(self) -> None:
        self.requested = False

    def set(self) -> None:
        """Request the stop."""
        self.requested = True

    def install(self) -> None:
        """SIGTERM and SIGINT request the stop (the process then exits 0)."""

        def request_stop(_signum: int, _frame: FrameType | None) -> None:
            self.requested = True

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, request_stop)


def _pull_socket(context: zmq.Context[Any], max_bytes: int) -> zmq.Socket[Any]:
    """The stage's PULL with its options (docs/PROTOCOL.md §1, socket settings), not yet bound."""
    pull: zmq.Socket[Any] = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    keep_alive(pull)
    pull.setsockopt(zmq.RCVHWM, RECV_HWM)
    pull.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return pull


class StageWorker:
    """Serves one stage of a topology until `stop()` or SIGTERM/SIGINT."""

    def __init__(
        self,
        topology: TopologyConfig,
        stage: StageConfig,
        runtime: StageRuntimeLike,
        *,
        context: zmq.Context[Any] | None = None,
        log: EventLog | None = None,
        eog_ids: Sequence[int] = (),
        grammars: GrammarBook | None = None,
        rank_head: RankHead | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        send_timeout_ms: int = SEND_TIMEOUT_MS,
        batch_window_s: float = BATCH_WINDOW_S,
        rest_of_pass_max_s: float = REST_OF_PASS_S,
        stop_request: StopRequest | None = None,
        curve: CurveSetup | None = None,
        on_beat: Callable[[], None] | None = None,
        link: LinkShape | None = None,
    ) -> None:
        """`link` overrides the shape of the stage's emulated link (`worker --emulate-link`)."""
        self.stage = stage
        self._on_beat = on_beat
        self.log = log or EventLog(stage.stage_id)
        self.core = StageCore(topology, stage, runtime, log=self.log, eog_ids=eog_ids, grammars=grammars,
                              rank_head=rank_head)
        self.metrics = self.core.metrics
        self.downstream = topology.downstream(stage)
        self.return_connect = topology.driver.return_connect
        self.heartbeat_s = heartbeat_s
        self.send_timeout_ms = send_timeout_ms
        self.batch_window_s = batch_window_s
        self.rest_of_pass_max_s = rest_of_pass_max_s
        self._stop = stop_request or StopRequest()
        # New for every worker: a driver that sees it change knows the stage lost its sessions.
        self.incarnation = secrets.randbits(63) | 1
        self._beating = threading.Event()
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self.curve = curve = curve or (CurveSetup.for_stage(topology, stage) if topology.security.curve else None)
        self._guard = CurveGuard(self._context, curve, functools.partial(_refused, self.metrics, self.log, stage.index))
        self.max_frame_bytes = max_frame_bytes(stage.ctx_size, runtime.hparams.n_embd)
        self._pull = _pull_socket(self._context, self.max_frame_bytes)
        self._guard.serve(self._pull, STAGE_DOMAIN)
        self._downstream: zmq.Socket[Any] | None = None
        if self.downstream is not None:
            self._downstream = self._push(self.downstream.pull_connect, send_timeout_ms, self.downstream.stage_id)
        self._driver = self._push(self.return_connect, 0, DRIVER, hwm=REPLY_HWM)
        # Link emulation (docs/ARCHITECTURE.md, "Link emulation"): the downstream link, or the final stage's
        # return link, through a delay line. Off, the sockets are used as they are and there is no line.
        self.link = stage.link if link is None else link
        final = self._downstream is None  # as the socket it stands for, a reply line drops at once when full
        self._line = None if self.link.is_off else DelayLine(
            self._driver if self._downstream is None else self._downstream, self.link, name=f"link-{stage.stage_id}",
            wait_ms=0 if final else send_timeout_ms, capacity=REPLY_HWM if final else LINE_CAPACITY, seed=stage.index)
        self._heartbeat: threading.Thread | None = None
        self._backlog: list[Inbound] = []  # messages drained but left for the next batch
        self.bound_endpoint = ""

    def _push(self, endpoint: str, timeout_ms: int, peer: str, hwm: int = SEND_HWM) -> zmq.Socket[Any]:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        keep_alive(socket)
        socket.setsockopt(zmq.SNDHWM, hwm)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self._guard.connect_to(socket, peer)
        socket.connect(endpoint)
        return socket

    def bind(self) -> str:
        """Bind the PULL socket (and the metrics endpoint); returns the endpoint bound."""
        try:
            self._pull.bind(self.stage.pull_bind)
        except zmq.ZMQError as exc:
            raise StageError(f"{self.stage.label}: cannot bind pull_bind {self.stage.pull_bind!r}: {exc}") from None
        self.bound_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.curve is None and not is_loopback(self.stage.pull_bind):
            self.log.emit("insecure_bind", stage=self.stage.index, pull=self.stage.pull_bind,
                          warning=_insecure_bind_warning(self.stage))
        if self.stage.metrics_bind:
            try:
                self.metrics.serve(self.stage.metrics_bind)
            except OSError as exc:
                raise StageError(
                    f"{self.stage.label}: cannot serve metrics on {self.stage.metrics_bind!r}: {exc}"
                ) from None
        return self.bound_endpoint

    def stop(self) -> None:
        """Ask the serve loop to finish the message in hand and return (safe in a signal handler)."""
        self._stop.set()

    def serve(self, *, max_seconds: float | None = None) -> None:
        """Run until stopped; a stop request is seen within POLL_MS when idle, or once the batch in
        hand is sent (a send waits at most SEND_TIMEOUT_MS downstream; replies never wait)."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        # The first beat goes on the reply socket, before any reply: the driver learns this
        # incarnation before it reads an answer from it (one connection keeps order).
        with contextlib.suppress(zmq.Again):
            self._driver.send_multipart(encode_reply(self._heartbeat_reply()), flags=zmq.NOBLOCK)
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeat.start()
        if self._line is not None:  # from here on the line's thread owns its socket
            self._line.start()
        self.log.emit(
            "ready",
            stage=self.stage.index,
            pid=os.getpid(),
            layers=[self.stage.layer_start, self.stage.layer_end],
            pull=self.bound_endpoint or self.stage.pull_bind,
            downstream=self.downstream.pull_connect if self.downstream else None,
            **({} if self.link.is_off else {"link": self.link.describe()}),
        )
        try:
            while not self._stop.requested:
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.core.expire()
                self.log.flush_suppressed()
                if self._line is not None:  # answer what the emulated link's socket refused
                    self._line.settle()
                if not self._backlog and not poller.poll(POLL_MS):
                    continue
                self._serve_available()
        finally:
            if self._backlog:  # answered, not dropped: their senders wait for a reply
                self._stop.set()
                self._send_outcomes(self._backlog)
            if self._line is not None:  # delivers what it holds for at most DRAIN_S, drops the rest
                self.log.emit("link_stopped", stage=self.stage.index, **attrs.asdict(self._line.close()))
            self._beating.set()  # from this thread, never from a signal handler
            self._heartbeat.join(2 * self.heartbeat_s + 1)
            self.log.flush_suppressed(force=True)
            self.log.emit("stopped", stage=self.stage.index, counts=self.metrics.counts)
            self.close()

    def close(self) -> None:
        """Close sockets with a short linger so queued replies still leave."""
        for socket in (self._pull, self._downstream, self._driver):
            if socket is not None and not socket.closed:
                socket.close(linger=200)
        self._guard.close()
        if self._owns_context:
            self._context.term()

    def _heartbeat_reply(self) -> Reply:
        return Reply.heartbeat(self.stage.index, now_us(), self.incarnation, _stage_load(self.core))

    def _beat(self) -> None:
        # Its own socket and thread: a stage busy with a long prefill or blocked on a full
        # downstream queue is alive, and the driver must not report it dead.
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)
        keep_alive(socket)
        self._guard.connect_to(socket, DRIVER)
        socket.connect(self.return_connect)
        try:
            # The first beat leaves at once: a driver waiting for readiness need not wait a period.
            while True:
                with contextlib.suppress(zmq.Again):
                    socket.send_multipart(encode_reply(self._heartbeat_reply()), flags=zmq.NOBLOCK)
                if self._on_beat is not None:
                    with contextlib.suppress(OSError):
                        self._on_beat()
                if self._beating.wait(self.heartbeat_s):
                    break
        finally:
            socket.close(linger=0)

    def _serve_available(self) -> None:
        batch, carried = self._backlog, bool(self._backlog)
        lanes = sum(1 for inbound in batch if inbound.message.kind.carries_tokens) + self.stage.lane_count
        # Drain what is queued (up to the lane count) so decode steps of different sessions
        # run as one batch. When other live sessions are likely to send their decode step
        # within moments (the driver answers a batch of tokens back to back), wait up to
        # `batch_window_s` for them: a batched step costs about what a single one does.
        window_ends = time.monotonic() + self.batch_window_s
        while takes_more(batch, lanes):
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # The upstream stage is still sending the pass this message belongs to.
                rest_s = rest_of_pass_s(batch, self.core.clock(), self.rest_of_pass_max_s)
                if rest_s > 0:
                    if not self._pull.poll(max(1, math.ceil(rest_s * 1000))):
                        break
                    continue
                decodes = sum(1 for i in batch if i.message.kind.decodes)
                remaining_ms = (window_ends - time.monotonic()) * 1000
                expected = self.core.decoding_sessions()
                if not (decodes or carried) or decodes >= expected or remaining_ms <= 0:
                    break
                if not self._pull.poll(max(1, round(remaining_ms))):
                    break
                continue
            # zmq.Frame exposes the buffer protocol; its stubs do not say so.
            accepted = self.core.accept(cast("Sequence[Buffer]", frames))
            if isinstance(accepted, Answer):
                self._reply(accepted.reply)
            else:
                batch.append(accepted)
        now, self._backlog = split_batch(batch)
        self._send_outcomes(now)

    def _send_outcomes(self, batch: list[Inbound]) -> None:
        for outcome in self.core.run(batch, lambda: self._stop.requested):
            if isinstance(outcome, Forward):
                self._forward(outcome)
            else:
                self._reply(outcome.reply)

    def _forward(self, outcome: Forward) -> None:
        assert self._downstream is not None and self.downstream is not None
        started = time.perf_counter()
        try:
            if self._line is None:
                self._downstream.send_multipart(encode_message(outcome.message), copy=False)
            else:  # sent by the line's thread when the emulated link delivers it
                self._line.put(encode_message(outcome.message), functools.partial(self._not_accepted, outcome.source))
        except zmq.Again:
            self._not_accepted(outcome.source)
            return
        self.metrics.step("send", time.perf_counter() - started)

    def _not_accepted(self, source: StageMessage) -> None:
        assert self.downstream is not None
        error = StageError(f"downstream stage {self.downstream.stage_id!r} ({self.downstream.pull_connect}) did not "
                           f"accept the message within {self.send_timeout_ms / 1000:g} s")
        self._reply(self.core.fail(source, error).reply)

    def _reply(self, reply: Reply) -> None:
        try:
            if self._line is None or self._downstream is not None:
                self._driver.send_multipart(encode_reply(reply), copy=False)
            else:  # the final stage's emulated link is its return link
                self._line.put(encode_reply(reply), functools.partial(self._dropped, reply))
        except zmq.Again:
            self._dropped(reply)

    def _dropped(self, reply: Reply) -> None:
        self.metrics.error("reply_dropped")
        self.log.emit_limited("reply_dropped", key="no listener", request=reply.request_id, session=reply.session_id,
                              reason="driver return queue full or driver gone")


def _refused(metrics: StageMetrics, log: EventLog, stage_index: int, domain: str, address: str, key: str,
             decision: ZapDecision) -> None:
    """A peer failed the CURVE handshake: count it; log it at most once per address per interval
    (across keys), and the summary of the ones not logged."""
    if not decision.summary:
        metrics.error("handshake_refused")
    if decision.log:
        log.emit("handshake_refused", stage=stage_index, domain=domain, peer=address, key=key or None,
                 reason=decision.text, suppressed=decision.suppressed, keys=decision.keys)


def _insecure_bind_warning(stage: StageConfig) -> str:
    """What a stage listening off loopback without CURVE exposes, and what to do about it."""
    return (f"{stage.label} listens on {stage.pull_bind} without CURVE: anyone who reaches this address can "
            "send it messages (create, steer or stop sessions) and read the activations and tokens on its links; "
            "set [security] curve = true (docs/PROTOCOL.md §10)")


def _check_tensors(model_path: Path, stage: StageConfig, n_layer: int, log: EventLog) -> None:
    """Scan the stage's tensors (model/tensor_check.py); CorruptTensorError for a damaged file."""
    from skippy_zmq.model.tensor_check import check_stage_tensors

    report = check_stage_tensors(model_path, stage.layer_start, stage.layer_end, n_layer)
    log.emit("load_progress", detail=report.summary())


def _load_runtime(model_path: Path, stage: StageConfig, log: EventLog) -> StageRuntimeLike:
    """The stage's layers on the kernel the topology names for it (if it names one) and with its KV
    cache types, each load step logged."""
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    return StageRuntime.load(
        model_path, stage.layer_start, stage.layer_end, ctx_size=stage.ctx_size,
        progress=lambda text: log.emit("load_progress", detail=text), kernel=Kernel.from_environment(stage.kernel),
        cache_type_k=stage.cache_type_k, cache_type_v=stage.cache_type_v)


def run_stage(
    topology: TopologyConfig,
    stage_id: str | int,
    *,
    log: EventLog | None = None,
    ready_file: str | None = None,
    check_tensors: bool = False,
    link: LinkShape | None = None,
) -> int:
    """Load a stage's layers (scanned first with `check_tensors`), serve until SIGTERM/SIGINT, return 0;
    `link` overrides the shape the topology gives the stage's emulated link."""
    from skippy_zmq.model.catalog import resolve_model
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.tokens.tokenizer import eog_ids_of

    stop = StopRequest()
    stop.install()  # before loading: a stop during the load also ends in exit status 0
    stage = topology.stage(stage_id)
    log = log or EventLog(stage.stage_id)
    log.capture_warnings()  # numpy's RuntimeWarnings become JSON events, not raw text
    if ready_file:
        # A file left by a killed predecessor must not mark this (still loading) stage healthy.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)
    started = time.monotonic()
    # Keys are read before the model: a missing or unsafe key file fails in milliseconds.
    curve = CurveSetup.for_stage(topology, stage) if topology.security.curve else None
    model_path = resolve_model(topology.model)
    hparams = ModelHParams.from_gguf(model_path)
    topology.check_model_layers(hparams.n_layer)
    log.emit("loading", stage=stage.index, model=str(model_path), layers=[stage.layer_start, stage.layer_end],
             cache_types=[stage.cache_type_k, stage.cache_type_v])
    if check_tensors or stage.check_tensors:
        _check_tensors(model_path, stage, hparams.n_layer, log)
    runtime = _load_runtime(model_path, stage, log)
    eog_ids: Sequence[int] = sorted(eog_ids_of(model_path)) if topology.is_final(stage) else ()
    # Built on the first constrained session: a stage that never meets one never pays for it.
    grammars = GrammarBook(model_path, eog_ids) if topology.is_final(stage) else None
    rank_head = RankHead.from_file(model_path) if topology.is_final(stage) else None
    touch = (lambda: os.utime(ready_file)) if ready_file else None  # its age tells a supervisor it is alive
    worker = StageWorker(topology, stage, runtime, log=log, eog_ids=eog_ids, grammars=grammars, rank_head=rank_head,
                         stop_request=stop,
                         curve=curve, on_beat=touch, link=link)
    worker.bind()
    log.emit("loaded", seconds=round(time.monotonic() - started, 2))
    if ready_file:
        with open(ready_file, "w") as handle:
            handle.write(f"{stage.stage_id} {worker.bound_endpoint}\n")
    try:
        worker.serve()
    finally:
        # A stop is under way: later signals change nothing. Ignored rather than left to Python,
        # whose shutdown restores the default action of a handled signal, so a second SIGINT or
        # SIGTERM arriving while the interpreter exits would kill it with -2 or -15.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if ready_file:
            with contextlib.suppress(OSError):
                os.unlink(ready_file)
    return 0
