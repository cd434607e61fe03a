"""`skippy-zmq serve`: listen at once, bring the pipeline up behind the listener, drain on a signal.

Startup: the HTTP port is bound first, so /health answers 503 naming the step under way while a
background thread reads the model's tokenizer and chat template, starts the engine (which binds
the topology's return endpoint), starts the local stage processes when there is no
`--topology`, and waits for every stage's heartbeat (all within `--ready-timeout`, else exit 1).
SIGTERM or SIGINT: /health and new requests answer 503 "draining", the engine lets in-flight
requests finish for up to `--drain-timeout` and fails the rest (at once on a second signal),
every session is stopped, the local stages are stopped, and the process exits 0. A local stage
that dies ends the server with exit status 1.

Access: `--api-key` (or `--api-key-file`) guards every HTTP route but /health and /metrics;
`--ssl-certfile`/`--ssl-keyfile` serve HTTPS (TLS 1.2 or newer). Both are read and checked before
the port is bound: a missing or unreadable file is a ConfigError (exit 1) naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs
from aiohttp import web

from skippy_zmq import defaults
from skippy_zmq.config import DEFAULT_MODEL, TopologyConfig, cache_type_validator
from skippy_zmq.errors import ConfigError, StageTimeout
from skippy_zmq.gateway.cors import ANY_ORIGIN, CorsPolicy
from skippy_zmq.gateway.http import make_app, server_options
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.state import AttachedEngine, ChatRenderer, GatewayState
from skippy_zmq.security.admission import ZapDecision
from skippy_zmq.security.curve import REQUESTS_DOMAIN, CurveSetup, RefusalHandler
from skippy_zmq.telemetry import EventLog

if TYPE_CHECKING:
    from skippy_zmq.driver.engine import Engine
    from skippy_zmq.gateway.zmq_api import ZmqRequestApi
    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.runtime.tokenizer import Tokenizer

WATCH_INTERVAL_S = 0.5
STARTER_JOIN_S = 60.0
"""How long shutdown waits for a startup thread that cannot be interrupted (a model being assembled)."""
SHUTDOWN_TIMEOUT_S = 5.0
"""How long closing the listener waits for handlers still running after the drain."""


def _check_pooling(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in POOLING_NAMES:
        raise ConfigError(f"--pooling {value!r} is not a pooling; expected one of {', '.join(POOLING_NAMES)}")


POOLING_NAMES = ("mean", "last")
"""`serve --pooling` values (runtime.pooling.Pooling's names)."""


@attrs.frozen
class ServeOptions:
    """Everything `serve` was asked for (see `skippy-zmq serve --help`)."""

    topology_path: str | None = None
    model: str | None = None
    stages: int = 3
    lanes: int = 16
    ctx_size: int = defaults.CTX_SIZE
    max_stage_memory: int | None = None  # bytes per local stage; None: the host's available memory shared
    cache_type_k: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)
    cache_type_v: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)
    codec: str = "raw-f32-v1"
    codec_policy: str = "fixed"
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_bind: str | None = None
    max_queue: int = 256
    request_timeout_s: float = 600.0
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    micro_batches: int = 1
    drain_timeout_s: float = 30.0
    prefill_chunk: int = 256
    verbose: bool = False
    log_json: bool = False
    api_key: str | None = attrs.field(default=None, repr=False)  # a secret: kept out of reprs and logs
    api_key_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_client_requests: int = defaults.MAX_CLIENT_REQUESTS
    recovery_timeout_s: float = defaults.RECOVERY_TIMEOUT_S
    check_tensors: bool = False  # the local stages scan their tensors at load
    pooling: str = attrs.field(default="mean", validator=_check_pooling)  # /v1/embeddings: "mean" or "last"
    served_model_name: tuple[str, ...] = ()  # the model's names in the API; the first is its id
    cors_origins: str | None = None  # web origins allowed to call the API (comma-separated, * any)

    def __attrs_post_init__(self) -> None:
        """Options that only make sense together, or apart (ConfigError otherwise)."""
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("--api-key and --api-key-file both give the API key: use one")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            given, missing = (("--ssl-certfile", "--ssl-keyfile") if self.ssl_keyfile is None
                              else ("--ssl-keyfile", "--ssl-certfile"))
            raise ConfigError(f"{given} needs {missing} too: HTTPS takes a certificate and its private key")
        CorsPolicy.parse(self.cors_origins)  # ConfigError naming an entry that is not an origin
        if self.check_tensors and self.topology_path is not None:
            raise ConfigError("check_tensors applies to the local stages serve starts; the stages of "
                              f"{self.topology_path} run already: start their workers with --check-tensors")


