"""What the gateway serves requests with, what it says while that is not there yet, and how many
requests one client may have in flight.

The HTTP server listens before the pipeline is up: until `GatewayState.attach` hands it an engine,
every generation request is a 503 naming the startup step under way, and /health says the same.
The served names (`serve --served-model-name`, docs/PROTOCOL.md §9.7) are the model's id and its
aliases. A request naming any other model is served by this one, as llama-server does (clients
hard-code names such as `gpt-3.5-turbo`), unless `--strict-model-name` makes it a 404 `model_not_found`.
`ClientLimiter` is the per-client cap both front ends apply (socket-free).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import attrs

from skippy_zmq.driver.engine import Event, Health
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.errors import RequestError
from skippy_zmq.gateway.embedding_api import EmbeddingParams, check_per_token_size
from skippy_zmq.gateway.openai_api import (
    ApiError,
    CompletionParams,
    Endpoint,
    JsonObject,
    ToolAnswers,
    constraint_field,
)
from skippy_zmq.gateway.reasoning import ReasoningReader, Thinking, answer_rules, thought_first
from skippy_zmq.gateway.rerank_api import RerankParams, RerankPrompts
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.gateway.sleep import PipelineSleep
from skippy_zmq.gateway.stages_api import StageSpan
from skippy_zmq.gateway.tool_formats import FORMATS, ToolFormat, tool_grammar
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS
from skippy_zmq.tokens.constraint import ConstraintKind
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.tokenizer import Tokenizer

DEADLINE_GRACE_S = 10.0
"""How long past the engine's own deadline either API still waits for a request's end (then 504)."""

PromptRenderer: TypeAlias = Callable[..., str]
"""Chat messages, `tools=` and `add_generation_prompt=` -> the prompt's text (`ChatTemplate.render_text`)."""
ChatRenderer: TypeAlias = Callable[..., list[int]]
"""Chat messages (JSON objects), `thinking=`, and `tools=` when the request has tools -> prompt token ids,
with the model's chat template (`ChatTemplate.render_ids`)."""
ReasoningReaders: TypeAlias = Callable[[Thinking], ReasoningReader | None]
"""A request's thought settings -> how its answers are read for thought (ChatTemplate.reasoning_reader)."""


class EngineLike(Protocol):
    """The part of `skippy_zmq.engine.Engine` the gateway uses (tests pass fakes)."""

    ctx_size: int
    max_sessions: int
    request_timeout_s: float

    def health(self) -> Health:
        """Readiness snapshot."""

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None]) -> Any:
        """Queue a request; returns its ticket."""

    def cancel(self, ticket: Any) -> None:
        """Give up on a request (idempotent)."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a lane."""

    @property
    def running(self) -> int:
        """Requests holding lanes."""


def model_id(model: str) -> str:
    """The id /v1/models reports: the packaged default's alias, else the GGUF file's stem."""
    if model == GEMMA3_270M_ALIAS:
        return model
    name = model.replace("\\", "/").rsplit("/", 1)[-1]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


