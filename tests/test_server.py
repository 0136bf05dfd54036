"""`clover-gguf serve`: the OpenAI-compatible server, through the official `openai` client and raw HTTP.

Runs on the bundled trained tiny Clover (clover_gguf/assets/tiny-clover, converted to F32 once per session), or on
a random tiny checkpoint where the asset is missing. Servers run uvicorn in a background thread on a free loopback
port. A scripted runtime (SlowRuntime) stands in for the model where a test needs an answer that never ends.
"""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import clover_gguf  # noqa: E402
from clover_gguf.controls import Controls  # noqa: E402
from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.errors import UserError  # noqa: E402
from clover_gguf.runtime import Piece, RunStats  # noqa: E402
from clover_gguf.serve import create_app  # noqa: E402
from clover_gguf.thinking import split_thinking  # noqa: E402

ASSET = Path(clover_gguf.__file__).parent / "assets" / "tiny-clover"
KEY = "test-key-123"
TIMEOUT = 60


@pytest.fixture(scope="session")
def served_model(make_checkpoint, tmp_path_factory, request) -> tuple[Path, list[str]]:
    """-> (GGUF, prompts): the bundled trained model and its eval prompts, else a random tiny model."""
    out = tmp_path_factory.mktemp("serve") / "model.gguf"
    if (ASSET / "config.json").is_file():
        out = request.getfixturevalue("bundled_gguf")
        prompts = [r["prompt"] for r in request.getfixturevalue("bundled_eval")[::19]][:8]
    else:
        convert(make_checkpoint(seed=1), out, outtype="f32", quiet=True)
        prompts = ["Count from 3 to 9.", "What is 5 + 4?", "Reverse: a b c", "Copy: q r s", "Keys: cup=4. What is cup?",
                   "Count from 10 to 14.", "What is 12 + 30?", "Copy: x y"]
    return out, prompts


class _Server:
    def __init__(self, app):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key or "none", timeout=TIMEOUT, max_retries=0)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def wait_idle(self, seconds: float = 60.0) -> dict:  # a hang guard: it returns as soon as the slots are idle
        deadline = time.monotonic() + seconds
        while True:
            h = self.health()
            if h["slots_idle"] == h["slots_total"] or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self) -> None:
        for job in list(self.app.state.pool.jobs):  # nothing may outlive the test
            job.cancel()
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def server(served_model):
    """Two slots, an API key, a 256-token context; exact arithmetic so ar and draft-self can be compared."""
    app = create_app(served_model[0], mode="draft-self", api_key=KEY, parallel=2, ctx=256,
                     runtime_kwargs={"exact": True})
    s = _Server(app)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompts(served_model) -> list[str]:
    return served_model[1]


def _ask(client, prompt: str, **kw):
    extra = {k: kw.pop(k) for k in ("mode", "block_size", "threshold", "think", "top_k") if k in kw}
    return client.chat.completions.create(model="clover", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=kw.pop("max_tokens", 40), extra_body=extra or None, **kw)


