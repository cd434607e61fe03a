"""llama.cpp's own test data, from the llama-cpp-python sdist the `model` extra builds: the
vocabulary-only GGUFs with their reference ids (`ggml-vocab-*.gguf`, `.inp`, `.out`), the real
chat templates (`models/templates/`) and llama-server's own test suite (`tools/server/tests/`).

The sdist of the installed llama-cpp-python version is fetched from PyPI once (`pip download`,
77 MB) and only its `vendor/llama.cpp/models/` and `vendor/llama.cpp/tools/server/tests/` folders
are kept, under the cache directory (`$SKIPPY_ZMQ_CACHE`, else `~/.cache/skippy-zmq`);
`$SKIPPY_ZMQ_LLAMA_MODELS` names an unpacked `models/` folder instead, and
`$SKIPPY_ZMQ_LLAMA_SERVER_TESTS` an unpacked `tools/server/tests/` folder.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

import attrs

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.catalog import cache_dir

MODELS_ENV = "SKIPPY_ZMQ_LLAMA_MODELS"
SERVER_TESTS_ENV = "SKIPPY_ZMQ_LLAMA_SERVER_TESTS"


@attrs.frozen
class SourceTree:
    """One folder of the sdist kept in the cache: where it is inside the sdist, its cache name, the
    path inside it that shows it is whole, and the variable naming an unpacked copy instead."""

    prefix: str  # inside the sdist's top folder, ending in "/"
    name: str  # the cache folder is f"{name}-{version}"
    marker: str
    env: str


MODELS = SourceTree("vendor/llama.cpp/models/", "llama.cpp-models", "templates", MODELS_ENV)
SERVER_TESTS = SourceTree("vendor/llama.cpp/tools/server/tests/", "llama.cpp-server-tests", "unit", SERVER_TESTS_ENV)
TREES = (MODELS, SERVER_TESTS)
"""Every folder kept: one download unpacks all that are missing."""
_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"  # between the texts of a .inp file
DOWNLOAD_TIMEOUT_S = 600.0


@attrs.frozen
class VocabCase:
    """One reference vocabulary: its GGUF, and the texts with llama.cpp's ids (add_special off,
    parse_special off) where the sources carry them."""

    name: str  # "llama-bpe", "qwen2", ...
    path: Path
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]

    @classmethod
    def read(cls, path: Path) -> VocabCase:
        """The case of `ggml-vocab-NAME.gguf`, with its `.inp`/`.out` pairs when present."""
        name = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        inp, out = path.with_name(path.name + ".inp"), path.with_name(path.name + ".out")
        if not (inp.is_file() and out.is_file()):
            return cls(name, path, (), ())
        # Bytes, not read_text: the texts keep their "\r\n"s. As llama.cpp's test reads it, a
        # separator at the very end opens no further text.
        raw = inp.read_bytes().decode("utf-8")
        texts = raw.removesuffix(_TEST_SEPARATOR).split(_TEST_SEPARATOR) if raw else []
        lines = out.read_bytes().decode("utf-8").split("\n")
        if len(lines) < len(texts):
            raise ModelLoadError(f"{out}: {len(lines)} lines for the {len(texts)} texts of {inp}")
        ids = tuple(tuple(int(word) for word in line.split()) for line in lines[: len(texts)])
        return cls(name, path, tuple(texts), ids)


def llama_models_dir() -> Path:
    """llama.cpp's `models/` folder (vocab files, templates), fetched once for this version."""
    return source_dir(MODELS)


def server_tests_dir() -> Path:
    """llama-server's test suite (`tools/server/tests/`: utils.py, conftest.py, unit/), fetched once
    for this version."""
    return source_dir(SERVER_TESTS)


def source_dir(tree: SourceTree) -> Path:
    """`tree`'s folder: the one its variable names, else the cache's, fetched with the sdist once."""
    given = os.environ.get(tree.env)
    if given:
        path = Path(given)
        if not (path / tree.marker).exists():
            folder = tree.prefix.removeprefix("vendor/llama.cpp/")
            raise ModelLoadError(f"${tree.env} is {given!r}; expected llama.cpp's {folder} folder with {tree.marker}/")
        return path
    version = metadata.version("llama-cpp-python")
    target = _cached(tree, version)
    if (target / tree.marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{tree.name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download however many test processes ask
        if not (target / tree.marker).exists():
            _fetch_trees(version, [t for t in TREES if not (_cached(t, version) / t.marker).exists()])
    return target


def _cached(tree: SourceTree, version: str) -> Path:
    return cache_dir() / f"{tree.name}-{version}"


def vocab_cases() -> list[VocabCase]:
    """Every `ggml-vocab-*.gguf` of the sources, by name."""
    return [VocabCase.read(p) for p in sorted(llama_models_dir().glob("ggml-vocab-*.gguf"))]


def template_files() -> list[Path]:
    """Every chat template (`models/templates/*.jinja`) of the sources, by name."""
    return sorted((llama_models_dir() / "templates").glob("*.jinja"))


def _fetch_trees(version: str, trees: list[SourceTree]) -> None:
    """Download the sdist of `version` and unpack each of `trees` into its cache folder."""
    with tempfile.TemporaryDirectory(prefix="llama-sdist-") as scratch:
        command = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                   "--no-binary", ":all:", "-d", scratch, "-q"]
        try:
            subprocess.run(command, check=True, timeout=DOWNLOAD_TIMEOUT_S, capture_output=True)
        except subprocess.TimeoutExpired:
            raise ModelLoadError(
                f"pip download of llama-cpp-python {version} took over {DOWNLOAD_TIMEOUT_S:.0f} s") from None
        except subprocess.CalledProcessError as exc:
            raise ModelLoadError(f"pip download of llama-cpp-python {version} failed: "
                                 f"{exc.stderr.decode(errors='replace')[-500:]}") from None
        archives = list(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
        if len(archives) != 1:
            raise ModelLoadError(f"pip download left {[a.name for a in archives]}; expected one sdist")
        for tree in trees:
            staging = Path(scratch) / tree.name
            _unpack(archives[0], tree.prefix, staging)
            if not (staging / tree.marker).exists():
                raise ModelLoadError(f"the llama-cpp-python {version} sdist has no {tree.prefix}{tree.marker}")
            shutil.move(str(staging), _cached(tree, version))


def _unpack(sdist: Path, prefix: str, staging: Path) -> None:
    """The files under `prefix` (inside the sdist's top folder) written below `staging`."""
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            _, _, inner = member.name.partition("/")
            if not (inner.startswith(prefix) and member.isfile()):
                continue
            relative = inner.removeprefix(prefix)
            if ".." in Path(relative).parts:
                continue
            source = archive.extractfile(member)
            if source is None:
                continue
            out = staging / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            with source, open(out, "wb") as sink:
                shutil.copyfileobj(source, sink)
