"""The chat page at `/` in a real browser (headless Chromium, the system's own, driven by
Playwright) against a live `swaserve serve` of a tiny model behind an API key: the key
entered in the page reaches the API, a message gets a streamed answer, and the memory view
shows a long request's row and follows it as it grows. Screenshots are checked not to be
blank (the pixels' variance, measured by the browser itself)."""

from __future__ import annotations

import base64
import re
import shutil
import threading

import httpx
import pytest

from tests.helpers.servers import start_server, stop_server

KEY = "page-key"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium executable on PATH "
                                "(Debian: apt-get install chromium)")
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def server(tiny_long_context):
    base, proc = start_server("--model", tiny_long_context, "--dtype", "float32",
                              "--api-key", KEY, "--max-running-requests", "4",
                              "--kv-memory", "32MiB", "--max-model-len", "8192")
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def variance(page, png: bytes) -> float:
    """The variance of the screenshot's grey levels (0 for a blank one)."""
    src = "data:image/png;base64," + base64.b64encode(png).decode()
    return page.evaluate("""async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
        const g = c.getContext("2d"); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data;
        let s = 0, s2 = 0, n = 0;
        for (let i = 0; i < d.length; i += 4 * 7) {
            const v = (d[i] + d[i + 1] + d[i + 2]) / 3; s += v; s2 += v * v; n++;
        }
        return s2 / n - (s / n) ** 2; }""", src)


def shoot(page, path) -> None:
    png = page.screenshot(path=str(path), full_page=False)
    assert variance(page, png) > 50, f"{path} looks blank"


def test_chat_and_memory_view_in_a_browser(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 860})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    page.wait_for_selector("#mem-status.error")  # no key yet: the view says 401
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0",
                           timeout=TIMEOUT_MS)  # /v1/models answered with the key
    for field, value in [("#max-tokens", "24"), ("#temperature", "0")]:  # greedy: repeatable
        page.fill(field, value)
        page.dispatch_event(field, "change")
    page.fill("#prompt", "Hello there, **model**!")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant.done", timeout=TIMEOUT_MS)
    assert page.inner_text(".msg.user") == "Hello there, **model**!"
    answer = page.inner_text(".msg.assistant .markdown")
    assert answer.strip(), "no streamed answer"
    assert re.search(r"\b\d+ tokens\b", page.inner_text(".msg.assistant .meta"))
    assert page.is_hidden("#error"), page.inner_text("#error")
    assert page.evaluate("JSON.parse(localStorage.getItem('swaserve.conversations'))"
                         "[0].messages.length") == 2
    shoot(page, tmp_path / "chat.png")
    rendered = page.evaluate("""() => [
        Markdown.render("<img src=x onerror=alert(1)>"),
        Markdown.render("```py\\nx = 1 < 2\\n```"),
        Markdown.render("[a](javascript:alert(1)) and [b](https://example.org)"),
        Markdown.render("| a | b |\\n|---|---|\\n| 1 | **2** |")]""")
    assert "<img" not in rendered[0] and "&lt;img" in rendered[0]
    assert '<code class="lang-py">x = 1 &lt; 2</code>' in rendered[1] and "copy" in rendered[1]
    assert rendered[2].count("<a ") == 1 and 'href="https://example.org"' in rendered[2]
    assert "<td><strong>2</strong></td>" in rendered[3]

    # a long request beside the page: its card appears and its computed tokens grow
    stop = threading.Event()

    def long_request() -> None:
        body = {"messages": [{"role": "user", "content": "tell me everything " * 30}],
                "max_tokens": 6000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # leaving the stream aborts the request

    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    try:
        page.wait_for_selector("#mem-requests .req .computed", timeout=TIMEOUT_MS)
        first = int(page.inner_text("#mem-requests .req .computed"))
        page.wait_for_function(f"+document.querySelector('#mem-requests .req .computed')"
                               f"?.textContent > {first}", timeout=TIMEOUT_MS)
        assert int(page.inner_text("#mem-rows-used")) >= 1
        assert page.inner_text("#mem-requests .req .ring-filled")  # the hybrid model's rings
        shoot(page, tmp_path / "memory.png")
    finally:
        stop.set()
        worker.join(30)
    page.wait_for_selector("#mem-requests .req", state="detached", timeout=TIMEOUT_MS)

    # Stop aborts the page's own stream: the answer keeps what came, the engine lets go
    page.fill("#max-tokens", "4000")
    page.dispatch_event("#max-tokens", "change")
    page.fill("#prompt", "A long answer, please.")
    page.press("#prompt", "Enter")
    page.wait_for_selector("#mem-requests .req", timeout=TIMEOUT_MS)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant:nth-child(4).done", timeout=TIMEOUT_MS)
    assert "stopped" in page.inner_text(".msg.assistant:nth-child(4) .meta")
    page.wait_for_selector("#mem-requests .req", state="detached", timeout=TIMEOUT_MS)
    assert page.is_enabled("#send") and page.is_hidden("#stop")
    assert not errors, errors
    page.close()
