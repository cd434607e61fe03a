"""`bench links`: modes, codecs, setups and their order, llama.cpp's layer split, the command lines, the table
and its ratios in-process; the namespaces made real, and the command end to end on a tiny model (slow, root)."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import pytest

from skippy_zmq.bench.clients import RunSummary
from skippy_zmq.bench.cpu_budget import CpuBudget, CpuHierarchy
from skippy_zmq.bench.links import (
    CodecChoice,
    CpuGroups,
    LinksBench,
    LinksResults,
    LinksRun,
    Mode,
    Network,
    Placement,
    Setup,
    cells,
    cpu_groups_unavailable,
    listening,
    namespace_prerequisites,
    pipeline_commands,
    rpc_commands,
    schedule,
    setups,
    tensor_split,
)
from skippy_zmq.bench.netns import Layout, LinkCounters, Rate, namespace_names
from skippy_zmq.errors import BenchError

REPO = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "skippy_zmq.cli")
RAW = CodecChoice.parse("raw-f32-v1")
LOOP, SHAPED = Mode.parse("loopback"), Mode.parse("10mbit")
RPC_LOOP, RPC_SHAPED = Mode.parse("rpc@loopback"), Mode.parse("rpc@10mbit")


@pytest.mark.parametrize(("text", "rpc", "bits", "name"), [
    ("loopback", False, None, "loopback"), ("100mbit", False, 10**8, "100mbit"), ("rpc@1gbit", True, 10**9, "rpc@1gbit"),
    (" RPC@Loopback ", True, None, "rpc@loopback"), ("1000mbit", False, 10**9, "1gbit"),
])
def test_modes(text: str, rpc: bool, bits: int | None, name: str) -> None:
    mode = Mode.parse(text)
    assert (mode.rpc, None if mode.rate is None else mode.rate.bits_per_s, mode.name) == (rpc, bits, name)


def test_a_mode_that_is_not_one_says_what_would_be() -> None:
    with pytest.raises(BenchError) as caught:
        Mode.parse("rpc@fast")
    assert str(caught.value).startswith("--links: 'rpc@fast' is not a mode (link rate 'fast' is not a rate; ")
    assert str(caught.value).endswith("expected loopback, a rate such as 100mbit, or rpc@ either")


@pytest.mark.parametrize(("text", "codec", "policy"), [
    ("raw-f32-v1", "raw-f32-v1", "fixed"), ("f32", "raw-f32-v1", "fixed"), ("f16", "f16-rne-v1", "fixed"),
    ("BF16", "bf16-rne-v1", "fixed"), ("s8", "s8-row-f32-rne-v1", "fixed"), ("f16-rne-v1", "f16-rne-v1", "fixed"),
    ("auto-lossless-v1", "raw-f32-v1", "auto-lossless-v1"),
])
def test_codecs_by_wire_name_label_or_the_lossless_policy(text: str, codec: str, policy: str) -> None:
    choice = CodecChoice.parse(text)
    assert (choice.codec, choice.policy) == (codec, policy)
    assert choice.name == (policy if policy != "fixed" else codec)


def test_a_codec_that_is_not_one_lists_the_names() -> None:
    with pytest.raises(BenchError, match=r"^--codecs: 'q4' is not a codec; expected one of raw-f32-v1, f32, "
                                         r"f16-rne-v1, f16, .*s8 or auto-lossless-v1$"):
        CodecChoice.parse("q4")


def test_codecs_and_micro_batches_multiply_the_pipeline_modes_only() -> None:
    f16 = CodecChoice.parse("f16")
    found = setups([LOOP, RPC_SHAPED, SHAPED, LOOP], [RAW, f16], [1, 2])
    assert [s.name for s in found] == [
        "loopback raw-f32-v1 x1", "loopback raw-f32-v1 x2", "loopback f16-rne-v1 x1", "loopback f16-rne-v1 x2",
        "rpc@10mbit",
        "10mbit raw-f32-v1 x1", "10mbit raw-f32-v1 x2", "10mbit f16-rne-v1 x1", "10mbit f16-rne-v1 x2"]
    assert found[4] == Setup(RPC_SHAPED) and found[4].codec is None and found[4].micro_batches is None


def test_every_second_round_runs_the_setups_in_reverse() -> None:
    a, b, c = Setup(LOOP, RAW, 1), Setup(SHAPED, RAW, 1), Setup(RPC_SHAPED)
    assert schedule([a, b, c], 3) == [(1, a), (1, b), (1, c), (2, c), (2, b), (2, a), (3, a), (3, b), (3, c)]


def test_partners() -> None:
    shaped = Setup(SHAPED, RAW, 2)
    assert shaped.loopback_partner() == Setup(LOOP, RAW, 2) and shaped.rpc_partner() == Setup(RPC_SHAPED)
    assert Setup(LOOP, RAW, 2).loopback_partner() is None and Setup(LOOP, RAW, 2).rpc_partner() == Setup(RPC_LOOP)
    assert Setup(RPC_SHAPED).loopback_partner() == Setup(RPC_LOOP) and Setup(RPC_SHAPED).rpc_partner() is None
    assert Setup(SHAPED, RAW, 2).slug == "10mbit-raw-f32-v1-x2" and Setup(RPC_SHAPED).slug == "rpc-10mbit"


def _llama_cpp_devices(split: Sequence[int], n_layer: int) -> list[int]:
    """The device llama.cpp's load_tensors gives each layer (the head as layer n_layer) for a --tensor-split:
    the first device whose cumulative share, in float32, exceeds layer / (n_layer + 1)."""
    shares = np.cumsum(np.asarray(split, dtype=np.float32), dtype=np.float32)
    shares = shares / shares[-1]
    return [int(np.searchsorted(shares, np.float32(layer) / np.float32(n_layer + 1), side="right"))
            for layer in range(n_layer + 1)]


def _cuts(n_layer: int, stages: int) -> list[list[tuple[int, int]]]:
    if stages == 1:
        return [[(0, n_layer)]]
    return [[(0, first), *((s + first, e + first) for s, e in rest)]
            for first in range(1, n_layer - stages + 2) for rest in _cuts(n_layer - first, stages - 1)]


@pytest.mark.parametrize("n_layer", [1, 4, 7, 18, 26])
def test_the_tensor_split_puts_each_stage_layers_on_its_device(n_layer: int) -> None:
    for stages in range(1, min(n_layer, 4) + 1):
        for ranges in _cuts(n_layer, stages):
            expected = [i for i, (start, end) in enumerate(ranges) for _ in range(start, end)] + [stages - 1]
            assert _llama_cpp_devices(tensor_split(ranges, n_layer), n_layer) == expected, ranges
    assert tensor_split([(0, 3), (3, 4)], 4) == (3, 2)  # the tiny llama's cut: llama-server's KV buffers were 3:1


@pytest.mark.parametrize("ranges", [[], [(1, 4)], [(0, 2), (3, 4)], [(0, 3)], [(0, 2), (2, 2), (2, 4)]])
def test_ranges_that_do_not_cut_the_model_give_no_split(ranges: list[tuple[int, int]]) -> None:
    with pytest.raises(BenchError, match=r"do not cut layers 0\.\.4 in order"):
        tensor_split(ranges, 4)


def _options(**overrides: object) -> LinksBench:
    settings: dict[str, object] = {"model": Path("/m/tiny.gguf"), "stages": 2, "modes": (SHAPED,), "lanes": 4,
                                   "ctx_size": 256, "ready_timeout_s": 60.0}
    return LinksBench(**(settings | overrides))  # type: ignore[arg-type]


def test_the_pipeline_runs_stage_i_in_host_i_and_the_gateway_in_host_0() -> None:
    layout = Layout("beef", 2, 9)
    placement = Placement.of_layout(layout)
    options = _options(worker_args=("--emulate-link", "20ms"), serve_args=("--max-queue", "64"))
    workers, gateway = pipeline_commands(options, Setup(SHAPED, RAW, 2), placement, Path("/t/topology.toml"),
                                         [5710, 5711, 5712, 8000], 1)
    h0, h1 = layout.host(0), layout.host(1)
    assert [w.argv for w in workers] == [
        ("ip", "netns", "exec", h, *CLI, "worker", "--topology", "/t/topology.toml", "--stage", f"stage-{i}",
         "--threads", "1", "--emulate-link", "20ms") for i, h in enumerate((h0, h1))]
    assert [(w.name, w.host, w.port) for w in workers] == [("stage-0", "10.77.9.1", 5711), ("stage-1", "10.77.9.2", 5712)]
    assert gateway.argv == ("ip", "netns", "exec", h0, *CLI, "serve", "--topology", "/t/topology.toml",
                            "--host", "10.78.9.2", "--port", "8000", "--micro-batches", "2", "--ready-timeout", "60",
                            "--max-queue", "64")
    assert gateway.url == "http://10.78.9.2:8000"
    local, _ = pipeline_commands(options, Setup(LOOP, RAW, 1), Placement.loopback(2), Path("/t.toml"),
                                 [1, 2, 3, 4], 2)
    assert local[0].argv[:len(CLI)] == CLI and local[0].host == "127.0.0.1"


def test_llama_cpp_gets_one_rpc_server_per_host_and_the_same_slots_and_context() -> None:
    rpc_server, llama_server = shutil.which("sh"), shutil.which("true")  # programs that exist
    assert rpc_server is not None and llama_server is not None
    layout = Layout("beef", 2, 9)
    options = _options(modes=(RPC_SHAPED,), rpc_server=rpc_server, llama_server=llama_server,
                       llama_server_args=("--no-webui",))
    servers, llama = rpc_commands(options, Placement.of_layout(layout), (3, 2), [50052, 50052, 8000], 2)
    assert [s.argv for s in servers] == [
        ("ip", "netns", "exec", layout.host(i), rpc_server, "-H", f"10.77.9.{i + 1}", "-p", "50052", "-t", "2", "-c")
        for i in range(2)]
    assert llama.argv == ("ip", "netns", "exec", layout.host(0), llama_server, "-m", "/m/tiny.gguf",
                          "--rpc", "10.77.9.1:50052,10.77.9.2:50052", "-ngl", "999", "-ts", "3,2", "-t", "2",
                          "-np", "4", "-c", "1024", "-fit", "off", "--host", "10.78.9.2", "--port", "8000",
                          "--no-webui")
    uncached, _ = rpc_commands(attrs.evolve(options, rpc_cache=False), Placement.loopback(2), (3, 2), [7, 8, 9], 2)
    assert uncached[1].argv == (rpc_server, "-H", "127.0.0.1", "-p", "8", "-t", "2")


def test_a_capped_host_runs_its_programs_in_its_cpu_group_inside_its_namespace() -> None:
    layout = Layout("beef", 2, 9)
    hierarchy = CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    groups = ("skippy-links-ab-cpu-h0", "skippy-links-ab-cpu-h1")
    placement = Placement.of_layout(layout).capped(hierarchy, groups)
    options = _options(host_cpus=CpuBudget(1.0))
    workers, gateway = pipeline_commands(options, Setup(SHAPED, RAW, 2), placement, Path("/t.toml"),
                                         [5710, 5711, 5712, 8000], options.threads_for(Setup(SHAPED, RAW, 2), 2))
    enter = ("sh", "-c", 'echo $$ > "$0" && exec "$@"')
    assert workers[1].argv[:8] == (*enter, "/sys/fs/cgroup/cpu/skippy-links-ab-cpu-h1/cgroup.procs",
                                   "ip", "netns", "exec", layout.host(1))
    assert workers[1].argv[8:] == (*CLI, "worker", "--topology", "/t.toml", "--stage", "stage-1", "--threads", "1")
    assert gateway.argv[:8] == (*enter, "/sys/fs/cgroup/cpu/skippy-links-ab-cpu-h0/cgroup.procs",
                                "ip", "netns", "exec", layout.host(0))
    local = Placement.loopback(2).capped(hierarchy, groups)
    assert local.wrap(0, ("prog",)) == (*enter, "/sys/fs/cgroup/cpu/skippy-links-ab-cpu-h0/cgroup.procs", "prog")
    with pytest.raises(BenchError, match="1 CPU groups for 2 hosts"):
        Placement.loopback(2).capped(hierarchy, groups[:1])


def test_rpc_modes_without_llama_cpp_programs_are_refused_naming_them() -> None:
    options = _options(modes=(SHAPED, RPC_SHAPED), rpc_server=None, llama_server="/no/such/llama-server")
    with pytest.raises(BenchError) as caught:
        options.rpc_binaries()
    assert str(caught.value) == ("the rpc modes (rpc@10mbit) need llama.cpp's ggml-rpc-server and an RPC-enabled "
                                 "llama-server: --rpc-server (not given); --llama-server /no/such/llama-server "
                                 "(no such program)")


def test_threads_as_a_local_pipeline_gives_them_unless_given() -> None:
    options = _options()
    assert [options.threads_for(Setup(SHAPED, RAW, mb), cores=2) for mb in (1, 2, 4)] == [2, 1, 1]
    assert options.threads_for(Setup(RPC_SHAPED), cores=2) == 2
    assert _options(threads=3).threads_for(Setup(SHAPED, RAW, 4), cores=2) == 3
    capped = _options(host_cpus=CpuBudget(2 / 3))  # a budget: the host's whole CPUs, at least one
    assert [capped.threads_for(setup, cores=2) for setup in (Setup(SHAPED, RAW, 1), Setup(RPC_SHAPED))] == [1, 1]
    assert _options(host_cpus=CpuBudget(2.0)).threads_for(Setup(SHAPED, RAW, 4), cores=4) == 2


def test_what_a_host_lacks_for_namespaces() -> None:
    assert namespace_prerequisites(0, lambda tool: f"/usr/sbin/{tool}") == []
    assert namespace_prerequisites(1000, lambda tool: None if tool == "tc" else "/usr/sbin/ip") == [
        "root (this process runs as uid 1000; namespaces, veths and qdiscs need CAP_NET_ADMIN)",
        "`tc` (iproute2) on PATH"]


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A057 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 607361 1
   1: 0209A8C0:C3AC 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1062 1
   2: 0100007F:1F40 0100007F:A335 06 00000000:00000000 03:00000ED0 00000000     0        0 0 3
"""


