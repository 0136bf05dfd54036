"""make_tiny: the slice35b preset's shape, streamed generation, the skewed router and the grown tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clover_gguf.config import SHAPE_35B
from clover_gguf.testing import make_tiny as mt


def test_slice35b_is_the_35b_layer_shape_with_four_layers():
    shape = json.loads(SHAPE_35B.read_text())
    special = {"<|im_end|>": 1, "<|endoftext|>": 0, "<|mask|>": 2}
    cfg = mt.make_config("slice35b", 248_320, special, context_length=131_072)
    for k in mt._SHAPE_FIELDS:
        assert getattr(cfg, k) == shape[k], k
    assert cfg.layer_types == tuple(shape["layer_types"][:4]) == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.vocab_size == shape["vocab_size"] and cfg.max_position_embeddings == 131_072
    cheap = mt.make_config("slice35b", 1024, special, num_experts=4, num_layers=8)
    assert (cheap.num_experts, cheap.num_experts_per_tok, cheap.num_hidden_layers) == (4, 4, 8)
    assert cheap.layer_types.count("full_attention") == 2


def test_generation_does_not_depend_on_the_piece_size(tmp_path, monkeypatch):
    mt.make_tiny(tmp_path / "a", seed=3, preset="small", dtype="bf16", experts="fused", shard_size=100_000)
    monkeypatch.setattr(mt, "CHUNK_ELEMENTS", 1000)  # every matrix in several pieces
    assert len(list(mt.generate_chunks("x", (64, 128), ("normal", 1.0), 0))) > 1
    mt.make_tiny(tmp_path / "b", seed=3, preset="small", dtype="bf16", experts="fused", shard_size=100_000)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and len(files) > 6
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_router_rows_have_per_expert_scales():
    """The slice's router: row e ~ N(0, std^2) * exp(0.2 z_e), so some experts' logits spread wider (popular)."""
    shape, std = (256, 2048), 2 * 2048 ** -0.5
    plain = mt.generate("r", shape, ("normal", std), 0)
    router = mt.generate("r", shape, ("router", std, 0.2), 0)
    log_plain = np.log(np.linalg.norm(plain, axis=1) / (std * 2048 ** 0.5))
    log_router = np.log(np.linalg.norm(router, axis=1) / (std * 2048 ** 0.5))
    assert np.std(log_plain) < 0.03  # a plain normal matrix: every row the same length
    assert 0.15 < np.std(log_router) < 0.25
    np.testing.assert_allclose(router / np.linalg.norm(router, axis=1, keepdims=True),
                               plain / np.linalg.norm(plain, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_grown_tokenizer_has_the_asked_size_and_loads_in_hf(tmp_path):
    from tokenizers import Tokenizer

    from clover_gguf.testing.tokenizer import write_tokenizer

    special = write_tokenizer(tmp_path, n_tokens=5000)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 5000 == max(special.values()) + 1
    assert tok.token_to_id("Ġabc") is not None  # grown: space + lowercase runs
    with pytest.raises(ValueError):
        write_tokenizer(tmp_path, n_tokens=10)
