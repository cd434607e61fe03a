"""The driver's transport: a PUSH to stage 0 and a PULL for every stage's replies, driving a
`Scheduler`.

Per session (docs/PROTOCOL.md §6): ConfigureGeneration -> prefill chunks -> decode loop -> Stop.
What to send and when, deadlines and liveness live in `scheduler.py`, what a token means in
`generation.py`; this module only encodes, sends, polls, receives and decodes.
"""

from __future__ import annotations

import contextlib
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from skippy_zmq.config import TopologyConfig
from skippy_zmq.defaults import REST_OF_PASS_S
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.lanes import Action, Report, Send, Text
from skippy_zmq.driver.scheduler import PipelineShape, Scheduler
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.watch import LinkTrouble
from skippy_zmq.errors import ConfigError, RequestError, SkippyError, StageTimeout, WireError
from skippy_zmq.security.admission import ZapDecision
from skippy_zmq.security.curve import RETURN_DOMAIN, CurveGuard, CurveSetup
from skippy_zmq.tcp import keep_alive
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import encode_message
from skippy_zmq.wire.replies import (
    MAX_ERROR_TEXT_BYTES,
    MAX_EXTRAS_BYTES,
    MAX_PREDICTED_TOKENS,
    REPLY_HEADER_BYTES,
    decode_reply,
)
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TRACE_BYTES, now_us

MAX_REPLY_BYTES = (REPLY_HEADER_BYTES + 4 * MAX_PREDICTED_TOKENS + MAX_ERROR_TEXT_BYTES
                   + MAX_TRACE_RECORDS * TRACE_BYTES + MAX_EXTRAS_BYTES)
"""ZMQ_MAXMSGSIZE of the driver's return socket (docs/PROTOCOL.md §2.5: set on every PULL)."""
READY_POLL_S = 0.2
READY_SAY_FIRST_S = 2.0
READY_SAY_EVERY_S = 10.0
LINK_NEWS: dict[int, LinkTrouble | None] = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: None,
    # The stage hung up mid-handshake: what a CURVE client whose server key is wrong sees.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: LinkTrouble.KEY,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: LinkTrouble.PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: LinkTrouble.AUTH,  # the stage's ZAP handler refused the driver (value: status)
    zmq.EVENT_DISCONNECTED: LinkTrouble.LOST,
    zmq.EVENT_CONNECT_RETRIED: LinkTrouble.REFUSED,
}
"""What the stage-0 PUSH's socket monitor events mean for the link (driver/watch.py `StageWatch.link`)."""

TextCallback = Callable[[int, str], None]
"""Receives (prompt index, new text) as a session's text grows."""
EventHandler = Callable[[Report], None]
"""Receives the scheduler's Text and Finished actions as the transport carries them out."""


