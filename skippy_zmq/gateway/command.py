"""The `skippy-zmq serve` click command (registered on the main group by skippy_zmq/cli.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from skippy_zmq import defaults
from skippy_zmq.errors import SkippyError

if TYPE_CHECKING:
    from skippy_zmq.gateway.options import ServeOptions
    from skippy_zmq.link import LinkShape

API_KEY_ENV = "SKIPPY_API_KEY"
"""The environment variable `serve` reads the API key from when --api-key is not given."""
F = TypeVar("F", bound=Callable[..., Any])

CHECK_TENSORS_HELP = ("Scan each stage's tensors at load for NaN/Inf values and block scales and refuse a damaged "
                      "model file, naming the tensor and the byte offset (llama.cpp's flag; docs/PROTOCOL.md §7).")
"""The help of `--check-tensors`, the same on `worker`, `up`, `serve` and `generate`."""
CHECK_TENSORS_REMOTE = ("--check-tensors applies to the stages this command starts; with --topology the stages run "
                        "already: start each worker with --check-tensors, or set check_tensors = true on its stage "
                        "in the topology")
"""Why `--check-tensors` and `--topology` do not go together on `serve` and `generate`."""


BATCH_INVARIANT_HELP = ("Compute every row in one order whatever else is in its pass (other sessions, prefill chunks, "
                        "batch size): a request's text then depends on the request alone, through replays after a "
                        "stage restarts, the prompt cache, forks and speculative decoding "
                        "(docs/ARCHITECTURE.md, \"Batch-invariant mode\", with its cost). Default: on wherever the "
                        "file's tensor types allow it, llama.cpp's kernels elsewhere (the stage's load line says "
                        "which). --batch-invariant refuses a file it cannot hold; --no-batch-invariant gives "
                        "llama.cpp's kernels and bits everywhere.")
"""The help of `--batch-invariant/--no-batch-invariant`, the same on `worker`, `up`, `serve` and `generate`."""


def set_batch_invariant(on: bool | None) -> None:
    """With `on` True (False), this process's stages (and those it starts, which inherit its environment) run
    (do not run) the batch-invariant mode; None leaves the environment's choice, by default where the file allows."""
    if on is not None:
        os.environ[defaults.BATCH_INVARIANT_ENV] = "1" if on else "0"


DRAFT_MAX_HELP = ("Speculative decoding without a draft model: a decode step may also carry up to N tokens that "
                  "the session's own text suggests (what followed the latest earlier occurrence of its last tokens), "
                  "checked in one pass by the session's own sampler; fewer as more sessions decode, none while they "
                  "keep failing. 0: one token a step. Where every stage computes batch-invariantly the text equals "
                  f"one-at-a-time decoding and the default is {defaults.DRAFT_MAX}; elsewhere a row of a wider pass "
                  "may differ from llama.cpp's in its last bits (as in llama-server's speculation), and the default "
                  "is 0.")
"""The help of `--draft-max`, the same on `serve` and `generate`."""

def default_drafts(draft_max: int | None, invariant: bool | None) -> int | None:
    """`--draft-max` as given, else its default: 0 with `--no-batch-invariant`, else None (the scheduler's choice:
    `defaults.DRAFT_MAX` while every stage's heartbeat says it computes batch-invariantly, else 0)."""
    if draft_max is not None:
        return draft_max
    return 0 if invariant is False else None


MAX_STAGE_MEMORY_HELP = ("Bytes each local stage may hold (weights, KV cache at --ctx-size and --lanes, graph buffers, "
                         "the process), e.g. 6GiB; a cut that cannot fit is refused before any stage starts. "
                         "Default: the host's available memory divided by the stages.")
"""The help of `--max-stage-memory`, the same on `serve`, `generate` and `plan`."""


