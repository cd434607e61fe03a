"""In-process tests of `serve`'s lifecycle (skippy_zmq.gateway.server and .cli): no stage runs,
so the gateway listens, reports what it waits for, and stops cleanly."""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.watch import FIRST_SAY_S, StageEvent, StagePlace
from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway import server as server_module
from skippy_zmq.gateway.command import serve
from skippy_zmq.gateway.options import ServeLog, ServeOptions, load_api_key, load_chat_template, tls_context
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING
from skippy_zmq.gateway.server import GatewayServer, exposure_warnings, stage_reporter
from skippy_zmq.gateway.starter import EarlyStages, write_serve_topology
from skippy_zmq.link import LinkShape
from tests.conftest import TINY_GEMMA3_LAYERS
from tests.pipeline_helpers import write_topology


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
    """/health names each stage never heard, its endpoint and what to check; the log says it once per stage
    (`stage_never_heard`, 5 s after the driver started)."""
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    stages = TopologyConfig.from_toml(path).stages
    labels = [stage.label for stage in stages]
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
        assert [(s["id"], s["host"], s["state"]) for s in body["stages"]] == [
            (stage.stage_id, "127.0.0.1", "never_heard") for stage in stages]
        assert body["stages"][1]["detail"].startswith(f"never heard: check the stage is running at "
                                                      f"{stages[1].pull_connect} and reaches the driver at")
        async with session.post(server.url + "/v1/completions", json={"prompt": "x"}) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "5"
            assert (await response.json())["error"]["code"] == "pipeline_unavailable"
        async with session.get(server.url + "/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == "tiny-gemma3"
        while "nothing accepts connections" not in body["stages"][0]["detail"]:  # the link's news: refused
            await asyncio.sleep(0.05)
            async with session.get(server.url + "/health") as response:
                body = await response.json()
        assert f'stage 0 "stage-0" never heard: nothing accepts connections at {stages[0].pull_connect}' in (
            body["message"])
        await asyncio.sleep(FIRST_SAY_S + 0.5)  # the first look was before /health said "waiting"

    code, log = run_server(options, scenario)
    assert code == 0
    names = [event["event"] for event in events(log)]
    assert names[0] == "listening"
    assert names[-2:] == ["draining", "stopped"]
    unheard = [event for event in events(log) if event["event"] == "stage_never_heard"]
    assert [(e["stage"], e["stage_id"], e["host"], e["endpoint"]) for e in unheard] == [
        (stage.index, stage.stage_id, "127.0.0.1", stage.pull_connect) for stage in stages]
    assert "not heard 5 s after the driver started (waiting for its first heartbeat)" in unheard[1]["message"]


def test_a_second_signal_cuts_the_drain(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    options = ServeOptions(topology_path=str(path), port=0, ready_timeout_s=60, drain_timeout_s=600)

    async def scenario(server: GatewayServer, session: aiohttp.ClientSession) -> None:
        while True:  # the engine is up (waiting for the stages) once /health says "waiting"
            async with session.get(server.url + "/health") as response:
                if (await response.json())["status"] == "waiting":
                    break
            await asyncio.sleep(0.02)
        server.on_signal()  # SIGTERM: the drain begins
        server.on_signal()  # SIGTERM again: what is in flight fails now

    code, log = run_server(options, scenario)
    assert code == 0
    names = [event["event"] for event in events(log)]
    # The cut may be logged before the drain's own line: both follow the first signal at once.
    assert {"draining", "drain_cut"} <= set(names) and names[-1] == "stopped"


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


@pytest.mark.slow
def test_early_stages_start_before_the_listener_and_stop_when_the_port_is_busy(
        tmp_path: Path, tiny_gemma3_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert EarlyStages.start(ServeOptions(topology_path="t.toml"), ServeLog(json_lines=False)) is None
    monkeypatch.setenv("SKIPPY_ZMQ_CACHE", str(tmp_path / "empty-cache"))
    assert EarlyStages.start(ServeOptions(), ServeLog(json_lines=False)) is None  # to assemble first: no early start
    stream = io.StringIO()
    log = ServeLog(json_lines=True, stream=stream)
    early = EarlyStages.start(ServeOptions(model=str(tiny_gemma3_path), stages=2, threads=1), log)
    assert early is not None and early.topology_path.is_file() and len(early.pipeline.processes) == 2
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        options = ServeOptions(model=str(tiny_gemma3_path), stages=2, port=busy.getsockname()[1])
        server = GatewayServer(options, log, early)
        with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1:"):
            asyncio.run(server.run())
    assert all(p.exit_code() is not None for p in early.pipeline.processes)  # stopped, not left loading
    assert not Path(early.directory).exists()
    assert sum(json.loads(line)["event"] == "progress" for line in stream.getvalue().splitlines()) >= 2


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


def test_a_stage_event_is_one_line_for_people_and_one_object_for_machines() -> None:
    event = StageEvent("stage_down", StagePlace(1, "stage-1", "tcp://10.0.0.2:5711"),
                       'stage 1 "stage-1" at 10.0.0.2 is down: no heartbeat for 3.1 s', {"cause": "silent"})
    human = io.StringIO()
    stage_reporter(ServeLog(json_lines=False, stream=human))(event)
    assert human.getvalue() == '[skippy-zmq] stage 1 "stage-1" at 10.0.0.2 is down: no heartbeat for 3.1 s\n'
    machine = io.StringIO()
    stage_reporter(ServeLog(json_lines=True, stream=machine))(event)
    [line] = machine.getvalue().splitlines()
    record = json.loads(line)
    assert {key: record[key] for key in ("event", "stage", "stage_id", "host", "endpoint", "cause")} == {
        "event": "stage_down", "stage": 1, "stage_id": "stage-1", "host": "10.0.0.2",
        "endpoint": "tcp://10.0.0.2:5711", "cause": "silent"}
    assert record["message"] == event.message


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
                   "--micro-batches", "--drain-timeout", "--prefill-chunk", "--verbose", "--log-json", "--api-key",
                   "--api-key-file", "--ssl-certfile", "--ssl-keyfile", "--max-client-requests", "SKIPPY_API_KEY",
                   "--pooling"):
        assert option in text


def test_pooling_option() -> None:
    result = CliRunner().invoke(serve, ["--pooling", "max"])
    assert result.exit_code == 2 and "'max' is not one of 'mean', 'last'" in result.output
    assert ServeOptions().pooling == "mean"
    assert ServeOptions(pooling="last").pooling == "last"
    with pytest.raises(ConfigError, match="--pooling 'max' is not a pooling; expected one of mean, last"):
        ServeOptions(pooling="max")


# --- TLS and the API key ---------------------------------------------------------------------------

KEY = "sk-serve-test"


def self_signed_cert(directory: Path, *, passphrase: bytes | None = None, subprocess_ok: bool = False
                     ) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost and its key (PEM), by `cryptography` or, in slow tests, the
    openssl command; the test is skipped when neither is there."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if not subprocess_ok or passphrase is not None or shutil.which("openssl") is None:
            pytest.skip("needs the cryptography package (or, in slow tests, the openssl command)")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True,
                       timeout=30)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    alt = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1)).add_extension(alt, critical=False)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    encryption: Any = (serialization.NoEncryption() if passphrase is None
                       else serialization.BestAvailableEncryption(passphrase))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return cert, key