def test_a_listening_socket_is_found_by_port_and_state() -> None:
    assert listening(PROC_NET_TCP, 0xA057) and listening(PROC_NET_TCP, 50092)
    assert not listening(PROC_NET_TCP, 8000)  # in TIME_WAIT (06), not listening
    assert not listening("", 50092)


def _summary(tok_s: float, *, tokens: int = 8, failed: int = 0) -> RunSummary:
    return RunSummary(requests=1, failed=failed, completion_tokens=tokens, expected_tokens=8, wall_s=1.0,
                      aggregate_tok_s=tok_s, decode_tok_s=tok_s, ttft_p50_ms=20.0, ttft_p99_ms=30.0,
                      itl_p50_ms=tok_s / 10, itl_p99_ms=5.0, first_error="HTTP 500: x" if failed else None)


def _run(setup: Setup, tok_s: float, *, round_index: int = 1, clients: int = 1,
         tx: tuple[int, ...] | None = None, failed: int = 0) -> LinksRun:
    links = None if tx is None else tuple(LinkCounters(t, 10) for t in tx)
    return LinksRun(round_index, setup, clients, 2, _summary(tok_s, failed=failed), links)


RUNS = (
    _run(Setup(LOOP, RAW, 1), 100.0), _run(Setup(LOOP, RAW, 1), 120.0, round_index=2),
    _run(Setup(SHAPED, RAW, 1), 50.0, tx=(8000, 800)), _run(Setup(SHAPED, RAW, 1), 60.0, round_index=2, tx=(9600, 960)),
    _run(Setup(RPC_SHAPED), 25.0, tx=(16000, 80000)), _run(Setup(RPC_SHAPED), 35.0, round_index=2, tx=(16000, 80000)),
    _run(Setup(SHAPED, RAW, 2), 70.0, tx=(8000, 800)),
)


