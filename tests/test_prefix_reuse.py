"""Prefix reuse in chat: each turn continues from the state kept after the previous turn's messages and decodes only
what is new, and its answers are the ones a full prefill gives (greedy, every mode, thinking on and off)."""

from __future__ import annotations

import io

import pytest

from clover_gguf.chat import ChatSession
from clover_gguf.decoding import MODES
from clover_gguf.llama_context import load_binding
from clover_gguf.runtime import CloverRuntime

FIVE_TURNS = ["What is 7 + 8?", "Count from 33 to 37.", "Reverse: c l o v e r", "What is 34 + 58?",
              "Count from 12 to 17."]


def _ask(http, messages, **fields) -> dict:
    """A chat request to a test server (fastapi's TestClient) -> its JSON answer; AR and 32 tokens unless `fields`
    say otherwise."""
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 32, "mode": "ar", **fields})
    assert r.status_code == 200, r.text
    return r.json()


DRAFT_NO_THINK = {"max_tokens": 48, "mode": "draft-self", "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("think", [True, False], ids=["think", "no-think"])
@pytest.mark.parametrize("mode", MODES)
def test_five_turns_with_reuse_answer_as_full_prefills_do(bundled_gguf, mode, think):
    out = io.StringIO()
    s = ChatSession(bundled_gguf, mode=mode, max_new_tokens=64, think=think, n_ctx=2048, json_stats=False,
                    inp=io.StringIO("".join(p + "\n" for p in FIVE_TURNS)), out=out)
    reused = []
    answer = s.answer

    def counted(text: str) -> None:
        answer(text)
        reused.append((s.last.reused_tokens, s.last.prompt_tokens))

    s.answer = counted
    s.loop()
    got = [m["content"] for m in s.messages if m["role"] == "assistant"]
    assert len(got) == 5
    # the first turn has nothing to continue from; every later one continues from everything before its own message
    assert reused[0][0] == 0 and all(0 < r < p for r, p in reused[1:]), reused
    with CloverRuntime(bundled_gguf, n_ctx=2048) as rt:  # no kept prefix: every turn prefilled whole
        for k in range(5):
            messages = s.messages[:2 * k + 1]
            full = rt.generate(messages, think=think, mode=mode, max_new_tokens=64)
            assert full.stats.reused_tokens == 0
            assert full.text == got[k], (mode, think, k)
            ids, keep = rt.prompt_and_keep(messages, think=think)
            assert len(ids) == reused[k][1]
            if k:  # what turn k reused is exactly where turn k - 1 kept its state: after its messages
                assert reused[k][0] == rt.prompt_and_keep(s.messages[:2 * k - 1], think=think)[1]


def test_reset_forgets_the_kept_prefix_and_the_stats_line_shows_reuse(bundled_gguf):
    out = io.StringIO()
    s = ChatSession(bundled_gguf, mode="ar", max_new_tokens=24, think=False, n_ctx=1024,
                    inp=io.StringIO("What is 7 + 8?\nCount from 3 to 6.\n/stats\n/reset\nWhat is 2 + 2?\n/stats\n"),
                    out=out)
    s.loop()
    text = out.getvalue()
    before, after = text.split("(conversation cleared)")
    assert "prompt tokens reused" in before  # the second turn continued from the first, and says so
    assert "reused" not in after  # after /reset nothing is kept
    assert s.last.reused_tokens == 0


def test_a_mode_switch_keeps_the_prefix(bundled_gguf):
    """/mode changes how the answer is decoded, not the prompt's causal pass: the next turn still continues from the
    kept state, and answers as a full prefill does in the new mode."""
    out = io.StringIO()
    s = ChatSession(bundled_gguf, mode="ar", max_new_tokens=48, think=False, n_ctx=1024,
                    inp=io.StringIO("What is 7 + 8?\n/mode diffusion\nCount from 33 to 37.\n"), out=out)
    s.loop()
    assert s.mode == "diffusion" and s.last.mode == "diffusion" and s.last.reused_tokens > 0
    with CloverRuntime(bundled_gguf, n_ctx=1024) as rt:
        full = rt.generate(s.messages[:3], think=False, mode="diffusion", max_new_tokens=48)
    assert full.text == s.messages[3]["content"]


def test_a_closed_runtime_says_so(bundled_gguf):
    """After close, the runtime refuses with one line instead of reading freed memory (it used to crash)."""
    from clover_gguf.errors import UserError

    rt = CloverRuntime(bundled_gguf, n_ctx=256)
    rt.close()
    with pytest.raises(UserError, match="closed"):
        rt.prompt_ids("hi")
    with pytest.raises(UserError, match="closed"):
        rt.generate("hi", mode="ar", max_new_tokens=2)


def test_the_server_continues_a_conversation_from_the_slots_kept_state(bundled_gguf):
    """A chat request that extends the slot's last conversation continues from its kept state: the usage says how
    many prompt tokens (OpenAI's prompt_tokens_details.cached_tokens), and the answer is the full prefill's."""
    from fastapi.testclient import TestClient

    from clover_gguf.serve import create_app

    first = [{"role": "user", "content": "What is 7 + 8?"}]
    with TestClient(create_app(bundled_gguf, mode="ar", parallel=1, ctx=1024)) as http:
        a = _ask(http, first, **DRAFT_NO_THINK)
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "Count from 33 to 37."}]
        b = _ask(http, second, **DRAFT_NO_THINK)
    assert 0 < b["usage"]["prompt_tokens_details"]["cached_tokens"] < b["usage"]["prompt_tokens"]
    with CloverRuntime(bundled_gguf, n_ctx=1024) as rt:
        full = rt.generate(second, think=False, mode="draft-self", max_new_tokens=48)
    assert b["choices"][0]["message"]["content"] == full.text


