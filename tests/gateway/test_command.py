"""End-to-end tests of `skippy-zmq serve`: real gateway and stage processes on 127.0.0.1, the
official `openai` package as the client, every wait bounded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.conftest import TINY_GEMMA3_LAYERS
from tests.gateway.test_server import self_signed_cert
from tests.pipeline_helpers import PROMPTS, generate, running, write_topology

pytestmark = pytest.mark.slow

LANES = 4
CTX = 1024
MAX_TOKENS = 16
START_TIMEOUT_S = 60.0


class Gateway:
    """A `serve` subprocess (JSON logs on stderr, read by a thread) and its URL."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "skippy_zmq.gateway.command", *args, "--port", "0", "--log-json"]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.ssl_context: ssl.SSLContext | None = None  # trusts the server's certificate under HTTPS
        self.api_key: str | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        listening = self.wait_event("listening", 30)
        self.url: str = listening["url"]

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("component") == "gateway":
                    self.events.append(record)

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in list(self.events):
                if event["event"] == name:
                    return event
            if self.process.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {name!r} event within {timeout_s} s; output:\n{''.join(self.lines[-30:])}")

    def get(self, path: str) -> tuple[int, Any, dict[str, str]]:
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.ssl_context) as response:
                return response.status, _body(response.read()), dict(response.headers)
        except urllib.error.HTTPError as error:
            return error.code, _body(error.read()), dict(error.headers)
        except urllib.error.URLError as error:  # no answer at all: say what serve did meanwhile
            state = "running" if self.process.poll() is None else f"exited with {self.process.returncode}"
            raise AssertionError(f"GET {path}: {error.reason}; serve is {state}; its output:\n"
                                 f"{''.join(self.lines[-30:])}") from None

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.get("/health")[0] != 200:
            assert self.process.poll() is None, "".join(self.lines[-30:])
            assert time.monotonic() < deadline, f"/health not 200 within {timeout_s} s: {self.get('/health')}"
            time.sleep(0.1)

    def client(self, timeout_s: float = 30.0, api_key: str | None = None) -> openai.OpenAI:
        http_client = None if self.ssl_context is None else openai.DefaultHttpxClient(verify=self.ssl_context)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key or "unused", max_retries=0,
                             timeout=timeout_s, http_client=http_client)

    def stop(self, timeout_s: float = 40.0) -> int:
        """SIGTERM, then the exit status (SIGKILL if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"serve did not exit within {timeout_s} s after SIGTERM") from None
        finally:
            self._thread.join(5)


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode()


@contextlib.contextmanager
def serving(*args: str) -> Iterator[Gateway]:
    gateway = Gateway(*args)
    try:
        yield gateway
    finally:
        if gateway.process.poll() is None:
            gateway.stop()


def stage_sessions(urls: list[str]) -> list[float]:
    values = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        match = re.search(r"^skippy_stage_sessions\{[^}]*\} (\S+)$", text, re.M)
        values.append(float(match.group(1)) if match else 0.0)
    return values


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_path: Path) -> Iterator[tuple[LocalPipeline,
                                                                                                  list[str]]]:
    """Two stages of the tiny Gemma 3 with their metrics endpoints."""
    directory = tmp_path_factory.mktemp("serve")
    path = write_topology(directory, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=LANES, ctx_size=CTX)
    ports = free_tcp_ports(2)
    parts = path.read_text().split("[[stages]]")
    for index, port in enumerate(ports):
        parts[index + 1] += f'metrics_bind = "127.0.0.1:{port}"\n\n'
    path.write_text("[[stages]]".join(parts))
    with running(path) as local:
        yield local, [f"http://127.0.0.1:{port}/metrics" for port in ports]


@pytest.fixture(scope="module")
def references(pipeline: tuple[LocalPipeline, list[str]], tiny_gemma3_path: Path) -> dict[str, Any]:
    """Greedy results of `generate`'s driver on the same pipeline (before the gateway owns it)."""
    results = generate(pipeline[0], tiny_gemma3_path, PROMPTS, max_tokens=MAX_TOKENS)
    assert all(result.error is None for result in results)
    return dict(zip(PROMPTS, results, strict=True))


