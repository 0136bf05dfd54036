"""The reference model against transformers' Qwen3.5-MoE (causal) and against the block-mode spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clover_gguf.reference import CloverModel, ReferenceBackend, coreset_keep_mask

PROMPT = [11, 57, 203, 4, 99, 150, 7, 7, 300, 12, 45, 88, 260]  # longer than the conv kernel (4)


def _transformers_logits(path, ids):
    from transformers import Qwen3_5MoeForCausalLM

    hf, info = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # every weight really loaded
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("opts", [dict(preset="tiny"), pytest.param(dict(preset="wide", tie=True), marks=pytest.mark.slow)],
                         ids=["tiny", "wide-tied"])
def test_causal_logits_equal_transformers(make_checkpoint, opts):
    clover = make_checkpoint(seed=3, zero_extras=True, **opts)
    plain = make_checkpoint(seed=3, plain_qwen=True, **opts)  # same seed: the same shared tensors, no extras
    model = CloverModel.from_pretrained(clover)
    assert model.cfg.linear_num_key_heads != model.cfg.linear_num_value_heads
    with torch.no_grad():
        ours = model(PROMPT)
    ref = _transformers_logits(plain, PROMPT)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def model(tiny):
    return CloverModel.from_pretrained(tiny, dtype=torch.float64)


def test_block_is_bidirectional(model):
    prefix, block = PROMPT[:5], [model.cfg.mask_token_id] * 8
    with torch.no_grad():
        base = model.block_logits(prefix, block, coreset=False)
        changed = list(block)
        changed[6] = 42  # a later block position
        other = model.block_logits(prefix, changed, coreset=False)
    # positions left of the change see it (causal mode could not)
    assert (base[:6] - other[:6]).abs().max().item() > 1e-6


def test_tokens_after_the_block_change_nothing(model):
    """Causal mode is causal, and block logits depend only on the prefix and the block itself."""
    seq = PROMPT + [5, 6, 7]
    with torch.no_grad():
        a = model(seq)
        b = model(seq[:-3] + [9, 9, 9])
        assert torch.equal(a[: len(PROMPT)], b[: len(PROMPT)])
        _, st = model.prefill(PROMPT[:5])
        x = model.block_logits(None, PROMPT[5:], state=st, coreset=False)
        y = model.block_logits(PROMPT[:5], PROMPT[5:], coreset=False)
    assert torch.allclose(x, y, atol=1e-12)


def test_block_leaves_prefix_state_untouched(model):
    with torch.no_grad():
        _, st = model.prefill(PROMPT)
        before = [tuple(None if t is None else t.clone() for t in (s.k, s.v, s.conv, s.ssm)) for s in st.layers]
        model.block_logits(None, [model.cfg.mask_token_id] * 6, state=st)
        after = [(s.k, s.v, s.conv, s.ssm) for s in st.layers]
    for b, a in zip(before, after):
        for x, y in zip(b, a):
            assert (x is None and y is None) or torch.equal(x, y)
    assert st.n_past == len(PROMPT)


def test_committed_block_equals_token_by_token(model):
    with torch.no_grad():
        _, st = model.prefill(PROMPT[:4])
        logits_block, st_block = model.prefill(PROMPT[4:], st)
        st_tok = st
        for t in PROMPT[4:]:
            last, st_tok = model.prefill([t], st_tok)
    assert torch.allclose(logits_block[-1], last[-1], atol=1e-9)
    for a, b in zip(st_block.layers, st_tok.layers):
        for x, y in zip((a.k, a.v, a.conv, a.ssm), (b.k, b.v, b.conv, b.ssm)):
            assert (x is None and y is None) or torch.allclose(x, y, atol=1e-9)


def test_coreset_top_p_one_equals_no_coreset(model):
    prefix, block = PROMPT[:6], PROMPT[6:] + [model.cfg.mask_token_id] * 3
    with torch.no_grad():
        off = model.block_logits(prefix, block, coreset=False)
        full = model.block_logits(prefix, block, coreset=1.0)
        narrow = model.block_logits(prefix, block, coreset=0.3)
    assert torch.allclose(off, full, atol=1e-12)
    assert (off - narrow).abs().max().item() > 1e-6  # the coreset really restricts routing


def test_coreset_size_monotone_and_at_least_top_k():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n_tok, n_exp, k = 1 + trial % 7, 16, 4
        probs = torch.randn(n_tok, n_exp, generator=gen).mul(2).softmax(-1)
        sizes = [int(coreset_keep_mask(probs, k, p).sum()) for p in (1.0, 0.95, 0.9, 0.7, 0.5, 0.2, 0.01)]
        assert all(a >= b for a, b in zip(sizes, sizes[1:])), sizes
        assert min(sizes) >= k
        candidates = probs.topk(k, dim=-1).indices.unique().numel()
        assert sizes[0] == candidates  # top_p = 1 keeps every candidate, nothing else


def test_reference_backend_rollback_equals_a_fresh_prefix(make_checkpoint):
    torch.set_num_threads(1)
    model = CloverModel.from_pretrained(make_checkpoint(seed=1), dtype=torch.float64)
    be = ReferenceBackend(model)
    ids = [5, 9, 13, 200, 41, 7, 88, 19]
    be.prefill(ids[:3])
    be.commit(ids[3:])
    be.rollback(3)
    assert be.n_past == 5
    blk = [be.mask_token_id] * 4
    a, b = be.commit([77]), be.block_logits(blk)
    fresh = ReferenceBackend(model)
    fresh.prefill(ids[:5])
    assert np.allclose(a, fresh.commit([77]), atol=1e-10)
    assert np.allclose(b, fresh.block_logits(blk), atol=1e-10)
    before = be.n_past
    be.block_logits(blk)
    assert be.n_past == before  # block mode commits nothing