_KEY_CHARS = frozenset(chr(code) for code in range(0x21, 0x7F))  # what a Bearer token may hold, spaces excepted


def load_api_key(options: ServeOptions) -> str | None:
    """The API key of --api-key or --api-key-file (its first line, stripped); ConfigError when unusable."""
    key, origin = options.api_key, "--api-key"
    if options.api_key_file is not None:
        origin = f"--api-key-file {options.api_key_file}"
        try:
            lines = Path(options.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{origin}: cannot read the API key: {_reason(exc)}") from None
        key = lines[0].strip() if lines else ""
    if key is None:
        return None
    if not key:
        raise ConfigError(f"{origin}: the API key is empty")
    if not set(key) <= _KEY_CHARS:
        raise ConfigError(f"{origin}: the API key must be printable ASCII without spaces (it travels in a header)")
    return key


def tls_context(options: ServeOptions) -> ssl.SSLContext | None:
    """The server's TLS context (TLS 1.2+) from --ssl-certfile/--ssl-keyfile, or None for plain HTTP."""
    if options.ssl_certfile is None or options.ssl_keyfile is None:
        return None
    for flag, path, marker in (("--ssl-certfile", options.ssl_certfile, b"-----BEGIN CERTIFICATE-----"),
                               ("--ssl-keyfile", options.ssl_keyfile, b"PRIVATE KEY-----")):
        try:
            pem = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot read it: {_reason(exc)}") from None
        if marker not in pem:  # says which file is wrong, which OpenSSL's "PEM lib" does not
            raise ConfigError(f"{flag} {path}: not a PEM file with a {marker.strip(b'-').decode()} block")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # a key with a passphrase would make OpenSSL prompt on the terminal: refuse it instead
        context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile, password=_no_passphrase)
    except (ssl.SSLError, OSError, ConfigError) as exc:
        raise ConfigError(f"--ssl-certfile {options.ssl_certfile} / --ssl-keyfile {options.ssl_keyfile}: "
                          f"not a usable certificate and private key: {_reason(exc)}") from None
    return context


def _no_passphrase() -> bytes:
    raise ConfigError("the private key is encrypted; give it without a passphrase")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)


def exposure_warnings(options: ServeOptions, *, api_key: bool) -> list[str]:
    """What the listener exposes: to every web page, the API without a key under `--cors-origins *`;
    beyond this machine, the API without a key or a key without TLS."""
    warnings = []
    if ANY_ORIGIN in CorsPolicy.parse(options.cors_origins).origins and not api_key:
        warnings.append("--cors-origins * without --api-key: any web page a browser opens can run generations "
                        "here, a page from the internet on a loopback listener included")
    return warnings + _network_warnings(options, api_key=api_key)


def _network_warnings(options: ServeOptions, *, api_key: bool) -> list[str]:
    if options.host in ("localhost", ""):
        return []
    try:
        if ipaddress.ip_address(options.host).is_loopback:
            return []
    except ValueError:
        pass  # a host name: it may resolve to anything
    where = f"--host {options.host}"
    if not api_key:
        return [f"{where} without --api-key: anyone who can reach the port can run generations"]
    if options.ssl_certfile is None:
        return [f"{where} without --ssl-certfile: the API key and every prompt cross the network in clear text"]
    return []


