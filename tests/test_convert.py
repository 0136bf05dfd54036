"""The converter against an independent re-derivation of every GGUF tensor from the HF checkpoint."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from clover_gguf.checkpoint import load_hf_tensors
from clover_gguf.config import CloverConfig
from clover_gguf.convert import convert
from clover_gguf.errors import UserError


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensors as float32 numpy arrays in numpy (HF-like) order."""
    out = {}
    for t in GGUFReader(path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type == QT.BF16:
            a = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t.tensor_type in (QT.F32, QT.F16):
            a = np.asarray(t.data).astype(np.float32)
        else:
            a = quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = a.reshape(shape)
    return out


def _tiled_index(cfg: CloverConfig, head_dim: int) -> np.ndarray:
    """For each tiled position, the grouped (HF) position it takes its value from — written as index arithmetic,
    independently of the converter's reshape/swapaxes."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    rep = hv // hk
    idx = []
    for tiled_head in range(hv):
        r, g = divmod(tiled_head, hk)  # tiled order: [k0v0, k1v0, ..., k0v1, k1v1, ...]
        grouped_head = g * rep + r
        idx.extend(range(grouped_head * head_dim, (grouped_head + 1) * head_dim))
    return np.array(idx)


def expected_gguf(src: Path) -> dict[str, np.ndarray]:
    """What each GGUF tensor must hold, from the HF tensors and docs/gguf.md alone."""
    cfg = CloverConfig.from_file(src)
    hf = {k: v.numpy().astype(np.float64) for k, v in load_hf_tensors(src).items()}
    vi = _tiled_index(cfg, cfg.linear_value_head_dim)
    hi = _tiled_index(cfg, 1)
    qk = 2 * cfg.key_dim
    qkv_idx = np.concatenate([np.arange(qk), qk + vi])
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    e = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": 1 + hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        e["output.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        e[b + "attn_norm.weight"] = 1 + hf[p + "input_layernorm.weight"]
        e[b + "post_attention_norm.weight"] = 1 + hf[p + "post_attention_layernorm.weight"]
        if cfg.is_full_attention(i):
            for ours, theirs in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                 ("attn_output", "o_proj")]:
                e[b + ours + ".weight"] = hf[p + f"self_attn.{theirs}.weight"]
            e[b + "attn_q_norm.weight"] = 1 + hf[p + "self_attn.q_norm.weight"]
            e[b + "attn_k_norm.weight"] = 1 + hf[p + "self_attn.k_norm.weight"]
        else:
            la = p + "linear_attn."
            e[b + "attn_qkv.weight"] = hf[la + "in_proj_qkv.weight"][qkv_idx]
            e[b + "attn_gate.weight"] = hf[la + "in_proj_z.weight"][vi]
            e[b + "ssm_beta.weight"] = hf[la + "in_proj_b.weight"][hi]
            e[b + "ssm_alpha.weight"] = hf[la + "in_proj_a.weight"][hi]
            e[b + "ssm_conv1d.weight"] = hf[la + "conv1d.weight"][:, 0, :][qkv_idx]
            e[b + "ssm_dt.bias"] = hf[la + "dt_bias"][hi]
            e[b + "ssm_a"] = -np.exp(hf[la + "A_log"])[hi]
            e[b + "ssm_norm.weight"] = hf[la + "norm.weight"]
            e[b + "ssm_out.weight"] = hf[la + "out_proj.weight"][:, vi]
            if cfg.is_clover:
                e[b + "ssm_conv1d_right.weight"] = hf[la + "conv_right_weight"][:, 0, :][qkv_idx]
                e[b + "ssm_block_scale"] = np.exp(hf[la + "bd_softmax_logit_scale"])[hi]
                e[b + "ssm_block_history_bias"] = hf[la + "bd_softmax_history_bias"][hi]
                e[b + "ssm_block_history_c"] = hf[la + "bd_softmax_history_c"][hi]
        e[b + "ffn_gate_inp.weight"] = hf[p + "mlp.gate.weight"]
        e[b + "ffn_gate_exps.weight"] = hf[p + "mlp.experts.gate_proj"]
        e[b + "ffn_up_exps.weight"] = hf[p + "mlp.experts.up_proj"]
        e[b + "ffn_down_exps.weight"] = hf[p + "mlp.experts.down_proj"]
        e[b + "ffn_gate_inp_shexp.weight"] = hf[p + "mlp.shared_expert_gate.weight"]  # [1, H], as upstream
        for n in ("gate", "up", "down"):
            e[b + f"ffn_{n}_shexp.weight"] = hf[p + f"mlp.shared_expert.{n}_proj.weight"]
    return e


CASES = {
    "f32-single-per-expert": dict(seed=5),
    "bf16-fused-prefix-sharded-mtp": dict(seed=6, dtype="bf16", experts="fused", prefix=True, mtp=True,
                                          shard_size=200_000),
    "f32-fused-sharded": dict(seed=7, experts="fused", shard_size=300_000),
    "bf16-per-expert-prefix": dict(seed=8, dtype="bf16", prefix=True, tie=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tensor_equals_its_source(make_checkpoint, tmp_path, case):
    opts = CASES[case]
    src = make_checkpoint(**opts)
    if opts.get("shard_size"):
        assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 1
    outtype = "bf16" if opts.get("dtype") == "bf16" else "f32"
    out = tmp_path / "m.gguf"
    res = convert(src, out, outtype=outtype, quiet=True)
    got = _read_gguf(out)
    want = expected_gguf(src)
    if opts.get("mtp"):
        n = CloverConfig.from_file(src).num_hidden_layers
        mtp = {k for k in got if k.startswith(f"blk.{n}.")}
        assert {f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.attn_q.weight", f"blk.{n}.ffn_up_exps.weight"} <= mtp
        got = {k: v for k, v in got.items() if k not in mtp}
    assert sorted(got) == sorted(want)
    assert res.n_tensors == len(got) + (len(mtp) if opts.get("mtp") else 0)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        if outtype == "bf16" and g.ndim > 1 and not name.startswith(("blk.0.ssm_conv", "blk.1.ssm_conv")):
            # bf16 source -> bf16 output: bits copied; transformed small tensors are F32 of the bf16 values
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=name)


def test_q8_0_dequantizes_close_to_source(tiny, tmp_path):
    out = tmp_path / "q8.gguf"
    convert(tiny, out, outtype="q8_0", quiet=True)
    types = {t.name: t.tensor_type for t in GGUFReader(out).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == QT.Q8_0
    assert types["blk.0.ssm_conv1d.weight"] == QT.F32 and types["blk.0.ssm_conv1d_right.weight"] == QT.F32
    got, want = _read_gguf(out), expected_gguf(tiny)
    for name in ("blk.0.ffn_up_exps.weight", "blk.0.attn_qkv.weight", "token_embd.weight"):
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < 1e-2, (name, err)


def test_metadata_and_vocabulary_round_trip(tiny, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "m.gguf"
    convert(tiny, out, outtype="f32", quiet=True)
    r = GGUFReader(out)
    f = r.fields
    val = lambda k: f[k].parts[f[k].data[0]].tolist()[0]  # noqa: E731
    txt = lambda k: bytes(f[k].parts[f[k].data[0]]).decode()  # noqa: E731
    cfg = CloverConfig.from_file(tiny)
    assert txt("general.architecture") == "clover_moe"
    assert txt("tokenizer.ggml.pre") == "qwen35" and txt("tokenizer.ggml.model") == "gpt2"
    assert val("clover_moe.block_count") == cfg.num_hidden_layers
    assert val("clover_moe.attention.key_length") == cfg.head_dim
    assert val("clover_moe.ssm.time_step_rank") == cfg.linear_num_value_heads
    assert val("diffusion.span_length") == 32
    assert abs(val("diffusion.threshold") - 0.95) < 1e-6
    assert val("clover_moe.diffusion.conv_right_kernel") == cfg.right_kernel
    assert bool(val("clover_moe.diffusion.enabled")) and bool(val("clover_moe.diffusion.expert_coreset"))
    assert abs(val("clover_moe.diffusion.expert_coreset_top_p") - 0.9) < 1e-6
    assert abs(val("clover_moe.generation.presence_penalty") - 0.9) < 1e-6
    assert abs(val("clover_moe.generation.repetition_penalty") - 1.05) < 1e-6
    assert val("clover_moe.generation.think_end_bias_start") == 4096
    assert val("tokenizer.ggml.mask_token_id") == cfg.mask_token_id
    assert "enable_thinking" in txt("tokenizer.chat_template")

    tok = AutoTokenizer.from_pretrained(tiny)
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    assert len(tokens) == cfg.vocab_size
    n = len(tok)
    assert tokens[:n] == tok.convert_ids_to_tokens(list(range(n)))
    assert all(t.startswith("[PAD") for t in tokens[n:])
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode() for i in f["tokenizer.ggml.merges"].data]
    hf_merges = json.loads((tiny / "tokenizer.json").read_text())["model"]["merges"]
    assert merges == [" ".join(m) for m in hf_merges]
    assert val("tokenizer.ggml.eos_token_id") == tok.convert_tokens_to_ids("<|im_end|>")
    types = [f["tokenizer.ggml.token_type"].parts[i].tolist()[0] for i in f["tokenizer.ggml.token_type"].data]
    assert types[tok.convert_tokens_to_ids("<|im_start|>")] == 3  # control
    assert types[tok.convert_tokens_to_ids("<think>")] == 4  # user-defined


def test_plain_qwen_converts_without_block_mode(make_checkpoint, tmp_path):
    src = make_checkpoint(seed=9, plain_qwen=True)
    out = tmp_path / "q.gguf"
    res = convert(src, out, outtype="f32", quiet=True)
    assert any("block mode will be unavailable" in n for n in res.notices)
    from clover_gguf.info import read_info

    info = read_info(out)
    assert info["features"] == {"block_mode": False, "coreset": False, "mtp": False}
    assert not any("ssm_conv1d_right" in n for n in _read_gguf(out))


def test_dry_run_writes_nothing(tiny, tmp_path):
    out = tmp_path / "dry.gguf"
    res = convert(tiny, out, outtype="bf16", dry_run=True, quiet=True)
    assert res.out is None and not out.exists() and not list(tmp_path.iterdir())
    assert res.n_tensors > 50 and res.nbytes > 0


def test_interrupt_leaves_no_file(tiny, tmp_path, monkeypatch):
    import clover_gguf.convert as conv

    real = conv._encode
    calls = {"n": 0}

    def interrupted(a, q):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(a, q)

    monkeypatch.setattr(conv, "_encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny, tmp_path / "x.gguf", outtype="f16", quiet=True)
    assert list(tmp_path.iterdir()) == []


# ---- errors: one line, exit code 2, no output file ----------------------------------------------------------
def _run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _break_missing_config(d: Path) -> None:
    (d / "config.json").unlink()


def _break_missing_shard(d: Path) -> None:
    shards = sorted(d.glob("model-*.safetensors"))
    shards[-1].unlink()


def _break_truncated(d: Path) -> None:
    f = sorted(d.glob("*.safetensors"))[0]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _break_corrupt_header(d: Path) -> None:
    f = sorted(d.glob("*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))


def _break_shape(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))


def _add_tensor(d: Path, name: str, dtype: str, payload: bytes, shape: list[int]) -> None:
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, len(payload)]}}).encode()
    (d / "extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"][name] = "extra.safetensors"
        index.write_text(json.dumps(data))


def _break_unknown(d: Path) -> None:
    _add_tensor(d, "model.layers.0.mystery.weight", "F32", b"\0" * 16, [4])


def _break_dtype(d: Path) -> None:
    f = sorted(d.glob("*.safetensors"))[0]
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["model.embed_tokens.weight"]["dtype"] = "I32"  # same byte size as F32
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (n - len(blob))
    assert len(blob) == n
    f.write_bytes(raw[:8] + blob + raw[8 + n:])


BREAKS = {
    "missing config": (_break_missing_config, "missing config.json"),
    "missing shard": (_break_missing_shard, "is named in model.safetensors.index.json but absent"),
    "truncated": (_break_truncated, "truncated safetensors"),
    "corrupt": (_break_corrupt_header, "corrupt safetensors header"),
    "shape": (_break_shape, "config.json implies"),
    "unknown": (_break_unknown, "the Clover map does not know: model.layers.0.mystery.weight"),
    "dtype": (_break_dtype, "unsupported dtype I32"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_bad_input_one_line_exit_2_no_output(make_checkpoint, tmp_path, case):
    breaker, message = BREAKS[case]
    src = _copy(make_checkpoint(seed=10, shard_size=300_000), tmp_path / "src")
    breaker(src)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    p = _run_cli("convert", src, "-o", out, "--quiet")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert list(out.parent.iterdir()) == []


def test_skip_unknown_drops_with_warning(make_checkpoint, tmp_path):
    src = _copy(make_checkpoint(seed=10, shard_size=300_000), tmp_path / "src")
    _break_unknown(src)
    out = tmp_path / "m.gguf"
    p = _run_cli("convert", src, "-o", out, "--skip-unknown", "--quiet")
    assert p.returncode == 0, p.stderr
    assert "dropped 1 unknown tensor(s): model.layers.0.mystery.weight" in p.stderr
    assert out.is_file()


def test_unwritable_output(tiny, tmp_path):
    p = _run_cli("convert", tiny, "-o", tmp_path / "no" / "such" / "dir" / "m.gguf", "--quiet")
    assert p.returncode == 2 and "output folder does not exist" in p.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores mode bits: check the refusal through the library instead
            from clover_gguf import fsutil

            fsutil_access = fsutil.os.access
            fsutil.os.access = lambda path, mode: False
            try:
                with pytest.raises(UserError, match="not writable"):
                    convert(tiny, ro / "m.gguf", quiet=True)
            finally:
                fsutil.os.access = fsutil_access
        else:
            p = _run_cli("convert", tiny, "-o", ro / "m.gguf", "--quiet")
            assert p.returncode == 2 and "not writable" in p.stderr
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []


def test_too_little_disk(tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match="not enough disk space"):
        convert(tiny, tmp_path / "m.gguf", quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_info_json(tiny, tmp_path):
    out = tmp_path / "m.gguf"
    convert(tiny, out, outtype="f16", quiet=True)
    p = _run_cli("info", out, "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["architecture"] == "clover_moe" and info["features"]["block_mode"] is True
    assert info["tensor_count"] == len(GGUFReader(out).tensors)
    assert set(info["bytes_by_type"]) == {"F32", "F16"}
    assert info["file_size_bytes"] == out.stat().st_size
    p = _run_cli("info", tiny / "config.json")
    assert p.returncode == 2 and "not a readable GGUF" in p.stderr


@pytest.mark.parametrize("opts,outtype", [
    (dict(seed=9, dtype="bf16"), "f32"),  # converted piece by piece (bf16 -> f32)
    (dict(seed=9, dtype="bf16", experts="fused", shard_size=300_000), "bf16"),  # bits copied piece by piece
    (dict(seed=10), "q8_0"),  # quantized piece by piece
], ids=["bf16-to-f32", "bf16-fused-raw", "f32-to-q8_0"])
def test_large_tensors_written_in_pieces_are_the_same_file(make_checkpoint, tmp_path, monkeypatch, opts, outtype):
    """Tensors above PIECE_BYTES (the 35B's embedding, output and expert stacks) are streamed in pieces: with a tiny
    piece size every embedding and expert stack goes that way, and the file must not change by a byte."""
    import clover_gguf.convert as conv
    from clover_gguf.checkpoint import Checkpoint

    src = make_checkpoint(**opts)
    whole = convert(src, tmp_path / "whole.gguf", outtype=outtype, quiet=True).out.read_bytes()
    monkeypatch.setattr(conv, "PIECE_BYTES", 2048)
    with Checkpoint(src) as ck:
        plan = conv.plan_conversion(ck, CloverConfig.from_file(src), outtype)
        n_pieces = {t.name: sum(1 for _ in t.pieces()) for t in plan.tensors}
    cfg = CloverConfig.from_file(src)
    assert n_pieces["token_embd.weight"] > 1 and n_pieces["blk.0.ffn_up_exps.weight"] == cfg.num_experts
    assert convert(src, tmp_path / "pieces.gguf", outtype=outtype, quiet=True).out.read_bytes() == whole


def test_info_prints_floats_as_written(tiny, tmp_path):
    """FLOAT32 metadata shown as the shortest decimal that reads back as the same float32 (issue 16)."""
    out = tmp_path / "m.gguf"
    convert(tiny, out, outtype="f32", quiet=True)
    p = _run_cli("info", out, "--json")
    hp = json.loads(p.stdout)["hparams"]
    assert hp["attention.layer_norm_rms_epsilon"] == 1e-06 and hp["diffusion.threshold"] == 0.95
    assert hp["generation.repetition_penalty"] == 1.05 and hp["diffusion.expert_coreset_top_p"] == 0.9
    text = _run_cli("info", out).stdout
    assert "attention.layer_norm_rms_epsilon         1e-06\n" in text and "9.99999" not in text


def test_existing_output_needs_force(tiny, tmp_path):
    """convert, like quantize and imatrix, replaces an existing output only with --force."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"an earlier file")
    p = _run_cli("convert", tiny, "-o", out, "--quiet")
    assert p.returncode == 2 and "exists (--force overwrites it)" in p.stderr
    assert out.read_bytes() == b"an earlier file"
    p = _run_cli("convert", tiny, "-o", out, "--quiet", "--force")
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:4] == b"GGUF"


def test_right_kernel_cuda_cannot_run_is_a_notice(make_checkpoint, tmp_path, monkeypatch):
    """The converter says when the right conv kernel is a width llama.cpp's CUDA ssm_conv has no kernel for (the op
    then runs on the CPU). The bundled widths hold the tiny model's 4; with 4 taken out of them the notice appears."""
    import clover_gguf.convert as conv

    src = make_checkpoint(seed=1)
    assert not any("right conv kernel" in n for n in convert(src, tmp_path / "a.gguf", dry_run=True, quiet=True).notices)
    monkeypatch.setattr(conv, "CUDA_SSM_CONV_WIDTHS", (3, 5, 9, 15))
    notes = convert(src, tmp_path / "b.gguf", dry_run=True, quiet=True).notices
    assert any("right conv kernel 4" in n and "CPU" in n for n in notes), notes
