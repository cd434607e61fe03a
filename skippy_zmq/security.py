"""CurveZMQ keys and admission: where key files live and which peer may send to which socket.

Layout under a topology's `keys_dir` (docs/PROTOCOL.md §10):

    keys_dir/public/<name>.key         public certificate (pyzmq `zmq.auth` format), mode 0644
    keys_dir/secret/<name>.key_secret  the pair, mode 0600 in a 0700 directory
    keys_dir/clients/<name>.key(_secret)  request-API client pairs made by `keygen --client`
    clients_dir/<name>.key             public keys admitted to serve's request API

`<name>` is `driver` or a stage id. A process reads its own secret and its peers' public files
only, so a container can be given `public/` and its one secret file.

Admission is decided here without sockets (`Admission`); `ZapHandler` is the thread that
answers libzmq's ZAP requests (RFC 27) with those decisions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import zmq
import zmq.auth
from zmq.utils import z85

from skippy_zmq.errors import SecurityError

if TYPE_CHECKING:  # the client imports this module: it must not pull in numpy (worker --threads)
    from skippy_zmq.config import SecurityConfig, StageConfig, TopologyConfig

DRIVER = "driver"
"""Key name of the driver (`generate --topology` or `serve`): stage 0's only sender."""
PUBLIC_DIR = "public"
SECRET_DIR = "secret"
CLIENT_PAIRS_DIR = "clients"
STAGE_DOMAIN = "skippy.stage"
RETURN_DOMAIN = "skippy.return"
REQUESTS_DOMAIN = "skippy.requests"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends its authentication requests (RFC 27): one handler per context."""
REFUSAL_LOG_INTERVAL_S = 60.0
"""A refused peer (address and key) is logged at most once per interval, with a count."""


@attrs.frozen
class KeyPair:
    """A CURVE key pair in Z85 text (40 bytes each); `secret` is None for a public-only file."""

    public: bytes
    secret: bytes | None = None

    @classmethod
    def load(cls, path: Path, *, secret: bool) -> KeyPair:
        """Read a certificate file; with `secret`, require the secret key and owner-only mode."""
        try:
            mode = path.stat().st_mode
            public, secret_key = zmq.auth.load_certificate(path)
        except FileNotFoundError:
            raise SecurityError(
                f"{path}: key file does not exist; create it with `skippy-zmq keygen --topology FILE`"
            ) from None
        except (OSError, ValueError) as exc:
            raise SecurityError(f"{path}: cannot read a CURVE certificate from it: {exc}") from None
        if secret:
            if secret_key is None:
                raise SecurityError(f"{path}: has no secret-key line; expected a .key_secret file")
            if mode & 0o077:
                raise SecurityError(
                    f"{path}: secret key file has mode {stat.S_IMODE(mode):04o}; "
                    "it must be readable by its owner only (chmod 600)"
                )
        for what, key in (("public", public), ("secret", secret_key)):
            if key is not None and len(key) != 40:
                raise SecurityError(f"{path}: {what} key is {len(key)} characters; expected 40 (Z85)")
        return cls(public=public, secret=secret_key if secret else None)


@attrs.frozen
class KeyStore:
    """The key files of one topology (`keys_dir`), read and written by name."""

    keys_dir: Path
    clients_dir: Path | None = None

    @classmethod
    def of(cls, security: SecurityConfig, source: str = "<topology>") -> KeyStore:
        """The store a topology's [security] table names; SecurityError when curve is off."""
        if not security.curve or security.keys_dir is None:
            raise SecurityError(f"{source}: [security] curve is not on; there are no keys to use")
        return cls(keys_dir=security.keys_dir, clients_dir=security.clients_dir)

    def public_path(self, name: str) -> Path:
        """The public certificate of `name`."""
        _check_name(name)
        return self.keys_dir / PUBLIC_DIR / f"{name}.key"

    def secret_path(self, name: str) -> Path:
        """The secret certificate (the pair) of `name`."""
        _check_name(name)
        return self.keys_dir / SECRET_DIR / f"{name}.key_secret"

    def public(self, name: str) -> bytes:
        """The Z85 public key of `name`."""
        return KeyPair.load(self.public_path(name), secret=False).public

    def pair(self, name: str) -> KeyPair:
        """The key pair of `name` (its secret file must be owner-only)."""
        return KeyPair.load(self.secret_path(name), secret=True)

    def clients(self) -> frozenset[bytes]:
        """Public keys admitted to the request API: every `*.key` in clients_dir (none if unset)."""
        if self.clients_dir is None or not self.clients_dir.is_dir():
            return frozenset()
        return frozenset(
            KeyPair.load(path, secret=False).public for path in sorted(self.clients_dir.glob("*.key"))
        )

    def ensure(self, name: str) -> bool:
        """Create `name`'s pair unless both its files exist; True when one was created."""
        public, secret = self.public_path(name), self.secret_path(name)
        if public.exists() and secret.exists():
            return False
        if public.exists() != secret.exists():
            present = public if public.exists() else secret
            raise SecurityError(
                f"{present}: exists without its other half; remove it to make a new pair for {name!r}"
            )
        _make_pair(name, public, secret)
        return True

    def ensure_client(self, name: str) -> tuple[Path, Path, Path]:
        """Create a request-API client pair and admit its public key; returns (public, secret, admitted)."""
        if self.clients_dir is None:
            raise SecurityError("keygen --client needs clients_dir in the topology's [security] table")
        _check_name(name)
        pairs = self.keys_dir / CLIENT_PAIRS_DIR
        public, secret = pairs / f"{name}.key", pairs / f"{name}.key_secret"
        if not (public.exists() and secret.exists()):
            if public.exists() or secret.exists():
                raise SecurityError(f"{pairs}: half of client pair {name!r} exists; remove it first")
            _make_pair(name, public, secret)
        admitted = self.clients_dir / f"{name}.key"
        try:
            self.clients_dir.mkdir(parents=True, exist_ok=True)
            if admitted.resolve() != public.resolve():
                shutil.copyfile(public, admitted)
            admitted.chmod(0o644)
        except OSError as exc:
            raise SecurityError(f"{admitted}: cannot admit client {name!r}: {exc.strerror or exc}") from None
        return public, secret, admitted


