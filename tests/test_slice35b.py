"""The 35B's real per-layer dimensions through convert and the patched llama.cpp, against the float64 reference.

`make_tiny --preset slice35b` with 16 experts (of 256) and a 1,024-row vocabulary: hidden 2048, attention heads of
256 (16 q / 2 kv), GDN heads of 128 (16 key / 32 value), experts of width 512 top-8, 4 layers (3 GDN + 1 attention).
Converted to F32 and decoded with LlamaContext(exact=True): causal, block passes of 32 and 1 tokens with the coreset
on and off, and causal decoding after the blocks. The routing of each block pass is read from llama.cpp's graph
(graph_probe) and compared with the reference's: it is what `bench/scale.py` counts distinct experts with.
Measured on the 2-core machine: 79 s of CPU (4 minutes wall while it was shared), 4.5 GB peak RSS (docs/scale.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clover_gguf.llama_context import LlamaContext, load_binding
from clover_gguf.testing.device import env_offload_kwargs

TOL = 1e-4
N_EXPERTS, VOCAB = 16, 1024

load_binding()  # raises (fails the module) when the patched library or the binding is missing


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def files(make_checkpoint, tmp_path_factory):
    from clover_gguf.convert import convert

    ckpt = make_checkpoint(seed=5, preset="slice35b", num_experts=N_EXPERTS, vocab_size=VOCAB)
    gguf = tmp_path_factory.mktemp("slice") / "slice-f32.gguf"
    convert(ckpt, gguf, outtype="f32", quiet=True)
    return ckpt, gguf


@pytest.fixture(scope="module")
def ref(files):
    from clover_gguf.reference import CloverModel

    return CloverModel.from_pretrained(files[0], dtype=torch.float64)


@pytest.fixture(scope="module")
def seqs(ref):
    rng = np.random.default_rng(7)
    ids = lambda n: rng.integers(0, ref.cfg.vocab_size, size=n).tolist()  # noqa: E731
    prefix, block, nxt = ids(23), ids(ref.cfg.block_size), ids(4)
    with torch.no_grad():
        want_prefix, state = ref.prefill(prefix)
        want_next, _ = ref.prefill(nxt, state)
    return dict(prefix=prefix, block=block, nxt=nxt, state=state, want_prefix=want_prefix.numpy(),
                want_next=want_next.numpy())


def test_the_slice_has_the_35b_layer_shape(ref):
    import json

    from clover_gguf.config import SHAPE_35B

    shape, c = json.loads(SHAPE_35B.read_text()), ref.cfg
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "moe_intermediate_size",
              "shared_expert_intermediate_size", "num_experts_per_tok"):
        assert getattr(c, k) == shape[k], k
    assert c.layer_types == tuple(shape["layer_types"][:4]) and c.num_experts == N_EXPERTS


def _runner(gguf, coreset: bool, probe=None) -> LlamaContext:
    return LlamaContext(gguf, n_ctx=256, n_ubatch=256, exact=True, n_threads=2, **env_offload_kwargs(),
                        overrides={"clover_moe.diffusion.expert_coreset": coreset},
                        eval_callback=None if probe is None else probe.callback)


def test_causal_parity(files, seqs):
    r = _runner(files[1], coreset=True)
    try:
        assert rel_err(r.decode(seqs["prefix"], 0, 0), seqs["want_prefix"]) <= TOL
        n = len(seqs["prefix"])
        for i, t in enumerate(seqs["nxt"]):  # one token at a time continues the same state
            assert rel_err(r.decode([t], n + i, 0), seqs["want_next"][i:i + 1]) <= TOL
    finally:
        r.close()


@pytest.mark.parametrize("coreset", [True, False], ids=["coreset-on", "coreset-off"])
def test_block_parity_routing_and_continuation(files, ref, seqs, coreset):
    """Block passes of 32 and 1 tokens, then causal decoding of seq 0 that must not have seen them."""
    from clover_gguf.graph_probe import GraphProbe
    from clover_gguf.reference import recorded_routes

    prefix, block, state, k = seqs["prefix"], seqs["block"], seqs["state"], ref.cfg.num_experts_per_tok
    want, routes = {}, {}
    with torch.no_grad():
        for n in (32, 1):
            with recorded_routes(ref) as calls:
                want[n] = ref.block_logits(None, block[:n], coreset=coreset, state=state).numpy()
            routes[n] = {layer: idx[0].numpy() for layer, idx in calls}  # [T, k] per layer
        causal = ref.prefill(block, state)[0].numpy()
    assert rel_err(causal, want[32]) > 1e-2  # block mode really differs from causal mode at this shape
    distinct = [len(np.unique(routes[32][layer])) for layer in sorted(routes[32])]
    if coreset:  # the coreset really cuts the experts a 32-token block uses (16 without it)
        assert min(distinct) >= k and sum(distinct) < 4 * N_EXPERTS
    else:
        assert distinct == [N_EXPERTS] * 4

    probe = GraphProbe(r"ffn_moe_topk-\d+")
    r = _runner(files[1], coreset=coreset, probe=probe)
    try:
        r.decode(prefix, 0, 0, logits=False)
        for n in (32, 1):
            probe.clear()
            assert rel_err(r.block(block[:n], len(prefix)), want[n]) <= TOL, n
            for layer, idx in routes[n].items():  # the same experts per token as the reference
                got = probe.routes(layer)
                assert got.shape == idx.shape
                assert [set(row) for row in got] == [set(row) for row in idx], (n, layer)
            assert {layer: len(e) for layer, e in probe.experts_per_layer().items()} == \
                {layer: len(np.unique(idx)) for layer, idx in routes[n].items()}
        # seq 0 never saw the blocks: the causal continuation is the reference's
        assert rel_err(r.decode(seqs["nxt"], len(prefix), 0), seqs["want_next"]) <= TOL
    finally:
        r.close()


@pytest.mark.parametrize("reading", ["hist-read-add", "hist-read-mix"])
def test_block_parity_under_every_reading(files, ref, seqs, reading):
    """The other readings of the block softmax (docs/architecture.md 3b), chosen at load by clover_moe.diffusion.softmax_form
    (here a KV override, as check-block uses it): llama.cpp's block logits are the reference's under the same reading,
    and not reading 1's. (Reading 1 is every other block test's.)"""
    prefix, block, state = seqs["prefix"], seqs["block"], seqs["state"]
    with torch.no_grad():
        first = ref.block_logits(None, block, coreset=False, state=state).numpy()
        ref.reading = reading
        try:
            want = ref.block_logits(None, block, coreset=False, state=state).numpy()
        finally:
            ref.reading = "hist-sink-add"
    assert rel_err(want, first) > 3 * TOL  # the reading matters at this shape, beyond the parity tolerance
    r = LlamaContext(files[1], n_ctx=256, n_ubatch=256, exact=True, n_threads=2, **env_offload_kwargs(),
                     overrides={"clover_moe.diffusion.expert_coreset": False, "clover_moe.diffusion.softmax_form": reading})
    try:
        r.decode(prefix, 0, 0, logits=False)
        for n in (32, 5, 1):
            with torch.no_grad():
                ref.reading = reading
                try:
                    want_n = ref.block_logits(None, block[:n], coreset=False, state=state).numpy()
                finally:
                    ref.reading = "hist-sink-add"
            assert rel_err(r.block(block[:n], len(prefix)), want_n) <= TOL, n
    finally:
        r.close()


CORPUS = ["Hello world! It's what we'll do; they're here.", "zebra quick brown foxes jump over lazy dogs abcd xyzzy",
          "<|im_start|>user\nCount from 3 to 9.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n3 4 5"]


def test_grown_vocabulary_tokenizes_like_hf(files):
    """make_tiny grows the tokenizer to fill the vocabulary (synthetic merges): llama.cpp must agree with HF."""
    from transformers import AutoTokenizer

    from clover_gguf.testing.make_tiny import UNUSED_VOCAB_ROWS
    from clover_gguf.testing.tokenizer import DEFAULT_CORPUS, SPECIAL_TOKENS, train_bpe

    ckpt, gguf = files
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == VOCAB - UNUSED_VOCAB_ROWS  # the rows past it are padding
    trained = len(train_bpe(DEFAULT_CORPUS, 200)[0])
    grown = range(trained, tok.convert_tokens_to_ids(SPECIAL_TOKENS[0]))
    r = LlamaContext(gguf, n_ctx=64, n_threads=2, **env_offload_kwargs())
    try:
        assert r.n_vocab == VOCAB
        used = []
        for text in CORPUS:
            ids = tok.encode(text, add_special_tokens=False)
            assert r.tokenize(text, special=True) == ids, text
            used += ids
        assert len(grown) > 200 and any(t in grown for t in used)  # the grown merges are in use
    finally:
        r.close()
