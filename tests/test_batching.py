"""serve's slots on one llama.cpp context (clover_gguf.batching): the slots' AR steps share llama_decode calls, a prompt
is prefilled in chunks between the others' steps, and every request's greedy answer is the one it gets alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from clover_gguf.controls import Gather
from clover_gguf.runtime import CloverRuntime

PROMPTS = ["What is 7 + 8?", "Count from 33 to 37.", "Reverse: c l o v e r", "What is 34 + 58?",
           "Count from 12 to 17.", "What is 2 + 2?", "Count from 3 to 9.", "Reverse: g g u f"]
MODES = ["ar", "draft-self", "ar", "diffusion", "ar", "ar", "draft-self", "ar"]
LENGTHS = [48, 24, 64, 32, 17, 40, 56, 30]


def _slots(gguf, n: int, **kw) -> list[CloverRuntime]:
    first = CloverRuntime(gguf, n_ctx=512, keep_prefix=True, slots=n, **kw)
    return [first] + [CloverRuntime(gguf, n_ctx=512, keep_prefix=True, slot_of=first, **kw) for _ in range(n - 1)]


def _answer(rt: CloverRuntime, k: int, think: bool = False) -> tuple[str, int]:
    a = rt.generate(PROMPTS[k], think=think, mode=MODES[k], max_new_tokens=LENGTHS[k], block_size=8)
    return a.raw, a.stats.generated_tokens


@pytest.fixture(scope="module")
def alone(bundled_gguf) -> list[tuple[str, int]]:
    """Each request on a runtime of its own."""
    with CloverRuntime(bundled_gguf, n_ctx=512) as rt:
        return [_answer(rt, k) for k in range(len(PROMPTS))]


@pytest.mark.parametrize("n", [2, 5, 8])
def test_concurrent_requests_answer_as_alone_and_share_decodes(bundled_gguf, alone, n):
    rts = _slots(bundled_gguf, n)
    sched = rts[0].ctx.scheduler
    try:
        assert len({id(rt.ctx.ctx) for rt in rts}) == 1  # one llama.cpp context
        with ThreadPoolExecutor(n) as ex:
            def serve(k: int) -> tuple[str, int]:
                rt = rts[k % n]
                with rt.ctx.serving():
                    return _answer(rt, k)

            # requests beyond n wait for a slot: run them in rounds of n
            got = []
            for r in range(0, len(PROMPTS), n):
                got += list(ex.map(serve, range(r, min(r + n, len(PROMPTS))), timeout=300))
    finally:
        for rt in rts:
            rt.close()
    assert got == alone
    # the slots' AR steps shared llama_decode calls
    assert sched.widest >= 2 and sched.decodes < sum(t for _, t in alone) + len(PROMPTS) * 4


def test_constrained_requests_with_forced_tokens_answer_as_alone(bundled_gguf):
    """A json_schema answer and a tool call (llguidance) on 3 slots at once, ar, draft-self and auto: their AR steps
    carry the tokens the grammar forces (passes of several rows beside the other slots' one-row steps), and each
    answer (and its forced count, but auto's) are the ones it gets alone."""
    from test_runtime_constrained import real_grammars

    jobs = [(k, name, mode) for k, (name, mode) in enumerate(
        [("schema", "ar"), ("tool_call", "ar"), ("schema", "draft-self"), ("tool_call", "auto"), ("tool_call", "ar"),
         ("schema", "ar")])]

    def run(rt, make, k, mode):
        toks, st = [], None
        for piece in rt.stream_pieces(rt.prompt_ids(PROMPTS[k], think=False), mode=mode, max_new_tokens=60,
                                      constraint=make()):
            toks += piece.tokens
            st = piece.stats
        return toks, st.forced_tokens if mode != "auto" else 1  # auto's count follows its (timed) choices

    with CloverRuntime(bundled_gguf, n_ctx=512) as rt:
        makes = real_grammars(rt)
        want = [run(rt, makes[name], k, mode) for k, name, mode in jobs]
    rts = _slots(bundled_gguf, 3)
    try:
        makes = real_grammars(rts[0])
        with ThreadPoolExecutor(3) as ex:
            def serve(job) -> tuple[list[int], int]:
                k, name, mode = job
                rt = rts[k % 3]
                with rt.ctx.serving():
                    return run(rt, makes[name], k, mode)

            got = []
            for r in range(0, len(jobs), 3):
                got += list(ex.map(serve, jobs[r:r + 3], timeout=300))
    finally:
        for rt in rts:
            rt.close()
    assert got == want and all(f > 0 for _, f in got)


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(bundled_gguf):
    rts = _slots(bundled_gguf, 2)
    sched = rts[0].ctx.scheduler
    sched.prefill_chunk = 16
    long_messages = [{"role": "user", "content": "Count from 1 to 40: " + " ".join(map(str, range(1, 41)))}]
    try:
        with CloverRuntime(bundled_gguf, n_ctx=512) as solo:
            want_long = solo.generate(long_messages, think=False, mode="ar", max_new_tokens=8).raw
            want_short = solo.generate(PROMPTS[0], think=False, mode="ar", max_new_tokens=64).raw
            n_prompt = len(solo.prompt_ids(long_messages, think=False))
        steps_seen = []

        def short() -> str:
            with rts[0].ctx.serving():
                return rts[0].generate(PROMPTS[0], think=False, mode="ar", max_new_tokens=64).raw

        def long() -> str:
            with rts[1].ctx.serving():
                steps_seen.append(sched.steps)
                out = rts[1].generate(long_messages, think=False, mode="ar", max_new_tokens=8).raw
                steps_seen.append(sched.steps)
                return out

        with ThreadPoolExecutor(2) as ex:
            a, b = ex.submit(short), ex.submit(long)
            assert (a.result(timeout=120), b.result(timeout=120)) == (want_short, want_long)
        assert n_prompt > 3 * 16
        assert steps_seen[1] - steps_seen[0] >= n_prompt // 16  # a chunk per step, not the prompt in one
    finally:
        for rt in rts:
            rt.close()


def test_merged_rows_go_to_their_own_sequences(bundled_gguf):
    """decode_parts: each token's row is its own sequence's, selected by its own sampler (libclover_sampler): three
    sequences given different prompts, then one step each in one decode, equal the same steps decoded one at a time
    (and a planted swap of two steps' rows fails this)."""
    rts = _slots(bundled_gguf, 3)
    try:
        ctx = rts[0].ctx.scheduler.ctx
        seqs = [rt.ctx._seq(0) for rt in rts]
        prompts = [rts[0].prompt_ids(PROMPTS[k], think=False) for k in (0, 1, 2)]
        g = Gather(np.array([1, 2, 3], dtype=np.int32), 1, 32, probs=True)
        one_by_one = []
        for s, ids in zip(seqs, prompts):  # the step alone on a copy (the recurrent state cannot be rewound)
            ctx.decode(ids[:-1], 0, s, logits=False)
            ctx.seq_cp(s, s + 2)
            one_by_one.append(ctx.decode(ids[-1:], len(ids) - 1, s + 2, gather=g))
        merged = ctx.decode_parts([(ids[-1:], len(ids) - 1, s, g) for s, ids in zip(seqs, prompts)])
        best = []
        for a, b in zip(one_by_one, merged):
            for f in ("at_ids", "rest_logits", "rest_probs"):
                # one row or three in a matmul: llama.cpp sums in another order (about 1e-4 here)
                np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=0, atol=1e-3)
            np.testing.assert_array_equal(a.rest_ids, b.rest_ids)
            best.append(int(b.rest_ids[0, np.argmax(b.rest_logits[0])]))
        assert len(set(best)) > 1  # different rows: a mix-up would show
    finally:
        for rt in rts:
            rt.close()


def test_a_cancelled_request_stops_between_prompt_chunks_and_the_slot_serves_on(bundled_gguf, alone):
    from clover_gguf.batching import Cancelled

    rts = _slots(bundled_gguf, 2)
    sched = rts[0].ctx.scheduler
    sched.prefill_chunk = 8
    asked = []
    long_messages = [{"role": "user", "content": "Count from 1 to 40: " + " ".join(map(str, range(1, 41)))}]
    try:
        with rts[1].ctx.serving(lambda: asked.append(1) or len(asked) > 1):  # cancelled from the second check on
            with pytest.raises(Cancelled):
                rts[1].generate(long_messages, think=False, mode="ar", max_new_tokens=8)
        assert len(asked) == 2  # two chunks decoded, not the whole prompt
        with rts[1].ctx.serving():
            assert _answer(rts[1], 0) == alone[0]
    finally:
        for rt in rts:
            rt.close()


def test_a_decode_is_charged_to_its_passes_by_their_tokens():
    """auto's clock in serve (SlotContext.cost_clock): a shared decode costs each pass its share by tokens, a pass
    alone its whole decode."""
    from clover_gguf.batching import Scheduler, _Pass

    sched = Scheduler.__new__(Scheduler)  # _finish alone: no context, no thread
    sched.decodes = 0
    shared = [_Pass(part=([5], 0, 0, None)), _Pass(part=([1, 2, 3], 0, 1, None))]
    sched._finish(shared, lambda: (time.sleep(0.08), [1, 2])[1])
    assert shared[1].seconds == pytest.approx(3 * shared[0].seconds)
    assert shared[0].seconds + shared[1].seconds >= 0.08
    alone = [_Pass(fn=lambda: None)]
    sched._finish(alone, lambda: (time.sleep(0.02), [0])[1])
    assert alone[0].seconds >= 0.02