def test_a_conversations_next_request_goes_to_the_slot_that_holds_it(bundled_gguf):
    """Two slots: the first request runs on one, which then goes to the back of the free list; the conversation's
    next request still gets that slot (FIFO alone would give it the other one) and continues from its state."""
    from fastapi.testclient import TestClient

    from clover_gguf.serve import create_app

    first = [{"role": "user", "content": "What is 7 + 8?"}]
    with TestClient(create_app(bundled_gguf, mode="ar", parallel=2, ctx=1024)) as http:
        a = _ask(http, first)
        b = _ask(http, first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                               {"role": "user", "content": "Count from 33 to 37."}])
        other = _ask(http, [{"role": "user", "content": "Reverse: c l o v e r"}])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("mode,rollback", [("ar", "redecode"), ("diffusion", "redecode"), ("draft-self", "snapshot")])
def test_the_same_question_again_goes_to_the_slot_that_holds_it(bundled_gguf, mode, rollback):
    """A repeated request (the same messages) continues, on the slot that holds it, from the state kept after its
    messages the second time, and from the state kept before its prompt's last token from the third time on (one token
    decoded); the answer is the first time's, in every mode."""
    from fastapi.testclient import TestClient

    from clover_gguf.serve import create_app

    q = [{"role": "user", "content": "What is 7 + 8?"}]
    with TestClient(create_app(bundled_gguf, mode="ar", parallel=2, ctx=1024,
                               runtime_kwargs={"rollback": rollback})) as http:
        a, b, c = (_ask(http, q, mode=mode) for _ in range(3))
    n = a["usage"]["prompt_tokens"]
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a, c)] == [0, n - 1]
    assert 0 < b["usage"]["prompt_tokens_details"]["cached_tokens"] < n - 1
    assert a["choices"][0]["message"] == b["choices"][0]["message"] == c["choices"][0]["message"]


