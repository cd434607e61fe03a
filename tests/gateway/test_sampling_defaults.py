"""Server-wide sampling defaults (`serve --seed --temp --top-k --top-p --min-p -n`): checked values, the
defaults of the fields a request leaves out on /completion and the /v1 routes, and what /props reports."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.reasoning import ReasoningFormat, Thinking
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.gateway.state import AttachedEngine, GatewayState
from tests.gateway.fakes import TOKENIZER, FakeEngine, render_chat
from tests.gateway.test_http import post, run_client
from tests.gateway.test_server import _options_of


def test_values_are_checked_with_the_flag_named() -> None:
    assert SamplingDefaults(seed=-1).seed is None  # llama-server's -1: random per request
    assert NO_DEFAULTS.given() == {} and NO_DEFAULTS.max_tokens() is None
    given = SamplingDefaults(seed=42, temperature=0.5, n_predict=7)
    assert given.given() == {"seed": 42, "temperature": 0.5, "n_predict": 7}
    assert given.over({"temperature": 1.0, "top_p": 1.0}) == {"temperature": 0.5, "top_p": 1.0, "seed": 42,
                                                               "n_predict": 7}
    assert (given.max_tokens(), SamplingDefaults(n_predict=-1).max_tokens()) == (7, None)
    for bad, match in (({"top_p": 1.5}, "--top-p 1.5 must be a number in"), ({"min_p": -0.1}, "--min-p"),
                       ({"temperature": float("nan")}, "--temp nan"), ({"seed": 2**64}, "--seed"),
                       ({"seed": -2}, "--seed -2"), ({"n_predict": -2}, "-n/--n-predict -2")):
        with pytest.raises(ConfigError, match=match):
            SamplingDefaults(**bad)


def test_the_serve_command_hands_them_on_as_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    code, options, output = _options_of(["--seed", "42", "--temp", "0.5", "--top-k", "5", "--top-p", "0.9",
                                         "--min-p", "0.1", "-n", "12"], {}, monkeypatch)
    assert code == 0, output
    assert options.sampling == SamplingDefaults(seed=42, temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, n_predict=12)
    code, options, output = _options_of([], {}, monkeypatch)
    assert (code, options.sampling) == (0, NO_DEFAULTS)
    code, options, output = _options_of(["--top-p", "2"], {}, monkeypatch)
    assert (code, options) == (1, None) and "--top-p 2.0 must be a number in [0, 1]" in output


def test_the_serve_command_hands_on_the_thought_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    code, options, output = _options_of(["--reasoning", "off", "--reasoning-format", "none",
                                         "--chat-template-kwargs", '{"reasoning_effort": "low"}'], {}, monkeypatch)
    assert code == 0, output
    assert options.sampling.thinking == Thinking(False, ReasoningFormat.NONE, (("reasoning_effort", "low"),))
    assert options.sampling.given() == {}  # thought settings are not sampling fields
    code, options, output = _options_of(["--chat-template-kwargs", '{"enable_thinking": 1}'], {}, monkeypatch)
    assert (code, options) == (1, None)
    assert "--chat-template-kwargs: chat_template_kwargs.enable_thinking must be true or false, got 1" in output


def _backend(engine: FakeEngine, sampling: SamplingDefaults) -> GatewayState:
    backend = GatewayState("/models/tiny-model.gguf", sampling=sampling)
    backend.attach(AttachedEngine(engine, TOKENIZER, render_chat))  # type: ignore[arg-type]
    return backend


def test_requests_leaving_fields_out_get_the_servers_defaults() -> None:
    engine = FakeEngine()
    sampling = SamplingDefaults(seed=42, temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, n_predict=3)

    async def scenario(client: TestClient[Any, Any]) -> None:
        props = await (await client.get("/props")).json()
        params = props["default_generation_settings"]["params"]
        assert (params["seed"], params["temperature"], params["top_k"], params["n_predict"]) == (42, 0.5, 5, 3)
        status, _, native = await post(client, "/completion", {"prompt": "x"})
        assert status == 200 and native["generation_settings"]["seed"] == 42
        assert (native["generation_settings"]["n_predict"], native["tokens_predicted"]) == (3, 3)
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            assert (await post(client, path, body))[0] == 200
        status, _, _ = await post(client, "/completion", {"prompt": "x", "seed": 7, "temperature": 0.0,
                                                          "n_predict": 2})
        assert status == 200

    run_client(_backend(engine, sampling), scenario)
    for request in [ticket.request for ticket in engine.submitted[:3]]:  # /completion, /v1/completions, chat: every route
        got = request.sampling
        assert (got.seed, got.temperature, got.top_k, got.top_p, got.min_p) == (42, 0.5, 5, pytest.approx(0.9),
                                                                                 pytest.approx(0.1))
        assert request.max_tokens == 3
    own = engine.submitted[3].request
    assert (own.sampling.seed, own.sampling.temperature, own.max_tokens) == (7, 0.0, 2)  # the request's own win


def test_without_server_defaults_each_route_keeps_its_own() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        props = await (await client.get("/props")).json()
        assert (props["default_generation_settings"]["params"]["seed"]) == -1
        assert (await post(client, "/completion", {"prompt": "x", "n_predict": 1}))[0] == 200
        assert (await post(client, "/v1/completions", {"prompt": "x"}))[0] == 200

    run_client(_backend(engine, NO_DEFAULTS), scenario)
    native, openai = (ticket.request for ticket in engine.submitted)
    assert (native.sampling.temperature, native.sampling.top_k) == (pytest.approx(0.8), 40)  # llama-server's
    assert (openai.sampling.temperature, openai.sampling.top_k, openai.max_tokens) == (1.0, 0, 16)  # OpenAI's


def test_the_request_api_applies_them_too() -> None:
    from skippy_zmq.gateway.zmq_requests import Submit, read_command

    command = read_command(1, b'{"v":1,"type":"completion","id":"r1","prompt":"Hi"}', SamplingDefaults(seed=42))
    assert isinstance(command, Submit) and command.params.seed == 42