@attrs.frozen
class AttachedEngine:
    """A started engine with the tokenizer and chat renderer of its model, and how it pools embeddings."""

    engine: EngineLike
    tokenizer: Tokenizer
    render_chat: ChatRenderer | None = None
    pooling: Pooling = Pooling.MEAN  # serve --pooling
    n_embd: int | None = None  # the model's width: the only `dimensions` an embeddings request may name
    chat_template: str | None = None  # the GGUF's tokenizer.chat_template (None: none, or a built-in turn format)
    model_path: str | None = None  # the model file the stages load (GET /props)
    # each emulated link of the topology ({"stage", "to", "link"}, TopologyConfig.emulated_links): /health names them
    links: tuple[Mapping[str, str], ...] = ()
    tool_format: ToolFormat = ToolFormat.GENERIC  # how the chat template writes tool calls (ChatTemplate.tool_format)
    render_prompt: PromptRenderer | None = None  # the chat prompt's text, for /apply-template
    reasoning: ReasoningReaders | None = None  # how answers are read for thought (ChatTemplate.reasoning_reader)
    rerank: RerankPrompts | None = None  # how /rerank builds its prompts (None: serve without --reranking)
    spans: tuple[StageSpan, ...] = ()  # each stage's layers and lanes, from the topology (GET /stages)

    def tool_answers(self, params: CompletionParams) -> ToolAnswers | None:
        """How the request's answers are read for tool calls (None: they are not)."""
        if params.tools is None or params.tools.choice == "none":
            return None
        return ToolAnswers(self.tool_format, params.tools)

    def reasoning_reader(self, params: CompletionParams) -> ReasoningReader | None:
        """How a chat request's answers are read for thought (None: they are not; docs/PROTOCOL.md §9.2)."""
        if params.endpoint is not Endpoint.CHAT or self.reasoning is None:
            return None
        return self.reasoning(self._thinking(params))

    def _thinking(self, params: CompletionParams) -> Thinking:
        """The request's thought settings, with thought turned off where the template would open one and the
        answer is constrained from its first token in a language a thought cannot be put before (a regex, a
        GBNF or Lark grammar: thought_first): the constraint would otherwise be spent inside the thought."""
        constraint = params.constraint
        if constraint is None or self.reasoning is None or answer_rules(constraint) is not None:
            return params.thinking
        reader = self.reasoning(params.thinking)
        return attrs.evolve(params.thinking, enable=False) if reader is not None and reader.opened else params.thinking

    def _with_thought(self, params: CompletionParams, request: GenerationRequest, *,
                      tools: bool) -> GenerationRequest:
        """A chat request of a thinking template: the thought markers shown in the text (the reader needs
        them), and unless thought is off, a constrained answer allowed a thought before it
        (reasoning.thought_first; `tools`: the constraint is the tool format's grammar)."""
        reader = self.reasoning_reader(params)
        if reader is None:
            return request
        special = self.tokenizer.marker_ids((reader.markers.start, reader.markers.end))
        request = attrs.evolve(request, shown_ids=request.shown_ids | frozenset(special.values()))
        rules = None if request.constraint is None else answer_rules(request.constraint, generated=tools)
        if rules is None or self._thinking(params).enable is False:  # thought turned off: the answer at once
            return request
        grammar = thought_first(rules, reader, special)
        return attrs.evolve(request, constraint=constraint_field(ConstraintKind.LARK, grammar,
                                                                 "tools" if tools else "response_format"))

    def prepare(self, params: CompletionParams, *, parse_special: bool = False,
                fill_context: bool = False) -> GenerationRequest:
        """Tokenize the prompt (or render the chat) and check it against the context; blocking.

        `parse_special`: control-token texts in a text prompt become their ids (llama-server's
        /completion does this). `fill_context`: a `max_tokens` that is None or more than the prompt
        leaves room for becomes that room (llama-server's `n_predict`), instead of the 400; so it does
        when the request gave `n_predict` in place of max_tokens."""
        fill_context = fill_context or params.max_tokens_field == "n_predict"
        lanes = self.engine.max_sessions
        if params.n > lanes:
            raise ApiError.invalid("n", f"n {params.n} is more than the pipeline's {lanes} lanes; each choice takes "
                                   f"a lane, so n may be at most {lanes}")
        text = ""
        if params.endpoint is Endpoint.CHAT:
            self._refuse_certain_overflow("messages", _content_chars(params.messages), bos=False)
            ids = self._chat_ids(params)
        elif isinstance(params.prompt, str):
            text = params.prompt
            self._refuse_certain_overflow("prompt", len(text), bos=True)
            ids = self.tokenizer.encode(text, parse_special=True) if parse_special else self.tokenizer.encode(text)
        else:
            ids = list(params.prompt)
        room = self.engine.ctx_size - len(ids)
        if fill_context and room >= 1 and (params.max_tokens is None or params.max_tokens > room):
            params = attrs.evolve(params, max_tokens=room)
        request = params.generation_request(ids, self.engine.ctx_size, n_vocab=self.tokenizer.n_vocab,
                                            prompt_text=text)
        with_tools = self._with_tools(params, request)
        return self._with_thought(params, with_tools, tools=with_tools is not request)

    def count_prompt(self, params: CompletionParams) -> int:
        """The tokens of a chat request's prompt, as `prepare` renders it, without the context checks; blocking."""
        return len(self._chat_ids(params))

    def _chat_ids(self, params: CompletionParams) -> list[int]:
        """The chat's prompt ids: its messages (and tools) through the chat template; 400 for messages the
        template refuses."""
        if self.render_chat is None:
            raise ApiError.invalid("messages", "this model has no chat template; use /v1/completions")
        given: dict[str, Any] = {"thinking": self._thinking(params)}
        if params.tools is not None:
            given["tools"] = params.tools
        if params.continue_final or not params.add_generation_prompt:  # the renderer's defaults otherwise
            given |= {"add_generation_prompt": params.add_generation_prompt, "continue_final": params.continue_final}
        try:
            return self.render_chat(params.messages, **given)
        except RequestError as exc:
            raise ApiError.invalid("messages", str(exc)) from None

    def _with_tools(self, params: CompletionParams, request: GenerationRequest) -> GenerationRequest:
        """A request with tools (but `tool_choice` none) constrained to the template's call format, its
        markers shown in the text (docs/PROTOCOL.md §9.2, Tools)."""
        if params.tools is None or params.tools.choice == "none":
            return request
        if params.constraint is not None:
            raise ApiError.invalid("tools", "tools and a response_format (or grammar) both constrain the answer; "
                                   "give one of them, or tool_choice \"none\"")
        markers = self.tokenizer.marker_ids(FORMATS[self.tool_format].markers)
        grammar = tool_grammar(self.tool_format, params.tools, special_tokens=markers)
        if grammar is None:
            return request
        constraint = constraint_field(ConstraintKind.LARK, grammar, "tools")
        return attrs.evolve(request, constraint=constraint, shown_ids=frozenset(markers.values()))

    def prepare_embeddings(self, params: EmbeddingParams, *, per_token: bool = False) -> list[GenerationRequest]:
        """Tokenize every input and check it against the context; one engine request each; blocking. With
        `serve --pooling none` only a route that answers per token (`per_token`: llama-server's /embeddings)
        takes it, and each input's rows must fit a reply (400s naming why)."""
        if self.pooling is Pooling.NONE and not per_token:
            raise ApiError.invalid(None, "this server embeds with --pooling none: one vector per token, which "
                                   "OpenAI's embeddings answer cannot carry; use POST /embeddings (llama-server's "
                                   "shape), or serve with --pooling mean or last")
        params.check_dimensions(self.n_embd)
        ids: list[list[int]] = []
        for index, given in enumerate(params.inputs):
            if isinstance(given, str):
                self._refuse_certain_overflow(f"input[{index}]" if len(params.inputs) > 1 else "input", len(given),
                                              bos=True, generating=False)
                ids.append(self.tokenizer.encode(given))
            else:
                ids.append(list(given))
        if self.pooling is Pooling.NONE and self.n_embd:
            check_per_token_size(ids, self.n_embd)
        return params.requests(ids, self.engine.ctx_size, n_vocab=self.tokenizer.n_vocab, pooling=self.pooling)

    def prepare_rerank(self, params: RerankParams) -> list[GenerationRequest]:
        """Each document's prompt with the query, tokenized and checked against the context; one rank-pooled
        engine request each; ApiError 501 when reranking is off; blocking."""
        if self.rerank is None:
            raise ApiError(501, "This server does not support reranking. Start it with `--reranking` (a file that "
                           "declares rank pooling turns it on by itself)", kind="not_supported_error",
                           code="not_supported")
        ids = []
        for index, document in enumerate(params.documents):
            self._refuse_certain_overflow(f"documents[{index}]", len(params.query) + len(document), bos=True,
                                          generating=False)
            ids.append(self.rerank.ids(self.tokenizer, params.query, document))
        return params.requests(ids, self.engine.ctx_size)

    def _refuse_certain_overflow(self, param: str, chars: int, *, bos: bool, generating: bool = True) -> None:
        """400 context_length_exceeded, before any tokenizing, for text too long to fit whatever
        it tokenizes to: no token covers more than `max_piece_chars` characters."""
        floor = self.tokenizer.min_tokens(chars, add_special=bos)
        if floor >= self.engine.ctx_size:
            ctx = self.engine.ctx_size
            rule = "leaving no room to generate" if generating else f"and an input may have at most {ctx - 1}"
            raise ApiError.context_length(param, f"the context holds {ctx} tokens and the {param} of {chars} "
                                          f"characters has at least {floor} tokens, {rule}",
                                          n_prompt_tokens=floor, n_ctx=ctx)  # a lower bound: never tokenized


