"""tools/llama_server_suite.py: the suite's server options mapped onto serve or refused by name, the
tables checked against the suite's own ServerProcess, outcomes recorded and compared, and (slow) one
suite file run against serve."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.tools import run_tool
from tools import llama_server_suite as suite

MODEL = Path("/models/m.gguf")


def _server(**options: Any) -> types.SimpleNamespace:
    """A stand-in for the suite's ServerProcess with its defaults (tinyllama2's model)."""
    defaults: dict[str, Any] = dict.fromkeys((*suite.SERVE_OPTIONS, *suite.SERVE_FLAGS, *suite.NO_EQUIVALENT,
                                              *suite.MODEL_SOURCES))
    defaults.update(server_host="127.0.0.1", server_port=8080, model_hf_repo="ggml-org/models", kv_unified=False)
    return types.SimpleNamespace(**{**defaults, **options})


def _after(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_serve_gets_the_options_that_have_an_equivalent() -> None:
    command = suite.serve_command(_server(n_ctx=512, n_slots=2, api_key="k", model_alias="tinyllama-2",
                                          pooling="last", ctk="f32"), MODEL)
    assert command[command.index("serve") + 1:][:4] == ["--model", str(MODEL), "--stages", "1"]
    assert _after(command, "--ctx-size") == "256"  # llama-server's context is shared by its slots
    assert _after(command, "--lanes") == "2" and _after(command, "--api-key") == "k"
    assert _after(command, "--alias") == "tinyllama-2" and _after(command, "--pooling") == "last"
    assert "--reranking" not in command and _after(command, "--tags") is None
    ranked = suite.serve_command(_server(server_reranking=True, model_tags="chat,fim"), MODEL)
    assert "--reranking" in ranked and _after(ranked, "--tags") == "chat,fim"
    assert "--no-ui" in suite.serve_command(_server(no_ui=True), MODEL) and "--no-ui" not in ranked
    assert _after(command, "--cache-type-k") == "f32" and _after(command, "--cache-type-v") is None
    unified = suite.serve_command(_server(n_ctx=512, n_slots=2, kv_unified=True), MODEL)
    assert _after(unified, "--ctx-size") == "512"
    sampled = suite.serve_command(_server(seed=42, temperature=0.8, n_predict=64, chat_template_file="t.jinja",
                                          jinja=True), MODEL)
    assert (_after(sampled, "--seed"), _after(sampled, "--temp"), _after(sampled, "--n-predict")) == ("42", "0.8", "64")
    assert _after(sampled, "--chat-template-file") == "t.jinja" and "--jinja" in sampled
    assert "--verbose" in suite.serve_command(_server(debug=True), MODEL) and "--verbose" not in sampled
    named = suite.serve_command(_server(chat_template="llama3"), MODEL)  # the suite's llama-server: --no-jinja
    assert _after(named, "--chat-template") == "llama3" and "--no-jinja" in named
    assert "--no-jinja" in suite.serve_command(_server(jinja=False), MODEL) and "--no-jinja" not in sampled
    assert _after(suite.serve_command(_server(server_host="127.0.0.1,::1"), MODEL), "--host") == "127.0.0.1,::1"


@pytest.mark.parametrize(("options", "named"), [
    ({"enable_ctx_shift": True}, "--context-shift"),
    ({"pooling": "cls"}, "--pooling cls"),
    ({"ctk": "q8_0"}, "--cache-type-k q8_0"),
    ({"model_hf_repo": None}, "router mode"),
])
def test_an_option_without_an_equivalent_skips_the_test_naming_it(options: dict[str, Any], named: str) -> None:
    with pytest.raises(pytest.skip.Exception, match=named):
        suite.serve_command(_server(**options), MODEL)


def test_every_option_the_tables_name_is_one_of_the_suites_server() -> None:
    from skippy_zmq.testing.llama_sources import server_tests_dir

    suite.stub_missing_modules()
    sys.path.insert(0, str(server_tests_dir()))
    try:
        import utils
    finally:
        sys.path.remove(str(server_tests_dir()))
    known = set(vars(utils.ServerProcess))
    named = {*suite.SERVE_OPTIONS, *suite.SERVE_FLAGS, *suite.NO_EQUIVALENT, *suite.MODEL_SOURCES}
    assert sorted(named - known) == []


def test_the_copy_finds_its_templates_and_its_tmp_folder_where_its_tests_look(tmp_path: Path) -> None:
    copied = suite.copy_suite(tmp_path)
    assert (copied / "unit" / "test_basic.py").is_file() and (copied / "tmp").is_dir()
    assert (copied / "../../../models/templates").is_dir()  # as test_template.py names them


def _report(when: str, outcome: str, message: str = "") -> types.SimpleNamespace:
    crash = types.SimpleNamespace(message=message)
    longrepr = ("f.py", 1, f"Skipped: {message}") if outcome == "skipped" else types.SimpleNamespace(reprcrash=crash)
    return types.SimpleNamespace(nodeid="unit/test_a.py::test_x", when=when, passed=outcome == "passed",
                                 skipped=outcome == "skipped", longrepr=longrepr)


def test_a_tests_worst_phase_is_its_outcome_with_a_one_line_reason() -> None:
    recorder = suite.Recorder(timeout_s=1.0)
    recorder.pytest_runtest_logreport(_report("setup", "passed"))
    recorder.pytest_runtest_logreport(_report("call", "failed", "assert 404 == 200\n  where 404 = status"))
    recorder.pytest_runtest_logreport(_report("teardown", "passed"))
    assert recorder.tests == {"unit/test_a.py::test_x": {"outcome": "failed",
                                                         "reason": "assert 404 == 200 where 404 = status"}}
    recorder.pytest_runtest_logreport(_report("teardown", "error", "server did not stop"))
    assert recorder.tests["unit/test_a.py::test_x"]["outcome"] == "error"
    skipped = suite.Recorder(timeout_s=1.0)
    skipped.pytest_runtest_logreport(_report("setup", "skipped", "serve has no equivalent of --lora"))
    assert skipped.tests["unit/test_a.py::test_x"] == {"outcome": "skipped",
                                                       "reason": "serve has no equivalent of --lora"}


def test_the_comparison_lists_what_the_reference_passes_and_the_candidate_does_not() -> None:
    reference = {"target": "llama-server", "tests": {
        "unit/test_a.py::test_x": {"outcome": "passed", "reason": ""},
        "unit/test_a.py::test_y": {"outcome": "passed", "reason": ""},
        "unit/test_b.py::test_z": {"outcome": "failed", "reason": "text"}}}
    candidate = {"target": "serve", "tests": {
        "unit/test_a.py::test_x": {"outcome": "passed", "reason": ""},
        "unit/test_a.py::test_y": {"outcome": "failed", "reason": "assert 404 == 200"},
        "unit/test_b.py::test_z": {"outcome": "failed", "reason": "text"}}}
    text = suite.render_comparison(reference, candidate)
    assert "unit/test_a.py" in text and "P2 F0 S0 E0" in text and "P1 F1 S0 E0" in text
    assert "1 tests llama-server passes and serve does not:" in text
    assert text.endswith("failed   unit/test_a.py::test_y: assert 404 == 200")


@pytest.mark.slow
def test_one_suite_file_runs_against_serve(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    done = run_tool("llama_server_suite", "--target", "serve", "--out", str(out), "--log-dir", str(tmp_path / "run"),
                    "--", "unit/test_tokenize.py", "-q", "-k", "test_tokenize_detokenize", timeout_s=300)
    assert done.returncode == 0, done.stderr + done.stdout
    tests = json.loads(out.read_text())["tests"]
    assert tests == {"unit/test_tokenize.py::test_tokenize_detokenize": {"outcome": "passed", "reason": ""}}
    assert "unit/test_tokenize.py" in done.stdout
