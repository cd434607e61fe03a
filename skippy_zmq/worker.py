"""One stage worker: PULL -> validate -> run layers -> forward downstream or reply to the driver.

The worker owns its sockets. It never dies or hangs on a bad message: anything it rejects is
answered with an `Error` reply to the driver, logged, counted, and dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import zmq

from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.errors import CodecMismatchError, SessionError, SkippyError, StageError, WireError
from skippy_zmq.forwarding import (
    ForwardingConfig,
    StageTiming,
    forward_control,
    forward_message,
    now_us,
)
from skippy_zmq.frames import MAX_ACTIVATION_BYTES, ActivationFrame
from skippy_zmq.runtime.sampling import Sampler, SamplingParams
from skippy_zmq.telemetry import EventLog, StageMetrics
from skippy_zmq.wire import (
    MAX_SIDEBAND_VALUES,
    MAX_TRACE_RECORDS,
    MESSAGE_MAGIC,
    MessageKind,
    Reply,
    ReplyKind,
    StageMessage,
    TraceRecord,
    decode_message,
    encode_message,
    encode_reply,
)

SEND_HWM = 16
"""Messages queued per link before a sender blocks: a slow stage pushes back upstream."""
RECV_HWM = 16
SEND_TIMEOUT_MS = 30_000
"""How long a send may block on a full downstream queue before the message fails by name."""
REPLY_TIMEOUT_MS = 5_000
HEARTBEAT_S = 1.0
BATCH_WINDOW_S = 0.003
DECODING_RECENT_S = 2.0
"""Longest wait for other sessions' decode steps to join a batch (only while some are live)."""
POLL_MS = 100
MAX_FRAME_BYTES = max(MAX_ACTIVATION_BYTES, 4 * MAX_SIDEBAND_VALUES) + 64 * 1024
"""ZMQ_MAXMSGSIZE of every PULL socket. libzmq applies it per frame: no legitimate frame is
larger than one activation payload (or a full sideband); a peer sending more is dropped."""


class StageRuntimeLike(Protocol):
    """What a worker drives: `skippy_zmq.runtime.stage.StageRuntime` or a test double."""

    is_first: bool
    is_last: bool
    ctx_size: int

    def open_session(self, session_id: int) -> None:
        """Start an empty session."""

    def close_session(self, session_id: int) -> None:
        """Free a session's KV cache (unknown ids are a no-op)."""

    def has_session(self, session_id: int) -> bool:
        """True while the session holds KV state."""

    def session_length(self, session_id: int) -> int:
        """Positions held in the session's KV cache."""

    def trim_session(self, session_id: int, n_positions: int) -> None:
        """Keep the first `n_positions` positions."""

    def forward(self, session_id: int, pos_start: int, inputs: np.ndarray) -> npt.NDArray[np.float32]:
        """Run the stage's layers on token ids (stage 0) or hidden rows: (T, n_embd) out."""

    def forward_batch(
        self, session_ids: Sequence[int], positions: Sequence[int], inputs: np.ndarray
    ) -> npt.NDArray[np.float32]:
        """One decode step for several sessions as one batch: (B, n_embd) out."""

    def logits(self, hidden: np.ndarray) -> npt.NDArray[np.float32]:
        """Output norm and head (final stage): (T, n_embd) -> (T, n_vocab)."""


@attrs.define
class _Session:
    session_id: int
    last_used: float
    params: SamplingParams = attrs.Factory(SamplingParams)
    sampler: Sampler | None = None
    history: list[int] = attrs.Factory(list)
    last_decode: float = float("-inf")


