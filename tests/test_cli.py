"""The command line: help of every command, exit codes and messages for bad input."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from skippy_zmq.cli import main
from tests.conftest import TINY_LLAMA_LAYERS

COMMANDS = ["worker", "generate", "up", "plan", "tokenize"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m skippy_zmq.cli ARGS` in a fresh process (only from tests marked slow)."""
    return subprocess.run([sys.executable, "-m", "skippy_zmq.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_top_level_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and "--" in result.output


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["generate"], "give at least one PROMPT"),
        (["generate", "x", "--stages", "0"], "--stages"),
        (["generate", "x", "--temperature", "-1"], "--temperature"),
        (["generate", "x", "--codec", "zip"], "unknown activation codec 'zip'"),
        (["generate", "x", "--codec-policy", "sometimes"], "sometimes"),
        (["generate", "x", "--topology", "t.toml", "--model", "m.gguf"], "--model applies to a local pipeline"),
        (["generate", "x", "--topology", "t.toml", "--check-tensors"], "start each worker with --check-tensors"),
        (["serve", "--topology", "t.toml", "--check-tensors"], "start each worker with --check-tensors"),
        (["worker", "--stage", "stage-0"], "--topology"),
        (["plan", "--model", "m.gguf"], "--stages"),
        (["generate", "x", "--cache-type-k", "q8_0"], "'q8_0' is not one of 'f32', 'f16'"),
        (["plan", "--model", "m.gguf", "--stages", "2", "--cache-type-v", "F16"], "'F16' is not one of 'f32', 'f16'"),
        (["generate", "x", "--topology", "t.toml", "--cache-type-k", "f32"],
         "--cache-type-k applies to a local pipeline; with --topology each stage's cache_type_k is in the topology"),
        (["plan", "--model", "m.gguf", "--stages", "2", "--hosts", "a=1g"], "--stages N (one host) or --hosts"),
        (["plan", "--model", "m.gguf", "--hosts", "a=1g", "--host", "a"], "--host applies to --stages"),
        (["plan", "--model", "m.gguf", "--hosts", "a=1g", "--max-stage-memory", "1g"],
         "--max-stage-memory applies to --stages"),
        (["plan", "--model", "m.gguf", "--stages", "2", "--driver-host", "a"], "--driver-host applies to --hosts"),
        (["keygen", "--topology", "t.toml", "--client", "a", "--bundles", "b"], "--client and --bundles"),
        (["nonsense"], "No such command"),
        (["worker", "--topology", "t.toml", "--stage", "0", "--emulate-link", "delay=10"],
         "--emulate-link 'delay=10': delay '10' is not a duration"),
        (["generate", "x", "--emulate-link", "rate=fast"], "rate 'fast' is not a rate"),
        (["generate", "x", "--topology", "t.toml", "--emulate-link", "delay=5ms"],
         "--emulate-link applies to a local pipeline; with --topology set emulate_link in the topology"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], text: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert text in result.output


@pytest.mark.slow
def test_bad_topology_files_exit_1_naming_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('topology_id = "x"\n[driver]\nreturn_bind = "tcp://127.0.0.1:1"\n'
                   '[[stages]]\nid = "s0"\nindex = 0\nlayer_start = 0\nlayer_end = 0\npull_bind = "tcp://127.0.0.1:2"\n')
    for args in (["worker", "--topology", str(bad), "--stage", "s0"],
                 ["up", "--topology", str(bad)],
                 ["generate", "--topology", str(bad), "hi"]):
        done = run(*args)
        assert done.returncode == 1, (args, done.stderr)
        assert f'{bad}: stage "s0": layer_end 0 must be greater than layer_start 0' in done.stderr
    missing = run("worker", "--topology", str(tmp_path / "none.toml"), "--stage", "s0")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


@pytest.mark.slow
def test_unknown_stage_and_missing_model_exit_1(tmp_path: Path, tiny_llama_path: Path) -> None:
    plan = run("plan", "--model", str(tiny_llama_path), "--stages", "2")
    assert plan.returncode == 0, plan.stderr
    topology = tmp_path / "t.toml"
    topology.write_text(plan.stdout)
    done = run("worker", "--topology", str(topology), "--stage", "stage-7")
    assert done.returncode == 1 and "no stage 'stage-7'; stages are stage-0, stage-1" in done.stderr
    done = run("tokenize", "--model", str(tmp_path / "absent.gguf"), "hi")
    assert done.returncode == 1 and "absent.gguf' does not exist" in done.stderr
    done = run("plan", "--model", str(tiny_llama_path), "--stages", "9")
    assert done.returncode == 1 and f"cannot cut {TINY_LLAMA_LAYERS} layers into 9 stages" in done.stderr


@pytest.mark.slow
def test_plan_prints_a_valid_balanced_topology(tiny_llama_path: Path, tmp_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig

    done = run("plan", "--model", str(tiny_llama_path), "--stages", "3")
    assert done.returncode == 0, done.stderr
    path = tmp_path / "plan.toml"
    path.write_text(done.stdout)
    topology = TopologyConfig.from_toml(path)
    assert topology.n_stages == 3 and topology.layer_count == TINY_LLAMA_LAYERS
    assert all(stage.n_layers >= 1 for stage in topology.stages)


def test_plan_states_each_stages_memory_and_refuses_a_cut_that_cannot_fit(tiny_llama_path: Path,
                                                                          tmp_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig

    done = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--stages", "2", "--max-stage-memory",
                                     "1GiB", "--lanes", "4", "--ctx-size", "512"])
    assert done.exit_code == 0, done.output
    assert "# memory limit per stage: --max-stage-memory" in done.stdout
    assert re.search(r"# stage 1: layers \d\.\.4 \(\d \+ head\): .*; memory [\d.]+ MiB \(weights .* of 1 GiB",
                     done.stdout)
    path = tmp_path / "plan.toml"
    path.write_text(done.stdout)
    stages = TopologyConfig.from_toml(path).stages
    assert [(s.max_memory, s.lane_count, s.ctx_size) for s in stages] == [(1 << 30, 4, 512)] * 2
    tight = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--stages", "2",
                                      "--max-stage-memory", "200MiB"])
    assert tight.exit_code == 1
    assert re.search(r"no cut of 4 layers into 2 stages fits the memory limits; the fastest cut's stage \d "
                     r"\(layers \d\.\.\d\).* needs .* over its limit of 200 MiB", tight.output)
    bad = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--stages", "2",
                                    "--max-stage-memory", "lots"])
    assert bad.exit_code == 2 and "--max-stage-memory: 'lots' is not a memory size" in bad.output