def test_https_and_the_api_key_in_process(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    options = ServeOptions(topology_path=str(path), port=0, ready_timeout_s=60, drain_timeout_s=1,
                           ssl_certfile=str(cert), ssl_keyfile=str(key), api_key=KEY)
    trusted = ssl.create_default_context(cafile=str(cert))

    async def scenario(server: GatewayServer, session: aiohttp.ClientSession) -> None:
        assert server.url.startswith("https://127.0.0.1:")
        async with session.get(server.url + "/health", ssl=trusted) as response:
            assert response.status == 503  # open without the key (no stage runs: waiting)
        async with session.get(server.url + "/v1/models", ssl=trusted) as response:
            assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        async with session.get(server.url + "/v1/models", ssl=trusted,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # the default trust store does not know it
            await session.get(server.url + "/health")
        plain = server.url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):
            await session.get(plain + "/health")

    code, log = run_server(options, scenario)
    assert code == 0
    listening = events(log)[0]
    assert (listening["event"], listening["tls"], listening["api_key"]) == ("listening", True, True)
    assert KEY not in log


def test_tls_context_refuses_tls_below_1_2(tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    context = tls_context(ServeOptions(ssl_certfile=str(cert), ssl_keyfile=str(key)))
    assert context is not None and context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert tls_context(ServeOptions()) is None


def test_tls_option_errors(tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    _, other_key = self_signed_cert(other_dir)
    encrypted_dir = tmp_path / "encrypted"
    encrypted_dir.mkdir()
    _, encrypted_key = self_signed_cert(encrypted_dir, passphrase=b"secret")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem file\n")
    with pytest.raises(ConfigError, match=r"^--ssl-certfile needs --ssl-keyfile too"):
        ServeOptions(ssl_certfile=str(cert))
    with pytest.raises(ConfigError, match=r"^--ssl-keyfile needs --ssl-certfile too"):
        ServeOptions(ssl_keyfile=str(key))
    cases = [
        (str(tmp_path / "missing.pem"), str(key), r"^--ssl-certfile .*missing\.pem: cannot read it: No such file"),
        (str(cert), str(tmp_path), r"^--ssl-keyfile .*: cannot read it: Is a directory"),
        (str(junk), str(key), r"^--ssl-certfile .*junk\.pem: not a PEM file with a BEGIN CERTIFICATE block"),
        (str(cert), str(junk), r"^--ssl-keyfile .*junk\.pem: not a PEM file with a PRIVATE KEY block"),
        (str(cert), str(other_key), r"not a usable certificate and private key: .*KEY_VALUES_MISMATCH"),
        (str(cert), str(encrypted_key), r"the private key is encrypted; give it without a passphrase"),
    ]
    for certfile, keyfile, message in cases:
        with pytest.raises(ConfigError, match=message):
            tls_context(ServeOptions(ssl_certfile=certfile, ssl_keyfile=keyfile))


def test_a_bad_certificate_fails_before_the_port_is_bound(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    options = ServeOptions(topology_path=str(path), port=0, ssl_certfile=str(tmp_path / "no.pem"),
                           ssl_keyfile=str(tmp_path / "no.key"))
    with pytest.raises(ConfigError, match="--ssl-certfile"):
        GatewayServer(options, ServeLog(json_lines=True, stream=io.StringIO()))


def test_api_key_sources_and_errors(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}  \nsecond line ignored\n")
    assert load_api_key(ServeOptions(api_key_file=str(key_file))) == KEY
    assert load_api_key(ServeOptions(api_key=KEY)) == KEY
    assert load_api_key(ServeOptions()) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases: list[tuple[ServeOptions, str]] = [
        (ServeOptions(api_key_file=str(tmp_path / "nope")), r"^--api-key-file .*nope: cannot read the API key: No such"),
        (ServeOptions(api_key_file=str(empty)), r"^--api-key-file .*empty: the API key is empty"),
        (ServeOptions(api_key=""), r"^--api-key: the API key is empty"),
        (ServeOptions(api_key="two words"), r"^--api-key: the API key must be printable ASCII without spaces"),
        (ServeOptions(api_key="s\u00e9same"), r"printable ASCII"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_api_key(options)
    with pytest.raises(ConfigError, match="--api-key and --api-key-file both give the API key"):
        ServeOptions(api_key=KEY, api_key_file=str(key_file))


@pytest.mark.parametrize(("host", "api_key", "tls", "warning"), [
    ("127.0.0.1", False, False, None),
    ("::1", False, False, None),
    ("localhost", False, False, None),
    ("0.0.0.0", False, False, "--host 0.0.0.0 without --api-key: anyone who can reach the port"),
    ("10.0.0.5", True, False, "--host 10.0.0.5 without --ssl-certfile: the API key and every prompt"),
    ("example.org", False, True, "--host example.org without --api-key"),
    ("0.0.0.0", True, True, None),
])
def test_exposure_warnings(host: str, api_key: bool, tls: bool, warning: str | None) -> None:
    tls_files = {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem"} if tls else {}
    warnings = exposure_warnings(ServeOptions(host=host, **tls_files), api_key=api_key)
    assert [text[: len(warning)] for text in warnings] == ([] if warning is None else [warning])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_several_hosts_listen_on_one_port(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    """`--host 127.0.0.1,::1` (llama-server's form): every address answers on the first one's port."""
    if not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2)
    options = ServeOptions(topology_path=str(path), host="127.0.0.1, ::1", port=0, drain_timeout_s=1)
    assert options.hosts == ("127.0.0.1", "::1")

    async def scenario(server: GatewayServer, session: aiohttp.ClientSession) -> None:
        port = server.url.rsplit(":", 1)[1]
        assert server.url == f"http://127.0.0.1:{port}"
        for url in (server.url, f"http://[::1]:{port}"):
            async with session.get(url + "/v1/models") as response:
                assert response.status == 200

    code, log = run_server(options, scenario)
    assert code == 0
    listening = events(log)[0]
    assert listening["urls"] == [listening["url"], listening["url"].replace("127.0.0.1", "[::1]")]


def test_host_lists_are_checked_and_warned_about_as_a_whole() -> None:
    for host, message in (("127.0.0.1,", "has an empty address"), ("::1,::1", "names an address twice")):
        with pytest.raises(ConfigError, match=message):
            ServeOptions(host=host)
    warnings = exposure_warnings(ServeOptions(host="127.0.0.1,10.0.0.5,::1"), api_key=False)
    assert warnings == ["--host 10.0.0.5 without --api-key: anyone who can reach the port can run generations"]


def _options_of(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, Any, str]:
    """Run the `serve` command with `server.serve` replaced: its exit code, the options it got, the output."""
    seen: list[ServeOptions] = []

    def fake_serve(options: ServeOptions, _log: ServeLog, early: EarlyStages | None) -> int:
        assert early is None
        seen.append(options)
        load_api_key(options)
        return 0

    monkeypatch.setattr(server_module, "serve", fake_serve)
    monkeypatch.setattr(EarlyStages, "start", classmethod(lambda _cls, _options, _log: None))
    result = CliRunner().invoke(serve, args, env=env)
    return result.exit_code, seen[0] if seen else None, result.output + (result.stderr or "")


def test_the_serve_command_hands_its_scheduler_options_on_as_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from skippy_zmq.driver.settings import SchedulerSettings

    code, options, output = _options_of([], {}, monkeypatch)
    assert code == 0, output
    assert options.scheduler == SchedulerSettings(max_queue=256, request_timeout_s=600.0, prefill_chunk=256,
                                                  micro_batches=1, recovery_timeout_s=60.0, cache_prompts=True,
                                                  gather_max_s=defaults.GATHER_MAX_S)
    code, options, output = _options_of(["--max-queue", "4", "--request-timeout", "9", "--prefill-chunk", "32",
                                         "--micro-batches", "2", "--recovery-timeout", "0", "--no-cache-prompt"],
                                        {}, monkeypatch)
    assert code == 0, output
    assert options.scheduler == SchedulerSettings(max_queue=4, request_timeout_s=9.0, prefill_chunk=32,
                                                  micro_batches=2, recovery_timeout_s=0.0, cache_prompts=False,
                                                  gather_max_s=defaults.GATHER_MAX_S)


def test_cli_api_key_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"SKIPPY_API_KEY": "from-env"}
    code, options, _ = _options_of([], env, monkeypatch)
    assert (code, options.api_key, options.max_client_requests) == (0, "from-env", defaults.MAX_CLIENT_REQUESTS)
    code, options, _ = _options_of(["--api-key", "from-flag"], env, monkeypatch)
    assert (code, options.api_key) == (0, "from-flag")
    code, options, _ = _options_of(["--api-key-file", str(key_file)], env, monkeypatch)
    assert (code, options.api_key, load_api_key(options)) == (0, None, "from-file")
    code, options, output = _options_of(["--api-key", "a", "--api-key-file", str(key_file)], {}, monkeypatch)
    assert (code, options) == (1, None) and "--api-key and --api-key-file both give the API key" in output
    code, options, output = _options_of(["--ssl-certfile", "c.pem"], {}, monkeypatch)
    assert (code, options) == (1, None) and "--ssl-certfile needs --ssl-keyfile too" in output
    code, options, output = _options_of(["--api-key-file", str(tmp_path / "none")], {}, monkeypatch)
    assert code == 1 and "cannot read the API key" in output


def test_check_tensors_needs_local_stages() -> None:
    assert ServeOptions(check_tensors=True).check_tensors
    with pytest.raises(ConfigError, match=r"^check_tensors applies to the local stages serve starts; the stages of "
                                          r"t\.toml run already: start their workers with --check-tensors$"):
        ServeOptions(topology_path="t.toml", check_tensors=True)


def test_serve_keeps_the_kv_cache_types_it_is_given_in_its_local_topology(tmp_path: Path, tiny_gemma3_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    code, options, _ = _options_of([], {}, monkeypatch)
    assert (code, options.cache_type_k, options.cache_type_v) == (0, "f16", "f16")  # llama.cpp's default
    code, options, _ = _options_of(["--cache-type-k", "f32", "--stages", "2"], {}, monkeypatch)
    assert (code, options.cache_type_k, options.cache_type_v) == (0, "f32", "f16")
    directory, path = write_serve_topology(options, tiny_gemma3_path)
    try:
        stages = TopologyConfig.from_toml(path).stages
        assert [(s.cache_type_k, s.cache_type_v) for s in stages] == [("f32", "f16")] * 2
    finally:
        shutil.rmtree(directory)
    code, options, output = _options_of(["--cache-type-v", "q8_0"], {}, monkeypatch)
    assert (code, options) == (2, None) and "'q8_0' is not one of 'f32', 'f16'" in output
    code, options, output = _options_of(["--topology", "t.toml", "--cache-type-v", "f32"], {}, monkeypatch)
    assert (code, options) == (2, None) and "--cache-type-v applies to a local pipeline" in output
    with pytest.raises(ConfigError, match=r"ServeOptions.cache_type_k: cache type 'q4_0' is unknown"):
        ServeOptions(cache_type_k="q4_0")


def test_serve_emulates_every_link_of_its_local_topology_when_asked(tmp_path: Path, tiny_gemma3_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    code, options, _ = _options_of(["--stages", "2"], {}, monkeypatch)
    assert (code, options.emulate_link) == (0, None)  # off by default
    code, options, _ = _options_of(["--stages", "2", "--emulate-link", "delay=20ms,rate=1gbit"], {}, monkeypatch)
    assert code == 0 and options.emulate_link == LinkShape(delay_ms=20, rate_bit_s=1e9)
    directory, path = write_serve_topology(options, tiny_gemma3_path)
    try:
        topology = TopologyConfig.from_toml(path)
        assert [stage.link for stage in topology.stages] == [LinkShape(delay_ms=20, rate_bit_s=1e9)] * 2
        assert [link["to"] for link in topology.emulated_links()] == ["stage-1", "driver"]
    finally:
        shutil.rmtree(directory)
    code, options, output = _options_of(["--emulate-link", "delay=20"], {}, monkeypatch)
    assert (code, options) == (2, None) and "--emulate-link 'delay=20': delay '20' is not a duration" in output
    code, options, output = _options_of(["--topology", "t.toml", "--emulate-link", "delay=2ms"], {}, monkeypatch)
    assert (code, options) == (2, None) and "with --topology set emulate_link in the topology" in output


def test_cli_served_model_names_and_cors_origins(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--served-model-name", "gpt-4o,org/m", "--served-model-name", " x ", "--served-model-name", "gpt-4o",
            "--cors-origins", "http://localhost:5173,*"]
    code, options, _ = _options_of(args, {}, monkeypatch)
    assert code == 0 and options.served_model_name == ("gpt-4o", "org/m", "x") and not options.strict_model_name
    assert _options_of(["--strict-model-name"], {}, monkeypatch)[1].strict_model_name
    assert options.cors_origins == "http://localhost:5173,*"
    code, options, _ = _options_of([], {}, monkeypatch)
    assert (code, options.served_model_name, options.cors_origins) == (0, (), None)
    for bad, option in ((["--served-model-name", "a,,b"], "--served-model-name"),
                        (["--cors-origins", "localhost:5173"], "--cors-origins")):
        code, options, output = _options_of(bad, {}, monkeypatch)
        assert (code, options) == (2, None) and option in output
    with pytest.raises(ConfigError, match="--cors-origins: 'ftp://x'"):
        ServeOptions(cors_origins="ftp://x")
    backend = GatewayServer(ServeOptions(served_model_name=("gpt-4o", "org/m")), ServeLog(json_lines=False)).backend
    assert (backend.model_id, backend.served_names) == ("gpt-4o", ("gpt-4o", "org/m"))
    default = GatewayServer(ServeOptions(), ServeLog(json_lines=False)).backend
    assert default.served_names == (default.model_id,) and default.model_id != "gpt-4o"
    assert not default.strict_model_name
    assert GatewayServer(ServeOptions(strict_model_name=True), ServeLog(json_lines=False)).backend.strict_model_name


def test_cli_alias_is_llama_servers_set_of_names_and_tags_and_reranking_reach_the_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, options, _ = _options_of(["--alias", "tinyllama-2,fim,code", "--tags", "chat,fim", "--tags", "small",
                                    "--reranking"], {}, monkeypatch)
    assert code == 0 and options.served_model_name == ("code", "fim", "tinyllama-2")  # the id: first in sorted order
    assert options.tags == ("chat", "fim", "small") and options.reranking
    backend = GatewayServer(options, ServeLog(json_lines=False)).backend
    assert (backend.model_id, backend.tags) == ("code", ("chat", "fim", "small"))
    assert _options_of(["--rerank"], {}, monkeypatch)[1].reranking
    code, options, output = _options_of(["--alias", "a", "--served-model-name", "b"], {}, monkeypatch)
    assert (code, options) == (2, None) and "--alias and --served-model-name both name the model" in output


def test_any_origin_without_a_key_is_warned_about_even_on_loopback() -> None:
    warnings = exposure_warnings(ServeOptions(cors_origins="*"), api_key=False)
    assert len(warnings) == 1 and warnings[0].startswith("--cors-origins * without --api-key")
    assert exposure_warnings(ServeOptions(cors_origins="*"), api_key=True) == []
    assert exposure_warnings(ServeOptions(cors_origins="http://localhost:5173"), api_key=False) == []


def test_chat_template_options_are_checked_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    good, broken = tmp_path / "good.jinja", tmp_path / "broken.jinja"
    good.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", encoding="utf-8")
    broken.write_text("{% for m in messages %}{{ m.content }}", encoding="utf-8")
    code, options, output = _options_of(["--chat-template-file", str(good), "--jinja"], {}, monkeypatch)
    assert code == 0, output
    assert load_chat_template(options) == (good.read_text(), f"--chat-template-file {good}")
    code, options, output = _options_of(["--chat-template", "{{ messages[0].content }}"], {}, monkeypatch)
    assert code == 0 and load_chat_template(options) == ("{{ messages[0].content }}", "--chat-template")
    assert load_chat_template(ServeOptions()) is None
    code, options, output = _options_of(["--chat-template", "chatml"], {}, monkeypatch)  # a built-in format
    assert code == 0 and load_chat_template(options) == ("chatml", "--chat-template"), output
    for args, message in (
        (["--chat-template-file", str(broken)], f"--chat-template-file {broken}: "),
        (["--chat-template-file", str(tmp_path / "none.jinja")], "cannot read the chat template"),
        (["--chat-template", "lama3"], "--chat-template: llama.cpp has no chat format 'lama3'"),
        (["--chat-template", "not a name"], "is neither Jinja text nor the name of one of llama.cpp's"),
        (["--no-jinja", "--chat-template", "{{ x }}"], "llama.cpp has no chat format '{{ x }}'"),
        (["--chat-template", "{{ x }}", "--chat-template-file", str(good)], "use one"),
    ):
        code, options, output = _options_of(args, {}, monkeypatch)
        assert (code, options) == (1, None) and message in output, output


def test_a_given_chat_template_replaces_the_ggufs(tiny_gemma3_path: Path) -> None:
    from skippy_zmq.gateway.starter import _chat_renderer
    from skippy_zmq.tokens.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_gemma3_path)
    source = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    given = _chat_renderer(tiny_gemma3_path, tokenizer, ServeLog(json_lines=False, stream=io.StringIO()),
                           (source, "--chat-template-file t.jinja"))
    render, text = given.render_chat, given.render_prompt
    assert given.source == source and render is not None and text is not None
    assert tokenizer.decode(render([{"role": "user", "content": "hi"}])) == "[user]hi"
    assert text([{"role": "user", "content": "hi"}]) == "[user]hi"
    assert given.reasoning is not None and given.reasoning(DEFAULT_THINKING) is None  # no thought markers
    gguf = _chat_renderer(tiny_gemma3_path, tokenizer, ServeLog(json_lines=False, stream=io.StringIO()))
    assert gguf.source != source
