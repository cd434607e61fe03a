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

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import zmq
import zmq.auth

from skippy_zmq.errors import SecurityError

if TYPE_CHECKING:  # the client imports this module: it must not pull in numpy (worker --threads)
    from skippy_zmq.config import SecurityConfig, StageConfig, TopologyConfig

DRIVER = "driver"
"""Key name of the driver (`generate --topology` or `serve`): stage 0's only sender."""
PUBLIC_DIR = "public"
SECRET_DIR = "secret"
CLIENT_PAIRS_DIR = "clients"


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


