"""The block view's events (decoding.generate's `observe`, serve's `clover_blocks`): replayed by an independent reader
they give back the answer token for token, and they count what the stats count; asking for them changes nothing.

The decoder side runs on test_decoding's scripted models; the API side (tests/test_server.py's servers) on the bundled
tiny Clover, through raw HTTP and the openai client's raw stream.
"""

import inspect
import itertools
import json

import pytest

from clover_gguf.decoding import generate, generate_all
from test_decoding import EOS, PROMPT, FakeBackend, _draft_backend, _HashModel


class Replay:
    """Reads the events as the page does, from nothing else: each block's slots filled pass by pass, a draft's kept
    tokens up to its cut, a diffusion block whole at its commit, AR steps' tokens. -> the answer's tokens."""

    def __init__(self, eos: frozenset[int]):
        self.eos, self.answer, self.block, self.counts = eos, [], None, {}
        self.texts: dict[int, str] = {}  # token -> its text, where the events say (serve's)

    def __call__(self, ev: dict) -> None:
        ev = json.loads(json.dumps(ev))  # plain data: survives JSON unchanged
        kind = ev["type"]
        self.texts.update(zip(ev.get("tokens", []), ev.get("texts", [])))
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "block":
            assert self.block is None or self.block["kind"] == "diffusion" and None not in self.block["slots"]
            assert ev["start"] == len(self.answer)
            slots = [None] * ev["size"]
            for i, t in zip(ev["known"], ev["tokens"]):
                slots[i] = t
            self.block = {"kind": ev["kind"], "slots": slots, "passes": 0}
        elif kind == "pass":
            slots = self.block["slots"]
            assert ev["filled"], "a pass fills at least one position"
            for i, t in zip(ev["filled"], ev["tokens"]):
                assert slots[i] is None, f"position {i} filled twice"
                slots[i] = t
            masked = [i for i, t in enumerate(slots) if t is None]
            assert ev["masked"] == masked[:len(ev["masked"])] and set(ev["masked"]) <= set(masked)
            self.block["passes"] += 1
        elif kind == "verify":
            assert self.block["kind"] == "draft"
            kept = self.block["slots"][:ev["cut"]]
            assert None not in kept and len(kept) == 1 + ev["accepted"] and ev["accepted"] <= ev["drafted"]
            assert ev["ended"] == (kept[-1] in self.eos)
            self.answer += kept[:-1] if ev["ended"] else kept
            self.block = None
        elif kind == "commit":
            assert self.block["kind"] == "diffusion" and None not in self.block["slots"]
            self.answer += self.block["slots"]
            self.block = None
        elif kind == "ar":  # the decoder's one step, or serve's run of them
            self.answer += ev["tokens"] if "tokens" in ev else [ev["token"]]
            self.counts["ar"] += ev.get("steps", 1) - 1
        else:
            raise AssertionError(f"unknown event {ev}")

    def close(self) -> list[int]:
        """The answer; a diffusion block that ended the answer has no commit pass: its tokens up to the end token."""
        if self.block is not None and self.block["kind"] == "diffusion":
            slots = self.block["slots"]
            end = next(i for i, t in enumerate(slots) if t is not None and t in self.eos)
            assert None not in slots[:end]
            self.answer += slots[:end]
        return self.answer


@pytest.mark.parametrize("mode", ["diffusion", "draft-self", "auto", "ar"])
@pytest.mark.parametrize("seed", range(6))
def test_replayed_events_give_the_answer_and_the_stats_counts(mode, seed):
    m = _HashModel(seed)

    def clock():  # auto's choices from a clock that ticks per call, the same in both runs
        ticks = itertools.count()
        return lambda: next(ticks) * 1e-3

    plain, plain_stats = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode=mode, max_new_tokens=60,
                                      clock=clock())
    replay = Replay(frozenset({EOS}))
    tokens, stats = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode=mode, max_new_tokens=60,
                                 observe=replay, clock=clock())
    assert stats.finish_reason == "stop"  # the model ends after about 15 tokens: every event's block is complete
    assert tokens == plain and stats == plain_stats  # observing changes nothing
    assert replay.close() == tokens
    c = replay.counts
    assert c.get("pass", 0) == stats.block_passes
    assert c.get("verify", 0) == stats.drafts
    assert c.get("ar", 0) == stats.ar_steps
    if mode == "diffusion":
        assert c["block"] == c.get("commit", 0) + 1  # the last block ends the answer uncommitted
    if mode in ("diffusion", "draft-self"):
        assert stats.block_passes > 0
    if mode == "ar":
        assert set(c) == {"ar"}


