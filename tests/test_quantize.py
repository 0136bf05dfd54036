"""clover-gguf quantize / plan / imatrix on the patched llama.cpp (llama_model_quantize through the binding).

Runs in CI on the build `make llama` made (libllama and llama-imatrix): a missing library is a failure, never a
skip. Quality is measured on the bundled trained tiny model when it exists (clover_gguf/assets/tiny-clover),
else on a random make_tiny one, whose near-flat logits make top-1 agreement meaningless (see RANDOM_FLOORS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter

from clover_gguf.config import SHAPE_35B
from clover_gguf.errors import UserError
from clover_gguf.llama_context import LlamaContext, load_binding
from clover_gguf.offload import Offload
from clover_gguf.quantize import COMMUNITY_GIB, imatrix, plan, quantize, read_header
from clover_gguf.recipes import BUILTIN, FTYPES, recipe_for

load_binding()  # raises (fails the module) when the patched library or the binding is missing

ROOT = Path(__file__).resolve().parents[1]
# CLOVER_GGUF_QUALITY_MODEL points the quality tests at another trained checkpoint folder (for measuring)
ASSET = Path(os.environ.get("CLOVER_GGUF_QUALITY_MODEL", ROOT / "clover_gguf" / "assets" / "tiny-clover"))

# Quality floors on the trained tiny model (hidden 128: K-quant rows fall back to 32-blocks there, so Q4_K_M is
# mostly Q5_0 and Q8_0, IQ4_XS is IQ4_NL). Measured with this file's metric (causal + block-mode positions
# together) on a 300-step snapshot of train_tiny: Q8_0 top-1 0.991, KL 0.0013; Q4_K_M 0.983, 0.0077; IQ4_XS
# 0.962, 0.0143; Q3_K_M 0.949, 0.0156.
# type: (top-1 floor, mean KL ceiling).
# The 3,200-step bundled model (issue 17) measured Q8_0 top-1 0.987, KL 0.036; Q4_K_M 0.979, 0.0043; IQ4_XS 0.955,
# 0.0105; Q3_K_M 0.957, 0.0221. Q8_0's mean KL is above Q4_K_M's although every tensor where the two differ is
# Q8_0 against Q5_0: a few positions where the sharper trained model's logits swing carry the mean (open finding,
# docs/quantization.md); Q8_0's bound is set above it until that is understood.
TRAINED_FLOORS = {"Q8_0": (0.98, 0.05), "Q4_K_M": (0.9, 0.03), "IQ4_XS": (0.9, 0.05), "Q3_K_M": (0.88, 0.06)}
# On a random model (make_tiny seed 1, hidden 64) the logits are near ties, so even Q8_0 flips top-1s: KL is the
# fairer measure there. Measured over the same prompts: Q8_0 top-1 0.852, KL 0.0046; Q4_K_M 0.594, 0.024;
# IQ4_XS 0.334, 0.119; Q3_K_M 0.441, 0.087.
RANDOM_FLOORS = {"Q8_0": (0.75, 0.015), "Q4_K_M": (0.45, 0.06), "IQ4_XS": (0.2, 0.25), "Q3_K_M": (0.3, 0.2)}

TASKS = [("Count from 12 to 17.", "12 13 14 15 16 17"), ("What is 23 + 58?", "23 + 58 = 81"),
         ("Reverse: q w e r", "r e w q"), ("Copy: a b c d e", "a b c d e"), ("Count from 40 to 44.", "40 41 42 43 44"),
         ("What is 91 + 17?", "91 + 17 = 108")]
THINK = "<think>\nLet me work it out.\n</think>\n\n"


def _convert(ckpt: Path, out: Path, outtype: str = "f32") -> Path:
    subprocess.run([sys.executable, "-m", "clover_gguf", "convert", str(ckpt), "-o", str(out), "--outtype", outtype,
                    "--quiet"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def wide(make_checkpoint, tmp_path_factory) -> Path:
    """A random model with 256-wide rows, so that K-quants and IQ types apply without falling back."""
    return _convert(make_checkpoint(seed=3, preset="wide"), tmp_path_factory.mktemp("q") / "wide-f32.gguf")


@pytest.fixture(scope="module")
def quality_model(make_checkpoint, tmp_path_factory) -> tuple[Path, bool]:
    trained = (ASSET / "config.json").is_file()
    ckpt = ASSET if trained else make_checkpoint(seed=1)
    return _convert(ckpt, tmp_path_factory.mktemp("q") / "quality-f32.gguf"), trained


def _logits(path: Path) -> np.ndarray:
    """Logits of the chat prompts + answers (causal) and of a first all-mask block pass after each prompt."""
    causal, block = [], []
    with LlamaContext(path, n_ctx=512, n_threads=2, exact=True) as c:
        mask = int(c.meta("tokenizer.ggml.mask_token_id"))
        for p, a in TASKS:
            prompt = c.tokenize(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{THINK}")
            c.clear()
            causal.append(c.decode(prompt + c.tokenize(a + "<|im_end|>"), 0))
            c.clear()
            c.decode(prompt, 0, logits=False)
            block.append(c.block([mask] * 32, len(prompt)))
    return np.concatenate(causal + block)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def reference_logits(quality_model) -> np.ndarray:
    return _logits(quality_model[0])


# ---- runs --------------------------------------------------------------------------------------------------------
def test_quantized_model_runs_causal_and_block(wide, tmp_path):
    out = quantize(wide, tmp_path / "q4km.gguf", "Q4_K_M", quiet=True).out
    with LlamaContext(out, n_ctx=256, n_threads=2) as c:
        a = c.decode([5, 6, 7, 8, 9], 0)
        b = c.block([10] * 32, 5)
        assert c.meta("clover_moe.quant.recipe").startswith("q4_k_m ")
        assert c.meta("general.file_type") == str(FTYPES["Q4_K_M"])
    assert a.shape == (5, c.n_vocab) and b.shape == (32, c.n_vocab)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    types = {qt for _, qt in read_header(out).tensors.values()}
    assert QT.Q4_K in types and QT.Q6_K in types  # real K-quants, no fallback on 256-wide rows


# ---- every recipe: the output is what the plan said ------------------------------------------------------------
@pytest.mark.parametrize("qtype", BUILTIN)
def test_recipe_output_matches_plan(wide, tmp_path, qtype):
    p = plan(qtype, src=wide)
    res = quantize(wide, tmp_path / f"{qtype}.gguf", qtype, quiet=True, threads=2)
    got = read_header(res.out)
    assert {t.name: t.type for t in p.tensors} == {n: qt for n, (_, qt) in got.tensors.items()}
    assert res.size_bytes == p.size_bytes  # the predicted size is the file size, to the byte
    assert got.header_bytes == p.header_bytes  # exactly, not only after padding to the alignment
    assert got.file_type == FTYPES[qtype]
    # the Clover invariants every recipe carries
    for name, (shape, qt) in got.tensors.items():
        if ".ssm_alpha." in name or ".ssm_beta." in name or "ffn_gate_inp" in name or "ssm_conv1d" in name \
                or name.endswith(("ssm_block_scale", "ssm_block_history_bias", "ssm_block_history_c", "ssm_a",
                                  "ssm_dt.bias")):
            assert qt == QT.F32, name
    r = recipe_for(qtype)
    assert r.source.endswith(f"{qtype.lower()}.toml")
    if r.output is not None:
        assert got.tensors["output.weight"][1] == r.output
    assert got.tensors["token_embd.weight"][1] == r.token_embd


def test_plan_json_and_text(wide):
    p = plan("Q4_K_M", src=wide)
    d = p.to_json()
    assert d["size_bytes"] == p.size_bytes and len(d["tensors"]) == len(read_header(wide).tensors)
    assert set(d["tensors"][0]) >= {"name", "type", "bytes"}
    json.dumps(d)
    text = p.format()
    # the published files' sizes are the 35B's: no comparison for a model of another shape (issue 16)
    assert "official" not in text and "community" not in text and "Q4_K_M (q4_k_m)" in text
    assert d["official_gib"] is None and d["community_gib"] is None


def test_plan_from_another_config_has_no_35b_comparison(make_checkpoint):
    """(the 35B's own config gets it: test_35b_plan_sizes_match_community_files)"""
    tiny = plan("Q4_K_M", config=make_checkpoint(seed=1) / "config.json")
    assert "official" not in tiny.format() and tiny.to_json()["official_gib"] is None


def test_imatrix_with_too_little_text_says_why(wide, tmp_path):
    """llama-imatrix's own reason, not its last log line (issue 16)."""
    text = tmp_path / "short.txt"
    text.write_text("What is 2 + 3?\n")  # 8 tokens in llama-imatrix's own count (its -f drops the final newline)
    with pytest.raises(UserError, match=r"needs at least 128 tokens for a context of 64 tokens; .*short.txt "
                                        r"tokenizes to only 8 tokens"):
        imatrix(wide, text, tmp_path / "im.gguf", ctx=64, quiet=True, offload=Offload(threads=2))
    assert list(tmp_path.iterdir()) == [text]


# ---- quality against F32 ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M", "IQ4_XS", "Q3_K_M"])
def test_quality_against_f32(quality_model, reference_logits, tmp_path, qtype):
    f32, trained = quality_model
    out = quantize(f32, tmp_path / f"{qtype}.gguf", qtype, quiet=True).out
    q = _logits(out)
    ref = _log_softmax(reference_logits)
    kl = float((np.exp(ref) * (ref - _log_softmax(q))).sum(-1).mean())
    top1 = float((reference_logits.argmax(-1) == q.argmax(-1)).mean())
    floor, ceiling = (TRAINED_FLOORS if trained else RANDOM_FLOORS)[qtype]
    print(f"{qtype} ({'trained' if trained else 'random'}): top-1 {top1:.3f}, KL {kl:.5f}")
    assert top1 >= floor, f"{qtype}: top-1 agreement {top1:.3f} < {floor}"
    assert kl <= ceiling, f"{qtype}: mean KL {kl:.5f} > {ceiling}"


# ---- imatrix: IQ types and importance-weighted K-quants end to end ---------------------------------------------
@pytest.mark.slow
def test_imatrix_then_iq3_xxs(wide, tmp_path):
    text = tmp_path / "calib.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(
        f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n{a} + {b} = {a + b}<|im_end|>"
        for a, b in rng.integers(10, 99, size=(80, 2))))
    with pytest.raises(UserError, match="importance matrix"):
        quantize(wide, tmp_path / "no.gguf", "IQ3_XXS", quiet=True)
    assert not (tmp_path / "no.gguf").exists()
    im = imatrix(wide, text, tmp_path / "imatrix.gguf", ctx=64, chunks=8, quiet=True, offload=Offload(threads=2))
    r = GGUFReader(im)
    assert any(t.name.endswith(".in_sum2") for t in r.tensors)
    for qtype in ("IQ3_XXS", "Q4_K_M"):
        res = quantize(wide, tmp_path / f"{qtype}.gguf", qtype, imatrix=im, quiet=True, threads=2)
        assert res.out.is_file()
        with LlamaContext(res.out, n_ctx=128, n_threads=2) as c:
            assert np.isfinite(c.decode([5, 6, 7], 0)).all()
            assert c.meta("quantize.imatrix.entries_count") is not None
    assert QT.IQ3_XXS in {qt for _, qt in read_header(tmp_path / "IQ3_XXS.gguf").tensors.values()}