@attrs.define
class _Inbound:
    message: StageMessage
    received_at_us: int
    received_mono: float
    bytes_in: int
    started: float = 0.0
    decode_us: int = 0


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
        heartbeat_s: float = HEARTBEAT_S,
        send_timeout_ms: int = SEND_TIMEOUT_MS,
        batch_window_s: float = BATCH_WINDOW_S,
    ) -> None:
        self.topology = topology
        self.stage = stage
        self.runtime = runtime
        self.log = log or EventLog(stage.stage_id)
        self.metrics = StageMetrics(stage.stage_id)
        self.forwarding = ForwardingConfig.from_topology(topology, stage)
        self.upstream = topology.upstream(stage)
        self.downstream = topology.downstream(stage)
        self.is_final = self.downstream is None
        self.eog_ids = tuple(eog_ids)
        self.heartbeat_s = heartbeat_s
        self.send_timeout_ms = send_timeout_ms
        self.batch_window_s = batch_window_s
        self._sessions: dict[int, _Session] = {}
        self._stopping = threading.Event()
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._downstream: zmq.Socket[Any] | None = None
        if self.downstream is not None:
            self._downstream = self._push(self.downstream.pull_connect, send_timeout_ms)
        self._driver = self._push(topology.driver.return_connect, REPLY_TIMEOUT_MS)
        self._heartbeat: threading.Thread | None = None
        self.bound_endpoint = ""

    def _push(self, endpoint: str, timeout_ms: int) -> zmq.Socket[Any]:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        socket.connect(endpoint)
        return socket

    def bind(self) -> str:
        """Bind the PULL socket (and the metrics endpoint); returns the endpoint bound."""
        try:
            self._pull.bind(self.stage.pull_bind)
        except zmq.ZMQError as exc:
            raise StageError(f"{self.stage.label}: cannot bind pull_bind {self.stage.pull_bind!r}: {exc}") from None
        self.bound_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.stage.metrics_bind:
            try:
                self.metrics.serve(self.stage.metrics_bind)
            except OSError as exc:
                raise StageError(
                    f"{self.stage.label}: cannot serve metrics on {self.stage.metrics_bind!r}: {exc}"
                ) from None
        return self.bound_endpoint

    def stop(self) -> None:
        """Ask the serve loop to finish the message in hand and return."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop after the message in hand (exit status 0)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda _signum, _frame: self.stop())

    def serve(self, *, max_seconds: float | None = None) -> None:
        """Run until stopped; every wait is bounded so a stop request is seen within POLL_MS."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeat.start()
        self.log.emit(
            "ready",
            stage=self.stage.index,
            pid=os.getpid(),
            layers=[self.stage.layer_start, self.stage.layer_end],
            pull=self.bound_endpoint or self.stage.pull_bind,
            downstream=self.downstream.pull_connect if self.downstream else None,
        )
        try:
            while not self._stopping.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    break
                self._expire_sessions()
                if not poller.poll(POLL_MS):
                    continue
                self._serve_available()
        finally:
            self._stopping.set()
            self._heartbeat.join(2 * self.heartbeat_s + 1)
            self.log.emit("stopped", stage=self.stage.index, counts=self.metrics.counts)
            self.close()

    def close(self) -> None:
        """Close sockets with a short linger so queued replies still leave."""
        for socket in (self._pull, self._downstream, self._driver):
            if socket is not None and not socket.closed:
                socket.close(linger=200)
        if self._owns_context:
            self._context.term()

    def _beat(self) -> None:
        # Its own socket and thread: a stage busy with a long prefill or blocked on a full
        # downstream queue is alive, and the driver must not report it dead.
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)
        socket.connect(self.topology.driver.return_connect)
        try:
            while not self._stopping.wait(self.heartbeat_s):
                with contextlib.suppress(zmq.Again):
                    socket.send_multipart(encode_reply(Reply.heartbeat(self.stage.index, now_us())), flags=zmq.NOBLOCK)
        finally:
            socket.close(linger=0)

    # --- receiving --------------------------------------------------------------------------

    def _serve_available(self) -> None:
        batch: list[_Inbound] = []
        limit = self.stage.lane_count
        # Drain what is queued (up to the lane count) so decode steps of different sessions
        # run as one batch. When other live sessions are likely to send their decode step
        # within moments (the driver answers a batch of tokens back to back), wait up to
        # `batch_window_s` for them: a batched step costs about what a single one does.
        window_ends = time.monotonic() + self.batch_window_s
        while len(batch) < limit:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                decodes = sum(1 for i in batch if i.message.kind is MessageKind.DECODE_EMBD)
                remaining_ms = (window_ends - time.monotonic()) * 1000
                if decodes == 0 or decodes >= self._decoding_sessions() or remaining_ms <= 0:
                    break
                if not self._pull.poll(max(1, round(remaining_ms))):
                    break
                continue
            inbound = self._accept(frames)
            if inbound is not None:
                batch.append(inbound)
        self._run(batch)

    def _accept(self, frames: list[zmq.Frame]) -> _Inbound | None:
        received_at = now_us()
        received_mono = time.monotonic()
        try:
            message = decode_message(frames)
            self._check_incoming(message)
        except SkippyError as exc:
            self._fail_undecodable(frames, exc)
            return None
        bytes_in = message.activation.wire_nbytes if message.activation is not None else 0
        return _Inbound(message, received_at, received_mono, bytes_in)

    def _check_incoming(self, message: StageMessage) -> None:
        """Checks that need the topology: who may send here, with which codec, range and shape."""
        expected_source = self.upstream.index if self.upstream is not None else -1
        if message.state.source_stage_index != expected_source:
            raise WireError(
                f"message from source_stage_index {message.state.source_stage_index}; this stage "
                f"accepts messages from {expected_source} only"
            )
        if not message.kind.carries_tokens:
            return
        if message.positions.size and not np.array_equal(
            message.positions, np.arange(message.pos_start, message.pos_start + message.token_count)
        ):
            raise WireError(
                f"position sideband must be pos_start..pos_start+token_count-1 "
                f"({message.pos_start}..{message.pos_start + message.token_count - 1}); "
                f"other positions are not supported"
            )
        activation = message.activation
        if self.upstream is None:
            if activation is not None:
                raise WireError("stage 0 embeds token ids; a message from the driver must not carry an activation")
            return
        if activation is None:
            raise WireError(f"{message.kind.name} for a non-first stage must carry an activation frame")
        admitted = self.topology.codec_policy.admits(self.topology.activation_codec, activation.codec)
        if not admitted:
            allowed = ", ".join(
                c.wire_name for c in self.topology.codec_policy.admitted(self.topology.activation_codec)
            )
            raise CodecMismatchError(
                f"stage activation codec mismatch: got {activation.codec.wire_name}, policy "
                f"{self.topology.codec_policy.value} admits {allowed}"
            )
        desc = activation.desc
        if (desc.layer_start, desc.layer_end) != (self.upstream.layer_start, self.upstream.layer_end):
            raise WireError(
                f"activation frame layers {desc.layer_start}..{desc.layer_end} do not match upstream "
                f"stage {self.upstream.index} layers {self.upstream.layer_start}..{self.upstream.layer_end}"
            )
        primary = desc.parts[0]
        if primary.rank != 2 or primary.token_axis != 1:
            raise WireError(
                f"primary activation part must have dims [n_embd, token_count] (rank 2, token_axis 1), "
                f"got dims {list(primary.dims)} token_axis {primary.token_axis}"
            )
        if desc.sequence_count != 1:
            raise WireError(f"activation sequence_count {desc.sequence_count} is not supported; expected 1")
        required = [part.identity for part in desc.parts[1:] if not part.optional]
        if required:
            raise WireError(
                f"activation parts {required} are not OPTIONAL and this stage's runtime cannot use them"
            )

    # --- running ----------------------------------------------------------------------------

    def _run(self, batch: list[_Inbound]) -> None:
        group: list[_Inbound] = []
        for position, inbound in enumerate(batch):
            if self._stopping.is_set():
                # Shutting down: finish the batch in hand, answer the rest instead of running it.
                for rest in [*group, *batch[position:]]:
                    self._fail(rest.message, StageError("stage is shutting down; message not run"))
                return
            message = inbound.message
            is_decode = message.kind is MessageKind.DECODE_EMBD
            if is_decode and all(g.message.session_id != message.session_id for g in group):
                group.append(inbound)
                continue
            self._run_decode_group(group)
            group = [inbound] if is_decode else []
            if not is_decode:
                self._run_one(inbound)
        self._run_decode_group(group)

    def _run_one(self, inbound: _Inbound) -> None:
        message = inbound.message
        self.metrics.message(message.kind.name)
        self._guarded(message, self._compute_one if message.kind.carries_tokens else self._control, inbound)

    def _guarded(self, message: StageMessage, step: Any, *args: Any) -> Any:
        """Run one message's step; any failure becomes an Error reply, never a dead worker."""
        try:
            return step(*args)
        except SkippyError as exc:
            self._fail(message, exc)
        except Exception as exc:  # noqa: BLE001 - a worker never dies on one message
            self._fail(message, exc, internal=True)
        return None

    def _compute_one(self, inbound: _Inbound) -> None:
        message = inbound.message
        inbound.started = time.monotonic()
        session = self._prepare(message)
        inputs = self._inputs(inbound)
        compute_started = time.monotonic()
        hidden = self.runtime.forward(message.session_id, message.pos_start, inputs)
        compute_s = time.monotonic() - compute_started
        self.metrics.tokens(message.token_count)
        if self.is_final:  # only the sampler reads the history (repeat penalty)
            session.history.extend(int(t) for t in message.tokens)
        self._emit(inbound, hidden, compute_s, session)

    def _prepare(self, message: StageMessage) -> _Session:
        """Session lookup and position rules for a prefill chunk or decode step."""
        if message.kind is MessageKind.DECODE_EMBD:
            session = self._session(message.session_id, create=False)
            session.last_decode = session.last_used
            self._rollback(message)
        else:
            # A session is born at its first prefill chunk (or ConfigureGeneration), so stray
            # messages for unknown sessions never hold a lane.
            session = self._session(message.session_id, create=message.pos_start == 0)
            length = self.runtime.session_length(message.session_id)
            if message.pos_start != length:
                raise SessionError(
                    f"prefill chunk starts at pos_start {message.pos_start} but session "
                    f"{message.session_id} holds {length} positions; chunks must be contiguous"
                )
        if message.pos_start + message.token_count > self.runtime.ctx_size:
            raise SessionError(
                f"session {message.session_id}: positions {message.pos_start}.."
                f"{message.pos_start + message.token_count - 1} exceed ctx_size {self.runtime.ctx_size}"
            )
        return session

    def _run_decode_group(self, group: list[_Inbound]) -> None:
        if len(group) <= 1:
            for inbound in group:
                self._run_one(inbound)
            return
        ready: list[tuple[_Inbound, _Session, np.ndarray]] = []
        for inbound in group:
            message = inbound.message
            self.metrics.message(message.kind.name)
            inbound.started = time.monotonic()
            prepared = self._guarded(message, lambda i=inbound: (i, self._prepare(i.message), self._inputs(i)))
            if prepared is not None:
                ready.append(prepared)
        if not ready:
            return
        compute_started = time.monotonic()
        try:
            inputs = np.concatenate([inputs for _, _, inputs in ready], axis=0)
            hidden = self.runtime.forward_batch(
                [i.message.session_id for i, _, _ in ready],
                [i.message.pos_start for i, _, _ in ready],
                inputs,
            )
            # The final stage projects all rows through the output head in one matmul.
            logits = self.runtime.logits(hidden) if self.is_final else None
        except Exception:  # noqa: BLE001 - isolate the failing session: rerun one by one
            # Each decode trims its session back to its own position first, so rows the
            # failed batch may have appended are undone before they run again.
            self.metrics.error("batch_retried_alone")
            for inbound, _, _ in ready:
                self._guarded(inbound.message, self._compute_one, inbound)
            return
        compute_s = time.monotonic() - compute_started
        self.metrics.tokens(len(ready))
        for row, (inbound, session, _) in enumerate(ready):
            if self.is_final:
                session.history.extend(int(t) for t in inbound.message.tokens)
            self._guarded(
                inbound.message,
                self._emit,
                inbound,
                hidden[row : row + 1],
                compute_s,
                session,
                None if logits is None else logits[row],
            )

    def _rollback(self, message: StageMessage) -> None:
        """A decode step carries the authoritative position: trim the session back to it."""
        length = self.runtime.session_length(message.session_id)
        if message.pos_start > length:
            raise SessionError(
                f"decode at pos_start {message.pos_start} but session {message.session_id} holds "
                f"only {length} positions"
            )
        if message.pos_start < length:
            self.runtime.trim_session(message.session_id, message.pos_start)
            del self._sessions[message.session_id].history[message.pos_start :]

    def _inputs(self, inbound: _Inbound) -> np.ndarray:
        message = inbound.message
        if message.activation is None:
            return np.ascontiguousarray(message.tokens, dtype=np.int32)
        started = time.perf_counter()
        frame = message.activation.decode()
        inbound.decode_us = round((time.perf_counter() - started) * 1e6)
        return frame.hidden

    def _emit(
        self,
        inbound: _Inbound,
        hidden: npt.NDArray[np.float32],
        compute_s: float,
        session: _Session,
        logits_row: npt.NDArray[np.float32] | None = None,
    ) -> None:
        message = inbound.message
        queue_us = round((inbound.started - inbound.received_mono) * 1e6)
        if not self.is_final:
            timing = StageTiming(
                received_at_us=inbound.received_at_us,
                queue_us=queue_us,
                decode_us=inbound.decode_us,
                compute_us=round(compute_s * 1e6),
                bytes_in=inbound.bytes_in,
            )
            frame = ActivationFrame.from_hidden(
                hidden,
                producer_stage_index=self.stage.index,
                layer_start=self.stage.layer_start,
                layer_end=self.stage.layer_end,
            )
            forwarded = forward_message(self.forwarding, message, frame, timing)
            self.metrics.step("encode", forwarded.encode_seconds)
            self._send_downstream(forwarded.message)
            return
        if message.kind is MessageKind.PREFILL_EMBD:
            return  # a non-final prefill chunk only fills the KV cache; nobody waits for it
        sample_started = time.monotonic()
        logits = logits_row if logits_row is not None else self.runtime.logits(hidden[-1:])[0]
        if session.sampler is None:
            session.sampler = Sampler(session.params, eog_ids=self.eog_ids)
        token = session.sampler.sample(logits, session.history)
        compute_us = round((compute_s + time.monotonic() - sample_started) * 1e6)
        record = TraceRecord(
            stage_index=self.stage.index,
            received_at_us=inbound.received_at_us,
            sent_at_us=now_us(),
            queue_us=queue_us,
            decode_us=inbound.decode_us,
            compute_us=compute_us,
            encode_us=0,
            bytes_in=inbound.bytes_in,
            bytes_out=0,
        )
        self._answer(message, ReplyKind.PREDICTED_TOKEN, record, predicted_token=token)

    def _control(self, inbound: _Inbound) -> None:
        message = inbound.message
        kind = message.kind
        if kind is MessageKind.CONFIGURE_GENERATION:
            session = self._session(message.session_id, create=True)
            if message.sampling is not None:
                session.params = message.sampling
                session.sampler = Sampler(message.sampling, eog_ids=self.eog_ids)
        elif kind is MessageKind.TRIM_SESSION:
            self._session(message.session_id, create=False)
            self.runtime.trim_session(message.session_id, message.token_count)
            del self._sessions[message.session_id].history[message.token_count :]
        if self.is_final:
            if kind is MessageKind.STOP:
                self._free(message.session_id)
            self._answer(message, ReplyKind.ACK, self._control_record(inbound))
            return
        timing = StageTiming(received_at_us=inbound.received_at_us, bytes_in=inbound.bytes_in)
        try:
            self._send_downstream(forward_control(self.forwarding, message, timing))
        finally:
            if kind is MessageKind.STOP:
                # Free even when the forward failed: this stage's lane must not leak.
                self._free(message.session_id)

    def _control_record(self, inbound: _Inbound) -> TraceRecord:
        return TraceRecord(
            stage_index=self.stage.index,
            received_at_us=inbound.received_at_us,
            sent_at_us=now_us(),
            bytes_in=inbound.bytes_in,
        )

    # --- sessions ---------------------------------------------------------------------------

    def _session(self, session_id: int, *, create: bool) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            if not create:
                raise SessionError(
                    f"session {session_id} is not open on this stage (never started, stopped, "
                    f"or expired after {self.stage.session_ttl_s:g} s idle)"
                )
            if len(self._sessions) >= self.stage.lane_count:
                raise SessionError(
                    f"lane limit reached: {len(self._sessions)} live sessions (lane_count "
                    f"{self.stage.lane_count}); session {session_id} rejected. Stop a session "
                    f"or raise lane_count"
                )
            if not self.runtime.has_session(session_id):
                self.runtime.open_session(session_id)
            session = _Session(session_id, time.monotonic())
            self._sessions[session_id] = session
            self.metrics.sessions(len(self._sessions))
        session.last_used = time.monotonic()
        return session

    def _decoding_sessions(self) -> int:
        """Sessions that ran a decode step lately: the ones worth waiting for in a batch."""
        recent = time.monotonic() - DECODING_RECENT_S
        return sum(1 for session in self._sessions.values() if session.last_decode >= recent)

    def _free(self, session_id: int) -> None:
        self._sessions.pop(session_id, None)
        self.runtime.close_session(session_id)
        self.metrics.sessions(len(self._sessions))

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if now - session.last_used > self.stage.session_ttl_s:
                self._free(session.session_id)
                self.log.emit("session_expired", session=session.session_id, ttl_s=self.stage.session_ttl_s)

    # --- sending ----------------------------------------------------------------------------

    def _send_downstream(self, message: StageMessage) -> None:
        assert self._downstream is not None and self.downstream is not None
        started = time.perf_counter()
        try:
            self._downstream.send_multipart(encode_message(message), copy=False)
        except zmq.Again:
            raise StageError(
                f"downstream stage {self.downstream.stage_id!r} ({self.downstream.pull_connect}) did "
                f"not accept the message within {self.send_timeout_ms / 1000:g} s"
            ) from None
        self.metrics.step("send", time.perf_counter() - started)

    def _answer(self, message: StageMessage, kind: ReplyKind, record: TraceRecord | None, **fields: Any) -> None:
        """Reply to the driver about `message`, with its trace (plus `record`, this stage's)."""
        trace = message.trace if record is None else (*message.trace, record)
        self._reply(
            Reply(
                kind=kind,
                request_id=message.request_id,
                session_id=message.session_id,
                stage_index=self.stage.index,
                answered=message.kind,
                decode_step=message.state.decode_step,
                trace=trace[-MAX_TRACE_RECORDS:],
                **fields,
            )
        )

    def _reply(self, reply: Reply) -> None:
        try:
            self._driver.send_multipart(encode_reply(reply), copy=False)
        except zmq.Again:
            self.log.emit("reply_dropped", request=reply.request_id, session=reply.session_id,
                          reason="driver return queue full or driver gone")

    def _fail(self, message: StageMessage, exc: BaseException, *, internal: bool = False) -> None:
        cause = type(exc).__name__
        self.metrics.error(cause)
        detail = f"internal error {cause}: {exc}" if internal else str(exc)
        self.log.emit("message_failed", request=message.request_id, session=message.session_id,
                      kind=message.kind.name, error=str(exc), cause=cause)
        self._answer(message, ReplyKind.ERROR, None, error=f"{self.stage.label}: {message.label}: {detail}"[:16_000])

    def _fail_undecodable(self, frames: Sequence[zmq.Frame], exc: SkippyError) -> None:
        request_id, session_id, kind = _peek_ids(frames)
        cause = type(exc).__name__
        self.metrics.error(cause)
        self.log.emit("message_rejected", request=request_id, session=session_id, error=str(exc), cause=cause)
        self._reply(
            Reply(
                kind=ReplyKind.ERROR,
                request_id=request_id,
                session_id=session_id,
                stage_index=self.stage.index,
                answered=kind,
                error=f"{self.stage.label}: rejected message (request {request_id} session {session_id}): {exc}"[:16_000],
            )
        )