def test_a_new_conversation_takes_a_slot_whose_state_is_spare():
    """Free slots holding A, A and B (B free the longest): a request of a third conversation takes one of A's two
    slots, not B's, whose state no other slot keeps; A's next request still finds a slot holding it, and a slot that
    holds nothing goes before any."""
    import asyncio

    from clover_gguf.serve.slots import _FreeSlots

    class Slot:
        def __init__(self, name, served):
            self.name, self.served = name, served

    a, b, c = ([{"role": "user", "content": x}] for x in "ABC")

    async def take(slots, messages):
        free = _FreeSlots(slots)
        return (await free.get(messages)).name

    slots = [Slot("b", b), Slot("a1", a), Slot("a2", a)]
    assert asyncio.run(take(slots, c)) == "a1"
    assert asyncio.run(take(slots, a)) == "a1"  # its own state first
    assert asyncio.run(take([Slot("b", b), Slot("empty", None)], c)) == "empty"
    assert asyncio.run(take([Slot("b", b), Slot("c", c)], a)) == "b"  # nothing spare: the one free the longest


@pytest.mark.parametrize("parallel,rollback,mode", [(1, "redecode", "ar"), (2, "redecode", "ar"),
                                                    (2, "snapshot", "draft-self")])
def test_a_conversation_continues_from_the_state_cache_on_any_slot(bundled_gguf, parallel, rollback, mode):
    """One slot per conversation is not enough: A, then as many other conversations as there are slots (each takes
    a slot and drops the state kept there), then A's next turn. With the state cache (serve's --cache-ram) the dropped
    state was saved in host memory and A's next turn continues from it, on whichever slot, and answers exactly as
    when prefilled whole; without it (0) it is prefilled whole."""
    from fastapi.testclient import TestClient

    from clover_gguf.serve import create_app

    first = [{"role": "user", "content": "What is 7 + 8?"}]
    others = [[{"role": "user", "content": f"Reverse: {w}"}] for w in ("c l o v e r", "g g u f")[:parallel]]
    answers = {}
    for cache in (0, 2**26):
        with TestClient(create_app(bundled_gguf, mode="ar", parallel=parallel, ctx=1024,
                                   runtime_kwargs={"cache_ram": cache, "rollback": rollback})) as http:
            a = _ask(http, first, mode=mode)
            for o in others:
                _ask(http, o, mode=mode)
            follow = first + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "Count from 33 to 37."}]
            answers[cache] = _ask(http, follow, mode=mode)
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reused = answers[2**26]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < reused < answers[2**26]["usage"]["prompt_tokens"]
    assert answers[2**26]["choices"][0]["message"] == answers[0]["choices"][0]["message"]


def test_the_state_cache_keeps_the_longest_prefix_within_its_budget():
    """StateCache: the longest kept prefix that a prompt goes on past; least recently used entries go first when the
    budget is full; an entry larger than the budget is not kept."""
    from clover_gguf.state_cache import StateCache

    c = StateCache(10)
    c.put([1, 2], b"ab")
    c.put([1, 2, 3], b"abc")
    c.put([7], b"x" * 11)  # over the budget: not kept
    assert len(c) == 2 and c.bytes == 5
    assert c.get([1, 2, 3]) == ([1, 2], b"ab")  # [1, 2, 3] itself is not a prefix the prompt goes on past
    assert c.get([1, 2, 3, 4]) == ([1, 2, 3], b"abc")
    assert c.get([5, 6]) is None and c.hits == 2
    c.put([1, 2, 3], b"ABC")  # replaced
    assert c.bytes == 5 and c.get([1, 2, 3, 4]) == ([1, 2, 3], b"ABC")
    assert c.refresh([1, 2]) and not c.refresh([9])
    c = StateCache(10)
    c.put([1], b"aaaa")
    c.put([2], b"bbbb")
    assert c.get([1, 0]) == ([1], b"aaaa")  # used: [2] is now the least recently used
    c.put([3], b"cccc")  # 12 bytes > 10: [2] goes
    assert c.get([2, 0]) is None and c.get([1, 0]) and c.get([3, 0]) == ([3], b"cccc")


