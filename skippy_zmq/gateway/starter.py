"""Bringing `serve`'s pipeline up behind the listener, and taking it down (docs/ARCHITECTURE.md,
"Serving", Startup).

A local pipeline's stage processes start first, before the gateway imports its HTTP stack
(`EarlyStages`, from `gateway/command.py`): they load while the gateway starts, which on two
cores takes about as long as the stages do. A background thread (`PipelineStarter`) then reads
the model's tokenizer and chat template, starts the engine (which binds the topology's return
endpoint), starts the local stages itself when they could not start early (a model still to be
assembled), and waits for every stage's heartbeat (all within `--ready-timeout`, else exit 1).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from skippy_zmq.config import DEFAULT_MODEL, TopologyConfig
from skippy_zmq.errors import StageTimeout
from skippy_zmq.gateway.options import ServeLog, ServeOptions, load_chat_template, uses_legacy_chat
from skippy_zmq.gateway.tool_formats import ToolFormat

if TYPE_CHECKING:
    from skippy_zmq.driver.engine import Engine
    from skippy_zmq.driver.watch import StageEvent
    from skippy_zmq.gateway.chat import ChatTemplate
    from skippy_zmq.gateway.legacy_chat import LegacyTemplate
    from skippy_zmq.gateway.rerank_api import RerankPrompts
    from skippy_zmq.gateway.state import ChatRenderer, GatewayState, PromptRenderer, ReasoningReaders
    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.security.curve import RefusalHandler
    from skippy_zmq.tokens.tokenizer import Tokenizer

STARTER_JOIN_S = 60.0
"""How long shutdown waits for a startup thread that cannot be interrupted (a model being assembled)."""


class PipelineStarter:
    """Brings the pipeline up on a background thread and takes it down again."""

    def __init__(self, options: ServeOptions, backend: GatewayState, log: ServeLog,
                 on_refused: RefusalHandler | None = None, early: EarlyStages | None = None,
                 on_stage_event: Callable[[StageEvent], None] | None = None) -> None:
        """`early`: the local stages, already started (this starter then owns and stops them);
        `on_stage_event`: the engine's news of its stages (down, back, replays)."""
        self.options = options
        self.backend = backend
        self.log = log
        self.on_refused = on_refused
        self.on_stage_event = on_stage_event
        self.early = early
        self.engine: Engine | None = None
        self.pipeline: LocalPipeline | None = early.pipeline if early is not None else None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.finished = threading.Event()
        self._cancelled = threading.Event()
        self._released = threading.Event()
        self._directory: str | None = early.directory if early is not None else None
        self._thread = threading.Thread(target=self._run, name="skippy-serve-start", daemon=True)

    def start(self) -> None:
        """Start the background thread."""
        self._thread.start()

    def _run(self) -> None:
        try:
            self._bring_up()
        except Exception as exc:  # noqa: BLE001 - any failure ends the server; reported by its watcher
            self.error = exc
            return
        finally:
            self.finished.set()
        # Stay alive until shutdown: the stages' parent-death signal (launch/processes.py) follows the
        # thread that started them, so this thread ending would stop every stage.
        self._released.wait()

    def _status(self, text: str) -> None:
        self.backend.status = f"starting: {text}"
        self.log.event("progress", text)

    def _bring_up(self) -> None:
        from skippy_zmq.driver.engine import Engine
        from skippy_zmq.gateway.stages_api import StageSpan
        from skippy_zmq.gateway.state import AttachedEngine
        from skippy_zmq.model.catalog import resolve_model
        from skippy_zmq.model.gguf_model import ModelHParams
        from skippy_zmq.tokens.pooling import Pooling
        from skippy_zmq.tokens.tokenizer import Tokenizer

        options = self.options
        started = self.early.started if self.early is not None else time.monotonic()
        if self.early is not None:
            model_path, topology_path = self.early.model_path, self.early.topology_path
            self.early.pipeline.progress = self._status
        else:
            model = self._model_name()
            self._status(f"reading the model {model}")
            model_path = resolve_model(model, progress=self._status)
            if options.topology_path is not None:
                topology_path = Path(options.topology_path)
            else:
                self._directory, topology_path = write_serve_topology(options, model_path)
        topology = TopologyConfig.from_toml(topology_path)
        if self.early is not None:
            self._status(f"loading {topology.n_stages} stages")
        elif options.topology_path is None and not self._cancelled.is_set():
            # The stages load while this process reads the tokenizer and builds the engine.
            self._status(f"loading {topology.n_stages} stages")
            self.pipeline = _local_pipeline(topology_path, options, self._status)
            self.pipeline.spawn()
        try:
            tokenizer = Tokenizer.from_gguf(model_path)
            n_embd = ModelHParams.from_gguf(model_path).n_embd  # the `dimensions` /v1/embeddings answers with
            given = load_chat_template(options)
            chat = _chat_renderer(model_path, tokenizer, self.log, given, legacy=uses_legacy_chat(options, given))
            engine = Engine(topology, tokenizer, options.scheduler, on_handshake_refused=self.on_refused,
                            on_stage_event=self.on_stage_event)
            self.backend.ctx_size = engine.ctx_size
            self.engine = engine
            engine.start()
            if self.pipeline is not None:
                self.pipeline.wait_ready(max(options.ready_timeout_s - (time.monotonic() - started), 1.0))
        except BaseException:
            if self.pipeline is not None:
                self.pipeline.stop()
            raise
        self.backend.attach(AttachedEngine(engine, tokenizer, chat.render_chat, pooling=Pooling.named(options.pooling),
                                           n_embd=n_embd, chat_template=chat.source, model_path=str(model_path),
                                           links=tuple(topology.emulated_links()), tool_format=chat.tool_format,
                                           render_prompt=chat.render_prompt, reasoning=chat.reasoning,
                                           rerank=_rerank_prompts(model_path, options.reranking),
                                           spans=StageSpan.of_topology(topology)))
        self._wait_heartbeats(engine, started + options.ready_timeout_s)

    def _model_name(self) -> str:
        if self.options.topology_path is not None:
            return TopologyConfig.from_toml(self.options.topology_path).model
        return self.options.model or DEFAULT_MODEL

    def _wait_heartbeats(self, engine: Engine, deadline: float) -> None:
        while not engine.health().ready:
            if self._cancelled.is_set():
                return
            if time.monotonic() > deadline:
                raise StageTimeout(
                    f"pipeline not ready after --ready-timeout {self.options.ready_timeout_s:g} s: "
                    f"{engine.health().describe()}"
                )
            time.sleep(0.05)
        self.ready.set()

    def dead_stage(self) -> str | None:
        """A description of a local stage process that exited, or of a dead engine, if any."""
        engine = self.engine
        if engine is not None and self.ready.is_set() and not engine.alive:
            return f"the serving engine stopped: {engine.failure or 'unknown cause'}"
        pipeline = self.pipeline
        if self.backend.sleeping:
            return None  # stopped on purpose, or starting again (a failed wake answers its request)
        dead = pipeline.dead() if pipeline is not None and self.ready.is_set() else []
        return dead[0].describe_exit() if dead else None

    def sleep(self) -> None:
        """Stop the local stages for serve --sleep-idle-seconds (their memory goes back to the system); the
        engine stays, waiting for their heartbeats (blocking)."""
        assert self.pipeline is not None, "only a local pipeline sleeps (ServeOptions checks it)"
        codes = self.pipeline.stop()
        self.log.event("stages_stopped", f"stages stopped to sleep: {codes}", exit_codes=codes)

    def wake(self) -> None:
        """Start the local stages again and wait, within --ready-timeout, until they load and beat to the engine
        (blocking); StageError or StageTimeout naming the stage when they do not (they are stopped then)."""
        pipeline, engine = self.pipeline, self.engine
        assert pipeline is not None and engine is not None, "only a started local pipeline sleeps"
        deadline = time.monotonic() + self.options.ready_timeout_s
        pipeline.spawn()
        pipeline.wait_ready(self.options.ready_timeout_s)
        while not engine.health().ready:
            if time.monotonic() > deadline:
                pipeline.stop()
                raise StageTimeout(f"the stages did not beat within --ready-timeout {self.options.ready_timeout_s:g} s "
                                   f"of waking: {engine.health().describe()}")
            time.sleep(0.05)

    def cancel(self) -> None:
        """Stop a startup still under way (stage processes loading are told to exit)."""
        self._cancelled.set()
        pipeline = self.pipeline
        if pipeline is not None and not self.ready.is_set():
            for process in list(pipeline.processes):
                process.request_stop()

    def stop(self) -> None:
        """Close the engine and stop the local stages (blocking; after the drain)."""
        deadline = time.monotonic() + STARTER_JOIN_S
        while not self.finished.is_set() and time.monotonic() < deadline:
            self.cancel()  # again: a stage process may have started since the last call
            self.finished.wait(0.2)
        if self.engine is not None:
            self.engine.close()
        if self.pipeline is not None:
            codes = self.pipeline.stop()
            self.log.event("stages_stopped", f"stages stopped: {codes}", exit_codes=codes)
        self._released.set()
        self._thread.join(5)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