def _ask_streamed(client, prompt: str, **kw) -> tuple[str, str, str, list]:
    """-> (reasoning, content, finish_reason, chunks) of a streamed chat completion."""
    extra = {k: kw.pop(k) for k in ("mode", "block_size") if k in kw}
    chunks = list(client.chat.completions.create(
        model="clover", messages=[{"role": "user", "content": prompt}], max_tokens=kw.pop("max_tokens", 40),
        stream=True, extra_body=extra or None, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return reasoning, content, finish[0], chunks


# ---------------------------------------------------------------------------------------------------------------
# The official client, streamed and not
# ---------------------------------------------------------------------------------------------------------------
def test_chat_completion_with_the_openai_client(server, prompts):
    client = server.client()
    raw = client.chat.completions.with_raw_response.create(
        model="clover", messages=[{"role": "user", "content": prompts[0]}], max_tokens=40)
    r = raw.parse()
    msg = r.choices[0].message
    assert r.object == "chat.completion" and r.model == server.health()["model"]
    assert msg.role == "assistant" and msg.content
    assert "<think>" not in msg.content and "</think>" not in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["clover_stats"]
    assert stats["mode"] == "draft-self" and stats["generated_tokens"] == r.usage.completion_tokens
    assert stats["forward_passes"] > 0
    assert json.loads(raw.headers["x-clover-stats"]) == stats
    if (ASSET / "config.json").is_file():  # the trained model thinks, then answers
        assert msg.reasoning_content == "Let me work it out."
        assert r.choices[0].finish_reason == "stop"


def test_streamed_chat_equals_the_whole_answer(server, prompts):
    client = server.client()
    whole = _ask(client, prompts[1], mode="ar")
    reasoning, content, finish, chunks = _ask_streamed(client, prompts[1], mode="ar",
                                                       stream_options={"include_usage": True})
    assert content == whole.choices[0].message.content
    assert reasoning == whole.choices[0].message.reasoning_content
    assert finish == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert any("clover_stats" in (c.model_extra or {}) for c in chunks)
    # the wire format: server-sent events, ending with [DONE]
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": prompts[1]}], "max_tokens": 8, "stream": True,
                            "mode": "ar"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"


def test_completions_models_and_health(server, prompts):
    client = server.client()
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == server.health()["model"]
    prompt = f"<|im_start|>user\n{prompts[2]}<|im_end|>\n<|im_start|>assistant\n"
    c = client.completions.create(model=models[0].id, prompt=prompt, max_tokens=40, extra_body={"mode": "ar"})
    assert c.object == "text_completion" and c.choices[0].text and c.usage.completion_tokens > 0
    chat = _ask(client, prompts[2], mode="ar")
    thinking, answer = split_thinking(c.choices[0].text)
    assert answer == chat.choices[0].message.content and thinking == chat.choices[0].message.reasoning_content
    streamed = client.completions.create(model=models[0].id, prompt=prompt, max_tokens=40, stream=True,
                                         extra_body={"mode": "ar"})
    assert "".join(x.choices[0].text for x in streamed if x.choices) == c.choices[0].text
    h = server.health()
    assert h["status"] == "ok" and h["slots_total"] == 2


def test_stop_strings_cut_the_answer(server, prompts):
    client = server.client()
    full = _ask(client, prompts[0], mode="ar").choices[0].message.content
    assert len(full) >= 4, full
    stop = full[2:4]
    cut = full[:full.index(stop)].strip()
    r = _ask(client, prompts[0], mode="ar", stop=[stop, "never-appears"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.model_extra["clover_stats"]["stop_string"] == stop
    _, content, finish, _ = _ask_streamed(client, prompts[0], mode="ar", stop=stop)
    assert content == cut and finish == "stop"


# ---------------------------------------------------------------------------------------------------------------
# Decoding modes and concurrency
# ---------------------------------------------------------------------------------------------------------------
def test_greedy_ar_and_draft_self_give_the_same_text(server, prompts):
    client = server.client()
    for p in prompts[:3]:
        ar = _ask(client, p, mode="ar", max_tokens=32)
        ds = _ask(client, p, mode="draft-self", max_tokens=32, block_size=8)
        assert ds.choices[0].message.content == ar.choices[0].message.content
        assert ds.choices[0].message.reasoning_content == ar.choices[0].message.reasoning_content
        assert ds.model_extra["clover_stats"]["mode"] == "draft-self"
        # AR: the prompt's pass, then one per token but the last when the length limit ended it (no end token)
        stop = ar.choices[0].finish_reason == "stop"
        assert ar.model_extra["clover_stats"]["forward_passes"] == ar.usage.completion_tokens + stop


def test_the_slots_share_one_context(server):
    """--parallel 2: one llama.cpp context (the weights held once), each slot on its own sequences."""
    a, b = server.app.state.pool.runtimes
    assert a.ctx.ctx and a.ctx.ctx == b.ctx.ctx and a.ctx.scheduler is b.ctx.scheduler
    assert (a.ctx._seq(0), b.ctx._seq(0)) == (0, 5)  # five sequences a slot (runtime.slot_sequences)


def test_eight_concurrent_clients_get_their_own_answers(server, prompts):
    modes = ["ar", "draft-self", "diffusion", "draft-self"]
    jobs = [(prompts[i % len(prompts)], modes[i % 4], i % 2 == 1) for i in range(8)]

    def one(job):
        prompt, mode, stream = job
        client = server.client()
        if stream:
            r, c, f, _ = _ask_streamed(client, prompt, mode=mode, block_size=8, max_tokens=24)
            return r, c, f
        a = _ask(client, prompt, mode=mode, block_size=8, max_tokens=24)
        return a.choices[0].message.reasoning_content, a.choices[0].message.content, a.choices[0].finish_reason

    alone = [one(j) for j in jobs]
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, jobs, timeout=120))
    assert together == alone
    assert server.wait_idle()["slots_idle"] == 2


def test_a_disconnect_mid_stream_leaves_the_server_serving(server, prompts):
    body = {"messages": [{"role": "user", "content": prompts[3]}], "max_tokens": 200, "stream": True,
            "mode": "diffusion", "block_size": 4}
    with httpx.Client(timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"}) as http:
        with http.stream("POST", server.base + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk, then hang up
    assert server.wait_idle()["slots_idle"] == 2
    r = _ask(server.client(), prompts[3], mode="ar", max_tokens=24)
    assert r.choices[0].message.content


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------
def test_api_key_is_required(server, prompts):
    with pytest.raises(openai.AuthenticationError):
        _ask(server.client(key="wrong"), prompts[0])
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/v1/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # health needs no key


def test_context_overflow_is_a_400_with_the_reason(server, prompts):
    """A prompt that leaves no room in the context is refused; max_tokens past the room it leaves is taken (the
    answer stops at the context: tests/test_serve_apis.py)."""
    client = server.client()
    too_long = prompts[0] * 40
    with pytest.raises(openai.BadRequestError, match=r"more than the context"):
        _ask(client, too_long, max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match=r"more than the context"):  # before any stream starts
        _ask_streamed(client, too_long, max_tokens=1000)
    assert _ask(client, prompts[0], max_tokens=1000).choices[0].finish_reason in ("stop", "length")
    assert server.wait_idle()["slots_idle"] == 2


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "mode": "fast"}, 400, "mode"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "at most 16"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}, 400, "without streaming"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "grammar": "root ::= (bad"}, 400, "GBNF"),
    ({"messages": [{"role": "user", "content": "hi"}], "json_schema": {"type": 123}}, 400, "compiled"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object", "schema": 123}},
     400, "JSON schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "grammar": "root ::= \"a\"", "json_schema": {}}, 400,
     "give one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
])
def test_malformed_requests_are_refused_with_the_reason(server, body, status, words):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        r = httpx.post(server.base + "/v1/chat/completions", content=body, headers=headers, timeout=TIMEOUT)
    else:
        r = httpx.post(server.base + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_block_modes_need_the_clover_extras(make_checkpoint, tmp_path):
    plain = tmp_path / "plain.gguf"
    convert(make_checkpoint(seed=2, plain_qwen=True), plain, outtype="f32", quiet=True)
    with pytest.raises(UserError, match="--mode ar"):
        create_app(plain, mode="draft-self")
    from fastapi.testclient import TestClient

    with TestClient(create_app(plain, mode="ar")) as http:
        ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert ok.status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                    "mode": "draft-self"})
        assert r.status_code == 400 and "block-mode" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------------------------