class PipelineTransport:
    """Talks to running workers of a topology: stage 0 PULL in, driver return PULL out."""

    def __init__(
        self,
        topology: TopologyConfig,
        tokenizer: Tokenizer,
        settings: SchedulerSettings | None = None,
        *,
        context: zmq.Context[Any] | None = None,
        curve: CurveSetup | None = None,
        on_refused: Callable[[str, str, str, ZapDecision], None] | None = None,
        watch_link: bool = False,
    ) -> None:
        """`settings` go to the scheduler whole (a batch run's, `SchedulerSettings()`, when not given).
        `watch_link`: monitor the stage-0 PUSH (`link_monitor`, read by `read_link`)."""
        self.scheduler = Scheduler(PipelineShape.from_topology(topology), tokenizer, settings)
        self.topology = topology
        self.tokenizer = tokenizer
        self.rest_of_pass_max_s = REST_OF_PASS_S  # how long `receive` waits for the rest of a pass's replies
        self._owns_context = context is None
        self._context = context or zmq.Context()
        if curve is None and topology.security.curve:
            curve = CurveSetup.for_driver(topology)
        self.curve = curve
        self.handshakes_refused = 0
        self._on_refused = on_refused
        self._guard = CurveGuard(self._context, curve, self._refused)
        self._returns = self._context.socket(zmq.PULL)
        self._returns.setsockopt(zmq.LINGER, 0)
        self._returns.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        self._stage0 = self._context.socket(zmq.PUSH)
        keep_alive(self._returns)
        keep_alive(self._stage0)
        self.link_monitor: zmq.Socket[Any] | None = None
        try:
            self._guard.serve(self._returns, RETURN_DOMAIN)
            try:
                self._returns.bind(topology.driver.return_bind)
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"{topology.source}: cannot bind [driver] return_bind {topology.driver.return_bind!r}: {exc}"
                ) from None
            self._stage0.setsockopt(zmq.LINGER, 0)
            self._stage0.setsockopt(zmq.SNDHWM, 64)
            self._stage0.setsockopt(zmq.SNDTIMEO, max(1, round(self.scheduler.send_timeout_s * 1000)))
            self._guard.connect_to(self._stage0, topology.stages[0].stage_id)
            if watch_link:  # before connect: the first handshake's news too
                self.link_monitor = self._stage0.get_monitor_socket(sum(LINK_NEWS))  # distinct bits
            self._stage0.connect(topology.stages[0].pull_connect)
        except BaseException:
            self._returns.close(linger=0)
            self._close_link_monitor()
            self._stage0.close(linger=0)
            self._guard.close()
            if self._owns_context:
                self._context.term()
            raise

    def _refused(self, domain: str, address: str, key: str, decision: ZapDecision) -> None:
        if not decision.summary:  # a summary repeats refusals already counted
            self.handshakes_refused += 1
        if domain == RETURN_DOMAIN:  # a stage with a key the driver does not know: /health says so
            self.scheduler.watch.return_refused(address)
        if self._on_refused is not None:
            self._on_refused(domain, address, key, decision)

    def close(self) -> None:
        """Stop the prompt cache's sessions, then close both sockets (the stage-0 PUSH lingers 500 ms
        so queued Stops still leave)."""
        with contextlib.suppress(zmq.ZMQError):  # best effort: the stages' TTL frees what does not leave
            self.perform(self.scheduler.prompts.drop(), None)
        self._returns.close(linger=0)
        self._close_link_monitor()
        self._stage0.close(linger=500)  # let queued Stops leave
        self._guard.close()
        if self._owns_context:
            self._context.term()

    def read_link(self, now: float) -> None:
        """Hand what libzmq said of the link to stage 0 since the last call to the scheduler's watch."""
        monitor = self.link_monitor
        while monitor is not None and monitor.poll(0):
            news = recv_monitor_message(monitor)
            if news["event"] not in LINK_NEWS:
                continue
            trouble, value = LINK_NEWS[news["event"]], int(news["value"])
            mismatch = trouble is LinkTrouble.PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            if mismatch or (trouble is LinkTrouble.KEY and self.curve is None):
                # A plain driver that stage 0 hangs up on mid-handshake: the stage wants CURVE.
                trouble = LinkTrouble.MECHANISM
            self.scheduler.watch.link(0, trouble, now, value)

    def _close_link_monitor(self) -> None:
        if self.link_monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._stage0.disable_monitor()
            self.link_monitor.close(linger=0)
            self.link_monitor = None

    def __enter__(self) -> PipelineTransport:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 60.0, progress: Callable[[str], None] | None = None) -> None:
        """Wait until every stage has sent a heartbeat; raise StageTimeout naming the silent ones.
        `progress` hears which stages it still waits for, after 2 s and then every 10 s."""
        started = time.monotonic()
        deadline = started + timeout_s
        say_at = started + READY_SAY_FIRST_S
        while True:
            missing = self.scheduler.liveness.missing_since(started - 0.001)
            if not missing:
                return
            if progress is not None and time.monotonic() >= say_at:
                say_at += READY_SAY_EVERY_S
                progress(f"waiting for heartbeats from {', '.join(missing)} "
                         f"({deadline - time.monotonic():.0f} s left of --ready-timeout {timeout_s:g} s)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(missing)
                raise StageTimeout(f"pipeline not ready after {timeout_s:.1f} s: no heartbeat from {names}")
            self.receive(min(remaining, READY_POLL_S), None)

    @property
    def max_sessions(self) -> int:
        """Sessions in flight at once: the smallest lane count of the pipeline."""
        return self.scheduler.shape.max_sessions

    @property
    def ctx_size(self) -> int:
        """Positions a session may hold: the smallest context of the pipeline."""
        return self.scheduler.shape.ctx_size

    def generate(
        self, requests: Sequence[GenerationRequest], on_text: TextCallback | None = None
    ) -> list[GenerationResult]:
        """Run the requests as concurrent sessions (at most `max_sessions` at a time, the rest
        queued); returns results in request order. A failed session carries its error text in
        `result.error`; the others go on."""
        sessions = [self.scheduler.submit(request, index=index) for index, request in enumerate(requests)]

        def on_event(action: Report) -> None:
            if isinstance(action, Text) and on_text is not None:
                on_text(action.session.index, action.text)

        try:
            while True:
                # Replies already queued count before deadlines and silence are judged: a driver
                # that was itself stalled must not take its own delay for a silent stage.
                self.receive(0.0, on_event)
                self.perform(self.scheduler.tick(time.monotonic()), on_event)
                if all(session.done for session in sessions):
                    break
                self.receive(self.scheduler.poll_timeout(time.monotonic()), on_event)
        finally:
            # Interrupted or not: no session of ours may keep a lane on any stage.
            for session in sessions:
                self.perform(self.scheduler.cancel(session, time.monotonic()), None)
        return [session.result for session in sessions]

    @property
    def returns(self) -> zmq.Socket[Any]:
        """The PULL socket replies arrive on (for a transport that polls more than it)."""
        return self._returns

    def perform(self, actions: Sequence[Action], on_event: EventHandler | None) -> None:
        """Carry out the scheduler's actions in order, reporting every send's outcome; Text and
        Finished actions go to `on_event`."""
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if not isinstance(action, Send):
                if on_event is not None:
                    on_event(action)
            elif self.scheduler.wants(action):
                flags = 0 if action.block else zmq.NOBLOCK
                try:
                    frames = encode_message(action.message)
                except (SkippyError, struct.error, OverflowError, ValueError) as exc:
                    error = RequestError(f"session {action.session.session_id}: {action.message.label} cannot be "
                                         f"encoded: {exc}")
                    queue.extend(self.scheduler.unsendable(action, error, time.monotonic()))
                    continue
                try:
                    self._stage0.send_multipart(frames, copy=False, flags=flags)
                except zmq.Again:
                    queue.extend(self.scheduler.refused(action, time.monotonic()))
                else:
                    self.scheduler.sent(action, time.monotonic())

    def receive(self, timeout_s: float, on_event: EventHandler | None) -> None:
        """Wait up to `timeout_s` for replies, then hand every queued one to the scheduler. While
        the newest reply says more of its pass follow (PASS_CONTINUES), wait for them too, at most
        `rest_of_pass_max_s` after it: the tokens of one pass then start the next decode step together
        instead of the first of them alone (docs/PROTOCOL.md §6)."""
        if not self._returns.poll(round(timeout_s * 1000)):
            return
        rest_until = 0.0  # while in the future, the newest reply's pass is still arriving
        while True:
            try:
                frames = self._returns.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                wait_s = rest_until - time.monotonic()
                if wait_s > 0 and self._returns.poll(max(1, math.ceil(wait_s * 1000))):
                    continue
                return
            received_us = now_us()
            try:
                reply = decode_reply([frame.buffer for frame in frames])
            except WireError:
                continue  # a corrupt reply cannot be matched to a session; its deadline will tell
            if not reply.is_heartbeat:  # a stage's beat comes on a socket of its own, between anything
                rest_until = time.monotonic() + self.rest_of_pass_max_s if reply.pass_continues else 0.0
            self.perform(self.scheduler.on_reply(reply, time.monotonic(), received_us), on_event)