class ServeLog:
    """Progress for people on stderr (`[skippy-zmq] ...`), or one JSON object per line."""

    def __init__(self, *, json_lines: bool, stream: IO[str] | None = None) -> None:
        self._json = EventLog("gateway", stream) if json_lines else None
        self._stream = stream
        self._lock = threading.Lock()

    def capture_warnings(self) -> None:
        """With JSON lines, Python warnings become rate-limited `warning` events, not raw text; the
        package's log records (warnings and errors, tracebacks included) become events either way,
        so every line on stderr has the one format."""
        if self._json is not None:
            self._json.capture_warnings()
        logger = logging.getLogger("skippy_zmq")
        for old in [h for h in logger.handlers if isinstance(h, _RecordsToLog)]:
            logger.removeHandler(old)  # one serve per process at a time: the latest one's log
        logger.addHandler(_RecordsToLog(self))
        logger.propagate = False  # not also through logging's last-resort handler


    def event(self, event: str, text: str, **fields: Any) -> None:
        """Report one event (`fields` go to JSON lines only)."""
        if self._json is not None:
            self._json.emit(event, message=text, **fields)
            return
        stream = self._stream or sys.stderr
        with self._lock:
            stream.write(f"[skippy-zmq] {text}\n")
            stream.flush()


class _RecordsToLog(logging.Handler):
    """Hands the package's log records (WARNING and above) to a `ServeLog`: one `log` event each."""

    def __init__(self, log: ServeLog) -> None:
        super().__init__(logging.WARNING)
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        self._log.event("log", text, level=record.levelname.lower(), logger=record.name)


def refusal_reporter(metrics: GatewayMetrics, log: ServeLog) -> RefusalHandler:
    """Counts every refused CURVE handshake; logs the ones `Admission` marks (once per address per
    minute, across keys) and its summaries."""

    def refused(domain: str, address: str, key: str, decision: ZapDecision) -> None:
        if not decision.summary:
            metrics.handshake_refused(domain)
        if decision.log:
            log.event("handshake_refused", f"refused a CURVE handshake on {domain} from {address}: {decision.text}",
                      domain=domain, peer=address, key=key or None, suppressed=decision.suppressed,
                      keys=decision.keys)

    return refused


class PipelineStarter:
    """Brings the pipeline up on a background thread and takes it down again."""

    def __init__(self, options: ServeOptions, backend: GatewayState, log: ServeLog,
                 on_refused: RefusalHandler | None = None) -> None:
        self.options = options
        self.backend = backend
        self.log = log
        self.on_refused = on_refused
        self.engine: Engine | None = None
        self.pipeline: LocalPipeline | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.finished = threading.Event()
        self._cancelled = threading.Event()
        self._released = threading.Event()
        self._directory: str | None = None
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
        from skippy_zmq.launch.processes import LocalPipeline
        from skippy_zmq.runtime.catalog import resolve_model
        from skippy_zmq.runtime.model import ModelHParams
        from skippy_zmq.runtime.pooling import Pooling
        from skippy_zmq.runtime.tokenizer import Tokenizer

        options = self.options
        started = time.monotonic()
        model = self._model_name()
        self._status(f"reading the model {model}")
        model_path = resolve_model(model, progress=self._status)
        topology_path = Path(options.topology_path) if options.topology_path else self._write_topology(model_path)
        topology = TopologyConfig.from_toml(topology_path)
        if options.topology_path is None and not self._cancelled.is_set():
            # The stages load while this process reads the tokenizer and builds the engine.
            self._status(f"loading {topology.n_stages} stages")
            self.pipeline = LocalPipeline(topology_path, log_sink=sys.stderr if options.verbose else None,
                                          log_json=options.log_json, check_tensors=options.check_tensors,
                                          progress=self._status)
            self.pipeline.spawn()
        try:
            tokenizer = Tokenizer.from_gguf(model_path)
            n_embd = ModelHParams.from_gguf(model_path).n_embd  # the `dimensions` /v1/embeddings answers with
            render_chat, chat_template = _chat_renderer(model_path, tokenizer, self.log)
            engine = Engine(topology, tokenizer, max_queue=options.max_queue,
                            request_timeout_s=options.request_timeout_s, micro_batches=options.micro_batches,
                            prefill_chunk=options.prefill_chunk, recovery_timeout_s=options.recovery_timeout_s,
                            on_handshake_refused=self.on_refused)
            self.backend.ctx_size = engine.ctx_size
            self.engine = engine
            engine.start()
            if self.pipeline is not None:
                self.pipeline.wait_ready(max(options.ready_timeout_s - (time.monotonic() - started), 1.0))
        except BaseException:
            if self.pipeline is not None:
                self.pipeline.stop()
            raise
        self.backend.attach(AttachedEngine(engine, tokenizer, render_chat, pooling=Pooling.named(options.pooling),
                                           n_embd=n_embd, chat_template=chat_template, model_path=str(model_path)))
        self._wait_heartbeats(engine, started + options.ready_timeout_s)

    def _model_name(self) -> str:
        if self.options.topology_path is not None:
            return TopologyConfig.from_toml(self.options.topology_path).model
        return self.options.model or DEFAULT_MODEL

    def _write_topology(self, model_path: Path) -> Path:
        from skippy_zmq.launch.topology import blas_threads_per_stage, write_local_topology
        from skippy_zmq.runtime.model import ModelHParams

        options = self.options
        self._directory = tempfile.mkdtemp(prefix="skippy-zmq-serve-")
        threads = options.threads
        if threads is None:  # K micro-batches keep up to K stages busy at once: they share the cores
            threads = blas_threads_per_stage(options.stages, busy_stages=options.micro_batches)
        return write_local_topology(
            str(model_path), ModelHParams.from_gguf(model_path).n_layer, options.stages, codec=options.codec,
            policy=options.codec_policy, directory=Path(self._directory), lane_count=options.lanes,
            ctx_size=options.ctx_size, threads=threads, max_stage_memory=options.max_stage_memory,
            cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v,
        )

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
        dead = pipeline.dead() if pipeline is not None and self.ready.is_set() else []
        return dead[0].describe_exit() if dead else None

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


