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

    def __call__(self, ev: dict) -> None:
        ev = json.loads(json.dumps(ev))  # plain data: survives JSON unchanged
        kind = ev["type"]
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
        elif kind == "ar":
            self.answer.append(ev["token"])
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
