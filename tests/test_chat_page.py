"""`serve`'s chat page at /, in a real browser: Debian's headless Chromium and its chromedriver (`make test` installs
them where /usr/bin/chromedriver is missing: `apt-get install chromium chromium-driver`), driven by selenium.

The model answers come from the bundled tiny Clover (tests/test_server.py's way of building it); answers that must
never end, or that carry HTML, come from test_server's scripted SlowRuntime. The page's hooks are its data-testid
attributes (docs/serve.md, "The chat page"). With CLOVER_GGUF_SCREENSHOTS=DIR the screenshot test writes the
pictures docs/ shows into DIR (`make screenshots`); otherwise into a temporary folder.
"""

import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

import clover_gguf.serve  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from clover_gguf.serve import create_app  # noqa: E402
from test_server import KEY, TIMEOUT, SlowRuntime, _Server  # noqa: E402

CHROMIUM = os.environ.get("CLOVER_GGUF_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CLOVER_GGUF_CHROMEDRIVER", "/usr/bin/chromedriver")
QUESTION = "What is 34 + 58?"
WAIT = 60  # seconds an answer of the tiny model may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(f"no {CHROMIUM} or {CHROMEDRIVER}: `make test` installs them on Debian (apt-get install chromium "
                    "chromium-driver); elsewhere set CLOVER_GGUF_CHROMIUM and CLOVER_GGUF_CHROMEDRIVER")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                f"--user-data-dir={profile}", "--window-size=1100,800", "--force-color-profile=srgb"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def viewport(drv, width: int = 1100, height: int = 760) -> None:
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                                "deviceScaleFactor": 1, "mobile": width < 500})


def find(drv, testid: str):
    return drv.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def found(drv, testid: str) -> list:
    return drv.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def open_page(drv, base: str, settings: dict | None = None, width: int = 1100, height: int = 760) -> None:
    """A fresh page of this server: nothing kept from an earlier test, these settings, connected."""
    viewport(drv, width, height)
    drv.get(base + "/")
    drv.execute_script("localStorage.clear(); sessionStorage.clear();"
                       "if (arguments[0]) localStorage.setItem('clover-gguf.settings', JSON.stringify(arguments[0]));",
                       settings)
    drv.get(base + "/")
    WebDriverWait(drv, WAIT).until(lambda d: "ok" in d.find_element(By.ID, "status-dot").get_attribute("class")
                                   or d.execute_script("return document.getElementById('key-dialog').open"))


def ask(drv, text: str) -> None:
    prompt = find(drv, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)


def answered(drv):
    """Wait until the latest answer is over (its stats line is there) -> the stats element."""
    return WebDriverWait(drv, WAIT).until(lambda d: found(d, "stats") and found(d, "stats")[0])


def passes(drv) -> int:
    return int(find(drv, "block-view").get_attribute("data-passes") or 0)


def no_alert(drv) -> bool:
    try:
        drv.switch_to.alert
    except NoAlertPresentException:
        return True
    return False


@pytest.fixture(scope="module")
def model_server(bundled_gguf):
    """The bundled model, one slot, auto by default, exact draft acceptance (greedy text is AR's in every mode)."""
    s = _Server(create_app(bundled_gguf, mode="auto", parallel=1, ctx=512, runtime_kwargs={"exact": True}))
    yield s
    s.stop()


def _api_answer(server, mode: str, question: str = QUESTION) -> dict:
    r = httpx.post(server.base + "/v1/chat/completions", timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": question}], "mode": mode})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------------------------
# The bundled model
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "ar", "draft-self", "diffusion"])
def test_each_mode_streams_the_apis_greedy_answer(browser, model_server, mode):
    api = _api_answer(model_server, mode)
    msg = api["choices"][0]["message"]
    open_page(browser, model_server.base)
    Select(find(browser, "mode")).select_by_value(mode)
    ask(browser, QUESTION)
    stats = answered(browser)
    assert find(browser, "answer").text == msg["content"]
    thinking = find(browser, "thinking")
    assert thinking.get_attribute("open") is None  # folded above the answer
    thought = thinking.find_element(By.CLASS_NAME, "thinking-text").get_attribute("textContent")
    assert thought == msg["reasoning_content"]
    assert stats.text.split()[0] == mode and "tok/s" in stats.text and "tokens/pass" in stats.text
    # every block pass of the answer was drawn: as many as the server's stats count
    drawn = passes(browser)
    assert drawn == api["clover_stats"]["block_passes"]
    if mode in ("draft-self", "diffusion"):
        assert drawn >= 1
    if mode == "auto":  # what auto chose; where it wrote no block, why, and how to see blocks
        assert "AR steps" in stats.text and "draft" in stats.text
        why = stats.find_elements(By.CLASS_NAME, "auto-why")
        drafts = int(re.search(r"AR steps, (\d+) drafts?", stats.text)[1])
        assert len(why) == (drafts == 0), stats.text
        if why:
            assert "Pick draft-self or diffusion in the mode menu to see the blocks" in why[0].text, why[0].text
    if mode == "ar":
        assert drawn == 0
    assert no_alert(browser)


