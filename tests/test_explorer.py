"""The request explorer in a real browser: headless Debian Chromium driven by Playwright against a real server."""

import json
import math
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright  # a test extra (`make test-deps`, which `make test` runs)

from tests.conftest import REPO_ROOT
from tests.server_utils import start_server

pytestmark = [pytest.mark.slow, pytest.mark.server]
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
    # the page and its event stream ask for the key; n-gram speculation, whose accepted proposals the page marks
    speculation = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    proc = start_server("--api-key", KEY, "--speculative-config", speculation)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), "Debian's chromium is installed by `make test-deps` (which `make test` runs)"
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


def run_prompt(page, text: str, max_tokens: int = 24, temperature: str = "0") -> None:
    """Runs `text` greedy unless told (an empty temperature: the model's recommended settings)."""
    page.fill("#prompt", text)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", temperature)
    page.click("#submit")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=120_000)


def record_statuses(page) -> None:
    """From now on the page keeps every text its status line shows (window.statuses), however briefly, and the
    engine panel's running count as each was shown (window.runningAt: [status, running])."""
    page.evaluate(
        """() => { window.statuses = []; window.runningAt = [];
        const text = (id) => document.getElementById(id).textContent;
        new MutationObserver(() => {
            window.statuses.push(text('status'));
            window.runningAt.push([text('status'), text('eng-running')]);
        }).observe(document.getElementById('status'), { childList: true, characterData: true, subtree: true }); }"""
    )


def no_label_is_cut(page) -> bool:
    """Every timeline segment's label fits inside it (or it has none)."""
    return page.evaluate("[...document.querySelectorAll('#timeline .seg')].every(e => e.scrollWidth <= e.clientWidth)")


