"""Tests of skippy_zmq.gateway.web_page and the page's routes, in-process: what the page is made of (light,
no inline script or style, text only ever written as text, relative URLs only), the headers every file
carries (its Content-Security-Policy, nosniff), the key left to the API behind it, and `--no-web`. The page in
a real browser against a real serve: tests/gateway/test_web_browser.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from click.testing import CliRunner

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway import web_page
from skippy_zmq.gateway.cors import CorsPolicy
from skippy_zmq.gateway.options import ServeOptions
from skippy_zmq.gateway.web_page import CONTENT_SECURITY_POLICY, MAX_PAGE_BYTES, Asset, WebPage
from tests.gateway.fakes import FakeEngine
from tests.gateway.test_http import KEY, make_backend, run_client

FOLDER = Path(web_page.__file__).parent / "web"
SCRIPTS = sorted(FOLDER.glob("*.js"))


def test_the_page_and_its_scripts_stay_under_150_kb() -> None:
    files = [path for path in FOLDER.iterdir() if path.is_file()]
    total = sum(path.stat().st_size for path in files)
    assert total <= MAX_PAGE_BYTES == 150 * 1024, f"the web page's files hold {total} bytes"
    assert WebPage.from_package().size == total  # every file in the folder is served, nothing else
    assert {path.suffix for path in files} <= {".html", ".js", ".css"}


def test_the_page_loads_nothing_from_elsewhere_and_nothing_inline() -> None:
    html = (FOLDER / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="web/app.js">']
    assert re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S) == [""]  # no inline script body
    assert re.search(r"<style\b|\sstyle\s*=|\son[a-z]+\s*=", html, re.I) is None  # no inline style or handler
    for reference in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert reference == "data:," or (reference.startswith("web/") and (FOLDER / reference[4:]).is_file())
    for path in [FOLDER / "index.html", FOLDER / "app.css", *SCRIPTS]:
        assert "://" not in path.read_text(), f"{path.name} names an absolute URL"


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_scripts_write_text_as_text_and_call_the_server_by_relative_paths(script: Path) -> None:
    text = script.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "setAttribute(\"style\"", "DOMParser"):
        assert sink not in text, f"{script.name} uses {sink}"
    if script.name != "api.js":  # the one place that calls fetch, and it refuses absolute URLs
        assert "fetch(" not in text and "XMLHttpRequest" not in text and "localStorage" not in text
    for path in re.findall(r'request\("([^"]*)"', text):
        assert not path.startswith(("/", "http")), path
    imports = re.findall(r'from "([^"]+)"', text)
    assert all(name.startswith("./") and (FOLDER / name[2:]).is_file() for name in imports), imports


def test_every_file_is_answered_with_its_policy_type_and_validator() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        for path, content_type in (("/", "text/html"), ("/web/app.js", "text/javascript"),
                                   ("/web/app.css", "text/css"), ("/web/chart.js", "text/javascript")):
            response = await client.get(path)
            assert response.status == 200, path
            headers = response.headers
            assert headers["Content-Type"].startswith(content_type)
            assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
            assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
            assert headers["X-Content-Type-Options"] == "nosniff"
            again = await client.get(path, headers={"If-None-Match": headers["ETag"]})
            assert (again.status, await again.read()) == (304, b"")
            assert again.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        body = await (await client.get("/")).text()
        assert body == (FOLDER / "index.html").read_text()
        for missing in ("/web/nothing.js", "/web/index.htm", "/web/..%2Fhttp.py", "/web/"):
            assert (await client.get(missing)).status == 404, missing

    run_client(make_backend(FakeEngine()), scenario)


def test_the_page_loads_without_the_key_and_everything_behind_it_needs_it() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        assert (await client.get("/")).status == 200
        assert (await client.get("/web/api.js")).status == 200
        assert (await client.get("/web/nothing.js")).status == 404  # a path of the page's: no data behind it
        for path in ("/stages", "/v1/models", "/nothing"):
            assert (await client.get(path)).status == 401, path
        keyed = await client.get("/stages", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status == 200

    run_client(make_backend(FakeEngine()), scenario, api_key=KEY)


def test_nothing_a_client_sends_comes_back_in_the_page() -> None:
    probe = "<script>alert(1)</script>"

    async def scenario(client: TestClient[Any, Any]) -> None:
        page = await client.get("/", params={"q": probe}, headers={"Referer": probe, "X-Probe": probe})
        assert probe not in await page.text()
        missing = await client.get(f"/web/{probe.replace('/', '')}")
        assert missing.status == 404 and probe.replace("/", "") not in await missing.text()
        assert missing.headers["Content-Type"].startswith("application/json")

    run_client(make_backend(FakeEngine()), scenario, cors=CorsPolicy.parse("*"))


def test_no_web_leaves_the_page_out_and_root_is_a_404() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        for path in ("/", "/web/app.js"):
            response = await client.get(path)
            assert response.status == 404, path
            assert (await response.json())["error"]["code"] == "not_found"
        assert (await client.get("/stages")).status == 200  # the JSON route stays: it is the API's

    run_client(make_backend(FakeEngine()), scenario, web_page=False)


def test_serve_no_web_is_the_options_web_field() -> None:
    from skippy_zmq.gateway.command import serve

    seen: dict[str, Any] = {}

    def fake_run(settings: ServeOptions, *_: Any) -> int:
        seen["web"] = settings.web
        return 0

    for args, web in (([], True), (["--no-web"], False), (["--web"], True), (["--no-ui"], False)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("skippy_zmq.gateway.server.serve", fake_run)
            patch.setattr("skippy_zmq.gateway.starter.EarlyStages.start", lambda *_a: None)
            result = CliRunner().invoke(serve, ["--topology", "missing.toml", *args])
        assert seen.pop("web") is web, result.output
    assert ServeOptions().web and not ServeOptions(web=False).web


def test_a_file_of_an_unknown_type_or_a_missing_index_is_a_config_error(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"web page file 'x\.png' has no known type"):
        Asset.of("x.png", b"")
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "app.js").write_text("")
    monkeypatch.setattr(web_page.resources, "files", lambda _package: tmp_path)
    with pytest.raises(ConfigError, match=r"index\.html is not in skippy_zmq/gateway/web .*serve --no-web"):
        WebPage.from_package()
