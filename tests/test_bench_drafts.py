"""bench/drafts.py: --by-position's count (one block pass per stride of the answer, its greedy choice against the
answer's token at each block position, and the agreeing prefix a verification would keep) and --oracle's drafter
(every draft the answer's next block, whole, in one block pass)."""

from __future__ import annotations

import numpy as np

from bench_scripts import load_bench

drafts = load_bench("drafts.py")

B, V, MASK = 4, 50, 49


class Backend:
    """A block pass proposes the answer's tokens for its first `sees` positions after the given one, then token 0."""

    mask_token_id = MASK
    block_size = B

    def __init__(self, answer: list[int], prompt: list[int], sees: int):
        self.answer, self.prompt, self.sees, self.past = answer, prompt, sees, []

    def reset(self) -> None:
        self.past = []

    def prefill(self, ids) -> None:
        self.past = list(ids)

    def block_logits(self, block) -> np.ndarray:
        start = len(self.past) - len(self.prompt)
        assert self.past[:len(self.prompt)] == self.prompt and block[0] == self.answer[start]
        assert list(block[1:]) == [MASK] * (B - 1)
        out = np.zeros((B, V), dtype=np.float32)
        for j in range(1, B):
            out[j, self.answer[start + j] if j <= self.sees else 0] = 1.0
        return out


def test_one_pass_agreement_counts_by_position_and_the_agreeing_prefix():
    # 11 tokens: passes at 0, 3 and 6 with stride 3 (one at 9 would run past the answer)
    prompt, answer = [40, 41], list(range(1, 12))
    hits, tries, prefixes = drafts.one_pass_agreement(Backend(answer, prompt, sees=2), prompt, answer, B, stride=3)
    assert tries == [0, 3, 3, 3] and hits == [0, 3, 3, 0] and prefixes == [2, 2, 2]
    hits, tries, prefixes = drafts.one_pass_agreement(Backend(answer, prompt, sees=0), prompt, answer, B, stride=3)
    assert hits == [0, 0, 0, 0] and prefixes == [0, 0, 0]


class Causal:
    """A backend whose causal rows choose the token at each position by a rule (an answer of `length` tokens, then
    the end token); its block passes are counted and say nothing (an Oracle drops their rows)."""

    mask_token_id, eos_ids, block_size, n_vocab = MASK, frozenset({48}), B, V

    def __init__(self, n_prompt: int, length: int):
        self.n_prompt, self.length, self.past, self.block_passes, self.keep_backup = n_prompt, length, [], 0, True

    @property
    def n_past(self) -> int:
        return len(self.past)

    def token_at(self, pos: int) -> int:
        return 48 if pos >= self.n_prompt + self.length else (pos * 7) % 40 + 1

    def _rows(self, first: int, n: int) -> np.ndarray:
        out = np.zeros((n, V), dtype=np.float32)
        for i in range(n):
            out[i, self.token_at(first + i)] = 5.0
        return out

    def reset(self) -> None:
        self.past = []

    def prefill(self, ids) -> np.ndarray:
        self.past += list(ids)
        return self._rows(len(self.past), 1)[0]

    def commit(self, ids) -> np.ndarray:
        first = len(self.past) + 1
        self.past += list(ids)
        return self._rows(first, len(ids))

    def rollback(self, n: int) -> None:
        del self.past[len(self.past) - n:]

    def settle(self) -> None:
        pass

    def block_logits(self, block) -> np.ndarray:
        self.block_passes += 1
        return np.zeros((len(block), V), dtype=np.float32)


def test_the_oracle_drafts_the_answer_whole_in_one_block_pass_a_draft():
    prompt = [40, 41, 42]
    for length in (0, 1, 3, 4, 10, 13):
        backend = Causal(len(prompt), length)
        answer, got = drafts.oracle_row(backend, prompt, max_new=64)
        assert answer == [backend.token_at(len(prompt) + i) for i in range(length)]
        toks, stats, _ = got["draft-self"]
        assert toks == got["ar"][0] == answer
        # every draft is B tokens of the answer (the last one up to its end token; an end token right after a
        # draft is its verification's choice), in one block pass, every proposal accepted
        drafts_made = -(-length // B)
        assert stats.drafts == stats.block_passes == backend.block_passes == drafts_made
        assert stats.accepted_tokens == stats.drafted_tokens == length - drafts_made + (length % B != 0)