# ---- errors: one UserError each, and no output file ------------------------------------------------------------
def _no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob(".out.gguf.partial-*"))


def test_error_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    with pytest.raises(UserError, match="not a GGUF file"):
        quantize(bad, tmp_path / "out.gguf", "Q4_K_M", quiet=True)
    _no_output(tmp_path)


def test_error_not_clover(tmp_path):
    other = tmp_path / "llama.gguf"
    w = GGUFWriter(other, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="not a Clover GGUF"):
        quantize(other, tmp_path / "out.gguf", "Q4_K_M", quiet=True)
    with pytest.raises(UserError, match="not a Clover GGUF"):
        plan("Q4_K_M", src=other)
    _no_output(tmp_path)


@pytest.mark.parametrize("pattern,qtype,error", [("ffn_down", "Q4_KM", "unknown tensor type 'Q4_KM'"),
                                                  ("no_such_tensor", "Q8_0", "matches no tensor")],
                         ids=["unknown-type", "rule-matches-nothing"])
def test_error_bad_recipe_rule(wide, tmp_path, pattern, qtype, error):
    rf = tmp_path / "r.toml"
    rf.write_text(f'ftype = "Q4_K_M"\n[[rules]]\npattern = "{pattern}"\ntype = "{qtype}"\n')
    with pytest.raises(UserError, match=error):
        quantize(wide, tmp_path / "out.gguf", "Q4_K_M", recipe_file=rf, quiet=True)
    _no_output(tmp_path)