# Cancellation, on a scripted runtime whose answers never end
# ---------------------------------------------------------------------------------------------------------------
class SlowRuntime:
    """Just enough of CloverRuntime for the server: one word per 10 ms, counted."""

    block_mode, block_size, context_length, n_ctx = True, 4, 10**6, 10**6
    controls = Controls()
    meta: dict = {}
    words = ["tok "]  # the answer, repeated
    step_s = 0.01  # seconds a word
    opens_thinking = False  # what thinking_at_start says about every prompt

    def __init__(self):
        self.produced = 0

    def prompt_ids(self, messages, think=True):
        return self.raw_prompt_ids(" ".join(m["content"] for m in messages))

    def raw_prompt_ids(self, text):
        return list(range(max(1, len(text.split()))))

    def thinking_at_start(self, ids):
        return self.opens_thinking

    def check_request(self, n_prompt, max_new_tokens, mode, block_size):
        pass

    def stream_pieces(self, ids, max_new_tokens=1, mode="ar", **kw):
        stats = RunStats(mode=mode, prompt_tokens=len(ids))
        for i in range(max_new_tokens):
            time.sleep(self.step_s)
            self.produced += 1
            stats.generated_tokens = i + 1
            stats.finish_reason = "length" if i + 1 == max_new_tokens else None
            yield Piece(self.words[i % len(self.words)], stats, [i])

    def close(self):
        pass


