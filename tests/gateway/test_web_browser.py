"""The web page (docs/PROTOCOL.md §9.9) in a real browser: headless Chromium, Debian's own (`apt-get install
chromium`), driven by Playwright's Python package pointed at that executable; nothing is downloaded at test time.

Against a real `serve` over two stages of the tiny random Gemma 3 (`tiny_serve`): a chat answer streams in,
stops and regenerates; the pipeline view shows one card per stage with live figures, a stage stopped with
SIGSTOP goes down on its card and comes back with SIGCONT. Against the gateway's app in this process over a
fake engine: the API key is asked for, kept in sessionStorage and sent to the page's own origin only, and text
that looks like HTML stays text. Every wait is bounded and says what it waits for. With `--web-screenshots
DIR`, the screenshots README shows are written to DIR.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api  # the `test` extra's: a missing one is an error, not a skip

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.stage_figures import StageFigures, TokenSplit
from skippy_zmq.driver.watch import StagePlace, StageStatus
from skippy_zmq.gateway import http
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.wire.replies import StageLoad
from tests.gateway.fakes import AppServer, FakeEngine
from tests.gateway.test_http import KEY, make_backend

pytestmark = pytest.mark.slow  # a browser is a process
expect = sync_api.expect

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium): the web page's browser tests "
                "drive it with Playwright", allow_module_level=True)

WAIT_MS = 30_000
"""The longest any one wait of a page may take (a loaded 2-core machine included)."""
DOWN_WAIT_MS = 20_000
"""How long a stopped stage may take to show as down: 3 s of silence, a look, a poll, a loaded machine."""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, timeout=WAIT_MS)
        expect.set_options(timeout=WAIT_MS)  # every expectation's bound (Playwright's own default is 5 s)
        try:
            yield chromium
        finally:
            chromium.close()


class Page:
    """One tab (its own context: storage, cookies) with what it logged, and the requests it made."""

    def __init__(self, browser: Any, base_url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.tab = self.context.new_page()
        self.tab.set_default_timeout(WAIT_MS)
        self.base_url = base_url
        self.errors: list[str] = []
        self.requests: list[tuple[str, str | None]] = []  # (url, Authorization header)
        self.tab.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.tab.on("pageerror", lambda error: self.errors.append(str(error)))
        self.tab.on("request", lambda request: self.requests.append((request.url, request.headers.get("authorization"))))

    def open(self, view: str) -> Any:
        self.tab.goto(f"{self.base_url}/#{view}", timeout=WAIT_MS)
        return self.tab

    def expect(self, locator: Any, what: str) -> Any:
        """Playwright's expect, bounded, naming what is waited for."""
        return expect(locator, f"waiting {WAIT_MS / 1000:g} s for {what}")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, tiny_serve: Any) -> Iterator[Page]:
    tab = Page(browser, tiny_serve.url)
    try:
        yield tab
    finally:
        tab.close()
    # The page's own code and its policy: no script error, no Content-Security-Policy violation
    assert tab.errors == []


def chat_settings(tab: Any, *, mode: str = "chat", max_tokens: int, system: str = "") -> None:
    tab.select_option("#mode", mode)
    tab.fill("#temperature", "0")
    tab.fill("#max_tokens", str(max_tokens))
    tab.fill("#system", system)