def test_a_kept_prompt_serves_the_same_prompt_again_and_moves_to_the_cache_with_its_conversation(bundled_gguf):
    """keep_prompt (serve's runtimes): a prompt whose messages were seen before (it continues from their kept state)
    also keeps the state before its last token, so from its third time on the same prompt decodes one token, and
    answers as the first time; a prompt seen the first time keeps its turn only (no pass more for it). When the
    conversation goes on, its earlier prompt is dropped (nothing would use it but a regenerated earlier turn); when the
    slot moves on to another conversation, both kept states go to the state cache, and the same prompt again, on a
    slot that holds nothing of it, comes back from there with its one token to decode."""
    def ask(rt, messages):
        ids, keep = rt.prompt_and_keep(messages, think=False)
        text = "".join(t for t, _ in rt.stream_ids(ids, mode="ar", max_new_tokens=12, keep=keep))
        return text, rt.backend.reused, len(ids), keep

    first = [{"role": "user", "content": "What is 7 + 8?"}]
    with CloverRuntime(bundled_gguf, n_ctx=1024, keep_prefix=True, keep_prompt=True, cache_ram=2**26) as rt:
        cache = rt.backend.state_cache
        a, reused, n, keep = ask(rt, first)
        assert reused == 0 and not rt.backend.prompt_kept  # the first time: its turn is kept, not its prompt
        assert ask(rt, first)[:3] == (a, keep, n)  # the second time: from its turn; its prompt is kept now
        assert ask(rt, first)[:3] == (a, n - 1, n)  # the third time: one token decoded
        second = first + [{"role": "assistant", "content": a}, {"role": "user", "content": "Count from 33 to 37."}]
        b, reused, n2, keep2 = ask(rt, second)
        assert 0 < reused < keep2  # the conversation goes on from its turn boundary
        assert len(cache) == 0  # the first prompt was dropped, not stashed
        assert ask(rt, second)[:2] == (b, keep2)  # the second time: its prompt kept
        other = ask(rt, [{"role": "user", "content": "Reverse: c l o v e r"}])
        assert other[1] == 0 and len(cache) == 2  # moved on: the second turn's prefix and prompt went to the cache
        assert ask(rt, second)[:3] == (b, n2 - 1, n2)  # back from the cache, one token decoded
        third = second + [{"role": "assistant", "content": b}, {"role": "user", "content": "What is 34 + 58?"}]
        c, reused, _, _ = ask(rt, third)
        assert reused == keep2  # the next turn: the second turn's boundary, from the cache
    with CloverRuntime(bundled_gguf, n_ctx=1024) as rt:  # nothing kept: every prompt decoded whole
        for messages, want in ((first, a), (second, b), (third, c)):
            assert ask(rt, messages)[:2] == (want, 0)