def test_a_rejected_draft_is_cut_where_the_causal_pass_disagrees():
    be = _draft_backend([5, 6, 7, 3, 9, 1], [5, 6, 7, 8, 9])
    events = []
    tokens, stats = generate_all(be, PROMPT, mode="draft-self", max_new_tokens=20, observe=events.append)
    assert tokens == [5, 6, 7, 8, 9]
    first = next(e for e in events if e["type"] == "verify")
    # pending 5, drafted 6 7 3 ...: 6 and 7 accepted, the causal pass says 8 where the draft says 3
    assert (first["accepted"], first["cut"], first["next"], first["ended"]) == (2, 3, 8, False)
    block = next(e for e in events if e["type"] == "block")
    assert block["kind"] == "draft" and block["known"] == [0] and block["tokens"] == [5]


def test_events_are_plain_data_and_none_is_the_default():
    m = _HashModel(3)
    events = []
    for chunk in generate(FakeBackend(m.causal, m.block), PROMPT, mode="auto", max_new_tokens=40,
                          observe=events.append):
        pass
    assert events and all(json.loads(json.dumps(e)) == e for e in events)
    assert {e["type"] for e in events} <= {"block", "pass", "verify", "commit", "ar"}
    assert inspect.signature(generate).parameters["observe"].default is None


# ---------------------------------------------------------------------------------------------------------------
# Through the API: `clover_blocks: true` on a streamed request (docs/serve.md)
# ---------------------------------------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from clover_gguf.serve import create_app  # noqa: E402
from clover_gguf.thinking import split_thinking  # noqa: E402
from test_server import KEY, TIMEOUT, _Server  # noqa: E402

QUESTION = "What is 34 + 58?"


@pytest.fixture(scope="module")
def server(bundled_gguf):
    s = _Server(create_app(bundled_gguf, mode="auto", api_key=KEY, parallel=1, ctx=512,
                           runtime_kwargs={"exact": True}))
    yield s
    s.stop()


