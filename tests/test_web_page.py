"""The chat page at / in headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
send a message and see the streamed reply, stop a reply mid-way (and check the server freed
its KV blocks), and a narrow-screen layout.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from nanoinfer import LLM, SamplingParams

from server_utils import run_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Screenshots land here too, so a person can look at them after a run.
SHOTS = Path(os.environ.get("NANOINFER_SCREENSHOTS", "/tmp/nanoinfer-screenshots"))

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download needed)")


@pytest.fixture(scope="module")
def server(long_reply_model):
    with run_server(["--model", str(long_reply_model), "--kv-cache-memory", "64M", "--log-level", "warning"]) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1000, "height": 720})
    page = context.new_page()
    external = []
    page.on("request", lambda r: external.append(r.url) if not r.url.startswith(server) else None)
    page.goto(server)
    page.wait_for_function("document.getElementById('model').textContent.length > 0")
    yield page
    context.close()
    assert not external, f"the page loaded something from outside: {external}"


def kv_blocks_used(url: str, timeout: float = 10.0) -> float:
    """Poll /metrics until no KV block is held (bounded); the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        used = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("nanoinfer_kv_cache_blocks_used "))
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def set_settings(page, **values) -> None:
    if page.is_hidden("#settings"):
        page.click("#settings-toggle")
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def test_send_message_and_see_streamed_reply(page, long_reply_model):
    set_settings(page, temperature=0, max_tokens=24)
    page.fill("#input", "Hello there!")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=30_000)
    assert page.text_content(".msg.user .bubble") == "Hello there!"
    reply = page.text_content(".msg.assistant .bubble")
    # Greedy over HTTP from the page is the offline engine's greedy reply.
    ref = LLM(long_reply_model, kv_cache_memory=16 << 20).chat(
        [{"role": "user", "content": "Hello there!"}], SamplingParams(temperature=0, max_tokens=24))[0]
    assert reply == ref.outputs[0].text
    stats = page.text_content(".msg.assistant .stats")
    assert "TTFT" in stats and "tokens" in stats
    if len(ref.outputs[0].token_ids) > 1:
        assert "tok/s" in stats
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-desktop.png"))
    # A second turn carries the first in its history; Clear empties the conversation.
    page.fill("#input", "And again?")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant[data-state=\"done\"]').length == 2",
                           timeout=30_000)
    assert page.locator(".msg.user").count() == 2
    page.click("#clear")
    assert page.locator(".msg").count() == 0


def test_json_output_toggle(page):
    """The settings' "JSON output" box asks for response_format json_object: even this tiny
    random model's reply is then one JSON object (closed within its max_tokens)."""
    set_settings(page, temperature=1, max_tokens=40)
    page.check("#json")
    page.fill("#input", "Describe a cat.")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=30_000)
    reply = page.text_content(".msg.assistant .bubble")
    assert isinstance(json.loads(reply), dict), reply
    page.reload()  # the choice is kept, like the other settings
    assert page.is_checked("#json")
    set_settings(page)
    page.uncheck("#json")


def test_stop_mid_reply_frees_kv_blocks(page, server):
    set_settings(page, temperature=0, max_tokens=60000)  # ~1 ms a token: a minute at least
    page.fill("#input", "Tell me a very long story.")
    page.click("#send")
    assert page.is_visible("#stop") and page.is_hidden("#send")
    # Text streams in while the reply is still running ...
    page.wait_for_function("document.querySelector('.msg.assistant .bubble').textContent.length > 40",
                           timeout=30_000)
    assert page.get_attribute(".msg.assistant", "data-state") == "streaming"
    page.click("#stop")
    page.wait_for_selector('.msg.assistant[data-state="stopped"]', timeout=10_000)
    assert "stopped" in page.text_content(".msg.assistant .stats")
    assert page.is_visible("#send") and page.is_hidden("#stop")
    # ... and stopping closed the connection, so the server aborted the request and freed its blocks.
    assert kv_blocks_used(server) == 0
    metrics = httpx.get(f"{server}/metrics").text
    assert 'nanoinfer_request_success_total{finish_reason="abort"} 1.0' in metrics


def test_narrow_screen(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 375, "height": 740}, device_scale_factor=2, is_mobile=True)
    page = context.new_page()
    page.goto(server)
    set_settings(page, max_tokens=40, seed=1)
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-375-settings.png"))
    page.click("#settings-toggle")
    page.fill("#input", "Hi")
    page.click("#send")
    page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=30_000)
    for selector in ("#input", "#send"):
        box = page.locator(selector).bounding_box()
        assert page.is_visible(selector) and box is not None
        assert box["x"] >= 0 and box["x"] + box["width"] <= 375 and box["y"] + box["height"] <= 740, selector
    assert page.evaluate("document.documentElement.scrollWidth") <= 375  # no sideways scrolling
    shot = tmp_path / "chat-375.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 1000
    shutil.copy(shot, SHOTS / "chat-375.png")
    context.close()


def test_the_page_asks_for_the_api_key(browser, long_reply_model):
    """A server with --api-key: the page's first call gets a 401, asks for the key (a prompt
    dialog), keeps it, and then works; a wrong key is asked again."""
    with run_server(["--model", str(long_reply_model), "--kv-cache-memory", "16M", "--api-key", "page-key",
                     "--log-level", "warning"]) as url:
        context = browser.new_context()
        page = context.new_page()
        answers = iter(["wrong-key", "page-key"])
        asked = []

        def on_dialog(dialog):
            asked.append(dialog.message)
            dialog.accept(next(answers))

        page.on("dialog", on_dialog)
        page.goto(url)
        page.wait_for_function("document.getElementById('model').textContent.length > 0")
        assert len(asked) == 2 and "API key" in asked[0]
        assert page.evaluate("localStorage.getItem('nanoinfer-api-key')") == "page-key"
        set_settings(page, max_tokens=4)
        page.fill("#input", "Hello there!")
        page.click("#send")
        page.wait_for_selector('.msg.assistant[data-state="done"]', timeout=30_000)
        assert len(asked) == 2  # the kept key was sent: no more asking
        context.close()