def test_conversations_are_kept_in_the_browser_and_new_chat_starts_one(browser, model_server):
    open_page(browser, model_server.base)
    ask(browser, QUESTION)
    answered(browser)
    first = find(browser, "answer").text
    browser.refresh()  # kept in localStorage: the conversation is still there
    WebDriverWait(browser, WAIT).until(lambda d: found(d, "answer") and find(d, "answer").text == first)
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, "[data-role=user]")] == [QUESTION]
    assert found(browser, "stats") and found(browser, "thinking")
    find(browser, "new-chat").click()
    assert not found(browser, "answer") and browser.find_element(By.ID, "empty").is_displayed()
    ask(browser, "Count from 12 to 17.")
    answered(browser)
    rows = browser.find_elements(By.CSS_SELECTOR, ".chat-row .chat-open")
    assert sorted(r.text for r in rows) == sorted([QUESTION, "Count from 12 to 17."])
    next(r for r in rows if r.text == QUESTION).click()
    assert find(browser, "answer").text == first


def test_enter_sends_and_shift_enter_breaks_the_line(browser, model_server):
    open_page(browser, model_server.base)
    prompt = find(browser, "prompt")
    prompt.send_keys("What is")
    prompt.send_keys(Keys.SHIFT, Keys.ENTER)
    assert prompt.get_attribute("value") == "What is\n" and not browser.find_elements(By.CSS_SELECTOR, ".msg")
    prompt.send_keys(Keys.BACKSPACE, " 34 + 58?")
    prompt.send_keys(Keys.ENTER)
    answered(browser)
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, "[data-role=user]")] == [QUESTION]
    assert prompt.get_attribute("value") == ""


def test_a_375_pixel_screen(browser, model_server):
    open_page(browser, model_server.base, settings={"mode": "diffusion"}, width=375, height=740)
    ask(browser, QUESTION)
    answered(browser)
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 375, f"the page is {width} px wide on a 375 px screen"
    for testid in ("prompt", "send", "mode", "answer", "stats", "block-view"):
        box = browser.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.right]",
                                     find(browser, testid))
        assert 0 <= box[0] and box[1] <= 375, (testid, box)
    assert find(browser, "send").is_displayed()
    assert find(browser, "answer").text == _api_answer(model_server, "diffusion")["choices"][0]["message"]["content"]


MARKDOWN = """# Title *x*
Some **bold**, *em*, `code`, ~~gone~~ and snake_case_name.
Line two [link](https://example.com) and [bad](javascript:alert(1)) <b>raw</b>
https://a.b/c).

- one
- two
  - nested `x`
- three
1. first

> quoted **q**

| a | b |
|---|--:|
| 1 | 2 |
---
```python
print("<hi>")"""
# what the renderer must build, written out by hand (the last fence is still open: streamed code so far)
MARKDOWN_DOM = (
    '<h1>Title <em>x</em></h1><p>Some <strong>bold</strong>, <em>em</em>, <code>code</code>, <del>gone</del> and '
    'snake_case_name.<br>Line two <a href="https://example.com" rel="noopener noreferrer" target="_blank">link</a> '
    'and [bad](javascript:alert(1)) &lt;b&gt;raw&lt;/b&gt;<br><a href="https://a.b/c" rel="noopener noreferrer" '
    'target="_blank">https://a.b/c</a>).</p><ul><li><p>one</p></li><li><p>two</p><ul><li><p>nested <code>x</code>'
    '</p></li></ul></li><li><p>three</p></li></ul><ol><li><p>first</p></li></ol><blockquote><p>quoted <strong>q'
    '</strong></p></blockquote><div class="table"><table><thead><tr><th>a</th><th style="text-align: right;">b'
    '</th></tr></thead><tbody><tr><td>1</td><td style="text-align: right;">2</td></tr></tbody></table></div><hr>'
    '<div class="code"><div class="code-head"><span class="code-lang">python</span><button class="code-copy" '
    'type="button">Copy</button></div><pre><code>print("&lt;hi&gt;")</code></pre></div>')


