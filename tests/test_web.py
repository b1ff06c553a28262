"""The web page in a real browser: headless Chromium (Debian's package) driven by Playwright, against the live
service with the demo models ("/") and a keyed application whose chat model never ends a reply ("/keyed")."""
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from core.chat import save_chat_model
from deployments.errors import error
from deployments.completion import sse
from tests.conftest import delete_apps, tiny_model
from tests.waiting import wait_until

CHROMIUM = os.environ.get("STARTLUX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.serve, pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM, reason="no Chromium to drive: install Debian's `chromium` package "
                                                      "(apt-get install chromium) or set STARTLUX_CHROMIUM")]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
KEY = "sekrit"
# Chromium's own background traffic has nowhere to go on an offline machine
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def service(serve_url, tmp_path_factory, tokenizer):
    from ray import serve

    from deployments.app import AppArgs, wire

    root = tmp_path_factory.mktemp("web")
    model = tiny_model("nanochat", tokenizer, sequence_len=8192)
    with torch.no_grad():       # greedy, it never ends a reply on its own: there is always a long answer to stop
        model.lm_head.weight[min(tokenizer.special_tokens.values()):] = 0.0
    save_chat_model(str(root / "endless"), model, tokenizer)
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    options = {"ChatModel": small, "DecisionModel": dict(small, user_config={"max_batch_size": 8}), "Ingress": small}
    keyed = AppArgs(device="cpu", chat_checkpoint=str(root / "endless"), api_keys=[KEY], max_chat_inflight=1,
                    max_chat_waiting=0)
    serve.run_many([serve.RunTarget(wire(AppArgs(device="cpu"), options), name="demo", route_prefix="/"),  # demo models
                    serve.RunTarget(wire(keyed, options), name="keyed", route_prefix="/keyed")])
    yield serve_url
    delete_apps("demo", "keyed")


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """-> open(url, **context options): a fresh page on `url`; every console error it logs is collected and must
    not be a Content-Security-Policy violation."""
    contexts, errors = [], []

    def open_(url, **options):
        context = browser.new_context(**({"viewport": {"width": 1000, "height": 820}} | options))
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(url)
        return page

    yield open_
    for c in contexts:
        c.close()
    assert not [e for e in errors if "Content Security Policy" in e], errors


