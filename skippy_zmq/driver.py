"""The driver: tokenizes prompts, runs many sessions through a pipeline at once, streams text.

Per session (SPEC 6): ConfigureGeneration -> prefill chunks -> decode loop -> Stop. Replies are
matched by (request_id, session_id); every wait has a deadline, and a silent stage is named.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError, SkippyError, StageTimeout, WireError
from skippy_zmq.forwarding import now_us
from skippy_zmq.runtime.sampling import SamplingParams
from skippy_zmq.runtime.tokenizer import StreamingDetokenizer, Tokenizer
from skippy_zmq.telemetry import HopTiming, hop_timings, summarize
from skippy_zmq.wire import (
    MAX_ERROR_TEXT_BYTES,
    MAX_PREDICTED_TOKENS,
    MAX_TRACE_RECORDS,
    REPLY_HEADER_BYTES,
    TRACE_BYTES,
    MessageKind,
    Reply,
    ReplyKind,
    StageMessage,
    StateHeader,
    decode_reply,
    encode_message,
)

DEFAULT_REPLY_TIMEOUT_S = 120.0
DEFAULT_SILENCE_S = 15.0
"""A stage that sent no heartbeat for this long while a request waits is reported dead."""
MAX_REPLY_BYTES = REPLY_HEADER_BYTES + 4 * MAX_PREDICTED_TOKENS + MAX_ERROR_TEXT_BYTES + MAX_TRACE_RECORDS * TRACE_BYTES
"""ZMQ_MAXMSGSIZE of the driver's return socket (SPEC 2.5: set on every PULL)."""


@attrs.frozen
class GenerationRequest:
    """One prompt to complete."""

    prompt: str
    max_tokens: int = 64
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    stop: tuple[str, ...] = ()
    prompt_ids: tuple[int, ...] | None = None


@attrs.define
class GenerationResult:
    """What one session produced (`tokens` includes EOS when the model emitted it)."""

    prompt: str
    prompt_ids: list[int]
    session_id: int = 0
    tokens: list[int] = attrs.Factory(list)
    text: str = ""
    finish_reason: str = ""
    error: str | None = None
    hops: list[HopTiming] = attrs.Factory(list)
    started_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0

    def stats(self) -> dict[str, Any]:
        """Per-stage timings per token (µs) and throughput figures."""
        decode_tokens = max(len(self.tokens) - 1, 0)
        decode_s = self.finished_s - self.first_token_s
        return {
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": len(self.tokens),
            "time_to_first_token_s": round(self.first_token_s - self.started_s, 4),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 and decode_tokens else None,
            "stages": summarize(self.hops),
        }

    def as_json(self) -> dict[str, Any]:
        """The `--json` object of this prompt."""
        return {
            "prompt": self.prompt,
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "stats": self.stats(),
        }


@attrs.define
class _Pending:
    session: _SessionRun
    kind: MessageKind
    deadline: float
    sent_at: float


@attrs.define
class _SessionRun:
    index: int
    session_id: int
    request: GenerationRequest
    result: GenerationResult
    detok: StreamingDetokenizer
    position: int = 0
    step: int = 0
    done: bool = False
    stopping: bool = False
    streamed: int = 0
    next_token: int | None = None
    ready_at: float = 0.0


TextCallback = Callable[[int, str], None]


