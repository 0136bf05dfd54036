"""Clover on MLX (clover_gguf/mlx_backend.py, docs/mac.md), on MLX's CPU device: causal and block logits equal the
PyTorch reference on a random tiny checkpoint and on a slice with the 35B's per-layer shapes; a 4-bit conversion
stays within the tolerance docs/mac.md states; on the bundled model draft-self (exact) gives AR's text and decodes
in the reference backend's passes (which the llama.cpp backend's tests equal); an MLX folder without the block
tensors runs AR and graft adds them; the commands take a folder, and the ones that do not run MLX never import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")  # the test extra installs mlx[cpu]; a machine without it skips this module

from clover_gguf import mlx_backend as mb  # noqa: E402
from clover_gguf.decoding import generate_all  # noqa: E402
from clover_gguf.errors import UserError  # noqa: E402
from clover_gguf.reference import CloverModel, ReferenceBackend  # noqa: E402

TOL = 1e-4  # relative, float32 on both sides
# a 4-bit conversion (groups of 64) of the bundled trained model against the reference, prompts and all-mask
# blocks of eight eval rows: measured 0.17 at most (0.10 on average), top-1 agreeing on 92% of rows (73% at least
# for one pass); 8-bit: 0.013 at most (docs/mac.md)
Q4_REL, Q4_TOP1 = 0.25, 0.85
Q8_REL = 0.03
BUNDLED = Path(__file__).resolve().parents[1] / "clover_gguf" / "assets" / "tiny-clover"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference on one thread: two spin against each other on a shared 2-core machine (as llama.cpp's do)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ids(rng, cfg, n):
    return rng.integers(0, cfg.vocab_size, size=n).tolist()


# ---------------------------------------------------------------------------------------------------------------
# Parity with the reference
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tiny):
    return CloverModel.from_pretrained(tiny, dtype=torch.float64), mb.load(tiny, dtype="float32")


def test_tiny_causal_and_block_logits_equal_the_reference(tiny_pair):
    ref, loaded = tiny_pair
    cfg = ref.cfg
    rng = np.random.default_rng(3)
    prefix, nxt = _ids(rng, cfg, 13), _ids(rng, cfg, 5)
    blocks = {"full": _ids(rng, cfg, cfg.block_size), "masked": [cfg.mask_token_id] * 8 + _ids(rng, cfg, 4),
              "short": _ids(rng, cfg, 3)}
    b = mb.MlxBackend(loaded)
    with torch.no_grad():
        want, state = ref.prefill(prefix)
        want_next, _ = ref.prefill(nxt, state)
        assert rel_err(b.commit(prefix), want.numpy()) < TOL
        for name, block in blocks.items():
            for coreset in (None, False, 0.5):
                b.coreset_top_p = mb.MlxBackend(loaded, coreset=coreset).coreset_top_p
                want_block = ref.block_logits(None, block, coreset=coreset, state=state).numpy()
                err = rel_err(b.block_logits(block), want_block)
                assert err < TOL, (name, coreset, err)
    # the block passes left the prefix as it was: the next causal pass continues it exactly
    assert rel_err(b.commit(nxt), want_next.numpy()) < TOL


def test_the_multimodal_layout_with_fused_experts_and_mtp(make_checkpoint, tmp_path):
    """A ForConditionalGeneration checkpoint (text_config, `model.language_model.` names, vision tensors), experts
    fused (gate_up_proj), an MTP block: loaded as is and through mlx-convert, the reference's logits."""
    ckpt = make_checkpoint(seed=2, experts="fused", prefix=True, mtp=True)
    ref = CloverModel.from_pretrained(ckpt, dtype=torch.float64)
    rng = np.random.default_rng(5)
    prefix, block = _ids(rng, ref.cfg, 11), _ids(rng, ref.cfg, 9)
    with torch.no_grad():
        want, state = ref.prefill(prefix)
        want_block = ref.block_logits(None, block, state=state).numpy()
    for folder in (ckpt, mb.convert(ckpt, tmp_path / "mlx").out):
        b = mb.MlxBackend(mb.load(folder, dtype="float32"))
        assert rel_err(b.commit(prefix), want.numpy()) < TOL and rel_err(b.block_logits(block), want_block) < TOL