def _stream(server, body: dict, path: str = "/v1/chat/completions") -> list[dict]:
    """-> the stream's chunks (JSON), read raw."""
    with httpx.stream("POST", server.base + path, json=body, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        lines = [x[6:] for x in r.iter_lines() if x]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _chat(mode: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "mode": mode, **extra}


@pytest.mark.parametrize("mode", ["diffusion", "draft-self", "auto", "ar"])
def test_the_stream_carries_each_pass_and_they_give_the_answer(server, mode):
    whole = httpx.post(server.base + "/v1/chat/completions", json=_chat(mode), timeout=TIMEOUT,
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    chunks = _stream(server, _chat(mode, stream=True, clover_blocks=True))
    replay = Replay(frozenset(server.app.state.pool.runtimes[0].eos_ids))
    reasoning, content = "", ""
    for c in chunks:
        for ev in c.get("clover_blocks", []):
            replay(ev)
        if c["choices"]:
            delta = c["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            if "clover_blocks" in c:  # an empty delta: a client that reads only the text sees nothing
                assert delta == {} and c["choices"][0]["finish_reason"] is None
    stats = chunks[-1]["clover_stats"]
    msg = whole["choices"][0]["message"]
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])  # the field changes no text
    # the answer rebuilt from the events alone, token by token and as text, is the one streamed
    tokens = replay.close()
    assert len(tokens) == stats["generated_tokens"]
    raw = "".join(replay.texts[t] for t in tokens)
    assert split_thinking(raw, True) == (msg["reasoning_content"], msg["content"])
    assert replay.counts.get("pass", 0) == stats["block_passes"]
    assert replay.counts.get("verify", 0) == stats["drafts"]
    assert replay.counts.get("ar", 0) == stats["ar_steps"]
    if mode in ("diffusion", "draft-self"):
        assert stats["block_passes"] >= 1


def test_passes_go_out_live_when_slow_and_with_the_text_when_fast():
    """serve.slots.BlockEvents on a clock the test moves: a pass FRAME_S after the last post goes out at once, faster
    ones wait for the next text (flush); AR steps are summed per run, AR_RUN at most."""
    from clover_gguf.serve.slots import AR_RUN, FRAME_S, BlockEvents

    class Job:
        posted: list = []

        def emit(self, kind, events):
            assert kind == "blocks"
            self.posted.append(events)

    now = [0.0]
    job = Job()
    view = BlockEvents(job, clock=lambda: now[0])
    view({"type": "block"})
    view({"type": "pass"})
    assert job.posted == []  # within a frame of the start: held
    now[0] += FRAME_S
    view({"type": "pass"})  # a slow pass: out at once, with what was held
    assert [[e["type"] for e in p] for p in job.posted] == [["block", "pass", "pass"]]
    view({"type": "verify"})
    view.flush()  # the worker's, before the text of the piece
    assert [e["type"] for e in job.posted[-1]] == ["verify"]
    for i in range(AR_RUN + 3):
        view({"type": "ar", "token": i, "text": str(i)})
    view.flush()  # a full run goes out with the text; the open one waits for the run's end
    assert job.posted[-1] == [{"type": "ar", "steps": AR_RUN, "tokens": list(range(AR_RUN)),
                               "texts": [str(i) for i in range(AR_RUN)]}]
    view.flush(end=True)
    rest = range(AR_RUN, AR_RUN + 3)
    assert job.posted[-1] == [{"type": "ar", "steps": 3, "tokens": list(rest), "texts": [str(i) for i in rest]}]
    assert len(job.posted) == 4
    # a step that carried tokens a grammar forced: they follow its token in the run, and `forced` counts them
    view({"type": "ar", "token": 7, "text": "7", "forced": [8, 9], "forced_texts": ["8", "9"]})
    view({"type": "ar", "token": 1, "text": "1"})
    view.flush(end=True)
    assert job.posted[-1] == [{"type": "ar", "steps": 2, "tokens": [7, 8, 9, 1], "texts": ["7", "8", "9", "1"],
                               "forced": 2}]


def test_without_the_field_the_stream_is_unchanged(server):
    chunks = _stream(server, _chat("draft-self", stream=True))
    assert not any("clover_blocks" in c for c in chunks)
    assert all(c["choices"] == [] or c["choices"][0]["delta"] or c["choices"][0]["finish_reason"] for c in chunks)


def test_the_openai_client_reads_a_stream_with_the_field(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    plain = client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}],
                                           extra_body={"mode": "diffusion"})
    chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}],
                                                 stream=True, extra_body={"mode": "diffusion", "clover_blocks": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    events = [e for c in chunks for e in (c.model_extra or {}).get("clover_blocks", [])]
    assert [e["type"] for e in events][:2] == ["block", "pass"]


def test_raw_completions_carry_the_field_too(server):
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    chunks = _stream(server, {"prompt": prompt, "mode": "draft-self", "stream": True, "clover_blocks": True},
                     "/v1/completions")
    events = [e for c in chunks for e in c.get("clover_blocks", [])]
    assert {"block", "pass", "verify"} <= {e["type"] for e in events}
    assert all(c["object"] == "text_completion" for c in chunks)


def test_the_field_is_refused_where_it_cannot_apply(server):
    r = httpx.post(server.base + "/v1/chat/completions", json=_chat("draft-self", clover_blocks=True),
                   timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "clover_blocks"
    assert "stream" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/chat/completions", json=_chat("draft-self", stream=True, clover_blocks="maybe"),
                   timeout=TIMEOUT, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    assert server.wait_idle()["slots_idle"] == 1