class PipelineClient:
    """Talks to running workers of a topology: stage 0 PULL in, driver return PULL out."""

    def __init__(
        self,
        topology: TopologyConfig,
        tokenizer: Tokenizer,
        *,
        context: zmq.Context[Any] | None = None,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        silence_s: float = DEFAULT_SILENCE_S,
        prefill_chunk: int = 256,
    ) -> None:
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk {prefill_chunk} must be at least 1")
        self.topology = topology
        self.tokenizer = tokenizer
        self.reply_timeout_s = reply_timeout_s
        self.silence_s = silence_s
        self.prefill_chunk = prefill_chunk
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self._returns = self._context.socket(zmq.PULL)
        self._returns.setsockopt(zmq.LINGER, 0)
        self._returns.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        try:
            self._returns.bind(topology.driver.return_bind)
        except zmq.ZMQError as exc:
            self._returns.close(linger=0)
            raise ConfigError(
                f"{topology.source}: cannot bind [driver] return_bind {topology.driver.return_bind!r}: {exc}"
            ) from None
        self._stage0 = self._context.socket(zmq.PUSH)
        self._stage0.setsockopt(zmq.LINGER, 0)
        self._stage0.setsockopt(zmq.SNDHWM, 64)
        # A full stage-0 queue is back-pressure: it drains as stage 0 finishes a message. A send
        # that waits longer than a stage may stay silent means stage 0 is gone.
        self._send_timeout_s = min(reply_timeout_s, silence_s)
        self._stage0.setsockopt(zmq.SNDTIMEO, max(1, round(self._send_timeout_s * 1000)))
        self._stage0.connect(topology.stages[0].pull_connect)
        self._next_request = 1
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._by_session: dict[int, _SessionRun] = {}
        self._step_s = 0.1  # running mean of a decode step's round trip
        self._heard: dict[int, float] = {}

    def close(self) -> None:
        """Close both sockets (linger 0)."""
        self._returns.close(linger=0)
        self._stage0.close(linger=500)  # let queued Stops leave
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> PipelineClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- readiness ----------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until every stage has sent a heartbeat; raise StageTimeout naming the silent ones."""
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while True:
            fresh = {i for i, t in self._heard.items() if t >= started - 0.001}
            missing = [s for s in self.topology.stages if s.index not in fresh]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(s.label for s in missing)
                raise StageTimeout(f"pipeline not ready after {timeout_s:.1f} s: no heartbeat from {names}")
            self._receive(min(remaining, 0.2))

    # --- generation ---------------------------------------------------------------------------

    @property
    def max_sessions(self) -> int:
        """Sessions in flight at once: the smallest lane count of the pipeline."""
        return min(stage.lane_count for stage in self.topology.stages)

    @property
    def ctx_size(self) -> int:
        """Positions a session may hold: the smallest context of the pipeline."""
        return min(stage.ctx_size for stage in self.topology.stages)

    def generate(
        self, requests: Sequence[GenerationRequest], on_text: TextCallback | None = None
    ) -> list[GenerationResult]:
        """Run the requests as concurrent sessions (at most `max_sessions` at a time, the rest
        queued); returns results in request order. A failed session carries its error text in
        `result.error`; the others go on."""
        runs = [self._prepare(index, request) for index, request in enumerate(requests)]
        try:
            self._run_all(runs, on_text)
        finally:
            # Interrupted or not: no session of ours may keep a lane on any stage.
            for run in runs:
                if run.session_id in self._by_session and not run.done:
                    with contextlib.suppress(SkippyError):
                        self._send(run, MessageKind.STOP, block=False)
                self._by_session.pop(run.session_id, None)
            for key in [k for k, p in self._pending.items() if p.session in runs]:
                del self._pending[key]
        return [run.result for run in runs]

    def _run_all(self, runs: list[_SessionRun], on_text: TextCallback | None) -> None:
        waiting = [run for run in runs if not run.done]
        active: list[_SessionRun] = []
        while waiting or active:
            while waiting and len(active) < self.max_sessions:
                run = waiting.pop(0)
                self._start(run)
                active.append(run)
                if run.result.error and "did not accept request" in run.result.error:
                    # Stage 0 takes nothing: every prompt still waiting would fail the same way.
                    for other in waiting:
                        other.done, other.result.finish_reason = True, "error"
                        other.result.error = run.result.error
                    waiting.clear()
            self._receive(self._poll_timeout(), on_text)
            self._expire(on_text)
            self._flush_decodes(on_text)
            for run in active:
                if run.done or run.next_token is not None:
                    continue
                if not any(p.session is run for p in self._pending.values()):
                    # Nothing outstanding and not finished: only a reply of an unexpected kind
                    # gets here; fail loudly rather than wait forever.
                    self._fail(run, f"session {run.session_id}: no request outstanding; the pipeline "
                               f"answered out of protocol", on_text)
            active = [run for run in active if not run.done]

    def _prepare(self, index: int, request: GenerationRequest) -> _SessionRun:
        ids = list(request.prompt_ids) if request.prompt_ids is not None else self.tokenizer.encode(request.prompt)
        session_id = secrets.randbits(63) + 1
        result = GenerationResult(prompt=request.prompt, prompt_ids=ids, session_id=session_id)
        run = _SessionRun(index, session_id, request, result, StreamingDetokenizer(self.tokenizer))
        if not ids:
            run.done, result.finish_reason = True, "error"
            result.error = f"prompt {index} tokenizes to no tokens"
        elif len(ids) >= self.ctx_size:
            run.done, result.finish_reason = True, "error"
            result.error = (
                f"prompt {index} has {len(ids)} tokens; the pipeline's ctx_size {self.ctx_size} "
                f"leaves no room to generate"
            )
        elif request.max_tokens < 1:
            run.done, result.finish_reason = True, "length"
        return run

    def _start(self, run: _SessionRun) -> None:
        ids = run.result.prompt_ids
        run.result.started_s = time.monotonic()
        self._by_session[run.session_id] = run
        try:
            self._send(run, MessageKind.CONFIGURE_GENERATION, sampling=run.request.sampling)
            for start in range(0, len(ids), self.prefill_chunk):
                chunk = ids[start : start + self.prefill_chunk]
                last = start + len(chunk) == len(ids)
                kind = MessageKind.PREFILL_FINAL_EMBD if last else MessageKind.PREFILL_EMBD
                self._send(run, kind, tokens=chunk, pos_start=start, seq_id=start // self.prefill_chunk)
            run.position = len(ids)
        except SkippyError as exc:
            self._fail(run, str(exc), None)

    def _send(
        self,
        run: _SessionRun,
        kind: MessageKind,
        *,
        tokens: Sequence[int] = (),
        pos_start: int = 0,
        seq_id: int = 0,
        sampling: SamplingParams | None = None,
        block: bool = True,
    ) -> None:
        request_id = self._next_request
        self._next_request += 1
        is_decode = kind is MessageKind.DECODE_EMBD
        state = StateHeader.for_kind(
            kind,
            seq_id=seq_id,
            prompt_token_count=len(run.result.prompt_ids),
            decode_step=run.step if is_decode else -1,
            current_token=tokens[-1] if is_decode else -1,
            sampling=sampling is not None,
        )
        message = StageMessage(
            kind=kind,
            pos_start=pos_start,
            token_count=len(tokens) if kind.carries_tokens else 0,
            state=state,
            request_id=request_id,
            session_id=run.session_id,
            sampling=sampling,
            tokens=np.asarray(tokens, dtype=np.int32),
        )
        if kind.expects_reply:
            now = time.monotonic()
            self._pending[(request_id, run.session_id)] = _Pending(run, kind, now + self.reply_timeout_s, now)
        try:
            self._stage0.send_multipart(encode_message(message), copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            self._pending.pop((request_id, run.session_id), None)
            stage = self.topology.stages[0]
            raise StageTimeout(
                f"session {run.session_id}: {stage.label} did not accept request {request_id} "
                f"({kind.name}) within {self._send_timeout_s:g} s"
            ) from None

    # --- replies ------------------------------------------------------------------------------

    def _poll_timeout(self) -> float:
        if not self._pending:
            return 0.05
        soonest = min(p.deadline for p in self._pending.values())
        return min(max(soonest - time.monotonic(), 0.0), 0.25)

    def _receive(self, timeout_s: float, on_text: TextCallback | None = None) -> None:
        if not self._returns.poll(round(timeout_s * 1000)):
            return
        while True:
            try:
                frames = self._returns.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received_us = now_us()
            try:
                reply = decode_reply(frames)
            except WireError:
                continue  # a corrupt reply cannot be matched to a session; its deadline will tell
            self._heard[reply.stage_index] = time.monotonic()
            if reply.is_heartbeat:
                continue
            pending = self._pending.pop((reply.request_id, reply.session_id), None)
            if pending is not None:
                self._handle(pending, reply, received_us, on_text)
            elif reply.kind is ReplyKind.ERROR and reply.session_id in self._by_session:
                # An error for a message nobody waits on (a non-final prefill chunk): it fails
                # the session now, with the real cause, instead of a later symptom.
                self._fail(self._by_session[reply.session_id], reply.error, on_text)
            # Anything else is stale: a reply to an earlier driver run, or one already failed.

    def _handle(self, pending: _Pending, reply: Reply, received_us: int, on_text: TextCallback | None) -> None:
        run = pending.session
        if run.done:
            return
        if reply.kind is ReplyKind.ERROR:
            self._fail(run, reply.error, on_text)
            return
        if reply.kind is ReplyKind.ACK:
            if pending.kind is MessageKind.STOP:
                run.done = True
                run.result.finished_s = run.result.finished_s or time.monotonic()
            return
        if run.stopping:
            return
        token = int(reply.predicted_token)
        result = run.result
        now = time.monotonic()
        if not result.tokens:
            result.first_token_s = now
        result.finished_s = now
        result.tokens.append(token)
        result.hops.extend(hop_timings(reply.trace, received_us))
        finish = ""
        if self.tokenizer.is_eog(token) and not run.request.sampling.ignore_eos:
            finish = "eos"  # the EOS token is reported in `tokens`, never rendered as text
        else:
            result.text += run.detok.push(token)
            stop_at = _find_stop(result.text, run.request.stop)
            if stop_at is not None:
                result.text = result.text[:stop_at]
                finish = "stop"
            elif len(result.tokens) >= run.request.max_tokens:
                finish = "length"
            elif run.position >= self.ctx_size:
                finish = "length"  # the KV cache is full: nothing more fits
        if finish and finish != "stop":
            result.text += run.detok.flush()
            stop_at = _find_stop(result.text, run.request.stop)
            if stop_at is not None:
                result.text, finish = result.text[:stop_at], "stop"
        self._stream(run, on_text, final=bool(finish))
        if finish:
            result.finish_reason = finish
            self._stop(run)
            return
        run.next_token = token
        run.ready_at = now
        if pending.kind is MessageKind.DECODE_EMBD:
            self._step_s = 0.8 * self._step_s + 0.2 * (now - pending.sent_at)

    def _flush_decodes(self, on_text: TextCallback | None) -> None:
        """Send the next decode step of every session whose token is in, once no decode step is
        still in flight: the sessions then travel the pipeline together and every stage runs
        them as one batch (a batched step costs about what a single one does)."""
        ready = [run for run in self._by_session.values() if run.next_token is not None and not run.done]
        if not ready:
            return
        in_flight = any(p.kind is MessageKind.DECODE_EMBD for p in self._pending.values())
        # Wait for the stragglers of this step, but never much longer than a step takes: a
        # lost reply must not hold every other session until its deadline.
        patience = max(0.05, 3 * self._step_s)
        if in_flight and time.monotonic() - min(run.ready_at for run in ready) < patience:
            return
        for run in ready:
            token, run.next_token = run.next_token, None
            run.step += 1
            position = run.position
            run.position += 1
            try:
                self._send(run, MessageKind.DECODE_EMBD, tokens=[token], pos_start=position)
            except SkippyError as exc:
                self._fail(run, str(exc), on_text)

    def _stream(self, run: _SessionRun, on_text: TextCallback | None, *, final: bool) -> None:
        """Hand new text to `on_text`, holding back a possible start of a stop string."""
        text = run.result.text
        hold = 0 if final else max((len(stop) - 1 for stop in run.request.stop if stop), default=0)
        upto = min(max(len(text) - hold, run.streamed), len(text))
        if upto > run.streamed and on_text is not None:
            on_text(run.index, text[run.streamed : upto])
        run.streamed = upto

    def _stop(self, run: _SessionRun) -> None:
        run.stopping = True
        try:
            self._send(run, MessageKind.STOP, block=False)
        except SkippyError:
            run.done = True

    def _fail(self, run: _SessionRun, error: str, on_text: TextCallback | None) -> None:
        if run.done:
            return
        run.result.error = error
        run.result.finish_reason = "error"
        run.result.finished_s = time.monotonic()
        run.done = True
        # Free the session's KV on every stage that is still alive; nobody waits for the Ack.
        with contextlib.suppress(SkippyError):
            self._send(run, MessageKind.STOP, block=False)
        self._stream(run, on_text, final=True)
        for key in [k for k, p in self._pending.items() if p.session is run]:
            del self._pending[key]

    def _expire(self, on_text: TextCallback | None) -> None:
        now = time.monotonic()
        silent = self._silent_stages(now)
        for key, pending in list(self._pending.items()):
            run = pending.session
            if pending.deadline > now and not (silent and now - pending.sent_at > self.silence_s):
                continue
            self._pending.pop(key, None)
            if run.done:
                continue
            if pending.kind is MessageKind.STOP and run.stopping and not run.result.error:
                run.done = True  # the text is complete; a lost Stop Ack is not the user's loss
                continue
            waited = now - pending.sent_at
            names = ", ".join(s.stage_id for s in self.topology.stages)
            detail = "; ".join(silent) if silent else "every stage is sending heartbeats"
            self._fail(
                run,
                f"session {run.session_id}: no reply to request {key[0]} ({pending.kind.name}) "
                f"after {waited:.1f} s; {detail} (pipeline stages: {names})",
                on_text,
            )

    def _silent_stages(self, now: float) -> list[str]:
        silent = []
        for stage in self.topology.stages:
            heard = self._heard.get(stage.index)
            if heard is None or now - heard > self.silence_s:
                age = "never" if heard is None else f"{now - heard:.1f} s ago"
                silent.append(f"{stage.label} is silent (last heartbeat {age})")
        return silent


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(stop) for stop in stops if stop and stop in text]
    return min(hits) if hits else None


@attrs.frozen
class GenerateOptions:
    """Everything `skippy-zmq generate` needs, parsed."""

    prompts: tuple[str, ...]
    topology_path: str | None = None
    model: str | None = None
    stages: int = 3
    codec: str = "raw-f32-v1"
    codec_policy: str = "fixed"
    prefill_chunk: int = 256
    timeout_s: float = DEFAULT_REPLY_TIMEOUT_S
    ready_timeout_s: float = 300.0
    max_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0
    stops: tuple[str, ...] = ()
    verbose: bool = False

    def sampling(self) -> SamplingParams:
        """The sampling settings every session gets."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            penalty_last_n=self.repeat_last_n,
            seed=self.seed,
        )

    def requests(self) -> list[GenerationRequest]:
        """One request per prompt."""
        sampling = self.sampling()
        return [
            GenerationRequest(prompt=p, max_tokens=self.max_tokens, sampling=sampling, stop=self.stops)
            for p in self.prompts
        ]