def test_a_chat_answer_streams_in_stops_and_regenerates(page: Page) -> None:
    tab = page.open("chat")
    page.expect(tab.locator("#status"), "the header to say the server is ready").to_have_text("ready")
    chat_settings(tab, max_tokens=400, system="Answer briefly.")
    # Every length the answer's text had while it streamed: growing pieces, not one block at the end
    tab.evaluate("""() => { window.seen = []; new MutationObserver(() => {
        const item = document.querySelector('.message.assistant');
        if (item && item.dataset.state === 'streaming') window.seen.push(item.querySelector('.content').textContent.length);
    }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    tab.fill("#prompt", "Hello there")
    tab.click("#send")
    answer = tab.locator(".message.assistant").last
    page.expect(answer, "the answer to start streaming").to_have_attribute("data-state", "streaming")
    tab.wait_for_function("() => window.seen.filter(n => n > 0).length >= 3", timeout=WAIT_MS)
    tab.click("#stop")
    page.expect(answer, "the stopped answer").to_have_attribute("data-state", "stopped")
    page.expect(answer.locator(".stats"), "the stopped answer's figures").to_contain_text("stopped")
    lengths = [n for n in tab.evaluate("window.seen") if n > 0]
    assert lengths == sorted(lengths) and len(set(lengths)) >= 3, lengths
    assert tab.locator(".message.user .content").last.text_content() == "Hello there"

    tab.fill("#max_tokens", "12")
    tab.click("#regenerate")
    page.expect(tab.locator(".message.assistant"), "one answer after regenerating").to_have_count(1)
    page.expect(answer, "the regenerated answer to finish").to_have_attribute("data-state", "done")
    stats = answer.locator(".stats")
    assert int(stats.get_attribute("data-tokens") or 0) == 12  # the stream's usage: max_tokens, no EOS here
    assert float(stats.get_attribute("data-ttft-ms") or -1) >= 0
    assert float(stats.get_attribute("data-tokens-per-second") or 0) > 0
    page.expect(stats, "the answer's figures").to_contain_text("tokens/s")
    assert answer.locator(".content").text_content()


def test_a_completion_streams_through_v1_completions(page: Page) -> None:
    tab = page.open("chat")
    chat_settings(tab, mode="completion", max_tokens=6)
    tab.fill("#prompt", "Once upon a time")
    tab.press("#prompt", "Enter")
    answer = tab.locator(".message.assistant").last
    page.expect(answer, "the completion to finish").to_have_attribute("data-state", "done")
    assert answer.locator(".stats").get_attribute("data-tokens") == "6"
    assert any(url.endswith("/v1/completions") for url, _ in page.requests)


def card(tab: Any, index: int) -> Any:
    return tab.locator(f'.stage[data-stage="{index}"]')


def test_the_pipeline_shows_each_stage_live_and_marks_the_slowest(page: Page, tiny_serve: Any) -> None:
    tab = page.open("pipeline")
    page.expect(tab.locator(".stage"), "one card per stage").to_have_count(2)
    for index, layers in ((0, "[0, 3)"), (1, "[3, 7)")):
        stage = card(tab, index)
        page.expect(stage, f"stage {index} up").to_have_attribute("data-state", "up")
        page.expect(stage.locator('[data-field="layers"]'), f"stage {index}'s layers").to_have_text(layers)
        page.expect(stage.locator('[data-field="host"]'), f"stage {index}'s host").to_have_text("127.0.0.1")
        page.expect(stage.locator('[data-field="heartbeat"]'), f"stage {index}'s heartbeat").to_contain_text("s ago")
        page.expect(stage.locator('[data-field="rss"]'), f"stage {index}'s memory").to_contain_text("MiB")
        page.expect(stage.locator('[data-field="lanes"]'), f"stage {index}'s lanes").to_contain_text("of 8")
        page.expect(stage.locator('[data-field="restarts"]'), f"stage {index}'s restarts").to_have_text("0")
    client = tiny_serve.client()
    client.completions.create(model="tiny", prompt="The pipeline", max_tokens=32, temperature=0)
    for index in (0, 1):
        page.expect(card(tab, index).locator('[data-field="split"]'),
                    f"stage {index}'s token split after a generation").to_contain_text("per token")
    page.expect(tab.locator(".stage.slowest"), "exactly one stage marked slowest").to_have_count(1)
    tokens = tab.locator('.figure[data-figure="tokens_per_second"] .value')
    page.expect(tokens, "the gateway's tokens/s to count the generation").not_to_have_text("0")
    assert tab.evaluate("document.querySelector('.stage.slowest .bar').style.width") == "100%"
    # the chart draws the rise: painted pixels in the canvas's upper half, above its baseline (two polls at least)
    tab.wait_for_function("""() => {
        const canvas = document.querySelector('.figure[data-figure="tokens_per_second"] canvas');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height / 2).data;
        for (let i = 3; i < data.length; i += 4) if (data[i] > 0) return true;
        return false; }""", timeout=WAIT_MS)


def test_a_stopped_stage_goes_down_on_its_card_and_comes_back(page: Page, tiny_pipeline: Any,
                                                              tiny_serve: Any) -> None:
    tab = page.open("pipeline")
    stage = card(tab, 1)
    page.expect(stage, "stage 1 up before it is stopped").to_have_attribute("data-state", "up")
    pid = tiny_pipeline.processes[1].process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        expect(stage, f"waiting {DOWN_WAIT_MS / 1000:g} s for stage 1, stopped, to show as down").to_have_attribute(
            "data-state", "down", timeout=DOWN_WAIT_MS)
        page.expect(stage.locator('[data-field="detail"]'), "what the card says of the stopped stage").to_contain_text(
            "no heartbeat")
        page.expect(tab.locator("#status"), "the header to say the pipeline waits").to_have_text("waiting")
        page.expect(card(tab, 0), "stage 0 still up").to_have_attribute("data-state", "up")
    finally:
        os.kill(pid, signal.SIGCONT)
    page.expect(stage, "stage 1 up again after SIGCONT").to_have_attribute("data-state", "up")
    page.expect(tab.locator("#status"), "the header to say ready again").to_have_text("ready")
    page.expect(stage.locator('[data-field="restarts"]'), "the same process: no restart").to_have_text("0")
    tiny_serve.wait_healthy()


# --- the API key and hostile text, against the app in this process ------------------------------------------


HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>&amp;'


def hostile_script(request: GenerationRequest) -> Iterator[tuple[Any, ...]]:
    yield ("sleep", 0.01)
    yield ("delta", HOSTILE, (10,))
    yield ("done", "length", HOSTILE, (10,))


@pytest.fixture
def keyed_app() -> Iterator[tuple[AppServer, FakeEngine]]:
    engine = FakeEngine(script=hostile_script, ctx_size=1024)
    place = StagePlace(0, '<b id="bold">stage-0</b>', "tcp://127.0.0.1:5700")
    engine.stages = (StageStatus(place, "down", "down (<i>why</i>): check it"),)
    engine.figures = (StageFigures(0, time.monotonic(), StageLoad(64 << 20, 1), TokenSplit(3, 1, 1, 50, 1, 9)),)
    server = AppServer(http.make_app(make_backend(engine), GatewayMetrics(), api_key=KEY))
    try:
        yield server, engine
    finally:
        server.close()


def test_the_key_is_asked_for_kept_in_the_tab_and_sent_to_this_origin_only(
        browser: Any, keyed_app: tuple[AppServer, FakeEngine]) -> None:
    server, engine = keyed_app
    page = Page(browser, server.url)
    try:
        tab = page.open("pipeline")
        form = tab.locator("#key-form")
        page.expect(form, "the key field after the 401").to_be_visible()
        tab.fill("#key", "sk-wrong")
        tab.click("#key-form button")
        page.expect(tab.locator("#key-error"), "the wrong key refused").to_contain_text("refused")
        tab.fill("#key", KEY)
        tab.click("#key-form button")
        page.expect(form, "the key field gone once the key works").to_be_hidden()
        page.expect(tab.locator(".stage"), "the stage's card").to_have_count(1)
        assert tab.evaluate("sessionStorage.getItem('skippy-zmq.api-key')") == KEY
        assert tab.evaluate("localStorage.length") == 0 and page.context.cookies() == []

        tab.click("#tab-chat")
        tab.fill("#max_tokens", "4")
        tab.fill("#prompt", HOSTILE)
        tab.click("#send")
        answer = tab.locator(".message.assistant").last
        page.expect(answer, "the answer to end").not_to_have_attribute("data-state", "streaming")
        assert answer.get_attribute("data-state") == "done", tab.locator("#chat-error").text_content()
        # What the model and the client said is shown as the text it is; nothing in it became markup
        assert answer.locator(".content").text_content() == HOSTILE
        assert tab.locator(".message.user .content").text_content() == HOSTILE
        assert tab.locator("#messages img, #messages script, .stage b, .stage i").count() == 0
        assert tab.evaluate("window.pwned") is None
        assert card(tab, 0).locator("h3").text_content() == 'stage 0 · <b id="bold">stage-0</b>'
    finally:
        page.close()
    assert engine.submitted and engine.submitted[0].request.max_tokens == 4
    keyed = [(url, auth) for url, auth in page.requests if auth is not None]
    assert keyed and all(url.startswith(server.url + "/") and auth in (f"Bearer {KEY}", "Bearer sk-wrong")
                         for url, auth in keyed)
    assert all(url.startswith((server.url + "/", "data:")) for url, _ in page.requests)  # nothing elsewhere
    assert all("status of 401" in error for error in page.errors)  # the refused requests, as Chromium logs them


# --- the screenshots README shows ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def screenshots_dir(request: pytest.FixtureRequest) -> Path:
    directory = request.config.getoption("--web-screenshots")
    if directory is None:
        pytest.skip("give --web-screenshots DIR to write the web page's screenshots (README shows docs/'s)")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_screenshots(browser: Any, screenshots_dir: Path, gemma3_270m_path: Path) -> None:
    """docs/web-chat.png and docs/web-pipeline.png: a 2-stage serve of the packaged Gemma 3 270M (a base model,
    so the chat view runs in completion mode), two answers, then the pipeline view."""
    from tests.gateway.test_command import serving

    with serving("--model", str(gemma3_270m_path), "--stages", "2", "--lanes", "4", "--ctx-size", "1024") as gateway:
        gateway.wait_healthy(120)
        page = Page(browser, gateway.url)
        try:
            tab = page.open("chat")
            chat_settings(tab, mode="completion", max_tokens=24)
            for prompt in ("The capital of France is", "A haiku about the sea:"):
                tab.fill("#prompt", prompt)
                tab.click("#send")
                page.expect(tab.locator('.message.assistant[data-state="done"]'),
                            f"the answer to {prompt!r}").to_have_count(1 if "France" in prompt else 2)
            tab.screenshot(path=str(screenshots_dir / "web-chat.png"))
            tab.click("#tab-pipeline")
            with concurrent.futures.ThreadPoolExecutor(3) as clients:  # some load for the charts to show
                client = gateway.client(timeout_s=120)
                prompts = ["The capital of France is", "Once upon a time", "Once upon a time"]  # a prompt-cache hit
                for tokens in (16, 32, 48):
                    complete = functools.partial(client.completions.create, model="gemma", max_tokens=tokens,
                                                 temperature=0)
                    list(clients.map(lambda prompt, complete=complete: complete(prompt=prompt), prompts))
                    tab.wait_for_timeout(1500)
                for index in (0, 1):
                    page.expect(card(tab, index).locator('[data-field="split"]'),
                                f"stage {index}'s token split").to_contain_text("per token")
            # one session decoding alone through the splits' window: the cards show a token's steady time
            stream = client.completions.create(model="gemma", prompt="The sea", max_tokens=900, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            try:
                next(iter(stream))
                page.expect(tab.locator('.figure[data-figure="active_sessions"] .value'),
                            "a session running while the screenshot is taken").to_have_text("1")
                tab.wait_for_timeout(11_000)
                tab.screenshot(path=str(screenshots_dir / "web-pipeline.png"))
            finally:
                stream.close()  # the server cancels it
        finally:
            page.close()
        assert page.errors == []
