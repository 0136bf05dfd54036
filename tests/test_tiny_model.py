"""The committed tiny Clover (clover_gguf/assets/tiny-clover) keeps the figures docs/tiny-model.md states, with
the reference model and clover_gguf.decoding, on every third row of the held-out eval set (100 of 300 rows, all
three row kinds; tests/test_runtime_tiny.py runs all 300 through llama.cpp). The eval set is held out by rule.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from clover_gguf.testing.train_tiny import (ASSET_DIR, EVAL_ROWS, TASKS, draw_conversation, evaluate_rows,  # noqa: E402
                                            fast_path, is_held_out, load_tiny, make_eval_set, parallel_delta_rule,
                                            row_conversation, row_kind)

TARGET_ACCURACY = 0.95
MIN_TOKENS_PER_PASS = 3.0
STRIDE = 3  # every third eval row: 50 single, 25 multi-turn and 25 no-think rows


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok, rows = load_tiny(ASSET_DIR)
    return model, tok, rows[::STRIDE]


@pytest.fixture(scope="module")
def ar_result(tiny):
    model, tok, rows = tiny
    return evaluate_rows(model, tok, rows, mode="ar")


def assert_shipped_asset(asset_dir) -> None:
    """A tiny Clover shipped in clover_gguf/assets: a complete checkpoint with its eval set, no training state, within
    the size budget (the tool model keeps the bundled model's: tests/test_tiny_tools.py)."""
    names = {p.name for p in asset_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "eval.jsonl"} <= names
    assert "train_state.pt" not in names
    assert sum(p.stat().st_size for p in asset_dir.iterdir()) < 8 * 2**20


def test_asset_is_a_complete_small_checkpoint():
    assert_shipped_asset(ASSET_DIR)
    cfg = json.loads((ASSET_DIR / "config.json").read_text())
    gen = json.loads((ASSET_DIR / "generation_config.json").read_text())
    vocab = json.loads((ASSET_DIR / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert cfg["model_type"] == "clover_moe" and cfg["block_size"] == 32
    assert cfg["mask_token_id"] == ids["<|mask|>"]
    assert sorted(gen["eos_token_id"]) == sorted([ids["<|im_end|>"], ids["<|endoftext|>"]])
    assert cfg["linear_num_key_heads"] < cfg["linear_num_value_heads"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"]
    rows = [json.loads(line) for line in (ASSET_DIR / "eval.jsonl").read_text().splitlines()]
    assert rows == make_eval_set()  # the committed eval set is the one the rule makes
    assert all(set(r) <= {"prompt", "answer", "history", "think"} for r in rows)
    kinds = [row_kind(r) for r in rows]
    assert {k: kinds.count(k) for k in EVAL_ROWS} == {k: n * len(TASKS) for k, n in EVAL_ROWS.items()}
    assert {len(row_conversation(r).turns) for r in rows if row_kind(r) == "multi"} == {2, 3}
    assert {len(row_conversation(r).turns) for r in rows if row_kind(r) == "no-think"} == {1, 2, 3}


def test_eval_rows_are_held_out_and_training_never_sees_a_held_out_prompt():
    import random

    rows = make_eval_set()
    prompts = [p for r in rows for p, _ in row_conversation(r).turns]  # history turns included
    assert prompts and all(is_held_out(p) for p in prompts)
    rng = random.Random(0)
    train = [draw_conversation(rng) for _ in range(3000)]
    assert not any(is_held_out(p) for c in train for p, _ in c.turns)
    assert {len(c.turns) for c in train} == {1, 2, 3} and {c.think for c in train} == {True, False}
    adds = [c.prompt for c in train if c.prompt.startswith("What is")]
    assert any(len(p.split()[2]) == 1 for p in adds) and any(len(p.split()[2]) == 2 for p in adds)  # 0-99


def test_history_loss_covers_each_earlier_answer_after_its_first_token(tiny):
    import random

    from clover_gguf.testing.train_tiny import Conversation, history_targets

    tok = tiny[1]
    header, end = tok.encode("<|im_start|>assistant\n").ids, tok.token_to_id("<|im_end|>")
    rng = random.Random(3)
    for think in (True, False):
        c = Conversation(tuple(draw_conversation(rng, n_turns=1).turns[0] for _ in range(3)), think)
        ids = tok.encode(c.prompt_text()).ids
        got = [ids[j] for j in history_targets(ids, header, end)]
        want = [t for _, a in c.turns[:-1] for t in tok.encode(a).ids[1:] + [end]]  # each answer on its own
        assert got == want and len(want) > 4
    single = tok.encode(Conversation((c.turns[-1],)).prompt_text()).ids
    assert history_targets(single, header, end) == ()  # nothing before a first turn


def test_clover_extras_are_trained_and_non_zero(tiny):
    model = tiny[0]
    for layer in model.layers:
        if layer.full_attention:
            continue
        la = layer.linear_attn
        for t in (la.conv_right_weight, la.bd_softmax_logit_scale, la.bd_softmax_history_bias,
                  la.bd_softmax_history_c):
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


def test_fast_path_is_restored_when_the_body_raises():
    from clover_gguf import reference

    forward = reference.SparseMoe.forward
    with pytest.raises(RuntimeError):
        with fast_path():
            assert reference.GatedDeltaNet.delta_rule is parallel_delta_rule
            raise RuntimeError("interrupted")
    assert reference.GatedDeltaNet.delta_rule is reference.gated_delta_rule
    assert reference.SparseMoe.forward is forward


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

    kw = dict(steps=3, seed=5, micro=3, save_every=100, log_every=100, pool=200)
    train(tmp_path / "a", **kw)
    train(tmp_path / "b", stop_after=2, **kw)
    train(tmp_path / "b", resume=True, **kw)
    a = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 3
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