def test_error_output_exists(wide, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(UserError, match="exists"):
        quantize(wide, out, "Q8_0", quiet=True)
    assert out.read_bytes() == b"keep me"
    quantize(wide, out, "Q8_0", quiet=True, force=True)
    assert read_header(out).file_type == FTYPES["Q8_0"]


def test_error_unknown_type_and_requantize(wide, make_checkpoint, tmp_path):
    with pytest.raises(UserError, match="unknown quantization type"):
        quantize(wide, tmp_path / "out.gguf", "Q4_K_X", quiet=True)
    q8 = _convert(make_checkpoint(seed=3, preset="wide"), tmp_path / "q8.gguf", "q8_0")
    with pytest.raises(UserError, match="already quantized"):
        quantize(q8, tmp_path / "out.gguf", "Q4_K_M", quiet=True)
    _no_output(tmp_path)


def test_cli_error_is_one_line(tmp_path):
    """Through the command line: one line on stderr, exit 2, no output."""
    bad = tmp_path / "x.gguf"
    bad.write_text("nope")
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "quantize", str(bad), str(tmp_path / "out.gguf"),
                        "--type", "Q4_K_M"], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "not a GGUF file" in p.stderr
    _no_output(tmp_path)


# ---- the 35B plan from its config alone ------------------------------------------------------------------------
@pytest.mark.slow
def test_35b_plan_sizes_match_community_files(tmp_path):
    from clover_gguf.skeleton import write_skeleton

    skel = tmp_path / "skeleton.gguf"
    write_skeleton(SHAPE_35B, skel)
    assert skel.stat().st_size > 60 * 2**30 and skel.stat().st_blocks * 512 < 64 * 2**20  # sparse
    for qtype, want in COMMUNITY_GIB.items():
        got = plan(qtype, src=skel).size_gib
        assert abs(got / want - 1) < 0.005, f"{qtype}: planned {got:.3f} GiB, community file {want} GiB"
    # the --config path (skeleton in a temporary folder) gives the same plan
    p = plan("Q4_K_M", config=SHAPE_35B)
    assert abs(p.size_gib / COMMUNITY_GIB["Q4_K_M"] - 1) < 0.005
    assert "official  Q4_K_M of Clover-35B-A3B: 21.42 GiB" in p.format()
