"""The gateway's ZeroMQ request API: a ROUTER serving generations as JSON frames (docs/PROTOCOL.md §8).

Two socket-free parts decide: `parse_command` reads one client message into a command (or an
`ApiError` to answer), and `ClientTable` keeps the outstanding requests by (client identity,
request id) with the time each client was last heard, so silent clients and overdue requests
can be found; it holds each request's slot under the per-client cap (`backend.ClientLimiter`),
released when the request leaves the table, however it ends. The shell, `ZmqRequestApi`, moves
frames on the gateway's asyncio loop. It serves through the HTTP API's `GatewayState` (same startup
and drain answers, same prompt preparation) and validates fields with `openai_api`, so both APIs
accept exactly the same requests (`embed` with `embedding_api`). Prompts are tokenized off the
loop, and so are `tokenize` and `detokenize` requests, which are answered there without the
engine; an `embed` submits every input at once, one request under the per-client cap, and its
`embedding` frame is built off the loop. The engine's events come from its thread via
`loop.call_soon_threadsafe`. Every frame for a client goes through
`FrameSender`, which queues it in that client's socket-free `Outbox` queue, against the client's
send budget, and hands it to libzmq as libzmq takes it, retrying on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import zmq
import zmq.asyncio

from skippy_zmq.driver.engine import Delta, Done, Event, EventCallback, Failed
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.errors import ConfigError, RequestCancelled, SkippyError
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.gateway.state import (
    DEADLINE_GRACE_S,
    AttachedEngine,
    ClientLimiter,
    EngineLike,
    GatewayState,
)
from skippy_zmq.gateway.zmq_outbox import ZMQ_SNDHWM, Offer, Outbox, SendBudget
from skippy_zmq.gateway.zmq_requests import (
    CLIENT_SILENCE_S,
    Cancel,
    ClientTable,
    Detokenize,
    Embed,
    EmbeddingGather,
    FrameShape,
    PendingRequest,
    Ping,
    Refused,
    Submit,
    TextCommand,
    Tokenize,
    check_embedding_size,
    delta_frame,
    error_frame,
    final_frame,
    info_frame,
    pong_frames,
    read_command,
    text_answer,
    with_id,
)
from skippy_zmq.security.admission import Admission
from skippy_zmq.security.curve import REQUESTS_DOMAIN, CurveGuard, CurveSetup, RefusalHandler
from skippy_zmq.tcp import keep_alive
from skippy_zmq.wire.request_api import (
    JsonObject,
    encode_frame,
)

SWEEP_INTERVAL_S = 1.0
"""How often silent clients and overdue requests are looked for (more often for short silences)."""
MAX_MSG_SIZE = 4 << 20
"""ZMQ_MAXMSGSIZE of the ROUTER (per frame): above it ZeroMQ drops the client's connection unanswered."""
RCV_HWM = 128
"""ZMQ_RCVHWM of the ROUTER: whole messages libzmq queues per connection before it stops reading from
it (backpressure, nothing is dropped); twice the default per-client cap, so a legitimate burst fits."""
_POLL_MS = 200  # longest wait of the receive loop between sweeps
_RETRY_S = 0.01  # how soon frames libzmq did not take are offered again
_RECEIVE_SLICE_S = 0.02  # longest run of received messages handled before other tasks get the loop

_log = logging.getLogger("skippy_zmq.gateway")


# --- the socket shell -----------------------------------------------------------------------------


def _submit_runs(engine: EngineLike, requests: Sequence[GenerationRequest],
                 on_event: Callable[[int], EventCallback]) -> list[Any]:
    """Submit every request at once (an embed's inputs), `on_event(i)` hearing the i-th; the tickets.
    A refusal part way (QueueFull) cancels those already submitted and is raised."""
    tickets: list[Any] = []
    try:
        for index, request in enumerate(requests):
            tickets.append(engine.submit(request, on_event(index)))
    except BaseException:
        for ticket in tickets:
            engine.cancel(ticket)
        raise
    return tickets


def client_key(identity: bytes, message: zmq.Frame, *, curve: bool = False) -> str:
    """Whom a request counts against under the per-client cap: with CURVE, the client's public
    key (the ZAP handler's user id: it outlives one connection); else the connection's routing id."""
    if curve:
        with contextlib.suppress(zmq.ZMQError):
            return "curve:" + str(message.get("User-Id"))
    return identity.hex()