def test_plan_of_an_expert_file_states_what_each_stage_holds_and_reads(expert_mini_path: Path) -> None:
    done = CliRunner().invoke(main, ["plan", "--model", str(expert_mini_path), "--stages", "2", "--lanes", "1",
                                     "--max-stage-memory", "1GiB", "--ctx-size", "64"])
    assert done.exit_code == 0, done.output
    assert "# cost model: the file's bytes a decode step reads per layer at batch 1: experts " in done.stdout
    stages = re.findall(r"# stage \d: .*: reads [\d.]+ [KM]iB a step \(\d+% of the busiest\); memory [\d.]+ MiB "
                        r"\(weights [\d.]+ [KM]iB, .*\) of 1 GiB", done.stdout)
    assert len(stages) == 2, done.stdout


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_memory_limit_with_a_topology_is_a_usage_error(command: str, tmp_path: Path) -> None:
    topology = tmp_path / "t.toml"
    topology.write_text("")
    args = [command, "--topology", str(topology), "--max-stage-memory", "4GiB", *(["hi"] if command == "generate" else [])]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2 and "set max_memory on each stage of the topology" in done.output


@pytest.mark.slow
def test_tokenize_prints_ids(tiny_llama_path: Path) -> None:
    plain = run("tokenize", "--model", str(tiny_llama_path), "hello world")
    as_json = run("tokenize", "--model", str(tiny_llama_path), "hello world", "--json")
    assert plain.returncode == as_json.returncode == 0
    ids = json.loads(as_json.stdout)
    assert plain.stdout.split() == [str(i) for i in ids]
    assert ids[0] == 2  # BOS


