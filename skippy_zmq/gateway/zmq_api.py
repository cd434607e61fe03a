"""The gateway's ZeroMQ request API: a ROUTER serving generations as JSON frames (docs/PROTOCOL.md §8).

Two socket-free parts decide: `parse_command` reads one client message into a command (or an
`ApiError` to answer), and `ClientTable` keeps the outstanding requests by (client identity,
request id) with the time each client was last heard, so silent clients and overdue requests
can be found; it holds each request's slot under the per-client cap (`backend.ClientLimiter`),
released when the request leaves the table, however it ends. The shell, `ZmqRequestApi`, moves
frames on the gateway's asyncio loop. It serves through the HTTP API's `Backend` (same startup
and drain answers, same prompt preparation) and validates fields with `openai_api`, so both APIs
accept exactly the same requests. Prompts are tokenized off the loop; the engine's events come
from its thread via `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import zmq
import zmq.asyncio

from skippy_zmq.client import (
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_WAITING_IDS,
    PROTOCOL_VERSION,
    RESERVED_FIELDS,
    encode_frame,
)
from skippy_zmq.engine import Delta, Done, Event, Failed
from skippy_zmq.errors import ConfigError, RequestCancelled, SkippyError
from skippy_zmq.gateway.backend import DEADLINE_GRACE_S, Backend, ClientLimiter, ClientSlot, EngineLike, Serving
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.openai_api import ApiError, CompletionParams, Endpoint, Usage, finish_reason
from skippy_zmq.security import REQUESTS_DOMAIN, Admission, CurveSetup, RefusalHandler, ZapHandler

SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)
"""Protocol versions this gateway speaks (reported by `info`)."""
CLIENT_SILENCE_S = 15.0
"""A client with outstanding requests not heard from for longer has them cancelled (3 pings)."""
SWEEP_INTERVAL_S = 1.0
"""How often silent clients and overdue requests are looked for (more often for short silences)."""
MAX_MSG_SIZE = 4 << 20
"""ZMQ_MAXMSGSIZE of the ROUTER (per frame): above it ZeroMQ drops the client's connection unanswered."""
RCV_HWM = 128
"""ZMQ_RCVHWM of the ROUTER: whole messages libzmq queues per connection before it stops reading from
it (backpressure, nothing is dropped); twice the default per-client cap, so a legitimate burst fits."""
_POLL_MS = 200  # longest wait of the receive loop between sweeps

JsonObject: TypeAlias = dict[str, Any]
_log = logging.getLogger("skippy_zmq.gateway")

_ENDPOINTS = {"completion": Endpoint.COMPLETIONS, "chat": Endpoint.CHAT}
_DEFAULT_KINDS = {400: "invalid_request", 404: "not_found", 409: "duplicate_id", 413: "too_large"}


# --- commands (socket-free) ---------------------------------------------------------------------


@attrs.frozen
class Submit:
    """A completion or chat request, its fields already validated."""

    request_id: str
    params: CompletionParams


@attrs.frozen
class Cancel:
    """Give up on an outstanding request."""

    request_id: str


@attrs.frozen
class Ping:
    """A heartbeat; answered with a pong, and with a 404 error frame for each id in `waiting`
    that is not one of the client's outstanding requests."""

    request_id: str | None = None
    waiting: tuple[str, ...] = ()


@attrs.frozen
class Info:
    """Ask what the gateway serves."""

    request_id: str | None = None


Command: TypeAlias = Submit | Cancel | Ping | Info


def decode_message(frames: Sequence[bytes]) -> JsonObject:
    """The JSON object of a client message (the frames after the routing id); ApiError otherwise."""
    check_frame_count(len(frames))
    return decode_frame(frames[0])


def check_frame_count(count: int) -> None:
    """ApiError 400 unless a message has exactly one frame after the routing id."""
    if count != 1:
        raise ApiError.invalid(None, f"a request is one frame holding a JSON object; got {count} frames")