@pytest.fixture()
def slow_server():
    rts: list[SlowRuntime] = []

    def factory():
        rts.append(SlowRuntime())
        return rts[-1]

    s = _Server(create_app(factory, mode="ar", parallel=1))
    s.runtimes = rts
    yield s
    s.stop()


def test_a_disconnect_stops_the_decode_and_frees_the_slot(slow_server):
    rt = slow_server.runtimes[0]
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100000, "stream": True}
    with httpx.stream("POST", slow_server.base + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(6)]
    assert any("tok" in g for g in got)
    assert slow_server.wait_idle()["slots_idle"] == 1
    n = rt.produced
    time.sleep(0.3)
    assert rt.produced == n < 1000  # the worker stopped
    # a non-streamed request whose client gives up is stopped too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(slow_server.base + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    assert slow_server.wait_idle()["slots_idle"] == 1
    n = rt.produced
    time.sleep(0.3)
    assert rt.produced == n
    r = slow_server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "go"}],
                                                     max_tokens=3)
    assert r.choices[0].message.content == "tok tok tok" and r.choices[0].finish_reason == "length"


def test_requests_wait_for_the_one_slot(slow_server):
    client = slow_server.client()

    def one(_):
        return client.chat.completions.create(model="x", messages=[{"role": "user", "content": "go"}],
                                              max_tokens=20).choices[0].message.content

    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(one, i) for i in range(3)]
        deadline = time.monotonic() + 5
        waited = 0
        while time.monotonic() < deadline and not all(f.done() for f in futs):
            waited = max(waited, slow_server.health()["requests_waiting"])
            time.sleep(0.01)
        outs = [f.result(timeout=TIMEOUT) for f in futs]
    assert outs == [" ".join(["tok"] * 20)] * 3
    assert waited >= 1