def test_the_page_follows_a_prompt_through_the_engine(server, browser) -> None:
    page = open_explorer(browser, server.url, viewport={"width": 1280, "height": 1100})
    record_statuses(page)
    run_prompt(page, "How do GPUs work?")
    # a prompt of one chunk is shown prefilling while its step runs, before its first token
    statuses = page.evaluate("window.statuses")
    prefilling = [i for i, t in enumerate(statuses) if re.fullmatch(r"prefilling chunk 1/1: prompt tokens .*…", t)]
    generating = [i for i, t in enumerate(statuses) if t.startswith("generating")]
    assert prefilling and generating and prefilling[0] < generating[0], statuses
    summary = page.inner_text("#timeline-summary")
    assert re.fullmatch(r"queued [\d.]+ m?s · prefill [\d.]+ m?s in 1 chunk · decode [\d.]+ m?s in \d+ steps", summary)
    assert no_label_is_cut(page)

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

    # the model's recommended settings are what empty fields mean: said on the page, and not sent
    note = page.inner_text("#defaults-note")
    assert "temperature 0.2" in note and "top p 0.9" in note and "SmolLM2's model card" in note, note
    assert page.get_attribute("#temperature", "placeholder") == "0.2"
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        run_prompt(page, "How do GPUs work?", max_tokens=8, temperature="")
    body = json.loads(sent.value.post_data)
    assert "temperature" not in body and "top_p" not in body and body["max_tokens"] == 8

    # the same prompt again: its leading blocks come from the prefix cache, and the chips say so
    run_prompt(page, "How do GPUs work?", max_tokens=8)
    assert page.locator("#prompt-tokens .chip.cached").count() >= 16
    assert re.fullmatch(r"\d+ blocks? \(\d+ tokens\)", page.inner_text("#kv-reused"))
    assert page.inner_text("#fig-allowed") == "–"  # not constrained

    # constrained to a schema: the lifecycle shows how many tokens each step's mask allowed
    page.click("summary")
    page.fill("#json-schema", '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    run_prompt(page, "Is the sky blue? Answer in JSON.", max_tokens=16)
    last, fewest, most = (int(x) for x in page.inner_text("#fig-allowed").split(" / "))
    assert 1 <= fewest <= last <= most and fewest == 1  # '{"ok": ' allows one continuation at its start
    page.close()


@contextmanager
def engine_steps(url: str) -> Iterator[list[dict]]:
    """The engine's own step events while the block runs (read beside the page's), up to the engine's next idle
    heartbeat after it: every step of the block's requests."""
    steps: list[dict] = []
    listening, stop = threading.Event(), threading.Event()

    def listen() -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("GET", f"{url}/explorer/events", headers=headers, timeout=120) as r:
            listening.set()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "step":
                    steps.append(event)
                elif event["type"] == "stats" and stop.is_set():  # idle after the block: no step of it to come
                    return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert listening.wait(30)
    try:
        yield steps
    finally:
        stop.set()
        listener.join(timeout=30)


def test_a_long_prompt_shows_each_prefill_chunk_as_it_happens(server, browser) -> None:
    """A prompt of 1,300+ tokens is prefilled in chunks of at most max_num_batched_tokens (512 by default): the page
    says "prefilling chunk i/n" before the first token, counts the chunks the engine counts, and keeps the prompt
    collapsed so the lifecycle stays in view."""
    page = open_explorer(browser, server.url, viewport={"width": 1280, "height": 1100})
    # the engine panel is filled at load, from the engine's stats and last step (none yet: nothing ran before)
    engine = httpx.get(f"{server.url}/explorer/info", headers={"Authorization": f"Bearer {KEY}"}).json()["engine"]
    assert page.inner_text("#eng-steps") == str(engine["num_steps"])
    last = engine["last_step"]
    assert page.inner_text("#eng-batch") == (str(last["batch_size"]) if last else "none yet")
    text = "Read these notes and list every colour. " + " ".join(
        f"Note {i}: the {['red', 'green', 'blue', 'amber', 'violet'][i % 5]} lamp {i * 7} is lit." for i in range(88)
    )
    record_statuses(page)
    with engine_steps(server.url) as steps:
        page.fill("#prompt", text)
        page.fill("#max-tokens", "4")
        page.fill("#temperature", "0")
        page.click("#submit")
        prefilling_shown = "document.getElementById('status').textContent.includes('prefilling chunk')"
        page.wait_for_function(prefilling_shown, timeout=60_000)
        assert page.locator("#output-tokens .chip").count() == 0  # before the first token
        # the chunk under way shows in the timeline while it runs (not only once it is done)
        assert page.locator("#timeline .seg.prefill.running").count() == 1
        assert "prefill" in page.inner_text("#timeline-summary") and "(now)" in page.inner_text("#timeline-summary")
        page.screenshot(path=str(ARTIFACTS / "explorer-long-prefilling.png"))
        page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=120_000)
    page.screenshot(path=str(ARTIFACTS / "explorer-long-done.png"))
    # every chunk was shown while it ran, the first one included: "prefilling chunk i/n", i = 1..n
    shown = [
        re.fullmatch(r"prefilling chunk (\d)/(\d): prompt tokens [\d,]+–[\d,]+ of 1,3\d\d…", t)
        for t in page.evaluate("window.statuses")
    ]
    chunks_shown = sorted({(int(m[1]), int(m[2])) for m in shown if m})
    # the engine panel counts the tab's own request as running from its first chunk on (it said 0 until the first
    # step was done: the step that starts carried no counts)
    first_chunk = [running for status, running in page.evaluate("window.runningAt") if "chunk 1/" in status]
    assert first_chunk and all(running == "1" for running in first_chunk), page.evaluate("window.runningAt")

    prompt_tokens = int(page.inner_text("#fig-prompt").replace(",", ""))
    assert prompt_tokens >= 1300
    call = f"chatcmpl-{page.inner_text('#fig-request')}-0"
    mine = [b for e in steps for b in e["batch"] if b["request_id"] == call]
    engine_chunks = max(b["prefill_chunk"] or 0 for b in mine)
    computed = prompt_tokens - mine[0]["cached_tokens"]  # the chat template's first block may be cached
    assert engine_chunks == math.ceil(computed / 512) == 3  # prefilled alone, in chunks of 512 tokens
    assert chunks_shown == [(i, engine_chunks) for i in range(1, engine_chunks + 1)], page.evaluate("window.statuses")
    assert int(page.inner_text("#fig-chunks")) == engine_chunks
    assert page.locator("#timeline .seg.prefill").count() == engine_chunks
    assert re.search(r"\d+(\.\d+)? m?s", page.inner_text("#fig-queue"))

    # collapsed: head … "N more tokens" … tail, the lifecycle in the first screen; one click shows every token
    shown = page.locator("#prompt-tokens .chip").count()
    assert shown < 200
    more = page.locator("[data-testid=prompt-more]")
    assert more.inner_text() == f"… {prompt_tokens - shown:,} more tokens (show all)"
    assert page.locator("#lifecycle-card").bounding_box()["y"] < 1100
    more.click()
    assert page.locator("#prompt-tokens .chip").count() == prompt_tokens
    page.screenshot(path=str(ARTIFACTS / "explorer-long-expanded.png"))
    page.close()