@attrs.frozen
class ChatRendering:
    """What serving chats needs of the chat template (all None when the model has none)."""

    render_chat: ChatRenderer | None = None  # messages -> prompt ids
    source: str | None = None  # the GGUF's template text (None for a built-in turn format), GET /props
    tool_format: ToolFormat = ToolFormat.GENERIC  # how it writes tool calls
    render_prompt: PromptRenderer | None = None  # messages -> prompt text, /apply-template
    reasoning: ReasoningReaders | None = None  # how answers are read for thought

    @classmethod
    def of(cls, template: ChatTemplate | LegacyTemplate) -> ChatRendering:
        """The renderers of one compiled template."""
        return cls(template.render_ids, None if template.is_fallback else template.source, template.tool_format,
                   template.render_text, template.reasoning_reader)


def _chat_renderer(model_path: Path, tokenizer: Tokenizer, log: ServeLog, given: tuple[str, str] | None = None,
                   *, legacy: bool = False) -> ChatRendering:
    """The model's chat template (or its family's turn format), nothing when it has neither.
    `given` (--chat-template(-file): its text and origin) replaces the GGUF's; it must compile. `legacy`:
    llama.cpp's C++ format for the given or the GGUF's template (chatml without one), as --no-jinja."""
    from skippy_zmq.errors import ChatTemplateError
    from skippy_zmq.gateway.chat import ChatTemplate

    if legacy:
        return _legacy_renderer(model_path, tokenizer, log, given)
    if given is not None:  # a ChatTemplateError naming the option and file ends serve
        template = ChatTemplate.from_source(given[0], tokenizer, origin=given[1])
        origin = given[1]
    else:
        try:
            template = ChatTemplate.from_gguf(model_path, tokenizer)
        except ChatTemplateError as exc:
            log.event("chat_disabled", f"/v1/chat/completions answers 400: {exc}", error=str(exc))
            return ChatRendering()
        origin = "the family's turn format" if template.is_fallback else "the model's chat template"
    markers = template.reasoning_reader()
    thought = f"; thought between {markers.markers.start} and {markers.markers.end}" if markers is not None else ""
    log.event("chat_template", f"chat prompts use {origin}; tool calls in the {template.tool_format} format{thought}",
              fallback=template.is_fallback, tool_format=str(template.tool_format))
    return ChatRendering.of(template)