def test_the_server_splits_thinking_by_the_prompts_rule():
    """A prompt that opened <think> (the runtime says so): `plan</think>answer` is reasoning "plan", content
    "answer", streamed or not, however the text is cut into pieces."""
    from fastapi.testclient import TestClient

    class Thinker(SlowRuntime):
        words = ["pl", "an</th", "ink>ans", "wer"]
        opens_thinking = True

    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4}
    with TestClient(create_app(Thinker, mode="ar")) as http:
        msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("plan", "answer")
        events = [json.loads(x[6:]) for x in http.post("/v1/chat/completions", json={**body, "stream": True}
                                                       ).text.splitlines() if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "plan"
        assert "".join(d.get("content") or "" for d in deltas) == "answer"


def _metrics(server) -> dict[str, float]:
    r = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_and_slots(server, prompts):
    """/metrics (Prometheus text) counts what the requests' own stats say; /slots shows each slot; both need the key."""
    assert httpx.get(server.base + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.base + "/slots", timeout=10).status_code == 401
    server.wait_idle()
    before = _metrics(server)
    modes = ("ar", "draft-self", "auto")
    answers = [_ask(server.client(), p, mode=m, max_tokens=16) for p, m in zip(prompts[:3], modes)]
    server.wait_idle()
    after = _metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    for a, m in zip(answers, modes):
        st = a.model_extra["clover_stats"]
        assert st["mode"] == m
    assert sum(delta(f'clover_requests_total{{mode="{m}",finish="{f}"}}') for m in modes
               for f in ("stop", "length")) == 3
    # what auto chose, as its stats say and /metrics counts
    auto = answers[2].model_extra["clover_stats"]
    assert auto["ar_steps"] + auto["drafts"] > 0 and auto["measured_tokens_per_s"] > 0
    for field in ("ar_steps", "drafts", "block_passes"):
        assert delta(f'clover_{field}_total{{mode="auto"}}') == auto[field], field
    assert delta('clover_auto_measured_seconds_total{mode="auto"}') > 0
    assert delta('clover_generated_tokens_total{mode="ar"}') == answers[0].usage.completion_tokens
    assert delta('clover_forward_passes_total{mode="draft-self"}') == \
        answers[1].model_extra["clover_stats"]["forward_passes"]
    assert after['clover_slots{state="idle"}'] == 2 and after["clover_requests_waiting"] == 0
    # the stall guard (threads.StallGuard): its drops as the answers' stats count them, the threads passes run with now
    assert sum(delta(f'clover_thread_drops_total{{mode="{m}"}}') for m in modes) == \
        sum(a.model_extra["clover_stats"]["thread_drops"] for a in answers)
    assert after['clover_threads{pass="one_token"}'] >= 1 and after['clover_threads{pass="batch"}'] >= 1
    # the scheduler's steps: each ran at least one llama_decode, and their time in llama.cpp is counted
    assert delta("clover_llama_decodes_total") >= delta("clover_batch_steps_total") > 0
    assert delta("clover_batch_run_seconds_total") > 0 and delta("clover_batch_wait_seconds_total") >= 0
    assert "clover_state_cache_bytes" in after and "clover_state_cache_hits_total" in after  # serve's default cache
    _ask(server.client(), prompts[0], mode="ar", max_tokens=4)  # its messages seen before: its prompt is kept too
    server.wait_idle()
    slots = httpx.get(server.base + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["state"] == "idle" for s in slots)
    # a chat request's states: before its prompt's last token, and after its messages (none when the prompt's state
    # came from the state cache: this module's earlier tests asked these prompts too)
    assert any(s["kept_prefix_tokens"] < s["kept_prompt_tokens"] and s["kept_messages"] == 1 for s in slots), slots


def test_a_whole_answer_is_posted_to_the_event_loop_once():
    """Not streamed: the worker posts the answer's text with its end (one event-loop wake-up per request, not one
    per token); streamed: every delta as it comes. The end (and a held text) reaches the client only when the slot
    is free (Job.finish, after Pool's give_back), so that the client's next request finds its slot free."""
    import asyncio

    from clover_gguf.serve.slots import Job

    loop = asyncio.new_event_loop()
    try:
        for stream, before, after in (
                (False, [], [("delta", "a", "bc", [1, 2]), ("done", "stop", {}, {})]),
                (True, [("delta", "a", "b", [1]), ("delta", "", "c", [2])], [("done", "stop", {}, {})])):
            job = Job(loop, stream=stream)
            job.emit("delta", "a", "b", [1])  # the last item: the tokens' logprob entries, joined when held
            job.emit("delta", "", "c", [2])
            job.emit("done", "stop", {}, {})
            loop.run_until_complete(asyncio.sleep(0))  # runs the posted callbacks
            assert [job.events.get_nowait() for _ in range(job.events.qsize())] == before
            loop.call_soon(job.finish)  # what Pool.start's give_back does after putting the slot back
            loop.run_until_complete(asyncio.sleep(0))
            assert [job.events.get_nowait() for _ in range(job.events.qsize())] == after
    finally:
        loop.close()


def test_the_answer_ends_after_its_slot_is_free():
    """A client that sends its next request the moment it reads an answer finds the slot that answered free: the
    pool gives the slot back before the answer's end is posted."""
    import asyncio
    import threading

    from clover_gguf.errors import UserError
    from clover_gguf.serve.slots import Plan, Pool

    go = threading.Event()

    class Slot:  # a runtime that answers at once (with a refusal: the end of an answer all the same)
        served = None

        def prompt_ids(self, messages, think=True):
            go.wait(10)
            raise UserError("refused")

    seen = []

    async def main():
        pool = Pool([Slot()])
        rt = await pool.acquire()
        job = pool.start(rt, Plan(mode="ar", messages=[{"role": "user", "content": "hi"}]))

        class Events(asyncio.Queue):  # what the client would read, and whether the slot was free when it came
            def put_nowait(self, ev):
                seen.append((ev[0], pool.idle))
                super().put_nowait(ev)

        job.events = Events()
        go.set()
        while (await job.events.get())[0] not in ("done", "error"):
            pass
        pool.close()

    asyncio.run(main())
    assert seen == [("error", 1)]
