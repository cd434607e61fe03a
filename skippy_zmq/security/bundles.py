"""Per-host key bundles: what each machine of a topology spread over several hosts needs, and no
other secret (docs/DEPLOY.md, "Plain hosts (no Docker)").

`write_bundles` makes one folder per host, `DIR/HOST/`, holding the topology file, every public
key, and the secret files of only the processes that run there: its stages, and the driver on
the driver's host (with the request API's admitted client keys). Inside a bundle the files keep
their places relative to one another, so a bundle copied into a working directory loads with the
topology's own relative `keys_dir`: a topology at `config/t.toml` with `keys_dir = "../keys/x"`
gives `HOST/config/t.toml` and `HOST/keys/x/...`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from skippy_zmq.errors import SecurityError
from skippy_zmq.security.keys import DRIVER, PUBLIC_DIR, SECRET_DIR, KeyStore, key_names

if TYPE_CHECKING:  # the client imports security modules: it must not pull in numpy
    from skippy_zmq.config import TopologyConfig


@attrs.frozen
class Bundle:
    """One host's folder: where it is, the topology file in it, and whose secret keys it holds."""

    host: str
    directory: Path
    topology: Path  # the copy of the topology file, inside `directory`
    public_keys: tuple[str, ...]
    secret_keys: tuple[str, ...]
    admitted_clients: int = 0

    def describe(self) -> str:
        """`10.0.0.1: bundles/10.0.0.1 (cluster.toml; 4 public keys; secrets: driver, stage-0)`."""
        clients = f"; {self.admitted_clients} admitted client keys" if self.admitted_clients else ""
        return (f"{self.host}: {self.directory} ({self.topology.relative_to(self.directory)}; "
                f"{len(self.public_keys)} public keys; secrets: {', '.join(self.secret_keys)}{clients})")


def host_secrets(topology: TopologyConfig) -> dict[str, tuple[str, ...]]:
    """The key names whose secret each host holds, hosts in pipeline order (the driver's host last when
    it runs no stage); SecurityError naming a stage or driver whose host is not known."""
    placed: dict[str, list[str]] = {}
    for stage in topology.stages:
        if stage.runs_on is None:
            raise SecurityError(f'{topology.source}: stage "{stage.stage_id}" has no host (pull_connect '
                                f"{stage.pull_connect!r}); a bundle per host needs tcp:// endpoints")
        placed.setdefault(stage.runs_on, []).append(stage.stage_id)
    driver = topology.driver.runs_on
    if driver is None:
        raise SecurityError(f"{topology.source}: [driver] has no host (return_connect "
                            f"{topology.driver.return_connect!r}); a bundle per host needs tcp:// endpoints")
    placed.setdefault(driver, []).insert(0, DRIVER)
    return {host: tuple(names) for host, names in placed.items()}


def bundle_root(topology_path: Path, topology: TopologyConfig) -> Path:
    """The folder a bundle reproduces: the nearest one holding the topology file, keys_dir and clients_dir."""
    security = topology.security
    folders = [topology_path.resolve().parent, *(Path(d) for d in (security.keys_dir, security.clients_dir) if d)]
    root = Path(os.path.commonpath([str(folder) for folder in folders]))
    if root == Path(root.anchor):
        raise SecurityError(f"{topology.source}: keys_dir {security.keys_dir} and the topology's folder "
                            f"{folders[0]} share no folder but {root}; give a keys_dir beside the file "
                            '(keys_dir = "keys") so each host can hold the same layout')
    return root


def write_bundles(topology_path: Path, topology: TopologyConfig, out_dir: Path) -> list[Bundle]:
    """Write `out_dir/HOST/` for every host of `topology` (its keys must exist: `keygen` first); a host
    folder that already exists is refused before anything is written, so no stale secret stays."""
    from skippy_zmq.config import is_plain_name  # here: config loads numpy, and clients import this package

    store = KeyStore.of(topology.security, topology.source)
    secrets = host_secrets(topology)
    root = bundle_root(topology_path, topology)
    for host in secrets:
        if not is_plain_name(host):
            raise SecurityError(f"{topology.source}: host {host!r} cannot name a bundle folder")
        if (out_dir / host).exists():
            raise SecurityError(f"{out_dir / host}: already exists; remove it (or choose another --bundles "
                                "folder) so the bundle holds exactly this host's secrets")
    names = key_names(topology)
    for name in names:  # every key is readable before any bundle is written
        store.public(name)
        store.pair(name)
    admitted = sorted(store.clients_dir.glob("*.key")) if store.clients_dir and store.clients_dir.is_dir() else []
    if not out_dir.exists():
        out_dir.mkdir(parents=True, mode=0o700)  # bundles hold secrets: not for other accounts here
    bundles = []
    for host, own in secrets.items():
        base = out_dir / host
        keys = base / store.keys_dir.relative_to(root)
        _copy(topology_path, base / topology_path.resolve().relative_to(root), 0o644)
        for name in names:
            _copy(store.public_path(name), keys / PUBLIC_DIR / f"{name}.key", 0o644)
        (keys / SECRET_DIR).mkdir(parents=True, exist_ok=True, mode=0o700)
        (keys / SECRET_DIR).chmod(0o700)
        for name in own:
            _copy(store.secret_path(name), keys / SECRET_DIR / f"{name}.key_secret", 0o600)
        clients = 0
        if DRIVER in own and store.clients_dir is not None:
            for key in admitted:
                _copy(key, base / store.clients_dir.relative_to(root) / key.name, 0o644)
                clients += 1
        bundles.append(Bundle(host=host, directory=base, topology=base / topology_path.resolve().relative_to(root),
                              public_keys=tuple(names), secret_keys=own, admitted_clients=clients))
    return bundles


def _copy(source: Path, target: Path, mode: int) -> None:
    """Copy a file, created with `mode` from the start (a secret is never readable by others, even briefly)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(descriptor, "wb") as out, open(source, "rb") as data:
            shutil.copyfileobj(data, out)
        os.chmod(target, mode)  # the umask may have taken bits off
    except OSError as exc:
        raise SecurityError(f"{target}: cannot write it from {source}: {exc.strerror or exc}") from None