def test_cells_take_medians_over_rounds_and_ratios_to_their_partners() -> None:
    found = {(c.setup.name, c.clients): c for c in cells(RUNS)}
    assert list(found) == [("loopback raw-f32-v1 x1", 1), ("10mbit raw-f32-v1 x1", 1), ("rpc@10mbit", 1),
                           ("10mbit raw-f32-v1 x2", 1)]
    shaped = found["10mbit raw-f32-v1 x1", 1]
    assert shaped.tok_s == 55.0 and shaped.vs_loopback == pytest.approx(0.5) and shaped.vs_rpc == pytest.approx(55 / 30)
    assert shaped.hop_bytes_per_token() == (1100.0, 110.0)
    assert found["loopback raw-f32-v1 x1", 1].vs_loopback is None and found["loopback raw-f32-v1 x1", 1].vs_rpc is None
    assert found["rpc@10mbit", 1].vs_loopback is None  # no rpc@loopback ran
    assert found["10mbit raw-f32-v1 x2", 1].vs_loopback is None  # no loopback at 2 micro-batches
    assert found["loopback raw-f32-v1 x1", 1].hop_bytes_per_token() is None


def test_the_table() -> None:
    results = LinksResults(_options(), ((0, 3), (3, 4)), RUNS)
    lines = results.table().splitlines()
    assert lines[0].startswith("2 stages (layers 0..3, 3..4, the last with the head), 4 lanes of 256 positions, "
                               "64 tokens per request, 1 per client; links: tbf on both directions of each host, burst "
                               "max(rate / 250 Hz, 1514 B), latency 50 ms;")
    assert lines[0].endswith("; CPUs: every host shares every core of this machine; prompts: stories")
    capped = LinksResults(_options(host_cpus=CpuBudget(0.5), texts="grounded"), ((0, 3), (3, 4)), RUNS)
    assert capped.table().splitlines()[0].endswith(
        "; CPUs: 0.5 CPUs per host (5000 us of each 10000 us); prompts: grounded")
    assert lines[2:] == [
        "| mode | codec | micro-batches | clients | tok/s | vs loopback | vs rpc | TTFT p50 ms | ITL p50 ms | "
        "bytes/token per hop |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        "| loopback | raw-f32-v1 | 1 | 1 | 110.0 | - | - | 20.0 | 11.0 | - |",
        "| 10mbit | raw-f32-v1 | 1 | 1 | 55.0 | 0.500 | 1.833 | 20.0 | 5.5 | 1,100 / 110 |",
        "| rpc@10mbit | - | - | 1 | 30.0 | - | - | 20.0 | 3.0 | 2,000 / 10,000 |",
        "| 10mbit | raw-f32-v1 | 2 | 1 | 70.0 | - | 2.333 | 20.0 | 7.0 | 1,000 / 100 |",  # rpc has no micro-batches
    ]
    assert results.problems() == []