def _chat_renderer(model_path: Path, tokenizer: Tokenizer, log: ServeLog) -> tuple[ChatRenderer | None, str | None]:
    """The model's chat template (or its family's turn format), None when it has neither; and the
    GGUF's template text (None for a built-in turn format), which /props reports."""
    from skippy_zmq.errors import ChatTemplateError
    from skippy_zmq.gateway.chat import ChatTemplate

    try:
        template = ChatTemplate.from_gguf(model_path, tokenizer)
    except ChatTemplateError as exc:
        log.event("chat_disabled", f"/v1/chat/completions answers 400: {exc}", error=str(exc))
        return None, None
    origin = "the family's turn format" if template.is_fallback else "the model's chat template"
    log.event("chat_template", f"chat prompts use {origin}", fallback=template.is_fallback)
    return template.render_ids, None if template.is_fallback else template.source


class GatewayServer:
    """The `serve` process: listener, startup thread, optional ZeroMQ API, signals, drain."""

    def __init__(self, options: ServeOptions, log: ServeLog) -> None:
        self.options = options
        self.log = log
        self.metrics = GatewayMetrics()
        model = options.model or DEFAULT_MODEL
        if options.topology_path is not None:
            model = TopologyConfig.from_toml(options.topology_path).model
        self.backend = GatewayState(model, ctx_size=None if options.topology_path else options.ctx_size,
                                    served_names=options.served_model_name)
        self.api_key = load_api_key(options)
        self.tls = tls_context(options)
        self.zmq_api: ZmqRequestApi | None = None
        self._zmq_task: asyncio.Future[None] | None = None
        self.url = ""
        self._stop: asyncio.Event | None = None
        self._exit_code = 0
        self._starter: PipelineStarter | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self) -> int:
        """Serve until a signal (exit status 0) or a failure (1)."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = make_app(self.backend, self.metrics, api_key=self.api_key,
                       max_client_requests=self.options.max_client_requests,
                       cors=CorsPolicy.parse(self.options.cors_origins))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                               **server_options())
        await runner.setup()
        try:
            await self._listen(runner)
            self._start_zmq()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(f"cannot listen on {self.options.host}:{self.options.port}: {exc.strerror}") from None
        except BaseException:
            await runner.cleanup()
            raise
        starter = PipelineStarter(self.options, self.backend, self.log, refusal_reporter(self.metrics, self.log))
        self._starter = starter
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal)
        starter.start()
        self._spawn(self._watch(starter))
        await self._stop.wait()
        await self._shutdown(runner, starter)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        return self._exit_code

    async def _listen(self, runner: web.AppRunner) -> None:
        site = web.TCPSite(runner, self.options.host, self.options.port, ssl_context=self.tls)
        await site.start()
        server: Any = site._server  # the bound port, when --port 0 asked the OS for one
        port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else self.options.port
        self.url = f"{'https' if self.tls is not None else 'http'}://{self.options.host}:{port}"
        guard = "; the API key is required" if self.api_key is not None else ""
        self.log.event("listening", f"listening on {self.url} (OpenAI API under /v1{guard}; /health is 503 until "
                      f"the pipeline is ready)", url=self.url, api_key=self.api_key is not None,
                      tls=self.tls is not None)
        for warning in exposure_warnings(self.options, api_key=self.api_key is not None):
            self.log.event("warning", f"warning: {warning}", warning=warning)

    def on_signal(self) -> None:
        """SIGTERM/SIGINT: the first begins the drain; a later one fails what is still in flight
        at once, so the shutdown goes on without waiting out --drain-timeout."""
        if self._stop is None or not self._stop.is_set():
            self.request_stop()
            return
        engine = self._starter.engine if self._starter is not None else None
        if engine is None:
            return  # no engine yet: the shutdown under way stops the startup
        self.log.event("drain_cut", "second signal: failing the requests still in flight now")
        engine.cut_drain()

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin the shutdown (from a signal handler or the watcher); a later call changes nothing."""
        if self._stop is None or self._stop.is_set():
            return
        self._exit_code = exit_code
        self.backend.begin_drain()
        self._stop.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_zmq(self) -> None:
        """Bind the ZeroMQ request API now (a bad --zmq-bind fails at once, before any stage starts)."""
        if self.options.zmq_bind is None:
            return
        from skippy_zmq.gateway.zmq_api import ZmqRequestApi

        curve = None
        if self.options.topology_path is not None:
            topology = TopologyConfig.from_toml(self.options.topology_path)
            if topology.security.curve:
                curve = CurveSetup.for_driver(topology, request_api=True)
                if not curve.admitted[REQUESTS_DOMAIN]:
                    self.log.event("warning", "CURVE is on and clients_dir admits no key: no client can use the "
                                   "ZeroMQ request API (skippy-zmq keygen --topology FILE --client NAME)")
        self.zmq_api = ZmqRequestApi(self.backend, self.options.zmq_bind, metrics=self.metrics,
                                     max_requests_per_client=self.options.max_client_requests,
                                     curve=curve, on_handshake_refused=refusal_reporter(self.metrics, self.log))
        endpoint = self.zmq_api.endpoint
        self.log.event("zmq_listening", f"ZeroMQ request API on {endpoint}", endpoint=endpoint)
        self._zmq_task = asyncio.ensure_future(self.zmq_api.run())

    async def _watch(self, starter: PipelineStarter) -> None:
        """End the server when startup fails or a local stage dies; announce readiness."""
        announced = False
        while self._stop is not None and not self._stop.is_set():
            if starter.error is not None:
                self.log.event("fatal", f"startup failed: {starter.error}", error=str(starter.error))
                self.request_stop(1)
                return
            if starter.ready.is_set() and not announced:
                announced = True
                self.log.event("ready", f"ready: serving {self.backend.model_id} on {self.url}",
                              model=self.backend.model_id, url=self.url)
            dead = starter.dead_stage()
            if dead is not None:
                self.log.event("fatal", f"stage died: {dead}", error=dead)
                self.request_stop(1)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _shutdown(self, runner: web.AppRunner, starter: PipelineStarter) -> None:
        options = self.options
        self.log.event("draining", f"draining: finishing in-flight requests (up to {options.drain_timeout_s:g} s)")
        starter.cancel()
        if starter.engine is not None:
            await asyncio.to_thread(starter.engine.drain, options.drain_timeout_s)
        if self.zmq_api is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.zmq_api.close(), SHUTDOWN_TIMEOUT_S)
            if self._zmq_task is not None:
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(self._zmq_task, SHUTDOWN_TIMEOUT_S)
        await runner.cleanup()
        await asyncio.to_thread(starter.stop)
        for task in list(self._tasks):
            task.cancel()
        self.log.event("stopped", "stopped")


def serve(options: ServeOptions, log: ServeLog) -> int:
    """Run the gateway until SIGTERM/SIGINT; the exit status."""
    log.capture_warnings()
    server = GatewayServer(options, log)
    return asyncio.run(server.run())
