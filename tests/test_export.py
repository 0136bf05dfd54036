"""The AR export (`export-ar`, `convert --arch qwen35moe`): a qwen35moe GGUF stock llama.cpp loads, with the clover
file's causal logits. The logits run through the patched build's qwen35moe class, which the patches leave as
upstream has it (bench/compat.py repeats them on the unpatched build).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from clover_gguf.convert import QWEN35MOE_HPARAMS, convert
from clover_gguf.export import export_ar
from clover_gguf.gguf_header import read_header
from clover_gguf.info import read_info
from clover_gguf.llama_context import LlamaContext
from clover_gguf.metadata import BLOCK_KEYS
from clover_gguf.tensor_map import CLOVER_EXTRA_RE

TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny random Clover as clover F32, its export, and both at Q4_K_M (quantized clover file, then exported)."""
    from clover_gguf.quantize import quantize

    d = tmp_path_factory.mktemp("export")
    f = {"clover": d / "clover-f32.gguf", "ar": d / "ar-f32.gguf", "clover_q4": d / "clover-q4_k_m.gguf",
         "ar_q4": d / "ar-q4_k_m.gguf"}
    convert(tiny, f["clover"], outtype="f32", quiet=True)
    export_ar(f["clover"], f["ar"], quiet=True, arch="qwen35moe")
    quantize(f["clover"], f["clover_q4"], "Q4_K_M", quiet=True)
    p = _cli("export-ar", f["clover_q4"], f["ar_q4"], "--quiet", "--arch", "qwen35moe")
    assert p.returncode == 0, p.stderr
    return f


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_convert_arch_qwen35moe_is_the_export(tiny, tmp_path, outtype):
    """Two routes to one file: `convert --arch qwen35moe` and `export-ar` of the clover conversion agree byte for
    byte, so the keys, the dropped tensors and the layout have one definition."""
    clover, direct, exported = tmp_path / "c.gguf", tmp_path / "d.gguf", tmp_path / "e.gguf"
    convert(tiny, clover, outtype=outtype, quiet=True)
    p = _cli("convert", tiny, "-o", direct, "--outtype", outtype, "--arch", "qwen35moe", "--quiet")
    assert p.returncode == 0, p.stderr
    export_ar(clover, exported, quiet=True, arch="qwen35moe")
    assert direct.read_bytes() == exported.read_bytes()


def test_export_keys_and_tensors(files):
    src, out = read_header(files["clover_q4"], full=True), read_header(files["ar_q4"], full=True)
    assert out.arch == "qwen35moe"
    assert not [k for k in out.kv if k.startswith("clover_moe.")]
    hp = {k[len("clover_moe."):] for k in src.kv if k.startswith("clover_moe.") and k[len("clover_moe."):] in QWEN35MOE_HPARAMS}
    assert {k[len("qwen35moe."):] for k in out.kv if k.startswith("qwen35moe.")} == hp
    for k in hp:
        assert out.kv[f"qwen35moe.{k}"] == src.kv[f"clover_moe.{k}"] and out.types[f"qwen35moe.{k}"] == src.types[f"clover_moe.{k}"]
    for k in ("tokenizer.chat_template", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.file_type",
              "tokenizer.ggml.mask_token_id"):
        assert out.kv[k] == src.kv[k], k
    assert abs(out.kv["general.sampling.penalty_repeat"] - 1.05) < 1e-6  # the card's default, where llama.cpp reads it
    dropped = [n for n in src.tensors if CLOVER_EXTRA_RE.match(n)]
    assert dropped and list(out.tensors) == [n for n in src.tensors if n not in dropped]
    # quantized tensors copied bit for bit (no requantization)
    theirs, ours = GGUFReader(files["clover_q4"]), GGUFReader(files["ar_q4"])
    src_data = {t.name: t for t in theirs.tensors}
    assert {t.tensor_type.name for t in ours.tensors} - {"F32", "F16"}  # (the tiny rows fall back from Q4_K)
    for t in ours.tensors:
        s = src_data[t.name]
        assert t.tensor_type == s.tensor_type and np.array_equal(t.shape, s.shape)
        assert np.asarray(t.data).tobytes() == np.asarray(s.data).tobytes(), t.name