def test_markdown_is_rendered_as_nodes(browser, model_server):
    open_page(browser, model_server.base)
    got = browser.execute_script("const root = document.createElement('div');"
                                 "CloverMarkdown.render(arguments[0], root); return root.innerHTML", MARKDOWN)
    assert got == MARKDOWN_DOM


# the work a render does, counted in characters: every string search (indexOf) from where it starts to where it stops,
# every regex run over the length of its input (test, exec, and what split/replace run through exec)
COUNTED_RENDER = """
const text = arguments[0];
let work = 0;
const indexOf = String.prototype.indexOf, exec = RegExp.prototype.exec;
String.prototype.indexOf = function (s, from) {
  const at = indexOf.call(this, s, from), start = Math.max(0, from | 0);
  work += (at < 0 ? this.length - start : at - start) + 1;
  return at;
};
RegExp.prototype.exec = function (input) { work += String(input).length + 1; return exec.call(this, input); };
const root = document.createElement('div');
try { CloverMarkdown.render(text, root); } finally {
  String.prototype.indexOf = indexOf; RegExp.prototype.exec = exec;
}
return [work, root.innerHTML.length, root.textContent];
"""


@pytest.mark.parametrize("unit", ["*a ", "_a ", "~~a ", "[a ", "**a "])
def test_markdown_work_grows_with_the_text_not_its_square(browser, unit):
    """Issue 68, cause 8: each emphasis opener searched to the text's end for a closer (and each '[' for its ']'),
    so "*a " x 16,000 took 3.6-5 s per render, 4x more at twice the length, and the page re-renders while streaming.
    The renderer's work, counted in characters searched, stays within a constant times the text's length; the text
    itself is all there."""
    s = _scripted_server(SlowRuntime)
    try:
        open_page(browser, s.base)
        for n in (4000, 16000):
            text = unit * n + ("]" if unit == "[a " else "")
            work, _, shown = browser.execute_script(COUNTED_RENDER, text)
            assert shown.replace("*", "") == text.replace("*", ""), (unit, n)  # "**a **a": "*a " emphasized
            assert work <= 40 * len(text), (unit, n, work, work / len(text))
        # and what it renders is what it rendered before: emphasis and links as the MARKDOWN test has them
        for text, want in (("*a *b* c*", "<p><em>a *b</em> c*</p>"), ("[a [b](https://x.y) c", '<p><a '
                           'href="https://x.y" rel="noopener noreferrer" target="_blank">a [b</a> c</p>'),
                           ("~~a ~~b~~", "<p><del>a ~~b</del></p>"), ("[x]\n(y)", "<p>[x]<br>(y)</p>")):
            got = browser.execute_script("const r = document.createElement('div'); CloverMarkdown.render(arguments[0], r);"
                                         "return r.innerHTML", text)
            assert got == want, (text, got)
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------------------------
# Stop, what answers may hold, the API key: scripted runtimes
# ---------------------------------------------------------------------------------------------------------------
class HtmlRuntime(SlowRuntime):
    """Answers with HTML and Markdown in it."""

    words = ["<img src=x onerror=alert(1)> ", "**bold** ", "<script>alert(2)</script>\n"]


class AutoARRuntime(SlowRuntime):
    """auto's answer on a CPU: AR steps only, with the pass costs it measured (a block pass at 9.34 AR steps);
    `drafts` set: an answer that drafted."""

    drafts = 0

    def stream_pieces(self, ids, max_new_tokens=1, mode="ar", **kw):
        for piece in super().stream_pieces(ids, max_new_tokens, mode, **kw):
            st = piece.stats
            st.ar_steps, st.drafts, st.block_pass_ar_steps = st.generated_tokens, self.drafts, 9.34
            yield piece