def test_runs_short_of_tokens_are_problems() -> None:
    results = LinksResults(_options(), ((0, 4),), (_run(Setup(SHAPED, RAW, 1), 5.0, failed=1),))
    assert results.problems() == ["10mbit raw-f32-v1 x1 round 1 at 1 clients: 1 of 1 requests failed, 8 of 8 tokens "
                                  "(first error: HTTP 500: x)"]


def test_a_run_row_carries_the_setup_and_each_hop() -> None:
    row = _run(Setup(SHAPED, CodecChoice.parse("auto-lossless-v1"), 2), 50.0, tx=(8000, 800)).as_json("x")
    assert {k: row[k] for k in ("row", "label", "mode", "server", "rate_bit_s", "codec", "codec_policy",
                                "micro_batches", "threads", "upload_bytes", "download_bytes",
                                "bytes_per_token_per_hop")} == {
        "row": "run", "label": "x", "mode": "10mbit", "server": "pipeline", "rate_bit_s": 10**7, "codec": "raw-f32-v1",
        "codec_policy": "auto-lossless-v1", "micro_batches": 2, "threads": 2, "upload_bytes": [8000, 800],
        "download_bytes": [10, 10], "bytes_per_token_per_hop": [1000.0, 100.0]}
    assert row["aggregate_tok_s"] == 50.0
    assert (row["host_cpus"], row["texts"]) == (None, "stories")
    capped = attrs.evolve(_run(Setup(SHAPED, RAW, 1), 50.0, tx=(1, 1)), host_cpus=0.5, texts="grounded")
    assert (capped.as_json("x")["host_cpus"], capped.as_json("x")["texts"]) == (0.5, "grounded")