def screenshot(page, name, tmp_path):
    """Screenshots go to STARTLUX_SCREENSHOTS (docs/ when they are refreshed for the README), else tmp."""
    out = Path(os.environ.get("STARTLUX_SCREENSHOTS") or tmp_path) / name
    page.screenshot(path=str(out), full_page=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def setting(page, name, value):
    """Open the settings (a closed <details>) if need be and set one."""
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")
    page.fill(f"#{name}", value)


def send(page, text):
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")


def reply(page):
    return page.locator(".msg.assistant .body").last


def watch_reply(page):
    """Record every text the last assistant message shows, as it changes (to see tokens stream in)."""
    page.evaluate("""() => { window.__seen = [];
        new MutationObserver(() => { const b = document.querySelectorAll('.msg.assistant .body');
            if (b.length) window.__seen.push(b[b.length - 1].textContent); })
        .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")


def test_chat_streams_the_answer(service, open_page):
    page = open_page(service + "/")
    expect(page.locator("#chat-model")).to_have_value("demo-chat")
    expect(page.locator("#decision-model")).to_have_value("startlux-decision")
    # each tab shows its own model's picker only
    expect(page.locator("#chat-model")).to_be_visible()
    expect(page.locator("#decision-model")).to_be_hidden()
    page.click("#tab-decide")
    expect(page.locator("#decision-model")).to_be_visible()
    expect(page.locator("#chat-model")).to_be_hidden()
    page.click("#tab-chat")
    expect(page.locator("#chat-model")).to_be_visible()
    expect(page.locator("#decision-model")).to_be_hidden()
    page.fill("#chat-input", "first line")
    page.press("#chat-input", "Shift+Enter")                # a new line, not a send
    page.locator("#chat-input").press_sequentially("second line")
    assert page.input_value("#chat-input") == "first line\nsecond line"
    assert page.locator(".msg").count() == 0
    setting(page, "temperature", "0")
    watch_reply(page)
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "What is the capital of Japan?")
    body = request.value.post_data_json
    assert body["stream"] is True and body["model"] == "demo-chat" and body["temperature"] == 0
    expect(reply(page)).to_contain_text("Tokyo", timeout=60_000)
    expect(page.locator("#send")).to_be_enabled()
    final = reply(page).text_content()
    seen = [t for t in page.evaluate("window.__seen") if t]
    partial = [t for t in seen if t != final and final.startswith(t)]
    assert len(partial) >= 2, seen                           # it grew in steps: streamed, not shown at the end
    assert page.locator(".msg.user .body").text_content() == "What is the capital of Japan?"


def test_calculator_calls_show_as_blocks_and_go_back_as_parts(service, open_page):
    page = open_page(service + "/")
    setting(page, "temperature", "0")
    send(page, "What is 1234 times 56?")
    expect(page.locator(".calc .calc-result")).to_have_text("69104", timeout=60_000)
    expect(page.locator(".calc .calc-expr")).to_have_text("1234*56")
    expect(page.locator("#send")).to_be_enabled()
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "thanks")
    assistant = request.value.post_data_json["messages"][1]
    assert assistant["role"] == "assistant"
    assert {"type": "python", "text": "1234*56"} in assistant["parts"]
    assert {"type": "python_output", "text": "69104"} in assistant["parts"]


def test_regenerate_edit_and_clear(service, open_page):
    page = open_page(service + "/")
    setting(page, "temperature", "0")
    send(page, "What is the capital of Japan?")
    expect(reply(page)).to_contain_text("Tokyo", timeout=60_000)
    expect(page.locator("#regenerate")).to_be_enabled()
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#regenerate")
    assert [m["role"] for m in request.value.post_data_json["messages"]] == ["user"]   # the old answer is gone
    expect(reply(page)).to_contain_text("Tokyo", timeout=60_000)
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator("#send")).to_be_enabled()
    page.click(".msg.user button")                           # edit: back in the box, the exchange removed
    assert page.input_value("#chat-input") == "What is the capital of Japan?"
    expect(page.locator(".msg")).to_have_count(0)
    send(page, "What is the capital of Peru?")
    expect(reply(page)).to_contain_text("Lima", timeout=60_000)
    page.click("#clear")
    expect(page.locator(".msg")).to_have_count(0)


def keyed_page(open_page, service):
    """The keyed application's page with the key given (after the page asked for it)."""
    page = open_page(service + "/keyed/")
    expect(page.locator("#key-panel")).to_be_visible()
    page.fill("#key-input", KEY)
    page.click("#key-panel button")
    expect(page.locator("#key-panel")).to_be_hidden()
    expect(page.locator("#chat-model")).to_have_value("endless")
    return page


def running(service):
    return httpx.get(f"{service}/keyed/debug/stats", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).json()["chat"]["running"]


def test_a_key_is_asked_for_and_kept_in_the_page(service, open_page):
    page = open_page(service + "/keyed/")
    expect(page.locator("#key-panel")).to_be_visible()
    expect(page.locator("#error")).to_contain_text("401")
    expect(page.locator("#error")).to_contain_text("API key")
    page.fill("#key-input", KEY)
    with page.expect_request("**/v1/models") as request:
        page.click("#key-panel button")
    assert request.value.headers["authorization"] == f"Bearer {KEY}"
    expect(page.locator("#chat-model")).to_have_value("endless")
    assert KEY not in page.url
    assert page.evaluate("JSON.stringify(sessionStorage) + JSON.stringify(localStorage)") == "{}{}"
    page.reload()                                            # kept in memory only: asked for again
    expect(page.locator("#key-panel")).to_be_visible()
    page.fill("#key-input", KEY)
    page.check("#key-remember")                              # opted in: the tab's session storage keeps it
    page.click("#key-panel button")
    expect(page.locator("#chat-model")).to_have_value("endless")
    assert page.evaluate("Object.values(sessionStorage)") == [KEY] and page.evaluate("localStorage.length") == 0
    page.reload()
    expect(page.locator("#chat-model")).to_have_value("endless")
    expect(page.locator("#key-panel")).to_be_hidden()


def test_stop_aborts_and_frees_the_engine(service, open_page):
    page = keyed_page(open_page, service)
    setting(page, "max-tokens", "6000")
    setting(page, "temperature", "0")          # greedy: the endless model's end-of-turn token is never the top one
    send(page, "hello")
    expect(reply(page)).not_to_be_empty(timeout=60_000)
    wait_until(lambda: len(reply(page).text_content()) >= 40, 60, "the reply did not grow to 40 characters")
    assert running(service) == 1
    # the state the click needs: the reply still streaming in the page (Stop enabled, no note on the reply); a
    # reply that ended another way says how
    expect(page.locator("#stop")).to_be_enabled(timeout=30_000)
    assert page.locator(".msg.assistant .note").count() == 0, (page.locator(".msg.assistant .note").all_text_contents(),
                                                               page.locator("#error").text_content())
    page.click("#stop")
    expect(page.locator(".msg.assistant .note")).to_have_text("stopped")
    wait_until(lambda: running(service) == 0, 20, "the engine still runs the stopped reply", 0.2)
    expect(page.locator("#send")).to_be_enabled()


def test_errors_are_shown_as_messages(service, open_page):
    page = open_page(service + "/")
    setting(page, "max-tokens", "100000")          # over the context: the API's 400 names the field
    send(page, "hello")
    expect(page.locator("#error")).to_contain_text("400")
    expect(page.locator("#error")).to_contain_text("max_tokens")
    expect(page.locator(".msg.assistant")).to_have_count(0)
    expect(page.locator("#send")).to_be_enabled()
    setting(page, "max-tokens", "")                          # fixed: the failed turn is sent again
    page.click("#regenerate")
    expect(reply(page)).not_to_be_empty(timeout=60_000)
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator(".msg")).to_have_count(2)

    keyed = keyed_page(open_page, service)                   # 503: the keyed service takes one generation at once
    body = {"messages": [{"role": "user", "content": "busy"}], "max_tokens": 6000, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{service}/keyed/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as busy:
        lines = busy.iter_lines()          # kept: a dropped line iterator closes the response
        next(lines)
        send(keyed, "hello")
        expect(keyed.locator("#error")).to_contain_text("503")
        expect(keyed.locator("#error")).to_contain_text("Retry in 1 s")
    expect(keyed.locator("#send")).to_be_enabled()


def test_an_interrupted_stream_says_so(service, open_page):
    """The service's own interruption event (its error shape and SSE framing), in place of a real fault."""
    page = open_page(service + "/")
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "demo-chat",
             "choices": [{"index": 0, "delta": {"content": "The capital"}, "finish_reason": None}]}
    cut = sse(chunk) + sse(error("the chat stream was interrupted by a server fault; retry the request",
                                 "server_error")) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=cut))
    send(page, "What is the capital of Japan?")
    expect(page.locator("#error")).to_contain_text("interrupted by a server fault")
    expect(page.locator(".msg.assistant .note")).to_have_text("failed")
    expect(reply(page)).to_have_text("The capital")
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(   # the connection drops: no end at all
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse(chunk)))
    page.click("#regenerate")
    expect(page.locator("#error")).to_contain_text("ended before it was complete")
    expect(page.locator("#send")).to_be_enabled()