def _peek_ids(frames: Sequence[Any]) -> tuple[int, int, MessageKind | None]:
    """Best-effort ids of a message that failed validation, so the driver can match the error."""
    with contextlib.suppress(IndexError, TypeError, ValueError):
        head = memoryview(frames[0]).cast("B")
        # The ids sit in the first 32 bytes: a header cut short after them still names them.
        if head.nbytes >= 32 and bytes(head[:4]) == MESSAGE_MAGIC:
            kind_id = int.from_bytes(head[6:8], "little")
            request_id = int.from_bytes(head[16:24], "little")
            session_id = int.from_bytes(head[24:32], "little")
            kind = MessageKind(kind_id) if kind_id in MessageKind._value2member_map_ else None
            return request_id, session_id, kind
    return 0, 0, None


def run_stage(
    topology: TopologyConfig,
    stage_id: str | int,
    *,
    log: EventLog | None = None,
    ready_file: str | None = None,
) -> int:
    """Load a stage's layers, serve until SIGTERM/SIGINT, and return the exit status (0)."""
    from skippy_zmq.runtime.catalog import resolve_model
    from skippy_zmq.runtime.model import ModelHParams
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.runtime.tokenizer import Tokenizer

    stage = topology.stage(stage_id)
    log = log or EventLog(stage.stage_id)
    if ready_file:
        # A file left by a killed predecessor must not mark this (still loading) stage healthy.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)
    started = time.monotonic()
    model_path = resolve_model(topology.model)
    hparams = ModelHParams.from_gguf(model_path)
    topology.check_model_layers(hparams.n_layer)
    log.emit("loading", stage=stage.index, model=str(model_path), layers=[stage.layer_start, stage.layer_end])
    runtime = StageRuntime.load(
        model_path,
        stage.layer_start,
        stage.layer_end,
        ctx_size=stage.ctx_size,
        progress=lambda text: log.emit("load_progress", detail=text),
    )
    eog_ids: Sequence[int] = ()
    if topology.downstream(stage) is None:
        eog_ids = sorted(Tokenizer.from_gguf(model_path).eog_ids)
    worker = StageWorker(topology, stage, runtime, log=log, eog_ids=eog_ids)
    worker.install_signal_handlers()
    worker.bind()
    log.emit("loaded", seconds=round(time.monotonic() - started, 2))
    if ready_file:
        with open(ready_file, "w") as handle:
            handle.write(f"{stage.stage_id} {worker.bound_endpoint}\n")
    try:
        worker.serve()
    finally:
        if ready_file:
            with contextlib.suppress(OSError):
                os.unlink(ready_file)
    return 0
