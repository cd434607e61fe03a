"""What `skippy-zmq serve` was asked for, its access settings and its log: everything the command
needs before the gateway imports its HTTP stack (aiohttp), so a local pipeline's stages can start
first (gateway/starter.py `EarlyStages`).

Access: `--api-key` (or `--api-key-file`) guards every HTTP route but /health and /metrics;
`--ssl-certfile`/`--ssl-keyfile` serve HTTPS (TLS 1.2 or newer). Both are read and checked before
any stage starts or the port is bound: a missing or unreadable file is a ConfigError (exit 1)
naming it.
"""

from __future__ import annotations

import logging
import math
import re
import ssl
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import attrs

from skippy_zmq import defaults
from skippy_zmq.config import cache_type_validator
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.cors import CorsPolicy
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.link import LinkShape
from skippy_zmq.telemetry import EventLog


def _check_pooling(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in POOLING_NAMES:
        raise ConfigError(f"--pooling {value!r} is not a pooling; expected one of {', '.join(POOLING_NAMES)}")


POOLING_NAMES = ("mean", "last", "none")
"""`serve --pooling` values (tokens.pooling.Pooling's names)."""


def _route(value: str | None, name: str) -> str | None:
    if value is None or value == "":
        return None
    path = value if value.startswith("/") else "/" + value
    if not re.fullmatch(r"/[A-Za-z0-9._~/-]*", path):
        raise ConfigError(f"{name} {value!r} is not a URL path")
    return path


@attrs.frozen
class VertexSettings:
    """What Google Cloud Vertex AI's environment asks of serve (its `AIP_*` custom-container variables;
    docs/PROTOCOL.md §9.8)."""

    enabled: bool = False
    predict_route: str = "/predict"
    health_route: str | None = None  # another path answering as /health
    port: int | None = None  # AIP_HTTP_PORT: replaces --port

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> VertexSettings:
        """The settings of `AIP_MODE=PREDICTION` and its `AIP_*` variables (off without it); ConfigError naming
        a variable whose value is unusable."""
        if env.get("AIP_MODE") != "PREDICTION":
            return cls()
        port_text = env.get("AIP_HTTP_PORT", "8080")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"AIP_HTTP_PORT {port_text!r} is not a TCP port (1 to 65535)")
        predict = _route(env.get("AIP_PREDICT_ROUTE"), "AIP_PREDICT_ROUTE") or "/predict"
        return cls(True, predict, _route(env.get("AIP_HEALTH_ROUTE"), "AIP_HEALTH_ROUTE"), int(port_text))


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
    max_queue: int = defaults.MAX_QUEUE
    request_timeout_s: float = defaults.REQUEST_TIMEOUT_S
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    micro_batches: int = 1
    drain_timeout_s: float = 30.0
    prefill_chunk: int = defaults.PREFILL_CHUNK
    cache_prompt: bool = True  # finished sessions stay on the stages for prompts that continue them
    # n-gram drafts a decode step may carry (0: none; None: as the stages' numerics allow; PROTOCOL §6, Speculative
    # decoding)
    draft_max: int | None = None
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
    strict_model_name: bool = False  # a request naming another model is a 404, not served by this one
    tags: tuple[str, ...] = ()  # labels /v1/models lists with the model (llama-server's --tags)
    reranking: bool = False  # POST /rerank (also on when the file declares rank pooling)
    sleep_idle_s: float | None = None  # stop the local stages after this long unused (None: never)
    sampling: SamplingDefaults = NO_DEFAULTS  # --seed, --temp, ...: what requests leaving those fields out get
    chat_template: str | None = None  # Jinja text used instead of the GGUF's chat template
    chat_template_file: str | None = None  # a file of Jinja text used instead of the GGUF's chat template
    jinja: bool = True  # llama-server's --jinja; --no-jinja renders with llama.cpp's C++ formats (legacy_chat)
    cors_origins: str | None = None  # web origins allowed to call the API (comma-separated, * any)
    vertex: VertexSettings = VertexSettings()  # AIP_MODE=PREDICTION: Vertex AI's prediction route and port
    emulate_link: LinkShape | None = None  # every link of the local pipeline, emulated (docs/ARCHITECTURE.md)
    web: bool = True  # the web page at GET / (docs/PROTOCOL.md §9.9); --no-web leaves it out
    # The engine's and the scheduler's share of these, built once (a bad value fails before any stage starts).
    scheduler: SchedulerSettings = attrs.field(init=False)

    @scheduler.default
    def _scheduler(self) -> SchedulerSettings:
        return SchedulerSettings.from_serve(self)

    def __attrs_post_init__(self) -> None:
        """Options that only make sense together, or apart (ConfigError otherwise)."""
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("--api-key and --api-key-file both give the API key: use one")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            given, missing = (("--ssl-certfile", "--ssl-keyfile") if self.ssl_keyfile is None
                              else ("--ssl-keyfile", "--ssl-certfile"))
            raise ConfigError(f"{given} needs {missing} too: HTTPS takes a certificate and its private key")
        CorsPolicy.parse(self.cors_origins)  # ConfigError naming an entry that is not an origin
        if self.sleep_idle_s is not None and not (math.isfinite(self.sleep_idle_s) and self.sleep_idle_s > 0):
            raise ConfigError(f"--sleep-idle-seconds {self.sleep_idle_s:g} must be a positive number of seconds")
        if self.sleep_idle_s is not None and self.topology_path is not None:
            raise ConfigError("--sleep-idle-seconds stops and starts the stages serve starts itself; with --topology "
                              "the stages are started elsewhere: stop those yourself, or serve --model instead")
        if self.chat_template is not None and self.chat_template_file is not None:
            raise ConfigError("--chat-template and --chat-template-file both give the chat template: use one")
        if self.chat_template is not None and not is_jinja(self.chat_template) and self.jinja \
                and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.chat_template):
            raise ConfigError(f"--chat-template {self.chat_template[:80]!r} is neither Jinja text nor the name of one "
                              "of llama.cpp's built-in chat formats (chatml, llama3, ...)")
        self.hosts  # noqa: B018 - ConfigError naming an empty address
        if self.check_tensors and self.topology_path is not None:
            raise ConfigError("check_tensors applies to the local stages serve starts; the stages of "
                              f"{self.topology_path} run already: start their workers with --check-tensors")


    @property
    def hosts(self) -> tuple[str, ...]:
        """The addresses `--host` names (comma-separated, llama-server's form: one listener each)."""
        hosts = tuple(part.strip() for part in self.host.split(","))
        if len(hosts) > 1 and not all(hosts):
            raise ConfigError(f"--host {self.host!r} has an empty address; separate addresses with commas, "
                              "e.g. 127.0.0.1,::1")
        if len(set(hosts)) != len(hosts):
            raise ConfigError(f"--host {self.host!r} names an address twice")
        return hosts


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


def is_jinja(text: str) -> bool:
    """Whether a chat template's text is Jinja (else it names one of llama.cpp's built-in formats)."""
    return any(mark in text for mark in ("{{", "{%"))


def uses_legacy_chat(options: ServeOptions, given: tuple[str, str] | None) -> bool:
    """Whether chats render with llama.cpp's C++ formats: `--no-jinja`, or a built-in format's name."""
    return not options.jinja or (given is not None and given[1] == "--chat-template" and not is_jinja(given[0]))


def load_chat_template(options: ServeOptions) -> tuple[str, str] | None:
    """The chat template given instead of the GGUF's, and where it came from (for errors), or None;
    ConfigError naming a file that cannot be read as UTF-8 text."""
    if options.chat_template is not None:
        return options.chat_template, "--chat-template"
    if options.chat_template_file is None:
        return None
    origin = f"--chat-template-file {options.chat_template_file}"
    try:
        return Path(options.chat_template_file).read_text(encoding="utf-8"), origin
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{origin}: cannot read the chat template: {_reason(exc)}") from None


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