@pytest.fixture(scope="module")
def gateway(pipeline: tuple[LocalPipeline, list[str]], references: dict[str, Any]) -> Iterator[Gateway]:
    with serving("--topology", str(pipeline[0].topology_path), "--prefill-chunk", "4") as gateway:
        gateway.wait_healthy()
        yield gateway
        assert gateway.stop() == 0


def test_health_and_models(gateway: Gateway, tiny_gemma3_path: Path) -> None:
    status, body, _ = gateway.get("/health")
    assert (status, body["status"], body["silent_stages"]) == (200, "ok", [])
    models = gateway.client().models.list().data
    assert [model.id for model in models] == [tiny_gemma3_path.stem]
    assert models[0].model_dump()["context_length"] == CTX


def test_greedy_completions_equal_generate(gateway: Gateway, references: dict[str, Any]) -> None:
    client = gateway.client()
    for prompt, reference in references.items():
        out = client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == reference.text
        assert out.choices[0].finish_reason == ("length" if reference.finish_reason == "length" else "stop")
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
            len(reference.prompt_ids), len(reference.tokens)
        )


def test_stream_equals_whole_and_reports_usage(gateway: Gateway, references: dict[str, Any]) -> None:
    client = gateway.client()
    prompt = PROMPTS[1]
    stream = client.completions.create(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, model="tiny-gemma3")
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == references[prompt].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(references[prompt].tokens)


def test_chat_whole_and_streamed(gateway: Gateway) -> None:
    client = gateway.client()
    messages: Any = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(messages=messages, max_tokens=8, temperature=0, stream=True,
                                            model="tiny-gemma3")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_error_statuses(gateway: Gateway) -> None:
    client = gateway.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-gemma3", prompt="x", n=10_000)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model="tiny-gemma3", prompt=[5] * (CTX + 10))
    assert long_prompt.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="tiny-gemma3", prompt="x", max_tokens=CTX)
    assert (too_many.value.code, too_many.value.param) == ("context_length_exceeded", "max_tokens")
    assert client.completions.create(model="gpt-4o", prompt="x", max_tokens=1).model == "tiny-gemma3"


def test_concurrent_requests_beyond_the_lanes(gateway: Gateway, references: dict[str, Any]) -> None:
    client = gateway.client(timeout_s=60)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(3 * LANES)]

    def complete(prompt: str) -> str:
        out = client.completions.create(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, model="tiny-gemma3")
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(complete, prompts, timeout=90))
    assert texts == [references[prompt].text for prompt in prompts]


def test_streaming_clients_that_disconnect_free_their_lanes(
    gateway: Gateway, pipeline: tuple[LocalPipeline, list[str]], references: dict[str, Any]
) -> None:
    client = gateway.client()
    metrics_urls = pipeline[1]
    streams = [
        client.completions.create(prompt=PROMPTS[i], max_tokens=CTX - 20, temperature=0, stream=True,
                                  model="tiny-gemma3", extra_body={"ignore_eos": True})
        for i in range(LANES)
    ]
    for stream in streams:
        next(iter(stream))
    assert stage_sessions(metrics_urls) == [LANES, LANES]
    for stream in streams:
        stream.close()
    # generating the ~1000 tokens left would take seconds; a cancel frees the lanes within a step
    wait_for(lambda: stage_sessions(metrics_urls) == [0, 0], 2.0, "every stage's sessions freed")
    test_concurrent_requests_beyond_the_lanes(gateway, references)  # every lane serves again


def test_before_ready_health_and_requests_are_503(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    """A topology whose stages do not run: the gateway listens and says what it waits for."""
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=LANES, ctx_size=CTX)
    with serving("--topology", str(path), "--ready-timeout", "120") as gateway:
        deadline = time.monotonic() + 20
        while (health := gateway.get("/health"))[1]["status"] == "starting":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, body, _ = health
        assert (status, body["status"]) == (503, "waiting")
        labels = [stage.label for stage in TopologyConfig.from_toml(path).stages]
        assert body["silent_stages"] == labels and all(label in body["message"] for label in labels)
        with pytest.raises(openai.InternalServerError) as unavailable:
            gateway.client().completions.create(model="tiny-gemma3", prompt="x")
        assert unavailable.value.status_code == 503
        assert unavailable.value.response.headers["Retry-After"] == "5"
        assert gateway.stop() == 0


