"""The driver's transport: a PUSH to stage 0 and a PULL for every stage's replies, driving a
`Scheduler`.

Per session (docs/PROTOCOL.md §6): ConfigureGeneration -> prefill chunks -> decode loop -> Stop.
What to send and when, deadlines and liveness live in `scheduler.py`, what a token means in
`session.py`; this module only encodes, sends, polls, receives and decodes.
"""

from __future__ import annotations

import struct
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import zmq

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError, RequestError, SkippyError, StageTimeout, WireError
from skippy_zmq.forwarding import now_us
from skippy_zmq.runtime.sampling import SamplingParams
from skippy_zmq.runtime.tokenizer import Tokenizer
from skippy_zmq.scheduler import (
    DEFAULT_RECOVERY_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    DEFAULT_SILENCE_S,
    Action,
    Finished,
    PipelineShape,
    Scheduler,
    Text,
)
from skippy_zmq.security import RETURN_DOMAIN, CurveSetup, ZapDecision, ZapHandler
from skippy_zmq.session import GenerationRequest, GenerationResult
from skippy_zmq.wire import (
    MAX_ERROR_TEXT_BYTES,
    MAX_PREDICTED_TOKENS,
    MAX_TRACE_RECORDS,
    REPLY_HEADER_BYTES,
    TRACE_BYTES,
    decode_reply,
    encode_message,
)

__all__ = [
    "DEFAULT_REPLY_TIMEOUT_S",
    "DEFAULT_SILENCE_S",
    "MAX_REPLY_BYTES",
    "GenerateOptions",
    "GenerationRequest",
    "GenerationResult",
    "PipelineClient",
    "TextCallback",
    "run_generate",
]

MAX_REPLY_BYTES = REPLY_HEADER_BYTES + 4 * MAX_PREDICTED_TOKENS + MAX_ERROR_TEXT_BYTES + MAX_TRACE_RECORDS * TRACE_BYTES
"""ZMQ_MAXMSGSIZE of the driver's return socket (docs/PROTOCOL.md §2.5: set on every PULL)."""
READY_POLL_S = 0.2
READY_SAY_FIRST_S = 2.0
READY_SAY_EVERY_S = 10.0

TextCallback = Callable[[int, str], None]
"""Receives (prompt index, new text) as a session's text grows."""
EventHandler = Callable[[Text | Finished], None]
"""Receives the scheduler's Text and Finished actions as the transport carries them out."""


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
        micro_batches: int = 1,
        recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S,
        curve: CurveSetup | None = None,
        on_refused: Callable[[str, str, str, ZapDecision], None] | None = None,
    ) -> None:
        self.scheduler = Scheduler(
            PipelineShape.from_topology(topology), tokenizer,
            reply_timeout_s=reply_timeout_s, silence_s=silence_s, prefill_chunk=prefill_chunk,
            micro_batches=micro_batches, recovery_timeout_s=recovery_timeout_s,
        )
        self.topology = topology
        self.tokenizer = tokenizer
        self.reply_timeout_s = reply_timeout_s
        self.silence_s = silence_s
        self.prefill_chunk = prefill_chunk
        self._owns_context = context is None
        self._context = context or zmq.Context()
        if curve is None and topology.security.curve:
            curve = CurveSetup.for_driver(topology)
        self.curve = curve
        self.handshakes_refused = 0
        self._on_refused = on_refused
        self._zap: ZapHandler | None = None
        if curve is not None:  # before the bind: libzmq asks the handler about every handshake
            self._zap = ZapHandler(self._context, curve.admission(), self._refused)
        self._returns = self._context.socket(zmq.PULL)
        self._returns.setsockopt(zmq.LINGER, 0)
        self._returns.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        self._stage0 = self._context.socket(zmq.PUSH)
        try:
            if curve is not None:
                curve.serve(self._returns, RETURN_DOMAIN)
            try:
                self._returns.bind(topology.driver.return_bind)
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"{topology.source}: cannot bind [driver] return_bind {topology.driver.return_bind!r}: {exc}"
                ) from None
            self._stage0.setsockopt(zmq.LINGER, 0)
            self._stage0.setsockopt(zmq.SNDHWM, 64)
            self._stage0.setsockopt(zmq.SNDTIMEO, max(1, round(self.scheduler.send_timeout_s * 1000)))
            if curve is not None:
                curve.connect_to(self._stage0, topology.stages[0].stage_id)
            self._stage0.connect(topology.stages[0].pull_connect)
        except BaseException:
            self._returns.close(linger=0)
            self._stage0.close(linger=0)
            if self._zap is not None:
                self._zap.close()
            if self._owns_context:
                self._context.term()
            raise

    def _refused(self, domain: str, address: str, key: str, decision: ZapDecision) -> None:
        self.handshakes_refused += 1
        if self._on_refused is not None:
            self._on_refused(domain, address, key, decision)

    def close(self) -> None:
        """Close both sockets (the stage-0 PUSH lingers 500 ms so queued Stops still leave)."""
        self._returns.close(linger=0)
        self._stage0.close(linger=500)  # let queued Stops leave
        if self._zap is not None:
            self._zap.close()
        if self._owns_context:
            self._context.term()

    def __enter__(self) -> PipelineClient:
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

        def on_event(action: Text | Finished) -> None:
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
            if isinstance(action, Text | Finished):
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
        """Wait up to `timeout_s` for replies, then hand every queued one to the scheduler."""
        if not self._returns.poll(round(timeout_s * 1000)):
            return
        while True:
            try:
                frames = self._returns.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received_us = now_us()
            try:
                reply = decode_reply([frame.buffer for frame in frames])
            except WireError:
                continue  # a corrupt reply cannot be matched to a session; its deadline will tell
            self.perform(self.scheduler.on_reply(reply, time.monotonic(), received_us), on_event)


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
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S
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
        return _drive(topology, tokenizer, options, on_text, progress)
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
                # Nothing restarts this pipeline's stages: a failure fails at once, no recovery wait.
                local = attrs.evolve(options, recovery_timeout_s=0.0)
                return _drive(pipeline.topology, tokenizer, local, on_text, progress)
            except SkippyError as exc:
                dead = pipeline.dead()
                if dead:
                    raise type(exc)(f"{exc}; {'; '.join(p.describe_exit() for p in dead)}") from None
                raise


def _drive(
    topology: TopologyConfig, tokenizer: Tokenizer, options: GenerateOptions, on_text: TextCallback | None,
    progress: Callable[[str], None] | None = None,
) -> list[GenerationResult]:
    with PipelineClient(
        topology, tokenizer, reply_timeout_s=options.timeout_s, prefill_chunk=options.prefill_chunk,
        recovery_timeout_s=options.recovery_timeout_s,
    ) as client:
        client.wait_ready(options.ready_timeout_s, progress)
        return client.generate(options.requests(), on_text)
