"""The patched llama.cpp (clover architecture) against clover_gguf.reference and transformers, through
llama-cpp-python. Runs in CI on the build `make llama` made: a missing library is a failure, never a skip.

Parity settings: flash attention off and an F32 KV cache (CPU flash attention / F16 K/V give ~3e-4 on their own).
Relative error is ||d|| / ||ref|| over the whole logits array.

bench/device/run.sh also runs this file on a GPU build, all layers offloaded (CLOVER_GGUF_TEST_GPU_LAYERS=-1,
clover_gguf.testing.device): once in the exact settings, held to TOL, and once with CLOVER_GGUF_PARITY=defaults
(llama.cpp's default settings: flash attention auto, F16 K/V), where the errors themselves are the result: TOL is then
only a bound that keeps every test running to its end, and CLOVER_GGUF_PARITY_LOG=file collects each error compared.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from clover_gguf.build import llama_tool
from clover_gguf.errors import UserError
from clover_gguf.llama_context import LlamaContext, load_binding
from clover_gguf.testing.device import env_offload_kwargs
from clover_gguf.testing.ports import free_port

EXACT = os.environ.get("CLOVER_GGUF_PARITY", "exact") != "defaults"
TOL = 1e-4 if EXACT else 1e-2

load_binding()  # raises (fails the module) when the patched library or the binding is missing


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def parity(got, want) -> float:
    """rel_err of llama.cpp's logits against an independent computation; appended to $CLOVER_GGUF_PARITY_LOG."""
    err = rel_err(got, want)
    log = os.environ.get("CLOVER_GGUF_PARITY_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "rel_err": err}) + "\n")
    return err


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


def _runner(gguf: Path, **kw) -> LlamaContext:
    kw.setdefault("n_ctx", 512)
    kw.setdefault("n_ubatch", 512)
    kw.setdefault("exact", EXACT)
    return LlamaContext(gguf, n_threads=2, **env_offload_kwargs(), **kw)


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
        assert parity(got, want[: len(prefix)]) <= TOL
        # token by token continues the same state
        for i, t in enumerate(nxt):
            assert parity(r.decode([t], len(prefix) + i, 0), want[len(prefix) + i: len(prefix) + i + 1]) <= TOL
    finally:
        r.close()


# n_rs_seq > 0 takes the fused snapshot path of the delta rule; block mode must not depend on it
@pytest.mark.parametrize("n_block,n_rs_seq", [(32, 0), (5, 0), (1, 0), (32, 4)],
                         ids=["32", "5", "1", "32-rs-snapshots"])
def test_block_parity_and_prefix_untouched(clover_files, ref, seqs, n_block, n_rs_seq):
    prefix, block, nxt = seqs["prefix"], seqs["block"][:n_block], seqs["nxt"]
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()  # coreset as config.json says (on)
        want_next = ref(torch.tensor(prefix + nxt)).numpy()[len(prefix):]
        causal_block = ref(torch.tensor(prefix + block)).numpy()[len(prefix):]
    assert rel_err(causal_block, want_block) > 1e-2  # block mode really differs from causal mode
    r = _runner(clover_files[1], n_rs_seq=n_rs_seq)
    try:
        r.decode(prefix, 0, 0)
        assert parity(r.block(block, len(prefix)), want_block) <= TOL
        # seq 0 never saw the block
        assert parity(r.decode(nxt, len(prefix), 0), want_next) <= TOL
    finally:
        r.close()


@pytest.mark.slow
@pytest.mark.parametrize("filled", [0, 5, 20], ids=["all-masked", "5-filled", "20-filled"])
@pytest.mark.parametrize("coreset", [True, False], ids=["coreset-on", "coreset-off"])
def test_masked_block_parity(clover_files, ref, seqs, filled, coreset):
    """A diffusion block as decoding sees it: mask tokens, with some positions already resolved."""
    prefix, mask = seqs["prefix"], ref.cfg.mask_token_id
    block = [mask] * ref.cfg.block_size
    for i in np.random.default_rng(filled).choice(len(block), size=filled, replace=False):
        block[i] = seqs["block"][i]
    with torch.no_grad():
        want = ref.block_logits(prefix, block, coreset=coreset).numpy()
    r = _runner(clover_files[1], overrides={"clover_moe.diffusion.expert_coreset": coreset})
    try:
        r.decode(prefix, 0, 0)
        assert parity(r.block(block, len(prefix)), want) <= TOL
    finally:
        r.close()


@pytest.mark.parametrize("overrides,coreset", [
    ({"clover_moe.diffusion.expert_coreset": False}, False),
    ({"clover_moe.diffusion.expert_coreset_top_p": 0.5}, 0.5),
    ({"clover_moe.diffusion.expert_coreset_top_p": 1.0}, 1.0),
], ids=["off", "top_p-0.5", "top_p-1.0"])
@pytest.mark.slow
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
        assert parity(r.block(block, len(prefix)), want) <= TOL
    finally:
        r.close()


def test_block_coreset_off_equals_top_p_one(ref, seqs):
    prefix, block = seqs["prefix"], seqs["block"]
    with torch.no_grad():
        a = ref.block_logits(prefix, block, coreset=False).numpy()
        b = ref.block_logits(prefix, block, coreset=1.0).numpy()
    assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("n2", [32, 8], ids=["equal", "unequal"])
def test_blocks_of_two_sequences_in_one_call(clover_files, ref, seqs, n2):
    """Blocks on two block sequences in one llama_decode, of equal or unequal length: each block stays whole (a
    ubatch per sequence) and gets the logits it gets alone, with its own coreset. Before block attention was per
    sequence, the unequal pair was cut by the equal-length splitter and came out silently wrong."""
    prefix, b1, b2 = seqs["prefix"], seqs["block"], seqs["block2"][:n2]
    with torch.no_grad():
        w1 = ref.block_logits(prefix, b1).numpy()
        w2 = ref.block_logits(prefix, b2).numpy()
    r = _runner(clover_files[1], n_seq_max=3)
    try:
        r.decode(prefix, 0, 0)
        alone = [r.block(b, len(prefix), scratch=s) for b, s in ((b1, 1), (b2, 2))]
        r.seq_cp(0, 1)
        r.seq_cp(0, 2)
        r.set_block_attn(1)  # the flag is the sequence's state: a copy of the causal sequence 0 has it off
        r.set_block_attn(2)
        got = r.decode(b1, len(prefix), 1, extra=[(b2, len(prefix), 2)])
        r.seq_rm(1)
        r.seq_rm(2)
        # the same as alone up to float reordering (the KV cache holds the other block's cells meanwhile)
        assert rel_err(got[: len(b1)], alone[0]) <= 1e-6 and rel_err(got[len(b1):], alone[1]) <= 1e-6
        assert parity(got[: len(b1)], w1) <= TOL
        assert parity(got[len(b1):], w2) <= TOL
    finally:
        r.close()


def test_causal_commit_and_block_in_one_call(clover_files, ref, seqs):
    """Block attention is per sequence: one llama_decode holds a causal continuation of sequence 0 and a block on
    sequence 1 (a copy of the prefix), and each gets its own mode."""
    prefix, block, nxt = seqs["prefix"], seqs["block"], seqs["nxt"]
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()
        want_next = ref(torch.tensor(prefix + nxt)).numpy()[len(prefix):]
    r = _runner(clover_files[1])
    try:
        r.decode(prefix, 0, 0)
        r.seq_cp(0, 1)
        r.set_block_attn(1)  # after the copy: seq_cp gives the destination the source's flag
        got = r.decode(nxt, len(prefix), 0, extra=[(block, len(prefix), 1)])
        r.seq_rm(1)
        assert parity(got[: len(nxt)], want_next) <= TOL
        assert parity(got[len(nxt):], want_block) <= TOL
    finally:
        r.close()


def test_block_attention_set_before_the_copy_stays_on(clover_files, ref, seqs):
    """The other order of the scratch copy (review round 4): block attention switched on for the empty sequence 1,
    then the prefix copied onto it. Round 3's seq_cp gave the destination the source's flag (off): the "block"
    decoded causally and llama_decode returned 0 (NMSE 1.8 at stdev 1). Now the flag stays on and the block is the
    float64 reference's."""
    prefix, block = seqs["prefix"], seqs["block"]
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()
    r = _runner(clover_files[1], n_seq_max=3)
    try:
        r.decode(prefix, 0, 0)
        r.set_block_attn(1)
        r.seq_rm(2)  # an operation on another sequence leaves the empty sequence's flag alone
        r.seq_cp(0, 1)
        assert r._api.llama_get_block_attn(r.ctx, 1)
        assert parity(r.decode(block, len(prefix), 1), want_block) <= TOL
    finally:
        r.close()


def test_a_partial_state_of_a_block_makes_its_reader_a_block_sequence(clover_files, seqs):
    """A partial (recurrent-only) state of a block sequence carries its flag: read into a causal sequence, that
    sequence becomes a block sequence (its recurrent state is past a block, never a causal prefix). Round 3 wrote no
    flag in a partial state, and the continuation silently went on from the block's state (NMSE 1.33)."""
    prefix, block = seqs["prefix"], seqs["block"]
    r = _runner(clover_files[1], n_seq_max=3)
    api, partial = r._api, 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    api.llama_state_seq_get_size_ext.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32]
    api.llama_state_seq_get_size_ext.restype = ctypes.c_size_t
    for name in ("llama_state_seq_get_data_ext", "llama_state_seq_set_data_ext"):
        fn = getattr(api, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_uint32]
        fn.restype = ctypes.c_size_t
    try:
        r.decode(prefix, 0, 0)
        r.seq_cp(0, 1)
        r.set_block_attn(1)
        r.decode(block, len(prefix), 1)
        buf = ctypes.create_string_buffer(api.llama_state_seq_get_size_ext(r.ctx, 1, partial))
        n = api.llama_state_seq_get_data_ext(r.ctx, buf, len(buf), 1, partial)
        assert n == len(buf) > 0
        r.seq_cp(0, 2)
        assert not api.llama_get_block_attn(r.ctx, 2)
        assert api.llama_state_seq_set_data_ext(r.ctx, buf, n, 2, partial) == n
        assert api.llama_get_block_attn(r.ctx, 2)
    finally:
        r.close()