def test_local_pipeline_serve_queue_full_and_drain(tiny_gemma3_path: Path, references: dict[str, Any]) -> None:
    """`serve --model`: listens before the stages load, then serves; a full queue is a 429; SIGTERM
    lets the stream in flight finish and exits 0."""
    # --drain-timeout 300: the two 400-token streams finish on a busy host too (the drain, not its clock, is tested).
    with serving("--model", str(tiny_gemma3_path), "--stages", "2", "--lanes", "1", "--max-queue", "1",
                 "--ctx-size", str(CTX), "--prefill-chunk", "4", "--zmq-bind", "tcp://127.0.0.1:*",
                 "--drain-timeout", "300") as gateway:
        status, body, _ = gateway.get("/health")
        assert (status, body["status"]) == (503, "starting")
        gateway.wait_healthy()
        assert gateway.wait_event("zmq_listening", 5)["endpoint"].startswith("tcp://127.0.0.1:")
        client = gateway.client()
        prompt = PROMPTS[0]
        out = client.completions.create(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, model="tiny-gemma3")
        assert out.choices[0].text == references[prompt].text
        # one lane, one queue slot: a running stream, a waiting stream, then 429
        long_args: Any = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
                          "model": "tiny-gemma3", "extra_body": {"ignore_eos": True}}
        running_stream = client.completions.create(**long_args)
        first = next(iter(running_stream))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: "".join(c.choices[0].text for c in client.completions.create(**long_args)
                                                  if c.choices))
            wait_for(lambda: "skippy_gateway_queue_depth 1.0" in gateway.get("/metrics")[1], 10, "one waiting")
            with pytest.raises(openai.RateLimitError) as full:
                client.completions.create(prompt=prompt, max_tokens=4, model="tiny-gemma3")
            assert full.value.code == "queue_full"
            assert full.value.response.headers["Retry-After"] == "1"
            gateway.process.send_signal(signal.SIGTERM)  # drain: both streams finish
            rest = "".join(chunk.choices[0].text for chunk in running_stream if chunk.choices)
            assert len(first.choices[0].text + rest) > 0
            assert waiting.result(timeout=60)
        assert gateway.stop() == 0
        assert gateway.wait_event("stages_stopped", 1)["exit_codes"] == {"stage-0": 0, "stage-1": 0}


def test_tokenizer_matches_reference_prompt_ids(tiny_gemma3_path: Path, references: dict[str, Any]) -> None:
    tokenizer = Tokenizer.from_gguf(tiny_gemma3_path)
    for prompt, reference in references.items():
        assert tokenizer.encode(prompt) == reference.prompt_ids