def _check_name(name: str) -> None:
    # The one rule, shared with the topology's check of stage ids; imported here, not at the top,
    # because config loads numpy and the Client imports this module.
    from skippy_zmq.config import is_plain_name

    if not is_plain_name(name):
        raise SecurityError(f"key name {name!r} must be a plain file name (no '/', not starting with '.')")


def _make_pair(name: str, public: Path, secret: Path) -> None:
    """Write a new pair: made in a private temporary directory, then moved in place."""
    for directory, mode in ((public.parent, 0o755), (secret.parent, 0o700)):
        directory.mkdir(parents=True, exist_ok=True, mode=mode)
    secret.parent.chmod(0o700)
    with tempfile.TemporaryDirectory(dir=secret.parent) as scratch:  # mkdtemp: mode 0700
        old_umask = os.umask(0o077)
        try:
            made_public, made_secret = zmq.auth.create_certificates(scratch, name)
        finally:
            os.umask(old_umask)
        Path(made_secret).chmod(0o600)
        os.replace(made_secret, secret)
        Path(made_public).chmod(0o644)
        shutil.move(made_public, public)


def is_loopback(endpoint: str) -> bool:
    """True for ipc/inproc endpoints and TCP on a loopback host (reachable from this host only)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def key_names(topology: TopologyConfig) -> list[str]:
    """Every key pair a topology needs: the driver's and one per stage."""
    return [DRIVER, *(stage.stage_id for stage in topology.stages)]