def decode_frame(data: bytes) -> JsonObject:
    """The JSON object of a message's one frame; ApiError 413 above the frame limit, 400 otherwise."""
    if len(data) > MAX_FRAME_BYTES:
        raise ApiError(413, f"request frame of {len(data)} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes",
                       code="too_large")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError.invalid(None, f"the request frame is not UTF-8 JSON: {data[:60]!r}") from None
    if not isinstance(obj, dict):
        raise ApiError.invalid(None, f"the request frame must hold a JSON object, not {type(obj).__name__}")
    return obj


def readable_id(obj: Mapping[str, Any]) -> str | None:
    """The message's request id when it is a valid one (error frames echo it), else None."""
    request_id = obj.get("id")
    ok = isinstance(request_id, str) and 1 <= len(request_id) <= MAX_ID_CHARS
    return request_id if ok else None


def parse_command(obj: Mapping[str, Any]) -> Command:
    """The command of a decoded message; ApiError (400) naming the bad field otherwise."""
    version = obj.get("v")
    if not (type(version) is int and version in SUPPORTED_VERSIONS):
        raise ApiError.invalid("v", f"unsupported protocol version {version!r}; this gateway speaks "
                               + ", ".join(map(str, SUPPORTED_VERSIONS)))
    kind = obj.get("type")
    if "id" in obj and readable_id(obj) is None:
        raise ApiError.invalid("id", f"id must be a string of 1 to {MAX_ID_CHARS} characters, got {obj['id']!r:.80}")
    request_id = readable_id(obj)
    endpoint = _ENDPOINTS.get(kind) if isinstance(kind, str) else None
    if endpoint is not None:
        if request_id is None:
            raise ApiError.invalid("id", f"a {kind} request needs an id")
        body = {name: value for name, value in obj.items() if name not in RESERVED_FIELDS}
        if body.get("stream") is None:
            body["stream"] = True  # the request API streams unless asked not to
        return Submit(request_id, CompletionParams.from_body(endpoint, body))
    if kind not in ("cancel", "ping", "info"):
        raise ApiError.invalid("type", f"unknown type {kind!r}; expected completion, chat, cancel, ping or info")
    allowed = RESERVED_FIELDS | ({"waiting"} if kind == "ping" else set())
    extra = sorted(set(obj) - allowed)
    if extra:
        fields = "v, type, id and waiting" if kind == "ping" else "v, type and id"
        article = "an" if kind == "info" else "a"
        raise ApiError.invalid(extra[0], f"unknown field {extra[0]!r}: {article} {kind} message has only {fields}")
    if kind == "cancel":
        if request_id is None:
            raise ApiError.invalid("id", "a cancel needs the id of the request to cancel")
        return Cancel(request_id)
    if kind == "ping":
        return Ping(request_id, _waiting_ids(obj.get("waiting", [])))
    return Info(request_id)


def _waiting_ids(value: Any) -> tuple[str, ...]:
    """A ping's `waiting` list: up to MAX_WAITING_IDS request ids; ApiError (400) otherwise."""
    if not isinstance(value, list) or len(value) > MAX_WAITING_IDS:
        raise ApiError.invalid("waiting", f"waiting must be a list of at most {MAX_WAITING_IDS} request ids, "
                               f"got {value!r:.80}")
    ids = tuple(readable_id({"id": item}) for item in value)
    if any(request_id is None for request_id in ids):
        raise ApiError.invalid("waiting", f"waiting holds ids of 1 to {MAX_ID_CHARS} characters, got {value!r:.80}")
    return tuple(request_id for request_id in ids if request_id is not None)


def error_frame(request_id: str | None, error: ApiError, *, refused: bool = False) -> JsonObject:
    """The `error` frame answering `error` (with `retry_after_s` for 429 and 503). `refused`:
    it answers a message that started nothing, so a running request with the same id (the
    409 case) goes on; the frame says so with `"refused": true`."""
    kind = error.code or _DEFAULT_KINDS.get(error.status, "internal_error")
    frame: JsonObject = {"v": PROTOCOL_VERSION, "type": "error", "id": request_id, "code": error.status,
                         "error": kind, "message": error.message, "param": error.param}
    if refused:
        frame["refused"] = True
    if error.retry_after_s is not None:
        frame["retry_after_s"] = error.retry_after_s
    return frame


# --- outstanding requests (socket-free) -----------------------------------------------------------