def test_https_api_key_and_per_client_cap(tiny_gemma3_path: Path, references: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` over HTTPS with the key from SKIPPY_API_KEY: the openai client with the certificate and the
    key is served, a wrong key is refused, /health needs no key; a second request of the same client
    beyond --max-client-requests 1 is a 429."""
    cert, key = self_signed_cert(tmp_path, subprocess_ok=True)
    monkeypatch.setenv("SKIPPY_API_KEY", "sk-e2e-key")
    with serving("--model", str(tiny_gemma3_path), "--stages", "2", "--lanes", "2", "--ctx-size", str(CTX),
                 "--prefill-chunk", "4", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                 "--max-client-requests", "1") as gateway:
        assert gateway.url.startswith("https://127.0.0.1:")
        gateway.ssl_context = ssl.create_default_context(cafile=str(cert))
        gateway.wait_healthy()  # /health: no key needed
        status, body, headers = gateway.get("/v1/models")
        assert (status, body["error"]["code"], headers["WWW-Authenticate"]) == (401, None, "Bearer")
        gateway.api_key = "sk-e2e-key"
        client = gateway.client()
        assert [model.id for model in client.models.list().data] == [tiny_gemma3_path.stem]
        prompt = PROMPTS[0]
        out = client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == references[prompt].text
        with pytest.raises(openai.AuthenticationError) as wrong:
            gateway.client(api_key="sk-wrong").models.list()
        assert (wrong.value.status_code, wrong.value.code) == (401, "invalid_api_key")
        stream = client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as capped:
            client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=2)
        assert capped.value.code == "too_many_requests"
        assert capped.value.response.headers["Retry-After"] == "1"
        stream.close()
        wait_for(lambda: gateway.get("/metrics")[1].count("skippy_gateway_running_sessions 0.0") == 1, 10,
                 "the closed stream's lane freed")
        assert client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=2).usage is not None
        metrics = gateway.get("/metrics")[1]
        assert 'skippy_gateway_client_cap_refused_total{api="http"} 1.0' in metrics
        assert 'skippy_gateway_requests_total{route="/v1/models",status="401"} 2.0' in metrics
        assert gateway.stop() == 0
    assert "sk-e2e-key" not in "".join(gateway.lines)


def test_serve_on_a_curve_topology_serves_admitted_clients_and_survives_a_stage_restart(
    tmp_path: Path, tiny_gemma3_path: Path, references: dict[str, Any]
) -> None:
    """CURVE on every link: serve drives the stages with the driver's key, the request API
    admits the client in clients_dir, and a stage killed and restarted mid-stream (under a
    supervisor, as `up` runs it) costs no text: the stream completes equal to the reference."""
    import os

    from skippy_zmq import Client
    from skippy_zmq.errors import SkippyError
    from skippy_zmq.launch.supervisor import RestartPolicy
    from skippy_zmq.security.keys import KeyStore

    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=LANES, ctx_size=CTX,
                          curve=True)
    store = KeyStore.of(TopologyConfig.from_toml(path).security)
    _public, alice, _admitted = store.ensure_client("alice")
    zmq_port = free_tcp_ports(1)[0]
    pipeline = LocalPipeline(path)
    pipeline.start(60.0)
    stop = threading.Event()
    supervisor = threading.Thread(target=pipeline.supervise, args=(stop.is_set, RestartPolicy(silence_s=5.0)),
                                   kwargs={"poll_s": 0.1}, daemon=True)
    supervisor.start()
    try:
        with serving("--topology", str(path), "--prefill-chunk", "4", "--zmq-bind",
                     f"tcp://127.0.0.1:{zmq_port}") as gateway:
            gateway.wait_healthy()
            endpoint = f"tcp://127.0.0.1:{zmq_port}"
            with Client(endpoint, timeout_s=30.0, server_key=store.public_path("driver"),
                        client_keys=alice) as client:
                prompt = PROMPTS[0]
                want = references[prompt]
                got = client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                assert list(got.token_ids) == want.tokens
                old_pid = pipeline.processes[1].pid
                pieces: list[str] = []
                for delta in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                    pieces.append(delta.text)
                    if len(pieces) == 3:
                        os.kill(old_pid, signal.SIGKILL)
                assert "".join(pieces) == want.text
                # The stream may end before the supervisor has noticed the death: wait for the restart.
                wait_for(lambda: pipeline.processes[1].pid != old_pid, 60, "the supervisor restarts stage 1")
                # serve says so: one line naming the stage and its host, and a counter.
                back = gateway.wait_event("stage_back", 30)
                assert (back["stage"], back["stage_id"], back["host"], back["restarted"]) == (
                    1, "stage-1", "127.0.0.1", True)
                assert 'skippy_gateway_stage_restarts_total{host="127.0.0.1",index="1",stage="stage-1"} 1.0' in (
                    gateway.get("/metrics")[1])
            with Client(endpoint, timeout_s=1.0) as stranger, pytest.raises(SkippyError):
                stranger.complete(prompt, max_tokens=2)
            assert gateway.stop() == 0
    finally:
        stop.set()
        supervisor.join(10)
        pipeline.stop()


def _post_json(gateway: Gateway, path: str, body: Any) -> tuple[int, str]:
    request = urllib.request.Request(gateway.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_llama_server_routes_agree_with_generate(gateway: Gateway, references: dict[str, Any],
                                                 tiny_gemma3_path: Path) -> None:
    stop_types = {"length": "limit", "eos": "eos", "stop": "word"}
    for prompt, reference in references.items():
        status, text = _post_json(gateway, "/tokenize", {"content": prompt, "add_special": True})
        assert status == 200 and json.loads(text)["tokens"] == reference.prompt_ids
        status, text = _post_json(gateway, "/detokenize", {"tokens": json.loads(text)["tokens"][1:]})
        assert (status, json.loads(text)["content"]) == (200, prompt)
        body = {"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0}
        status, text = _post_json(gateway, "/completion", body)
        answer = json.loads(text)
        assert status == 200 and answer["content"] == reference.text
        assert (answer["tokens_predicted"], answer["tokens_evaluated"]) == (len(reference.tokens),
                                                                            len(reference.prompt_ids))
        assert answer["stop_type"] == stop_types[reference.finish_reason]
        assert answer["timings"]["predicted_n"] == len(reference.tokens) and answer["timings"]["predicted_ms"] > 0
        status, text = _post_json(gateway, "/completion", body | {"stream": True})
        events = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n") if block]
        assert "".join(event["content"] for event in events) == reference.text
        assert [event["stop"] for event in events].index(True) == len(events) - 1
    status, props, _ = gateway.get("/props")
    assert status == 200 and (props["default_generation_settings"]["n_ctx"], props["total_slots"]) == (CTX, LANES)
    assert props["model_alias"] == tiny_gemma3_path.stem


def test_logprobs_choices_and_embeddings_through_a_real_pipeline(gateway: Gateway, references: dict[str, Any],
                                                                  pipeline: tuple[LocalPipeline, list[str]]) -> None:
    """The openai client against real stages: greedy logprobs whose top alternative is the token,
    n choices that reproduce with a seed and compute the prompt once (the stages' token
    counters), and embeddings of unit length, the same whether sent alone or together."""
    import numpy as np

    client = gateway.client()
    prompt, reference = next(iter(references.items()))
    out = client.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    logprobs=2)
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == reference.text and logprobs is not None
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == len(reference.tokens)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and all(
        max(top.values()) == pytest.approx(lp) for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs,
                                                                  strict=True))

    def tokens_computed() -> list[float]:
        values = []
        for url in pipeline[1]:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            match = re.search(r"^skippy_stage_tokens_total\{[^}]*\} (\S+)$", text, re.M)
            values.append(float(match.group(1)) if match else 0.0)
        return values

    runs = []
    for _ in range(2):
        before = tokens_computed()
        chat = client.chat.completions.create(model="tiny-gemma3", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=6, n=3, seed=42, temperature=1.2)
        assert [choice.index for choice in chat.choices] == [0, 1, 2]
        assert chat.usage is not None and 3 <= chat.usage.completion_tokens <= 3 * 6  # summed over the choices
        # The choices' Stops have passed both stages (choices are never kept by the prompt cache; what
        # earlier requests left there stays).
        wait_for(lambda: len(set(stage_sessions(pipeline[1]))) == 1, 10, "the choices' lanes free")
        computed = [after - b for after, b in zip(tokens_computed(), before, strict=True)]
        prompt_tokens = chat.usage.prompt_tokens
        # the prompt once, then at most 5 decode steps per choice (its first token came with the fork)
        assert all(prompt_tokens <= c <= prompt_tokens + 3 * 5 for c in computed), (computed, prompt_tokens)
        runs.append([choice.message.content for choice in chat.choices])
    assert runs[0] == runs[1]

    together = client.embeddings.create(model="tiny-gemma3", input=[prompt, "another input"])
    alone = client.embeddings.create(model="tiny-gemma3", input=prompt, encoding_format="float")
    vectors = [np.array(item.embedding) for item in together.data]
    assert [item.index for item in together.data] == [0, 1]
    assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vectors)
    assert np.allclose(vectors[0], np.array(alone.data[0].embedding), atol=1e-5)


def _post(gateway: Gateway, path: str, body: dict[str, Any]) -> Any:
    status, text = _post_json(gateway, path, body)
    assert status == 200, (path, status, text)
    return json.loads(text)


def test_a_byte_level_bpe_file_serves_with_llama_cpps_tokens_pieces_and_stops(tmp_path: Path) -> None:
    # Llama 3's real vocabulary (llama.cpp's ggml-vocab-llama-bpe.gguf) on a small random llama, over
    # two stages: the ids, pieces and texts every route gives are llama.cpp's own.
    llama_cpp = pytest.importorskip("llama_cpp")
    from skippy_zmq.testing.random_model import SHAPES, write_random_model
    from tests.pipeline_helpers import family_tokenizer

    path = write_random_model(tmp_path / "llama3-bpe.gguf", SHAPES["llama3-mini"],
                              tokenizer=family_tokenizer("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct"), seed=3)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    prompt = "Grüße aus 東京 🦙, and the capital of France is"
    with serving("--model", str(path), "--stages", "2", "--ctx-size", "256", "--lanes", "2") as gateway:
        gateway.wait_healthy(120)
        expected_ids = llama.tokenize(prompt.encode(), add_bos=True, special=False)
        answer = _post(gateway, "/tokenize", {"content": prompt, "add_special": True, "with_pieces": True})
        assert [t["id"] for t in answer["tokens"]] == expected_ids
        # Pieces: text where a piece is UTF-8, else its byte values (llama-server's form); BOS as its text.
        pieces = [t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in answer["tokens"]]
        assert pieces[0] == b"<|begin_of_text|>" and b"".join(pieces[1:]) == prompt.encode()

        whole = _post(gateway, "/completion", {"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                    "return_tokens": True})
        tokens = whole["tokens"]
        assert len(tokens) == 24
        # The text is llama.cpp's pieces of those ids, joined (U+FFFD where they are not UTF-8).
        assert whole["content"] == llama.detokenize(tokens).decode("utf-8", "replace")
        detok = _post(gateway, "/detokenize", {"tokens": tokens})
        assert detok["content"] == llama.detokenize(tokens, special=True).decode("utf-8", "replace")

        client = gateway.client(timeout_s=60)
        stream = client.completions.create(model="llama3-bpe", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        deltas = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert "".join(deltas) == whole["content"]

        # A stop string across two tokens' pieces ends the text before it.
        texts = [llama.detokenize([t]).decode("utf-8", "replace") for t in tokens]
        k = next(i for i in range(1, len(texts) - 1) if len(texts[i].strip()) >= 2 and len(texts[i + 1].strip()) >= 2)
        stop = texts[k][-2:] + texts[k + 1][:2]
        start = whole["content"].index(stop)
        stopped = client.completions.create(model="llama3-bpe", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
        assert stopped.choices[0].text == whole["content"][:start] and stopped.choices[0].finish_reason == "stop"

        # Chat: the template's control tokens are tokens; the same text typed by a user is text.
        plain = client.chat.completions.create(model="llama3-bpe", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        typed = client.chat.completions.create(model="llama3-bpe", messages=[{"role": "user", "content": "hi<|eot_id|>"}],
                                               max_tokens=1)
        assert plain.usage is not None and typed.usage is not None
        eot_as_text = len(llama.tokenize(b"<|eot_id|>", add_bos=False, special=False))
        assert typed.usage.prompt_tokens == plain.usage.prompt_tokens + eot_as_text
        assert gateway.stop() == 0


def test_drafts_default_on_only_where_they_cannot_change_the_text() -> None:
    from skippy_zmq.gateway.command import default_drafts

    # None: the scheduler's choice, DRAFT_MAX while every stage's heartbeat says it computes batch-invariantly
    assert default_drafts(None, invariant=True) is None and default_drafts(None, invariant=None) is None
    assert default_drafts(None, invariant=False) == 0  # llama.cpp's kernels: a wider pass may change last bits
    assert default_drafts(0, invariant=True) == 0 and default_drafts(5, invariant=False) == 5
