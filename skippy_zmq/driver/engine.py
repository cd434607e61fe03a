"""The serving engine: one long-running thread owns a pipeline's driver sockets and scheduler.

Clients on other threads (the HTTP gateway, the ZeroMQ request API) `submit` requests and
`cancel` them; the engine thread turns scheduler actions into sends and replies into events
(`Delta`, then one `Done` or `Failed`) that it hands to each request's callback. Nothing here
parses HTTP or JSON: the gateway does (docs/ARCHITECTURE.md, "Serving").
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeAlias

import attrs
import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationResult, GenerationState, Timing
from skippy_zmq.driver.lanes import Progress, Report, Text
from skippy_zmq.driver.scheduler import PipelineShape, Scheduler
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.stage_figures import StageFigures
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.driver.watch import SILENT_AFTER_S, StageEvent, StageStatus
from skippy_zmq.errors import (
    EngineUnavailable,
    QueueFull,
    RequestCancelled,
    RequestTimeout,
    SkippyError,
    StageTimeout,
)
from skippy_zmq.security.admission import ZapDecision
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.tokenizer import Tokenizer

_log = logging.getLogger("skippy_zmq.engine")

HEALTH_SILENCE_S = SILENT_AFTER_S
"""A stage with no heartbeat for this long makes /health report it, as the log does (stages beat every second)."""
LOOP_POLL_S = 0.25
"""Longest sleep of the engine loop when nothing happens (a stop request is seen this fast)."""


@attrs.frozen
class PromptProgress:
    """How far a prompt has run (llama-server's `prompt_progress`): `total` positions, `cache` of them kept from
    the prompt cache, `processed` held by every stage so far (cache included), `time_ms` since the request started."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def as_json(self) -> dict[str, int | float]:
        """llama-server's `prompt_progress` object."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@attrs.frozen
class Delta:
    """New output of a running request; `text` may be "" while a stop string may be starting, and a request
    that asked for prompt progress gets Deltas without text that carry `progress`."""

    text: str
    token_ids: tuple[int, ...]
    choice: int = 0  # which of the request's choices it belongs to
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked
    progress: PromptProgress | None = None
    timing: Timing | None = None  # the choice's timings so far, when the request asked (GenerationRequest.timings)


@attrs.frozen
class Done:
    """The request finished normally (`result.finish_reason` is "eos", "stop" or "length");
    `results` holds every choice's result, `result` the first's."""

    result: GenerationResult
    results: tuple[GenerationResult, ...] = attrs.field()

    @results.default
    def _one_choice(self) -> tuple[GenerationResult, ...]:
        return (self.result,)


@attrs.frozen
class Failed:
    """The request failed, timed out or was cancelled; `error` says which."""

    error: SkippyError
    result: GenerationResult
    results: tuple[GenerationResult, ...] = attrs.field()

    @results.default
    def _one_choice(self) -> tuple[GenerationResult, ...]:
        return (self.result,)


Event: TypeAlias = Delta | Done | Failed
EventCallback: TypeAlias = Callable[[Event], None]


@attrs.frozen
class Health:
    """What /health reports: ready when every stage heartbeats and requests are accepted."""

    ready: bool
    silent: tuple[str, ...] = ()
    draining: bool = False
    started: bool = True
    down: tuple[str, ...] = ()  # stages that failed; their sessions replay once they are back
    starved: tuple[str, ...] = ()  # stages that refused a session for lack of a lane: requests queue
    stages: tuple[StageStatus, ...] = ()  # each stage as the driver sees it: up, down or never heard, and why
    figures: tuple[StageFigures, ...] = ()  # each stage's heartbeat, load and token split (GET /stages)

    @property
    def serving(self) -> bool:
        """Ready, and no stage lately refused a session for lack of a lane (what /health 200 means)."""
        return self.ready and not self.starved

    def describe(self) -> str:
        """One human sentence."""
        if self.draining:
            return "draining: finishing in-flight requests before shutdown"
        if not self.started:
            return "starting: the engine is not running yet"
        why = "".join(f"; {s.place.name} {s.detail}" for s in self.stages if not s.up)
        if self.down:
            return (", ".join(self.down) + " failed: waiting for it to come back; running sessions replay "
                    "then, new requests stay queued" + why)
        if self.silent:
            return "waiting for heartbeats from " + ", ".join(self.silent) + why
        if self.starved:
            return (", ".join(self.starved) + " has no free lane: its lanes are held by sessions this driver did "
                    "not open (they free when their driver stops them, or after the stage's session TTL); "
                    "requests stay queued and start once a lane is free")
        return "ready"


@attrs.define(eq=False)
class Ticket:
    """One submitted request, as its submitter sees it."""

    request_id: str
    request: GenerationRequest
    on_event: EventCallback
    deadline: float
    session: Generation | None = None  # the first choice (the others are its `forks`)
    reported: dict[int, int] = attrs.Factory(dict)  # tokens already in a Delta, by choice
    ended: bool = False
    cancel_reason: SkippyError | None = None

    @property
    def sessions(self) -> list[Generation]:
        """Every choice's session, in choice order (none before the engine took the request)."""
        return [] if self.session is None else [self.session, *self.session.forks]

    @property
    def result(self) -> GenerationResult | None:
        """The first choice's result once the engine took the request."""
        return None if self.session is None else self.session.result


def _progress_delta(ticket: Ticket, session: Generation, action: Progress) -> Delta:
    """A Delta without text reporting the prompt's progress, with the timings of the positions computed so far
    (as if the prompt were `processed` long and no token came yet) when the request asked for timings."""
    result = session.result
    progress = PromptProgress(len(result.prompt_ids), result.cached_tokens, action.processed, action.time_ms)
    timing = Timing(action.processed, result.cached_tokens, 0, result.started_s, 0.0,
                    result.started_s + action.time_ms / 1000) if ticket.request.timings else None
    return Delta("", (), session.choice, progress=progress, timing=timing)


class TicketBook:
    """The engine thread's requests: by choice (each Generation) once submitted to the scheduler,
    and those not yet holding a lane; turns the scheduler's Text, Progress and Finished actions into each
    request's Deltas, then one Done or Failed when its last choice ends. Engine thread only; no sockets."""

    def __init__(self) -> None:
        self.live: dict[Generation, Ticket] = {}  # by choice: a session's id may change (a prompt-cache lane)
        self.unadmitted: list[Ticket] = []
        self.to_cancel: list[Ticket] = []  # a choice failed: the request's other choices are to be cancelled

    def start(self, scheduler: Scheduler, ticket: Ticket) -> None:
        """Submit a new request to the scheduler (one cancelled before it started ends at once)."""
        if ticket.cancel_reason is not None:
            self.end(ticket, ticket.cancel_reason)
            return
        session = scheduler.submit(ticket.request)
        ticket.session = session
        if session.done:  # refused at once (e.g. a prompt that leaves no room)
            self.end(ticket, session.error)
            return
        for choice in ticket.sessions:
            self.live[choice] = ticket

    def on_action(self, action: Report) -> None:
        """A scheduler action for one choice of a request: its new text, its prompt's progress, or its end."""
        session = action.session
        ticket = self.live.get(session)
        if ticket is None or all(choice is not session for choice in ticket.sessions):
            return
        if isinstance(action, Text):
            self.emit(ticket, self._delta(ticket, session, action.text))
            return
        if isinstance(action, Progress):
            self.emit(ticket, _progress_delta(ticket, session, action))
            return
        del self.live[session]
        delta = self._delta(ticket, session, "")
        if delta.token_ids:
            self.emit(ticket, delta)
        if session.state is not GenerationState.FINISHED and ticket.cancel_reason is None:
            # One choice failed: the request fails, and its other choices need not run on.
            ticket.cancel_reason = session.error
            self.to_cancel.append(ticket)
        self._end_if_complete(ticket)

    def on_actions(self, actions: list[Report]) -> None:
        """`on_action` for each of `actions`, in order."""
        for action in actions:
            self.on_action(action)

    def take_admitted(self) -> int:
        """How many of the requests not yet holding a lane took one, or ended, since the last call."""
        admitted = [t for t in self.unadmitted
                    if t.ended or (t.session is not None and t.session.state is not GenerationState.WAITING)]
        self.unadmitted = [t for t in self.unadmitted if t not in admitted]
        return len(admitted)

    def overdue(self, now: float, timeout_s: float) -> list[tuple[Ticket, SkippyError]]:
        """The requests past their deadline, each with its RequestTimeout."""
        return [(t, RequestTimeout(f"request {t.request_id} did not finish within the request timeout of "
                                   f"{timeout_s:g} s")) for t in self.live.values() if t.deadline <= now]

    def take_cancels(self) -> list[Generation]:
        """The first choices of the requests one of whose choices failed (cancelling one cancels all)."""
        firsts = [t.session for t in self.to_cancel if t.session is not None]
        self.to_cancel.clear()
        return firsts

    def finish_complete(self) -> None:
        """A request whose choices' texts are all complete (STOPPING: their Stops are on the way)
        ends now; the lanes stay held in the scheduler until the Stops are answered."""
        for ticket in {id(t): t for t in self.live.values()}.values():
            sessions = ticket.sessions
            if sessions and all(s.state in (GenerationState.STOPPING, GenerationState.FINISHED) for s in sessions):
                for session in sessions:
                    self.live.pop(session, None)
                    delta = self._delta(ticket, session, "")
                    if delta.token_ids:
                        self.emit(ticket, delta)
                self.end(ticket, None)

    def _end_if_complete(self, ticket: Ticket) -> None:
        if ticket.ended or any(self.live.get(s) is ticket for s in ticket.sessions):
            return
        failed = next((s for s in ticket.sessions if s.state is not GenerationState.FINISHED), None)
        self.end(ticket, None if failed is None else ticket.cancel_reason or failed.error)

    def _delta(self, ticket: Ticket, session: Generation, text: str) -> Delta:
        """`text` with the tokens (and their logprobs) of `session` not yet reported."""
        result = session.result
        start = ticket.reported.get(session.choice, 0)
        ticket.reported[session.choice] = len(result.tokens)
        logprobs = tuple(result.logprobs[start:]) if result.logprobs else ()
        timing = result.timing() if ticket.request.timings else None
        return Delta(text, tuple(result.tokens[start:]), session.choice, logprobs, timing=timing)

    def end(self, ticket: Ticket, error: SkippyError | None) -> None:
        """The request's last event: Done, or Failed with `error`."""
        ticket.ended = True
        results = tuple(s.result for s in ticket.sessions)
        result = results[0] if results else GenerationResult(prompt=ticket.request.prompt, prompt_ids=[])
        results = results or (result,)
        if error is None:
            self.emit(ticket, Done(result, results))
        else:
            self.emit(ticket, Failed(error, result, results))

    def emit(self, ticket: Ticket, event: Event) -> None:
        """Hand `event` to the request's callback; a callback that raises ends its request."""
        try:
            ticket.on_event(event)
        except Exception:  # noqa: BLE001 - a broken subscriber must not stop the engine
            ticket.ended = True


class Engine:
    """Serves generation requests from any thread over one pipeline (see module docstring)."""

    def __init__(
        self,
        topology: TopologyConfig,
        tokenizer: Tokenizer,
        settings: SchedulerSettings,
        *,
        on_handshake_refused: Callable[[str, str, str, ZapDecision], None] | None = None,
        on_stage_event: Callable[[StageEvent], None] | None = None,
    ) -> None:
        """`settings`: its queue bound and request deadline; the rest go to the scheduler whole
        (`SchedulerSettings.from_serve` makes `serve`'s). `on_stage_event` hears, on the engine
        thread, what the driver tells the operator about its stages (driver/watch.py)."""
        self.topology = topology
        self.tokenizer = tokenizer
        self.settings = settings
        self.request_timeout_s = settings.request_timeout_s  # what the gateway's deadlines add their grace to
        self._on_handshake_refused = on_handshake_refused
        self._on_stage_event = on_stage_event or (lambda _event: None)
        shape = PipelineShape.from_topology(topology)
        self.max_sessions = shape.max_sessions
        self.ctx_size = shape.ctx_size
        self._inbox: queue.SimpleQueue[tuple[str, Ticket | None, SkippyError | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet holding a lane (nor ended)
        self._running = 0
        self._health = Health(ready=False, started=False)
        self._draining = False
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()
        self._book = TicketBook()
        self._ids = itertools.count(1)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: Exception | None = None
        self._closed = False
        self.failure: str | None = None  # why the engine thread ended on its own, if it did

    # --- any thread -----------------------------------------------------------------------

    def start(self) -> None:
        """Bind the return endpoint and start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="skippy-engine", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            raise self._start_error

    def health(self) -> Health:
        """The latest health snapshot (cheap; refreshed by the engine loop)."""
        return self._health

    @property
    def alive(self) -> bool:
        """True while the engine thread runs (a watcher ends the server when it does not)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a lane."""
        return self._queued

    @property
    def running(self) -> int:
        """Requests holding lanes."""
        return self._running

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every stage heartbeats; StageTimeout naming the silent stages otherwise."""
        deadline = time.monotonic() + timeout_s
        while not self._health.ready:
            if self._start_error is not None:
                raise EngineUnavailable(f"engine failed to start: {self._start_error}")
            if time.monotonic() > deadline:
                raise StageTimeout(f"pipeline not ready after {timeout_s:.1f} s: {self._health.describe()}")
            time.sleep(0.05)

    def submit(self, request: GenerationRequest, on_event: EventCallback) -> Ticket:
        """Queue a request; `on_event` is called from the engine thread and must not block."""
        with self._lock:
            if self._draining or self._stopping or self._thread is None:
                raise EngineUnavailable("the pipeline is not accepting requests (draining or stopped)")
            if not self._health.ready:
                raise EngineUnavailable(f"the pipeline is not ready: {self._health.describe()}")
            # Requests that a free lane will take at the next step are not waiting.
            waiting = self._queued - max(self.max_sessions - self._running, 0)
            if waiting >= self.settings.max_queue:
                raise QueueFull(
                    f"{max(waiting, 0)} requests are already waiting for a lane (max_queue {self.settings.max_queue}); "
                    f"retry later"
                )
            self._queued += 1
            self._idle.clear()
        ticket = Ticket(f"req-{next(self._ids)}", request, on_event, time.monotonic() + self.request_timeout_s)
        self._post("submit", ticket)
        return ticket

    def cancel(self, ticket: Ticket, reason: SkippyError | None = None) -> None:
        """Give up on a request (idempotent); it ends with Failed(RequestCancelled)."""
        self._post("cancel", ticket, reason or RequestCancelled(f"request {ticket.request_id} was cancelled"))

    def drain(self, timeout_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout_s`, fail the rest."""
        with self._lock:
            self._draining = True
            self._health = attrs.evolve(self._health, ready=False, draining=True)
        if not self._idle.wait(timeout_s):
            self._post("cancel_all", None, EngineUnavailable(f"the server shut down (drain timeout {timeout_s:g} s)"))
            self._idle.wait(5.0)

    def cut_drain(self) -> None:
        """Fail every request still in flight now (a second signal during `drain`), which
        ends the drain's wait."""
        self._post("cancel_all", None, EngineUnavailable("the server shut down (a second signal cut the drain short)"))

    def close(self) -> None:
        """Drain at once if needed, stop the engine thread and close its sockets."""
        if self._thread is not None and self._thread.is_alive():
            self.drain(0.0)
            self._stopping = True
            self._wake()
            self._thread.join(10)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _post(self, command: str, ticket: Ticket | None, reason: SkippyError | None = None) -> None:
        self._inbox.put((command, ticket, reason))
        self._wake()

    def _wake(self) -> None:
        with self._lock:  # never write to a descriptor number close() gave back
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_write, b"x")

    # --- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            client = PipelineTransport(self.topology, self.tokenizer, self.settings,
                                       on_refused=self._on_handshake_refused, watch_link=True)
        except Exception as exc:  # noqa: BLE001 - reported by start() in the caller's thread
            self._start_error = exc
            self._started.set()
            return
        self._publish(client, time.monotonic())  # before start() returns: health names the silent stages
        self._started.set()
        poller = zmq.Poller()
        poller.register(client.returns, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        if client.link_monitor is not None:
            poller.register(client.link_monitor, zmq.POLLIN)
        try:
            while not self._stopping:
                self._step(client, poller)
        except Exception as exc:  # noqa: BLE001 - the engine thread must report, not vanish
            # Every per-request failure is handled inside; reaching here is a bug. Say so, end
            # every request with it, and let the server's watcher stop serving.
            self.failure = f"{type(exc).__name__}: {exc}"
            _log.exception("serving engine stopped")
        finally:
            now = time.monotonic()
            with contextlib.suppress(Exception):
                self._take_commands(client, now)
            reason = EngineUnavailable(f"the engine stopped{': ' + self.failure if self.failure else ''}")
            for ticket in list(self._book.live.values()):
                with contextlib.suppress(Exception):
                    self._cancel(client, ticket, reason, now)
            client.close()
            with self._lock:
                self._health = Health(ready=False, started=False)
                self._idle.set()

    def _step(self, client: PipelineTransport, poller: zmq.Poller) -> None:
        """One loop turn: replies, commands, due sends, the replies' texts to their requests,
        deadlines, then wait for replies or a wake-up."""
        # Queued replies first (a stalled engine is not a silent stage), but their texts go to the
        # requests only after the sends they made due: handing a text over wakes the HTTP thread,
        # which would take the GIL while the next decode step waits to leave (on 2 cores a
        # single stream's every token paid for it).
        # Deadlines are checked after the texts, so that a request answered in time ends as answered.
        texts: list[Report] = []
        client.receive(0.0, texts.append)
        now = time.monotonic()
        self._take_commands(client, now)
        client.perform(client.scheduler.tick(now), self._book.on_action)
        self._book.on_actions(texts)
        for ticket, error in self._book.overdue(now, self.request_timeout_s):
            self._cancel(client, ticket, error, now)
        for first in self._book.take_cancels():  # a choice failed: its request's other choices stop now
            client.perform(client.scheduler.cancel(first, time.monotonic()), self._book.on_action)
        self._book.finish_complete()
        self._publish(client, time.monotonic())  # after the replies: heartbeats are fresh
        timeout_s = min(client.scheduler.poll_timeout(time.monotonic()), LOOP_POLL_S)
        ready = dict(poller.poll(round(timeout_s * 1000)))
        if self._wake_read in ready:
            os.read(self._wake_read, 4096)
        if client.link_monitor in ready:
            client.read_link(time.monotonic())

    def _take_commands(self, client: PipelineTransport, now: float) -> None:
        while True:
            try:
                command, ticket, reason = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "submit" and ticket is not None:
                self._book.unadmitted.append(ticket)
                self._book.start(client.scheduler, ticket)
            elif command == "cancel" and ticket is not None:
                self._cancel(client, ticket, reason, now)
            elif command == "cancel_all":
                for live in list(self._book.live.values()):
                    self._cancel(client, live, reason, now)

    def _cancel(self, client: PipelineTransport, ticket: Ticket, reason: SkippyError | None, now: float) -> None:
        if ticket.ended:
            return
        ticket.cancel_reason = reason or RequestCancelled(f"request {ticket.request_id} was cancelled")
        if ticket.session is not None:  # its other choices with it
            client.perform(client.scheduler.cancel(ticket.session, now), self._book.on_action)

    def _publish(self, client: PipelineTransport, now: float) -> None:
        scheduler = client.scheduler
        for event in scheduler.watch.take_events():
            self._on_stage_event(event)
        silent = tuple(scheduler.liveness.missing_since(now - HEALTH_SILENCE_S))
        admitted = self._book.take_admitted()
        with self._lock:  # submit() reads and changes these under the same lock
            self._queued -= admitted
            self._running = scheduler.active
            down = tuple(scheduler.down)
            self._health = Health(ready=not silent and not down and not self._draining, silent=silent,
                                  draining=self._draining, down=down, starved=tuple(scheduler.starved(now)),
                                  stages=scheduler.watch.statuses(), figures=scheduler.figures.snapshot(now))
            if not self._book.live and self._queued == 0:
                self._idle.set()
            else:
                self._idle.clear()