def test_a_refused_seq_cp_is_an_error_the_caller_sees(clover_files, seqs):
    """llama_memory_seq_cp returns false when the hybrid memory refuses a copy (round 3: void, the caller could not
    know); LlamaContext.seq_cp raises, and nothing was copied."""
    prefix, block = seqs["prefix"], seqs["block"]
    r = _runner(clover_files[1], n_seq_max=3)
    try:
        r.decode(prefix, 0, 0)
        r.seq_cp(0, 1)
        r.set_block_attn(1)
        r.decode(block, len(prefix), 1)
        with pytest.raises(RuntimeError, match="refused to copy sequence 0 onto sequence 1"):
            r.seq_cp(0, 1)
        with pytest.raises(RuntimeError, match="refused to copy sequence 1 onto sequence 0"):
            r.seq_cp(1, 0)
        assert r.L.llama_memory_seq_pos_max(r.mem, 0) == len(prefix) - 1
        assert r.L.llama_memory_seq_pos_max(r.mem, 1) == len(prefix) + len(block) - 1
    finally:
        r.close()


def test_causal_sequences_and_a_block_take_two_ubatches(clover_files, ref, seqs):
    """Four one-token causal continuations and a block in one llama_decode are two ubatches (the causal ones split as
    usual, the block whole and alone), not one per sequence; each gets the logits it gets alone."""
    from clover_gguf.graph_probe import GraphProbe

    prefix, block, nxt = seqs["prefix"], seqs["block"], seqs["nxt"][:1]
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()
        want_next = ref(torch.tensor(prefix + nxt)).numpy()[len(prefix):]
    probe = GraphProbe(r"ffn_moe_topk-0", read_data=False)  # computed once per ubatch
    r = _runner(clover_files[1], n_seq_max=5, eval_callback=probe.callback)
    try:
        r.decode(prefix, 0, 0)
        for s in (1, 2, 3, 4):
            r.seq_cp(0, s)
        r.set_block_attn(4)
        probe.clear()
        got = r.decode(nxt, len(prefix), 0, extra=[(nxt, len(prefix), s) for s in (1, 2, 3)] +
                       [(block, len(prefix), 4)])
        probe.check()
        assert len(probe.records) == 2, [rec.name for rec in probe.records]
        for s in range(4):
            assert parity(got[s:s + 1], want_next) <= TOL
        assert parity(got[4:], want_block) <= TOL
    finally:
        r.close()


