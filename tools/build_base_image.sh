#!/usr/bin/env bash
# The base image for the Dockerfile where `python:3.11-slim` cannot be pulled.
#
# The Dockerfile starts from the build argument BASE (default python:3.11-slim), and
# docker-compose.yml passes ${SKIPPY_BASE_IMAGE} as BASE. This tool decides what that is:
#
#   1. python:3.11-slim, when the engine has it or can pull it: nothing is built.
#   2. Otherwise an equivalent image made here from Debian's packages: Debian 12 (bookworm),
#      whose python3 is 3.11, bootstrapped with mmdebstrap (variant minbase, no docs, man
#      pages or locales, no apt lists) and loaded with `docker import`. It has python3 with
#      venv and pip, `python` as python3 (python-is-python3), and groupadd/useradd, which is
#      what the Dockerfile uses of python:3.11-slim.
#
# Then, with --wheelhouse auto (the default), it asks a container of that base whether it
# reaches the package index (https://pypi.org/simple/, certificate verified). If not, it
# makes a wheelhouse on the host with `pip wheel` (the package's dependencies, its [model]
# extra and its build requirements; not the package itself) in <context>/build/wheelhouse,
# which the Dockerfile installs from with --no-index when that folder holds wheels.
#
# The last line printed is SKIPPY_BASE_IMAGE=<image>, to export before `docker-compose up
# --build` (docs/DEPLOY.md). Needs a running Docker engine; building needs root and
# mmdebstrap (`apt-get install mmdebstrap`; $MMDEBSTRAP names another one), the wheelhouse a
# host python3.11 with pip.
set -euo pipefail

REGISTRY_IMAGE=python:3.11-slim
# -2: the package list gained libgomp1 (ggml), so an older base is not reused.
TAG=skippy-zmq-base:3.11-bookworm-2
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security
CONTEXT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELHOUSE=auto
FORCE=0
PULL=1
PACKAGES=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,libgomp1  # libgomp1: ggml's OpenMP threads
MMDEBSTRAP="${MMDEBSTRAP:-mmdebstrap}"

usage() {
    cat <<EOF
usage: $0 [options]
  --tag TAG               the image to build (default $TAG)
  --registry-image IMG    the image to use instead when present or pullable (default $REGISTRY_IMAGE)
  --no-pull               do not try to pull the registry image
  --force                 build even if the registry image or TAG is already there
  --mirror URL            Debian mirror (default $MIRROR)
  --security-mirror URL   Debian security mirror (default $SECURITY_MIRROR)
  --context DIR           the build context, a checkout (default $CONTEXT)
  --wheelhouse auto|yes|no
                          make DIR/build/wheelhouse: when a container cannot reach the index
                          (auto, the default), always (yes), or never (no)
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG="$2"; shift 2 ;;
        --registry-image) REGISTRY_IMAGE="$2"; shift 2 ;;
        --no-pull) PULL=0; shift ;;
        --force) FORCE=1; shift ;;
        --mirror) MIRROR="$2"; shift 2 ;;
        --security-mirror) SECURITY_MIRROR="$2"; shift 2 ;;
        --context) CONTEXT="$(cd "$2" && pwd)"; shift 2 ;;
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build_base_image: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$WHEELHOUSE" in auto|yes|no) ;; *) echo "build_base_image: --wheelhouse is auto, yes or no" >&2; exit 2 ;; esac

say() { echo "build_base_image: $*" >&2; }
fail() { say "$*"; exit 1; }

docker info >/dev/null 2>&1 || fail "no Docker engine answers (docker info failed): start dockerd first"
[ -f "$CONTEXT/pyproject.toml" ] || fail "$CONTEXT is not a checkout (no pyproject.toml)"

# ---- 1. the base image ---------------------------------------------------------------------

have() { docker image inspect "$1" >/dev/null 2>&1; }

