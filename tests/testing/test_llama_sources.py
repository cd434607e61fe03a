"""llama.cpp's test data: the reference-id files parse, the env variable is checked, and the
fetched sources hold the vocabularies and templates the tokenizer and chat tests use, and
llama-server's test suite (tools/llama_server_suite.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.testing.llama_sources import (
    MODELS_ENV,
    SERVER_TESTS_ENV,
    VocabCase,
    llama_models_dir,
    server_tests_dir,
    template_files,
    vocab_cases,
)


def test_a_case_pairs_each_text_with_its_ids(tmp_path: Path) -> None:
    path = tmp_path / "ggml-vocab-demo.gguf"
    path.write_bytes(b"")
    (tmp_path / "ggml-vocab-demo.gguf.inp").write_bytes(
        b"a b\n__ggml_vocab_test__\n\n__ggml_vocab_test__\n\r\n\n__ggml_vocab_test__\n")
    (tmp_path / "ggml-vocab-demo.gguf.out").write_text(" 1 2\n\n 7 7\n", encoding="utf-8")
    case = VocabCase.read(path)
    assert case.name == "demo"
    assert case.texts == ("a b", "", "\r\n")
    assert case.ids == ((1, 2), (), (7, 7))


def test_a_case_without_reference_files_has_no_texts(tmp_path: Path) -> None:
    path = tmp_path / "ggml-vocab-bare.gguf"
    path.write_bytes(b"")
    assert VocabCase.read(path) == VocabCase("bare", path, (), ())


def test_fewer_ids_than_texts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ggml-vocab-short.gguf"
    (tmp_path / "ggml-vocab-short.gguf.inp").write_text("a\n__ggml_vocab_test__\nb", encoding="utf-8")
    (tmp_path / "ggml-vocab-short.gguf.out").write_text(" 1", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="1 lines for the 2 texts"):
        VocabCase.read(path)


def test_the_env_variable_must_name_a_models_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODELS_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="templates/"):
        llama_models_dir()


def test_the_env_variable_must_name_a_server_tests_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVER_TESTS_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="tools/server/tests/ folder with unit/"):
        server_tests_dir()
    (tmp_path / "unit").mkdir()
    assert server_tests_dir() == tmp_path


def test_the_sources_hold_the_reference_vocabularies_and_templates() -> None:
    names = {case.name for case in vocab_cases()}
    assert {"llama-bpe", "qwen2", "llama-spm", "phi-3", "gpt-2", "command-r", "deepseek-llm"} <= names
    with_ids = [case for case in vocab_cases() if case.texts]
    assert len(with_ids) >= 15
    assert all(len(case.texts) == len(case.ids) for case in with_ids)
    assert len(template_files()) >= 60


def test_the_sources_hold_llama_servers_test_suite() -> None:
    suite = server_tests_dir()
    assert (suite / "utils.py").is_file() and (suite / "conftest.py").is_file()
    assert {"test_basic.py", "test_chat_completion.py", "test_completion.py"} <= {p.name for p in (suite / "unit").iterdir()}