def _content_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of text in chat messages (string contents and the text of content parts)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return total


class GatewayState:
    """The gateway's view of the pipeline: the startup status, then the serving engine."""

    def __init__(self, model: str, *, ctx_size: int | None = None, served_names: Sequence[str] = (),
                 strict_model_name: bool = False, sampling: SamplingDefaults = NO_DEFAULTS,
                 verbose: bool = False, tags: Sequence[str] = ()) -> None:
        """`model` as the topology or --model names it; `ctx_size` once known (for /v1/models);
        `served_names` (--served-model-name): the first is the id reported; `strict_model_name`: a
        request naming another model is a 404 instead of being served by this one; `sampling`: the
        server's sampling defaults (`serve --seed`, `--temp`, ...); `verbose` (`serve -v`): OpenAI
        answers carry `__verbose` unless the request says `verbose: false` (llama-server's --verbose);
        `tags` (--tags): labels /v1/models lists with the model."""
        names = tuple(dict.fromkeys(served_names))  # in order, each once
        self.model_id = names[0] if names else model_id(model)
        self.served_names: tuple[str, ...] = names or (self.model_id,)
        self.strict_model_name = strict_model_name
        self.tags = tuple(tags)
        self.pipeline_sleep: PipelineSleep | None = None  # serve --sleep-idle-seconds (PROTOCOL §9.6, Sleeping)
        self.sampling = sampling
        self.verbose = verbose
        self.ctx_size = ctx_size
        self.created = int(time.time())
        self.status = "starting"  # human text while no engine is attached
        self._serving: AttachedEngine | None = None
        self._draining = False

    def attach(self, serving: AttachedEngine) -> None:
        """The engine is started (its stages may still be loading: health says when they beat)."""
        self.ctx_size = serving.engine.ctx_size
        self._serving = serving

    def check_model(self, name: str | None) -> None:
        """A request's `model`: with `strict_model_name`, ApiError 404 `model_not_found` unless it is None
        (not given) or one of the served names; otherwise any name is answered by the served model."""
        if self.strict_model_name:
            self.find_model(name)

    def find_model(self, name: str | None) -> None:
        """ApiError 404 `model_not_found` unless `name` is None or one of the served names (/v1/models/{id})."""
        if name is not None and name not in self.served_names:
            raise ApiError.model_not_found(name, self.model_id)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; /health answers 503 "draining"."""
        self._draining = True

    @property
    def draining(self) -> bool:
        """True once shutdown began."""
        return self._draining

    @property
    def engine(self) -> EngineLike | None:
        """The engine once attached (None while starting)."""
        return None if self._serving is None else self._serving.engine

    @property
    def sleeping(self) -> bool:
        """Whether serve --sleep-idle-seconds has the stages stopped (or stopping, or starting)."""
        return self.pipeline_sleep is not None and self.pipeline_sleep.sleeping

    @property
    def spans(self) -> tuple[StageSpan, ...]:
        """Each stage's layers and lanes once the engine is attached (() while starting)."""
        return () if self._serving is None else self._serving.spans

    def serving(self) -> AttachedEngine:
        """What serves a request now; ApiError 503 (with Retry-After) while starting, draining or asleep (the
        HTTP routes wake the pipeline before they get here)."""
        if self._draining:
            raise ApiError.unavailable("draining: the server is shutting down")
        if self.sleeping:
            raise ApiError.unavailable("asleep: the stages were stopped after --sleep-idle-seconds; an HTTP "
                                       "request that needs the model wakes them")
        if self._serving is None:
            raise ApiError.unavailable(self.status)
        health = self._serving.engine.health()
        if not health.ready:
            raise ApiError.unavailable(health.describe())
        return self._serving

    def attached(self) -> AttachedEngine:
        """The attached engine whatever its health (the tokenizer routes need no stage); ApiError 503
        while starting or draining."""
        if self._draining:
            raise ApiError.unavailable("draining: the server is shutting down")
        if self._serving is None:
            raise ApiError.unavailable(self.status)
        return self._serving

    def pipeline(self) -> tuple[str, str, Health | None]:
        """The state /health reports ("ok", "starting", "waiting", "draining"), its sentence, and the engine's
        health snapshot it was read from (None while starting or draining); reads snapshots only."""
        if self._draining:
            return "draining", "draining: the server is shutting down", None
        if self.sleeping:  # it serves: the next request wakes it
            return "ok", "asleep: the stages are stopped until a request needs them (--sleep-idle-seconds)", None
        if self._serving is None:
            return "starting", self.status, None
        health = self._serving.engine.health()
        state = "ok" if health.serving else ("draining" if health.draining else "waiting")
        return state, health.describe(), health

    def health(self) -> tuple[bool, JsonObject]:
        """Whether /health is 200, and its JSON body (what it waits for, the silent stages, and each
        stage as the driver sees it: up, down or never heard, and what to check)."""
        state, message, health = self.pipeline()
        silent = () if health is None else health.silent
        stages = [] if health is None else [status.as_json() for status in health.stages]
        body: JsonObject = {"status": state, "message": message, "silent_stages": list(silent), "stages": stages,
                            "model": self.model_id, "sleeping": self.sleeping}
        if self._serving is not None and self._serving.links:  # whoever reads figures must know the links were emulated
            body["emulated_links"] = [dict(link) for link in self._serving.links]
        return state == "ok", body


