"""The runtime on the bundled trained model: llama.cpp decodes like the reference, draft-self (exact) gives the AR
text, and the figures docs/tiny-model.md states hold on llama.cpp too (F32 and Q8_0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clover_gguf.convert import convert
from clover_gguf.decoding import generate_all
from clover_gguf.reference import ReferenceBackend
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.device import env_offload_kwargs
from clover_gguf.testing.train_tiny import ASSET_DIR, chat_prompt, load_tiny, strip_thinking

pytestmark = pytest.mark.slow  # minutes of decoding on the trained model: `make test` runs it

STRIDE = 6  # every 6th eval row: 25 prompts, five per task (eval.jsonl lists 30 rows per task in task order)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok, rows = load_tiny(ASSET_DIR)
    return model, tok, rows[::STRIDE]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    from clover_gguf.quantize import quantize

    d = tmp_path_factory.mktemp("tiny-gguf")
    f32 = d / "tiny-f32.gguf"
    convert(ASSET_DIR, f32, outtype="f32", quiet=True)
    q8 = d / "tiny-q8_0.gguf"
    quantize(f32, q8, "Q8_0", quiet=True)
    return {"f32": f32, "q8_0": q8}


def _decode_all(backend, tok, rows, **kw):
    outs, passes = [], []
    for row in rows:
        ids = tok.encode(chat_prompt(row["prompt"])).ids
        out, stats = generate_all(backend, ids, max_new_tokens=96, **kw)
        outs.append(out)
        passes.append(stats.forward_passes)
    return outs, passes


def test_llama_diffusion_matches_the_reference_decode(tiny, ggufs):
    model, tok, rows = tiny
    ref_out, ref_passes = _decode_all(ReferenceBackend(model), tok, rows, mode="diffusion", threshold=0.95)
    with CloverRuntime(ggufs["f32"], n_ctx=512, exact=True, n_threads=2, **env_offload_kwargs()) as rt:
        out, passes = _decode_all(rt.backend, tok, rows, mode="diffusion", threshold=0.95)
    assert out == ref_out
    assert passes == ref_passes
    correct = sum(r["answer"] in strip_thinking(tok.decode(o, skip_special_tokens=True)) for r, o in zip(rows, out))
    n_tokens = sum(len(o) + 1 for o in out)  # + the end token each answer resolved
    assert correct / len(rows) >= 0.95  # on this subset, as docs/tiny-model.md states for the full set (97.3%)
    assert n_tokens / sum(passes) >= 3.0  # at least 3 tokens per forward pass, as the docs state


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("rollback", ["redecode", "snapshot"])
def test_draft_self_exact_equals_ar(tiny, ggufs, kind, rollback):
    _, tok, rows = tiny
    with CloverRuntime(ggufs[kind], n_ctx=512, rollback=rollback, n_threads=2, **env_offload_kwargs()) as rt:
        ar, _ = _decode_all(rt.backend, tok, rows, mode="ar")
        ds, _ = _decode_all(rt.backend, tok, rows, mode="draft-self", accept="exact")
    assert ds == ar
    correct = sum(r["answer"] in strip_thinking(tok.decode(o, skip_special_tokens=True)) for r, o in zip(rows, ar))
    assert correct / len(rows) >= 0.95


def test_generate_with_the_cards_controls_answers(ggufs, tiny):
    """The user-facing path (GGUF chat template, llama tokenizer, the card's controls on) answers correctly."""
    _, _, rows = tiny
    with CloverRuntime(ggufs["f32"], n_ctx=512, n_threads=2, **env_offload_kwargs()) as rt:
        for row in rows[::5]:
            for mode in ("ar", "diffusion", "draft-self"):
                a = rt.generate(row["prompt"], mode=mode, max_new_tokens=96)
                assert row["answer"] in a.text, (mode, row, a.raw)
                assert a.stats.finish_reason == "stop"
