"""The committed tiny Clover (clover_gguf/assets/tiny-clover) keeps the figures docs/tiny-model.md states, with
the reference model and clover_gguf.decoding, on the whole held-out eval set (150 rows; about 30 s on one core).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from clover_gguf.testing.train_tiny import (ASSET_DIR, TASKS, fast_path, load_tiny, parallel_delta_rule,  # noqa: E402
                                            evaluate_rows)

TARGET_ACCURACY = 0.95
MIN_TOKENS_PER_PASS = 3.0


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok, rows = load_tiny(ASSET_DIR)
    return model, tok, rows


@pytest.fixture(scope="module")
def ar_result(tiny):
    model, tok, rows = tiny
    return evaluate_rows(model, tok, rows, mode="ar")


def test_asset_is_a_complete_small_checkpoint():
    names = {p.name for p in ASSET_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "eval.jsonl"} <= names
    assert "train_state.pt" not in names
    assert sum(p.stat().st_size for p in ASSET_DIR.iterdir()) < 8 * 2**20
    cfg = json.loads((ASSET_DIR / "config.json").read_text())
    gen = json.loads((ASSET_DIR / "generation_config.json").read_text())
    vocab = json.loads((ASSET_DIR / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert cfg["model_type"] == "clover" and cfg["block_size"] == 32
    assert cfg["mask_token_id"] == ids["<|mask|>"]
    assert sorted(gen["eos_token_id"]) == sorted([ids["<|im_end|>"], ids["<|endoftext|>"]])
    assert cfg["linear_num_key_heads"] < cfg["linear_num_value_heads"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"]
    rows = [json.loads(line) for line in (ASSET_DIR / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 30 * len(TASKS) and all(set(r) == {"prompt", "answer"} for r in rows)


def test_clover_extras_are_trained_and_non_zero(tiny):
    model = tiny[0]
    for layer in model.layers:
        if layer.full_attention:
            continue
        la = layer.linear_attn
        for t in (la.conv1d_right, la.block_attn_log_scale, la.block_attn_gate):
            assert t.abs().sum() > 0


def test_training_fast_path_equals_the_reference_loop(tiny):
    """The parallel delta rule and dense MoE used for training compute the reference model's function."""
    model = tiny[0].double()
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.cfg.vocab_size - 8, (2, 30), generator=g)
        blk = ids[:, :32].clone()
        blk[:, ::2] = model.cfg.mask_token_id
        with torch.no_grad():
            a, st = model.run(ids[:, :17])
            b, _ = model.run(blk, st, block=True)
            with fast_path():
                a2, st2 = model.run(ids[:, :17])
                b2, _ = model.run(blk, st2, block=True)
        assert torch.allclose(a, a2, atol=1e-10) and torch.allclose(b, b2, atol=1e-10)
        for x, y in zip(st.layers, st2.layers):
            if x.ssm is not None:
                assert torch.allclose(x.ssm, y.ssm, atol=1e-10)
    finally:
        model.float()
    from clover_gguf import reference
    assert reference.GatedDeltaNet.delta_rule is reference.gated_delta_rule  # restored
    assert reference.GatedDeltaNet.delta_rule is not parallel_delta_rule


@pytest.mark.slow
def test_causal_greedy_accuracy(ar_result):
    assert ar_result["accuracy"] >= TARGET_ACCURACY, ar_result["accuracy"]


@pytest.fixture(scope="module")
def diffusion_result(tiny):
    model, tok, rows = tiny
    return evaluate_rows(model, tok, rows, mode="diffusion", threshold=0.95)


@pytest.mark.slow
def test_block_decoding_tokens_per_pass(diffusion_result):
    assert diffusion_result["tokens_per_pass"] >= MIN_TOKENS_PER_PASS, diffusion_result["tokens_per_pass"]


@pytest.mark.slow
def test_block_decoding_accuracy(diffusion_result):
    assert diffusion_result["accuracy"] >= TARGET_ACCURACY, diffusion_result["accuracy"]


@pytest.mark.slow
def test_draft_self_exact_equals_causal_greedy(tiny, ar_result):
    model, tok, rows = tiny
    r = evaluate_rows(model, tok, rows, mode="draft-self", accept="exact")
    mismatched = [row["prompt"] for row, a, b in zip(rows, ar_result["outputs"], r["outputs"]) if a != b]
    assert not mismatched
    assert r["acceptance_rate"] is not None and r["acceptance_rate"] > 0.5


@pytest.mark.slow
def test_training_is_seeded_and_resumable(tmp_path):
    from clover_gguf.testing.train_tiny import train

    kw = dict(steps=3, seed=5, micro=3, save_every=100, log_every=100)
    train(tmp_path / "a", **kw)
    train(tmp_path / "b", stop_after=2, **kw)
    train(tmp_path / "b", resume=True, **kw)
    a = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 3
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
