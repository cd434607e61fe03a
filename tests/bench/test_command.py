"""The `bench` command group: option parsing, help, usage errors and exit codes, and small runs of `codecs` and
`step` through the command line, in this process."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from skippy_zmq.bench import codecs as bench_codecs
from skippy_zmq.bench.command import counts, shapes
from skippy_zmq.cli import main
from skippy_zmq.errors import BenchError

SUBCOMMANDS = ["serve", "step", "pipeline", "codecs", "products", "memory", "web"]


def bench(*args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `skippy-zmq bench ARGS`."""
    result = CliRunner().invoke(main, ["bench", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(("text", "expected"), [("1,8,16,32", (1, 8, 16, 32)), ("4", (4,)), (" 1, 2 ", (1, 2))])
def test_counts(text: str, expected: tuple[int, ...]) -> None:
    assert counts(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "'' holds no count; expected positive integers separated by commas, such as 1,8,16"),
    ("1,x", "'x' in '1,x' is not a positive integer; expected counts such as 1,8,16"),
    ("0,2", "'0' in '0,2' is not a positive integer"),
    ("1,,2", "'' in '1,,2' is not a positive integer"),
    ("-1", "'-1' in '-1' is not a positive integer"),
])
def test_bad_counts_are_named(text: str, message: str) -> None:
    with pytest.raises(BenchError) as caught:
        counts(text)
    assert message in str(caught.value)


def test_shapes_read_as_written() -> None:
    assert shapes("4096x4096, 4096x14336") == ((4096, 4096), (4096, 14336))


@pytest.mark.parametrize("text", ["4096", "4096x", "100x64", "0x64", "4096x-1", "axb", ""])
def test_a_bad_shape_is_named_with_the_form(text: str) -> None:
    with pytest.raises(BenchError, match=r"is not a shape; expected KxN with K a multiple of 256"):
        shapes(text)


def test_the_group_lists_every_benchmark() -> None:
    code, out, _ = bench("--help")
    assert code == 0
    assert all(name in out for name in SUBCOMMANDS)
    assert "bench" in CliRunner().invoke(main, ["--help"]).stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_benchmark_has_help_with_json_out(name: str) -> None:
    code, out, _ = bench(name, "--help")
    assert code == 0 and "Usage:" in out and "--json-out FILE" in out


@pytest.mark.parametrize(("args", "text"), [
    (["serve", "--clients", "1,x"], "Invalid value for '--clients': 'x' in '1,x' is not a positive integer"),
    (["serve", "--url", "http://h:1", "--serve-args", "--stages 2"], "--serve-args applies to the serve this command"),
    (["serve", "--tokens", "0"], "--tokens"),
    (["step", "--sessions", "0"], "Invalid value for '--sessions'"),
    (["step", "--layers", "3"], "--layers"),
    (["pipeline", "--stages", ""], "Invalid value for '--stages'"),
    (["codecs", "--sizes", "4KiB,lots"], "Invalid value for '--sizes': --sizes: 'lots' is not a memory size"),
    (["products", "--shapes", "4096x4096,100x8"], "Invalid value for '--shapes': '100x8' in '4096x4096,100x8' is "
                                                 "not a shape"),
    (["products", "--type", "Q5_K"], "Invalid value for '--type'"),
    (["products", "--rows", "0"], "Invalid value for '--rows'"),
    (["memory"], "give a serving command after --, or --stage"),
    (["memory", "--stage", "--", "srv"], "give a serving command after --, or --stage"),
    (["memory", "--", "srv", "--port", "1"], "--port: give the port COMMAND serves on"),
    (["web", "--url", "http://h:1"], "--url and --pid go together"),
    (["web", "--url", "http://h:1", "--pid", "1", "--serve-args", "--stages 3"], "--serve-args applies to the serve"),
    (["web", "--pages", "0"], "Invalid value for '--pages'"),
])
def test_usage_errors_exit_2_naming_the_option(args: list[str], text: str) -> None:
    code, _, err = bench(*args)
    assert code == 2 and text in err


def test_a_skippy_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    code, out, err = bench("step", "--model", str(tmp_path / "missing.gguf"))
    assert code == 1 and out == ""
    assert err.startswith("error: model file ") and "missing.gguf" in err


def test_signals_are_given_back_after_a_command(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    bench("step", "--model", str(tmp_path / "missing.gguf"))
    assert signal.getsignal(signal.SIGTERM) is before


def test_codecs_through_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_codecs, "MIN_BATCH_SECONDS", 0.001)
    out = tmp_path / "codecs.jsonl"
    code, stdout, stderr = bench("codecs", "--sizes", "4KiB", "--repeat", "1", "--json-out", str(out))
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("codecs: ") and lines[0].endswith("Z") and lines[1] == ""
    assert lines[2] == "| size | codec | op | GB/s | copyto GB/s | ratio to copyto |"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(lines) - 4 and all(row["size_bytes"] == 4096 for row in rows)
    assert "[bench] size 1/1: 4 KiB, best of 1" in stderr


def test_step_through_the_command_line(tiny_gemma3_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "step.jsonl"
    code, stdout, stderr = bench("step", "--model", str(tiny_gemma3_path), "--layers", "0", "2", "--sessions", "1,2",
                                 "--prompt", "2", "--steps", "2", "--threads", "1", "--no-repack", "--ctx-size", "16",
                                 "--json-out", str(out))
    assert code == 0, stderr
    assert stdout.splitlines()[2].startswith("| sessions | prompt ms |")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["sessions"], r["layers"], r["threads"], r["repack"]) for r in rows] == [(1, [0, 2], 1, False),
                                                                                      (2, [0, 2], 1, False)]