def _luminance(rgb: str) -> float:
    """WCAG's relative luminance of a computed colour ("rgb(r, g, b)")."""
    channels = [int(c) / 255 for c in re.findall(r"\d+", rgb)[:3]]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_the_base_model_note_is_readable(server, browser) -> None:
    """The note that a model is a base model sits in the dark header with a cream background of its own: its text
    was the header's white (contrast 1.0:1); WCAG asks 4.5:1 of small text."""
    page = open_explorer(browser, server.url)
    color, background = page.evaluate(
        """() => { const note = document.getElementById('model-note');
        note.textContent = 'a base model: give it text to continue'; note.hidden = false;
        const style = getComputedStyle(note); return [style.color, style.backgroundColor]; }"""
    )
    lighter, darker = sorted((_luminance(color), _luminance(background)), reverse=True)
    assert (lighter + 0.05) / (darker + 0.05) >= 4.5, (color, background)
    page.close()


def test_new_output_chips_never_cover_their_neighbours(server, browser) -> None:
    """A new token's chip is animated in: at any moment of its animation it stays within its own box (it grew by
    a quarter and covered the chips beside it)."""
    page = open_explorer(browser, server.url)
    run_prompt(page, "Name three colors.", max_tokens=12)
    overlaps = page.evaluate(
        """() => { const box = document.getElementById('output-tokens');
        const fresh = [0, 1, 2].map((i) => { const el = chip('tok' + i, i, 'out new'); box.append(el); return el; });
        const found = [];
        for (const t of [0, 100, 200, 300]) {
            for (const el of fresh) for (const a of el.getAnimations()) { a.pause(); a.currentTime = t; }
            const [a, b, c] = fresh.map((el) => el.getBoundingClientRect());
            const meet = (p, q) => p.left < q.right - 0.5 && q.left < p.right - 0.5 && p.top < q.bottom - 0.5
                && q.top < p.bottom - 0.5;
            if (meet(a, b) || meet(b, c)) found.push(t);
        }
        return found; }"""
    )
    assert overlaps == [], f"new chips overlap at {overlaps} ms of their animation"
    page.close()


def test_accepted_proposals_are_marked_on_their_chips(server, browser) -> None:
    """Speculative decoding: an answer that copies its prompt is mostly proposals the model accepted; the page
    marks exactly the output tokens the engine's step events say were accepted, and the timeline's decode steps
    tell how many of how many proposed tokens held."""
    from tests.test_spec_decode import PASSAGE

    page = open_explorer(browser, server.url, viewport={"width": 1280, "height": 1100})
    with engine_steps(server.url) as steps:
        run_prompt(page, "Repeat this passage word for word:\n\n" + PASSAGE, max_tokens=48)
    call = f"chatcmpl-{page.inner_text('#fig-request')}-0"
    accepted = {  # output indices of the accepted proposals, from the engine's own events
        b["start"] - b["prompt_tokens"] + k
        for e in steps
        for b in e["batch"]
        if b["request_id"] == call and b["accepted"]
        for k in range(1, b["accepted"] + 1)
    }
    assert len(accepted) >= 10
    chips = page.locator("#output-tokens .chip")
    marked = {i for i in range(chips.count()) if "spec" in (chips.nth(i).get_attribute("class") or "").split()}
    assert marked == accepted
    # each decode step tells it (in its label where that fits, else on hover), and the summary adds them up
    titles = [page.locator("#timeline .seg.decode").nth(i).get_attribute("title") for i in range(4)]
    assert any(re.search(r"\(\d+ of \d+ proposed tokens accepted\)", title) for title in titles), titles
    proposed = sum(b["proposed"] for e in steps for b in e["batch"] if b["request_id"] == call)
    summary = page.inner_text("#timeline-summary")
    assert summary.endswith(f" · {len(accepted)} of {proposed} proposed tokens accepted"), summary
    assert no_label_is_cut(page)
    page.screenshot(path=str(ARTIFACTS / "explorer-speculation.png"))
    page.close()


