"""Per-host key bundles: each host's folder holds the topology, every public key and its own secrets only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import SecurityError
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.security.bundles import host_secrets, write_bundles
from skippy_zmq.security.curve import CurveSetup
from skippy_zmq.security.keys import KeyStore, keygen
from tests.conftest import TINY_LLAMA_LAYERS

HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.1"]


def _topology(folder: Path, *, hosts: list[str] = HOSTS, driver: str = "gw.lan", keys_dir: str = "keys",
              name: str = "cluster.toml", model: str = "m.gguf", ports: list[int] | None = None,
              ranges: list[tuple[int, int]] | None = None) -> Path:
    text = topology_toml(model=model, ranges=ranges or [(i, i + 1) for i in range(len(hosts))], topology_id="hosts",
                         ports=ports, stage_hosts=hosts, driver_host=driver, keys_dir=keys_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def _files(folder: Path) -> dict[str, int]:
    """Every file under `folder`, relative, with its permission bits."""
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in sorted(folder.rglob("*")) if p.is_file()}


def test_each_bundle_holds_the_file_every_public_key_and_only_its_own_secrets(tmp_path: Path) -> None:
    path = _topology(tmp_path / "plan")
    topology = TopologyConfig.from_toml(path)
    keygen(topology)
    assert host_secrets(topology) == {"10.0.0.1": ("stage-0", "stage-2"), "10.0.0.2": ("stage-1",),
                                      "gw.lan": ("driver",)}
    bundles = write_bundles(path, topology, tmp_path / "bundles")
    assert [(b.host, b.secret_keys) for b in bundles] == [("10.0.0.1", ("stage-0", "stage-2")),
                                                          ("10.0.0.2", ("stage-1",)), ("gw.lan", ("driver",))]
    public = {f"keys/public/{name}.key": 0o644 for name in ("driver", "stage-0", "stage-1", "stage-2")}
    for bundle in bundles:
        secrets = {f"keys/secret/{name}.key_secret": 0o600 for name in bundle.secret_keys}
        assert _files(bundle.directory) == {"cluster.toml": 0o644, **public, **secrets}
        assert (bundle.directory / "keys" / "secret").stat().st_mode & 0o777 == 0o700
        assert bundle.topology.read_bytes() == path.read_bytes()
        for name in bundle.secret_keys:  # the very keys keygen made
            assert (bundle.directory / "keys/secret" / f"{name}.key_secret").read_bytes() == \
                KeyStore.of(topology.security).secret_path(name).read_bytes()
    assert (tmp_path / "bundles").stat().st_mode & 0o777 == 0o700
    assert bundles[0].describe() == (f"10.0.0.1: {tmp_path / 'bundles' / '10.0.0.1'} (cluster.toml; 4 public keys; "
                                     "secrets: stage-0, stage-2)")


def test_a_bundle_moved_elsewhere_loads_its_own_keys_and_no_one_elses(tmp_path: Path) -> None:
    path = _topology(tmp_path / "plan")
    topology = TopologyConfig.from_toml(path)
    keygen(topology)
    write_bundles(path, topology, tmp_path / "bundles")
    for host in ("10.0.0.1", "10.0.0.2", "gw.lan"):  # as if copied to that host's working directory
        shutil.copytree(tmp_path / "bundles" / host, tmp_path / "hosts" / host)
    shutil.rmtree(tmp_path / "plan")  # nothing of the planning machine is left to find
    first = TopologyConfig.from_toml(tmp_path / "hosts/10.0.0.1/cluster.toml")
    assert first.security.keys_dir == tmp_path / "hosts/10.0.0.1/keys"
    for stage in first.stages_on("10.0.0.1"):
        assert CurveSetup.for_stage(first, stage).own.secret is not None
    with pytest.raises(SecurityError, match=r"hosts/10\.0\.0\.1/keys/secret/stage-1\.key_secret: key file does not "
                                            "exist"):
        CurveSetup.for_stage(first, first.stage("stage-1"))
    with pytest.raises(SecurityError, match=r"driver\.key_secret: key file does not exist"):
        CurveSetup.for_driver(first)
    gateway = TopologyConfig.from_toml(tmp_path / "hosts/gw.lan/cluster.toml")
    assert set(CurveSetup.for_driver(gateway).admitted["skippy.return"]) == {
        CurveSetup.for_stage(first, first.stage("stage-0")).own.public,
        CurveSetup.for_stage(first, first.stage("stage-2")).own.public,
        KeyStore.of(gateway.security).public("stage-1")}


def test_a_bundle_keeps_the_layout_of_keys_outside_the_topologys_folder(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    path = _topology(checkout / "config", hosts=["a.lan", "b.lan"], driver="b.lan", keys_dir="../keys/x")
    path.write_text(path.read_text().replace('keys_dir = "../keys/x"',
                                             'keys_dir = "../keys/x"\nclients_dir = "../keys/admitted"'))
    topology = TopologyConfig.from_toml(path)
    keygen(topology)
    KeyStore.of(topology.security).ensure_client("app")
    bundles = write_bundles(path, topology, tmp_path / "out")
    assert [(b.host, b.secret_keys, b.admitted_clients) for b in bundles] == [("a.lan", ("stage-0",), 0),
                                                                             ("b.lan", ("driver", "stage-1"), 1)]
    assert _files(tmp_path / "out" / "a.lan") == {
        "config/cluster.toml": 0o644, "keys/x/public/driver.key": 0o644, "keys/x/public/stage-0.key": 0o644,
        "keys/x/public/stage-1.key": 0o644, "keys/x/secret/stage-0.key_secret": 0o600}
    driver_files = _files(tmp_path / "out" / "b.lan")
    assert driver_files["keys/admitted/app.key"] == 0o644
    assert not any("clients/" in name for name in driver_files)  # a client's own pair never leaves here
    moved = TopologyConfig.from_toml(tmp_path / "out" / "b.lan" / "config" / "cluster.toml")
    assert len(KeyStore.of(moved.security).clients()) == 1
    assert CurveSetup.for_driver(moved, request_api=True).own.secret is not None


def test_an_existing_host_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = _topology(tmp_path / "plan")
    topology = TopologyConfig.from_toml(path)
    keygen(topology)
    (tmp_path / "bundles" / "10.0.0.2").mkdir(parents=True)
    with pytest.raises(SecurityError, match=r"bundles/10\.0\.0\.2: already exists; remove it"):
        write_bundles(path, topology, tmp_path / "bundles")
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["10.0.0.2"]


def test_bundles_need_every_key_a_host_for_every_process_and_one_shared_folder(tmp_path: Path) -> None:
    path = _topology(tmp_path / "plan")
    topology = TopologyConfig.from_toml(path)
    with pytest.raises(SecurityError, match=r"driver\.key: key file does not exist; create it with `skippy-zmq "
                                            "keygen"):
        write_bundles(path, topology, tmp_path / "bundles")
    assert not (tmp_path / "bundles").exists()
    ipc = tmp_path / "ipc" / "t.toml"
    ipc.parent.mkdir()
    ipc.write_text(path.read_text().replace('pull_connect = "tcp://10.0.0.2:5712"\nhost = "10.0.0.2"',
                                            'pull_connect = "ipc:///tmp/skippy-s1"'))
    with pytest.raises(SecurityError, match=r'stage "stage-1" has no host \(pull_connect \'ipc:///tmp/skippy-s1\'\)'):
        write_bundles(ipc, TopologyConfig.from_toml(ipc), tmp_path / "bundles")
    apart = _topology(tmp_path / "apart", keys_dir="/nonexistent-skippy-keys")
    with pytest.raises(SecurityError, match=r"keys_dir /nonexistent-skippy-keys and the topology's folder .* share "
                                            r"no folder but /; give a keys_dir beside the file"):
        write_bundles(apart, TopologyConfig.from_toml(apart), tmp_path / "bundles")
    plain = tmp_path / "plain" / "t.toml"
    plain.parent.mkdir()
    plain.write_text(path.read_text().replace("curve = true", "curve = false"))
    with pytest.raises(SecurityError, match=r"\[security\] curve is not on"):
        write_bundles(plain, TopologyConfig.from_toml(plain), tmp_path / "bundles")


@pytest.mark.slow
def test_two_hosts_run_their_own_bundles_and_a_driver_generates_through_them(tmp_path: Path,
                                                                             tiny_llama_path: Path) -> None:
    """127.0.0.1 and localhost stand for two machines: each `up --host` runs in a copy of its bundle only."""
    import os

    import skippy_zmq

    # the commands run in the bundles' folders: this checkout's package must still be the one imported
    source = str(Path(skippy_zmq.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    ports = free_tcp_ports(3)
    path = _topology(tmp_path / "plan", hosts=["127.0.0.1", "localhost"], driver="127.0.0.1",
                     model=str(tiny_llama_path), ports=ports, ranges=[(0, 2), (2, TINY_LLAMA_LAYERS)])
    done = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "keygen", "--topology", str(path), "--bundles",
                           str(tmp_path / "bundles")], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"bundle localhost: {tmp_path / 'bundles' / 'localhost'} (cluster.toml; 3 public keys; secrets: " \
           "stage-1)" in done.stdout
    shutil.rmtree(tmp_path / "plan")
    ups = []
    try:
        for host in ("127.0.0.1", "localhost"):
            ups.append(subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", "up", "--topology", "cluster.toml",
                                         "--host", host, "--max-restarts", "0"], cwd=tmp_path / "bundles" / host,
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        done = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "generate", "--topology", "cluster.toml",
                               "--temperature", "0", "--max-tokens", "4", "--json", "--ready-timeout", "60", "Hello"],
                              cwd=tmp_path / "bundles" / "127.0.0.1", env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["error"] is None and len(result["tokens"]) == 4
        assert all(up.poll() is None for up in ups)
    finally:
        for up in ups:
            up.terminate()
        for up in ups:
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(10)
