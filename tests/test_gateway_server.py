"""In-process tests of `serve`'s lifecycle (skippy_zmq.gateway.server and .cli): no stage runs,
so the gateway listens, reports what it waits for, and stops cleanly."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.cli import serve
from skippy_zmq.gateway.server import GatewayServer, ServeLog, ServeOptions

from .conftest import TINY_GEMMA3_LAYERS
from .pipeline_helpers import write_topology


def run_server(options: ServeOptions, scenario: Any) -> tuple[int, str]:
    """Run the server with `scenario(server, session)` against it; its exit status and log."""
    stream = io.StringIO()

    async def main() -> int:
        server = GatewayServer(options, ServeLog(json_lines=True, stream=stream))
        task = asyncio.create_task(server.run())
        while not server.url:
            assert not task.done(), stream.getvalue()
            await asyncio.sleep(0.01)
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(scenario(server, session), 20)
        finally:
            server.request_stop()
        return await asyncio.wait_for(task, 30)

    return asyncio.run(main()), stream.getvalue()


def events(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines()]


def test_topology_without_stages_waits_then_stops_cleanly(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    labels = [stage.label for stage in TopologyConfig.from_toml(path).stages]
    options = ServeOptions(topology_path=str(path), port=0, ready_timeout_s=60, drain_timeout_s=1)

    async def scenario(server: GatewayServer, session: aiohttp.ClientSession) -> None:
        while True:
            async with session.get(server.url + "/health") as response:
                body = await response.json()
                assert response.status == 503
            if body["status"] == "waiting":
                break
            assert body["status"] == "starting" and body["message"].startswith("starting: ")
            await asyncio.sleep(0.02)
        assert body["silent_stages"] == labels
        async with session.post(server.url + "/v1/completions", json={"prompt": "x"}) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "5"
            assert (await response.json())["error"]["code"] == "pipeline_unavailable"
        async with session.get(server.url + "/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == "tiny-gemma3"

    code, log = run_server(options, scenario)
    assert code == 0
    names = [event["event"] for event in events(log)]
    assert names[0] == "listening"
    assert names[-2:] == ["draining", "stopped"]


def test_ready_timeout_ends_the_server_with_status_1(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    options = ServeOptions(topology_path=str(path), port=0, ready_timeout_s=0.3)

    async def scenario(server: GatewayServer, session: aiohttp.ClientSession) -> None:
        while not server.backend.draining:
            await asyncio.sleep(0.02)

    code, log = run_server(options, scenario)
    assert code == 1
    fatal = [event for event in events(log) if event["event"] == "fatal"]
    assert "not ready after --ready-timeout 0.3 s" in fatal[0]["error"]


def test_busy_port_is_a_config_error(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        options = ServeOptions(topology_path=str(path), port=busy.getsockname()[1])
        server = GatewayServer(options, ServeLog(json_lines=True, stream=io.StringIO()))
        with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1:"):
            asyncio.run(server.run())


def test_log_lines_for_people_and_machines() -> None:
    human = io.StringIO()
    ServeLog(json_lines=False, stream=human).event("ready", "ready: serving m", model="m")
    assert human.getvalue() == "[skippy-zmq] ready: serving m\n"
    machine = io.StringIO()
    ServeLog(json_lines=True, stream=machine).event("ready", "ready: serving m", model="m")
    record = json.loads(machine.getvalue())
    assert (record["component"], record["event"], record["message"], record["model"]) == (
        "gateway", "ready", "ready: serving m", "m"
    )


@pytest.mark.parametrize(("args", "message"), [
    (["--topology", "t.toml", "--model", "m.gguf"], "--model applies to a local pipeline"),
    (["--codec", "nope"], "Invalid value"),
    (["--lanes", "0"], "Invalid value for '--lanes'"),
    (["--port", "70000"], "Invalid value for '--port'"),
])
def test_cli_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(serve, args)
    assert result.exit_code == 2
    assert message in result.output


def test_cli_help_lists_every_option() -> None:
    text = CliRunner().invoke(serve, ["--help"]).output
    for option in ("--topology", "--model", "--stages", "--lanes", "--ctx-size", "--codec", "--codec-policy",
                   "--host", "--port", "--zmq-bind", "--max-queue", "--request-timeout", "--ready-timeout",
                   "--micro-batches", "--drain-timeout", "--prefill-chunk", "--verbose", "--log-json"):
        assert option in text
