"""bench/drafts.py --by-position's count: one block pass per stride of the answer, its greedy choice against the
answer's token at each block position, and the agreeing prefix a verification would keep."""

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