def run_generate(
    options: GenerateOptions,
    on_text: TextCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[GenerationResult]:
    """Generate through running workers (`topology_path`) or a local pipeline started for it;
    `progress` hears about stages starting."""
    import sys

    from skippy_zmq.launch import LocalPipeline, write_local_topology
    from skippy_zmq.runtime.catalog import GEMMA3_270M_ALIAS, resolve_model
    from skippy_zmq.runtime.model import ModelHParams

    if options.topology_path is not None:
        topology = TopologyConfig.from_toml(options.topology_path)
        tokenizer = Tokenizer.from_gguf(resolve_model(topology.model))
        return _drive(topology, tokenizer, options, on_text)
    model = options.model or GEMMA3_270M_ALIAS
    model_path = resolve_model(model)
    hparams = ModelHParams.from_gguf(model_path)
    tokenizer = Tokenizer.from_gguf(model_path)
    with tempfile.TemporaryDirectory(prefix="skippy-zmq-") as directory:
        path = write_local_topology(
            str(model_path), hparams.n_layer, options.stages, codec=options.codec,
            policy=options.codec_policy, directory=Path(directory),
        )
        with LocalPipeline(path, log_sink=sys.stderr if options.verbose else None, progress=progress) as pipeline:
            try:
                return _drive(pipeline.topology, tokenizer, options, on_text)
            except SkippyError as exc:
                dead = pipeline.dead()
                if dead:
                    raise type(exc)(f"{exc}; {'; '.join(p.describe_exit() for p in dead)}") from None
                raise


def _drive(
    topology: TopologyConfig, tokenizer: Tokenizer, options: GenerateOptions, on_text: TextCallback | None
) -> list[GenerationResult]:
    with PipelineClient(
        topology, tokenizer, reply_timeout_s=options.timeout_s, prefill_chunk=options.prefill_chunk
    ) as client:
        client.wait_ready(options.ready_timeout_s)
        return client.generate(options.requests(), on_text)