@attrs.define(eq=False)
class PendingRequest:
    """One outstanding request of one client."""

    identity: bytes
    request_id: str
    stream: bool
    opened: float  # clock time the request arrived
    slot: ClientSlot | None = None  # its place under the per-client cap, released when it leaves the table
    deadline: float = float("inf")  # clock time after which the API ends it itself (504)
    engine: EngineLike | None = None
    ticket: Any = None  # the engine's ticket; None while the prompt is being tokenized
    cancelled: bool = False
    last_token: float | None = None  # clock time of the latest tokens (for the latency metrics)

    def tokens(self, count: int, now: float, metrics: GatewayMetrics) -> None:
        """Observe `count` new tokens in the latency histograms."""
        if not count:
            return
        if self.last_token is None:
            metrics.first_token(now - self.opened)
            if count > 1:
                metrics.inter_token(0.0, count - 1)
        else:
            metrics.inter_token(now - self.last_token, count)
        self.last_token = now


class ClientTable:
    """Outstanding requests by (client identity, request id) and when each client was last heard.

    A client is tracked only while it has outstanding requests, so idle clients cost nothing. The
    per-client cap is `limiter`'s (default: one of `max_per_client`), keyed by the `client` string
    `open` is given (default: the routing id), so several connections may count as one client.
    """

    def __init__(self, silence_s: float = CLIENT_SILENCE_S, max_per_client: int | None = None, *,
                 limiter: ClientLimiter | None = None) -> None:
        self.silence_s = silence_s
        self.limiter = limiter if limiter is not None else ClientLimiter(max_per_client)
        self._requests: dict[bytes, dict[str, PendingRequest]] = {}
        self._heard: dict[bytes, float] = {}

    def __len__(self) -> int:
        return sum(len(requests) for requests in self._requests.values())

    def heard(self, identity: bytes, now: float) -> None:
        """Any message from a client proves it alive."""
        if identity in self._heard:
            self._heard[identity] = now

    def open(self, identity: bytes, request_id: str, now: float, *, stream: bool,
             client: str | None = None) -> PendingRequest:
        """Track a new request; ApiError 409 for a running id, 429 over the per-client cap."""
        requests = self._requests.get(identity, {})
        if request_id in requests:
            raise ApiError(409, f"request id {request_id!r} is still running; ids must be unique among "
                           "a client's outstanding requests", param="id", code="duplicate_id")
        slot = self.limiter.acquire(client if client is not None else identity.hex())
        entry = PendingRequest(identity, request_id, stream, now, slot)
        self._requests.setdefault(identity, {})[request_id] = entry
        self._heard[identity] = now
        return entry

    def get(self, identity: bytes, request_id: str) -> PendingRequest | None:
        """The outstanding request, or None."""
        return self._requests.get(identity, {}).get(request_id)

    def is_open(self, entry: PendingRequest) -> bool:
        """Whether `entry` is still outstanding (not ended, not forgotten with its client)."""
        return self.get(entry.identity, entry.request_id) is entry

    def close(self, entry: PendingRequest) -> None:
        """The request ended; a client left with none is forgotten."""
        requests = self._requests.get(entry.identity)
        if requests is not None and requests.get(entry.request_id) is entry:
            del requests[entry.request_id]
            _release(entry)
            if not requests:
                del self._requests[entry.identity]
                del self._heard[entry.identity]

    def silent(self, now: float) -> list[bytes]:
        """Clients with outstanding requests not heard from for longer than `silence_s`."""
        return [identity for identity, heard in self._heard.items() if now - heard > self.silence_s]

    def overdue(self, now: float) -> list[PendingRequest]:
        """Requests past their deadline."""
        return [entry for requests in self._requests.values() for entry in requests.values() if now > entry.deadline]

    def forget(self, identity: bytes) -> list[PendingRequest]:
        """Drop a client (gone or silent) and return its outstanding requests."""
        self._heard.pop(identity, None)
        entries = list(self._requests.pop(identity, {}).values())
        for entry in entries:
            _release(entry)
        return entries

    def identities(self) -> list[bytes]:
        """Every client with outstanding requests."""
        return list(self._requests)


def _release(entry: PendingRequest) -> None:
    if entry.slot is not None:
        entry.slot.release()