@pytest.mark.parametrize("drafts", [0, 2])
def test_auto_says_why_it_wrote_no_block_and_how_to_see_blocks(browser, drafts):
    """issue 64: on a CPU auto decodes AR, and the page showed "AR 28 · 28 AR steps" without a word of why or of how
    to see the block view. Under the stats: auto's measured cost of a block pass in AR steps and the modes that show
    blocks; nothing of it for an answer that drafted."""
    s = _scripted_server(type("R", (AutoARRuntime,), {"drafts": drafts}))
    try:
        open_page(browser, s.base, settings={"max_tokens": 6})
        Select(find(browser, "mode")).select_by_value("auto")
        ask(browser, "go")
        stats = answered(browser)
        why = stats.find_elements(By.CLASS_NAME, "auto-why")
        if drafts:
            assert not why, stats.text
            return
        assert len(why) == 1 and why[0].text == (
            "auto decoded AR: a block pass costs 9.3 AR steps on this machine (measured), more than its drafts would "
            "save. Pick draft-self or diffusion in the mode menu to see the blocks."), why[0].text
        assert why[0].location["y"] > stats.find_element(By.CLASS_NAME, "mode").location["y"]  # a line of its own
    finally:
        s.stop()


def _scripted_server(runtime_class, api_key=None):
    rts = []

    def factory():
        rts.append(runtime_class())
        return rts[-1]

    s = _Server(create_app(factory, mode="ar", parallel=1, api_key=api_key))
    s.runtimes = rts
    return s


@pytest.fixture()
def slow_server():
    s = _scripted_server(SlowRuntime)
    yield s
    s.stop()


def _slots(server, key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.base + "/slots", headers=headers, timeout=10).json()