BASE=""
if [ "$FORCE" = 0 ]; then
    if have "$REGISTRY_IMAGE"; then
        BASE="$REGISTRY_IMAGE"
        say "using $REGISTRY_IMAGE, which the engine has"
    elif [ "$PULL" = 1 ] && pulled="$(timeout 300 docker pull "$REGISTRY_IMAGE" 2>&1)"; then
        BASE="$REGISTRY_IMAGE"
        say "pulled $REGISTRY_IMAGE"
    else
        [ "$PULL" = 1 ] && say "cannot pull $REGISTRY_IMAGE: $(printf '%s' "$pulled" | tail -n 1)"
        if have "$TAG"; then
            BASE="$TAG"
            say "using $TAG, built before (--force builds it again)"
        fi
    fi
fi

if [ -z "$BASE" ]; then
    [ "$(id -u)" = 0 ] || fail "building $TAG needs root (mmdebstrap creates device nodes and file owners)"
    command -v "$MMDEBSTRAP" >/dev/null 2>&1 || fail "$MMDEBSTRAP is not installed: apt-get install mmdebstrap"
    work="$(mktemp -d "${TMPDIR:-/tmp}/skippy-base.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    say "bootstrapping Debian $SUITE from $MIRROR with $PACKAGES"
    started=$(date +%s)
    # merged-usr hook: /bin, /lib, /sbin as links into /usr without installing usrmerge
    # (and the perl it pulls in). The dpkg excludes are those of Debian's slim images.
    "$MMDEBSTRAP" --variant=minbase --include="$PACKAGES" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/lintian/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log "$1"/var/cache/ldconfig/aux-cache' \
        --customize-hook='chroot "$1" python3 -c "import ssl, sys, venv; assert sys.version_info[:2] == (3, 11), sys.version"' \
        "$SUITE" "$work/rootfs.tar" \
        "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main" \
        >"$work/mmdebstrap.log" 2>&1 || { tail -n 20 "$work/mmdebstrap.log" >&2; fail "mmdebstrap failed (above: the end of its log)"; }
    # What `docker import` cannot take from a tarball: the environment and the command.
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        --message "tools/build_base_image.sh: Debian $SUITE minbase + $PACKAGES" \
        "$work/rootfs.tar" "$TAG" >/dev/null
    say "built $TAG in $(( $(date +%s) - started )) s: $(docker run --rm "$TAG" python --version 2>&1)," \
        "$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
    BASE="$TAG"
fi

# ---- 2. the wheelhouse ---------------------------------------------------------------------

wheels="$CONTEXT/build/wheelhouse"
if [ "$WHEELHOUSE" = auto ]; then
    probe='import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20)'
    if reason="$(docker run --rm "$BASE" python3 -c "$probe" 2>&1)"; then
        WHEELHOUSE=no
        say "a container of $BASE reaches the package index: no wheelhouse"
    else
        WHEELHOUSE=yes
        say "a container of $BASE cannot use the package index: $(printf '%s' "$reason" | tail -n 1)"
    fi
fi

if [ "$WHEELHOUSE" = yes ]; then
    host_python=""
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            host_python="$candidate"
            break
        fi
    done
    [ -n "$host_python" ] || fail "the wheelhouse needs a host CPython 3.11 (the image's python) with pip; none found"
    # The requirements, read from pyproject.toml: dependencies, the [model] extra, and the
    # build system's (pip builds the package itself from the context, in isolation).
    mapfile -t requirements < <("$host_python" - "$CONTEXT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
for requirement in (project["build-system"]["requires"] + project["project"]["dependencies"]
                    + project["project"]["optional-dependencies"]["model"]):
    print(requirement)
EOF
)
    rm -rf "$wheels"
    mkdir -p "$wheels"
    say "making $wheels with $host_python -m pip wheel (${#requirements[@]} requirements)"
    started=$(date +%s)
    "$host_python" -m pip wheel --wheel-dir "$wheels" "${requirements[@]}" >"$wheels.log" 2>&1 \
        || { tail -n 20 "$wheels.log" >&2; fail "pip wheel failed (above: the end of $wheels.log)"; }
    say "wheelhouse: $(find "$wheels" -name '*.whl' | wc -l) wheels, $(du -sm "$wheels" | cut -f1) MiB," \
        "in $(( $(date +%s) - started )) s"
elif [ -d "$wheels" ]; then
    say "note: $wheels exists, and the build installs from it; remove it to use the index"
fi

echo "SKIPPY_BASE_IMAGE=$BASE"