# --- the socket shell -----------------------------------------------------------------------------


def client_key(identity: bytes, message: zmq.Frame, *, curve: bool = False) -> str:
    """Whom a request counts against under the per-client cap: with CURVE, the client's public
    key (the ZAP handler's user id: it outlives one connection); else the connection's routing id."""
    if curve:
        with contextlib.suppress(zmq.ZMQError):
            return "curve:" + str(message.get("User-Id"))
    return identity.hex()


def bind_router(context: zmq.asyncio.Context, bind: str, curve: CurveSetup | None = None) -> zmq.asyncio.Socket:
    """The request API's ROUTER, bound at `bind` with its options and limits (a CURVE server
    admitting clients_dir's keys when `curve` is given); ConfigError if it cannot bind."""
    sock = context.socket(zmq.ROUTER)
    if curve is not None:
        curve.serve(sock, REQUESTS_DOMAIN)
    for option, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.MAXMSGSIZE, MAX_MSG_SIZE),
                          (zmq.RCVHWM, RCV_HWM),
                          (zmq.SNDHWM, 0)):  # SNDHWM 0: a slow reader's frames wait; they are bounded by max_tokens
        sock.setsockopt(option, value)
    try:
        sock.bind(bind)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError(f"--zmq-bind {bind}: cannot bind the request API: {exc}") from exc
    return sock