def keygen(topology: TopologyConfig) -> list[str]:
    """Create the missing pairs of a topology; returns the names created (existing keys are kept)."""
    store = KeyStore.of(topology.security, topology.source)
    for name in key_names(topology):
        _check_name(name)
    return [name for name in key_names(topology) if store.ensure(name)]


def sender_of(topology: TopologyConfig, stage: StageConfig) -> str:
    """The one key a stage's PULL admits: the driver for stage 0, else the previous stage."""
    upstream = topology.upstream(stage)
    return DRIVER if upstream is None else upstream.stage_id


@attrs.frozen
class CurveSetup:
    """What one process needs for CURVE: its own pair, its peers' public keys, and who may
    reach each of its server domains."""

    own: KeyPair
    peers: Mapping[str, bytes]
    admitted: Mapping[str, frozenset[bytes]]

    def serve(self, socket: zmq.Socket[Any], domain: str) -> None:
        """Make `socket` a CURVE server whose peers are checked against `domain` (before bind)."""
        if domain not in self.admitted:
            raise SecurityError(f"no admitted keys are configured for ZAP domain {domain!r}")
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, _secret(self.own))
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.own.public)
        socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        # Fail closed: without an answering ZAP handler libzmq would admit every CURVE key.
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def connect_to(self, socket: zmq.Socket[Any], peer: str) -> None:
        """Make `socket` a CURVE client of the peer named `peer` (before connect)."""
        if peer not in self.peers:
            raise SecurityError(f"no public key is known for peer {peer!r}; known: {', '.join(sorted(self.peers))}")
        curve_client(socket, self.own, self.peers[peer])

    def admission(self, **kwargs: Any) -> Admission:
        """The ZAP decisions for this process's server sockets."""
        return Admission(self.admitted, **kwargs)

    @classmethod
    def for_stage(cls, topology: TopologyConfig, stage: StageConfig) -> CurveSetup:
        """A stage: its pair; its PULL admits only its upstream sender; it connects to its
        downstream stage and to the driver."""
        store = KeyStore.of(topology.security, topology.source)
        peers = {DRIVER: store.public(DRIVER)}
        downstream = topology.downstream(stage)
        if downstream is not None:
            peers[downstream.stage_id] = store.public(downstream.stage_id)
        sender = sender_of(topology, stage)
        return cls(
            own=store.pair(stage.stage_id),
            peers=peers,
            admitted={STAGE_DOMAIN: frozenset({peers.get(sender) or store.public(sender)})},
        )

    @classmethod
    def for_driver(cls, topology: TopologyConfig, *, request_api: bool = False) -> CurveSetup:
        """The driver: its pair; the return socket admits every stage, the request API the
        keys in clients_dir; it connects to stage 0."""
        store = KeyStore.of(topology.security, topology.source)
        stage_keys = {stage.stage_id: store.public(stage.stage_id) for stage in topology.stages}
        admitted = {RETURN_DOMAIN: frozenset(stage_keys.values())}
        if request_api:
            admitted[REQUESTS_DOMAIN] = store.clients()
        first = topology.stages[0].stage_id
        return cls(own=store.pair(DRIVER), peers={first: stage_keys[first]}, admitted=admitted)