@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2", "phi-3"])
def test_tokenize_gives_llama_cpps_ids_for_any_vocabulary(vocab: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from skippy_zmq.testing.llama_sources import vocab_cases

    path = next(case.path for case in vocab_cases() if case.name == vocab)
    text = "Hello <|im_start|> wörld 🦙  123"
    done = CliRunner().invoke(main, ["tokenize", "--model", str(path), text, "--json"])
    assert done.exit_code == 0, done.output
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert json.loads(done.stdout) == llama.tokenize(text.encode(), add_bos=True, special=False)
    bare = CliRunner().invoke(main, ["tokenize", "--model", str(path), text, "--json", "--no-bos"])
    assert json.loads(bare.stdout) == llama.tokenize(text.encode(), add_bos=False, special=False)


@pytest.mark.slow
def test_generate_json_on_a_local_three_stage_pipeline(tiny_llama_path: Path) -> None:
    done = run("generate", "--model", str(tiny_llama_path), "--stages", "3", "--temperature", "0",
               "--max-tokens", "5", "--json", "--stats", "hello world", "once upon a time")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["hello world", "once upon a time"]
    for line in lines:
        assert set(line) >= {"prompt", "prompt_ids", "tokens", "text", "stats"}
        assert 1 <= len(line["tokens"]) <= 5
        assert [s["stage_index"] for s in line["stats"]["stages"]] == [0, 1, 2]


def _ready_pids(
    process: subprocess.Popen[str], count: int, timeout_s: float, seen: list[str] | None = None
) -> tuple[dict[str, int], queue.Queue[str]]:
    """Read `up`'s output until it says its `count` stages are up; their pids by stage (from its
    JSON ready events, if any), and the queue that keeps receiving its later lines. The lines
    read are appended to `seen`."""
    from skippy_zmq.telemetry import parse_event

    lines: queue.Queue[str] = queue.Queue()
    assert process.stderr is not None
    stream = process.stderr
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    pids: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {sorted(pids)} ready after {timeout_s} s"
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if seen is not None:
            seen.append(line)
        event = parse_event(line)
        if event is not None and event["event"] == "ready":
            pids[event["component"]] = event["pid"]
        if f"{count} stages ready; Ctrl-C stops them" in line:
            return pids, lines


def _planned_topology(tmp_path: Path, model: Path, n_stages: int, base_port: int) -> Path:
    """`skippy-zmq plan`'s topology for `model`, its ports moved to free ones, written under tmp_path."""
    from skippy_zmq.launch.topology import free_tcp_ports

    text = run("plan", "--model", str(model), "--stages", str(n_stages), "--base-port", str(base_port)).stdout
    for offset, port in enumerate(free_tcp_ports(n_stages + 1)):
        text = text.replace(f'"tcp://127.0.0.1:{base_port + offset}"', f'"tcp://127.0.0.1:{port}"')
    topology = tmp_path / "t.toml"
    topology.write_text(text)
    return topology


def _drain(lines: queue.Queue[str]) -> str:
    text = []
    with contextlib.suppress(queue.Empty):
        while True:
            text.append(lines.get(timeout=1))
    return "".join(text)


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["stage dies", "ctrl-c"])
def test_up_supervises_every_stage(tmp_path: Path, tiny_llama_path: Path, outcome: str) -> None:
    import os
    import signal

    topology = _planned_topology(tmp_path, tiny_llama_path, 3, 5710)
    # With restarts off, one dead stage ends `up` and stops the others (by default it would be
    # restarted: tests/test_survival.py).
    process = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", "up", "--topology", str(topology),
                                "--max-restarts", "0", "--log-json"],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        pids, lines = _ready_pids(process, 3, 60)
        assert sorted(pids) == ["stage-0", "stage-1", "stage-2"]
        if outcome == "stage dies":
            os.kill(pids["stage-1"], signal.SIGKILL)
            assert process.wait(30) == 1
            rest = _drain(lines)
            assert f"stage failed: stage-1: stage-1 (pid {pids['stage-1']}) exited with status -9 (SIGKILL)" in rest
            assert "restarts are off (--max-restarts 0)" in rest
        else:
            process.send_signal(signal.SIGINT)
            assert process.wait(30) == 0
        for stage, pid in pids.items():  # every other stage was stopped too
            if stage != "stage-1" or outcome == "ctrl-c":
                with pytest.raises(ProcessLookupError):
                    for _ in range(50):
                        os.kill(pid, 0)
                        time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_the_command_loads_no_numpy_before_worker_threads_are_pinned() -> None:
    # `worker --threads` sets OPENBLAS_NUM_THREADS before numpy loads; any import of numpy by the
    # package or the command module would make it a no-op.
    probe = "import sys, skippy_zmq, skippy_zmq.cli; print(sorted(m for m in ('numpy', 'zmq') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "['zmq']"