def test_stop_aborts_the_request_and_frees_the_slot_at_once(browser, slow_server):
    rt = slow_server.runtimes[0]
    open_page(browser, slow_server.base)
    ask(browser, "go")  # an answer that never ends (no max_tokens: the scripted context is 10**6)
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.CSS_SELECTOR, ".answer").text.count("tok") >= 5)
    assert _slots(slow_server)[0]["state"] == "busy"
    find(browser, "stop").click()
    deadline = time.monotonic() + 1.0
    while _slots(slow_server)[0]["state"] != "idle":
        assert time.monotonic() < deadline, "the slot was still busy a second after stop"
        time.sleep(0.02)
    made = rt.produced
    time.sleep(0.3)  # nothing decodes any more: the token count stays where the stop left it
    assert rt.produced == made and made < 1000
    stats = answered(browser)
    assert "stopped" in stats.text
    assert find(browser, "send").is_displayed() and not find(browser, "stop").is_displayed()
    # the slot serves the next request
    r = httpx.post(slow_server.base + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "again"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok tok"


def test_what_the_user_and_the_model_write_is_shown_as_text(browser):
    s = _scripted_server(HtmlRuntime)
    try:
        open_page(browser, s.base, settings={"max_tokens": 6})
        attack = "<img src=x onerror=alert(1)> and <b>not bold</b>"
        ask(browser, attack)
        answered(browser)
        assert browser.find_element(By.CSS_SELECTOR, "[data-role=user]").text == attack
        answer = find(browser, "answer")
        text = answer.text
        assert "<img src=x onerror=alert(1)>" in text and "<script>alert(2)</script>" in text
        assert answer.find_elements(By.TAG_NAME, "strong")[0].text == "bold"  # Markdown is rendered
        messages = browser.find_element(By.ID, "messages")
        assert not messages.find_elements(By.CSS_SELECTOR, "img, script, b")
        assert no_alert(browser)
    finally:
        s.stop()


def test_the_api_key_is_asked_once_and_kept_for_the_tab(browser):
    s = _scripted_server(SlowRuntime, api_key=KEY)
    try:
        open_page(browser, s.base, settings={"max_tokens": 3})
        dialog = browser.find_element(By.ID, "key-dialog")
        assert dialog.is_displayed()
        find(browser, "api-key").send_keys("wrong-key", Keys.ENTER)
        WebDriverWait(browser, 10).until(lambda d: find(d, "api-key-error").is_displayed())
        assert dialog.is_displayed()
        find(browser, "api-key").send_keys(KEY, Keys.ENTER)
        WebDriverWait(browser, 10).until(lambda d: "ok" in d.find_element(By.ID, "status-dot").get_attribute("class"))
        assert not dialog.is_displayed()
        ask(browser, "hi")
        answered(browser)
        assert find(browser, "answer").text == "tok tok tok"
        browser.refresh()  # the same tab: not asked again
        WebDriverWait(browser, 10).until(lambda d: "ok" in d.find_element(By.ID, "status-dot").get_attribute("class"))
        assert not browser.find_element(By.ID, "key-dialog").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('clover-gguf.api-key')") == KEY
        kept = browser.execute_script("return Object.values(localStorage).join(' ')")
        assert KEY not in kept  # for the tab only, never in the conversations' storage
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------------------------
# The page's files, and the pictures docs/ shows
# ---------------------------------------------------------------------------------------------------------------
def test_the_page_is_served_without_the_key_and_builds_no_html_from_strings():
    s = _scripted_server(SlowRuntime, api_key=KEY)
    try:
        page = httpx.get(s.base + "/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert httpx.head(s.base + "/", timeout=10).status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for path in ("/static/app.js", "/static/markdown.js", "/static/style.css", "/static/icon.svg"):
            assert path in page.text and httpx.get(s.base + path, timeout=10).status_code == 200
        assert httpx.get(s.base + "/v1/models", timeout=10).status_code == 401  # the API still needs the key
        assert httpx.get(s.base + "/static/../pyproject.toml", timeout=10).status_code in (401, 404)
    finally:
        s.stop()
    static = Path(clover_gguf.serve.__file__).parent / "static"
    for js in static.glob("*.js"):
        code = js.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in code, f"{js.name} uses {sink}"
    # nothing from elsewhere: the page's own files only (it works offline)
    html = (static / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert refs and all(r.startswith("/static/") for r in refs), refs
    assert not re.search(r"url\(|@import", (static / "style.css").read_text())


class PacedRuntime:
    """The bundled model with each pass event held back a moment, so that a screenshot catches an answer mid-block."""

    def __init__(self, rt: CloverRuntime, delay: float):
        self.rt, self.delay = rt, delay

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def stream_pieces(self, ids, observe=None, **kw):
        def paced(ev):
            observe(ev)
            time.sleep(self.delay)

        return self.rt.stream_pieces(ids, observe=None if observe is None else paced, **kw)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_screenshots(browser, bundled_gguf):
    """docs/chat-page.png: an answer mid-block, its thinking folded; docs/chat-page-mobile.png: a finished answer on a
    375 px screen with its strip of blocks and one block opened."""
    out = Path(os.environ.get("CLOVER_GGUF_SCREENSHOTS") or tempfile.mkdtemp(prefix="clover-screens-"))
    out.mkdir(parents=True, exist_ok=True)
    rt = CloverRuntime(bundled_gguf, n_ctx=512, exact=True, keep_prefix=True, keep_prompt=True)
    s = _Server(create_app(lambda: PacedRuntime(rt, 0.6), mode="diffusion", parallel=1, model_id="tiny-clover"))
    try:
        # 16-position blocks: the first holds the thinking, the second fills over several passes
        open_page(browser, s.base, settings={"block_size": 16}, width=1000, height=600)
        ask(browser, "Count from 0 to 6.")
        WebDriverWait(browser, WAIT).until(lambda d: passes(d) >= 5)
        assert find(browser, "thinking").get_attribute("open") is None
        browser.save_screenshot(str(out / "chat-page.png"))
        answered(browser)
        assert _png_size(out / "chat-page.png") == (1000, 600)

        open_page(browser, s.base, width=375, height=740)
        s.app.state.pool.runtimes[0].delay = 0
        ask(browser, QUESTION)
        answered(browser)
        browser.find_element(By.CSS_SELECTOR, '[data-testid="block-view"] .chip:not(.ar)').click()
        browser.save_screenshot(str(out / "chat-page-mobile.png"))
        assert _png_size(out / "chat-page-mobile.png") == (375, 740)
        assert no_alert(browser)
    finally:
        s.stop()