def curve_client(socket: zmq.Socket[Any], own: KeyPair, server_public: bytes) -> None:
    """Make `socket` a CURVE client with pair `own` of the server whose public key is given."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, own.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, _secret(own))


def _secret(pair: KeyPair) -> bytes:
    if pair.secret is None:
        raise SecurityError(
            f"key pair with public key {pair.public.decode()} has no secret key; a CURVE peer needs "
            "its own .key_secret file, not a public .key"
        )
    return pair.secret


@attrs.frozen
class ZapDecision:
    """One answer to a ZAP request: status 200 admits, 400 refuses; `log` says whether to log it."""

    admitted: bool
    text: str
    user_id: str = ""
    log: bool = False
    suppressed: int = 0

    @property
    def status(self) -> bytes:
        """The RFC 27 status code."""
        return b"200" if self.admitted else b"400"


class Admission:
    """Decides ZAP requests: CURVE only, and only the keys admitted for the socket's domain.

    Socket-free and clock-injectable. Refusals are counted per domain; each refused peer
    (address and key) is marked for logging at most once per `log_interval_s`, the next log
    carrying how many refusals were not logged in between.
    """

    def __init__(
        self,
        admitted: Mapping[str, frozenset[bytes]],
        *,
        log_interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admitted = {domain: frozenset(z85.decode(k) for k in keys) for domain, keys in admitted.items()}
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._last_logged: dict[tuple[str, bytes], tuple[float, int]] = {}
        self.refused: dict[str, int] = {}
        self.admitted_count: dict[str, int] = {}

    def decide(self, domain: str, address: str, mechanism: bytes, credentials: Iterable[bytes]) -> ZapDecision:
        """Admit a CURVE peer whose public key is admitted in `domain`; refuse anything else."""
        creds = list(credentials)
        key = creds[0] if mechanism == b"CURVE" and len(creds) == 1 and len(creds[0]) == 32 else b""
        allowed = self._admitted.get(domain)
        if allowed is not None and key and key in allowed:
            self.admitted_count[domain] = self.admitted_count.get(domain, 0) + 1
            return ZapDecision(admitted=True, text="OK", user_id=z85.encode(key).decode())
        if allowed is None:
            why = f"unknown ZAP domain {domain!r}"
        elif mechanism != b"CURVE":
            why = f"mechanism {mechanism.decode(errors='replace')!r} is not CURVE"
        else:
            why = "public key not admitted"
        self.refused[domain] = self.refused.get(domain, 0) + 1
        now = self._clock()
        peer = (address, key)
        last = self._last_logged.get(peer)
        if last is None or now - last[0] >= self._log_interval_s:
            suppressed = 0 if last is None else last[1]
            self._last_logged[peer] = (now, 0)
            if len(self._last_logged) > 4096:  # bounded memory under a flood of addresses
                self._last_logged = {peer: (now, 0)}
            return ZapDecision(admitted=False, text=why, log=True, suppressed=suppressed)
        self._last_logged[peer] = (last[0], last[1] + 1)
        return ZapDecision(admitted=False, text=why)


RefusalHandler = Callable[[str, str, str, ZapDecision], None]
"""Called with (domain, peer address, peer key in Z85 or "", decision) for every refusal."""


class ZapHandler:
    """Answers libzmq's ZAP requests on one context from a thread, with `Admission`'s decisions."""

    def __init__(
        self, context: zmq.Context[Any], admission: Admission, on_refused: RefusalHandler | None = None
    ) -> None:
        self.admission = admission
        self._on_refused = on_refused
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise SecurityError(f"cannot start the ZAP handler on this context: {exc}") from None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (within one poll interval) and close its socket."""
        self._stopping.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._socket.poll(100):
                    continue
                request = self._socket.recv_multipart()
                try:
                    answer = self._answer(request)
                except Exception:  # noqa: BLE001 - refuse this peer; the handler must keep answering
                    answer = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"internal error", b"", b""]
                self._socket.send_multipart(answer)
        except zmq.ContextTerminated:
            pass
        finally:
            self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 6 or request[0] != b"1.0":
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        _version, request_id, domain, address, _identity, mechanism, *credentials = request
        domain_text, address_text = domain.decode(errors="replace"), address.decode(errors="replace")
        decision = self.admission.decide(domain_text, address_text, mechanism, credentials)
        if not decision.admitted and self._on_refused is not None:
            key = credentials[0] if len(credentials) == 1 and len(credentials[0]) == 32 else b""
            with contextlib.suppress(Exception):  # a logging failure must not stop authentication
                self._on_refused(domain_text, address_text, z85.encode(key).decode() if key else "", decision)
        return [b"1.0", request_id, decision.status, decision.text.encode(), decision.user_id.encode(), b""]