def _legacy_renderer(model_path: Path, tokenizer: Tokenizer, log: ServeLog, given: tuple[str, str] | None
                     ) -> ChatRendering:
    """llama.cpp's C++ chat format (--no-jinja, or a built-in name in --chat-template): the given template's,
    else the one llama.cpp recognises in the GGUF's template, chatml without one (llama-server's rule)."""
    from skippy_zmq.gateway.chat import CHAT_TEMPLATE_KEY
    from skippy_zmq.gateway.legacy_chat import CHATML, LegacyTemplate
    from skippy_zmq.model.gguf_file import read_header

    if given is None:
        source = read_header(model_path).string(CHAT_TEMPLATE_KEY, "") or CHATML
        origin = "the model's chat template (--no-jinja)" if source != CHATML else "chatml (--no-jinja, no template)"
    else:
        source, origin = given
    template = LegacyTemplate(source, tokenizer, origin=origin)
    log.event("chat_template", f"chat prompts use llama.cpp's C++ format for {origin}; tool calls in the generic "
              "format", fallback=False, tool_format=str(template.tool_format))
    return ChatRendering.of(template)


def write_serve_topology(options: ServeOptions, model_path: Path) -> tuple[str, Path]:
    """The local pipeline's topology, planned for `options` in a new temporary directory: (the
    directory, the topology file)."""
    from skippy_zmq.launch.topology import blas_threads_per_stage, write_local_topology
    from skippy_zmq.model.gguf_model import ModelHParams

    directory = tempfile.mkdtemp(prefix="skippy-zmq-serve-")
    threads = options.threads
    if threads is None:  # K micro-batches keep up to K stages busy at once: they share the cores
        threads = blas_threads_per_stage(options.stages, busy_stages=options.micro_batches)
    try:
        path = write_local_topology(
            str(model_path), ModelHParams.from_gguf(model_path).n_layer, options.stages, codec=options.codec,
            policy=options.codec_policy, directory=Path(directory), lane_count=options.lanes,
            ctx_size=options.ctx_size, threads=threads, max_stage_memory=options.max_stage_memory,
            cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v, emulate_link=options.emulate_link,
        )
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, path