@pytest.mark.parametrize("kind", ["f32", "q4_k_m"])
def test_exported_file_loads_as_qwen35moe_with_the_clover_logits(files, kind):
    clover, ar = (files["clover"], files["ar"]) if kind == "f32" else (files["clover_q4"], files["ar_q4"])
    ids = np.random.default_rng(5).integers(0, 300, size=29).tolist()
    got = {}
    for name, path in (("clover", clover), ("ar", ar)):
        with LlamaContext(path, n_ctx=256, n_ubatch=256, exact=True, n_threads=2) as ctx:
            assert ctx.meta("general.architecture") == ("qwen35moe" if name == "ar" else "clover_moe")
            rows = [ctx.decode(ids[:21], 0, 0)]
            rows += [ctx.decode([t], 21 + i, 0) for i, t in enumerate(ids[21:])]  # token by token on the same state
            got[name] = np.concatenate(rows)
    assert np.abs(got["clover"]).max() > 0
    err = rel_err(got["ar"], got["clover"])
    print(f"{kind}: relative logit difference exported vs clover {err:.3e}")
    assert err <= TOL


def test_info_tells_the_kinds_apart(files, make_checkpoint, tmp_path):
    plain = tmp_path / "plain.gguf"
    convert(make_checkpoint(seed=2, plain_qwen=True), plain, outtype="f32", quiet=True)
    kinds = {k: read_info(files[k])["kind"] for k in ("clover", "ar", "ar_q4")}
    assert kinds == {"clover": "clover_moe", "ar": "qwen35moe", "ar_q4": "qwen35moe"}
    assert read_info(plain)["kind"] == "clover_moe-ar"
    p = _cli("info", files["ar_q4"])
    assert p.returncode == 0 and "architecture  qwen35moe" in p.stdout and "stock llama.cpp" in p.stdout


@pytest.mark.parametrize("which", ["clover", "ar_q4"])
def test_gguf_dump_reads_what_info_reports(files, which):
    """The gguf package's own gguf-dump reads our files; its values are the ones `info --json` reports."""
    path = files[which]
    dump = subprocess.run([str(Path(sys.executable).parent / "gguf-dump"), "--json", "--json-array", str(path)],
                          capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr[-2000:]
    theirs = json.loads(dump.stdout)
    p = _cli("info", path, "--json")
    assert p.returncode == 0, p.stderr
    ours = json.loads(p.stdout)
    meta = {k: v["value"] for k, v in theirs["metadata"].items()}
    assert meta["general.architecture"] == ours["architecture"]
    assert meta["GGUF.tensor_count"] == ours["tensor_count"] == len(theirs["tensors"])
    for key, value in ours["hparams"].items():
        want = meta[key if key in BLOCK_KEYS else f"{ours['architecture']}.{key}"]  # arch-less diffusion.* as they are
        if isinstance(value, float):
            assert value == pytest.approx(want, rel=1e-6), key
        elif isinstance(value, str) and value.endswith(" values]"):  # long arrays are only counted
            assert f"[{len(want)} values]" == value, key
        else:
            assert value == want, key
    by_type: dict[str, int] = {}
    for t in theirs["tensors"].values():
        by_type[t["type"]] = by_type.get(t["type"], 0) + 1
    assert by_type == ours["tensors_by_type"]


def test_export_refuses_a_non_clover_file(files, tmp_path):
    out = tmp_path / "again.gguf"
    for bad in (files["ar"], Path(__file__)):
        p = _cli("export-ar", bad, out)
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
        assert not out.exists() and not list(tmp_path.glob(".*partial*"))
    p = _cli("export-ar", files["clover"], files["ar"])  # no silent overwrite
    assert p.returncode == 2 and "--force" in p.stderr