@pytest.mark.slow
@pytest.mark.parametrize("log_json", [False, True], ids=["plain", "json"])
def test_up_writes_one_log_format_and_nothing_twice(tmp_path: Path, tiny_llama_path: Path, log_json: bool) -> None:
    import signal

    from skippy_zmq.telemetry import parse_event

    topology = _planned_topology(tmp_path, tiny_llama_path, 2, 5730)
    command = [sys.executable, "-m", "skippy_zmq.cli", "up", "--topology", str(topology), "--max-restarts", "0"]
    process = subprocess.Popen(command + (["--log-json"] if log_json else []),
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen: list[str] = []
    try:
        _, lines = _ready_pids(process, 2, 60, seen)
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        output = [line.rstrip("\n") for line in seen if line.strip()]
        output += [line for line in _drain(lines).splitlines() if line.strip()]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert output, "up wrote nothing after its stages were ready"
    events = [parse_event(line) for line in output]
    if log_json:
        assert None not in events, [line for line, e in zip(output, events, strict=True) if e is None]
    else:
        assert [line for line, e in zip(output, events, strict=True) if e is not None] == []
        assert all(line.startswith(("[skippy-zmq] ", "error: ")) for line in output), output
    assert len(output) == len(set(output)), "a line was written twice"


def test_up_and_worker_take_log_json() -> None:
    from click.testing import CliRunner

    for command in ("up", "worker", "serve"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert "--log-json" in result.output, command


def test_every_command_that_starts_stages_takes_check_tensors() -> None:
    for command in ("worker", "up", "serve", "generate"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert "--check-tensors" in result.output and "byte offset" in " ".join(result.output.split()), command


@pytest.mark.slow
def test_check_tensors_refuses_a_damaged_file_on_worker_up_and_the_topology(tmp_path: Path,
                                                                             tiny_llama_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.model.gguf_file import read_header

    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(tiny_llama_path.read_bytes())
    offset = read_header(damaged).tensor("blk.1.ffn_down.weight").data_offset + 34 * 2
    with open(damaged, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes([0x00, 0x7C]))  # f16 +inf, little-endian
    topology = _planned_topology(tmp_path, damaged, 2, 5750)
    cut = TopologyConfig.from_toml(topology).stages[0].layer_end
    refusal = (f"tensor blk.1.ffn_down.weight (Q8_0): block 2 scale d is inf at byte offset {offset}; expected "
               f"finite weights and block scales in layers [0, {cut})")
    done = run("worker", "--topology", str(topology), "--stage", "stage-0", "--check-tensors")
    assert done.returncode == 1 and refusal in done.stderr, done.stderr
    done = run("up", "--topology", str(topology), "--max-restarts", "0", "--check-tensors")
    assert done.returncode == 1 and refusal in done.stderr, done.stderr
    checked = tmp_path / "checked.toml"
    checked.write_text(topology.read_text().replace(f"layer_end = {cut}\n", f"layer_end = {cut}\ncheck_tensors = true\n"))
    assert "check_tensors = true" in checked.read_text()
    done = run("worker", "--topology", str(checked), "--stage", "stage-0")
    assert done.returncode == 1 and refusal in done.stderr, done.stderr


def test_plan_writes_the_kv_cache_types_into_every_stage(tiny_llama_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig

    for args, types in (([], ("f16", "f16")), (["--cache-type-k", "f32", "--cache-type-v", "f32"], ("f32", "f32"))):
        result = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--stages", "2", *args])
        assert result.exit_code == 0, result.output
        stages = TopologyConfig.from_toml_text(result.output, source="<plan>").stages
        assert [(s.cache_type_k, s.cache_type_v) for s in stages] == [types, types]


def test_generate_hands_its_kv_cache_types_to_the_local_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    from skippy_zmq.driver import generate
    from skippy_zmq.errors import ConfigError

    seen: list[generate.GenerateOptions] = []
    monkeypatch.setattr("skippy_zmq.cli._generate_and_print", lambda options, *_a, **_k: seen.append(options) or True)
    result = CliRunner().invoke(main, ["generate", "hi", "--cache-type-v", "f32"])
    assert result.exit_code == 0, result.output
    assert (seen[0].cache_type_k, seen[0].cache_type_v) == ("f16", "f32")
    with pytest.raises(ConfigError, match=r"GenerateOptions.cache_type_k: cache type 'f64' is unknown"):
        generate.GenerateOptions(prompts=("hi",), cache_type_k="f64")


def test_generate_and_the_native_completion_sample_with_llama_cpps_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate's options, GenerateOptions and /completion read one set of defaults (defaults.py)."""
    from skippy_zmq import defaults
    from skippy_zmq.driver.generate import GenerateOptions
    from skippy_zmq.gateway.llama_api import NATIVE_DEFAULTS
    from skippy_zmq.tokens.sampling import SamplingParams

    seen: list[GenerateOptions] = []
    monkeypatch.setattr("skippy_zmq.cli._generate_and_print", lambda options, *_a, **_k: seen.append(options) or True)
    result = CliRunner().invoke(main, ["generate", "hi", "--seed", "7"])
    assert result.exit_code == 0, result.output
    llama_cpp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                               penalty_last_n=64, seed=7)
    assert seen[0].sampling() == GenerateOptions(prompts=("hi",), seed=7).sampling() == llama_cpp
    native = NATIVE_DEFAULTS
    assert (native.temperature, native.top_k, native.top_p, native.min_p, native.repeat_penalty,
            native.repeat_last_n) == (defaults.TEMPERATURE, defaults.TOP_K, defaults.TOP_P, defaults.MIN_P,
                                      defaults.REPEAT_PENALTY, defaults.REPEAT_LAST_N) == (0.8, 40, 0.95, 0.05, 1.0, 64)
    assert SamplingParams().penalty_last_n == defaults.REPEAT_LAST_N


def test_generate_takes_one_constraint_checked_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    pytest.importorskip("llguidance")
    from skippy_zmq.driver.generate import GenerateOptions

    seen: list[GenerateOptions] = []
    monkeypatch.setattr("skippy_zmq.cli._generate_and_print", lambda options, *_a, **_k: seen.append(options) or True)
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    for args, kind in ((["--regex", "[a-z]+"], "regex"), (["--grammar", 'root ::= "yes"'], "gbnf"),
                       (["--json-schema", f"@{schema}"], "json_schema")):
        result = CliRunner().invoke(main, ["generate", "hi", *args])
        assert result.exit_code == 0, result.output
        constraint = seen[-1].constraint
        assert constraint is not None and constraint.name == kind
        assert all(request.constraint == constraint for request in seen[-1].requests())
    for args, said in ((["--regex", "[a-"], "--regex: regex: .*unclosed character class"),
                       (["--regex", "a", "--grammar", 'root ::= "a"'], "--grammar and --regex both constrain"),
                       (["--json-schema", '{"type": "integr"}'], r"--json-schema: .*\$\.type"),
                       (["--json-schema", f"@{tmp_path / 'missing.json'}"], "cannot read the file")):
        result = CliRunner().invoke(main, ["generate", "hi", *args])
        assert result.exit_code == 1 and re.search(said, result.output), result.output


def test_run_generate_refuses_check_tensors_for_running_stages() -> None:
    from skippy_zmq.driver.generate import GenerateOptions, run_generate
    from skippy_zmq.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^check_tensors applies to a local pipeline; the stages of t\.toml run "
                                          "already: start their workers with --check-tensors$"):
        run_generate(GenerateOptions(prompts=("hi",), topology_path="t.toml", check_tensors=True))


def test_plan_hosts_writes_a_topology_whose_stages_name_their_hosts(tiny_llama_path: Path, tmp_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig

    args = ["plan", "--model", str(tiny_llama_path), "--hosts", "10.0.0.1=1GiB,10.0.0.2=2g", "--lanes", "2",
            "--ctx-size", "256", "--driver-host", "gw.lan"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    path = tmp_path / "cluster.toml"
    path.write_text(done.stdout)
    topology = TopologyConfig.from_toml(path)
    assert [(s.host, s.max_memory) for s in topology.stages] == [("10.0.0.1", 1 << 30), ("10.0.0.2", 2 << 30)]
    assert topology.driver.host == "gw.lan" and topology.security.curve
    assert "# stage 1 on host 10.0.0.2: layers" in done.stdout
    plain = CliRunner().invoke(main, [*args, "--no-curve"])
    assert plain.exit_code == 0 and not TopologyConfig.from_toml_text(plain.stdout).security.curve
    tight = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--hosts", "10.0.0.1=8g,10.0.0.2=100m"])
    assert tight.exit_code == 1
    assert re.search(r"error: no cut of 4 layers into 2 stages fits the memory limits; the fastest cut's stage 1 "
                     r"\(layers \d\.\.4\) \+ head on host 10\.0\.0\.2 needs [\d.]+ MiB .* over its limit of 100 MiB",
                     tight.output), tight.output
    bad = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--hosts", "10.0.0.1"])
    assert bad.exit_code == 1 and "entry 1 '10.0.0.1' must be ADDRESS=MEMORY" in bad.output


def test_plan_stages_may_turn_curve_on(tiny_llama_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig

    done = CliRunner().invoke(main, ["plan", "--model", str(tiny_llama_path), "--stages", "2", "--curve"])
    assert done.exit_code == 0, done.output
    topology = TopologyConfig.from_toml_text(done.stdout)
    assert topology.security.curve and topology.stages[0].pull_bind.startswith("tcp://127.0.0.1:")


def _hosted_topology(tmp_path: Path, model: Path) -> Path:
    done = CliRunner().invoke(main, ["plan", "--model", str(model), "--hosts", "10.0.0.1=1g,10.0.0.2=1g,10.0.0.1=1g",
                                     "--lanes", "1", "--ctx-size", "64"])
    assert done.exit_code == 0, done.output
    path = tmp_path / "cluster.toml"
    path.write_text(done.stdout)
    return path


def test_up_host_supervises_only_that_hosts_stages(tmp_path: Path, tiny_llama_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from skippy_zmq.launch import processes
    from skippy_zmq.stage.worker import StopRequest

    topology = _hosted_topology(tmp_path, tiny_llama_path)
    started: list[list[str]] = []

    class Started(processes.LocalPipeline):
        """The real selection and memory check; no process is started, supervision ends at once."""

        def start(self, ready_timeout_s: float = 0.0) -> None:
            started.append([stage.stage_id for stage in self.stages])

        def supervise(self, *_args: object, **_kwargs: object) -> None:
            return None

    monkeypatch.setattr(processes, "LocalPipeline", Started)
    monkeypatch.setattr("skippy_zmq.cli._exit_on_sigterm", lambda: None)
    monkeypatch.setattr(StopRequest, "install", lambda self: None)
    for host, stages in (("10.0.0.1", ["stage-0", "stage-2"]), ("10.0.0.2", ["stage-1"])):
        done = CliRunner().invoke(main, ["up", "--topology", str(topology), "--host", host])
        assert done.exit_code == 0, done.output
        assert started[-1] == stages
    done = CliRunner().invoke(main, ["up", "--topology", str(topology), "--host", "10.0.0.3"])
    assert done.exit_code == 1 and len(started) == 2
    assert (f"error: {topology}: no stage runs on host '10.0.0.3'; the hosts of its stages are "
            "10.0.0.1 (stage-0, stage-2); 10.0.0.2 (stage-1)") in done.output



def test_keygen_bundles_says_what_went_where(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = _hosted_topology(tmp_path, tiny_llama_path)
    done = CliRunner().invoke(main, ["keygen", "--topology", str(topology), "--bundles", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    assert "stage-2: created (" in done.output
    bundles = [line for line in done.output.splitlines() if line.startswith("bundle ")]
    assert bundles == [
        f"bundle 10.0.0.1: {tmp_path / 'out' / '10.0.0.1'} (cluster.toml; 4 public keys; secrets: driver, stage-0, "
        "stage-2)",
        f"bundle 10.0.0.2: {tmp_path / 'out' / '10.0.0.2'} (cluster.toml; 4 public keys; secrets: stage-1)"]
    again = CliRunner().invoke(main, ["keygen", "--topology", str(topology), "--bundles", str(tmp_path / "out")])
    assert again.exit_code == 1 and "driver: kept (" in again.output
    assert f"error: {tmp_path / 'out' / '10.0.0.1'}: already exists; remove it" in again.output
