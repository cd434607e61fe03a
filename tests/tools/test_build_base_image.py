"""tools/build_base_image.sh against stand-ins for docker, mmdebstrap and pip: the base image it picks
or builds, the wheelhouse it makes (README.md, "Docker"; the image's build is tests/test_deploy.py's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_deploy import BASE_TAG, BASE_TOOL, REPO

_FAKE_DOCKER = r"""#!/usr/bin/env bash
# docker as the tool sees it: images in $FAKE_IMAGES, a pull that fails unless FAKE_PULL=ok,
# an index that containers reach unless FAKE_INDEX=no. Every call goes to $FAKE_LOG.
echo "docker $*" >> "$FAKE_LOG"
case "$1" in
    info) exit "${FAKE_INFO:-0}" ;;
    image)
        name="${@: -1}"
        for image in $FAKE_IMAGES; do
            if [ "$image" = "$name" ]; then [ "$3" = -f ] && echo 146000000; exit 0; fi
        done
        echo "Error: No such image: $name" >&2; exit 1 ;;
    pull)
        [ "${FAKE_PULL:-fail}" = ok ] && exit 0
        echo 'Error response from daemon: Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io on 10.255.255.53:53: no such host' >&2
        exit 1 ;;
    import) echo "FAKE_IMAGES=\"$FAKE_IMAGES ${@: -1}\"" >> "$FAKE_STATE"; echo sha256:0 ;;
    run)
        case "$*" in *--version*) echo "Python 3.11.2"; exit 0 ;; esac
        [ "${FAKE_INDEX:-yes}" = yes ] && exit 0
        echo "urllib.error.URLError: <urlopen error [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed>" >&2
        exit 1 ;;
esac
"""

_FAKE_MMDEBSTRAP = r"""#!/usr/bin/env bash
# Records its arguments and writes an empty tarball where the rootfs would go.
printf '%s\n' "$@" > "$FAKE_LOG.mmdebstrap"
for arg in "$@"; do case "$arg" in *.tar) : > "$arg" ;; esac; done
"""

_FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3.11 for the wheelhouse: `-m pip wheel` records its arguments and leaves one wheel;
# anything else is the real interpreter's.
if [ "$1" = -m ] && [ "$2" = pip ]; then
    printf '%s\n' "$@" > "$FAKE_LOG.pip"
    while [ $# -gt 0 ]; do [ "$1" = --wheel-dir ] && { touch "$2/numpy-2.0-cp311-cp311-linux_x86_64.whl"; }; shift; done
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.fixture
def fake_tools(tmp_path: Path) -> dict[str, str]:
    """A PATH whose docker and python3.11 are the stand-ins above, and an mmdebstrap to name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("docker", _FAKE_DOCKER), ("mmdebstrap", _FAKE_MMDEBSTRAP), ("python3.11", _FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(tmp_path / "docker.log"),
            "FAKE_STATE": str(tmp_path / "state"), "MMDEBSTRAP": str(bin_dir / "mmdebstrap"),
            "REAL_PYTHON": sys.executable, "TMPDIR": str(tmp_path)}


def _tool(env: dict[str, str], *args: str, context: Path = REPO) -> subprocess.CompletedProcess[str]:
    state = Path(env["FAKE_STATE"]) if "FAKE_STATE" in env else None
    extra = {}
    if state is not None and state.exists():  # images the stand-in imported on an earlier call
        for line in state.read_text().splitlines():
            extra["FAKE_IMAGES"] = line.split("=", 1)[1].strip('"')
    return subprocess.run(["bash", str(BASE_TOOL), "--context", str(context), *args],
                          env={"HOME": os.environ.get("HOME", "/root"), **env, **extra},
                          capture_output=True, text=True, timeout=120, check=False)