def test_coreset_keep_is_the_reference_rule(tiny_pair):
    from clover_gguf.reference import coreset_keep_mask

    rng = np.random.default_rng(0)
    for t, e, k, p in [(32, 16, 8, 0.9), (5, 8, 2, 0.5), (32, 256, 8, 0.9), (1, 8, 2, 1.0)]:
        probs = torch.from_numpy(rng.dirichlet(np.full(e, 0.3), size=t))
        probs[:, 3] = probs[:, 4]  # equal masses: the lower index first
        want = coreset_keep_mask(probs, k, p).numpy()
        got = np.array(mb.coreset_keep(mx.array(probs.float().numpy()), k, p))
        assert (got == want).all(), (t, e, k, p)
    # equal masses at the cut: the lower index is kept (experts 1 and 2 each hold 0.6, the cut keeps one)
    probs = np.array([[0.1, 0.1, 0.6, 0.2], [0.1, 0.6, 0.1, 0.2]], dtype=np.float32)
    assert np.array(mb.coreset_keep(mx.array(probs), 1, 0.4)).tolist() == [False, True, False, False]
    # a top_p whose leading set is smaller than k: extended along the ranking to k experts
    probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.6, 0.3, 0.05, 0.05]], dtype=np.float32)
    assert np.array(mb.coreset_keep(mx.array(probs), 2, 0.1)).tolist() == [True, True, False, False]
    assert coreset_keep_mask(torch.from_numpy(probs), 2, 0.1).tolist() == [True, True, False, False]


def test_rollback_gives_the_state_of_the_kept_tokens(tiny_pair):
    ref, loaded = tiny_pair
    rng = np.random.default_rng(4)
    prefix, draft = _ids(rng, ref.cfg, 9), _ids(rng, ref.cfg, 7)
    b = mb.MlxBackend(loaded)
    b.commit(prefix)
    b.commit(draft)
    b.rollback(4)
    assert b.n_past == 12
    with torch.no_grad():
        want, _ = ref.prefill(prefix + draft[:3] + [5])
    assert rel_err(b.commit([5])[-1], want[-1].numpy()) < TOL
    with pytest.raises(ValueError):
        b.rollback(3)  # past the latest commit's one token
    # a prompt prefilled in passes of 4 tokens, as a long one is in passes of PREFILL_CHUNK
    b.reset()
    b.prefill_chunk = 4
    assert rel_err(b.prefill(prefix + draft[:3] + [5]), want[-1].numpy()) < TOL
    with torch.no_grad():
        want_block = ref.block_logits(prefix + draft[:3] + [5], draft).numpy()
    assert b.n_past == 13 and rel_err(b.block_logits(draft), want_block) < TOL


def test_draft_self_with_rejections_gives_ar(tiny_pair, tiny):
    """On a random model most drafted tokens are rejected: every round rolls back and runs the kept tokens again.
    draft-self (exact) still answers what AR answers, in the reference backend's passes."""
    ref, loaded = tiny_pair
    b, ref_b = mb.MlxBackend(loaded), ReferenceBackend(CloverModel.from_pretrained(tiny, dtype=torch.float32))
    rng = np.random.default_rng(11)
    drafted = accepted = 0
    for n in (7, 12):
        ids = _ids(rng, ref.cfg, n)
        ar, _ = generate_all(b, ids, mode="ar", max_new_tokens=12)
        got, stats = generate_all(b, ids, mode="draft-self", max_new_tokens=12, block_size=6, threshold=0.3)
        want, want_stats = generate_all(ref_b, ids, mode="draft-self", max_new_tokens=12, block_size=6, threshold=0.3)
        assert got == ar == want and stats.forward_passes == want_stats.forward_passes
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
    assert accepted < drafted and b.extra_passes > 0