def test_two_tabs_each_highlight_their_own_sequence(server, browser) -> None:
    tabs = [open_explorer(browser, server.url, viewport={"width": 1280, "height": 1100}) for _ in range(2)]
    # each tab latches the moment its engine panel shows both sequences with its own one marked: the two requests
    # share the batch for only part of their steps, and the tabs are watched at once, not one after the other
    latch_both_in_the_batch = """() => { window.bothSeen = false;
        const panel = document.getElementById('eng-requests');
        new MutationObserver(() => {
            const seqs = panel.querySelectorAll('.seq');
            const mine = panel.querySelectorAll('.seq.mine');
            const id = document.getElementById('fig-request').textContent;
            if (seqs.length >= 2 && mine.length === 1 && mine[0].dataset.requestId === `chatcmpl-${id}-0`)
                window.bothSeen = true;
        }).observe(panel, { childList: true, subtree: true, attributes: true }); }"""
    for tab in tabs:
        tab.evaluate(latch_both_in_the_batch)
    for tab, prompt in zip(tabs, ("Write a poem about the sea.", "Write a story about a fox."), strict=True):
        tab.fill("#prompt", prompt)
        tab.fill("#max-tokens", "40")
        tab.click("#submit")
    for i, tab in enumerate(tabs):
        tab.wait_for_function("window.bothSeen", timeout=60_000)
        tab.screenshot(path=str(ARTIFACTS / f"explorer-two-tabs-{i + 1}.png"), full_page=True)
    assert tabs[0].inner_text("#fig-request") != tabs[1].inner_text("#fig-request")
    for tab in tabs:
        tab.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=120_000)
        tab.close()


def test_another_tabs_request_shows_in_the_engine_panel(server, browser) -> None:
    watcher = open_explorer(browser, server.url)
    other = open_explorer(browser, server.url)
    other.fill("#prompt", "Write a long story about a lighthouse.")
    other.fill("#max-tokens", "48")  # 48 steps: each one an event the watcher sees
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
    icon = httpx.get(server.url + "/favicon.ico", timeout=10)  # like the page itself, the icon needs no key
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
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
    "prefill_chunk",
    "blocks",
    "allowed_tokens",
    "proposed",  # speculative decoding: how many tokens were proposed, and how many held
    "accepted",
}


def test_a_reasoning_models_thinking_shows_apart_from_its_answer(browser, tmp_path_factory) -> None:
    """A tiny model with Qwen3's template whose every reply is forced to a thought and an answer
    (tests/scripted_logits.py): the page shows the thinking in its own box, with its token count and time, and
    only the answer as the answer."""
    import os

    from tests.gguf_builder import TinyModel, write_tiny_gguf
    from tokenmill.loader.gguf_file import GGUFFile
    from tokenmill.loader.model_path import bundled_model_path
    from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

    template = (REPO_ROOT / "tests" / "data" / "templates" / "qwen3.jinja").read_text()
    path = write_tiny_gguf(
        tmp_path_factory.mktemp("qwen3") / "qwen3.gguf",
        TinyModel(vocab_size=49152, context=4096),
        tokenizer_from=bundled_model_path(),
        chat_template=template,
    )
    tokenizer = Tokenizer.from_gguf(GGUFFile(bundled_model_path()))
    ids = tokenizer.encode("<think>\nWeighing it up.\n</think>\n\nForty-two.") + [tokenizer.eos_token_id]
    os.environ["TOKENMILL_TEST_SCRIPT"] = json.dumps(ids)
    try:
        proc = start_server("--model", str(path), "--logits-processors", "tests.scripted_logits:ScriptedEveryReply")
    finally:
        del os.environ["TOKENMILL_TEST_SCRIPT"]
    try:
        page = browser.new_page()
        page.goto(proc.url + "/")
        page.wait_for_function("document.getElementById('model-info').textContent.includes('KV blocks')")
        run_prompt(page, "What is the answer?", max_tokens=64)
        assert page.is_visible("#thinking-box")
        assert page.inner_text("#thinking").strip() == "Weighing it up."
        assert page.inner_text("#answer").strip() == "Forty-two."
        assert re.fullmatch(r"thinking: \d+ tokens, [\d.]+ s", page.inner_text("#thinking-summary")), page.inner_text(
            "#thinking-summary"
        )
        # the page's event stream is still open: a stopping server ends it rather than wait for it
        started = time.monotonic()
        assert proc.stop(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        proc.stop()
