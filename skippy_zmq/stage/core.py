"""The socket-free core of a stage: admission, sessions, positions, compute, sampling, control.

`StageCore` takes received messages and returns outcomes: a message to forward downstream or a
reply for the driver. `worker.py` owns the sockets and only moves bytes; everything a stage
decides lives here and is tested in-process (docs/PROTOCOL.md §5).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.defaults import REST_OF_PASS_S
from skippy_zmq.errors import (
    CodecMismatchError,
    DriverReplacedError,
    FrameError,
    LaneLimitError,
    LimitError,
    NonFiniteLogits,
    SessionError,
    SkippyError,
    StageError,
    WireError,
    check_rows,
)
from skippy_zmq.stage.drivers import describe
from skippy_zmq.stage.final import FinalAnswer, FinalOutput
from skippy_zmq.stage.forwarding import ForwardingConfig, StageTiming, forward_control, forward_message
from skippy_zmq.stage.sessions import SessionTable, StageRuntimeLike, StageSession
from skippy_zmq.telemetry import EventLog, StageMetrics
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.pooling import RankHead
from skippy_zmq.wire.frames import MAX_ACTIVATION_BYTES, ActivationFrame
from skippy_zmq.wire.messages import MessageKind, StageMessage, decode_message, peek_ids
from skippy_zmq.wire.replies import ErrorCause, Reply, ReplyKind, clip_error_text
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TraceRecord, now_us

if TYPE_CHECKING:
    from skippy_zmq.tokens.exp_sum import RowSum
    from skippy_zmq.wire.codecs import Buffer

F32: TypeAlias = npt.NDArray[np.float32]


@attrs.define
class Inbound:
    """A validated message waiting to run, with what was measured when it arrived."""

    message: StageMessage
    received_at_us: int
    received_mono: float
    bytes_in: int
    started: float = 0.0
    decode_us: int = 0

    def timing(self, compute_s: float) -> StageTiming:
        """What this stage measured for the message, for its trace record."""
        return StageTiming(
            received_at_us=self.received_at_us,
            queue_us=round((self.started - self.received_mono) * 1e6),
            decode_us=self.decode_us,
            compute_us=round(compute_s * 1e6),
            bytes_in=self.bytes_in,
        )


@attrs.frozen
class Forward:
    """Send `message` downstream; a failed send is answered as a failure of `source`."""

    message: StageMessage
    source: StageMessage


@attrs.frozen
class Answer:
    """Send `reply` to the driver."""

    reply: Reply


Outcome: TypeAlias = Forward | Answer


# --- admission --------------------------------------------------------------------------------


def check_incoming(topology: TopologyConfig, stage: StageConfig, message: StageMessage) -> None:
    """Checks that need the topology: who may send here, with which codec, range and shape (§5)."""
    if message.request_id == 0:  # reserved: an Ack for request 0 is a heartbeat (§1, §2.4)
        raise WireError("request_id 0 is reserved for heartbeats; a driver numbers its requests from 1")
    upstream = topology.upstream(stage)
    expected_source = upstream.index if upstream is not None else -1
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
    if upstream is None:
        if activation is not None:
            raise WireError("stage 0 embeds token ids; a message from the driver must not carry an activation")
        return
    if activation is None:
        raise WireError(f"{message.kind.name} for a non-first stage must carry an activation frame")
    policy, codec = topology.codec_policy, topology.activation_codec
    if not policy.admits(codec, activation.codec):
        allowed = ", ".join(c.wire_name for c in policy.admitted(codec))
        raise CodecMismatchError(
            f"stage activation codec mismatch: got {activation.codec.wire_name}, policy "
            f"{policy.value} admits {allowed}"
        )
    desc = activation.desc
    if (desc.layer_start, desc.layer_end) != (upstream.layer_start, upstream.layer_end):
        raise WireError(
            f"activation frame layers {desc.layer_start}..{desc.layer_end} do not match upstream "
            f"stage {upstream.index} layers {upstream.layer_start}..{upstream.layer_end}"
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
        raise WireError(f"activation parts {required} are not OPTIONAL and this stage's runtime cannot use them")


def check_fits(message: StageMessage, *, is_final: bool, ctx_size: int, n_embd: int) -> None:
    """What this stage would refuse after running its layers, refused before: a trace that
    forwarding would take past its limit, positions past the context, an output activation
    frame over the size limit (docs/PROTOCOL.md §2.5, §5)."""
    if not is_final and len(message.trace) >= MAX_TRACE_RECORDS:
        raise LimitError(
            f"trace has {len(message.trace)} records; forwarding adds this stage's, which would pass "
            f"the limit of {MAX_TRACE_RECORDS}"
        )
    if not message.kind.carries_tokens:
        return
    if message.pos_start + message.token_count > ctx_size:
        # The runtime's own words (check_step): the session can hold no more than ctx_size.
        raise SessionError(
            f"session {message.session_id}: {message.pos_start} + {message.token_count} positions exceed "
            f"the context size {ctx_size}"
        )
    frame_bytes = message.token_count * n_embd * 4  # (T, n_embd) float32 out
    if not is_final and frame_bytes > MAX_ACTIVATION_BYTES:
        raise LimitError(
            f"{message.token_count} tokens make a {frame_bytes}-byte activation frame (n_embd {n_embd}); "
            f"the limit is {MAX_ACTIVATION_BYTES} bytes: send shorter prefill chunks"
        )


# --- the core ---------------------------------------------------------------------------------


Handler: TypeAlias = Callable[["StageCore", Inbound], list[Outcome]]


class ErrorReplies:
    """A stage's Error replies: every failure or rejection is counted by cause, logged (rate-limited)
    and answered naming the stage, the request and the session."""

    def __init__(self, stage: StageConfig, log: EventLog, metrics: StageMetrics) -> None:
        self.stage = stage
        self.log = log
        self.metrics = metrics

    def fail(self, message: StageMessage, exc: BaseException, *, internal: bool = False) -> Answer:
        """Count, log and answer the failure of one message with an Error reply naming it."""
        cause = type(exc).__name__
        self.metrics.error(cause)
        if isinstance(exc, NonFiniteLogits):
            self.metrics.nonfinite_logits()
        detail = f"internal error {cause}: {exc}" if internal else str(exc)
        self.log.emit_limited(
            "message_failed", request=message.request_id, session=message.session_id,
            kind=message.kind.name, error=str(exc), cause=cause,
        )
        text = clip_error_text(f"{self.stage.label}: {message.label}: {detail}")
        return _answer(self.stage.index, message, ReplyKind.ERROR, None, error=text, predicted_token=_cause(exc))

    def reject(self, frames: Sequence[Buffer], exc: SkippyError) -> Answer:
        """Answer a message that failed to decode or to be admitted, with the ids its header names."""
        request_id, session_id, kind = peek_ids(frames)
        cause = type(exc).__name__
        self.metrics.error(cause)
        self.log.emit_limited("message_rejected", request=request_id, session=session_id, error=str(exc),
                              cause=cause)
        text = f"{self.stage.label}: rejected message (request {request_id} session {session_id}): {exc}"
        reply = Reply(kind=ReplyKind.ERROR, request_id=request_id, session_id=session_id,
                      stage_index=self.stage.index, answered=kind, error=clip_error_text(text),
                      predicted_token=_cause(exc))
        return Answer(reply)


_CAUSES: dict[type[BaseException], ErrorCause] = {
    LaneLimitError: ErrorCause.LANE_LIMIT,
    DriverReplacedError: ErrorCause.DRIVER_REPLACED,
}
"""The failures an Error reply names by cause code (docs/PROTOCOL.md §2.4); others are UNSPECIFIED."""


def _cause(exc: BaseException) -> int:
    return int(_CAUSES.get(type(exc), ErrorCause.UNSPECIFIED))


DRAIN_MESSAGES_PER_LANE = 4
"""A batch drains at most this many queued messages per lane in all (control messages included)."""


def takes_more(batch: Sequence[Inbound], lanes: int) -> bool:
    """Whether a stage should drain another queued message into `batch`: while it holds fewer
    compute messages (prefill chunks, decode steps) than `lanes`. A session's control messages
    (its ConfigureGeneration ahead of its prompt) count only toward a bound of
    `DRAIN_MESSAGES_PER_LANE` x lanes, so a wave of new prompts shares one pass instead of
    filling half the batch with their configurations."""
    computes = sum(1 for inbound in batch if inbound.message.kind.carries_tokens)
    return computes < lanes and len(batch) < DRAIN_MESSAGES_PER_LANE * lanes


def rest_of_pass_s(batch: Sequence[Inbound], now_mono: float, max_s: float = REST_OF_PASS_S) -> float:
    """How long to wait for the next message of the pass the newest message in `batch` belongs to:
    0 unless that message says more of its pass follow (PASS_CONTINUES), at most `max_s` after it
    arrived. Without it, a stage that finds only the first of its upstream's messages
    queued would run that one alone and the others in a second pass (docs/PROTOCOL.md §5)."""
    if not batch or not batch[-1].message.pass_continues:
        return 0.0
    return max(0.0, batch[-1].received_mono + max_s - now_mono)


def _marked_as_one_pass(outcomes: list[Outcome]) -> list[Outcome]:
    """A pass's outcomes with PASS_CONTINUES on every message sent downstream but the last, and on
    every reply to the driver but the last (the final stage's tokens of one pass)."""
    last_forward = max((i for i, o in enumerate(outcomes) if isinstance(o, Forward)), default=-1)
    last_answer = max((i for i, o in enumerate(outcomes) if isinstance(o, Answer)), default=-1)
    marked: list[Outcome] = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, Forward) and i < last_forward:
            marked.append(Forward(outcome.message.with_pass_continues(True), outcome.source))
        elif isinstance(outcome, Answer) and i < last_answer:
            marked.append(Answer(attrs.evolve(outcome.reply, pass_continues=True)))
        else:
            marked.append(outcome)
    return marked