EMULATE_LINK_HELP = ("Emulate a slower link: delay, jitter, rate and stalls, as in delay=10ms,jitter=2ms,rate=100mbit,"
                     "stall=5ms@2s (any subset), or off. The stage's sends downstream (the final stage's replies to "
                     "the driver) leave when the emulated link delivers them; heartbeats are not delayed "
                     "(docs/ARCHITECTURE.md, \"Link emulation\").")
"""The help of `--emulate-link`, the same on `worker`, `serve` and `generate`."""


def link_shape(_ctx: click.Context, param: click.Parameter, value: str | None) -> LinkShape | None:
    """Click callback: a link spec to a `LinkShape`; a usage error names the field that is wrong."""
    from skippy_zmq.link import LinkShape

    if value is None:
        return None
    try:
        return LinkShape.parse(value, where=f"--{(param.name or '').replace('_', '-')}")
    except SkippyError as exc:
        raise click.BadParameter(str(exc)) from None


def memory_size(_ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Click callback: a size such as `6GiB` or a byte count to bytes; a usage error names what was wrong."""
    from skippy_zmq.config import parse_size

    if value is None:
        return None
    try:
        return parse_size(value, where=f"--{(param.name or '').replace('_', '-')}")
    except SkippyError as exc:
        raise click.BadParameter(str(exc)) from None


def check_local_options(topology_path: str | None, *, model: str | None, check_tensors: bool,
                        max_stage_memory: int | None, emulate_link: LinkShape | None = None) -> None:
    """Options of a local pipeline given with --topology are usage errors (exit 2) saying what to do instead."""
    if not topology_path:
        return
    if model:
        raise click.UsageError("--model applies to a local pipeline; with --topology the topology names the model")
    if check_tensors:
        raise click.UsageError(CHECK_TENSORS_REMOTE)
    if max_stage_memory is not None:
        raise click.UsageError("--max-stage-memory applies to a local pipeline; with --topology set max_memory on "
                               "each stage of the topology")
    if emulate_link is not None:
        raise click.UsageError("--emulate-link applies to a local pipeline; with --topology set emulate_link in the "
                               "topology, or start a worker with --emulate-link")


def check_codec_options(codec: str, codec_policy: str) -> None:
    """A bad codec or policy name is a usage error (exit 2), caught before anything starts."""
    from skippy_zmq.wire.codecs import ActivationCodec, CodecPolicy

    try:
        ActivationCodec.parse(codec)
        CodecPolicy.parse(codec_policy)
    except SkippyError as exc:
        raise click.BadParameter(str(exc)) from None


def cache_type_options(func: F) -> F:
    """`--cache-type-k` and `--cache-type-v`, llama.cpp's options with its names, on serve, generate and plan."""
    for which, what in (("v", "values"), ("k", "keys")):
        func = click.option(f"--cache-type-{which}", type=click.Choice(defaults.CACHE_TYPE_NAMES),
                            default=defaults.CACHE_TYPE, show_default=True,
                            help=f"KV cache type of the {what} each stage keeps (llama.cpp's names; f32 to compare "
                                 "with an F32 reference).")(func)
    return func


def check_local_cache_types(topology_path: str | None) -> None:
    """With --topology the topology names each stage's cache types: a --cache-type-* given too is a usage error."""
    context = click.get_current_context()
    for name in ("cache_type_k", "cache_type_v"):
        if topology_path and context.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            option = "--" + name.replace("_", "-")
            raise click.UsageError(f"{option} applies to a local pipeline; with --topology each stage's {name} "
                                   "is in the topology")


_SECONDS = click.FloatRange(min=0, min_open=True)


def served_names(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """Click callback of `--served-model-name`: each use may hold several names, comma-separated."""
    names = tuple(name.strip() for entry in value for name in entry.split(","))
    if any(not name for name in names):
        raise click.BadParameter(f"{', '.join(map(repr, value))} holds an empty name; give model names such as "
                                 "gpt-4o or org/model, comma-separated or one per --served-model-name")
    return tuple(dict.fromkeys(names))


def cors_origins(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Click callback of `--cors-origins`: a usage error names an entry that is not an origin."""
    from skippy_zmq.gateway.cors import CorsPolicy

    try:
        CorsPolicy.parse(value)
    except SkippyError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


SAMPLING_OPTIONS = ("seed", "temp", "top_k", "top_p", "min_p", "n_predict")
"""The click parameters of the server's sampling defaults (llama-server's names), one `SamplingDefaults`."""


def sampling_options(func: F) -> F:
    """`--seed`, `--temp`, `--top-k`, `--top-p`, `--min-p`, `-n/--n-predict`: llama-server's options, the
    defaults of requests that leave those fields out (gateway/sampling_defaults.py checks them)."""
    rows = ((("-s", "--seed"), int, "Seed of requests that give none: they are then reproducible (-1: a random "
             "seed each, the default)."),
            (("--temp",), float, "Temperature of requests that give none (default: 0.8 on /completion, 1 on /v1)."),
            (("--top-k",), int, "top_k of requests that give none (default: 40 on /completion, off on /v1)."),
            (("--top-p",), float, "top_p of requests that give none (default: 0.95 on /completion, 1 on /v1)."),
            (("--min-p",), float, "min_p of requests that give none (default: 0.05 on /completion, 0 on /v1)."),
            (("-n", "--n-predict"), int, "Tokens to generate for requests that give no n_predict or max_tokens, "
             "up to the room the prompt leaves (-1, the default: /completion up to the context, /v1/completions "
             "16, chat up to the context)."))
    for names, kind, text in reversed(rows):
        func = click.option(*names, type=kind, default=None, help=text)(func)
    return func


def check_files(settings: ServeOptions) -> None:
    """The API key, TLS and chat template files read and checked (SkippyError naming the one at fault)."""
    from skippy_zmq.gateway.options import load_api_key, load_chat_template, tls_context, uses_legacy_chat

    load_api_key(settings)
    tls_context(settings)
    given = load_chat_template(settings)
    if given is not None and uses_legacy_chat(settings, given):
        from skippy_zmq.gateway.legacy_chat import LegacyTemplate

        LegacyTemplate.check_source(given[0], origin=given[1])  # no such format: exit 1 naming it
    elif given is not None:
        from skippy_zmq.gateway.chat import ChatTemplate

        ChatTemplate.check_source(given[0], origin=given[1])  # not compiling: exit 1 naming the file


@click.command()
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="Serve through stage workers already running for this topology.")
@click.option("--model", default=None, help="GGUF path for a local pipeline (default: Gemma 3 270M Q4_K_M).")
@click.option("--stages", type=click.IntRange(min=1), default=3, show_default=True,
              help="Stages of the local pipeline.")
@click.option("--lanes", type=click.IntRange(min=1), default=16, show_default=True,
              help="Concurrent sessions each local stage holds.")
@click.option("--ctx-size", type=click.IntRange(min=2), default=defaults.CTX_SIZE, show_default=True,
              help="Positions per session of the local pipeline (prompt + completion).")
@click.option("--max-stage-memory", default=None, callback=memory_size, help=MAX_STAGE_MEMORY_HELP)
@cache_type_options
@click.option("--emulate-link", default=None, callback=link_shape, metavar="SPEC",
              help=EMULATE_LINK_HELP + " Every link of the local pipeline.")
@click.option("--codec", default="raw-f32-v1", show_default=True, help="Activation codec of the local pipeline.")
@click.option("--codec-policy", default="fixed", show_default=True, help="fixed or auto-lossless-v1.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="BLAS threads per local stage (default: chosen by the launcher).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="HTTP listen address; several, comma-separated (e.g. 127.0.0.1,::1), listen on one port.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="HTTP port (0: any free port).")
@click.option("--zmq-bind", default=None, help="Also serve the ZeroMQ request API on this endpoint (tcp://HOST:PORT).")
@click.option("--max-queue", type=click.IntRange(min=0), default=defaults.MAX_QUEUE, show_default=True,
              help="Requests that may wait for a lane; beyond that, 429.")
@click.option("--request-timeout", "request_timeout_s", type=_SECONDS, default=defaults.REQUEST_TIMEOUT_S,
              show_default=True, help="Deadline of each request, seconds (then 504).")
@click.option("--ready-timeout", "ready_timeout_s", type=_SECONDS, default=defaults.READY_TIMEOUT_S, show_default=True,
              help="Seconds for every stage to be ready at startup (else exit 1).")
@click.option("--recovery-timeout", "recovery_timeout_s", type=click.FloatRange(min=0),
              default=defaults.RECOVERY_TIMEOUT_S,
              show_default=True,
              help="How long running sessions wait for a failed stage to come back, then replay (same text); "
                   "new requests stay queued meanwhile. 0: fail them at once.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True,
              help="Groups the live sessions are split into, pipelined through the stages.")
@click.option("--drain-timeout", "drain_timeout_s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM/SIGINT, seconds in-flight requests may take to finish.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=defaults.PREFILL_CHUNK, show_default=True,
              help="Prompt tokens per prefill message.")
@click.option("--cache-prompt/--no-cache-prompt", default=True, show_default=True,
              help="Keep a finished session's KV on the stages, so that a prompt which starts with its tokens "
                   "(the next turn of a chat, the same prompt again) computes only the rest, as llama-server's "
                   "cache_prompt does. Results may then differ in the last bits from a fresh run; a request's "
                   "own \"cache_prompt\": false opts out.")
@click.option("--draft-max", "--draft", type=click.IntRange(0, defaults.MAX_DRAFT_TOKENS), default=None,
              help=DRAFT_MAX_HELP + " A request's speculative.n_max overrides it.")
@click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True, default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health and /metrics (401 otherwise). "
                   f"Prefer ${API_KEY_ENV} or --api-key-file: a command line is visible to every local user. "
                   f"This flag wins over ${API_KEY_ENV}.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help=f"Read the API key from this file's first line (a compose secret); wins over ${API_KEY_ENV}.")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False), default=None,
              help="Serve HTTPS (TLS 1.2 or newer) with this PEM certificate (chain); needs --ssl-keyfile.")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False), default=None,
              help="The PEM private key (no passphrase) of --ssl-certfile.")
@click.option("--max-client-requests", type=click.IntRange(min=0), default=defaults.MAX_CLIENT_REQUESTS,
              show_default=True,
              help="Requests one client may have in flight (waiting, tokenizing or running); beyond that, 429 "
                   "too_many_requests. A client is a peer address on HTTP (behind a proxy all share one: raise "
                   "this or use 0) and a CURVE key (else a connection) on the ZeroMQ API. The default is a "
                   "quarter of the default --max-queue, so no one client can fill the queue. 0: no cap.")
@click.option("--pooling", type=click.Choice(("mean", "last", "none")), default="mean", show_default=True,
              help="How /v1/embeddings pools an input's output-normed rows into one L2-normalized vector "
                   "(llama-server's name). mean, the default, reflects every token of the input; the last row "
                   "of a model not trained for embeddings mostly predicts the next token. none: every token's "
                   "row, unnormalized, on POST /embeddings in llama-server's shape (/v1/embeddings refuses it).")
@click.option("--served-model-name", "served_model_name", multiple=True, callback=served_names,
              help="The model's name in the API (vLLM's option): the first is the id /v1/models reports and every "
                   "answer names. Repeat the option or separate names with commas. Default: the GGUF file's name.")
@click.option("--alias", "alias", multiple=True, callback=served_names,
              help="llama-server's name for --served-model-name, with its meaning: the names form a set, and the id "
                   "/v1/models reports is the first in sorted order. Use one of the two options.")
@click.option("--tags", "tags", multiple=True, callback=served_names,
              help="Labels /v1/models lists with the model (llama-server's --tags), comma-separated or repeated.")
@click.option("--reranking", "--rerank", "reranking", is_flag=True,
              help="Serve POST /rerank (and /v1/rerank): each document's prompt with the query is scored by the "
                   "model's rank head (a reranker's classifier, such as Qwen3-Reranker's; a file without one "
                   "scores by the first value of its last output-normed row, as llama-server does). On without "
                   "this flag when the file declares rank pooling.")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help=BATCH_INVARIANT_HELP + " Applies to the stages serve starts (with --topology: give each worker "
                   "the flag).")
@click.option("--sleep-idle-seconds", "sleep_idle_s", type=_SECONDS, default=None,
              help="Stop the local stages after this many seconds without a request that needs the model (their "
                   "memory goes back to the system; llama-server's option); the next such request starts them "
                   "again and waits for them (about the startup time). /health stays 200 and /props says "
                   "is_sleeping. Only for the stages serve starts itself (not with --topology). Default: never.")
@click.option("--strict-model-name", is_flag=True,
              help="Answer a request naming a model other than the --served-model-name names with 404 "
                   "model_not_found. Default: any name is served by this model, as llama-server does (clients "
                   "hard-code names such as gpt-3.5-turbo).")
@click.option("--cors-origins", default=None, callback=cors_origins,
              help="Web origins whose pages may call the API from a browser, comma-separated "
                   "(e.g. http://localhost:5173), or * for any. Preflights are answered without the API key; "
                   "the key still guards every request. Default: none.")
@sampling_options
@click.option("--chat-template", default=None, metavar="TEXT",
              help="Jinja text of the chat template to use instead of the GGUF's, or the name of one of llama.cpp's "
                   "built-in chat formats (chatml, llama3, command-r, ...), rendered as llama-server's --no-jinja "
                   "does (llama-server's option).")
@click.option("--chat-template-file", type=click.Path(dir_okay=False), default=None,
              help="A file of Jinja text: the chat template to use instead of the GGUF's (llama-server's option). "
                   "A file that cannot be read or does not compile ends serve at startup, naming it.")
@click.option("-rea", "--reasoning", type=click.Choice(("on", "off", "auto")), default="auto", show_default=True,
              help="Thought in chats (llama-server's option): on or off tells the chat template (enable_thinking); "
                   "auto lets it decide. A request's chat_template_kwargs.enable_thinking or reasoning_effort "
                   "\"none\" wins.")
@click.option("--reasoning-format", type=click.Choice(("auto", "deepseek", "deepseek-legacy", "none")),
              default="auto", show_default=True,
              help="Where a chat answer's thought goes (llama-server's option): deepseek (and auto) in "
                   "message.reasoning_content and reasoning_content deltas, deepseek-legacy there and in content "
                   "too, none left in content. A request's reasoning_format wins.")
@click.option("--chat-template-kwargs", default=None, metavar="JSON",
              help="A JSON object of extra chat template variables for every chat, e.g. "
                   "'{\"enable_thinking\": false}' (llama-server's option); a request's chat_template_kwargs "
                   "are added over them.")
@click.option("--jinja/--no-jinja", default=True, show_default=True,
              help="Render chats with the chat template's Jinja (the default), or with llama.cpp's C++ chat formats "
                   "as llama-server's --no-jinja does: the format llama.cpp recognises in the template (chatml for "
                   "a file without one), or the built-in format --chat-template names.")
@click.option("--web/--no-web", "--ui/--no-ui", "web", default=True, show_default=True,
              help="Serve the web page at / (chat with the model, and each stage's health, memory, lanes and where a "
                   "token's time goes; docs/PROTOCOL.md §9.9). It holds no data and needs no key to load; with an API "
                   "key, the page asks for it. --no-web (or llama-server's --no-ui): / is a 404.")
@click.option("-v", "--verbose", is_flag=True,
              help="Relay the local stages' log lines to stderr; OpenAI answers carry llama-server's __verbose.")
@click.option("--log-json", is_flag=True, help="Log one JSON object per line instead of human-readable progress.")
@click.option("--check-tensors", is_flag=True, help=CHECK_TENSORS_HELP + " Local pipeline only.")
def serve(topology_path: str | None, model: str | None, **options: object) -> None:
    """Serve a pipeline over an OpenAI-compatible HTTP API (and optionally ZeroMQ).

    Without --topology, a local pipeline of --stages worker processes is started for --model,
    before the port is bound. The port answers at once: /health is 503 until every stage is
    ready. SIGTERM or SIGINT drains in-flight requests (--drain-timeout), stops the stages and
    exits 0.

    With an API key, /health and /metrics still answer without it (for probes and the operator's
    Prometheus scraper; /metrics shows counts, never prompts): bind --host to a private address or
    firewall the port when they should not be public.
    """
    from skippy_zmq.gateway.options import ServeLog, ServeOptions, VertexSettings
    from skippy_zmq.gateway.reasoning import Thinking
    from skippy_zmq.gateway.sampling_defaults import SamplingDefaults
    from skippy_zmq.gateway.starter import EarlyStages

    check_local_options(topology_path, model=model, check_tensors=bool(options["check_tensors"]),
                        max_stage_memory=options["max_stage_memory"],  # type: ignore[arg-type]  # click's int
                        emulate_link=options["emulate_link"])  # type: ignore[arg-type]  # the callback's LinkShape
    check_local_cache_types(topology_path)
    check_codec_options(str(options["codec"]), str(options["codec_policy"]))
    source = click.get_current_context().get_parameter_source("api_key")
    if options["api_key_file"] is not None and source is ParameterSource.ENVIRONMENT:
        options["api_key"] = None  # the flag wins over the environment
    log = ServeLog(json_lines=bool(options["log_json"]))
    invariant: bool | None = options.pop("batch_invariant")  # type: ignore[assignment]  # click's flag or None
    set_batch_invariant(invariant)  # the local stages inherit it
    options["draft_max"] = default_drafts(options["draft_max"], invariant)  # type: ignore[arg-type]  # click's int
    alias: tuple[str, ...] = options.pop("alias")  # type: ignore[assignment]  # served_names' tuple
    if alias:
        if options["served_model_name"]:
            raise click.UsageError("--alias and --served-model-name both name the model: use one")
        options["served_model_name"] = tuple(sorted(alias))
    sampling = {name: options.pop(name) for name in SAMPLING_OPTIONS}
    thought = [options.pop(name) for name in ("reasoning", "reasoning_format", "chat_template_kwargs")]
    try:
        options["sampling"] = SamplingDefaults(seed=sampling["seed"], temperature=sampling["temp"],  # type: ignore[arg-type]
                                               top_k=sampling["top_k"], top_p=sampling["top_p"],  # type: ignore[arg-type]
                                               min_p=sampling["min_p"], n_predict=sampling["n_predict"],  # type: ignore[arg-type]
                                               thinking=Thinking.from_options(*thought))  # type: ignore[arg-type]
        options["vertex"] = VertexSettings.from_env(os.environ)  # AIP_MODE=PREDICTION: Vertex AI's routes
        settings = ServeOptions(topology_path=topology_path, model=model, **options)  # type: ignore[arg-type]  # click checked the types
        check_files(settings)  # refused files end here, before any stage starts
        # The local stages load while this process imports its HTTP stack and binds the port.
        early = EarlyStages.start(settings, log)
        from skippy_zmq.gateway.server import serve as run_server

        code = run_server(settings, log, early)
    except SkippyError as exc:
        log.event("fatal", f"error: {exc}", error=str(exc))
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        sys.exit(130)
    sys.exit(code)


if __name__ == "__main__":
    serve()
