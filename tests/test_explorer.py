"""The request explorer in a real browser: headless Debian Chromium driven by Playwright against a real server."""

import json
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright  # installed by `make install`

from tests.conftest import REPO_ROOT
from tests.server_utils import start_server

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO_ROOT / "test-artifacts"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


KEY = "explorer-key"


@pytest.fixture(scope="module")
def server():
    proc = start_server("--api-key", KEY)  # the page and its event stream ask for the key
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), "Debian's chromium is installed by `make install`"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_explorer(browser, url: str, **page_options):
    """A new tab on the explorer, past its question for the API key."""
    page = browser.new_page(**page_options)
    page.goto(url + "/")
    page.wait_for_selector("#key-form", state="visible")
    page.fill("#api-key", KEY)
    page.click("#key-submit")
    page.wait_for_function("document.getElementById('model-info').textContent.includes('SmolLM2')")
    return page


def run_prompt(page, text: str, max_tokens: int = 24) -> None:
    page.fill("#prompt", text)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#submit")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=120_000)


def test_the_page_follows_a_prompt_through_the_engine(server, browser) -> None:
    page = open_explorer(browser, server.url, viewport={"width": 1280, "height": 1100})
    run_prompt(page, "How do GPUs work?")

    prompt_chips = page.locator("#prompt-tokens .chip")
    assert prompt_chips.count() > 10
    assert re.fullmatch(r"\S+#\d+", prompt_chips.nth(1).inner_text().replace("\n", ""))
    assert "#2020" in page.locator("#prompt-tokens").inner_text().replace("\n", "")  # "How" of the question
    output_chips = page.locator("#output-tokens .chip")
    assert output_chips.count() == 24
    assert page.locator("#answer").inner_text().strip()
    for figure in ("#fig-ttft", "#fig-tpot", "#fig-queue", "#fig-e2e"):
        assert re.search(r"\d+(\.\d+)? m?s", page.inner_text(figure)), figure
    assert int(page.inner_text("#kv-blocks")) >= 3
    assert re.search(r"\d+(\.\d+)? (KiB|MiB)", page.inner_text("#kv-bytes"))
    assert "bytes" in page.inner_text("#kv-formula")
    assert int(page.inner_text("#eng-steps")) > 0
    assert page.inner_text("#fig-ranks") == "1"  # one process computed it (more under tensor parallelism)
    assert "one rank" in page.inner_text("#eng-collective")
    assert page.locator("#timeline .seg.prefill").count() >= 1
    assert page.locator("#timeline .seg.decode").count() >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=True)

    # the same prompt again: its leading blocks come from the prefix cache, and the chips say so
    run_prompt(page, "How do GPUs work?", max_tokens=8)
    assert page.locator("#prompt-tokens .chip.cached").count() >= 16
    assert "blocks" in page.inner_text("#kv-reused")
    assert page.inner_text("#fig-allowed") == "–"  # not constrained

    # constrained to a schema: the lifecycle shows how many tokens each step's mask allowed
    page.click("summary")
    page.fill("#json-schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    run_prompt(page, "Is the sky blue? Answer in JSON.", max_tokens=16)
    last, fewest, most = (int(x) for x in page.inner_text("#fig-allowed").split(" / "))
    assert 1 <= fewest <= last <= most and fewest == 1  # '{"ok": ' allows one continuation at its start
    page.close()


def test_another_tabs_request_shows_in_the_engine_panel(server, browser) -> None:
    watcher = open_explorer(browser, server.url)
    other = open_explorer(browser, server.url)
    other.fill("#prompt", "Write a long story about a lighthouse.")
    other.fill("#max-tokens", "200")
    other.click("#submit")
    watcher.wait_for_function("document.getElementById('eng-running').textContent === '1'", timeout=60_000)
    watcher.wait_for_function("document.getElementById('eng-requests').textContent.includes('chatcmpl')")
    other.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=120_000)
    watcher.close()
    other.close()


def test_readable_on_a_phone(server, browser) -> None:
    page = open_explorer(
        browser, server.url, viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True
    )
    run_prompt(page, "Name three colors.", max_tokens=12)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page scrolls sideways on a phone ({width}px)"
    page.screenshot(path=str(ARTIFACTS / "explorer-phone.png"), full_page=True)
    page.close()


def test_the_explorer_needs_the_api_key_and_shows_no_ones_text(server, browser) -> None:
    """With --api-key, the page's data (/explorer/info, /explorer/events) needs the key: the page asks for it, and
    asks again when it is wrong. The event stream tells request ids and token counts, never text or token ids."""
    for path in ("/explorer/info", "/explorer/events"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#key-form", state="visible")
    assert "SmolLM2" not in page.inner_text("#model-info")
    page.fill("#api-key", "wrong")
    page.click("#key-submit")
    page.wait_for_function("document.getElementById('key-message').textContent.includes('refused')")
    page.fill("#api-key", KEY)
    page.click("#key-submit")
    page.wait_for_function("document.getElementById('model-info').textContent.includes('SmolLM2')")
    page.close()

    secret = "The vault code is purple-falcon-1234"
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": secret}, headers=headers).json()["tokens"]
    events: list[str] = []
    with httpx.stream("GET", f"{server.url}/explorer/events", headers=headers, timeout=30) as r:
        body = {"prompt": secret, "max_tokens": 6, "ignore_eos": True}
        threading.Thread(
            target=lambda: httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        ).start()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                event = json.loads(line[6:])
                if event["type"] == "step" and any(b["kind"] == "decode" for b in event["batch"]):
                    break
    seen = "".join(events)
    assert "purple" not in seen and "vault" not in seen
    steps = [json.loads(e) for e in events if json.loads(e)["type"] == "step"]
    assert steps and all(set(b) <= STEP_FIELDS for step in steps for b in step["batch"])
    assert json.dumps(ids)[1:-1] not in seen


# what an engine step tells about each sequence: counts and ids, no content
STEP_FIELDS = {
    "request_id",
    "sample",
    "kind",
    "start",
    "tokens",
    "prompt_tokens",
    "cached_tokens",
    "blocks",
    "allowed_tokens",
}