class ClientSlot:
    """One request's place under its client's cap; `release` is idempotent, so every end path may call it."""

    def __init__(self, limiter: ClientLimiter, client: str) -> None:
        self._limiter = limiter
        self.client = client
        self.released = False

    def release(self) -> None:
        """The request ended (finished, failed, cancelled, or its client went away)."""
        if not self.released:
            self.released = True
            self._limiter._release(self.client)

    def __enter__(self) -> ClientSlot:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class ClientLimiter:
    """Requests in flight per client, capped, so no one client can take the whole queue; socket-free.

    A client is a string the front end chooses (HTTP: the peer address; the ZeroMQ request API: the
    client's CURVE public key when CURVE is on, else the connection's routing id). In flight means
    from acceptance to the request's end: waiting for a lane, being tokenized, or generating. Used
    from the event loop's thread only.
    """

    def __init__(self, cap: int | None, on_refused: Callable[[], None] | None = None) -> None:
        """`cap` None or 0: no cap. `on_refused` is called for each refusal (the metrics counter)."""
        self.cap = cap or None
        self._on_refused = on_refused
        self._in_flight: dict[str, int] = {}

    def acquire(self, client: str) -> ClientSlot:
        """A slot for one more request of `client`; ApiError 429 `too_many_requests` at the cap."""
        count = self._in_flight.get(client, 0)
        if self.cap is not None and count >= self.cap:
            if self._on_refused is not None:
                self._on_refused()
            raise ApiError.client_cap(self.cap)
        self._in_flight[client] = count + 1
        return ClientSlot(self, client)

    def in_flight(self, client: str) -> int:
        """Requests of `client` in flight now."""
        return self._in_flight.get(client, 0)

    def __len__(self) -> int:
        """Clients with requests in flight (a client with none is forgotten)."""
        return len(self._in_flight)

    def _release(self, client: str) -> None:
        count = self._in_flight[client] - 1
        if count:
            self._in_flight[client] = count
        else:
            del self._in_flight[client]