def test_a_long_prompt_beside_a_block_is_accepted(clover_files, ref, seqs):
    """A causal chunk longer than n_ubatch and a block in one llama_decode: the chunk is split over ubatches as
    always, the block stays whole (before, every sequence of a batch holding a block had to fit one ubatch: -1)."""
    prefix, block = seqs["prefix"], seqs["block"]
    chunk = _ids(31, 100, ref.cfg.vocab_size)
    with torch.no_grad():
        want_block = ref.block_logits(prefix, block).numpy()
        want_chunk = ref(torch.tensor(prefix + chunk)).numpy()[-1:]
    r = _runner(clover_files[1], n_ubatch=64)
    try:
        r.decode(prefix, 0, 0)
        r.seq_cp(0, 1)
        r.set_block_attn(1)
        got = r.decode(chunk, len(prefix), 0, logits=[False] * 99 + [True], extra=[(block, len(prefix), 1)])
        assert parity(got[:1], want_chunk) <= TOL
        assert parity(got[1:], want_block) <= TOL
    finally:
        r.close()


def test_an_mtp_context_on_a_block_capable_file_is_safe(make_checkpoint, tmp_path):
    """An MTP context's memory is a plain KV cache, not the hybrid memory the block graph reads: creating one on a
    block-capable GGUF reserves no block graph, and block attention is refused on it. In a process of its own, so
    that a fault fails the test instead of the session."""
    gguf = _convert(make_checkpoint(seed=1, mtp=True), tmp_path / "mtp.gguf")
    script = textwrap.dedent(f"""
        from clover_gguf.llama_context import _clover_api, load_binding
        L = load_binding()
        api = _clover_api(L)
        mp = L.llama_model_default_params()
        mp.load_mtp = True
        model = L.llama_model_load_from_file({str(gguf).encode()!r}, mp)
        assert model and api.llama_model_has_block_attn(model)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.ctx_type, cp.kv_unified = 256, 1, True  # LLAMA_CONTEXT_TYPE_MTP
        ctx = L.llama_init_from_model(model, cp)
        assert ctx, "no MTP context"
        assert not api.llama_set_block_attn(ctx, 0, True)
        print("refused")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "refused" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])


def test_the_memory_view_and_the_coreset_key_refuse_bad_values(clover_files):
    """The C view of the memory breakdown answers NULL with a count of entries > 0 with -1 (it wrote through it), and a
    coreset top_p outside (0, 1] (here through an override, past clover-gguf's own header check) is a load error."""
    r = _runner(clover_files[1], n_ctx=256, n_ubatch=256)
    try:
        assert r._api.llama_get_memory_breakdown_entries(r.ctx, None, 4) == -1
        assert r._api.llama_get_memory_breakdown_entries(r.ctx, None, 0) > 0
    finally:
        r.close()
    with pytest.raises(UserError, match="could not load"):
        _runner(clover_files[1], n_ctx=256, n_ubatch=256, overrides={"clover_moe.diffusion.expert_coreset_top_p": 1.5})


def test_the_block_graph_is_reserved_at_the_block_size_not_the_ubatch(bundled_gguf, tmp_path):
    """At -ub 2048, flash attention on as users run it, a block-capable file's compute buffers are within a few MiB of
    the same model's without the block tensors (before, the block graph was reserved at n_ubatch tokens: its
    {T, T, heads} scores made them 88 MiB against 25 MiB here, 3.5x)."""
    from clover_gguf.export import export_ar

    plain = export_ar(bundled_gguf, tmp_path / "ar.gguf", quiet=True).out

    def compute(path: Path) -> int:
        r = LlamaContext(path, n_ctx=4096, n_ubatch=2048, n_batch=2048, n_threads=2, exact=False)
        try:
            return sum(v["compute"] for v in r.memory_breakdown().values())
        finally:
            r.close()

    assert compute(bundled_gguf) - compute(plain) <= 4 * 2**20


def test_block_larger_than_a_ubatch_is_an_error_code(clover_files, seqs):
    """llama_decode returns -1 (no abort, nothing written) for a block that cannot go whole into one ubatch."""
    prefix = seqs["prefix"]
    r = _runner(clover_files[1], n_ubatch=16)
    try:
        r.decode(prefix, 0, 0)
        with pytest.raises(RuntimeError, match="returned -1"):
            r.block(seqs["block"][:17], len(prefix))
        assert r.block(seqs["block"][:16], len(prefix)).shape[0] == 16  # the context still works
    finally:
        r.close()


def test_causal_flag_alone_is_not_block_mode(clover_files, seqs):
    """llama_set_causal_attn(false) keeps its upstream meaning on a clover model (a non-causal mask over the causal
    graph); only llama_set_block_attn selects the block graph."""
    prefix, block = seqs["prefix"], seqs["block"]
    r = _runner(clover_files[1], n_seq_max=3)
    try:
        r.decode(prefix, 0, 0)
        want_block = r.block(block, len(prefix))  # on scratch sequence 1, switched to block attention
        r.seq_cp(0, 2)
        r.L.llama_set_causal_attn(r.ctx, False)
        noncausal = r.decode(block, len(prefix), 2)
        r.L.llama_set_causal_attn(r.ctx, True)
        r.seq_rm(2)
        assert rel_err(noncausal, want_block) > 1e-3
    finally:
        r.close()


def test_block_passes_allocate_nothing_after_context_creation(clover_files, seqs):
    """The block graph (the model's block size, 32 tokens, coreset on) is reserved when the context is created: the
    compute buffers do not grow during block passes of any size up to it, and a longer block is refused (-1) before
    anything is allocated."""
    prefix, block = seqs["prefix"], seqs["block"] * 2
    r = _runner(clover_files[1], n_ctx=1024, n_ubatch=512, exact=False)  # flash attention as users run it
    try:
        def compute() -> int:
            return sum(part["compute"] for part in r.memory_breakdown().values())

        at_creation = compute()
        assert at_creation > 0
        r.decode(prefix, 0, 0)
        for n in (1, 5, 31, 32):  # up to the block size
            r.block(block[:n], len(prefix))
            assert compute() == at_creation, n
        with pytest.raises(RuntimeError, match="returned -1"):
            r.block(block[:33], len(prefix))
        assert compute() == at_creation
    finally:
        r.close()


def test_saved_model_keeps_block_settings(clover_files, ref, seqs, tmp_path):
    """llama_model_save_to_file keeps block mode, the coreset settings, the right-conv kernel and the mask token
    (patches/0003: the saver left it out, so a saved copy lost block mode): the saved copy decodes blocks to the same
    logits (here with a coreset override that must survive too)."""
    prefix, block = seqs["prefix"], seqs["block"]
    saved = tmp_path / "saved.gguf"
    r = _runner(clover_files[1], overrides={"clover_moe.diffusion.expert_coreset_top_p": 0.5})
    try:
        r.decode(prefix, 0, 0)
        want = r.block(block, len(prefix))
        mask = r.meta("tokenizer.ggml.mask_token_id")
        r.L.llama_model_save_to_file(r.model, str(saved).encode())
    finally:
        r.close()
    with torch.no_grad():
        assert parity(want, ref.block_logits(prefix, block, coreset=0.5).numpy()) <= TOL
    from clover_gguf.gguf_header import read_clover

    assert read_clover(saved).types["clover_moe.attention.recurrent_layers"][1] == 4  # llama.cpp's UINT32, taken
    r = _runner(saved)
    try:
        assert r.meta("clover_moe.diffusion.expert_coreset_top_p") == "0.500000" and r.meta("clover_moe.diffusion.enabled") == "true"
        assert mask is not None and r.meta("tokenizer.ggml.mask_token_id") == mask
        r.decode(prefix, 0, 0)
        assert np.array_equal(r.block(block, len(prefix)), want)
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
        assert parity(r.decode(ids, 0, 0), want) <= TOL
    finally:
        r.close()


def test_plain_qwen_block_mode_is_refused_cleanly(plain_files):
    """A GGUF without the block-mode tensors has no block attention: a block pass is a clean error, not an abort,
    and the context keeps working."""
    r = _runner(plain_files[1], n_ctx=256, n_ubatch=256)
    try:
        assert not r.has_block_attn
        r.decode([1, 2, 3], 0, 0)
        with pytest.raises(UserError, match="no Clover block-mode tensors"):
            r.block([4, 5, 6], 3)
        assert not r._api.llama_set_block_attn(r.ctx, 1, True)  # the C API refuses too
        assert r.decode([4], 3, 0).shape[0] == 1
    finally:
        r.close()


@pytest.mark.slow
def test_long_prompt_over_several_ubatches_and_pieces(clover_files, ref):
    ids = _ids(30, 70, ref.cfg.vocab_size)
    with torch.no_grad():
        want = ref(torch.tensor(ids)).numpy()
    r = _runner(clover_files[1], n_ubatch=16)  # 70 tokens = 5 ubatches
    try:
        got = [r.decode(ids[a:b], a, 0) for a, b in ((0, 9), (9, 40), (40, 41), (41, 70))]
        assert parity(np.concatenate(got), want) <= TOL
        r.clear()
        # one call after the short ones: the reused batch grows past its first capacity (64)
        assert parity(r.decode(ids, 0, 0), want) <= TOL
        r.clear()
        last = r.decode(ids, 0, 0, logits=[False] * 69 + [True])  # only the rows asked for, in batch order
        assert last.shape == (1, want.shape[1]) and parity(last, want[-1:]) <= TOL
    finally:
        r.close()


@pytest.mark.slow
def test_transformers_checkpoint_gives_transformers_logits(plain_files):
    from transformers import Qwen3_5MoeForCausalLM

    ckpt, gguf = plain_files
    hf = Qwen3_5MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = _ids(21, 40, hf.config.vocab_size)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    r = _runner(gguf)
    try:
        assert parity(r.decode(ids, 0, 0), want) <= TOL
    finally:
        r.close()


CORPUS = [
    "Hello world! It's what we'll do; they're here, I'm sure you've seen it.",
    "Count from 3 to 19: 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19",
    "What is 123456 + 7890?  The answer is 131346.\n\n\tTabs\tand   spaces   ",
    "<|im_start|>user\nReverse: abc def<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nfed cba<|im_end|>",
    "Ünïcödé: naïve café, 東京, Привет, emoji 🙂 and symbols ~!@#$%^&*()_+{}|:\"<>?",
    "key -> value; apple -> red\r\nsky -> blue\n\n\n",
]


def test_gguf_vocabulary_tokenizes_like_hf(clover_files):
    from transformers import AutoTokenizer

    ckpt, gguf = clover_files
    tok = AutoTokenizer.from_pretrained(ckpt)
    r = _runner(gguf)
    try:
        for text in CORPUS:
            assert r.tokenize(text, special=True) == tok.encode(text, add_special_tokens=False), text
            ids = tok.encode(text, add_special_tokens=False)
            assert b"".join(r.token_to_piece(t, special=True) for t in ids).decode("utf-8") == text
    finally:
        r.close()


@pytest.mark.slow
def test_patches_apply_to_a_fresh_pinned_tree(tmp_path):
    from clover_gguf import build, llama_sdist

    sdist = llama_sdist.fetch_sdist(build.cache_root() / "sdist", quiet=True)
    tree = llama_sdist.extract_llama_source(sdist, tmp_path / "llama.cpp")
    build.apply_patches(tree, build.patch_files(source=llama_sdist.PINNED.name))  # whatever CLOVER_GGUF_SOURCE says
    assert (tree / "src" / "models" / "clover-moe.cpp").is_file()
    assert "LLM_ARCH_CLOVER" in (tree / "src" / "llama-arch.h").read_text()


@pytest.mark.slow
def test_llama_cli_runs_causal_with_chat_template(clover_files):
    p = subprocess.run([str(llama_tool("llama-cli")), "-m", str(clover_files[1]), "-p", "Count from 3 to 9.", "-n", "8",
                        "-st", "--temp", "0", "-t", "2", "-c", "256", "--no-warmup"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "> Count from 3 to 9." in p.stdout  # a chat turn (the template applied), not a raw completion
    assert "Generation:" in p.stdout  # tokens were generated


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["clover", "qwen35moe"])
def test_llama_server_answers_the_openai_client(bundled_gguf, bundled_eval, tmp_path, kind):
    """llama.cpp's own server (AR) on the bundled trained model, the clover file and its export-ar: a correct
    answer to a held-out prompt through the official openai client."""
    import openai

    from clover_gguf.export import export_ar

    model = bundled_gguf if kind == "clover" else export_ar(bundled_gguf, tmp_path / "ar.gguf", quiet=True, arch="qwen35moe").out
    row = bundled_eval[0]
    port = free_port()
    server = subprocess.Popen([str(llama_tool("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                               "--port", str(port), "-c", "512", "-t", "2", "--jinja", "--no-warmup"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        # llama-server turns thinking on only for templates it recognises (the real Qwen3.6 one, not the tiny one):
        # ask for it, since the tiny model was trained to think first. Sampling defaults are the GGUF's.
        r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": row["prompt"]}],
                                           max_tokens=48, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        msg = r.choices[0].message
        assert msg.role == "assistant" and r.usage.prompt_tokens > 10  # the chat template wrapped the message
        assert r.choices[0].finish_reason == "stop"
        assert msg.content.strip().endswith(row["answer"]), (msg.content, msg.model_extra)
    finally:
        server.terminate()
        server.wait(timeout=30)