def test_model_and_user_text_is_shown_as_text(service, open_page):
    page = open_page(service + "/")
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'
    send(page, hostile)
    expect(page.locator(".msg.user .body")).to_have_text(hostile)
    expect(page.locator("#send")).to_be_enabled(timeout=60_000)
    # a reply that carries markup, in text and in a calculator part
    chunks = [{"choices": [{"index": 0, "delta": {"content": hostile}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"parts": [{"type": "python", "text": "<img src=y onerror=alert(1)>"}]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body="".join(sse(c) for c in chunks) + "data: [DONE]\n\n"))
    send(page, "again")
    expect(reply(page)).to_contain_text(hostile)
    expect(page.locator(".calc-expr").last).to_have_text("<img src=y onerror=alert(1)>")
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_decisions_from_an_example(service, open_page, tmp_path):
    page = open_page(service + "/")
    page.click("#tab-decide")
    page.select_option("#examples", "Fruit, a comparison, a count")
    page.click("#load-example")
    with page.expect_request("**/v1/systemone") as request:
        page.click("#decide")
    sent = request.value.post_data_json
    assert sent["state"] == "The office opens at nine."
    assert sent["questions"]["fruit"] == {"type": "choice", "instructions": "Which option is a fruit?",
                                          "criteria": {"a": "tiger", "b": "plum", "c": "drill"}}
    assert sent["questions"]["count"]["criteria"] == ["none", "one", "two", "three"]
    cards = page.locator(".answer")
    expect(cards).to_have_count(3, timeout=60_000)
    fruit, bigger, count = (cards.nth(i) for i in range(3))
    expect(fruit.locator(".verdict")).to_contain_text("choice: b")
    expect(fruit.locator(".bar-row")).to_have_count(3)
    expect(fruit.locator(".bar-row.best .bar-label")).to_have_text("b: plum")
    expect(bigger.locator(".bar-row.best .bar-label")).to_have_text("Yes")
    expect(count.locator(".verdict")).to_contain_text("score 2.0")
    expect(count.locator(".bar-row.best .bar-label")).to_have_text("2: two")
    expect(page.locator(".usage")).to_contain_text("input tokens")
    screenshot(page, "web-decisions.png", tmp_path)

    # the state as JSON, checked as it is typed; a bad one is not sent
    page.select_option("#state-kind", "json")
    expect(page.locator("#state-status")).to_contain_text("not JSON")
    page.click("#decide")
    expect(page.locator("#error")).to_contain_text("not valid JSON")
    page.fill("#state", json.dumps({"note": "<b>bold</b>", "room": 4}))
    expect(page.locator("#state-status")).to_have_text("valid JSON")
    page.click("[data-add=noul]")
    question = page.locator(".question").last
    question.locator(".q-instructions").fill("Is 12 less than 40?")
    with page.expect_request("**/v1/systemone") as request:
        page.click("#decide")
    assert request.value.post_data_json["state"] == {"note": "<b>bold</b>", "room": 4}
    expect(page.locator(".answer")).to_have_count(4, timeout=60_000)
    expect(page.locator(".answer").last.locator(".bar-row.best .bar-label")).to_have_text("Yes")

    # a question the API refuses: its 400 names the question
    page.click("[data-add=score]")
    levels = page.locator(".question").last.locator(".crit.level button")
    levels.nth(2).click()
    levels.nth(1).click()                                    # one level left: a score needs at least two
    page.click("#decide")
    expect(page.locator("#error")).to_contain_text("400")
    expect(page.locator("#error")).to_contain_text("score")


@pytest.mark.parametrize("example,best", [
    ("The largest number", {"largest": "n2: 88", "less": "Yes"}),
    ("A JSON state", {"vehicle": "o2: train", "tools": "2: two"}),
])
def test_every_example_gets_the_right_answers(service, open_page, example, best):
    page = open_page(service + "/")
    page.click("#tab-decide")
    page.select_option("#examples", example)
    page.click("#load-example")
    page.click("#decide")
    cards = page.locator(".answer")
    expect(cards).to_have_count(len(best), timeout=60_000)
    for i, (name, label) in enumerate(best.items()):
        expect(cards.nth(i).locator("h3")).to_contain_text(name)
        expect(cards.nth(i).locator(".bar-row.best .bar-label")).to_have_text(label)


def test_the_page_at_phone_width(service, open_page, tmp_path):
    page = open_page(service + "/", viewport={"width": 390, "height": 844}, device_scale_factor=2)
    setting(page, "temperature", "0")
    send(page, "What is 1234 times 56?")
    expect(page.locator(".calc .calc-result")).to_have_text("69104", timeout=60_000)
    expect(page.locator("#send")).to_be_enabled()
    send(page, "What is the capital of Japan?")
    expect(reply(page)).to_contain_text("Tokyo", timeout=60_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.locator("#send").bounding_box()
    assert box["x"] + box["width"] <= 390
    screenshot(page, "web-phone.png", tmp_path)
    page.click("#tab-decide")
    page.click("#decide")
    expect(page.locator(".answer")).to_have_count(3, timeout=60_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


def test_chat_screenshot(service, open_page, tmp_path):
    page = open_page(service + "/")
    setting(page, "temperature", "0")
    for text in ("What is the capital of Japan?", "And Peru?", "What is 1234 times 56?"):
        send(page, text)
        expect(page.locator("#send")).to_be_enabled(timeout=60_000)
    expect(page.locator(".calc-result")).to_have_text("69104")
    screenshot(page, "web-chat.png", tmp_path)


def test_page_headers_and_files(service):
    """The page needs no key (the API does), runs under a policy without inline script or eval, and is found
    under an application's route prefix with or without its slash."""
    r = httpx.get(f"{service}/keyed/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "default-src 'none'" in csp and r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{service}/keyed/v1/models").status_code == 401
    moved = httpx.get(f"{service}/keyed")
    assert moved.status_code in (307, 308) and moved.headers["location"].endswith("/keyed/")
    js = httpx.get(f"{service}/keyed/ui/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "textContent" in js.text
    assert "innerHTML" not in js.text and "eval(" not in js.text
    missing = httpx.get(f"{service}/ui/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert "<script>" not in httpx.get(f"{service}/").text.replace('<script src="ui/app.js" defer></script>', "")