class ZmqRequestApi:
    """The ROUTER of the request API on the gateway's asyncio loop (see module docstring)."""

    def __init__(
        self,
        backend: Backend,
        bind: str,
        *,
        metrics: GatewayMetrics | None = None,
        context: zmq.asyncio.Context | None = None,
        client_silence_s: float = CLIENT_SILENCE_S,
        max_requests_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        curve: CurveSetup | None = None,
        on_handshake_refused: RefusalHandler | None = None,
    ) -> None:
        """Bind the ROUTER at `bind` (ConfigError if it cannot); call from the loop's thread."""
        self._backend = backend
        self._metrics = metrics
        on_refused = None if metrics is None else functools.partial(metrics.client_cap_refused, "zmq")
        limiter = ClientLimiter(max_requests_per_client, on_refused=on_refused)
        self._table = ClientTable(client_silence_s, limiter=limiter)
        self._clock = clock
        context = context or zmq.asyncio.Context.instance()
        self._curve = curve is not None
        self._zap: ZapHandler | None = None
        if curve is not None:  # before the bind; the handler answers on a plain shadow of the context
            admitted = {REQUESTS_DOMAIN: curve.admitted.get(REQUESTS_DOMAIN, frozenset())}
            self._zap = ZapHandler(zmq.Context.shadow(context.underlying), Admission(admitted), on_handshake_refused)
        try:
            self._sock = bind_router(context, bind, curve)
        except BaseException:
            if self._zap is not None:
                self._zap.close()
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # non-blocking sends and receives go through a plain shadow of the same socket: they never
        # wait, and their errors are raised here rather than stored in futures
        self._io: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
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
        sweep_s = min(SWEEP_INTERVAL_S, self._table.silence_s / 3)
        next_sweep = self._clock() + sweep_s
        try:
            while not self._closing:
                self._poll = asyncio.ensure_future(self._sock.poll(_POLL_MS))
                try:
                    ready = await self._poll
                except asyncio.CancelledError:
                    if self._woken_by_close():
                        break
                    raise
                if ready:
                    self._receive_ready()
                if self._clock() >= next_sweep:
                    next_sweep = self._clock() + sweep_s
                    self._sweep()
        finally:
            self._stopped.set()

    def _woken_by_close(self) -> bool:
        """Whether a cancelled poll was close() waking run() up (not run()'s own task being cancelled)."""
        task = asyncio.current_task()
        return self._closing and (task is None or not task.cancelling())

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
                self._cancel_ticket(entry, "the gateway is shutting down")
                self._count(503)
                self._send(identity, error_frame(entry.request_id, gone))
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()

    # --- receiving ----------------------------------------------------------------------------

    def _receive_ready(self) -> None:
        for _ in range(256):  # then let other tasks run; the next poll returns at once
            try:
                identity = self._io.recv(flags=zmq.DONTWAIT)
            except zmq.Again:
                return
            first, count = self._recv_rest()
            try:
                self._handle(identity, first, count)
            except Exception:  # noqa: BLE001 - a bug in handling one message must not stop the API
                _log.exception("request API: failed to handle a message from client %s", identity.hex())

    def _recv_rest(self) -> tuple[zmq.Frame | None, int]:
        """The first frame after the routing id and how many there were; the others are dropped unread.

        libzmq hands a message over whole, so its frames are all here; holding only the first keeps a
        message of many frames from being copied into Python before it is refused.
        """
        first: zmq.Frame | None = None
        count = 0
        while self._io.getsockopt(zmq.RCVMORE):
            frame = self._io.recv(copy=False)
            count += 1
            if first is None:
                first = frame
        return first, count

    def _handle(self, identity: bytes, message: zmq.Frame | None, count: int) -> None:
        now = self._clock()
        self._table.heard(identity, now)
        request_id: str | None = None
        try:
            check_frame_count(count)
            assert message is not None  # one frame
            obj = decode_frame(message.bytes)
            request_id = readable_id(obj)
            command = parse_command(obj)
        except ApiError as exc:
            self._reject(identity, request_id, exc)
            return
        if isinstance(command, Submit):
            self._submit(identity, client_key(identity, message, curve=self._curve), command, now)
        elif isinstance(command, Cancel):
            self._cancel(identity, command.request_id)
        elif isinstance(command, Ping):
            pong = {"v": PROTOCOL_VERSION, "type": "pong", "ready": self._backend.health()[0]}
            self._send(identity, _with_id(pong, command.request_id))
            for lost in command.waiting:
                if self._table.get(identity, lost) is None:
                    # A client waits on a request this gateway does not hold (it restarted,
                    # or the request ended and its frames were lost): end the wait.
                    gone = ApiError(404, f"request {lost!r} is not running on this gateway; it ended or the "
                                    "gateway restarted", param="id", code="unknown_request")
                    self._send(identity, error_frame(lost, gone))
        else:
            self._send(identity, _with_id(info_frame(self._backend, self._table.silence_s), command.request_id))

    def _reject(self, identity: bytes, request_id: str | None, error: ApiError) -> None:
        self.rejected += 1
        _log.info("request API: refused a message from client %s: %s", identity.hex(), error.message)
        self._count(error.status)
        self._send(identity, error_frame(request_id, error, refused=True))

    def _submit(self, identity: bytes, client: str, command: Submit, now: float) -> None:
        try:
            command.params.check_model(self._backend.model_id)
            serving = self._backend.serving()  # 503 while starting, draining or not ready
            entry = self._table.open(identity, command.request_id, now, stream=command.params.stream, client=client)
        except ApiError as exc:
            self._reject(identity, command.request_id, exc)
            return
        assert self._loop is not None  # messages are only received inside run()
        task = self._loop.create_task(self._start(entry, serving, command.params))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, entry: PendingRequest, serving: Serving, params: CompletionParams) -> None:
        """Tokenize off the loop (a long prompt takes a while), then submit unless cancelled meanwhile."""
        try:
            request = await asyncio.to_thread(serving.prepare, params)
            if not self._table.is_open(entry):
                return  # the client went away meanwhile
            if entry.cancelled:
                raise RequestCancelled(f"request {entry.request_id!r} was cancelled by its client")
            engine = serving.engine
            entry.engine = engine
            entry.deadline = self._clock() + engine.request_timeout_s + DEADLINE_GRACE_S
            entry.ticket = engine.submit(request, functools.partial(self._from_engine_thread, entry))
        except SkippyError as exc:
            self._end(entry, ApiError.from_exception(exc))
        except Exception:  # noqa: BLE001 - answered as a 500; the API goes on
            _log.exception("request API: request %r failed to start", entry.request_id)
            self._end(entry, ApiError.from_exception(SkippyError("internal error while starting the request")))

    def _cancel(self, identity: bytes, request_id: str) -> None:
        entry = self._table.get(identity, request_id)
        if entry is None or entry.cancelled:
            return  # idempotent: unknown, ended or already cancelled
        entry.cancelled = True
        if entry.engine is not None:
            entry.engine.cancel(entry.ticket)  # it ends with Failed(RequestCancelled): the 499 frame

    def _sweep(self) -> None:
        now = self._clock()
        for identity in self._table.silent(now):
            self._drop_client(identity, f"silent for more than {self._table.silence_s:g} s")
        for entry in self._table.overdue(now):
            self._cancel_ticket(entry, "past its deadline")
            self._end(entry, ApiError(504, "the request did not finish before its deadline", kind="timeout_error",
                                      code="request_timeout"))

    def _drop_client(self, identity: bytes, why: str) -> None:
        """The client is gone or silent: cancel its requests without answering."""
        for entry in self._table.forget(identity):
            _log.info("request API: cancelling request %r of client %s: %s", entry.request_id, identity.hex(), why)
            self._cancel_ticket(entry, why)
            self._count(499)

    @staticmethod
    def _cancel_ticket(entry: PendingRequest, why: str) -> None:
        if not entry.cancelled:
            _log.debug("request API: request %r cancelled: %s", entry.request_id, why)
        entry.cancelled = True
        if entry.engine is not None:
            entry.engine.cancel(entry.ticket)

    # --- engine events ------------------------------------------------------------------------

    def _from_engine_thread(self, entry: PendingRequest, event: Event) -> None:
        """Called on the engine thread: hand the event to the loop, never block."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the gateway is shutting down
            loop.call_soon_threadsafe(self._deliver, entry, event)

    def _deliver(self, entry: PendingRequest, event: Event) -> None:
        if not self._table.is_open(entry) or self._sock.closed:
            return  # ended, or its client was dropped
        if isinstance(event, Delta):
            if self._metrics is not None:
                entry.tokens(len(event.token_ids), self._clock(), self._metrics)
            if entry.stream and (event.text or event.token_ids):
                self._send(entry.identity, {"v": PROTOCOL_VERSION, "type": "delta", "id": entry.request_id,
                                            "text": event.text, "token_ids": list(event.token_ids)})
        elif isinstance(event, Done):
            self._table.close(entry)
            result, usage = event.result, Usage.of(event.result)
            self._count(200)
            if self._metrics is not None:
                self._metrics.finished(self._clock() - entry.opened, usage.prompt_tokens, usage.completion_tokens)
            self._send(entry.identity, {
                "v": PROTOCOL_VERSION, "type": "final", "id": entry.request_id,
                "finish_reason": finish_reason(result.finish_reason), "text": result.text,
                "token_ids": list(result.tokens), "usage": usage.as_dict(), "model": self._backend.model_id,
            })
        elif isinstance(event, Failed):
            self._end(entry, ApiError.from_exception(event.error))

    # --- sending ------------------------------------------------------------------------------

    def _end(self, entry: PendingRequest, error: ApiError) -> None:
        if not self._table.is_open(entry):
            return  # its client was dropped: nobody to answer
        self._table.close(entry)
        self._count(error.status)
        self._send(entry.identity, error_frame(entry.request_id, error))

    def _count(self, status: int) -> None:
        if self._metrics is not None:
            self._metrics.request("zmq", status)

    def _send(self, identity: bytes, frame: JsonObject) -> None:
        """Send without waiting; a client that cannot be reached has its requests cancelled."""
        try:
            self._io.send_multipart([identity, encode_frame(frame)], flags=zmq.DONTWAIT)
        except zmq.Again:
            self._drop_client(identity, "stopped reading its frames")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                _log.warning("request API: cannot send to client %s: %s", identity.hex(), exc)
            self._drop_client(identity, "disconnected")


def info_frame(backend: Backend, client_silence_s: float) -> JsonObject:
    """The `info` frame: what the gateway serves and its protocol limits."""
    return {
        "v": PROTOCOL_VERSION, "type": "info", "model": backend.model_id, "ctx_size": backend.ctx_size,
        "ready": backend.health()[0], "versions": list(SUPPORTED_VERSIONS), "max_frame_bytes": MAX_FRAME_BYTES,
        "client_silence_s": client_silence_s,
    }


def _with_id(frame: JsonObject, request_id: str | None) -> JsonObject:
    return frame if request_id is None else {**frame, "id": request_id}