PREFILL_ROWS_PER_PASS = 64
"""Prompt rows a pass takes beyond its first prefill chunk; the other chunks wait for the next pass."""


def split_batch(batch: Sequence[Inbound], prefill_rows: int = PREFILL_ROWS_PER_PASS
                ) -> tuple[list[Inbound], list[Inbound]]:
    """The messages to run now and those to keep for the next batch. A session's second
    compute message, and everything of that session after it, waits for the next batch;
    other sessions' messages behind it still run now. A long prompt's chunks then take one
    pass each, shared with the running streams' decode steps, instead of running back to
    back ahead of them. So does a prefill chunk that would take the pass's prompt rows past
    `prefill_rows` (the first chunk always runs): a wave of new prompts is spread over a few
    passes, so that the first of them get their first token sooner (prefill is bound by
    compute, so the sum of the passes costs the same) and the running streams are not held up
    by one long pass. Decode steps always run now. Each session's messages keep their order."""
    now: list[Inbound] = []
    later: list[Inbound] = []
    computing: set[int] = set()
    deferred: set[int] = set()
    rows = 0
    for inbound in batch:
        message = inbound.message
        session = message.session_id
        prompt = message.kind.carries_tokens and not message.kind.decodes
        over = prompt and rows > 0 and rows + message.token_count > prefill_rows
        if session in deferred or (message.kind.carries_tokens and session in computing) or over:
            deferred.add(session)
            later.append(inbound)
            continue
        if message.kind.carries_tokens:
            computing.add(session)
        if prompt:
            rows += message.token_count
        now.append(inbound)
    return now, later