def _calls(env: dict[str, str]) -> list[str]:
    log = Path(env["FAKE_LOG"])
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow
def test_base_tool_usage_and_bad_arguments() -> None:
    done = subprocess.run(["bash", str(BASE_TOOL), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and "--wheelhouse auto|yes|no" in done.stdout
    done = subprocess.run(["bash", str(BASE_TOOL), "--bogus"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr
    done = subprocess.run(["bash", str(BASE_TOOL), "--wheelhouse", "maybe"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 2


@pytest.mark.slow
def test_base_tool_needs_an_engine(fake_tools: dict[str, str]) -> None:
    done = _tool(fake_tools | {"FAKE_INFO": "1"})
    assert done.returncode == 1
    assert "no Docker engine answers (docker info failed): start dockerd first" in done.stderr


@pytest.mark.slow
def test_base_tool_uses_the_registry_image_when_the_engine_has_it(fake_tools: dict[str, str], tmp_path: Path) -> None:
    done = _tool(fake_tools | {"FAKE_IMAGES": "python:3.11-slim"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "SKIPPY_BASE_IMAGE=python:3.11-slim"
    calls = _calls(fake_tools)
    assert not any(c.startswith(("docker pull", "docker import")) for c in calls), calls
    assert not Path(fake_tools["FAKE_LOG"] + ".mmdebstrap").exists()
    assert "reaches the package index: no wheelhouse" in done.stderr


@pytest.mark.slow
def test_base_tool_uses_a_pulled_registry_image(fake_tools: dict[str, str]) -> None:
    done = _tool(fake_tools | {"FAKE_PULL": "ok"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "SKIPPY_BASE_IMAGE=python:3.11-slim"
    assert "docker pull python:3.11-slim" in _calls(fake_tools)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the tool builds as root only")
def test_base_tool_builds_debian_bookworm_where_the_pull_fails_then_reuses_it(fake_tools: dict[str, str]) -> None:
    done = _tool(fake_tools)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"SKIPPY_BASE_IMAGE={BASE_TAG}"
    assert "cannot pull python:3.11-slim: Error response from daemon" in done.stderr
    args = Path(fake_tools["FAKE_LOG"] + ".mmdebstrap").read_text().splitlines()
    assert "--variant=minbase" in args
    assert "--include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,libgomp1" in args
    assert "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr" in args
    suite = args.index("bookworm")
    assert args[suite + 1].endswith("/rootfs.tar")
    assert args[suite + 2:] == ["deb http://deb.debian.org/debian bookworm main",
                                "deb http://deb.debian.org/debian bookworm-updates main",
                                "deb http://deb.debian.org/debian-security bookworm-security main"]
    imports = [c for c in _calls(fake_tools) if c.startswith("docker import")]
    assert len(imports) == 1 and imports[0].endswith(f"/rootfs.tar {BASE_TAG}"), imports
    for change in ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   'CMD ["python3"]'):
        assert f"--change {change}" in imports[0]
    assert not list(Path(fake_tools["TMPDIR"]).glob("skippy-base.*")), "the rootfs tarball is left behind"
    # Again: the image built before is used, and nothing is built.
    Path(fake_tools["FAKE_LOG"] + ".mmdebstrap").unlink()
    done = _tool(fake_tools)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == f"SKIPPY_BASE_IMAGE={BASE_TAG}"
    assert f"using {BASE_TAG}, built before" in done.stderr
    assert not Path(fake_tools["FAKE_LOG"] + ".mmdebstrap").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the tool builds as root only")
def test_base_tool_says_when_mmdebstrap_is_missing(fake_tools: dict[str, str]) -> None:
    done = _tool(fake_tools | {"MMDEBSTRAP": "/nonexistent/mmdebstrap"})
    assert done.returncode == 1
    assert "/nonexistent/mmdebstrap is not installed: apt-get install mmdebstrap" in done.stderr


@pytest.mark.slow
def test_base_tool_makes_a_wheelhouse_where_containers_cannot_use_the_index(
    fake_tools: dict[str, str], tmp_path: Path
) -> None:
    context = tmp_path / "checkout"
    context.mkdir()
    shutil.copy(REPO / "pyproject.toml", context / "pyproject.toml")
    stale = context / "build" / "wheelhouse" / "old-1.0-py3-none-any.whl"
    stale.parent.mkdir(parents=True)
    stale.touch()
    done = _tool(fake_tools | {"FAKE_IMAGES": "python:3.11-slim", "FAKE_INDEX": "no"}, context=context)
    assert done.returncode == 0, done.stderr
    assert "cannot use the package index: urllib.error.URLError" in done.stderr
    args = Path(fake_tools["FAKE_LOG"] + ".pip").read_text().splitlines()
    assert args[:5] == ["-m", "pip", "wheel", "--wheel-dir", str(context / "build" / "wheelhouse")]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert args[5:] == [*project["build-system"]["requires"], *project["project"]["dependencies"],
                        *project["project"]["optional-dependencies"]["model"]]
    assert not any(a.startswith((".", "skippy")) for a in args[5:]), "the package itself is built from the context"
    assert sorted(p.name for p in (context / "build" / "wheelhouse").iterdir()) == [
        "numpy-2.0-cp311-cp311-linux_x86_64.whl"], "the wheelhouse is made anew"
    assert done.stdout.splitlines()[-1] == "SKIPPY_BASE_IMAGE=python:3.11-slim"
    # --wheelhouse no: none made, and an existing one is pointed out.
    done = _tool(fake_tools | {"FAKE_IMAGES": "python:3.11-slim", "FAKE_INDEX": "no"}, "--wheelhouse", "no",
                 context=context)
    assert done.returncode == 0 and "build/wheelhouse exists, and the build installs from it" in done.stderr
