"""`bench memory`: a serving command's start time and process-tree memory, or one stage's resident memory
against the planner's estimate (docs/ARCHITECTURE.md, "Memory-aware planning").

A serving command (skippy-zmq serve, llama-server) is timed from its start to the first `/health` 200,
sent 4 completions of 16 tokens one after another, and the resident memory (VmRSS) of it and every
process below it is summed; then it is stopped. `warmup` unmeasured starts run first, and the command
runs without PYTHONDONTWRITEBYTECODE, so Python's bytecode caches of an editable install are written
and read as a normal install's are: a warm start, as a user's second one.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from skippy_zmq.bench.report import Report, cell, markdown_table
from skippy_zmq.bench.servers import Server, ServerCommand, log_directory
from skippy_zmq.errors import BenchError

COMPLETIONS = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at")
"""The requests a serving command answers before its memory is read, 16 tokens each."""
COMPLETION_TOKENS = 16
READY_POLL_S = 0.05
"""Between two `/health` probes of a start being timed: the start time is read to this."""


def _children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _vm_rss_kib(status: str) -> int:
    """VmRSS of one /proc/PID/status text, KiB (0 for a process without memory of its own)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def tree_rss_mib(root: int) -> float:
    """VmRSS of `root` and every process below it, MiB."""
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            total += _vm_rss_kib(Path(f"/proc/{pid}/status").read_text())
        except OSError:  # ended meanwhile
            continue
    return total / 1024


def rss_mib() -> float:
    """This process's VmRSS, MiB."""
    return _vm_rss_kib(Path("/proc/self/status").read_text()) / 1024


def _complete(url: str, prompt: str, timeout_s: float) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": COMPLETION_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except OSError as exc:  # HTTP errors, refused, timed out
        raise BenchError(f"a completion at {url}/v1/completions failed: {exc}") from None


@attrs.frozen
class CommandMemory:
    """A serving command's measured start: seconds to `/health` 200, process-tree RSS after the completions."""

    command: str
    ready_s: float
    tree_rss_mib: float
    warmup_ready_s: tuple[float, ...]

    def as_json(self) -> dict[str, Any]:
        """The row's figures."""
        return {"command": self.command, "ready_s": round(self.ready_s, 2), "tree_rss_mib": round(self.tree_rss_mib),
                "warmup_ready_s": [round(s, 2) for s in self.warmup_ready_s]}


def measure_command(argv: Sequence[str], *, port: int, warmup: int, ready_timeout_s: float, timeout_s: float,
                    report: Report, progress: Callable[[str], None]) -> CommandMemory:
    """`warmup` unmeasured starts, then the measured one; each started process tree is stopped."""
    command = ServerCommand(Path(argv[0]).name, tuple(argv), port)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    with log_directory() as logs:
        def start(index: int) -> Server:
            progress(f"start {index + 1}/{warmup + 1} ({'measured' if index == warmup else 'warm-up'}): "
                     f"{command.shown}")
            return Server(command, logs / f"command-{index}.log", env=env)

        warmups = []
        for index in range(warmup):
            server = start(index)
            try:
                warmups.append(server.wait_healthy(ready_timeout_s, progress, poll_s=READY_POLL_S))
            finally:
                server.stop()
        server = start(warmup)
        try:
            ready_s = server.wait_healthy(ready_timeout_s, progress, poll_s=READY_POLL_S)
            try:
                for prompt in COMPLETIONS:
                    _complete(command.url, prompt, timeout_s)
            except BenchError as exc:
                raise server.failure(f"did not answer: {exc}") from None
            server.check_alive()
            rss = tree_rss_mib(server.process.pid)
        finally:
            server.stop()
    result = CommandMemory(command.shown, ready_s, rss, tuple(warmups))
    report.add({"row": "command", **result.as_json()})
    return result


def command_table(result: CommandMemory) -> str:
    """The measured start's row."""
    return markdown_table(("command", "to /health 200 s", "tree RSS MiB", "warm-up starts s"), [
        (f"`{result.command}`", cell(result.ready_s, 2), cell(result.tree_rss_mib, 0),
         ", ".join(f"{s:.2f}" for s in result.warmup_ready_s) or "-")], "lrrr")


@attrs.frozen
class StageMemory:
    """One stage's VmRSS in this process after the imports, the load and the prompts, and the estimate."""

    model: str
    layers: tuple[int, int]
    kernel: str
    after_imports_mib: float
    after_load_mib: float
    after_prompts_mib: float
    estimate_mib: float
    estimate: str  # the estimate's parts, as the planner describes them

    def as_json(self) -> dict[str, Any]:
        """The row's figures."""
        return {"model": self.model, "layers": list(self.layers), "kernel": self.kernel,
                "rss_mib_after_imports": round(self.after_imports_mib, 1),
                "rss_mib_after_load": round(self.after_load_mib, 1),
                "rss_mib_after_prompts": round(self.after_prompts_mib, 1),
                "estimate_mib": round(self.estimate_mib, 1), "estimate": self.estimate}


def measure_stage(model: Path, layers: tuple[int, int] | None, *, ctx_size: int, lanes: int, prompt: int,
                  report: Report, progress: Callable[[str], None]) -> StageMemory:
    """As a stage worker has it: its imports, layers [A, B) on the environment's kernel, `lanes` sessions
    with a `prompt`-token prompt each (the head run on the last stage)."""
    import numpy as np
    import zmq  # noqa: F401  # a worker's imports, counted in the baseline

    import skippy_zmq.stage.worker  # noqa: F401
    from skippy_zmq.launch.memory import MemoryModel
    from skippy_zmq.model.gguf_file import read_header
    from skippy_zmq.model.gguf_model import read_hparams
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    after_imports = rss_mib()
    hp = read_hparams(model)
    start, end = layers if layers is not None else (0, hp.n_layer)
    kernel = Kernel.from_environment()
    runtime = StageRuntime.load(model, start, end, ctx_size=ctx_size, kernel=kernel, weight_cache=None,
                                progress=progress)
    after_load = rss_mib()
    rng = np.random.default_rng(0)
    progress(f"{lanes} sessions with a {prompt}-token prompt each")
    for session in range(lanes):
        runtime.open_session(session)
        inputs = (rng.integers(min(10, hp.n_vocab - 1), min(hp.n_vocab, 30000), prompt).astype(np.int32)
                  if runtime.is_first else rng.standard_normal((prompt, hp.n_embd)).astype(np.float32))
        out = runtime.forward(session, 0, inputs)
        if runtime.is_last:
            runtime.logits(out[-1:])
    estimate = MemoryModel.of_model(read_header(model), hp, quantized=kernel.quantized, ctx_size=ctx_size,
                                    lanes=lanes, head_by_nbits=lambda t: kernel.head_by_nbits(t, str(model)),
                                    ).stage(start, end)
    result = StageMemory(str(model), (start, end), kernel.name, after_imports, after_load, rss_mib(),
                         estimate.total / 2**20, estimate.describe())
    report.add({"row": "stage", "ctx_size": ctx_size, "lanes": lanes, "prompt": prompt, **result.as_json()})
    return result


def stage_table(result: StageMemory) -> str:
    """The stage's row, MiB."""
    return markdown_table(("layers", "kernel", "RSS after imports", "after load", "after prompts", "estimate"), [
        (f"{result.layers[0]}..{result.layers[1]}", result.kernel, cell(result.after_imports_mib),
         cell(result.after_load_mib), cell(result.after_prompts_mib), cell(result.estimate_mib))], "llrrrr")