def bind_router(context: zmq.asyncio.Context, bind: str, curve: CurveSetup | None = None,
                on_refused: RefusalHandler | None = None) -> tuple[zmq.asyncio.Socket, CurveGuard]:
    """The request API's ROUTER, bound at `bind` with its options and limits, and its CURVE guard
    (a CURVE server admitting clients_dir's keys when `curve` is given); ConfigError if it cannot bind."""
    # The ZAP handler answers on a plain shadow of the asyncio context; it admits the request domain only.
    admitted = frozenset() if curve is None else curve.admitted.get(REQUESTS_DOMAIN, frozenset())
    admission = Admission({REQUESTS_DOMAIN: admitted})
    guard = CurveGuard(zmq.Context.shadow(context.underlying), curve, on_refused, admission=admission)
    sock = context.socket(zmq.ROUTER)
    keep_alive(sock)
    guard.serve(sock, REQUESTS_DOMAIN)
    for option, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.MAXMSGSIZE, MAX_MSG_SIZE),
                          (zmq.RCVHWM, RCV_HWM),
                          (zmq.SNDHWM, ZMQ_SNDHWM)):  # beyond it a client's frames wait in its Outbox queue
        sock.setsockopt(option, value)
    try:
        sock.bind(bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        guard.close()
        raise ConfigError(f"--zmq-bind {bind}: cannot bind the request API: {exc}") from exc
    return sock, guard


def _recv_rest(io: zmq.Socket[bytes]) -> tuple[zmq.Frame | None, int]:
    """The first frame after the routing id and how many there were; the others are dropped unread.

    libzmq hands a message over whole, so its frames are all here; holding only the first keeps a
    message of many frames from being copied into Python before it is refused.
    """
    first: zmq.Frame | None = None
    count = 0
    while io.getsockopt(zmq.RCVMORE):
        frame = io.recv(copy=False)
        count += 1
        if first is None:
            first = frame
    return first, count


def _receive_slice(io: zmq.Socket[bytes], handle: Callable[[bytes, zmq.Frame | None, int], None]) -> None:
    """Hand the messages waiting on `io` to `handle` (routing id, first frame, frame count) for at
    most `_RECEIVE_SLICE_S`, then let other tasks run; a message that fails is logged, never raised."""
    until = time.monotonic() + _RECEIVE_SLICE_S
    for _ in range(256):  # then let other tasks run; the next poll returns at once
        if time.monotonic() > until:
            return  # a flood of costly messages (pings naming 256 ids) must not hold the loop
        try:
            identity = io.recv(flags=zmq.DONTWAIT)
        except zmq.Again:
            return
        first, count = _recv_rest(io)
        try:
            handle(identity, first, count)
        except Exception:  # noqa: BLE001 - a bug in handling one message must not stop the API
            _log.exception("request API: failed to handle a message from client %s", identity.hex())


def _work(serving: AttachedEngine, command: Submit | Embed | TextCommand,
          ) -> Callable[[], list[GenerationRequest] | JsonObject]:
    """What a request does off the loop before the engine: tokenize (a generation's prompt, an embed's
    inputs) into its engine requests, or the whole answer of a tokenize or detokenize."""
    if isinstance(command, Submit):
        params = command.params
        return lambda: [serving.prepare(params)]
    if isinstance(command, Embed):
        return functools.partial(serving.prepare_embeddings, command.params)
    return functools.partial(text_answer, serving.tokenizer, command)


def _woken_by_close(closing: bool) -> bool:
    """Whether a cancelled poll was close() waking run() up (not run()'s own task being cancelled)."""
    task = asyncio.current_task()
    return closing and (task is None or not task.cancelling())


def _cancelled(entry: PendingRequest) -> RequestCancelled:
    return RequestCancelled(f"request {entry.request_id!r} was cancelled by its client")


class FrameSender:
    """Sends the request API's frames without waiting: each client's go through its `Outbox` queue,
    handed to libzmq as it takes them; `on_lost(identity, why)` hears of a client cut off (logged
    and counted) or gone, to cancel its requests."""

    def __init__(self, io: zmq.Socket[bytes], outbox: Outbox, on_lost: Callable[[bytes, str], None],
                 metrics: GatewayMetrics | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._io = io
        self.outbox = outbox
        self._on_lost = on_lost
        self._metrics = metrics
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None  # set while retries may be scheduled
        self._retry: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on, frames libzmq did not take are offered again on `loop` until it takes them."""
        self._loop = loop

    def stop(self) -> None:
        """No more retries (the socket is closing)."""
        self._loop = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def post(self, identity: bytes, frame: JsonObject) -> None:
        """Queue `frame` for the client and hand over what libzmq takes now; the rest is retried soon."""
        if self.send(identity, frame, self._clock()):
            self._retry_soon()

    def _retry_soon(self) -> None:
        if self._retry is None and self._loop is not None:
            self._retry = self._loop.call_later(_RETRY_S, self._flush_backlog)

    def _flush_backlog(self) -> None:
        self._retry = None
        if self._loop is not None and self.flush_all(self._clock()):
            self._retry_soon()

    def send(self, identity: bytes, frame: JsonObject, now: float) -> bool:
        """Queue `frame` for the client and hand over what libzmq takes now; True if some is left."""
        offer = self.outbox.offer(identity, encode_frame(frame), now)
        if offer is Offer.CUT_OFF:
            budget = self.outbox.budget
            self._cut_off(identity, f"it has more queued than its send budget of {budget.max_bytes} bytes "
                          f"or {budget.max_frames} frames: it does not read its frames")
        return offer is Offer.QUEUED and self.flush(identity, now)

    def flush(self, identity: bytes, now: float) -> bool:
        """Hand the client's held frames to libzmq, in order, until it takes no more; True if some are left."""
        while (data := self.outbox.next_frame(identity)) is not None:
            try:
                self._io.send_multipart([identity, data], flags=zmq.DONTWAIT)
            except zmq.Again:
                return True  # libzmq holds ZMQ_SNDHWM frames for this client: offer them again soon
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    _log.warning("request API: cannot send to client %s: %s", identity.hex(), exc)
                self.outbox.forget(identity)
                self._on_lost(identity, "disconnected")
                return False
            self.outbox.took(identity, now)
        return False

    def flush_all(self, now: float) -> bool:
        """Offer every backlogged client's frames to libzmq again, cut off the stalled ones; True if
        some are left."""
        for identity in self.outbox.stalled(now):
            self.outbox.cut_off(identity)
            self._cut_off(identity, f"it took none of its frames for {self.outbox.budget.stall_s:g} s")
        left = [self.flush(identity, now) for identity in self.outbox.backlogged()]
        return any(left)

    def _cut_off(self, identity: bytes, why: str) -> None:
        _log.warning("request API: cut off client %s: %s", identity.hex(), why)
        if self._metrics is not None:
            self._metrics.client_cut_off()
        self._on_lost(identity, why)


class ZmqRequestApi:
    """The ROUTER of the request API on the gateway's asyncio loop (see module docstring)."""

    def __init__(
        self,
        backend: GatewayState,
        bind: str,
        *,
        metrics: GatewayMetrics | None = None,
        context: zmq.asyncio.Context | None = None,
        client_silence_s: float = CLIENT_SILENCE_S,
        max_requests_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        curve: CurveSetup | None = None,
        on_handshake_refused: RefusalHandler | None = None,
        send_budget: SendBudget | None = None,
    ) -> None:
        """Bind the ROUTER at `bind` (ConfigError if it cannot); call from the loop's thread."""
        self._backend, self._metrics = backend, metrics
        on_refused = None if metrics is None else functools.partial(metrics.client_cap_refused, "zmq")
        limiter = ClientLimiter(max_requests_per_client, on_refused=on_refused)
        self._table = ClientTable(client_silence_s, limiter=limiter)
        self._clock = clock
        context = context or zmq.asyncio.Context.instance()
        self._curve = curve is not None
        self._sock, self._guard = bind_router(context, bind, curve, on_handshake_refused)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # non-blocking sends and receives go through a plain shadow of the same socket: they never
        # wait, and their errors are raised here rather than stored in futures
        self._io: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self.sender = FrameSender(self._io, Outbox(send_budget), self._drop_client, metrics, clock=clock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._poll: asyncio.Future[Any] | None = None
        self._stopped = asyncio.Event()
        self.rejected = 0  # messages answered with an error before any request started

    @property
    def outstanding(self) -> int:
        """Requests not yet ended."""
        return len(self._table)

    async def run(self) -> None:
        """Serve until close(); a bad client message is answered and never ends the loop."""
        self._loop = asyncio.get_running_loop()
        self.sender.start(self._loop)
        sweep_s = min(SWEEP_INTERVAL_S, self._table.silence_s / 3)
        next_sweep = self._clock() + sweep_s
        try:
            while not self._closing:
                self._poll = asyncio.ensure_future(self._sock.poll(_POLL_MS))
                try:
                    ready = await self._poll
                except asyncio.CancelledError:
                    if _woken_by_close(self._closing):
                        break
                    raise
                if ready:
                    _receive_slice(self._io, self._handle)
                if self._clock() >= next_sweep:
                    next_sweep = self._clock() + sweep_s
                    self._sweep()
        finally:
            self._stopped.set()

    async def close(self) -> None:
        """Stop run(), answer and cancel what is outstanding (best effort), close the socket.

        Drain the engine first: requests that finish meanwhile get their final frames.
        """
        if self._sock.closed:
            return
        self._closing = True
        if self._poll is not None:
            self._poll.cancel()
        if self._loop is not None:
            await asyncio.wait_for(self._stopped.wait(), timeout=5.0)
        for task in list(self._tasks):
            task.cancel()
        gone = ApiError.unavailable("the gateway is shutting down")
        for identity in self._table.identities():
            for entry in self._table.forget(identity):
                entry.cancel()
                self._count(503)
                self.sender.post(identity, error_frame(entry.request_id, gone))
        self.sender.stop()
        self._sock.close(linger=0)
        self._guard.close()

    # --- receiving ----------------------------------------------------------------------------

    def _handle(self, identity: bytes, message: zmq.Frame | None, count: int) -> None:
        now = self._clock()
        if self.sender.outbox.is_cut_off(identity):
            return  # nothing is sent to it any more; it must reconnect (a new routing id) to be served
        self._table.heard(identity, now)
        command = read_command(count, None if message is None else message.bytes, self._backend.sampling)
        if isinstance(command, Refused):
            self._reject(identity, command.request_id, command.error)
            return
        if isinstance(command, Submit | Embed | Tokenize | Detokenize):
            assert message is not None  # a command was read from it
            self._submit(identity, client_key(identity, message, curve=self._curve), command, now)
        elif isinstance(command, Cancel):
            self._cancel(identity, command.request_id)
        elif isinstance(command, Ping):
            ready = self._backend.health()[0]
            for frame in pong_frames(command, ready, lambda lost: self._table.get(identity, lost) is not None):
                self.sender.post(identity, frame)
        else:
            self.sender.post(identity, with_id(info_frame(self._backend, self._table.silence_s), command.request_id))

    def _reject(self, identity: bytes, request_id: str | None, error: ApiError) -> None:
        self.rejected += 1
        _log.info("request API: refused a message from client %s: %s", identity.hex(), error.message)
        self._count(error.status)
        self.sender.post(identity, error_frame(request_id, error, refused=True))

    def _submit(self, identity: bytes, client: str, command: Submit | Embed | TextCommand, now: float) -> None:
        """Open a generation, an embed, or a tokenize or detokenize (answered without the engine queue,
        but outstanding like any request: the per-client cap, unique ids, pings naming it)."""
        params = command.params if isinstance(command, Submit | Embed) else None
        try:
            if params is not None:
                self._backend.check_model(params.model)
            serving = self._backend.serving()  # 503 while starting, draining or not ready
            if isinstance(command, Embed):
                check_embedding_size(command.params, serving.n_embd, self.sender.outbox.budget.max_bytes)
            shape = _frame_shape(command, serving)
            entry = self._table.open(identity, command.request_id, now, stream=shape.streamed, client=client,
                                     shape=shape)
        except ApiError as exc:
            self._reject(identity, command.request_id, exc)
            return
        self._spawn(self._start(entry, serving, command))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None  # messages are only received inside run()
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, entry: PendingRequest, serving: AttachedEngine,
                     command: Submit | Embed | TextCommand) -> None:
        """Tokenize off the loop (a long prompt takes a while), then submit unless cancelled meanwhile
        (an embed: every input at once); a tokenize or detokenize is answered then and there."""
        try:
            prepared = await asyncio.to_thread(_work(serving, command))
            if not self._table.is_open(entry):
                return  # the client went away meanwhile
            if entry.cancelled:
                raise _cancelled(entry)
            if isinstance(prepared, dict):
                self._answer(entry, prepared, 200)
                return
            engine = entry.engine = serving.engine
            entry.deadline = self._clock() + engine.request_timeout_s + DEADLINE_GRACE_S
            if isinstance(command, Embed):
                entry.gather = EmbeddingGather(command.params, len(prepared))
            entry.tickets = _submit_runs(engine, prepared,
                                         lambda index: functools.partial(self._from_engine_thread, entry, index))
        except SkippyError as exc:
            self._end(entry, ApiError.from_exception(exc))
        except Exception:  # noqa: BLE001 - answered as a 500; the API goes on
            _log.exception("request API: request %r failed to start", entry.request_id)
            self._end(entry, ApiError.from_exception(SkippyError("internal error while starting the request")))

    def _cancel(self, identity: bytes, request_id: str) -> None:
        entry = self._table.get(identity, request_id)
        if entry is not None and not entry.cancelled:  # idempotent: unknown, ended or already cancelled
            entry.cancel()  # it ends with Failed(RequestCancelled): the 499 frame

    def _sweep(self) -> None:
        now = self._clock()
        for identity in self._table.silent(now):
            self._drop_client(identity, f"silent for more than {self._table.silence_s:g} s")
        self.sender.outbox.expire(now)
        for entry in self._table.overdue(now):
            entry.cancel()
            self._end(entry, ApiError(504, "the request did not finish before its deadline", kind="timeout_error",
                                      code="request_timeout"))

    def _drop_client(self, identity: bytes, why: str) -> None:
        """The client is gone or silent: cancel its requests without answering."""
        for entry in self._table.forget(identity):
            _log.info("request API: cancelling request %r of client %s: %s", entry.request_id, identity.hex(), why)
            entry.cancel()
            self._count(499)

    # --- engine events ------------------------------------------------------------------------

    def _from_engine_thread(self, entry: PendingRequest, index: int, event: Event) -> None:
        """Called on the engine thread with an event of run `index` (an embed's input): hand it to the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the gateway is shutting down
            loop.call_soon_threadsafe(self._deliver, entry, index, event)

    def _deliver(self, entry: PendingRequest, index: int, event: Event) -> None:
        if not self._table.is_open(entry) or self._sock.closed:
            return  # ended, or its client was dropped
        if entry.gather is not None:
            outcome = entry.gather.take(index, event)
            if isinstance(outcome, ApiError):
                entry.cancel()  # one input failing fails the request: the others' runs end too
                self._end(entry, outcome)
            elif outcome:
                self._spawn(self._embedded(entry, entry.gather))
        elif isinstance(event, Delta):
            if self._metrics is not None and event.choice == 0:  # latencies of one stream, as with n = 1
                entry.tokens(len(event.token_ids), self._clock(), self._metrics)
            if entry.stream and (event.text or event.token_ids):
                self.sender.post(entry.identity, delta_frame(entry.request_id, event, entry.shape))
        elif isinstance(event, Done):
            if self._metrics is not None:
                self._metrics.choices_ended(self._clock() - entry.opened, event.results)
            self._answer(entry, final_frame(entry.request_id, event.results, self._backend.model_id, entry.shape), 200)
        elif isinstance(event, Failed):
            self._end(entry, ApiError.from_exception(event.error))

    async def _embedded(self, entry: PendingRequest, gather: EmbeddingGather) -> None:
        """Answer an embed whose every input has its vector, the frame built off the loop."""
        frame = await asyncio.to_thread(gather.frame, entry.request_id, self._backend.model_id)
        if entry.cancelled:  # the cancel came after the last vector: no run is left to end with a 499
            self._end(entry, ApiError.from_exception(_cancelled(entry)))
            return
        if self._metrics is not None:
            self._metrics.finished(self._clock() - entry.opened, gather.prompt_tokens, 0)
        self._answer(entry, frame, 200)

    # --- sending ------------------------------------------------------------------------------

    def _end(self, entry: PendingRequest, error: ApiError) -> None:
        self._answer(entry, error_frame(entry.request_id, error), error.status)

    def _answer(self, entry: PendingRequest, frame: JsonObject, status: int) -> None:
        """The request's last frame: it leaves the table, counted by `status`."""
        if not self._table.is_open(entry):
            return  # its client was dropped: nobody to answer
        self._table.close(entry)
        self._count(status)
        self.sender.post(entry.identity, frame)

    def _count(self, status: int) -> None:
        if self._metrics is not None:
            self._metrics.request("zmq", status)


def _frame_shape(command: Submit | Embed | TextCommand, serving: AttachedEngine) -> FrameShape:
    """What a command's frames carry: a generation's by its fields (and tools), the others' whole."""
    if isinstance(command, Submit):
        return FrameShape.of(command.params, serving.tool_answers(command.params),
                             serving.reasoning_reader(command.params))
    return FrameShape(streamed=False)