def test_slice35b_logits_equal_the_reference(make_checkpoint):
    """The 35B's per-layer shapes (hidden 2048, 16 q / 2 kv heads of 256, GDN 16 key / 32 value heads of 128,
    experts of 512 top-8) with 16 experts, 4 layers, a 1,024-row vocabulary (tests/test_slice35b.py's checkpoint)."""
    ckpt = make_checkpoint(seed=5, preset="slice35b", num_experts=16, vocab_size=1024)
    ref = CloverModel.from_pretrained(ckpt, dtype=torch.float32)
    loaded = mb.load(ckpt, dtype="float32")
    assert (loaded.cfg.hidden_size, loaded.cfg.linear_num_value_heads, loaded.cfg.head_dim) == (2048, 32, 256)
    rng = np.random.default_rng(7)
    prefix, block = _ids(rng, ref.cfg, 6), _ids(rng, ref.cfg, 12)
    b = mb.MlxBackend(loaded)
    with torch.no_grad():
        want, state = ref.prefill(prefix)
        assert rel_err(b.commit(prefix), want.numpy()) < TOL
        assert rel_err(b.block_logits(block), ref.block_logits(None, block, state=state).numpy()) < TOL


# ---------------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx")
    out = {}
    for name, bits in (("f32", None), ("q4", 4), ("q8", 8)):
        out[name] = mb.convert(BUNDLED, root / name, q_bits=bits, q_group_size=64).out
    return out


@pytest.fixture(scope="module")
def bundled_ref():
    return CloverModel.from_pretrained(BUNDLED, dtype=torch.float32)