class _FakeIp:
    """`links._run` in-process: records every command, fails the first that starts with `fail`."""

    def __init__(self, fail: tuple[str, ...]) -> None:
        self.fail = fail
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], what: str) -> str:
        self.commands.append(tuple(argv))
        if tuple(argv[:len(self.fail)]) == self.fail:
            raise BenchError(f"{what}: `{' '.join(argv)}` exited with status 2: Error: Specified qdisc kind is unknown.")
        return ""


def test_a_kernel_without_tbf_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeIp(("tc",))
    monkeypatch.setattr("skippy_zmq.bench.links._run", fake)
    with pytest.raises(BenchError) as caught:
        Network(Layout("beef", 2, 9), lambda _t: None).shape(Rate.parse("10mbit"))
    assert str(caught.value).endswith("Error: Specified qdisc kind is unknown.; the tbf qdisc could not be added "
                                      "(a kernel without sch_tbf, CONFIG_NET_SCH_TBF, refuses it)")


def test_a_creation_that_fails_deletes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout("beef", 2, 9)
    fake = _FakeIp(("ip", "-n", layout.switch, "link", "add", layout.switch_veth(1)))
    monkeypatch.setattr("skippy_zmq.bench.links._run", fake)
    network = Network(layout, lambda _t: None)
    with pytest.raises(BenchError, match="creating the namespaces"):
        network.create()
    assert [c for c in fake.commands if c in layout.delete_commands()] == layout.delete_commands()
    assert not network.created