def _local_pipeline(topology_path: Path, options: ServeOptions, progress: Callable[[str], None]) -> LocalPipeline:
    from skippy_zmq.launch.processes import LocalPipeline

    return LocalPipeline(topology_path, log_sink=sys.stderr if options.verbose else None, log_json=options.log_json,
                         check_tensors=options.check_tensors, progress=progress)


@attrs.frozen
class EarlyStages:
    """A local pipeline's stage processes started before the gateway imports its HTTP stack and
    binds its port: they load while the gateway starts (docs/ARCHITECTURE.md, "Serving")."""

    model_path: Path
    topology_path: Path
    directory: str
    pipeline: LocalPipeline
    started: float  # time.monotonic() when they were spawned: --ready-timeout counts from here

    @classmethod
    def start(cls, options: ServeOptions, log: ServeLog) -> EarlyStages | None:
        """Spawn the stages of `options`' local pipeline; None with --topology (no local stages) or
        when the model must first be assembled (the listener then reports that as it goes)."""
        from skippy_zmq.model.catalog import local_model

        if options.topology_path is not None:
            return None
        model_path = local_model(options.model or DEFAULT_MODEL)
        if model_path is None:
            return None
        started = time.monotonic()
        directory, topology_path = write_serve_topology(options, model_path)
        pipeline = _local_pipeline(topology_path, options, lambda text: log.event("progress", text))
        try:
            pipeline.spawn()  # stops what it started when it fails
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(model_path, topology_path, directory, pipeline, started)

    def stop(self) -> None:
        """Stop the stages and remove the topology's directory (when no starter took them over)."""
        self.pipeline.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _rerank_prompts(model_path: Path, reranking: bool) -> RerankPrompts | None:
    """How /rerank builds its prompts: on with --reranking or in a file that declares rank pooling."""
    from skippy_zmq.gateway.rerank_api import RerankPrompts, declares_rank_pooling
    from skippy_zmq.model.gguf_file import read_header

    header = read_header(model_path)
    return RerankPrompts.of_header(header) if reranking or declares_rank_pooling(header) else None
