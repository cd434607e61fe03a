"""CURVE on sockets: the options of a server or client socket, and the ZAP handler thread that
answers libzmq with `Admission`'s decisions (docs/PROTOCOL.md §10).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import zmq
import zmq.auth
from zmq.utils import z85

from skippy_zmq.errors import SecurityError
from skippy_zmq.security.admission import Admission, ZapDecision
from skippy_zmq.security.keys import DRIVER, KeyPair, KeyStore, sender_of

if TYPE_CHECKING:  # the client imports this module: it must not pull in numpy (worker --threads)
    from skippy_zmq.config import StageConfig, TopologyConfig


STAGE_DOMAIN = "skippy.stage"
RETURN_DOMAIN = "skippy.return"
REQUESTS_DOMAIN = "skippy.requests"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends its authentication requests (RFC 27): one handler per context."""


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


RefusalHandler = Callable[[str, str, str, ZapDecision], None]
"""Called with (domain, peer address, peer key in Z85 or "", decision) for every refusal, and for
each summary of an address's unlogged refusals (`decision.summary`: count nothing, log it)."""


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
                self._summarize()
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

    def _summarize(self) -> None:
        """Hand over the summaries of refusals not logged, once their address's interval has passed."""
        if self._on_refused is None:
            return
        for summary in self.admission.summaries():
            with contextlib.suppress(Exception):  # a logging failure must not stop authentication
                self._on_refused(summary.domain, summary.address, "", summary.decision())

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


class CurveGuard:
    """One process's CURVE on one ZeroMQ context: the ZAP handler, started before any bind, and the
    options of its server and client sockets. Without a `CurveSetup` every call does nothing, so a
    shell sets up its sockets the same way with CURVE on or off."""

    def __init__(
        self,
        context: zmq.Context[Any],
        curve: CurveSetup | None,
        on_refused: RefusalHandler | None = None,
        *,
        admission: Admission | None = None,
    ) -> None:
        """`admission` replaces the setup's own decisions (the request API admits one domain only)."""
        self.curve = curve
        self._zap: ZapHandler | None = None
        if curve is not None:  # libzmq asks the handler about every handshake, so it must be up first
            self._zap = ZapHandler(context, admission or curve.admission(), on_refused)

    @property
    def enabled(self) -> bool:
        """True when the sockets are CURVE servers and clients."""
        return self.curve is not None

    def serve(self, socket: zmq.Socket[Any], domain: str) -> None:
        """Make `socket` a CURVE server of `domain` (before bind)."""
        if self.curve is not None:
            self.curve.serve(socket, domain)

    def connect_to(self, socket: zmq.Socket[Any], peer: str) -> None:
        """Make `socket` a CURVE client of `peer` (before connect)."""
        if self.curve is not None:
            self.curve.connect_to(socket, peer)

    def close(self) -> None:
        """Stop the ZAP handler; idempotent."""
        if self._zap is not None:
            self._zap.close()
            self._zap = None