# --------------------------------------------------------------------------- real namespaces (root only)


def _namespaces_unavailable() -> str | None:
    """Why this host cannot make network namespaces, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not on PATH"
    probe = f"skippy-links-probe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30, check=False)
    return None


@pytest.fixture
def namespaces() -> None:
    """Skip, saying why, on a host that cannot make network namespaces."""
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _ours(suffix: str) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [name for name in namespace_names(listing) if suffix in name]


ECHO_SERVER = """\
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7007)); s.listen(1)
s.settimeout(20); print("listening", flush=True)
c, peer = s.accept(); c.sendall(c.recv(100) + b" from " + peer[0].encode()); c.close(); s.close()
"""
ECHO_CLIENT = """\
import socket, sys
c = socket.create_connection((sys.argv[1], 7007), timeout=20); c.sendall(b"ping"); print(c.recv(100).decode()); c.close()
"""


@pytest.mark.slow
@pytest.mark.usefixtures("namespaces")
def test_a_two_host_layout_is_shaped_reaches_across_the_bridge_and_is_deleted() -> None:
    said: list[str] = []
    network = Network.plan(2, said.append)
    layout = network.layout
    try:
        network.create()
        network.shape(Rate.parse("10mbit"))
        for namespace, dev in ((layout.host(1), layout.host_veth(1)), (layout.switch, layout.switch_veth(1))):
            shown = subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", dev], capture_output=True,
                                   text=True, timeout=30, check=True).stdout
            assert re.search(r"qdisc tbf \S+ root .*rate 10Mbit burst 5000b lat 50ms", shown), shown
        server = subprocess.Popen(["ip", "netns", "exec", layout.host(0), sys.executable, "-c", ECHO_SERVER,
                                   layout.host_address(0)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            echoed = subprocess.run(["ip", "netns", "exec", layout.host(1), sys.executable, "-c", ECHO_CLIENT,
                                     layout.host_address(0)], capture_output=True, text=True, timeout=30, check=True)
            assert echoed.stdout.strip() == f"ping from {layout.host_address(1)}"
            assert server.wait(20) == 0
        finally:
            server.kill()
            server.wait(20)
        sent = network.counters()
        assert sent[1].tx_bytes > 0 and sent[1].rx_bytes > 0  # host 1 sent the ping and got the echo
        second = Network.plan(1, said.append)  # our own layout is named stale, and left alone
        assert any(layout.host(0) in line and "left alone" in line for line in said)
        assert second.layout.suffix != layout.suffix
    finally:
        network.delete()
    assert _ours(layout.suffix) == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert layout.client_veth not in links


def _bench(tmp_path: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    return subprocess.run([*CLI, "bench", "links", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout_s, check=False)


@pytest.mark.slow
@pytest.mark.usefixtures("namespaces")
def test_bench_links_on_a_tiny_model_reports_bytes_per_token(tiny_llama_path: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "links.jsonl", tmp_path / "links.md"
    result = _bench(tmp_path, "--model", str(tiny_llama_path), "--links", "10mbit", "--stages", "2", "--clients", "1",
                    "--tokens", "4", "--rounds", "1", "--lanes", "2", "--ctx-size", "256", "--ready-timeout", "120",
                    "--timeout", "60", "--json-out", str(out), "--out", str(report))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["mode"], r["clients"]) for r in rows] == [("run", "10mbit", 1), ("setup", "10mbit", 1)]
    run = rows[0]
    assert run["failed"] == 0 and run["completion_tokens"] == 4 and run["aggregate_tok_s"] > 0
    assert len(run["bytes_per_token_per_hop"]) == 2 and all(v > 0 for v in run["bytes_per_token_per_hop"])
    table = result.stdout.splitlines()
    assert table[0].startswith("links: ") and table[4].startswith("| mode | codec | micro-batches |")
    assert table[6].startswith("| 10mbit | raw-f32-v1 | 1 | 1 | ")
    assert report.read_text().strip() == result.stdout.strip()
    suffix = re.search(r"creating namespaces skippy-links-([0-9a-f]+)-sw", result.stderr)
    assert suffix is not None and _ours(suffix.group(1)) == []
    assert "ip netns exec skippy-links-" in result.stderr and " skippy-zmq worker --topology " in result.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("namespaces")
@pytest.mark.skipif(cpu_groups_unavailable() is not None, reason=str(cpu_groups_unavailable()))
def test_bench_links_caps_each_host_in_its_namespace_and_removes_the_groups(tiny_llama_path: Path,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "links.jsonl"
    result = _bench(tmp_path, "--model", str(tiny_llama_path), "--links", "10mbit", "--stages", "2", "--clients", "1",
                    "--tokens", "4", "--lanes", "2", "--ctx-size", "256", "--ready-timeout", "120", "--timeout", "60",
                    "--host-cpus", "0.5", "--json-out", str(out))
    assert result.returncode == 0, result.stderr
    run = json.loads(out.read_text().splitlines()[0])
    assert (run["host_cpus"], run["threads"], run["completion_tokens"]) == (0.5, 1, 4)
    groups = re.findall(r"/sys/fs/cgroup/\S*?(skippy-links-[0-9a-f]+-cpu-h[01])/cgroup.procs ip netns exec "
                        r"skippy-links-[0-9a-f]+-h([01]) ", result.stderr)
    assert {(name[-1], host) for name, host in groups} == {("0", "0"), ("1", "1")}  # host i's group, host i's namespace
    assert "capping each host at 0.5 CPUs per host (5000 us of each 10000 us)" in result.stderr
    assert "CPUs: 0.5 CPUs per host" in result.stdout
    hierarchy = CpuGroups.plan(1, CpuBudget(0.5), lambda _line: None).hierarchy
    assert not [name for name, _host in groups if hierarchy.group(name).exists()]


@pytest.mark.slow
@pytest.mark.usefixtures("namespaces")
def test_sigterm_mid_run_stops_every_process_and_deletes_the_namespaces(tiny_llama_path: Path, tmp_path: Path) -> None:
    returncode, seen, rest = _interrupted(tmp_path, "--model", str(tiny_llama_path), "--links", "1mbit")
    assert returncode == 130, seen + rest
    suffix = re.search(r"creating namespaces skippy-links-([0-9a-f]+)-sw", seen)
    assert suffix is not None and _ours(suffix.group(1)) == []
    assert "deleted namespaces skippy-links-" in rest and rest.rstrip().endswith("interrupted")


@pytest.mark.slow
@pytest.mark.skipif(cpu_groups_unavailable() is not None, reason=str(cpu_groups_unavailable()))
def test_sigterm_mid_run_removes_the_cpu_groups(tiny_llama_path: Path, tmp_path: Path) -> None:
    returncode, seen, rest = _interrupted(tmp_path, "--model", str(tiny_llama_path), "--links", "loopback",
                                          "--host-cpus", "0.5")
    assert returncode == 130, seen + rest
    names = set(re.findall(r"skippy-links-[0-9a-f]+-cpu-h[01]", seen))
    assert len(names) == 2, seen
    hierarchy = CpuGroups.plan(1, CpuBudget(0.5), lambda _line: None).hierarchy
    assert [name for name in names if hierarchy.group(name).exists()] == []
    assert rest.rstrip().endswith("interrupted")


def _interrupted(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """`bench links ARGS` on 2 stages sent SIGTERM inside its first measured request: its status, what it
    printed on stderr before the signal and after."""
    env = os.environ | {"PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    process = subprocess.Popen([*CLI, "bench", "links", *args, "--stages", "2", "--clients", "1", "--tokens", "3000",
                                "--lanes", "1", "--ctx-size", "4096", "--ready-timeout", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    seen = b""
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 120
        while b"1 clients x 3000 tokens" not in seen:  # raw reads: a buffered reader would hide lines from select
            assert time.monotonic() < deadline and process.poll() is None, seen.decode()
            if select.select([process.stderr], [], [], 1.0)[0]:
                seen += os.read(process.stderr.fileno(), 65536)
        time.sleep(0.5)  # inside the measured requests
        process.send_signal(signal.SIGTERM)
        _, tail = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    return process.returncode, seen.decode(), tail.decode()