class StageCore:
    """Everything a stage decides, without sockets: messages in, outcomes out."""

    def __init__(self, topology: TopologyConfig, stage: StageConfig, runtime: StageRuntimeLike, *,
                 log: EventLog | None = None, metrics: StageMetrics | None = None, eog_ids: Sequence[int] = (),
                 grammars: GrammarBook | None = None, rank_head: RankHead | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.topology = topology
        self.stage = stage
        self.runtime = runtime
        self.is_final = topology.is_final(stage)
        if self.is_final != runtime.is_last:
            role = "final" if self.is_final else "non-final"
            raise StageError(f"{stage.label}: the topology makes it the {role} stage but its runtime "
                             f"{'lacks' if self.is_final else 'holds'} the output head")
        self.log = log or EventLog(stage.stage_id)
        self.metrics = metrics or StageMetrics(stage.stage_id)
        self.forwarding = ForwardingConfig.from_topology(topology, stage)
        self.sessions = SessionTable(stage, runtime, self.metrics, eog_ids)
        self.final = FinalOutput(self.sessions, runtime, grammars, rank_head)
        self.errors = ErrorReplies(stage, self.log, self.metrics)
        self.eog_ids = tuple(eog_ids)
        self.clock = clock

    # --- receiving ------------------------------------------------------------------------

    def accept(self, frames: Sequence[Buffer], received_at_us: int | None = None) -> Inbound | Answer:
        """Decode and admit one received message, or answer why it was rejected."""
        received_at = now_us() if received_at_us is None else received_at_us
        received_mono = self.clock()
        try:
            message = decode_message(frames)
            check_incoming(self.topology, self.stage, message)
            check_fits(message, is_final=self.is_final, ctx_size=self.runtime.ctx_size,
                       n_embd=self.runtime.hparams.n_embd)
            restart = self.sessions.see_driver(message.state.driver_incarnation)
        except SkippyError as exc:
            return self.errors.reject(frames, exc)
        if restart is not None:
            self.log.emit("driver_restarted", driver=restart.driver_id, replaced=describe(restart.replaced),
                          current=describe(restart.current), sessions_freed=len(restart.freed))
        bytes_in = message.activation.wire_nbytes if message.activation is not None else 0
        return Inbound(message, received_at, received_mono, bytes_in)

    def expire(self) -> list[int]:
        """Free sessions idle past their TTL (called between batches); returns their ids."""
        now = self.clock()
        expired = self.sessions.expire(now)
        for session in expired:
            self.log.emit("session_expired", session=session.session_id, phase=session.phase,
                          ttl_s=self.sessions.ttl(session))
        if (released := self.sessions.release_idle_caches(now)) is not None:
            self.log.emit("caches_released", slots=released)
        return [session.session_id for session in expired]

    def decoding_sessions(self) -> int:
        """Sessions that decoded lately: how many decode steps a batch may wait for."""
        return self.sessions.decoding(self.clock())

    # --- running --------------------------------------------------------------------------

    def run(self, batch: Sequence[Inbound], stopping: Callable[[], bool] = lambda: False) -> Iterator[Outcome]:
        """Run a batch, each session's messages in arrival order: prefill chunks and decode steps
        of distinct sessions together in one pass over the weights, a control message of a
        session with nothing in that pass at once (so a new session's ConfigureGeneration may
        take a lane ahead of an earlier prompt). Yields the outcomes of each message, or of each
        pass, as soon as they are known so the worker can send them at once."""
        group: list[Inbound] = []
        self.sessions.begin_batch(decodes=any(i.message.kind.decodes for i in batch))
        for position, inbound in enumerate(batch):
            if stopping():
                # Shutting down: the batch in hand is answered instead of run.
                for rest in [*group, *batch[position:]]:
                    yield self.fail(rest.message, StageError("stage is shutting down; message not run"))
                return
            message = inbound.message
            pending = any(g.message.session_id == message.session_id for g in group)
            if message.kind.carries_tokens:
                if not pending:
                    group.append(inbound)
                    continue
                # A session's second compute message: what came before runs first.
                yield from self._run_compute(group)
                group = [inbound]
                continue
            # A control message acts on its own session only, so it waits only for that
            # session's compute in the group: each new session's ConfigureGeneration ahead of
            # its prompt then no longer cuts the other prompts' shared pass into one per prompt.
            if pending:
                yield from self._run_compute(group)
                group = []
            yield from self._run_one(inbound)
        yield from self._run_compute(group)

    def _run_one(self, inbound: Inbound) -> list[Outcome]:
        self.metrics.message(inbound.message.kind.name)
        return self._guarded(inbound.message, _HANDLERS[inbound.message.kind], self, inbound)

    def _guarded(self, message: StageMessage, step: Callable[..., list[Outcome]], *args: Any) -> list[Outcome]:
        """Run one message's step; any failure becomes an Error reply, never a dead stage."""
        try:
            return step(*args)
        except SkippyError as exc:
            return [self.fail(message, exc)]
        except Exception as exc:  # noqa: BLE001 - a stage never dies on one message
            return [self.fail(message, exc, internal=True)]

    def _compute(self, inbound: Inbound) -> list[Outcome]:
        message = inbound.message
        inbound.started = self.clock()
        session = self.sessions.prepare(message, inbound.started)
        inputs = self._inputs(inbound)
        compute_started = time.perf_counter()
        hidden = self.runtime.forward(message.session_id, message.pos_start, inputs)
        compute_s = time.perf_counter() - compute_started
        self.metrics.tokens(message.token_count)
        if self.is_final:  # only the sampler reads the history (repeat penalty)
            self.sessions.record(session, message)
        return self._emit(inbound, hidden, compute_s, session, None)

    def _run_compute(self, group: list[Inbound]) -> list[Outcome]:
        """Prefill chunks and decode steps of distinct sessions in one pass; each message is
        checked alone first so a bad one fails alone, and a pass that fails is rerun message
        by message."""
        if len(group) <= 1:
            return [outcome for inbound in group for outcome in self._run_one(inbound)]
        outcomes: list[Outcome] = []
        ready: list[tuple[Inbound, StageSession, npt.NDArray[Any]]] = []
        for inbound in group:
            self.metrics.message(inbound.message.kind.name)
            inbound.started = self.clock()
            try:
                ready.append((inbound, self.sessions.prepare(inbound.message, inbound.started), self._inputs(inbound)))
            except Exception as exc:  # noqa: BLE001 - this message fails alone
                outcomes.append(self.fail(inbound.message, exc, internal=not isinstance(exc, SkippyError)))
        if not ready:
            return outcomes
        messages = [inbound.message for inbound, _, _ in ready]
        counts = [m.token_count for m in messages]
        ends = np.cumsum(counts)  # row after each message's last row
        compute_started = time.perf_counter()
        try:
            hidden = self.runtime.forward_many(
                [m.session_id for m in messages], [m.pos_start for m in messages], counts,
                np.concatenate([inputs for _, _, inputs in ready], axis=0),
            )  # (sum(counts), n_embd)
            logits, logits_rows_of, sums = _project(self.final, messages, [session for _, session, _ in ready], ends,
                                                    hidden) if self.is_final else (None, {}, {})
        except Exception:  # noqa: BLE001 - isolate the failing session: rerun one by one
            self.metrics.error("batch_retried_alone")
            for inbound, session, _ in ready:
                # Undo whatever the failed pass appended before the message runs again.
                if self.runtime.session_length(session.session_id) > inbound.message.pos_start:
                    self.sessions.trim(session, inbound.message.pos_start)
                outcomes.extend(self._guarded(inbound.message, self._compute, inbound))
            return outcomes
        compute_s = time.perf_counter() - compute_started
        self.metrics.tokens(int(ends[-1]))
        for index, (inbound, session, _) in enumerate(ready):
            if self.is_final:
                self.sessions.record(session, inbound.message)
            rows = hidden[ends[index] - counts[index] : ends[index]]
            row_logits, summed = _message_logits(inbound.message, logits, logits_rows_of.get(index), sums)
            outcomes.extend(self._guarded(inbound.message, self._emit, inbound, rows, compute_s, session, row_logits,
                                          summed))
        return _marked_as_one_pass(outcomes)

    def _inputs(self, inbound: Inbound) -> npt.NDArray[Any]:
        message = inbound.message
        if message.activation is None:
            return np.ascontiguousarray(message.tokens, dtype=np.int32)
        started = time.perf_counter()
        frame = message.activation.decode()
        inbound.decode_us = round((time.perf_counter() - started) * 1e6)
        _check_finite(frame.hidden, message.state.source_stage_index)
        return frame.hidden

    def _emit(
        self, inbound: Inbound, hidden: F32, compute_s: float, session: StageSession, logits: F32 | None,
        summed: tuple[RowSum | None, ...] = (),
    ) -> list[Outcome]:
        """The outcome of a compute message whose layers ran: `hidden` (T, n_embd) forwarded, or on the final
        stage answered from `logits` when the pass projected them (its last row's (n_vocab,), a verification's
        (T, n_vocab)) with their exp-sums `summed` (one a row, None where not computed)."""
        message = inbound.message
        timing = inbound.timing(compute_s)
        if not self.is_final:
            stage = self.stage
            frame = ActivationFrame.from_hidden(
                hidden, producer_stage_index=stage.index, layer_start=stage.layer_start, layer_end=stage.layer_end
            )
            forwarded = forward_message(self.forwarding, message, frame, timing)
            self.metrics.step("encode", forwarded.encode_seconds)
            return [Forward(forwarded.message, message)]
        sample_started = time.perf_counter()
        if message.kind is MessageKind.VERIFY_EMBD:
            answer: FinalAnswer | None = self.final.verify(message, session, hidden, logits, summed)
        else:
            answer = self.final.answer(message, session, hidden, logits, summed[0] if summed else None)
        if answer is None:
            return []
        sampled_us = round((time.perf_counter() - sample_started) * 1e6)
        timing = attrs.evolve(timing, compute_us=timing.compute_us + sampled_us)
        return [_final_answer(self.stage.index, message, answer, timing.record(self.stage.index))]

    # --- control kinds (one handler each, see _HANDLERS) ----------------------------------

    def _configure(self, inbound: Inbound) -> list[Outcome]:
        message = inbound.message
        session = self.sessions.get(message.session_id, create=True, now=self.clock(),
                                    driver=message.state.driver_incarnation)
        if message.options is not None:
            self.sessions.configure(session, message.options, message.state.prompt_token_count)
            self.final.start_constraint(session)
        return self._pass_on(inbound)

    def _fork(self, inbound: Inbound) -> list[Outcome]:
        message = inbound.message
        source, target = self.sessions.fork(message, self.clock())
        if not self.is_final:
            return self._pass_on(inbound)
        record = StageTiming(received_at_us=inbound.received_at_us).record(self.stage.index)
        return [_final_answer(self.stage.index, message, self.final.forked(message, source, target), record)]

    def _trim(self, inbound: Inbound) -> list[Outcome]:
        message = inbound.message
        session = self.sessions.get(message.session_id, create=False, now=self.clock())
        self.sessions.trim(session, message.token_count)
        return self._pass_on(inbound)

    def _stop(self, inbound: Inbound) -> list[Outcome]:
        # Freed before passing on: this stage's lane must not leak when the forward fails.
        self.sessions.free(inbound.message.session_id)
        return self._pass_on(inbound)

    def _pass_on(self, inbound: Inbound) -> list[Outcome]:
        """A control message goes on downstream; the final stage acknowledges it."""
        message = inbound.message
        timing = StageTiming(received_at_us=inbound.received_at_us, bytes_in=inbound.bytes_in)
        if self.is_final:
            return [_answer(self.stage.index, message, ReplyKind.ACK, timing.record(self.stage.index))]
        return [Forward(forward_control(self.forwarding, message, timing), message)]

    def fail(self, message: StageMessage, exc: BaseException, *, internal: bool = False) -> Answer:
        """Count, log and answer the failure of one message with an Error reply naming it."""
        return self.errors.fail(message, exc, internal=internal)


def _check_finite(hidden: npt.NDArray[np.float32], source_stage_index: int) -> None:
    """FrameError naming the first NaN or infinity of an activation (R, n_embd): a stage computes
    nothing from it, so a damaged upstream stage is named where it shows, not as NaN logits later."""
    finite = np.isfinite(hidden)
    if finite.all():
        return
    row, column = (int(i) for i in np.argwhere(~finite)[0])
    raise FrameError(
        f"activation from stage {source_stage_index} holds {int((~finite).sum())} non-finite values (first "
        f"{float(hidden[row, column])} at row {row}, column {column}); expected finite hidden states: that "
        "stage's weights may be damaged (restart it with --check-tensors)"
    )


def _project(final: FinalOutput, messages: Sequence[StageMessage], sessions: Sequence[StageSession],
             ends: npt.NDArray[np.int64], hidden: F32) -> tuple[F32 | None, dict[int, range], dict[int, RowSum]]:
    """The final stage's logits of a pass (its `hidden` rows, each message's ending at `ends`): every answered
    message's last row, a verification's every row, in one matmul (a non-final prefill chunk is answered by
    nobody, an embedding by no logits); which rows of them each message owns; the logprobs' exp-sums by row."""
    answered = [i for i, (message, session) in enumerate(zip(messages, sessions, strict=True))
                if final.wants_logits(message, session)]
    if not answered:
        return None, {}, {}
    spans: dict[int, range] = {}  # message index -> its rows of the logits
    picked: list[int] = []  # the pass's rows projected
    for i in answered:
        end = int(ends[i])
        first = end - messages[i].token_count if messages[i].kind is MessageKind.VERIFY_EMBD else end - 1
        spans[i] = range(len(picked), len(picked) + end - first)
        picked += range(first, end)
    # Read (and changed in place by the samplers) row by row, before the head runs again: the head's own
    # buffer, not a copy of answered x n_vocab floats.
    logits = final.runtime.logits(hidden[picked], reuse=True)
    return logits, spans, final.exp_sums(logits, [sessions[i] for i in answered for _ in spans[i]])


def _message_logits(message: StageMessage, logits: F32 | None, span: range | None, sums: dict[int, RowSum]
                    ) -> tuple[F32 | None, tuple[RowSum | None, ...]]:
    """A message's logits of its pass (its last row's (n_vocab,), a verification's (T, n_vocab)) and their
    exp-sums, or (None, ()) when the pass projected none for it."""
    if logits is None or span is None:
        return None, ()
    if message.kind is MessageKind.VERIFY_EMBD:
        return logits[span.start : span.stop], tuple(sums.get(row) for row in span)
    return logits[span.start], (sums.get(span.start),)


def _final_answer(stage_index: int, message: StageMessage, answer: FinalAnswer, record: TraceRecord) -> Answer:
    return _answer(stage_index, message, answer.kind, record, predicted_token=answer.token,
                   logprobs=answer.logprobs, embedding=answer.embedding, tokens=np.asarray(answer.tokens, np.int32),
                   token_logprobs=answer.token_logprobs)


def _answer(stage_index: int, message: StageMessage, kind: ReplyKind, record: TraceRecord | None,
            **fields: Any) -> Answer:
    """A reply to the driver about `message`, with its trace (plus `record`, this stage's)."""
    trace = message.trace if record is None else (*message.trace, record)
    reply = Reply(kind=kind, request_id=message.request_id, session_id=message.session_id, stage_index=stage_index,
                  answered=message.kind, decode_step=message.state.decode_step, trace=trace[-MAX_TRACE_RECORDS:],
                  **fields)
    return Answer(reply)


_HANDLERS: dict[MessageKind, Handler] = {
    MessageKind.PREFILL_EMBD: StageCore._compute,
    MessageKind.PREFILL_FINAL_EMBD: StageCore._compute,
    MessageKind.DECODE_EMBD: StageCore._compute,
    MessageKind.VERIFY_EMBD: StageCore._compute,
    MessageKind.CONFIGURE_GENERATION: StageCore._configure,
    MessageKind.TRIM_SESSION: StageCore._trim,
    MessageKind.FORK_SESSION: StageCore._fork,
    MessageKind.STOP: StageCore._stop,
}
"""One handler per message kind: a new kind is one row here (and its row in `wire.messages.KINDS`);
a kind without a handler fails at import, naming it."""
check_rows(_HANDLERS, MessageKind, "skippy_zmq.stage.core._HANDLERS")
