"""The patched llama.cpp (clover architecture) against clover_gguf.reference, through llama-cpp-python.

Needs a patched libllama: set LLAMA_CPP_LIB_PATH to its folder (a cmake build's bin/). Skipped otherwise.
Parity settings: flash attention off and an F32 KV cache (CPU flash attention / F16 K/V give ~3e-4 on their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from llama_parity_scratch import LlamaRunner, rel_err  # noqa: E402

TOL = 1e-4

if not os.environ.get("LLAMA_CPP_LIB_PATH"):
    pytest.skip("LLAMA_CPP_LIB_PATH is not set (needs the patched libllama)", allow_module_level=True)
try:
    import llama_cpp  # noqa: F401
except Exception as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"llama_cpp cannot be imported: {e}", allow_module_level=True)


def _convert(ckpt: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "clover_gguf", "convert", str(ckpt), "-o", str(out), "--outtype", "f32"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def clover_files(make_checkpoint, tmp_path_factory):
    ckpt = make_checkpoint(seed=1)
    return ckpt, _convert(ckpt, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def plain_files(make_checkpoint, tmp_path_factory):
    ckpt = make_checkpoint(seed=2, plain_qwen=True)
    return ckpt, _convert(ckpt, tmp_path_factory.mktemp("gguf") / "plain.gguf")


@pytest.fixture(scope="module")
def ref(clover_files):
    from clover_gguf.reference import CloverModel

    return CloverModel.from_pretrained(clover_files[0], dtype=torch.float64)


def _runner(gguf: Path, **kw) -> LlamaRunner:
    try:
        return LlamaRunner(str(gguf), **kw)
    except AssertionError as e:
        pytest.skip(f"the llama.cpp library cannot load a clover GGUF (not patched?): {e}")


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


@pytest.fixture(scope="module")
def seqs(ref):
    v = ref.cfg.vocab_size
    return dict(prefix=_ids(10, 23, v), block=_ids(11, ref.cfg.block_size, v), block2=_ids(12, ref.cfg.block_size, v),
                nxt=_ids(13, 5, v))


def test_causal_parity(clover_files, ref, seqs):
    prefix, nxt = seqs["prefix"], seqs["nxt"]
    with torch.no_grad():
        want = ref(torch.tensor(prefix + nxt)).numpy()
    r = _runner(clover_files[1])
    try:
        got = r.decode(prefix, 0, 0)
        assert rel_err(got, want[: len(prefix)]) <= TOL
        # token by token continues the same state
        for i, t in enumerate(nxt):
            assert rel_err(r.decode([t], len(prefix) + i, 0), want[len(prefix) + i: len(prefix) + i + 1]) <= TOL
    finally:
        r.close()


@pytest.mark.parametrize("n_block", [32, 5, 1])
def test_block_parity_and_prefix_untouched(clover_files, ref, seqs, n_block):
    prefix, block, nxt = seqs["prefix"], seqs["block"][:n_block], seqs["nxt"]
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()  # coreset as config.json says (on)
        want_next = ref(torch.tensor(prefix + nxt)).numpy()[len(prefix):]
        causal_block = ref(torch.tensor(prefix + block)).numpy()[len(prefix):]
    assert rel_err(causal_block, want_block) > 1e-2  # block mode really differs from causal mode
    r = _runner(clover_files[1])
    try:
        r.decode(prefix, 0, 0)
        assert rel_err(r.block(block, len(prefix)), want_block) <= TOL
        # seq 0 never saw the block
        assert rel_err(r.decode(nxt, len(prefix), 0), want_next) <= TOL
    finally:
        r.close()


@pytest.mark.parametrize("overrides,coreset", [
    ({"clover.moe_block_coreset.enabled": False}, False),
    ({"clover.moe_block_coreset.top_p": 0.5}, 0.5),
    ({"clover.moe_block_coreset.top_p": 1.0}, 1.0),
], ids=["off", "top_p-0.5", "top_p-1.0"])
def test_block_coreset_overrides(clover_files, ref, seqs, overrides, coreset):
    prefix, block = seqs["prefix"], seqs["block"]
    with torch.no_grad():
        want = ref.block_logits(prefix, block, coreset=coreset).numpy()
        default = ref.block_logits(prefix, block).numpy()
    if coreset is not False and coreset < 1.0:
        assert rel_err(want, default) > 1e-3  # the override matters for this block
    r = _runner(clover_files[1], overrides=overrides)
    try:
        r.decode(prefix, 0, 0)
        assert rel_err(r.block(block, len(prefix)), want) <= TOL
    finally:
        r.close()


def test_block_coreset_off_equals_top_p_one(ref, seqs):
    prefix, block = seqs["prefix"], seqs["block"]
    with torch.no_grad():
        a = ref.block_logits(prefix, block, coreset=False).numpy()
        b = ref.block_logits(prefix, block, coreset=1.0).numpy()
    assert rel_err(a, b) <= 1e-12


def test_two_blocks_in_one_ubatch(clover_files, ref, seqs):
    """Blocks of equal length on two scratch sequences decoded in one batch: each gets its own coreset."""
    prefix, b1, b2 = seqs["prefix"], seqs["block"], seqs["block2"]
    with torch.no_grad():
        w1 = ref.block_logits(prefix, b1).numpy()
        w2 = ref.block_logits(prefix, b2).numpy()
    r = _runner(clover_files[1], n_seq_max=3)
    L = r.L
    try:
        r.decode(prefix, 0, 0)
        L.llama_memory_seq_cp(r.mem, 0, 1, -1, -1)
        L.llama_memory_seq_cp(r.mem, 0, 2, -1, -1)
        L.llama_set_causal_attn(r.ctx, False)
        got = r.decode(b1, len(prefix), 1, extra=[(b2, len(prefix), 2)])
        L.llama_set_causal_attn(r.ctx, True)
        L.llama_memory_seq_rm(r.mem, 1, -1, -1)
        L.llama_memory_seq_rm(r.mem, 2, -1, -1)
        assert rel_err(got[: len(b1)], w1) <= TOL
        assert rel_err(got[len(b1):], w2) <= TOL
    finally:
        r.close()


def test_block_with_rs_rollback_snapshots(clover_files, ref, seqs):
    """n_rs_seq > 0 takes the fused snapshot path of the delta rule; block mode must not depend on it."""
    prefix, block, nxt = seqs["prefix"], seqs["block"], seqs["nxt"]
    with torch.no_grad():
        want = ref.block_logits(prefix, block).numpy()
        want_next = ref(torch.tensor(prefix + nxt)).numpy()[len(prefix):]
    r = _runner(clover_files[1], n_rs_seq=4)
    try:
        r.decode(prefix, 0, 0)
        assert rel_err(r.block(block, len(prefix)), want) <= TOL
        assert rel_err(r.decode(nxt, len(prefix), 0), want_next) <= TOL
    finally:
        r.close()


def test_plain_qwen_causal_parity(plain_files):
    from clover_gguf.reference import CloverModel

    ckpt, gguf = plain_files
    model = CloverModel.from_pretrained(ckpt, dtype=torch.float64)
    ids = _ids(20, 19, model.cfg.vocab_size)
    with torch.no_grad():
        want = model(torch.tensor(ids)).numpy()
    r = _runner(gguf)
    try:
        assert rel_err(r.decode(ids, 0, 0), want) <= TOL
    finally:
        r.close()


def test_plain_qwen_block_mode_aborts_clearly(plain_files):
    """A GGUF without the block-mode tensors refuses a non-causal decode (an abort with a message, not garbage)."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from llama_parity_scratch import LlamaRunner
        r = LlamaRunner({str(plain_files[1])!r})
        r.decode([1, 2, 3], 0, 0)
        r.block([4, 5, 6], 3)
        print("BLOCK DECODED")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "BLOCK DECODED" not in p.stdout
    assert "clover.block_mode" in p.stderr