def test_a_raw_prompt_keeps_its_prompt_for_the_same_or_a_longer_one(bundled_gguf):
    """A raw prompt (no chat turn to keep) keeps the state before its last token every time: the same prompt again
    decodes one token, and a longer prompt that goes on from it continues from there; both answer as when prefilled
    whole."""
    def ask(rt, text):
        ids = rt.raw_prompt_ids(text)
        out = "".join(t for t, _ in rt.stream_ids(ids, mode="ar", max_new_tokens=8))
        return out, rt.backend.reused, len(ids)

    short, longer = "<|im_start|>user\nWhat is 7 + 8?", "<|im_start|>user\nWhat is 7 + 8?<|im_end|>\n<|im_start|>assistant\n"
    with CloverRuntime(bundled_gguf, n_ctx=1024, keep_prefix=True, keep_prompt=True) as rt:
        a, reused, n = ask(rt, short)
        assert reused == 0
        assert ask(rt, short) == (a, n - 1, n)
        b, reused, _ = ask(rt, longer)
        assert reused == n - 1
    with CloverRuntime(bundled_gguf, n_ctx=1024) as rt:
        assert ask(rt, short)[:2] == (a, 0) and ask(rt, longer)[:2] == (b, 0)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_kept_prompt_attaches_its_sampler_before_its_first_pass(bundled_gguf, monkeypatch, slots):
    """A prompt decoded in parts (its turn kept, then the rest) gets its selection sampler before the first part: a
    sampler attached to llama.cpp makes it re-reserve its compute buffers at the next decode, and attached only before
    the last part it threw away the buffers the long first part had touched (the next turns' passes then faulted in
    fresh pages: 2.4x llama-server's wait on a continuing turn at 37K tokens of context). The next turn, same
    settings, attaches nothing. Also on a slot of a shared context (serve --parallel), whose prompt parts share the
    scheduler's decodes."""
    with CloverRuntime(bundled_gguf, n_ctx=1024, keep_prefix=True, keep_prompt=True, slots=slots) as rt:
        L = load_binding()
        calls: list[str] = []
        set_sampler, decode = L.llama_set_sampler, L.llama_decode

        def on_set(*a):
            calls.append("set_sampler")
            return set_sampler(*a)

        def on_decode(*a):
            calls.append("decode")
            return decode(*a)

        monkeypatch.setattr(L, "llama_set_sampler", on_set)
        monkeypatch.setattr(L, "llama_decode", on_decode)

        def ask(messages):
            calls.clear()
            ids, keep = rt.prompt_and_keep(messages, think=False)
            text = "".join(t for t, _ in rt.stream_ids(ids, mode="ar", max_new_tokens=4, keep=keep))
            return text, keep, len(ids)

        first = [{"role": "user", "content": "What is 7 + 8?"}]
        a, keep, n = ask(first)
        assert 0 < keep < n and rt.backend.prefix  # decoded in two parts, the turn kept between them
        assert calls[:3] == ["set_sampler", "decode", "decode"], calls
        second = first + [{"role": "assistant", "content": a}, {"role": "user", "content": "Count from 3 to 6."}]
        ask(second)
        assert rt.backend.reused == keep and calls.count("decode") >= 2
        assert "set_sampler" not in calls, calls


def test_an_agent_turn_is_tokenized_once_and_kept_where_its_messages_end(tool_gguf):
    """An agent resends 17K-45K tokens every turn, and llama.cpp's tokenizer takes 25-45 ms for 38K of them:
    prompt_and_keep tokenizes the prompt once and finds the kept position from the generation prompt's own tokens.
    The position is checked against the independent reading (the rendering without the generation prompt, tokenized
    on its own) on every turn of the recorded Qwen Code session (chat completions, its tools, tool results) as serve
    prepares it, and on a plain chat with thinking on and off."""
    from bench_scripts import load_bench

    from clover_gguf.serve import tools as serve_tools
    from clover_gguf.serve.core import chat_plan, normalize_roles

    store = load_bench("session_store.py")
    _, requests = store.load(store.file_of("qwen-code"))
    with CloverRuntime(tool_gguf, n_ctx=512) as rt:
        cases = []
        for req in requests:
            plan = chat_plan(req["body"], None, "ar")  # as serve's precheck prepares it (its size check left out)
            messages, tools = serve_tools.for_template(rt, normalize_roles(plan.messages), plan.template_tools)
            cases.append((messages, plan.think, tools))
        cases += [([{"role": "user", "content": "What is 7 + 8?"}, {"role": "assistant", "content": "15"},
                    {"role": "user", "content": "And 8 + 9?"}], think, None) for think in (True, False)]
        tokenize = rt.ctx.tokenize
        for messages, think, tools in cases:
            texts = []
            rt.ctx.tokenize = lambda text, special=True: texts.append(text) or tokenize(text, special)
            ids, keep = rt.prompt_and_keep(messages, think=think, tools=tools)
            rt.ctx.tokenize = tokenize
            prompt = rt.render(messages, think=think, tools=tools)
            assert sum(map(len, texts)) < len(prompt) + 200  # the prompt once, and the generation prompt's text
            history = tokenize(rt.render(messages, think=think, add_generation_prompt=False, tools=tools), True)
            assert keep == len(history) and ids[:keep] == history and ids == tokenize(prompt, True)
        assert len(cases) >= 8 and max(len(c[0]) for c in cases) > 10
