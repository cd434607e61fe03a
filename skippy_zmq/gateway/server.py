"""`skippy-zmq serve`: listen at once, bring the pipeline up behind the listener, drain on a signal.

Startup: the local stages are already loading (gateway/starter.py `EarlyStages`, started by the
command before this module is imported); the HTTP port is bound, so /health answers 503 naming
the step under way while `PipelineStarter` brings the rest up. A port or `--zmq-bind` that cannot
be bound stops those stages again. SIGTERM or SIGINT: /health and new requests answer 503
"draining", the engine lets in-flight requests finish for up to `--drain-timeout` and fails the
rest (at once on a second signal), every session is stopped, the local stages are stopped, and
the process exits 0. A local stage that dies ends the server with exit status 1.

Access: gateway/options.py reads and checks the API key and the TLS files.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from skippy_zmq.config import DEFAULT_MODEL, TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.cors import ANY_ORIGIN, CorsPolicy
from skippy_zmq.gateway.http import make_app, server_options
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.options import ServeLog, ServeOptions, load_api_key, tls_context
from skippy_zmq.gateway.sleep import PipelineSleep, SleepSchedule
from skippy_zmq.gateway.starter import EarlyStages, PipelineStarter
from skippy_zmq.gateway.state import GatewayState
from skippy_zmq.security.admission import ZapDecision
from skippy_zmq.security.curve import REQUESTS_DOMAIN, CurveSetup, RefusalHandler

if TYPE_CHECKING:
    from skippy_zmq.driver.watch import StageEvent
    from skippy_zmq.gateway.zmq_api import ZmqRequestApi

WATCH_INTERVAL_S = 0.5
SHUTDOWN_TIMEOUT_S = 5.0
"""How long closing the listener waits for handlers still running after the drain."""


def exposure_warnings(options: ServeOptions, *, api_key: bool) -> list[str]:
    """What the listener exposes: to every web page, the API without a key under `--cors-origins *`;
    beyond this machine, the API without a key or a key without TLS."""
    warnings = []
    if ANY_ORIGIN in CorsPolicy.parse(options.cors_origins).origins and not api_key:
        warnings.append("--cors-origins * without --api-key: any web page a browser opens can run generations "
                        "here, a page from the internet on a loopback listener included")
    return warnings + _network_warnings(options, api_key=api_key)


def _network_warnings(options: ServeOptions, *, api_key: bool) -> list[str]:
    exposed = [host for host in options.hosts if not _is_local(host)]
    if not exposed:
        return []
    where = f"--host {','.join(exposed)}"
    if not api_key:
        return [f"{where} without --api-key: anyone who can reach the port can run generations"]
    if options.ssl_certfile is None:
        return [f"{where} without --ssl-certfile: the API key and every prompt cross the network in clear text"]
    return []


def _is_local(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def http_url(host: str, port: int, *, tls: bool) -> str:
    """The URL of a listener (an IPv6 address in brackets)."""
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


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


def stage_reporter(log: ServeLog, quiet: Callable[[], bool] = lambda: False) -> Callable[[StageEvent], None]:
    """Writes each of the driver's stage events (driver/watch.py) as one log line, plain or JSON; none while
    `quiet()` (the stages were stopped on purpose: --sleep-idle-seconds)."""

    def report(event: StageEvent) -> None:
        if not quiet():
            log.event(event.event, event.message, **event.fields())

    return report


class GatewayServer:
    """The `serve` process: listener, startup thread, optional ZeroMQ API, signals, drain."""

    def __init__(self, options: ServeOptions, log: ServeLog, early: EarlyStages | None = None) -> None:
        """`early`: the local stages, already loading; the server owns them from here on."""
        self.options = options
        self.log = log
        self.early = early
        self.metrics = GatewayMetrics()
        model = options.model or DEFAULT_MODEL
        if options.topology_path is not None:
            model = TopologyConfig.from_toml(options.topology_path).model
        self.backend = GatewayState(model, ctx_size=None if options.topology_path else options.ctx_size,
                                    served_names=options.served_model_name,
                                    strict_model_name=options.strict_model_name, sampling=options.sampling,
                                    verbose=options.verbose, tags=options.tags)
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
                       cors=CorsPolicy.parse(self.options.cors_origins), vertex=self.options.vertex,
                       web_page=self.options.web)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                               **server_options())
        await runner.setup()
        try:
            await self._listen(runner)
            self._start_zmq()
        except OSError as exc:
            await self._abandon(runner)
            raise ConfigError(f"cannot listen on {self.options.host}:{self.options.port}: {exc.strerror}") from None
        except BaseException:
            await self._abandon(runner)
            raise
        starter = PipelineStarter(self.options, self.backend, self.log, refusal_reporter(self.metrics, self.log),
                                  early=self.early,
                                  on_stage_event=stage_reporter(self.log, lambda: self.backend.sleeping))
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

    async def _abandon(self, runner: web.AppRunner) -> None:
        """Close the listener and stop the early stages: the server will not run."""
        await runner.cleanup()
        if self.early is not None:
            await asyncio.to_thread(self.early.stop)

    async def _listen(self, runner: web.AppRunner) -> None:
        """One listener per `--host` address, all on one port (with --port 0, the one the first got)."""
        port = self.options.vertex.port or self.options.port  # Vertex AI's AIP_HTTP_PORT wins, as in llama-server
        urls = []
        for host in self.options.hosts:
            site = web.TCPSite(runner, host, port, ssl_context=self.tls)
            await site.start()
            server: Any = site._server  # the bound port, when --port 0 asked the OS for one
            port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
            urls.append(http_url(host, port, tls=self.tls is not None))
        self.url = urls[0]
        guard = "; the API key is required" if self.api_key is not None else ""
        page = f"; the web page at {urls[0]}/" if self.options.web else ""
        self.log.event("listening", f"listening on {', '.join(urls)} (OpenAI API under /v1{guard}; /health is 503 "
                      f"until the pipeline is ready{page})", url=self.url, urls=urls, api_key=self.api_key is not None,
                      tls=self.tls is not None, web=self.options.web)
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
        """Bind the ZeroMQ request API now (a bad --zmq-bind fails at once; `_abandon` stops early stages)."""
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
                self._start_sleep(starter)
            dead = starter.dead_stage()
            if dead is not None:
                self.log.event("fatal", f"stage died: {dead}", error=dead)
                self.request_stop(1)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _start_sleep(self, starter: PipelineStarter) -> None:
        """With --sleep-idle-seconds, the watch that stops the idle stages (PROTOCOL §9.6, Sleeping)."""
        idle, engine = self.options.sleep_idle_s, starter.engine
        if idle is None or engine is None:
            return
        sleep = PipelineSleep(SleepSchedule(idle, time.monotonic()), starter,
                              engine_busy=lambda: engine.running > 0 or engine.queue_depth > 0,
                              say=self.log.event)
        self.backend.pipeline_sleep = sleep
        self._spawn(sleep.watch())

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


def serve(options: ServeOptions, log: ServeLog, early: EarlyStages | None = None) -> int:
    """Run the gateway until SIGTERM/SIGINT (with `early`'s stages, which it then owns); the exit status."""
    log.capture_warnings()
    try:
        server = GatewayServer(options, log, early)
    except BaseException:
        if early is not None:
            early.stop()
        raise
    return asyncio.run(server.run())