def _eval_prompts(n: int, stride: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from clover_gguf.testing.train_tiny import load_eval, row_conversation

    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    return [tok.encode(row_conversation(r).prompt_text()).ids for r in load_eval(BUNDLED)[::stride][:n]]


def test_the_folder_keeps_the_block_tensors_unquantized_and_mlx_lm_loads_it(converted):
    from mlx_lm.utils import load_model
    from safetensors import safe_open

    q4 = converted["q4"]
    with safe_open(str(q4 / mb.BLOCK_FILE), "np") as f:
        names = list(f.keys())
        assert len(names) == 4 * 2 and all(f.get_tensor(n).dtype == np.float32 for n in names)
    cfg = json.loads((q4 / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["model_type"] == "qwen3_5_moe" and cfg["mask_token_id"] == 379
    with safe_open(str(q4 / "model.safetensors"), "np") as f:
        assert any(n.endswith(".scales") for n in f.keys()) and not any("conv_right" in n for n in f.keys())
    # mlx-lm's own loader (what mlx_lm.generate uses) runs the same folder, AR, with the same causal logits as ours
    model, _ = load_model(q4)
    ids = _eval_prompts(1, 1)[0]
    ours = mb.MlxBackend(mb.load(q4)).commit(ids)
    assert rel_err(np.array(model(mx.array([ids]))[0]), ours) < 1e-6


def test_quantized_conversions_stay_within_the_stated_tolerance(converted, bundled_ref):
    ref = bundled_ref
    mask = [ref.cfg.mask_token_id] * ref.cfg.block_size
    backends = {k: mb.MlxBackend(mb.load(converted[k])) for k in ("f32", "q4", "q8")}
    errs: dict[str, list[float]] = {k: [] for k in backends}
    top1: list[float] = []
    for ids in _eval_prompts(3, 100):
        with torch.no_grad():
            want, state = ref.prefill(ids)
            want_block = ref.block_logits(None, mask, state=state)
        for k, b in backends.items():
            b.reset()
            got, got_block = b.commit(ids), b.block_logits(mask)
            errs[k] += [rel_err(got, want.numpy()), rel_err(got_block, want_block.numpy())]
            if k == "q4":
                top1 += [float((got.argmax(-1) == want.numpy().argmax(-1)).mean()),
                         float((got_block.argmax(-1) == want_block.numpy().argmax(-1)).mean())]
    assert max(errs["f32"]) < TOL
    assert max(errs["q8"]) < Q8_REL
    assert max(errs["q4"]) < Q4_REL and np.mean(top1) >= Q4_TOP1, (max(errs["q4"]), np.mean(top1))


def test_a_bfloat16_4bit_folder_runs_block_mode(tmp_path, bundled_ref):
    """What a Mac runs (the 35B is BF16): 4-bit weights, BF16 activations, the block math in float32: block logits
    near the reference's, and draft-self (exact) still AR's text."""
    b = mb.MlxBackend(mb.load(mb.convert(BUNDLED, tmp_path / "bf16-q4", q_bits=4, dtype="bfloat16").out))
    ids = _eval_prompts(1, 1)[0]
    mask = [bundled_ref.cfg.mask_token_id] * 32
    with torch.no_grad():
        _, state = bundled_ref.prefill(ids)
        want = bundled_ref.block_logits(None, mask, state=state).numpy()
    b.commit(ids)
    assert rel_err(b.block_logits(mask), want) < Q4_REL
    for ids in _eval_prompts(2, 113):
        ar, _ = generate_all(b, ids, mode="ar", max_new_tokens=32)
        for mode in ("draft-self", "auto"):  # both exact: AR's text on MLX too
            assert generate_all(b, ids, mode=mode, max_new_tokens=32)[0] == ar, mode


# ---------------------------------------------------------------------------------------------------------------
# Decoding on the bundled model
# ---------------------------------------------------------------------------------------------------------------
def test_bundled_draft_self_exact_gives_ar_and_the_reference_passes(converted, bundled_ref):
    """Greedy, controls off: draft-self (exact) answers what AR answers; draft-self and diffusion take the same
    passes, token for token, as the reference backend (whose decodes the llama.cpp backend's tests equal)."""
    mlx_b = mb.MlxBackend(mb.load(converted["f32"]))
    ref_b = ReferenceBackend(bundled_ref)
    for i, ids in enumerate(_eval_prompts(3, 97)):
        ar, _ = generate_all(mlx_b, ids, mode="ar", max_new_tokens=48)
        for mode in ("draft-self", "diffusion"):
            got, stats = generate_all(mlx_b, ids, mode=mode, max_new_tokens=48)
            if mode == "draft-self":
                assert got == ar and stats.forward_passes < len(ar)
            if i == 0:  # the reference decodes slowly: one prompt
                want, want_stats = generate_all(ref_b, ids, mode=mode, max_new_tokens=48)
                assert got == want and stats.forward_passes == want_stats.forward_passes, mode
                assert stats.tokens_per_pass == want_stats.tokens_per_pass


def test_bundled_decodes_take_the_llama_cpp_backends_passes(converted, bundled_gguf):
    """draft-self (exact) and diffusion on MLX and on the patched llama.cpp (F32 GGUF, exact settings): the same
    tokens in the same passes."""
    from clover_gguf.runtime import CloverRuntime

    mlx_b = mb.MlxBackend(mb.load(converted["f32"]))
    with CloverRuntime(bundled_gguf, n_ctx=512, exact=True, n_threads=1) as rt:  # 2 spin on a shared machine
        for ids in _eval_prompts(2, 61):
            for mode in ("draft-self", "diffusion"):
                got, stats = generate_all(mlx_b, ids, mode=mode, max_new_tokens=48)
                want, want_stats = generate_all(rt.backend, ids, mode=mode, max_new_tokens=48)
                assert got == want and stats.forward_passes == want_stats.forward_passes, mode
                assert stats.accepted_tokens == want_stats.accepted_tokens


def test_selection_in_mlx_decides_as_numpy_does(converted):
    """The greedy selection done in MLX (the GraphBackend rows: a few numbers per row leave it) answers exactly as
    the one on the rows' whole logits, the card's controls on, in every mode."""
    from clover_gguf.decoding import GraphBackend
    from clover_gguf.mlx_runtime import MlxRuntime
    from clover_gguf.testing.train_tiny import load_eval, row_conversation

    runs = {}
    for selection in ("graph", "numpy"):
        rt = MlxRuntime(converted["f32"], selection=selection)
        assert isinstance(rt.backend, GraphBackend)
        runs[selection] = [(a.raw, a.stats.forward_passes, a.stats.accepted_tokens)
                           for r in load_eval(BUNDLED)[::150]
                           for mode in ("ar", "draft-self", "diffusion")
                           for a in [rt.generate(row_conversation(r).messages, mode=mode, max_new_tokens=48)]]
    assert runs["graph"] == runs["numpy"] and all(raw for raw, *_ in runs["graph"])


def test_constrained_output_and_logprobs_in_mlx_as_in_numpy(converted, monkeypatch):
    """Constrained output on MLX (the grammar's bitmasks unpacked in MLX, issue 49): every kept token follows the
    grammar in every mode, constrained greedy draft-self gives constrained greedy AR's text, the MLX selection
    answers as the numpy one, token for token, and its logprobs (logprobs=3) are the numpy path's; also with every
    mask treated as wide (checked after passes of several rows instead of applied)."""
    from clover_gguf import decoding
    from clover_gguf.mlx_runtime import MlxRuntime
    from test_runtime_constrained import PROMPTS, _answer, grammars
    from clover_gguf.testing.automaton import replay

    rts = {s: MlxRuntime(converted["f32"], selection=s) for s in ("graph", "numpy")}
    for cheap in (1024, 0):
        monkeypatch.setattr(decoding, "CHEAP_MASK_IDS", cheap)
        for name in ("json", "no_e"):
            for prompt in PROMPTS[:2]:
                runs = {}
                for selection, rt in rts.items():
                    g = grammars(rt)[name]
                    want, ws, lps = _answer(rt, prompt, g, mode="ar", logprobs=3)
                    assert replay(g, want, ws.finish_reason == "stop") is None
                    runs[selection] = [(want, [(x.logprob, x.top) for x in lps])]
                    for mode in ("draft-self", "diffusion"):
                        got, st, lps = _answer(rt, prompt, g, mode=mode, logprobs=3)
                        assert replay(g, got, st.finish_reason == "stop") is None, (selection, mode, got)
                        assert mode == "diffusion" or got == want, (selection, mode)
                        runs[selection].append((got, [(x.logprob, x.top) for x in lps]))
                for (tg, lg), (tn, ln) in zip(runs["graph"], runs["numpy"]):
                    assert tg == tn
                    for (a, ta), (b, tb) in zip(lg, ln):
                        assert a == pytest.approx(b, abs=1e-4)
                        assert [t for t, _ in ta] == [t for t, _ in tb]
                        np.testing.assert_allclose([v for _, v in ta], [v for _, v in tb], atol=1e-4)


def test_forced_tokens_in_mlx_as_in_llama_cpp(converted, bundled_gguf):
    """Forced tokens on MLX (the same decoders as llama.cpp's runtime): a json_schema answer and a tool call
    (llguidance, as serve builds them), ar and draft-self: the text equal with and without and to llama.cpp's
    F32 GGUF (exact settings), AR one pass fewer per forced token, the same passes as llama.cpp's."""
    from clover_gguf.mlx_runtime import MlxRuntime
    from clover_gguf.runtime import CloverRuntime
    from test_runtime_constrained import PROMPTS, _answer, real_grammars

    rt = MlxRuntime(converted["f32"])
    with CloverRuntime(bundled_gguf, n_ctx=512, exact=True, n_threads=1) as ref:
        for name, make in real_grammars(rt).items():
            ref_make = real_grammars(ref)[name]
            for mode in ("ar", "draft-self"):
                for prompt in PROMPTS[:2]:
                    got, st, _ = _answer(rt, prompt, make, mode=mode, max_new_tokens=48)
                    off, st_off, _ = _answer(rt, prompt, make, mode=mode, forced=False, max_new_tokens=48)
                    want, st_ref, _ = _answer(ref, prompt, ref_make, mode=mode, max_new_tokens=48)
                    assert got == off == want and st.forced_tokens == st_ref.forced_tokens > 0, (name, mode, prompt)
                    assert st.forward_passes == st_ref.forward_passes < st_off.forward_passes, (name, mode, prompt)
                    if mode == "ar":
                        assert st.forward_passes == st_off.forward_passes - st.forced_tokens


# ---------------------------------------------------------------------------------------------------------------
# A community folder (no block tensors), graft, the commands
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def community(converted, tmp_path_factory) -> Path:
    """What a community MLX conversion holds: mlx-lm's files without the block tensors or the Clover keys."""
    import shutil

    out = tmp_path_factory.mktemp("community") / "clover-4bit"
    shutil.copytree(converted["q4"], out)
    (out / mb.BLOCK_FILE).unlink()
    cfg = json.loads((out / "config.json").read_text())
    for k in ("mask_token_id", "block_size", "linear_conv_right_kernel_dim", "moe_block_coreset_enabled",
              "moe_block_coreset_top_p", "clover_gguf_block_reading"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_folder_without_block_tensors_runs_ar_and_graft_adds_them(community, converted, tmp_path):
    from clover_gguf.graft import graft
    from clover_gguf.mlx_runtime import MlxRuntime

    rt = MlxRuntime(community)
    assert not rt.block_mode and rt.default_mode == "ar"
    assert rt.generate("What is 7 + 8?", mode="ar", max_new_tokens=24).text
    with pytest.raises(UserError, match="graft clover-4bit --from .* -o OUT_FOLDER"):
        rt.check_request(10, 10, "draft-self", 32)
    out = tmp_path / "grafted"
    res = graft(community, str(BUNDLED), out, quiet=True)
    assert res.added_tensors == 8 and (out / mb.BLOCK_FILE).is_file() and not (community / mb.BLOCK_FILE).exists()
    ids = _eval_prompts(1, 1)[0]
    a, b = mb.MlxBackend(mb.load(out)), mb.MlxBackend(mb.load(converted["q4"]))
    a.commit(ids), b.commit(ids)
    mask = [379] * 32
    assert np.array_equal(a.block_logits(mask), b.block_logits(mask))
    with pytest.raises(UserError, match="already has"):
        graft(out, str(BUNDLED), tmp_path / "again", quiet=True)


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_mlx_convert_on_the_command_line(converted, capsys, tmp_path):
    from clover_gguf.cli import main

    with pytest.raises(SystemExit) as e:
        main(["mlx-convert", str(BUNDLED), "-o", str(tmp_path / "q8"), "--q-bits", "8", "--json"])
    assert e.value.code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["q_bits"] == 8 and res["q_group_size"] == 64 and res["block_tensors"] == 8
    for args, words in [(["--q-group-size", "48"], "--q-group-size must be"), (["--q-bits", "7"], "--q-bits must be"),
                        ([], "exists (--force replaces it)")]:
        with pytest.raises(SystemExit) as e:
            main(["mlx-convert", str(BUNDLED), "-o", str(tmp_path / "q8"), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:
        main(["mlx-convert", str(converted["q4"]), "-o", str(tmp_path / "again")])
    assert e.value.code == 2 and "an MLX folder already" in capsys.readouterr().err


def test_generate_takes_an_mlx_folder_and_a_checkpoint(converted, capsys):
    from clover_gguf.cli import main

    for model in (converted["q8"], BUNDLED):
        with pytest.raises(SystemExit) as e:
            main(["generate", str(model), "-p", "Count from 12 to 17.", "--json", "-n", "40"])
        assert e.value.code == 0
        out = json.loads(capsys.readouterr().out)
        assert out["text"] == "12 13 14 15 16 17" and out["stats"]["mode"] == "auto"  # the default
    with pytest.raises(SystemExit) as e:
        main(["generate", str(converted["q8"]), "-p", "x", "--backend", "llama"])
    assert e.value.code == 2 and "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["doctor", "--json"])
    d = json.loads(capsys.readouterr().out)["mlx"]
    assert d["installed"] and d["metal"] is False and d["mlx"] == mx.__version__ and "no Metal" in d["summary"]


def test_commands_that_do_not_run_mlx_never_import_it_and_a_missing_mlx_is_one_line(tmp_path, converted):
    code = ("import sys; from clover_gguf.cli import main\n"
            "for args in (['generate', '--help'], ['serve', '--help'], ['mlx-convert', '--help']):\n"
            "    try: main(args)\n"
            "    except SystemExit: pass\n"
            "import clover_gguf.runtime, clover_gguf.serve, clover_gguf.chat, clover_gguf.graft\n"
            "import clover_gguf.mlx_runtime\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')], 'mlx imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # no MLX: a package named mlx that cannot be imported stands in for it
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("raise ImportError('no MLX here', name='mlx')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])])}
    r = _cli("generate", converted["q8"], "-p", "hi", "--backend", "mlx", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "make mlx" in r.stderr, r.stderr
    assert "pip install -e '.[mlx]'" in r.stderr, r.stderr  # from the checkout, the editable install kept
    r = _cli("mlx-convert", BUNDLED, "-o", tmp_path / "x", env=env)
    assert r.returncode == 2 and "make mlx" in r.stderr


def test_chat_and_serve_run_an_mlx_folder(converted):
    """A three-turn chat and the OpenAI-compatible server on an MLX folder (one runtime, its answers as ar's)."""
    import io

    from fastapi.testclient import TestClient

    from clover_gguf.chat import ChatSession
    from clover_gguf.mlx_runtime import MlxRuntime
    from clover_gguf.serve import create_app

    rt = MlxRuntime(converted["f32"])
    out = io.StringIO()
    ChatSession(converted["f32"], runtime=rt, max_new_tokens=48, out=out,
                inp=io.StringIO("What is 7 + 8?\nCount from 33 to 37.\n/mode ar\nReverse: c l o v e r\n")).loop()
    text = out.getvalue()
    assert "7 + 8 = 15" in text and "33 34 35 36 37" in text and "r e v o l c" in text
    with TestClient(create_app(lambda: rt, mode="draft-self", model_id="tiny-mlx")) as http:
        r = http.post("/v1/chat/completions", json={"model": "tiny-mlx", "max_tokens": 48,
                                                   "messages": [{"role": "user", "content": "What is 34 + 58?"}]})
        assert r.status_code == 200, r.text
        assert "34 + 58 = 92" in r.json()["choices"][0]["message"]["content"]
        assert http.get("/v1/models").json()["data"][0]["meta"]["block_mode"] is True
        # the chat page and its block view (clover_blocks) on MLX too
        assert http.get("/").status_code == 200
        body = {"max_tokens": 48, "stream": True, "clover_blocks": True,
                "messages": [{"role": "user", "content": "What is 34 + 58?"}]}
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        events = [e for c in chunks for e in c.get("clover_blocks", [])]
        assert {"block", "pass", "verify"} <= {e["type"] for e in events}
        assert sum(e["type"] == "pass" for e in events) == chunks[-1]["clover_stats"]["block_passes"]


def test_a_bad_folder_is_one_line(tmp_path, capsys):
    """No config.json, a corrupt weights file (checkpoint or MLX folder), a wrong-shape block file: one line, exit 2."""
    import shutil

    from clover_gguf.cli import main

    cases = {"empty": ("not a model folder", None)}
    for name, mlx_folder in (("ckpt", False), ("mlxdir", True)):
        d = tmp_path / name
        d.mkdir()
        for f in BUNDLED.glob("*.json"):
            shutil.copy(f, d)
        if mlx_folder:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "quantization": {"bits": 4, "group_size": 64}}))
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
        cases[name] = ("corrupt safetensors header", None)  # read before mlx-lm's loader reads it
    (tmp_path / "empty").mkdir()
    blk = tmp_path / "blk"
    mb.convert(BUNDLED, blk)
    from safetensors.numpy import load_file, save_file

    t = load_file(str(blk / mb.BLOCK_FILE))
    t = {k: (v[:5] if k.endswith("conv_right_weight") else v) for k, v in t.items()}
    save_file(t, str(blk / mb.BLOCK_FILE))
    cases["blk"] = ("conv_right_weight has shape", None)
    for name, (words, _) in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["generate", str(tmp_path / name), "-p", "hi"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1, (name, err)
