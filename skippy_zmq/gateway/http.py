"""The HTTP API (docs/PROTOCOL.md §9) on aiohttp: OpenAI's routes, llama-server's own (`llama_api`), one
route table, one error middleware, and the bridge from the engine thread's events to each request's
asyncio task.

Limits: a request body above `MAX_BODY_BYTES` (1 MiB), as sent or once decoded by its
Content-Encoding, is a 413, one that takes longer than `BODY_TIMEOUT_S` to arrive a 408; a coding
other than gzip or deflate is a 415; a body that is not its coding, not UTF-8 JSON, or holds text
that is not valid Unicode is a 400 (docs/PROTOCOL.md §9.3). Every wait is bounded: the
engine ends each request by its deadline (`--request-timeout`), and the gateway gives up
`DEADLINE_GRACE_S` after that (504), cancelling the request. A client that goes away (its
connection closes while it waits, or a stream write fails or stalls until the deadline) has its
request cancelled at once, which frees its lanes within one engine step.

Access: with an API key, every route but /health, /metrics and the web page's (the routes marked `public`) needs
`Authorization: Bearer KEY` (or `X-Api-Key: KEY`), compared in constant time; otherwise 401 with `WWW-Authenticate`. The
check runs before the body is read. Fairness: each peer address may have at most
`--max-client-requests` generation requests in flight (`ClientLimiter`; 429 `too_many_requests`
beyond), counted from before the body is read to the request's end, so one client can neither fill
the queue nor hold more than that many request bodies in memory.

Browsers (`--cors-origins`, decided by `cors.CorsPolicy`): a CORS preflight is answered before the
API key check, 204 for an allowed origin and 403 for another; every answer to an allowed origin,
errors and event streams included, carries its Access-Control-Allow-Origin and Vary headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from skippy_zmq.driver.engine import Delta, Done, Event, Failed
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.errors import ConfigError, RequestError, SkippyError
from skippy_zmq.gateway import anthropic_api, vertex_api
from skippy_zmq.gateway.anthropic_api import MessageStream
from skippy_zmq.gateway.cors import CorsPolicy
from skippy_zmq.gateway.embedding_api import EmbeddingParams, per_token_response
from skippy_zmq.gateway.llama_api import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    LlamaExtras,
    NativeCompletion,
    NativeShape,
    ServerProps,
    TokenizeRequest,
    detokenize,
    read_json,
    stopping_word,
    timings,
    tokenize,
)
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.openai_api import (
    SSE_DONE,
    ApiError,
    Choice,
    ChoiceStreams,
    CompletionParams,
    Endpoint,
    JsonObject,
    ResponseShape,
    SseEvent,
    ToolAnswers,
    Usage,
    sse,
    token_piece,
)
from skippy_zmq.gateway.options import VertexSettings
from skippy_zmq.gateway.reasoning import ReasoningReader
from skippy_zmq.gateway.request_json import shown
from skippy_zmq.gateway.rerank_api import RerankParams
from skippy_zmq.gateway.responses_api import ResponsesRequest, ResponseStream, new_id, response
from skippy_zmq.gateway.stages_api import GatewayFigures, stages_body
from skippy_zmq.gateway.state import (
    DEADLINE_GRACE_S,
    AttachedEngine,
    ClientLimiter,
    ClientSlot,
    EngineLike,
    GatewayState,
)
from skippy_zmq.gateway.web_page import WebPage
from skippy_zmq.tokens.pooling import Pooling

MAX_BODY_BYTES = 1 << 20
"""Largest accepted request body (aiohttp's client_max_size): 1 MiB."""
CLIENT_CLOSED_REQUEST = 499
"""The status /metrics counts for a request whose client disconnected before its answer."""
BODY_TIMEOUT_S = 30.0
"""How long a client may take to send its request body (then 408)."""

_log = logging.getLogger("skippy_zmq.gateway")

Handler = Callable[["Gateway", web.Request], Awaitable[web.StreamResponse]]
ErrorBody = Callable[[ApiError], JsonObject]
"""An error's JSON object in a route's API (OpenAI's `ApiError.body`, Anthropic's `anthropic_api.error_body`)."""


@attrs.frozen
class Route:
    """One row of the route table."""

    method: str
    path: str
    handler: Handler
    public: bool = False  # answered without the API key
    wakes: bool = True  # needs the model: wakes a sleeping pipeline first (PROTOCOL §9.6, Sleeping)
    error_body: ErrorBody = ApiError.body  # the shape of its errors
    web: bool = False  # the web page's: left out with `serve --no-web`


def json_response(body: JsonObject | list[JsonObject], status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response (UTF-8, not ASCII-escaped): an object, or a list of them (llama-server's shapes)."""
    return web.json_response(body, status=status, headers=headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    # A lone surrogate, should one ever reach an answer, goes out as its JSON escape, not as an
    # encoding error in place of the answer (docs/PROTOCOL.md §9.3).
    return shown(json.dumps(obj, ensure_ascii=False))


def error_response(error: ApiError, body: ErrorBody = ApiError.body) -> web.Response:
    """An error object (OpenAI's unless `body` says) with its status; Retry-After for 429 and 503,
    WWW-Authenticate for 401."""
    headers: dict[str, str] = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if error.status == 401:  # RFC 6750: name the error only when a token was sent
        headers["WWW-Authenticate"] = 'Bearer error="invalid_token"' if error.code == "invalid_api_key" else "Bearer"
    return json_response(body(error), error.status, headers or None)


def check_api_key(authorization: str | None, api_key: bytes, x_api_key: str | None = None) -> None:
    """ApiError 401 unless `authorization` is `Bearer <api_key>`, or, without Authorization, `x_api_key` (the
    X-Api-Key header Anthropic's clients send, which llama-server accepts) is the key; compared in constant time."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if authorization is None and x_api_key is not None:
        scheme, token = "bearer", x_api_key.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError.unauthorized(key_given=False)
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: this gives the sent bytes back
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key):
        raise ApiError.unauthorized(key_given=True)


class Run:
    """One submitted request as the event loop sees it: the engine's events, in order."""

    def __init__(self, engine: EngineLike, request: GenerationRequest, deadline: float) -> None:
        """Submit `request` (QueueFull / EngineUnavailable propagate); events arrive from now on."""
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._engine = engine
        self.deadline = deadline  # loop time after which the gateway stops waiting
        self.ended = False
        self.ticket = engine.submit(request, self._on_event)

    def _on_event(self, event: Event) -> None:
        """Called on the engine thread: hand the event to the loop without blocking."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def next(self) -> Event:
        """The next event; ApiError 504 once the deadline passed (the request is cancelled)."""
        remaining = self.deadline - self._loop.time()
        try:
            event = await asyncio.wait_for(self._events.get(), max(remaining, 0.0))
        except TimeoutError:
            self.cancel()
            raise ApiError(504, "the request did not finish before its deadline", kind="timeout_error",
                           code="request_timeout") from None
        if not isinstance(event, Delta):
            self.ended = True
        return event

    def cancel(self) -> None:
        """Cancel the request unless it already ended (the engine's cancel is idempotent)."""
        if not self.ended:
            self.ended = True
            self._engine.cancel(self.ticket)

    def remaining(self) -> float:
        """Seconds until the deadline (at least a little, for a last write)."""
        return max(self.deadline - self._loop.time(), 0.1)


class _Timing:
    """Latency bookkeeping of one generation request for the metrics."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.last: float | None = None

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.first_token(now - self.started)
            if count > 1:
                self.metrics.inter_token(0.0, count - 1)
        else:
            self.metrics.inter_token(now - self.last, count)
        self.last = now

    def finished(self, usage: Usage, results: Sequence[GenerationResult]) -> None:
        self.metrics.finished(time.monotonic() - self.started, usage.prompt_tokens, usage.completion_tokens, results)


class Gateway:
    """The request handlers over one backend; `ROUTES` maps paths to them."""

    def __init__(self, backend: GatewayState, metrics: GatewayMetrics, limiter: ClientLimiter,
                 page: WebPage | None = None) -> None:
        """`page`: the web page's files (None: serve --no-web)."""
        self.backend = backend
        self.metrics = metrics
        self.limiter = limiter
        self.page = page

    async def health(self, _request: web.Request) -> web.StreamResponse:
        """200 when every stage heartbeats and the engine accepts requests, else 503 saying why."""
        ready, body = self.backend.health()
        return json_response(body, 200 if ready else 503)

    async def models(self, _request: web.Request) -> web.StreamResponse:
        """The one served model, with its context length."""
        return json_response({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: web.Request) -> web.StreamResponse:
        """`/v1/models/{id}`: the served model for any of its served names, or 404 for another id."""
        self.backend.find_model(request.match_info["model"])  # any served name answers with the model's entry
        return json_response(self._model_entry())

    def _model_entry(self) -> dict[str, object]:
        backend = self.backend
        return {"id": backend.model_id, "object": "model", "created": backend.created, "owned_by": "skippy-zmq",
                "context_length": backend.ctx_size, "aliases": list(backend.served_names), "tags": list(backend.tags)}

    async def metrics_text(self, _request: web.Request) -> web.StreamResponse:
        """Prometheus exposition of the gateway's metrics."""
        engine = self.backend.engine
        if engine is None:
            body, content_type = self.metrics.render(0, 0)
        else:
            body, content_type = self.metrics.render(engine.queue_depth, engine.running, engine.health().stages,
                                                     time.monotonic())
        return web.Response(body=body, headers={"Content-Type": content_type,
                                                "Process-Start-Time-Unix": str(self.metrics.started_unix)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        with self._client_slot(request):  # released however the request ends, a disconnect included
            return await self._generate_counted(request, endpoint)

    def _client_slot(self, request: web.Request) -> ClientSlot:
        """The request's place under its client's cap (429 at the cap). A client is a peer address: with
        one API key shared by every client, the key cannot tell clients apart."""
        return self.limiter.acquire(request.remote or "unknown")

    async def _generate_counted(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        timing = _Timing(self.metrics)
        batch = CompletionParams.batch_from_json(endpoint, await _read_body(request), self.backend.sampling)
        if len(batch) > 1:
            return await self._generate_batch(request, batch)
        params = batch[0]
        self.backend.check_model(params.model)
        serving = self.backend.serving()
        run = _submit(serving.engine, await asyncio.to_thread(serving.prepare, params))
        shape = ResponseShape.new(endpoint, self.backend.model_id, include_usage=params.include_usage,
                                  piece=token_piece(serving.tokenizer),
                                  post_sampling=params.post_sampling_probs and params.logprobs is not None)
        tools, reasoning = serving.tool_answers(params), serving.reasoning_reader(params)
        extras = LlamaExtras(self.backend.model_id, serving.tokenizer, serving.engine.ctx_size, params.stop,
                             verbose=self.backend.verbose if params.verbose is None else params.verbose)
        try:
            if params.stream:
                streams = ChoiceStreams(shape, params.n, logprobs=params.logprobs is not None, tools=tools,
                                        reasoning=reasoning)
                return await _stream(request, run, streams, timing, _OpenAISink(extras))
            return await _whole(run, shape, timing, extras, logprobs=params.logprobs is not None, tools=tools,
                                reasoning=reasoning)
        finally:
            run.cancel()  # the client went away, or the handler failed: free the lanes now

    async def _generate_batch(self, request: web.Request, batch: Sequence[CompletionParams]) -> web.StreamResponse:
        """/v1/completions with several prompts: one engine request each, submitted at once after every
        prompt passed its checks; prompt i answers as choice i."""
        params = batch[0]
        self.backend.check_model(params.model)
        serving = self.backend.serving()
        generations = [await asyncio.to_thread(serving.prepare, each) for each in batch]
        shape = ResponseShape.new(Endpoint.COMPLETIONS, self.backend.model_id, include_usage=params.include_usage,
                                  piece=token_piece(serving.tokenizer))
        extras = LlamaExtras(self.backend.model_id, serving.tokenizer, serving.engine.ctx_size, params.stop,
                             verbose=self.backend.verbose if params.verbose is None else params.verbose)
        runs: list[Run] = []
        try:
            for generation in generations:  # a QueueFull part way: the finally cancels those submitted
                runs.append(_submit(serving.engine, generation))
            timings = [_Timing(self.metrics) for _ in runs]
            if params.stream:
                streams = ChoiceStreams(shape, len(runs), logprobs=params.logprobs is not None)
                return await _batch_stream(request, runs, streams, timings, extras)
            return await _batch_whole(runs, shape, timings, extras, logprobs=params.logprobs is not None)
        finally:
            for run in runs:
                run.cancel()

    async def input_tokens(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions/input_tokens (llama-server's): how many tokens the chat body's prompt is."""
        params = CompletionParams.from_json(Endpoint.CHAT, await _read_body(request), self.backend.sampling)
        self.backend.check_model(params.model)
        serving = self.backend.attached()
        count = await asyncio.to_thread(serving.count_prompt, params)
        return json_response({"input_tokens": count, "object": "response.input_tokens"})

    # --- llama-server's routes (llama_api) ------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        """POST /tokenize: text to token ids (and pieces)."""
        parsed = TokenizeRequest.from_body(read_json(await _read_body(request)))
        serving = self.backend.attached()
        return json_response(await asyncio.to_thread(tokenize, serving.tokenizer, parsed))

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        """POST /detokenize: token ids to text."""
        parsed = DetokenizeRequest.from_body(read_json(await _read_body(request)))
        serving = self.backend.attached()
        return json_response(await asyncio.to_thread(detokenize, serving.tokenizer, parsed))

    async def apply_template(self, request: web.Request) -> web.StreamResponse:
        """POST /apply-template: the prompt text the chat template renders for messages (and tools)."""
        parsed = ApplyTemplateRequest.from_body(read_json(await _read_body(request)), self.backend.sampling)
        serving = self.backend.attached()
        render = serving.render_prompt
        if render is None:
            raise ApiError.invalid("messages", "this model has no chat template")
        tools: dict[str, Any] = {} if parsed.tools is None else {"tools": parsed.tools}
        if parsed.continue_final:  # the renderer's default otherwise
            tools["continue_final"] = True
        try:
            text = await asyncio.to_thread(render, parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                           thinking=parsed.thinking, **tools)
        except RequestError as exc:
            raise ApiError.invalid("messages", str(exc)) from None
        return json_response({"prompt": text})

    async def props(self, _request: web.Request) -> web.StreamResponse:
        """GET /props: the model, its context, the lanes, the chat template, the defaults."""
        serving = self.backend.attached()
        props = ServerProps(model_id=self.backend.model_id, model_path=serving.model_path or self.backend.model_id,
                            n_ctx=serving.engine.ctx_size, total_slots=serving.engine.max_sessions,
                            chat_template=serving.chat_template, sampling=self.backend.sampling,
                            is_sleeping=self.backend.sleeping)
        return json_response(props.as_json())

    async def slots(self, _request: web.Request) -> web.StreamResponse:
        """GET /slots: 501, llama-server's answer without --slots (lanes are the scheduler's, not a table)."""
        raise ApiError(501, "This server does not support slots endpoint: skippy-zmq serve has no slot table",
                       kind="not_supported_error", code="not_supported")

    async def completion(self, request: web.Request) -> web.StreamResponse:
        """POST /completion, llama-server's native completion; a batch of prompts runs as one request
        on the engine each, at once, answered as an array (a stream: their events interleaved)."""
        with self._client_slot(request):
            batch = NativeCompletion.batch_from_json(await _read_body(request), self.backend.sampling)
            self.backend.check_model(batch[0].model)
            serving = self.backend.serving()
            # Every prompt is checked before any is submitted: a bad one is a 400 with nothing running.
            prepared = [await self._native_prepared(serving, native) for native in batch]
            runs: list[Run] = []
            try:
                for _, generation in prepared:  # a QueueFull part way: the finally cancels those submitted
                    runs.append(_submit(serving.engine, generation))
                shapes = [shape for shape, _ in prepared]
                if batch[0].stream:
                    return await _native_stream(request, runs, shapes, self.metrics)
                return await _native_whole(runs, shapes, self.metrics)
            finally:
                for run in runs:
                    run.cancel()

    async def _native_prepared(self, serving: AttachedEngine, native: NativeCompletion
                               ) -> tuple[NativeShape, GenerationRequest]:
        """One prompt's answer shape and engine request (its tokens checked against the context: 400s)."""
        native = await asyncio.to_thread(native.tokenized, serving.tokenizer)
        prepared = await asyncio.to_thread(serving.prepare, native.params(), parse_special=True, fill_context=True)
        generation = native.finish(prepared)
        shape = NativeShape(self.backend.model_id, native, generation, serving.tokenizer, serving.engine.ctx_size)
        return shape, generation

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/embeddings: every input submitted at once, the answer when all are pooled."""
        with self._client_slot(request):
            return await self._embed(request, per_token=False)

    async def native_embeddings(self, request: web.Request) -> web.StreamResponse:
        """POST /embeddings: as /v1/embeddings, and with --pooling none each input's rows in llama-server's shape."""
        with self._client_slot(request):
            return await self._embed(request, per_token=True)

    async def _embed(self, request: web.Request, *, per_token: bool) -> web.StreamResponse:
        started = time.monotonic()
        params = EmbeddingParams.from_json(await _read_body(request))
        self.backend.check_model(params.model)
        serving = self.backend.serving()
        generations = await asyncio.to_thread(functools.partial(serving.prepare_embeddings, params,
                                                                per_token=per_token))
        results = await _pooled(serving.engine, generations)
        prompt_tokens = sum(len(result.prompt_ids) for result in results)
        self.metrics.finished(time.monotonic() - started, prompt_tokens, 0, results)
        vectors = [result.embedding for result in results if result.embedding is not None]
        if serving.pooling is Pooling.NONE and serving.n_embd:
            return json_response(per_token_response(vectors, serving.n_embd))
        return json_response(params.response(vectors, self.backend.model_id, prompt_tokens))

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        """POST /rerank: every document's prompt submitted at once, the answer when all are scored."""
        with self._client_slot(request):
            started = time.monotonic()
            params = RerankParams.from_json(await _read_body(request))
            self.backend.check_model(params.model)
            serving = self.backend.serving()
            generations = await asyncio.to_thread(serving.prepare_rerank, params)
            results = await _pooled(serving.engine, generations)
            prompt_tokens = sum(len(result.prompt_ids) for result in results)
            self.metrics.finished(time.monotonic() - started, prompt_tokens, 0, results)
            scores = [float(result.embedding[0]) for result in results if result.embedding is not None]
            return json_response(params.response(scores, self.backend.model_id, prompt_tokens))


async def _pooled(engine: EngineLike, generations: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Submit every pooled request (embeddings, rerank prompts) at once and wait for all their vectors."""
    runs: list[Run] = []
    try:
        for generation in generations:  # a QueueFull part way: the finally cancels those submitted
            runs.append(_submit(engine, generation))
        # Each run queues its own events, so waiting in input order waits for them together.
        return [await _embedded(run) for run in runs]
    finally:
        for run in runs:
            run.cancel()


def _submit(engine: EngineLike, generation: GenerationRequest) -> Run:
    """Submit to the engine with the gateway's deadline; the engine's refusals as ApiErrors."""
    loop = asyncio.get_running_loop()
    try:
        return Run(engine, generation, loop.time() + engine.request_timeout_s + DEADLINE_GRACE_S)
    except SkippyError as exc:
        raise ApiError.from_exception(exc) from None


async def _embedded(run: Run) -> GenerationResult:
    """The finished result of one embedding input (its `embedding` set); ApiError when it failed."""
    while True:
        event = await run.next()
        if isinstance(event, Delta):
            continue
        if isinstance(event, Failed):
            raise ApiError.from_exception(event.error)
        if event.result.embedding is None:
            raise ApiError(500, "the engine finished an embedding request without its vector", kind="server_error",
                           code="internal_error")
        return event.result


_INNER_BODY = web.RequestKey("inner_body", bytes)
"""Where a request made inside the gateway (a Vertex AI instance, `vertex_predict`) carries its body."""


async def _read_body(request: web.Request) -> bytes:
    """The body, decoded as its Content-Encoding says (`decode_body`); 413 above the size limit,
    408 when it is slow."""
    if _INNER_BODY in request:
        return request[_INNER_BODY]
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError.too_large(f"the request body exceeds {MAX_BODY_BYTES} bytes") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                       code="request_timeout") from None
    return decode_body(raw, request.headers.get("Content-Encoding"))


CONTENT_CODINGS = ("gzip", "x-gzip", "deflate", "identity")
"""The Content-Encoding values a request body may have (in a list, applied in order)."""


def decode_body(data: bytes, content_encoding: str | None) -> bytes:
    """A request body decoded as `content_encoding` says, the last coding first (RFC 9110 §8.4).
    ApiError 415 naming an unsupported coding, 400 for data that is not what it says it is (a
    stream cut short, trailing bytes, a bad checksum), 413 when the decoded body exceeds the limit.

    The gateway decodes bodies itself (its aiohttp server runs with `auto_decompress` off,
    `server_options`): aiohttp 3.14 answers an undecodable body by ending the connection with a
    traceback in the log, and leaves a deflate stream that does not end unread until the body
    timeout."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding not in CONTENT_CODINGS:
            raise ApiError(415, f"Content-Encoding {coding!r} is not supported; send the body as it is, or with gzip "
                           "or deflate", code="unsupported_content_encoding")
        if coding != "identity":
            data = _inflate(data, coding)
    return data


def _inflate(data: bytes, coding: str) -> bytes:
    # RFC 9110's deflate is the zlib format; some clients send raw deflate, which has no zlib header.
    zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
    wbits = 31 if coding in ("gzip", "x-gzip") else 15 if zlib_header else -15
    out, rest = b"", data
    while rest:  # gzip allows several members, one after another
        stream = zlib.decompressobj(wbits)
        try:
            out += stream.decompress(rest, MAX_BODY_BYTES + 1 - len(out))
        except zlib.error as exc:
            raise ApiError.invalid(None, f"the request body is not valid {coding} data, as its Content-Encoding "
                                   f"says: {exc}") from None
        if len(out) > MAX_BODY_BYTES:
            raise ApiError.too_large(f"the request body exceeds {MAX_BODY_BYTES} bytes once decoded ({coding})")
        if not stream.eof:
            raise ApiError.invalid(None, f"the request body is not valid {coding} data, as its Content-Encoding "
                                   f"says: its {len(rest)} bytes end before the {coding} stream does")
        rest = stream.unused_data
        if rest and wbits != 31:
            raise ApiError.invalid(None, f"the request body has {len(rest)} bytes after its {coding} stream")
    return out


async def _whole(run: Run, shape: ResponseShape, timing: _Timing, extras: LlamaExtras, *, logprobs: bool,
                 tools: ToolAnswers | None = None, reasoning: ReasoningReader | None = None) -> web.StreamResponse:
    """Wait for the end (every choice's) and answer the whole completion."""
    answer, _ = await _chat_answer(run, shape, timing, logprobs=logprobs, tools=tools, reasoning=reasoning,
                                   extras=extras)
    return json_response(answer)


async def _chat_answer(run: Run, shape: ResponseShape, timing: _Timing, *, logprobs: bool,
                       tools: ToolAnswers | None = None, reasoning: ReasoningReader | None = None,
                       extras: LlamaExtras | None = None) -> tuple[JsonObject, Sequence[GenerationResult]]:
    """Wait for the end (every choice's): the whole answer (with llama-server's additions, given `extras`),
    and the results it was made of."""
    while True:
        event = await run.next()
        if isinstance(event, Delta):
            timing.tokens(len(event.token_ids))
            continue
        usage = Usage.of_all(event.results)
        timing.finished(usage, event.results)
        if isinstance(event, Failed):
            raise ApiError.from_exception(event.error)
        choices = [Choice.of(result, logprobs=logprobs, tools=tools, reasoning=reasoning) for result in event.results]
        answer = shape.response(choices, usage)
        return (answer if extras is None else extras.added([answer], event.results)[0]), event.results


async def _stream(request: web.Request, run: Run, streams: ChoiceStreams, timing: _Timing,
                  sink: ChunkSink | None = None) -> web.StreamResponse:
    """Server-sent events: text chunks (one choice each), every choice's finish chunk, usage if
    asked, then [DONE] (or those chunks as `sink` translates them). A write that fails means the
    client left: the caller's `finally` cancels the request."""
    sink = sink or OPENAI_SINK
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await asyncio.wait_for(response.prepare(request), run.remaining())
        opening = sink.chunks(streams.opening(), opening=True)
        if opening:
            await _write(response, run, opening)
        while True:
            event = await run.next()
            if isinstance(event, Delta):
                timing.tokens(len(event.token_ids))
                progress = None if event.progress is None else event.progress.as_json()
                chunks = streams.delta(event.choice, event.text, event.logprobs, progress)
                if chunks and event.timing is not None:  # timings_per_token: llama-server's, on the last
                    chunks[-1]["timings"] = timings(event.timing)
                data = sink.chunks(chunks) if chunks else b""
                if data:
                    await _write(response, run, data)
                continue
            timing.finished(Usage.of_all(event.results), event.results)
            await _write(response, run, sink.end(event, streams))
            await response.write_eof()
            return response
    except (ConnectionError, TimeoutError):
        return response  # the client is gone (or stopped reading); nothing more can be said to it
    except ApiError as error:  # the gateway's own deadline: the status line is long sent
        with contextlib.suppress(ConnectionError):
            await _write(response, run, sink.failed(error))
        return response


class ChunkSink(Protocol):
    """How a chat stream's chunks go out: as OpenAI's events, or translated into another API's."""

    def chunks(self, chunks: list[JsonObject], *, opening: bool = False) -> bytes:
        """The bytes of these chunks (`opening`: the stream's first, before any text)."""

    def end(self, event: Done | Failed, streams: ChoiceStreams) -> bytes:
        """The stream's last bytes: its end or its failure."""

    def failed(self, error: ApiError) -> bytes:
        """The stream's last bytes when the gateway gives up (its deadline)."""


class _OpenAISink:
    """OpenAI's events: each chunk as it is, then [DONE]; with `extras`, llama-server's additions on the last
    chunks."""

    def __init__(self, extras: LlamaExtras | None = None) -> None:
        self.extras = extras

    def chunks(self, chunks: list[JsonObject], *, opening: bool = False) -> bytes:
        return b"".join(sse(chunk) for chunk in chunks)

    def end(self, event: Done | Failed, streams: ChoiceStreams) -> bytes:
        return _end_events(event, streams, self.extras)

    def failed(self, error: ApiError) -> bytes:
        return sse(error.body()) + SSE_DONE


OPENAI_SINK = _OpenAISink()


def _end_events(event: Done | Failed, streams: ChoiceStreams, extras: LlamaExtras | None = None) -> bytes:
    """The last events of a stream: every choice's finish (or the error), usage if asked (the last with
    llama-server's `timings`, given `extras`), [DONE]."""
    if isinstance(event, Failed):
        data = sse(ApiError.from_exception(event.error).body())
        if streams.shape.include_usage:
            data += sse(streams.shape.usage_chunk(Usage.of_all(event.results)))
        return data + SSE_DONE
    chunks = streams.ending(event.results)
    return b"".join(sse(chunk) for chunk in (chunks if extras is None else extras.added(chunks, event.results))
                    ) + SSE_DONE


async def _merged(runs: Sequence[Run]) -> AsyncGenerator[tuple[int, Event], None]:
    """Every run's events as they come, each with its run's place in `runs`, until every run ended
    (ApiError 504 once one passed its deadline)."""
    pending = {asyncio.ensure_future(run.next()): index for index, run in enumerate(runs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                event = future.result()
                if isinstance(event, Delta):
                    pending[asyncio.ensure_future(runs[index].next())] = index
                yield index, event
    finally:
        for future in pending:
            future.cancel()


async def _batch_results(runs: Sequence[Run], timings: Sequence[_Timing],
                         on_delta: Callable[[int, Delta], Awaitable[None]]) -> list[GenerationResult]:
    """Every run's result, as choice i of run i, once all ended (`on_delta` for each piece of output on
    the way); ApiError for the first that failed."""
    results: dict[int, GenerationResult] = {}
    async with contextlib.aclosing(_merged(runs)) as events:
        async for index, event in events:
            if isinstance(event, Delta):
                timings[index].tokens(len(event.token_ids))
                await on_delta(index, event)
                continue
            timings[index].finished(Usage.of(event.result), [event.result])
            if isinstance(event, Failed):
                raise ApiError.from_exception(event.error)
            results[index] = attrs.evolve(event.result, choice=index)
    return [results[index] for index in range(len(runs))]


async def _batch_whole(runs: Sequence[Run], shape: ResponseShape, timings: Sequence[_Timing], extras: LlamaExtras, *,
                       logprobs: bool) -> web.StreamResponse:
    """A batch's whole answer: one choice per prompt, the usage of all of them."""

    async def nothing(_index: int, _delta: Delta) -> None:
        return None

    results = await _batch_results(runs, timings, nothing)
    choices = [Choice.of(result, logprobs=logprobs) for result in results]
    return json_response(extras.added([shape.response(choices, Usage.of_batch(results))], results)[0])


async def _batch_stream(request: web.Request, runs: Sequence[Run], streams: ChoiceStreams,
                        timings: Sequence[_Timing], extras: LlamaExtras) -> web.StreamResponse:
    """A batch's server-sent events: each prompt's text chunks as its choice's, then every choice's finish
    chunk, the usage of all of them if asked, [DONE]; a failure is an error event, then [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    first = runs[0]

    async def write_delta(index: int, delta: Delta) -> None:
        chunks = streams.delta(index, delta.text, delta.logprobs)
        if chunks:
            await _write(response, first, b"".join(sse(chunk) for chunk in chunks))

    try:
        await asyncio.wait_for(response.prepare(request), first.remaining())
        try:
            results = await _batch_results(runs, timings, write_delta)
        except ApiError as error:
            await _write(response, first, sse(error.body()) + SSE_DONE)
            return response
        chunks = extras.added(streams.ending(results, Usage.of_batch(results)), results)
        await _write(response, first, b"".join(sse(chunk) for chunk in chunks) + SSE_DONE)
        await response.write_eof()
        return response
    except (ConnectionError, TimeoutError):
        return response  # the client is gone (or stopped reading)


async def _native_whole(runs: Sequence[Run], shapes: Sequence[NativeShape], metrics: GatewayMetrics
                        ) -> web.StreamResponse:
    """Wait for every prompt's end and answer /completion in llama-server's shape: the answer, or with
    several prompts the array of their answers in order."""
    timings = [_Timing(metrics) for _ in runs]
    answers: dict[int, JsonObject] = {}
    async with contextlib.aclosing(_merged(runs)) as events:
        async for index, event in events:
            if isinstance(event, Delta):
                timings[index].tokens(len(event.token_ids))
                continue
            timings[index].finished(Usage.of(event.result), [event.result])
            if isinstance(event, Failed):
                raise ApiError.from_exception(event.error)
            answers[index] = shapes[index].final(event.result)
    if len(runs) == 1:
        return json_response(answers[0])
    return json_response([answers[index] for index in range(len(runs))])


async def _native_stream(request: web.Request, runs: Sequence[Run], shapes: Sequence[NativeShape],
                         metrics: GatewayMetrics) -> web.StreamResponse:
    """/completion's server-sent events: one per piece of output (`stop: false`), then the totals
    (`stop: true`) or an error object, for each prompt (`index` tells them apart); no [DONE], as
    llama-server."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    timings = [_Timing(metrics) for _ in runs]
    predicted = [0] * len(runs)
    first = runs[0]  # every run has the same deadline, give or take the submission's microseconds
    try:
        await asyncio.wait_for(response.prepare(request), first.remaining())
        async with contextlib.aclosing(_merged(runs)) as events:
            async for index, event in events:
                shape, timing = shapes[index], timings[index]
                if isinstance(event, Delta):
                    timing.tokens(len(event.token_ids))
                    predicted[index] += len(event.token_ids)
                    if event.progress is not None:
                        await _write(response, first, sse(shape.progress(event.progress, event.timing)))
                    elif event.text or event.token_ids:
                        await _write(response, first, sse(shape.partial(event.text, event.token_ids, event.logprobs,
                                                                        predicted[index], event.timing)))
                    continue
                timing.finished(Usage.of(event.result), [event.result])
                last = ApiError.from_exception(event.error).body() if isinstance(event, Failed) else \
                    shape.final(event.result)
                await _write(response, first, sse(last))
                if isinstance(event, Failed):
                    break  # llama-server ends the stream at its first error
        await response.write_eof()
        return response
    except (ConnectionError, TimeoutError):
        return response  # the client is gone (or stopped reading)
    except ApiError as error:  # the gateway's own deadline: the status line is long sent
        with contextlib.suppress(ConnectionError):
            await _write(response, first, sse(error.body()))
        return response


async def _write(response: web.StreamResponse, run: Run, data: bytes) -> None:
    """One bounded write; a client that stops reading until the deadline counts as gone."""
    try:
        await asyncio.wait_for(response.write(data), run.remaining())
    except TimeoutError:
        raise ConnectionResetError("the client stopped reading") from None


# --- translated routes: Anthropic's Messages API and OpenAI's Responses API onto chat (PROTOCOL §9.6) -----

Events = list[SseEvent]


@attrs.frozen
class Translation:
    """How a translated route answers from the chat route's: its whole answer from chat's (and the stop
    string that ended it), and its stream's events from chat's chunks (`start`, `feed` per chunk,
    `finish` with the stop string, `failed`)."""

    whole: Callable[[JsonObject, str], JsonObject]
    start: Callable[[], Events]
    feed: Callable[[JsonObject], Events]
    finish: Callable[[str], Events]
    failed: Callable[[ApiError], Events]


def named_sse(events: Events) -> bytes:
    """Server-sent events with their names (`event: NAME`), as Anthropic's and the Responses API's streams."""
    return b"".join(b"event: " + name.encode("utf-8") + b"\n" + sse(data) for name, data in events)


@attrs.frozen
class _TranslatedSink:
    """A chat stream's chunks as a translated route's events; no [DONE]. With `timings` (timings_per_token),
    the last event carries llama-server's `timings` too."""

    translation: Translation
    stop_word: Callable[[GenerationResult], str]
    timings: bool = False

    def chunks(self, chunks: list[JsonObject], *, opening: bool = False) -> bytes:
        events = self.translation.start() if opening else []
        return named_sse(events + [event for chunk in chunks for event in self.translation.feed(chunk)])

    def end(self, event: Done | Failed, streams: ChoiceStreams) -> bytes:
        if isinstance(event, Failed):
            return named_sse(self.translation.failed(ApiError.from_exception(event.error)))
        ending = self.chunks(streams.ending(event.results))  # first: the finish reads what the ending fed it
        last = self.translation.finish(self.stop_word(event.results[0]))
        if self.timings and last:
            last[-1][1]["timings"] = timings(event.results[0])
        return ending + named_sse(last)

    def failed(self, error: ApiError) -> bytes:
        return named_sse(self.translation.failed(error))


async def _translated(gateway: Gateway, request: web.Request, chat: JsonObject,
                      translation_of: Callable[[ResponseShape, int], Translation]) -> web.StreamResponse:
    """Run `chat`, the chat request a translated route's body is, and answer as `translation_of(the chat
    answer's shape, the prompt's tokens)` says: chat's validation, engine and stream, another API's shapes."""
    timing = _Timing(gateway.metrics)
    params = CompletionParams.from_body(Endpoint.CHAT, chat, gateway.backend.sampling)
    gateway.backend.check_model(params.model)
    serving = gateway.backend.serving()
    generation = await asyncio.to_thread(serving.prepare, params)
    run = _submit(serving.engine, generation)
    shape = ResponseShape.new(Endpoint.CHAT, gateway.backend.model_id, include_usage=params.include_usage)
    tools, reasoning = serving.tool_answers(params), serving.reasoning_reader(params)
    translation = translation_of(shape, len(generation.prompt_ids or ()))

    def stop_word(result: GenerationResult) -> str:
        return stopping_word(serving.tokenizer, result, params.stop)

    try:
        if params.stream:
            streams = ChoiceStreams(shape, 1, logprobs=False, tools=tools, reasoning=reasoning)
            sink = _TranslatedSink(translation, stop_word, timings=params.timings_per_token)
            return await _stream(request, run, streams, timing, sink)
        answer, results = await _chat_answer(run, shape, timing, logprobs=False, tools=tools, reasoning=reasoning)
        return json_response(translation.whole(answer, stop_word(results[0])))
    finally:
        run.cancel()  # the client went away, or the handler failed: free the lanes now


async def _prompt_tokens(gateway: Gateway, chat: JsonObject) -> int:
    """The tokens of the prompt the chat request `chat` renders to (nothing generated)."""
    params = CompletionParams.from_body(Endpoint.CHAT, chat, gateway.backend.sampling)
    gateway.backend.check_model(params.model)
    render = gateway.backend.attached().render_chat
    if render is None:
        raise ApiError.invalid("messages", "this model has no chat template")
    tools = {} if params.tools is None else {"tools": params.tools}
    try:
        return len(await asyncio.to_thread(render, params.messages, thinking=params.thinking, **tools))
    except RequestError as exc:
        raise ApiError.invalid("messages", str(exc)) from None


def _anthropic(shape: ResponseShape, prompt_tokens: int) -> Translation:
    stream = MessageStream(shape.id, shape.model, prompt_tokens)
    return Translation(lambda answer, stop: anthropic_api.message(answer, stop_sequence=stop), stream.start,
                       stream.feed, stream.finish, stream.failed)


async def anthropic_messages(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: Anthropic's Messages API, through chat."""
    with gateway._client_slot(request):
        chat = anthropic_api.chat_body(read_json(await _read_body(request)))
        return await _translated(gateway, request, chat, _anthropic)


async def anthropic_count_tokens(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt's tokens, as Anthropic counts them."""
    chat = anthropic_api.chat_body(read_json(await _read_body(request)), count_only=True)
    return json_response({"input_tokens": await _prompt_tokens(gateway, chat)})


async def responses(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: OpenAI's Responses API, through chat."""
    with gateway._client_slot(request):
        parsed = ResponsesRequest.from_body(read_json(await _read_body(request)))
        response_id = new_id("resp_")

        def translation(shape: ResponseShape, _prompt_tokens: int) -> Translation:
            stream = ResponseStream(parsed.echo, response_id, shape.created, shape.model)
            return Translation(lambda answer, _stop: response(answer, parsed.echo, response_id), stream.start,
                               stream.feed, lambda _stop: stream.finish(), stream.failed)

        return await _translated(gateway, request, parsed.chat, translation)


async def responses_input_tokens(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """POST /v1/responses/input_tokens: the prompt's tokens, as OpenAI counts them."""
    parsed = ResponsesRequest.from_body(read_json(await _read_body(request)))
    return json_response({"object": "response.input_tokens",
                          "input_tokens": await _prompt_tokens(gateway, parsed.chat)})


NO_SNIFF = {"X-Content-Type-Options": "nosniff"}
"""What /stages' answers carry: their Content-Type is what it is (no sniffing)."""


async def web_file(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """GET / and GET /web/{name}: a file of the web page (web_page, docs/PROTOCOL.md §9.9) with its security
    headers, 304 when the browser holds this version; 404 for a name the page has no file of."""
    asset = None if gateway.page is None else gateway.page.get(request.match_info.get("name", ""))
    if asset is None:
        raise web.HTTPNotFound()
    status, headers = asset.answer(request.headers.get("If-None-Match"))
    return web.Response(status=status, body=asset.body if status == 200 else None, headers=headers)


async def stages(gateway: Gateway, _request: web.Request) -> web.StreamResponse:
    """GET /stages: every stage and the gateway's own figures (stages_api, docs/PROTOCOL.md §9.1), read from the
    snapshots the engine and the metrics hold: it never waits on a stage or on the engine's queue."""
    backend, live = gateway.backend, gateway.metrics.live
    state, message, health = backend.pipeline()
    engine = backend.engine
    queued, running = (0, 0) if engine is None else (engine.queue_depth, engine.running)
    figures = GatewayFigures(queued, running, live.tokens_per_second(), live.tokens_total, live.cache_hits,
                             live.cached_tokens)
    stage_list, stage_figures = ((), ()) if health is None else (health.stages, health.figures)
    body = stages_body(status=state, message=message, model=backend.model_id, stages=stage_list,
                       figures=stage_figures, spans=backend.spans, gateway=figures, now=time.monotonic(),
                       window_s=live.window_s)
    return json_response(body, headers={**NO_SNIFF, "Cache-Control": "no-store"})


ROUTES: tuple[Route, ...] = (
    # the web page (it holds no data; its requests send the key)
    Route("GET", "/", web_file, public=True, wakes=False, web=True),
    Route("GET", "/web/{name}", web_file, public=True, wakes=False, web=True),
    Route("GET", "/health", Gateway.health, public=True, wakes=False),
    Route("GET", "/v1/models", Gateway.models, wakes=False),
    Route("GET", "/v1/models/{model:.+}", Gateway.model, wakes=False),  # a served name may hold a slash
    Route("POST", "/v1/completions", Gateway.completions),
    Route("POST", "/v1/chat/completions", Gateway.chat_completions),
    Route("POST", "/v1/embeddings", Gateway.embeddings),
    # llama-server's un-prefixed aliases of the OpenAI routes
    Route("GET", "/models", Gateway.models, wakes=False),
    Route("POST", "/embeddings", Gateway.native_embeddings),
    Route("POST", "/chat/completions", Gateway.chat_completions),
    Route("POST", "/v1/chat/completions/input_tokens", Gateway.input_tokens),
    Route("POST", "/chat/completions/input_tokens", Gateway.input_tokens),
    # llama-server's own routes (docs/PROTOCOL.md §9.6); /completions is its native one too, as there
    Route("POST", "/completion", Gateway.completion),
    Route("POST", "/completions", Gateway.completion),
    Route("GET", "/slots", Gateway.slots, wakes=False),
    Route("POST", "/tokenize", Gateway.tokenize),
    Route("POST", "/detokenize", Gateway.detokenize),
    Route("POST", "/apply-template", Gateway.apply_template),
    Route("GET", "/props", Gateway.props, wakes=False),
    # Anthropic's Messages API and OpenAI's Responses API, translated onto chat (§9.6), with llama-server's aliases
    Route("POST", "/v1/messages", anthropic_messages, error_body=anthropic_api.error_body),
    Route("POST", "/v1/messages/count_tokens", anthropic_count_tokens, error_body=anthropic_api.error_body),
    Route("POST", "/v1/responses", responses),
    Route("POST", "/responses", responses),
    Route("POST", "/v1/responses/input_tokens", responses_input_tokens),
    Route("POST", "/responses/input_tokens", responses_input_tokens),
    # llama-server's reranking routes (Jina's and TEI's shapes, §9.3)
    Route("POST", "/rerank", Gateway.rerank),
    Route("POST", "/reranking", Gateway.rerank),
    Route("POST", "/v1/rerank", Gateway.rerank),
    Route("POST", "/v1/reranking", Gateway.rerank),
    # for the operator's scraper (bind or firewall); a scrape never wakes the stages
    Route("GET", "/metrics", Gateway.metrics_text, public=True, wakes=False),
    Route("GET", "/stages", stages, wakes=False),  # what the web page's pipeline view polls
)


_PUBLIC_PATHS = frozenset(route.path for route in ROUTES if route.public)
_POST_HANDLERS: dict[str, Handler] = {route.path: route.handler for route in ROUTES if route.method == "POST"}
_ERROR_BODIES = {route.path: route.error_body for route in ROUTES if route.error_body is not ApiError.body}


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def preflight_response(cors: CorsPolicy, request: web.Request) -> web.Response:
    """The answer to a CORS preflight: 204 with the Access-Control-Allow-* headers for an allowed
    origin, else a 403 without them (the browser then refuses the request)."""
    origin = request.headers.get("Origin")
    headers = cors.preflight(origin, request.headers.get("Access-Control-Request-Headers"))
    if headers:
        return web.Response(status=204, headers=headers)
    return error_response(ApiError(403, f"cross-origin requests from origin {origin!r:.200} are not allowed: serve "
                                   "--cors-origins does not list it", code="cors_origin_not_allowed"))


def _middleware(metrics: GatewayMetrics, api_key: bytes | None, cors: CorsPolicy,
                public: frozenset[str] = frozenset()) -> Any:
    """CORS preflights, the API key check (none on `public` paths beside the table's), errors as OpenAI error
    objects (Anthropic's on its routes), and one count per answered request."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        headers = request.headers
        if cors.is_preflight(request.method, headers.get("Origin"), headers.get("Access-Control-Request-Method")):
            # a browser sends no credentials on a preflight: it is answered before the key check
            response: web.StreamResponse = preflight_response(cors, request)
            metrics.request(_route_label(request), response.status)
            return response
        shape = _ERROR_BODIES.get(_route_label(request), ApiError.body)  # Anthropic's routes answer in its shape
        try:
            # unknown paths and wrong methods need the key too: without it nothing about the routes shows
            if api_key is not None and _route_label(request) not in _PUBLIC_PATHS | public:
                check_api_key(headers.get("Authorization"), api_key, headers.get("X-Api-Key"))
            response = await handler(request)
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels its handler): counted as nginx's 499.
            metrics.request(_route_label(request), CLIENT_CLOSED_REQUEST)
            raise
        except ApiError as error:
            response = error_response(error, shape)
        except web.HTTPException as exc:  # no such route, wrong method, body too large
            response = error_response(ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")),
                                      shape)
            if exc.status == 405:
                response.headers["Allow"] = exc.headers.get("Allow", "")
        except SkippyError as exc:
            response = error_response(ApiError.from_exception(exc), shape)
        except Exception as exc:  # noqa: BLE001 - a bug: answered with a 500 and logged, the server goes on
            _log.exception("unexpected error in %s %s", request.method, request.path)
            response = error_response(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error",
                                               code="internal_error"), shape)
        metrics.request(_route_label(request), response.status)
        return response

    return middleware


class _MalformedHttp(logging.Filter):
    """Turns aiohttp's report of a client's malformed HTTP (which aiohttp answers with a 4xx itself:
    a bad request line, header or body framing) into a debug line without its traceback; every
    other record, a bug's traceback included, passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            record.msg, record.args = "%s (%s)", (record.getMessage(), " ".join(str(exc).split()))
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
        return True


def server_options() -> dict[str, Any]:
    """How the gateway's aiohttp server must run (AppRunner's or TestServer's options): bodies
    left encoded for `decode_body`, and aiohttp's own log records through `server_logger`."""
    return {"auto_decompress": False, "logger": server_logger()}


def server_logger() -> logging.Logger:
    """The logger for aiohttp's connection handler (AppRunner's `logger`): under the package's, so
    its records reach serve's log, with a client's malformed HTTP kept out of it (`_MalformedHttp`)."""
    logger = logging.getLogger("skippy_zmq.gateway.aiohttp")
    if not any(isinstance(existing, _MalformedHttp) for existing in logger.filters):
        logger.addFilter(_MalformedHttp())
    return logger


def _cors_headers(cors: CorsPolicy) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An on_response_prepare hook: every answer to an allowed origin (errors and event streams
    included, since it runs as each response's headers go out) gets the origin's CORS headers."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        for name, value in cors.headers_for(request.headers.get("Origin")).items():
            vary = response.headers.get(name) if name == "Vary" else None
            response.headers[name] = value if not vary or value in vary else f"{vary}, {value}"

    return add


async def vertex_predict(gateway: Gateway, request: web.Request) -> web.StreamResponse:
    """Vertex AI's prediction route: each instance answered by the route its `@requestFormat` names, all at
    once; an instance that fails answers `{"error": ...}` in its place (vertex_api)."""
    unread = request.clone()  # aiohttp clones only a request whose body is unread: the instances' are its clones
    instances = vertex_api.instances_of(read_json(await _read_body(request)))
    answers = await asyncio.gather(*(_predict(gateway, unread, instance, index)
                                     for index, instance in enumerate(instances)))
    return json_response({"predictions": list(answers)})


_PREDICT_FORMATS = vertex_api.format_table(route.path for route in ROUTES if route.method == "POST"
                                           and "{" not in route.path)


async def _predict(gateway: Gateway, unread: web.Request, instance: Any, index: int) -> Any:
    """One instance's answer: its route's JSON, or its error object (`unread`: the prediction request before
    its body was read)."""
    try:
        path, body = vertex_api.instance_request(instance, index, _PREDICT_FORMATS)
        inner = unread.clone(rel_url=path)
        inner[_INNER_BODY] = body
        response = await _POST_HANDLERS[path](gateway, inner)
    except ApiError as exc:
        return exc.body()
    except SkippyError as exc:  # as the middleware answers it on the route itself
        return ApiError.from_exception(exc).body()
    data = response.body if isinstance(response, web.Response) else None
    if not isinstance(data, bytes) or not data:
        return None
    answer = json.loads(data)
    return answer if response.status < 400 else {"error": answer.get("error", answer)}


def make_app(backend: GatewayState, metrics: GatewayMetrics, *, api_key: str | None = None,
             max_client_requests: int | None = None, cors: CorsPolicy | None = None,
             vertex: VertexSettings | None = None, web_page: bool = True) -> web.Application:
    """The aiohttp application: ROUTES over `backend`, body size limit, error middleware; with `api_key`,
    every route but the public ones needs it; `max_client_requests` caps each peer (None or 0: no cap);
    `cors` says which web origins may call it (default: none); `vertex`, Vertex AI's prediction routes;
    `web_page` False leaves the web page's routes out (serve --no-web: `GET /` is then a 404)."""
    limiter = ClientLimiter(max_client_requests, on_refused=lambda: metrics.client_cap_refused("http"))
    gateway = Gateway(backend, metrics, limiter, WebPage.from_package() if web_page else None)
    key = None if api_key is None else api_key.encode("utf-8")
    cors = cors or CorsPolicy()
    health = frozenset({vertex.health_route} if vertex is not None and vertex.health_route else ())
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_middleware(metrics, key, cors, health)])
    if cors.enabled:
        app.on_response_prepare.append(_cors_headers(cors))
    for route in ROUTES:
        if route.web and not web_page:
            continue
        handler = route.handler

        async def call(request: web.Request, handler: Handler = handler, wakes: bool = route.wakes
                       ) -> web.StreamResponse:
            sleep = backend.pipeline_sleep
            if not wakes or sleep is None:
                return await handler(gateway, request)
            async with sleep.use():  # the stages serve first, and stay up until the answer is out
                return await handler(gateway, request)

        app.router.add_route(route.method, route.path, call)
    if vertex is not None and vertex.enabled:
        _add_vertex_routes(app, gateway, vertex)
    return app


def _add_vertex_routes(app: web.Application, gateway: Gateway, vertex: VertexSettings) -> None:
    """The prediction route (and another path for /health) beside the others; ConfigError on a clash."""
    taken = {route.path for route in ROUTES}
    added: list[tuple[str, str, Handler]] = [("POST", vertex.predict_route, vertex_predict)]
    if vertex.health_route is not None:
        added.append(("GET", vertex.health_route, Gateway.health))
    for method, path, handler in added:
        if path in taken:
            raise ConfigError(f"AIP_{'PREDICT' if method == 'POST' else 'HEALTH'}_ROUTE {path} is one of this "
                              "server's own routes")

        async def call(request: web.Request, handler: Handler = handler) -> web.StreamResponse:
            return await handler(gateway, request)

        app.router.add_route(method, path, call)
