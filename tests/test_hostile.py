"""Hostile input, one table: every case breaks a file (or a command line) on purpose and runs the real command in a
process of its own. Each must end with exit code 2 (130 when a signal stopped it), exactly one line on stderr, no
traceback, no file left anywhere in its folder and every input unchanged, and never exit 1, 134, 139 or hang.

The checkpoints and GGUFs are made here at test time from make_tiny and broken byte by byte (no committed binaries).
`ITEM` names the issue-15 item each case was written for ("own": a case of ours beyond that list).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from clover_gguf import metadata as md
from clover_gguf.convert import convert
from clover_gguf.testing.make_tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
# A case that tries to allocate something absurd must fail with its one line, not take the machine: every command
# runs under this address-space limit (a MemoryError under it is a failure like any other traceback).
ADDRESS_SPACE = 4 * 2**30
TIMEOUT_S = 90
PROMPT = "What is 2 + 3?"


# ---- running a command ------------------------------------------------------------------------------------------
def _limits(fsize: int | None = None) -> Callable[[], None]:
    def apply() -> None:
        # as in a terminal, whatever ran the tests: nohup ignores SIGHUP, and a shell's background job (`cmd &`)
        # ignores SIGINT, which Python then leaves ignored (no KeyboardInterrupt)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        if fsize is not None:  # a "full disk": writes past fsize fail with EFBIG (Python ignores SIGXFSZ)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GGML_NO_BACKTRACE": "1"}
    env.update(extra or {})
    return env


def clover(*args, env: dict[str, str] | None = None, fsize: int | None = None, stdout=subprocess.PIPE,
           stdin=None, cwd: Path = ROOT, read_only: bool = False) -> subprocess.CompletedProcess:
    """Run `clover-gguf ARGS` under the limits; stdout: where its output goes (a pipe we read, or a file such as
    /dev/full); stdin: what it reads (nothing: an empty input); read_only: folders without write permission stay
    so for it (as root: without CAP_DAC_OVERRIDE, which lets root write anywhere)."""
    argv = [*(_NO_OVERRIDE if read_only and os.geteuid() == 0 else []), sys.executable, "-m", "clover_gguf",
            *map(str, args)]
    return subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace",
                          timeout=TIMEOUT_S, env=_env(env), preexec_fn=_limits(fsize), cwd=cwd,
                          input=stdin if stdin is not None else "")


_NO_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: file contents (hash), links (target), FIFOs and folders (their kind)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        key = str(p.relative_to(folder))
        if stat.S_ISLNK(st.st_mode):
            out[key] = "link:" + os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            out[key] = "file:" + hashlib.sha256(p.read_bytes()).hexdigest()
        elif stat.S_ISFIFO(st.st_mode):
            out[key] = "fifo"
        else:
            out[key] = "dir" if stat.S_ISDIR(st.st_mode) else f"mode:{st.st_mode:o}"
    return out


def assert_refused(p: subprocess.CompletedProcess, before: dict, folder: Path, expect: str, rc: int = 2) -> None:
    err = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == rc, f"exit {p.returncode}, stderr: {p.stderr[-2000:]}"
    assert len(err) == 1, f"{len(err)} lines on stderr: {p.stderr[-2000:]}"
    assert err[0].startswith("clover-gguf: error: ") and expect in err[0], err[0]
    assert snapshot(folder) == before, "a file was left behind or an input changed"


# ---- building broken inputs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def base(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-base")
    make_tiny(root / "ck", seed=21)
    convert(root / "ck", root / "m.gguf", outtype="f32", quiet=True)
    return {"ck": root / "ck", "gguf": root / "m.gguf"}


class Work:
    """One case's folder: fresh copies of the inputs it asks for, and an output path in an empty folder."""

    def __init__(self, folder: Path, base: dict[str, Path]):
        self.folder, self.base = folder, base
        (folder / "out").mkdir()
        self.out = folder / "out" / "m.gguf"

    def _copy(self, name: str) -> Path:
        """This test's own copy of base[name] (a folder), made the first time it is asked for."""
        p = self.folder / name
        if not p.exists():
            shutil.copytree(self.base[name], p)
        return p

    @property
    def ck(self) -> Path:
        return self._copy("ck")

    @property
    def mlx(self) -> Path:
        """A copy of mlx-convert's folder of the base checkpoint (the `mlx_folder` fixture, given as base["mlx"])."""
        return self._copy("mlx")

    @property
    def q4(self) -> Path:
        """A copy of mlx-convert's 4-bit folder of the base checkpoint (base["q4"]: per-module quantization)."""
        return self._copy("q4")

    @property
    def community(self) -> Path:
        """What a community MLX conversion holds: mlx-lm's files without the block tensors or Clover's keys."""
        c = self.folder / "community"
        if not c.exists():
            from clover_gguf.graft import FOLDER_BLOCK_KEYS, MLX_BLOCK_FILE

            shutil.copytree(self.base["mlx"], c)
            (c / MLX_BLOCK_FILE).unlink()
            cfg = json.loads((c / "config.json").read_text())
            for k in (*FOLDER_BLOCK_KEYS, md.READING_FIELD):
                cfg.pop(k, None)
            (c / "config.json").write_text(json.dumps(cfg))
        return c

    @property
    def gguf(self) -> Path:
        g = self.folder / "in.gguf"
        if not g.exists():
            shutil.copy(self.base["gguf"], g)
        return g

    # config.json / tokenizer files
    def edit_json(self, name: str, fn: Callable[[dict], object]) -> None:
        """Change a JSON file of the checkpoint in place (fn mutates the object; what it returns is ignored)."""
        p = self.ck / name
        d = json.loads(p.read_text())
        fn(d)
        p.write_text(json.dumps(d))

    def config(self, **changes) -> None:
        self.edit_json("config.json", lambda d: d.update(changes))

    def shard(self) -> Path:
        return self.ck / "model.safetensors"

    def shard_header(self, fn: Callable[[dict], None]) -> None:
        """Rewrite the shard's JSON header in place (padded to its old length, so data offsets stay valid)."""
        p = self.shard()
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        fn(header)
        blob = json.dumps(header, separators=(",", ":")).encode()
        assert len(blob) <= n
        p.write_bytes(raw[:8] + blob + b" " * (n - len(blob)) + raw[8 + n:])

    def convert(self, *extra) -> list:
        return ["convert", self.ck, "-o", self.out, "--quiet", *extra]


def _offsets(h: dict, name: str) -> list[int]:
    return h[name]["data_offsets"]


def _first_two(h: dict) -> tuple[str, str]:
    names = [k for k in h if k != "__metadata__"]
    return names[0], names[1]


def _shift_negative(h: dict) -> None:
    name = "model.embed_tokens.weight"
    b, e = _offsets(h, name)
    h[name]["data_offsets"] = [b - 64, e - 64] if b >= 64 else [-64, e - b - 64]


def _overlap(h: dict) -> None:
    # two tensors of one shape share their bytes: the second reads the first's data
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _outside_index(w: Work) -> None:
    outside = w.folder / "outside.safetensors"
    shutil.move(w.shard(), outside)
    header_names = _shard_names(outside)
    index = {"metadata": {}, "weight_map": {n: "../outside.safetensors" for n in header_names}}
    (w.ck / "model.safetensors.index.json").write_text(json.dumps(index))


def _absolute_index(w: Work) -> None:
    names = _shard_names(w.shard())
    index = {"metadata": {}, "weight_map": {n: str(w.shard()) for n in names}}
    (w.ck / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_names(p: Path) -> list[str]:
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]


def _add_layer_7(w: Work) -> None:
    """An extra shard with a tensor of layer 7 (the config has 4 layers), named in no index: globbed."""
    payload = np.ones(64, np.float32).tobytes()
    header = json.dumps({"model.layers.7.input_layernorm.weight":
                         {"dtype": "F32", "shape": [64], "data_offsets": [0, len(payload)]}}).encode()
    (w.ck / "extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)


def _tok(fn: Callable[[dict], object]) -> Callable[[Work], None]:
    return lambda w: w.edit_json("tokenizer.json", fn)


def _tok_model(**changes) -> Callable[[Work], None]:
    return _tok(lambda d: d["model"].update(changes))


def _negative_id(d: dict) -> None:
    v = d["model"]["vocab"]
    k = next(iter(v))
    v[k] = -1


def _duplicate_id(d: dict) -> None:
    v = d["model"]["vocab"]
    a, b = list(v)[:2]
    v[b] = v[a]


def _string_ids(d: dict) -> None:
    d["model"]["vocab"] = {k: str(i) for k, i in d["model"]["vocab"].items()}


def _no_layer_types(**changes):
    def apply(d: dict) -> None:
        d.pop("layer_types", None)
        d.update(changes)
    return lambda w: w.edit_json("config.json", apply)


def _no_head_dim(**changes):
    """head_dim left out: it is then hidden_size // num_attention_heads"""
    def apply(d: dict) -> None:
        d.pop("head_dim", None)
        d.update(changes)
    return lambda w: w.edit_json("config.json", apply)


def _cfg(**changes) -> Callable[[Work], None]:
    return lambda w: w.config(**changes)


def _write(name: str, data: bytes) -> Callable[[Work], None]:
    return lambda w: (w.ck / name).write_bytes(data)


# ---- the convert table ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertCase:
    item: str
    breaker: Callable[[Work], None]
    expect: str
    extra: tuple = ()


CONVERT_CASES: dict[str, ConvertCase] = {
    # 3: impossible settings
    "experts-per-token-0": ConvertCase("3", _cfg(num_experts_per_tok=0), "num_experts_per_tok"),
    # 6: malformed config.json
    "config-is-a-list": ConvertCase("6", _write("config.json", b"[1, 2, 3]"), "config.json"),
    "config-is-null": ConvertCase("6", _write("config.json", b"null"), "config.json"),
    "config-is-binary": ConvertCase("6", _write("config.json", b"\xff\xfe\x00\x81garbage\x00"), "config.json"),
    "hidden-size-abc": ConvertCase("6", _cfg(hidden_size="abc"), "hidden_size"),
    "attention-heads-0": ConvertCase("6", _no_head_dim(num_attention_heads=0), "num_attention_heads"),
    "kv-heads-0": ConvertCase("6", _cfg(num_key_value_heads=0), "num_key_value_heads"),
    "linear-key-heads-0": ConvertCase("6", _cfg(linear_num_key_heads=0), "linear_num_key_heads"),
    "max-positions-2^32": ConvertCase("6", _cfg(max_position_embeddings=2**32), "max_position_embeddings"),
    # 6: malformed tokenizer files
    "tokenizer-binary": ConvertCase("6", _write("tokenizer.json", b"\x89PNG\r\n\x1a\n\xff\xff"), "tokenizer.json"),
    "tokenizer-is-a-list": ConvertCase("6", _write("tokenizer.json", b"[]"), "tokenizer.json"),
    "tokenizer-without-vocab": ConvertCase("6", _tok(lambda d: d["model"].pop("vocab")), "vocab"),
    "tokenizer-empty-vocab": ConvertCase("6", _tok(lambda d: (d["model"].update(vocab={}),
                                                                d.update(added_tokens=[]))), "vocab"),
    "tokenizer-string-ids": ConvertCase("6", _tok(_string_ids), "id"),
    "tokenizer-config-invalid": ConvertCase("6", _write("tokenizer_config.json", b"{\"eos_token\": "),
                                            "tokenizer_config.json"),
    # 6: a shard that is a folder
    "shard-is-a-folder": ConvertCase("6", lambda w: (w.ck / "more.safetensors").mkdir(), "more.safetensors"),
    # 7: absurd sizes, with and without --dry-run
    "vocab-2^40": ConvertCase("7", _cfg(vocab_size=2**40), "vocab_size"),
    "vocab-2^40-dry-run": ConvertCase("7", _cfg(vocab_size=2**40), "vocab_size", ("--dry-run",)),
    "layers-1e9": ConvertCase("7", _no_layer_types(num_hidden_layers=10**9), "num_hidden_layers"),
    "layers-1e9-dry-run": ConvertCase("7", _no_layer_types(num_hidden_layers=10**9), "num_hidden_layers",
                                      ("--dry-run",)),
    # 8: bad checkpoints that converted with exit 0
    "tensor-of-layer-7": ConvertCase("8", _add_layer_7, "layer 7"),
    "negative-offset": ConvertCase("8", lambda w: w.shard_header(_shift_negative), "model.embed_tokens.weight"),
    "overlapping-offsets": ConvertCase("8", lambda w: w.shard_header(_overlap), "overlap"),
    "index-points-outside": ConvertCase("8", _outside_index, "outside.safetensors"),
    "negative-token-id": ConvertCase("8", _tok(_negative_id), "id -1"),
    "zero-layers": ConvertCase("8", _cfg(num_hidden_layers=0, layer_types=[]), "num_hidden_layers"),
    "mask-id-out-of-vocab": ConvertCase("8", _cfg(mask_token_id=100000), "mask_token_id"),
    # own: more impossible or malformed settings
    "experts-per-token-above-experts": ConvertCase("own", _cfg(num_experts_per_tok=9), "num_experts_per_tok"),
    "mask-id-negative": ConvertCase("own", _cfg(mask_token_id=-1), "mask_token_id"),
    "attention-interval-0": ConvertCase("own", _no_layer_types(full_attention_interval=0), "full_attention_interval"),
    "rope-parameters-list": ConvertCase("own", _cfg(rope_parameters=[1, 2]), "rope_parameters"),
    "rotary-above-head-dim": ConvertCase("own", _cfg(rope_parameters={"partial_rotary_factor": 2.0}),
                                         "partial_rotary_factor"),
    "rms-eps-negative": ConvertCase("own", _cfg(rms_norm_eps=-1e-6), "rms_norm_eps"),
    "text-config-list": ConvertCase("own", _cfg(text_config=[1]), "text_config"),
    "layer-types-nested": ConvertCase("own", _cfg(layer_types=[["linear_attention"]] * 4), "layer_types"),
    "experts-2^20": ConvertCase("own", _cfg(num_experts=2**20), "num_experts"),
    "coreset-top-p-abc": ConvertCase("own", _cfg(moe_block_coreset_top_p="abc"), "moe_block_coreset_top_p"),
    "generation-config-list": ConvertCase("own", _write("generation_config.json", b"[0]"), "generation_config.json"),
    "generation-negative-start": ConvertCase("own", lambda w: w.edit_json(
        "generation_config.json", lambda d: d.update(dllm_length_penalty_start=-1)), "dllm_length_penalty_start"),
    "generation-block-size-0": ConvertCase("own", lambda w: w.edit_json(
        "generation_config.json", lambda d: d.update(block_size=0)), "block_size"),
    "tokenizer-config-list": ConvertCase("own", _write("tokenizer_config.json", b"[1]"), "tokenizer_config.json"),
    "tokenizer-config-eos-list": ConvertCase("own", lambda w: w.edit_json(
        "tokenizer_config.json", lambda d: d.update(eos_token=["<|im_end|>"])), "eos_token"),
    "tokenizer-duplicate-id": ConvertCase("own", _tok(_duplicate_id), "both"),
    "tokenizer-merges-numbers": ConvertCase("own", _tok_model(merges=[[1, 2]]), "merges"),
    "tokenizer-added-without-id": ConvertCase("own", _tok(lambda d: d["added_tokens"][0].pop("id")), "added_tokens"),
    "chat-template-binary": ConvertCase("own", _write("chat_template.jinja", b"\xff\xfe{{"), "chat_template.jinja"),
    "chat-template-invalid": ConvertCase("own", _write("chat_template.jinja", b"{% for m in messages %}{{ m"),
                                         "chat template"),
    "safetensors-header-list": ConvertCase("own", lambda w: _raw_header(w, b"[1, 2]"), "model.safetensors"),
    "safetensors-offsets-strings": ConvertCase("own", lambda w: w.shard_header(
        lambda h: h["model.norm.weight"].update(data_offsets=["0", "256"])), "model.norm.weight"),
    "index-absolute-path": ConvertCase("own", _absolute_index, "index"),
    "index-is-a-list": ConvertCase("own", lambda w: (w.ck / "model.safetensors.index.json").write_text("[]"),
                                   "model.safetensors.index.json"),
}


def _raw_header(w: Work, blob: bytes) -> None:
    p = w.shard()
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + blob + b" " * (n - len(blob)) + raw[8 + n:])


@pytest.mark.parametrize("case", list(CONVERT_CASES))
def test_convert_refuses(base, tmp_path, case):
    c = CONVERT_CASES[case]
    w = Work(tmp_path, base)
    c.breaker(w)
    before = snapshot(tmp_path)
    p = clover(*w.convert(*c.extra))
    assert_refused(p, before, tmp_path, c.expect)


# ---- outputs: never an input, never a special file, never an existing file without --force ------------------------
def _out_onto_shard(w: Work) -> list:
    return ["convert", w.ck, "-o", w.shard(), "--quiet"]


def _out_onto_config(w: Work) -> list:
    return ["convert", w.ck, "-o", w.ck / "config.json", "--quiet", "--force"]


def _out_onto_symlink_of_shard(w: Work) -> list:
    link = w.folder / "out" / "link.gguf"
    link.symlink_to(w.shard())
    return ["convert", w.ck, "-o", link, "--quiet"]


def _out_onto_hardlink_of_shard(w: Work) -> list:
    hard = w.folder / "out" / "hard.gguf"
    os.link(w.shard(), hard)
    return ["convert", w.ck, "-o", hard, "--quiet"]


def _out_onto_fifo(w: Work) -> list:
    fifo = w.folder / "out" / "fifo.gguf"
    os.mkfifo(fifo)
    return ["convert", w.ck, "-o", fifo, "--quiet"]


def _out_onto_device_link(w: Work) -> list:
    # a link to /dev/null: refusing it must follow the link (a device is never replaced, nor the link to it)
    link = w.folder / "out" / "null.gguf"
    link.symlink_to("/dev/null")
    return ["convert", w.ck, "-o", link, "--quiet"]


def _out_exists(w: Work) -> list:
    w.out.write_bytes(b"an earlier conversion")
    return w.convert()


def _quantize_onto_fifo(w: Work) -> list:
    fifo = w.folder / "out" / "fifo.gguf"
    os.mkfifo(fifo)
    return ["quantize", w.gguf, fifo, "--type", "Q8_0", "--quiet", "--force"]


def _quantize_onto_symlink_of_input(w: Work) -> list:
    link = w.folder / "out" / "link.gguf"
    link.symlink_to(w.gguf)
    return ["quantize", w.gguf, link, "--type", "Q8_0", "--quiet", "--force"]


OUTPUT_CASES = {
    "convert-onto-its-shard": ("4", _out_onto_shard, "input"),
    "convert-onto-its-config-force": ("4", _out_onto_config, "input"),
    "convert-onto-symlink-of-shard": ("4", _out_onto_symlink_of_shard, "input"),
    "convert-onto-hardlink-of-shard": ("4", _out_onto_hardlink_of_shard, "input"),
    "convert-onto-fifo": ("4", _out_onto_fifo, "not a regular file"),
    "convert-onto-link-to-dev-null": ("4", _out_onto_device_link, "not a regular file"),
    "convert-onto-existing-output": ("4", _out_exists, "--force"),
    "quantize-onto-fifo": ("4", _quantize_onto_fifo, "not a regular file"),
    "quantize-onto-link-to-input": ("own", _quantize_onto_symlink_of_input, "input"),
}


@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_output_never_replaces_an_input_or_a_special_file(base, tmp_path, case):
    _, make, expect = OUTPUT_CASES[case]
    w = Work(tmp_path, base)
    argv = make(w)
    before = snapshot(tmp_path)
    p = clover(*argv)
    assert_refused(p, before, tmp_path, expect)


# ---- a full disk mid-write ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_full_disk_mid_write(base, tmp_path, command):
    """Writes past RLIMIT_FSIZE fail with EFBIG, as a full disk fails with ENOSPC: one line, no partial file."""
    w = Work(tmp_path, base)
    argv = w.convert() if command == "convert" else ["quantize", w.gguf, w.out, "--type", "Q8_0", "--quiet"]
    before = snapshot(tmp_path)
    p = clover(*argv, fsize=256 * 1024)
    assert_refused(p, before, tmp_path, "m.gguf")


# ---- GGUFs whose hyperparameters would abort llama.cpp, or that our own readers choked on --------------------------
SCALAR_FMT = {4: "I", 5: "i", 6: "f", 7: "?"}


def _kv(vtype: int, value) -> bytes:
    return struct.pack("<I" + SCALAR_FMT[vtype], vtype, value)


def _kv_str(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<IQ", 8, len(b)) + b


def _kv_arr(sub: int, values) -> bytes:
    return struct.pack("<IIQ", 9, sub, len(values)) + b"".join(struct.pack("<" + SCALAR_FMT[sub], v) for v in values)


def _kv_nested(depth: int) -> bytes:
    inner = struct.pack("<IQI", 4, 1, 7)
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", 9, 1) + inner
    return struct.pack("<I", 9) + inner


def _skip_value(buf: bytes, pos: int, vtype: int) -> int:
    if vtype == 8:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == 9:
        sub, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if sub in (0, 1, 7):
            return pos + n
        if sub in (2, 3):
            return pos + 2 * n
        if sub in (4, 5, 6):
            return pos + 4 * n
        if sub in (10, 11, 12):
            return pos + 8 * n
        for _ in range(n):
            pos = _skip_value(buf, pos, sub)
        return pos
    return pos + {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[vtype]


def edit_gguf(src: Path, dst: Path, changes: dict[str, bytes | None], cut_tail: int = 0) -> Path:
    """Copy a GGUF byte for byte, replacing (bytes), adding or removing (None) metadata values; every tensor info
    and the tensor data are kept as they are (offsets are relative to the data section, re-aligned here)."""
    buf = src.read_bytes()
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs, align = 24, [], 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + n].decode()
        start = pos + 8 + n
        end = _skip_value(buf, start + 4, struct.unpack_from("<I", buf, start)[0])
        if key == "general.alignment":
            align = struct.unpack_from("<I", buf, start + 4)[0]
        kvs.append((key, buf[start:end]))
        pos = end
    infos_start = pos
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * nd + 4 + 8
    infos, data = buf[infos_start:pos], buf[(pos + align - 1) // align * align:]
    todo = dict(changes)
    out = []
    for key, raw in kvs:
        if key in todo:
            raw = todo.pop(key)
        if raw is not None:
            out.append((key, raw))
    out += [(k, v) for k, v in todo.items() if v is not None]
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(out))
    head += b"".join(struct.pack("<Q", len(k.encode())) + k.encode() + raw for k, raw in out) + infos
    blob = head + b"\0" * (-len(head) % align) + data
    dst.write_bytes(blob[:len(blob) - cut_tail] if cut_tail else blob)
    return dst


U32, I32, F32, BOOL = 4, 5, 6, 7
A = "clover_moe."
GGUF_CASES: dict[str, tuple[str, dict, str]] = {
    # 3: hyperparameters that abort llama.cpp (GGML_ASSERT) when it loads the model
    "expert-used-0": ("3", {A + "expert_used_count": _kv(U32, 0)}, "expert_used_count"),
    "expert-used-above-count": ("3", {A + "expert_used_count": _kv(U32, 9)}, "expert_used_count"),
    "expert-count-0": ("3", {A + "expert_count": _kv(U32, 0)}, "expert_count"),
    "block-count-0": ("3", {A + "block_count": _kv(U32, 0)}, "block_count"),
    "rope-dims-odd": ("3", {A + "rope.dimension_count": _kv(U32, 7)}, "rope.dimension_count"),
    "rope-dims-huge": ("3", {A + "rope.dimension_count": _kv(U32, 4096)}, "rope.dimension_count"),
    # 6: metadata of the wrong type, arrays nested 3000 deep
    "context-length-a-string": ("6", {A + "context_length": _kv_str("abc")}, "context_length"),
    "threshold-a-string": ("6", {"diffusion.threshold": _kv_str("abc")}, "diffusion.threshold"),
    "nested-3000": ("6", {"general.nested": _kv_nested(3000)}, "general.nested"),
    # own: more that abort, hang on NaN arithmetic or crash our own code
    "block-count-600": ("own", {A + "block_count": _kv(U32, 600)}, "block_count"),
    "nextn-above-blocks": ("own", {A + "nextn_predict_layers": _kv(U32, 9)}, "nextn_predict_layers"),
    "rope-sections-zero": ("own", {A + "rope.dimension_sections": _kv_arr(I32, [0, 0, 0, 0])}, "dimension_sections"),
    "rope-sections-too-wide": ("own", {A + "rope.dimension_sections": _kv_arr(I32, [100, 100, 100, 0])},
                               "dimension_sections"),
    "right-kernel-0": ("own", {"clover_moe.diffusion.conv_right_kernel": _kv(U32, 0)}, "conv_right_kernel"),
    "rope-scaling-bogus": ("own", {A + "rope.scaling.type": _kv_str("bogus")}, "rope.scaling.type"),
    "attention-interval-0": ("own", {A + "full_attention_interval": _kv(U32, 0),
                                     A + "attention.recurrent_layers": None}, "full_attention_interval"),
    "rms-eps-nan": ("own", {A + "attention.layer_norm_rms_epsilon": _kv(F32, float("nan"))},
                    "layer_norm_rms_epsilon"),
    "rms-eps-0": ("own", {A + "attention.layer_norm_rms_epsilon": _kv(F32, 0.0)}, "layer_norm_rms_epsilon"),
    "rope-base-0": ("own", {A + "rope.freq_base": _kv(F32, 0.0)}, "rope.freq_base"),
    "coreset-top-p-0": ("own", {"clover_moe.diffusion.expert_coreset_top_p": _kv(F32, 0.0)}, "top_p"),
    "mask-id-out-of-vocab": ("own", {"tokenizer.ggml.mask_token_id": _kv(U32, 100000)}, "mask_token_id"),
    "block-size-0": ("own", {"diffusion.span_length": _kv(U32, 0)}, "span_length"),
    "expert-used-int32": ("own", {A + "expert_used_count": _kv(I32, 2)}, "expert_used_count"),
    "chat-template-invalid": ("own", {"tokenizer.chat_template": _kv_str("{% for m in messages %}{{ m")},
                              "chat template"),
}
# the issue's bad GGUFs through the runtime (generate), the quantizer and info, two through serve; our own through
# the runtime (one check_model serves every command, so the others would repeat the same check)
GGUF_RUNS = [(case, cmd) for case, (item, _, _) in GGUF_CASES.items()
             for cmd in (("generate", "quantize", "info") if item != "own" else ("generate",))] + \
    [("expert-used-0", "serve"), ("nested-3000", "serve")]


def _gguf_command(cmd: str, model: Path, out: Path) -> list:
    return {"generate": ["generate", model, "-p", PROMPT, "-n", "8", "--mode", "diffusion"],
            "quantize": ["quantize", model, out, "--type", "Q8_0", "--quiet"],
            "info": ["info", model],
            "serve": ["serve", model, "--port", "0"]}[cmd]


@pytest.mark.parametrize("case,cmd", GGUF_RUNS, ids=[f"{c}-{m}" for c, m in GGUF_RUNS])
def test_bad_gguf_refused_before_llama_cpp(base, tmp_path, case, cmd):
    _, changes, expect = GGUF_CASES[case]
    w = Work(tmp_path, base)
    model = edit_gguf(base["gguf"], tmp_path / "bad.gguf", changes)
    before = snapshot(tmp_path)
    p = clover(*_gguf_command(cmd, model, w.out))
    assert_refused(p, before, tmp_path, expect)


# what llama.cpp's loader takes for attention.recurrent_layers (get_arr): an array of BOOL, UINT32 (what its own
# llama_model_save_to_file writes) or INT32; our check takes the same
@pytest.mark.parametrize("sub", [U32, I32], ids=["uint32", "int32"])
def test_what_llama_cpp_loads_we_load(base, tmp_path, sub):
    raw = _kv_arr(sub, [1, 1, 1, 0])
    model = edit_gguf(base["gguf"], tmp_path / "m.gguf", {A + "attention.recurrent_layers": raw})
    p = clover("generate", model, "-p", PROMPT, "-n", "4", "--mode", "ar")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert clover("info", model).returncode == 0


def test_recurrent_layers_of_another_type_is_refused(base, tmp_path):
    model = edit_gguf(base["gguf"], tmp_path / "m.gguf", {A + "attention.recurrent_layers": _kv_arr(F32, [1.0] * 4)})
    before = snapshot(tmp_path)
    assert_refused(clover("info", model), before, tmp_path, "ARRAY of BOOL or UINT32 or INT32")


def test_gguf_editor_round_trips(base, tmp_path):
    """The editor above changes only what it is told to: with no change it reproduces the file byte for byte."""
    assert edit_gguf(base["gguf"], tmp_path / "same.gguf", {}).read_bytes() == base["gguf"].read_bytes()


def test_truncated_gguf(base, tmp_path):
    model = edit_gguf(base["gguf"], tmp_path / "cut.gguf", {}, cut_tail=4096)
    before = snapshot(tmp_path)
    for cmd in ("info", "generate"):
        assert_refused(clover(*_gguf_command(cmd, model, tmp_path / "o.gguf")), before, tmp_path, "truncated")


# ---- quantize's own inputs --------------------------------------------------------------------------------------------
def _fake_imatrix(path: Path, base_gguf: Path) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(path, "imatrix")
    w.add_array("imatrix.datasets", ["calibration.txt"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 64)
    for name in ("blk.0.attn_qkv.weight", "blk.0.ffn_up_shexp.weight", "output.weight"):
        w.add_tensor(name + ".in_sum2", np.ones(64, np.float32))
        w.add_tensor(name + ".counts", np.full(1, 4.0, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_imatrix(base, tmp_path):
    w = Work(tmp_path, base)
    im = _fake_imatrix(tmp_path / "imatrix.gguf", base["gguf"])
    im.write_bytes(im.read_bytes()[:-100])
    src = w.gguf
    before = snapshot(tmp_path)
    p = clover("quantize", src, w.out, "--type", "Q4_K_M", "--imatrix", im, "--quiet")
    assert_refused(p, before, tmp_path, "imatrix.gguf")


def test_imatrix_sums_not_a_multiple_of_counts(base, tmp_path):
    """own: 64 sums over 3 experts cannot be split per expert."""
    from gguf import GGUFWriter

    w = Work(tmp_path, base)
    im = tmp_path / "imatrix.gguf"
    gw = GGUFWriter(im, "imatrix")
    gw.add_array("imatrix.datasets", ["c.txt"])
    gw.add_uint32("imatrix.chunk_count", 1)
    gw.add_uint32("imatrix.chunk_size", 64)
    gw.add_tensor("blk.0.ffn_up_exps.weight.in_sum2", np.ones(64, np.float32))
    gw.add_tensor("blk.0.ffn_up_exps.weight.counts", np.ones(3, np.float32))
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    src = w.gguf
    before = snapshot(tmp_path)
    p = clover("quantize", src, w.out, "--type", "Q4_K_M", "--imatrix", im, "--quiet")
    assert_refused(p, before, tmp_path, "blk.0.ffn_up_exps.weight")


# ---- signals: INT, TERM and HUP stop the run, remove the temporary file, rename nothing -----------------------------
@pytest.fixture(scope="session")
def wide(tmp_path_factory) -> dict[str, Path]:
    """A model whose conversion and IQ4_XS quantization take long enough to be interrupted."""
    root = tmp_path_factory.mktemp("hostile-wide")
    make_tiny(root / "ck", seed=22, preset="wide")
    convert(root / "ck", root / "m.gguf", outtype="f32", quiet=True)
    return {"ck": root / "ck", "gguf": root / "m.gguf"}


def _interrupt(argv: list, out_dir: Path, sig: int, group: bool, marker: str = ".partial-",
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess | None:
    """Start the command, wait until its temporary output (a name in `out_dir` containing `marker`) exists, then
    send `sig` (to its whole process group when `group`, as a terminal's Ctrl-C does). The process is stopped while
    the signal is sent, so it arrives in the middle of the work however fast the machine is. None: the work ended
    before the stop (try again)."""
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", env=_env(env), cwd=ROOT,
                            start_new_session=True, preexec_fn=_limits())
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not any(marker in p.name for p in out_dir.iterdir()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no temporary file appeared; exit {proc.returncode}")
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGSTOP)
        if not any(marker in p.name for p in out_dir.iterdir()):
            # it finished writing between the look and the stop: the signal would come after the rename
            os.killpg(proc.pid, signal.SIGCONT)
            proc.communicate(timeout=TIMEOUT_S)
            return None
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


SIGNAL_CASES = {
    "quantize-ctrl-c": ("5", "quantize", signal.SIGINT, True),
    "quantize-sigterm": ("5", "quantize", signal.SIGTERM, False),
    "quantize-sighup": ("5", "quantize", signal.SIGHUP, False),
    "convert-sigterm": ("5", "convert", signal.SIGTERM, False),
    "convert-sighup": ("5", "convert", signal.SIGHUP, False),
    "convert-ctrl-c": ("own", "convert", signal.SIGINT, True),
}


@pytest.mark.parametrize("case", list(SIGNAL_CASES))
def test_signal_leaves_nothing(wide, tmp_path, case):
    _, command, sig, group = SIGNAL_CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    if command == "quantize":
        src = tmp_path / "in.gguf"
        shutil.copy(wide["gguf"], src)
        argv = ["quantize", src, out / "m.gguf", "--type", "IQ4_XS", "--threads", "1", "--quiet"]
    else:
        src = tmp_path / "ck"
        shutil.copytree(wide["ck"], src)
        argv = ["convert", src, "-o", out / "m.gguf", "--outtype", "q8_0", "--quiet"]
    before = snapshot(tmp_path)
    for _ in range(5):
        p = _interrupt(argv, out, sig, group)
        if p is not None:
            break
        for f in out.iterdir():  # the finished output of a run the signal came too late for
            f.unlink()
    assert p is not None, "the command finished before it could be stopped, five times"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 130, f"exit {p.returncode}: {p.stderr[-2000:]}"
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0], p.stderr[-2000:]
    assert list(out.iterdir()) == [], "the output or its temporary file is still there"
    assert snapshot(tmp_path) == before, "an input changed"


# ---- issue 16 items that live in the same commands ----------------------------------------------------------------
def test_plan_from_config_without_the_library_says_so(base, tmp_path):
    p = clover("quantize", "--plan", "--type", "Q4_K_M", "--config", base["ck"] / "config.json",
               env={"LLAMA_CPP_LIB_PATH": str(tmp_path / "no-build")})
    assert_refused(p, {}, tmp_path, "needs the patched llama.cpp")


# =================================================================================================================
# Issue 27, the second round: fit on damaged files, RPC peers that are not rpc-servers, process limits, stdout,
# long names, signals on fit, Ctrl-C in chat, serve's slots. Key names come from clover_gguf.metadata.
# =================================================================================================================
def _tmpdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A TMPDIR of the case's own inside its folder, so a scratch folder left behind shows in the snapshot."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {"TMPDIR": str(tmp)}


# ---- 1. fit hands nothing to llama.cpp before the header check generate runs ------------------------------------
FIT_GGUF_CASES: dict[str, tuple[str, int, str]] = {  # name: (hparam, u32 value, words)
    "block-count-0": ("block_count", 0, "block_count"),
    "block-count-1000": ("block_count", 1000, "block_count"),
    "expert-count-0": ("expert_count", 0, "expert_count"),
    "expert-used-0": ("expert_used_count", 0, "expert_used_count"),
    "expert-used-above-count": ("expert_used_count", 9, "expert_used_count"),
    "context-length-2^31-1": ("context_length", 2**31 - 1, "context_length"),
    "context-length-2^32-1": ("context_length", 2**32 - 1, "context_length"),
}
FIT_RUNS = [(case, extra) for case in FIT_GGUF_CASES for extra in ((), ("--measure",))]


@pytest.mark.parametrize("case,extra", FIT_RUNS, ids=[f"{c}{'-measure' if e else ''}" for c, e in FIT_RUNS])
def test_fit_checks_the_header_before_llama_cpp(base, tmp_path, case, extra):
    key, value, words = FIT_GGUF_CASES[case]
    model = edit_gguf(base["gguf"], tmp_path / "bad.gguf", {md.hparam(key): _kv(U32, value)})
    tmp, env = _tmpdir(tmp_path)
    before = snapshot(tmp_path)
    p = clover("fit", model, "--mode", "ar", *extra, env=env)
    assert_refused(p, before, tmp_path, words)


def test_a_context_past_the_limit_is_refused_by_generate_too(base, tmp_path):
    """The same bound in the one check: generate refuses the file as fit does (it would plan or allocate 2^31)."""
    from clover_gguf.config import MAX_CONTEXT

    model = edit_gguf(base["gguf"], tmp_path / "bad.gguf", {md.hparam("context_length"): _kv(U32, MAX_CONTEXT + 1)})
    before = snapshot(tmp_path)
    assert_refused(clover("generate", model, "-p", PROMPT, "--ctx", str(MAX_CONTEXT + 1)), before, tmp_path,
                   "context_length")


# ---- 2. --threads has one bound, in offload.py, for every command -----------------------------------------------
THREAD_CASES = [
    ("generate-100000", ["generate", "M", "-p", PROMPT, "--threads", "100000"], "--threads must be 1..512"),
    ("generate-65536", ["generate", "M", "-p", PROMPT, "--threads", "65536"], "--threads must be 1..512"),
    ("generate-2^31", ["generate", "M", "-p", PROMPT, "--threads", str(2**31)], "--threads must be 1..512"),
    ("generate-2^63", ["generate", "M", "-p", PROMPT, "--threads", str(2**63)], "--threads must be 1..512"),
    ("chat-100000", ["chat", "M", "--threads", "100000"], "--threads must be 1..512"),
    ("serve-100000", ["serve", "M", "--port", "0", "--threads", "100000"], "--threads must be 1..512"),
    ("quantize-100000", ["quantize", "M", "OUT", "--type", "Q8_0", "--threads", "100000"], "--threads must be"),
    # also seen: --cpu-moe made --n-cpu-moe 99 pass unchecked, --n-cpu-moe 99 alone was refused
    ("cpu-moe-and-n-cpu-moe", ["generate", "M", "-p", PROMPT, "--cpu-moe", "--n-cpu-moe", "99"], "not both"),
]


@pytest.mark.parametrize("name,argv,words", THREAD_CASES, ids=[c[0] for c in THREAD_CASES])
def test_thread_counts_and_expert_options_are_bounded(base, tmp_path, name, argv, words):
    w = Work(tmp_path, base)
    argv = [w.gguf if a == "M" else w.out if a == "OUT" else a for a in argv]
    before = snapshot(tmp_path)
    assert_refused(clover(*argv), before, tmp_path, words)


# ---- 3. --rpc peers that accept but do not speak ggml's RPC -------------------------------------------------------
class FakePeer:
    """A listener on 127.0.0.1 that behaves as a non-rpc-server does, for every connection until stopped:
    closes at once, sends random bytes, a short or wrong reply, an old protocol version, or never answers (an HTTP
    server is the real one of http_peer)."""

    def __init__(self, kind: str):
        import socket
        import threading

        self.kind = kind
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.stopped = threading.Event()
        self.held: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import socket

        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                self._answer(conn)
            except OSError:
                conn.close()

    def _answer(self, conn) -> None:
        def hello() -> None:
            conn.settimeout(5)
            got = b""
            while len(got) < 33:  # cmd (1) + size (8) + conn_caps (24)
                chunk = conn.recv(33 - len(got))
                if not chunk:
                    break
                got += chunk

        if self.kind == "closes":
            conn.close()
        elif self.kind == "random":
            conn.sendall(os.urandom(64))
            self.held.append(conn)
        elif self.kind == "short-reply":
            hello()
            conn.sendall(struct.pack("<Q", 28) + b"\x07\x00")
            conn.close()
        elif self.kind == "wrong-reply":
            hello()
            conn.sendall(struct.pack("<Q", 5) + b"hello")
            self.held.append(conn)
        elif self.kind == "old-version":
            hello()
            conn.sendall(struct.pack("<Q", 28) + bytes([6, 0, 0, 0]) + bytes(24))
            self.held.append(conn)
        else:  # "silent": accepts, never answers
            self.held.append(conn)

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()
        self.thread.join(timeout=5)
        for c in self.held:
            c.close()


@pytest.fixture(scope="module")
def fake_peers():
    peers = {kind: FakePeer(kind) for kind in ("closes", "random", "short-reply", "wrong-reply", "old-version",
                                               "silent")}
    yield peers
    for p in peers.values():
        p.stop()


@pytest.fixture(scope="module")
def http_peer():
    """A real HTTP server (it waits for the end of a request line that ggml's HELLO never sends)."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


RPC_PEER_CASES = [  # (peer, command, words)
    ("closes", "generate", "closed the connection during the RPC handshake"),
    ("random", "generate", "is not a ggml-rpc-server"),
    ("short-reply", "generate", "closed the connection during the RPC handshake"),
    ("wrong-reply", "generate", "is not a ggml-rpc-server"),
    ("old-version", "generate", "speaks RPC protocol 6.0.0"),
    ("silent", "generate", "did not answer the RPC handshake"),
    ("silent", "chat", "did not answer the RPC handshake"),
    ("silent", "serve", "did not answer the RPC handshake"),
    ("http", "generate", "did not answer the RPC handshake"),
    ("http", "serve", "did not answer the RPC handshake"),
]


def _rpc_command(cmd: str, model: Path, spec: str) -> list:
    return {"generate": ["generate", model, "-p", PROMPT, "-n", "4", "--mode", "ar"], "chat": ["chat", model],
            "serve": ["serve", model, "--port", "0"]}[cmd] + ["--rpc", spec]


@pytest.mark.parametrize("peer,cmd,words", RPC_PEER_CASES, ids=[f"{p}-{c}" for p, c, _ in RPC_PEER_CASES])
def test_an_rpc_peer_that_is_not_an_rpc_server_is_named(base, tmp_path, fake_peers, http_peer, peer, cmd, words):
    ep = http_peer if peer == "http" else fake_peers[peer].endpoint
    w = Work(tmp_path, base)
    model = w.gguf
    before = snapshot(tmp_path)
    p = clover(*_rpc_command(cmd, model, ep))
    assert_refused(p, before, tmp_path, f"RPC server {ep} ")
    assert words in p.stderr, p.stderr


def test_a_bad_peer_after_a_real_rpc_server_is_found_before_either_is_used(base, tmp_path, fake_peers):
    from clover_gguf.testing.rpc_servers import rpc_servers

    bad = fake_peers["silent"].endpoint
    w = Work(tmp_path, base)
    model = w.gguf
    before = snapshot(tmp_path)
    with rpc_servers(1, threads=1) as (good,):
        p = clover(*_rpc_command("generate", model, f"{good},{bad}"))
        assert_refused(p, before, tmp_path, f"RPC server {bad} accepted the connection but did not answer")
        # and the real server passes the same check: the model runs on it
        ok = clover("generate", model, "-p", PROMPT, "-n", "4", "--mode", "ar", "--rpc", good)
        assert ok.returncode == 0, ok.stderr[-2000:]


# ---- 4. tracebacks: numbers past a float, odd --rpc values, long names, a stdout that fails -----------------------
ONE_LINE_CASES = [  # (name, argv with M for the model, words)
    ("fit-vram-1e400", ["fit", "M", "--vram", "1e400"], "too large"),
    ("fit-ram-1e400", ["fit", "M", "--ram", "1e400"], "too large"),
    ("fit-vram-400-digits", ["fit", "M", "--vram", "9" * 400], "too large"),
    ("fit-vram-1e300TiB", ["fit", "M", "--vram", "1e300TiB"], "too large"),
    ("rpc-superscript-port", ["generate", "M", "-p", PROMPT, "--rpc", "127.0.0.1:\u00b2"], "is not HOST:PORT"),
    ("rpc-300-char-host", ["generate", "M", "-p", PROMPT, "--rpc", "h" * 300 + ":50052"], "is not HOST:PORT"),
    ("rpc-host-with-newline", ["generate", "M", "-p", PROMPT, "--rpc", "127.0.0.1\nx:50052"], "is not HOST:PORT"),
    ("serve-rpc-with-newline", ["serve", "M", "--port", "0", "--rpc", "a:1\nb:2"], "is not HOST:PORT"),
    # a message that carries a newline of the user's (here a file name) is still one line
    ("model-name-with-newline", ["generate", "NEWLINE", "-p", PROMPT], "no such model file"),
]


@pytest.mark.parametrize("name,argv,words", ONE_LINE_CASES, ids=[c[0] for c in ONE_LINE_CASES])
def test_values_that_raised_tracebacks_are_one_line(base, tmp_path, name, argv, words):
    w = Work(tmp_path, base)
    argv = [w.gguf if a == "M" else tmp_path / "a\nb.gguf" if a == "NEWLINE" else a for a in argv]
    before = snapshot(tmp_path)
    assert_refused(clover(*argv), before, tmp_path, words)


LONG_NAME = "n" * 245 + ".gguf"  # 250 bytes: a legal file name, whose temporary name would pass 255


@pytest.mark.parametrize("command", ["convert", "quantize", "export-ar"])
def test_a_long_legal_output_name_is_written(base, tmp_path, command):
    w = Work(tmp_path, base)
    out = w.folder / "out" / LONG_NAME
    argv = {"convert": ["convert", w.ck, "-o", out, "--quiet"],
            "quantize": ["quantize", w.gguf, out, "--type", "Q8_0", "--quiet"],
            "export-ar": ["export-ar", w.gguf, out, "--quiet"]}[command]
    p = clover(*argv)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [f.name for f in (w.folder / "out").iterdir()] == [LONG_NAME]


def test_temporary_names_stay_within_name_max(tmp_path):
    from clover_gguf.fsutil import NAME_MAX, temp_name

    for name in ("m.gguf", LONG_NAME, "\u00e9" * 127, "x" * 255):
        t = temp_name(tmp_path / name)
        assert len(os.fsencode(t.name)) <= NAME_MAX and ".partial-" in t.name and t.parent == tmp_path
    assert temp_name(tmp_path / ("a" * 250)) != temp_name(tmp_path / ("a" * 249 + "b"))  # the hash tells them apart


STDOUT_CASES = [  # commands whose output goes to stdout: (name, argv, stdin)
    ("generate", ["generate", "M", "-p", PROMPT, "-n", "8", "--mode", "ar"], ""),
    ("fit-json", ["fit", "M", "--mode", "ar", "--json"], ""),
    ("chat", ["chat", "M", "--mode", "ar", "-n", "8"], PROMPT + "\n"),
]


@pytest.mark.parametrize("name,argv,stdin", STDOUT_CASES, ids=[c[0] for c in STDOUT_CASES])
def test_stdout_on_a_full_disk_is_one_line(base, tmp_path, name, argv, stdin):
    w = Work(tmp_path, base)
    argv = [w.gguf if a == "M" else a for a in argv]
    before = snapshot(tmp_path)
    with open("/dev/full", "w") as full:
        p = clover(*argv, stdout=full, stdin=stdin)
    assert_refused(p, before, tmp_path, "cannot write the output to stdout: No space left on device")


@pytest.mark.parametrize("name,argv,stdin", STDOUT_CASES, ids=[c[0] for c in STDOUT_CASES])
def test_a_closed_stdout_pipe_ends_quietly(base, tmp_path, name, argv, stdin):
    """`| head`: the reader left before anything was written. No word, no traceback, 141 (128 + SIGPIPE, as a
    shell reports a tool that SIGPIPE stopped)."""
    w = Work(tmp_path, base)
    argv = [str(w.gguf) if a == "M" else a for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT,
                            preexec_fn=_limits())
    proc.stdout.close()  # the reader is gone before the first write
    try:
        _, err = proc.communicate(stdin.encode(), timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 141 and err == b"", (proc.returncode, err.decode(errors="replace")[-2000:])


def test_a_closed_stdout_descriptor_is_no_error(base, tmp_path):
    """Started with stdout closed (`>&-`: Python's sys.stdout is None): the command runs and writes nothing, as
    before the stdout guard (which must leave a missing stdout alone)."""
    model = Work(tmp_path, base).gguf

    def no_stdout() -> None:
        _limits()()
        os.close(1)

    p = subprocess.run([sys.executable, "-m", "clover_gguf", "info", str(model)], stdin=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, env=_env(), cwd=ROOT, preexec_fn=no_stdout, timeout=TIMEOUT_S)
    assert p.returncode == 0 and p.stderr == b"", (p.returncode, p.stderr.decode(errors="replace")[-2000:])


# ---- 5. fit stopped by TERM or HUP removes its scratch folder, as Ctrl-C did -------------------------------------
@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, True)],
                         ids=["sigterm", "sighup", "ctrl-c"])
def test_fit_stopped_by_a_signal_leaves_no_scratch_folder(base, tmp_path, sig, group):
    tmp, env = _tmpdir(tmp_path)
    argv = ["fit", "--config", base["ck"] / "config.json", "--type", "Q8_0", "--mode", "ar"]
    before = snapshot(tmp_path)
    for _ in range(5):
        p = _interrupt(argv, tmp, sig, group, marker="clover-fit-", env=env)
        if p is not None:
            break
        for f in tmp.iterdir():  # a run that finished before the signal: its folder is gone anyway
            shutil.rmtree(f)
    assert p is not None, "fit finished before it could be stopped, five times"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 130, f"exit {p.returncode}: {p.stderr[-2000:]}"
    assert p.stderr.strip().splitlines() == ["clover-gguf: error: interrupted"], p.stderr[-2000:]
    assert snapshot(tmp_path) == before, "a scratch folder was left behind"


# ---- 6. Ctrl-C in chat, however many and whenever, never ends the chat ---------------------------------------------
def test_chat_survives_ctrl_c_while_it_prints(base, tmp_path):
    """The chat's output goes to a pipe nobody reads until it is full, so the chat is stuck in a write (of a
    command's answer or of its own "> " prompt) when each Ctrl-C comes: the moment a Ctrl-C used to land in the
    middle of the chat's own printing and end it with 130. Then the pipe is read, input ends, and the chat leaves
    as Ctrl-D leaves: exit 0."""
    import fcntl
    import termios

    w = Work(tmp_path, base)
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf", "chat", str(w.gguf), "--mode", "ar"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            cwd=ROOT, preexec_fn=_limits())
    try:
        proc.stdin.write(b"/stats\n" * 8000)  # 56 KB in (fits the input pipe), about 150 KB out: more than it holds
        proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT_S
        buf, seen, still = bytearray(4), -1, 0
        while still < 5:  # until the output pipe is full (within a page) and stays so: the chat is blocked writing
            fcntl.ioctl(proc.stdout.fileno(), termios.FIONREAD, buf)
            n = int.from_bytes(buf, sys.byteorder)
            still = still + 1 if n == seen and n >= 65536 - 4096 else 0
            seen = n
            assert proc.poll() is None and time.monotonic() < deadline, "the chat did not fill its output"
            time.sleep(0.05)
        for _ in range(3):  # the first Ctrl-C, then more while the chat handles it (still blocked: nobody reads)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        proc.stdin.close()
        out = proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in err, err.decode(errors="replace")[-2000:]
    assert proc.returncode == 0, (proc.returncode, err.decode(errors="replace")[-2000:])
    assert out.count(b"(no answer yet)") == 8000 and out.endswith(b"> \n")


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(bundled_gguf):
    """The other half of the chat's Ctrl-C: during an answer it stops the answer (at its next piece) and the chat
    takes the next line. A real SIGINT, sent by the chat's own output at the answer's first text."""
    import io

    from clover_gguf.chat import ChatSession

    class Out(io.StringIO):
        sent = False
        at = -1  # where the output stood when the Ctrl-C came

        def write(self, text: str) -> int:
            if not self.sent and text.strip() and not text.startswith(("clover-gguf chat", ">")):
                self.sent = True
                n = super().write(text)
                self.at = len(self.getvalue())
                os.kill(os.getpid(), signal.SIGINT)
                return n
            return super().write(text)

    out = Out()
    s = ChatSession(bundled_gguf, mode="ar", max_new_tokens=256, n_ctx=512, out=out, n_threads=2,
                    inp=io.StringIO("Count from 1 to 60.\n/stats\n"))
    s.loop()
    text = out.getvalue()
    assert out.sent and "(stopped)" in text, text
    assert text[out.at:].startswith("\n(stopped)"), text

    # a Ctrl-C while the next token is being decoded (the usual moment): that token is not printed (issue 38)
    out = io.StringIO()
    s = ChatSession(bundled_gguf, mode="ar", max_new_tokens=256, n_ctx=512, out=out, n_threads=2,
                    inp=io.StringIO("Count from 1 to 60.\n/stats\n"))
    backend, seen = s.rt.backend, {"at": -1}
    step = backend.commit_rows

    def commit_rows(ids, gather):  # an AR step: the Ctrl-C comes during the third one
        seen["n"] = seen.get("n", 0) + 1
        if seen["n"] == 3:
            seen["at"] = len(out.getvalue())
            os.kill(os.getpid(), signal.SIGINT)
        return step(ids, gather)

    backend.commit_rows = commit_rows
    s.loop()
    text = out.getvalue()
    assert seen["at"] > 0 and text[seen["at"]:].startswith("\n(stopped)"), text  # nothing printed after it
    assert s.last is not None and s.last.generated_tokens < 256
    assert text.count(f"({s.last.summary()})") == 2  # after the stopped answer, and for /stats: the chat went on
    assert text.endswith("> \n")


# ---- 7. serve: --parallel against memory, before the slots load --------------------------------------------------
def test_serve_refuses_slots_that_cannot_fit(base, tmp_path):
    model = Work(tmp_path, base).gguf
    before = snapshot(tmp_path)
    p = clover("serve", model, "--port", "0", "--ctx", "64", "--parallel", "1000000")
    assert_refused(p, before, tmp_path, "--parallel 1000000 cannot fit")


# ---- issue 37: graft from folders and from a misbehaving hub, check-block prompt files, convert's side files, ------
# ---- serve's empty key --------------------------------------------------------------------------------------------
INDEX = "model.safetensors.index.json"
BLOCK_SUFFIXES = ("conv_right_weight", "bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c")


@pytest.fixture(scope="session")
def official(base, tmp_path_factory) -> Path:
    """The base model without its block tensors (what upstream's converter writes): graft's input."""
    from clover_gguf.export import export_ar

    out = tmp_path_factory.mktemp("hostile-official") / "ar.gguf"
    export_ar(base["gguf"], out, quiet=True)
    return out


def _tensors(fn: Callable[[dict], None]) -> Callable[[Work], None]:
    """Rewrite the shard with fn applied to its {name: array} (safetensors' own writer: a well-formed file)."""
    def apply(w: Work) -> None:
        from safetensors.numpy import load_file, save_file

        t = load_file(w.shard())
        fn(t)
        save_file(t, w.shard())
    return apply


def _set_block(name: str, value: float) -> Callable[[Work], None]:
    def fn(t: dict) -> None:
        t[name] = np.full_like(t[name], value)
    return _tensors(fn)


def _block_on_attention_layer(t: dict) -> None:
    # layer 3 is the tiny model's full-attention layer
    t["model.layers.3.linear_attn.conv_right_weight"] = t["model.layers.0.linear_attn.conv_right_weight"].copy()


def _index(values) -> Callable[[Work], None]:
    """An index whose weight_map gives every tensor the shard name `values`."""
    def apply(w: Work) -> None:
        index = {"metadata": {}, "weight_map": {n: values for n in _shard_names(w.shard())}}
        (w.ck / INDEX).write_text(json.dumps(index))
    return apply


def _gen(**changes) -> Callable[[Work], None]:
    return lambda w: w.edit_json("generation_config.json", lambda d: d.update(changes))


def _gen_raw(key: str, text: str) -> Callable[[Work], None]:
    """A generation_config.json value written as raw JSON text (1e400: what json.dumps cannot write)."""
    def apply(w: Work) -> None:
        p = w.ck / "generation_config.json"
        p.write_text(p.read_text().rstrip().rstrip("}").rstrip() + f', "{key}": {text}}}')
    return apply


DEEP = "[" * 100_000 + "]" * 100_000
LOGIT_SCALE = "model.layers.0.linear_attn.bd_softmax_logit_scale"
RIGHT_CONV = "model.layers.0.linear_attn.conv_right_weight"
# breakers both convert and graft (from a folder) must refuse: item -> (breaker, words)
SIDE_FILE_CASES: dict[str, tuple[Callable[[Work], None], str]] = {
    # 3: one index reader
    "index-shard-5": (_index(5), "names a shard 5"),
    "index-shard-null": (_index(None), "names a shard None"),
    "index-shard-list": (_index(["model.safetensors"]), "names a shard ["),
    "index-100000-deep": (_write(INDEX, DEEP.encode()), "nested too deeply"),
    # 4: non-finite or absurd block tensors, in and out of their transform
    "block-nan": (_set_block(RIGHT_CONV, float("nan")), "NaN or infinite"),
    "block-inf": (_set_block("model.layers.1.linear_attn.bd_softmax_history_bias", float("inf")), "NaN or infinite"),
    "block-minus-inf": (_set_block("model.layers.2.linear_attn.bd_softmax_history_c", float("-inf")),
                        "NaN or infinite"),
    "block-1e30": (_set_block(RIGHT_CONV, 1e30), "beyond +-65504"),
    "logit-scale-1000": (_set_block(LOGIT_SCALE, 1000.0), "stored as exp(value)"),
    # 7: a block tensor on a full-attention layer
    "block-on-attention-layer": (_tensors(_block_on_attention_layer), "layer_types makes layer 3 full_attention"),
}
# 7: convert alone writes generation_config.json's sampling keys (general.sampling.*)
CONVERT37_CASES: dict[str, tuple[Callable[[Work], None], str]] = {
    "temperature-hot": (_gen(temperature="hot"), "temperature"),
    "top-k-string": (_gen(top_k="5"), "top_k"),
    "top-p-string": (_gen(top_p="0.9"), "top_p"),
    "min-p-list": (_gen(min_p=[]), "min_p"),
    "temperature-1e400": (_gen_raw("temperature", "1e400"), "temperature"),
    "top-p-7": (_gen(top_p=7), "top_p must be in [0, 1]"),
    "mirostat-3": (_gen(mirostat=3), "mirostat"),
    "presence-penalty-1e300": (_gen(presence_penalty=1e300), "presence_penalty"),
}


@pytest.mark.parametrize("case", list(SIDE_FILE_CASES) + list(CONVERT37_CASES))
def test_convert_refuses_bad_side_files_and_block_tensors(base, tmp_path, case):
    breaker, words = {**SIDE_FILE_CASES, **CONVERT37_CASES}[case]
    w = Work(tmp_path, base)
    breaker(w)
    before = snapshot(tmp_path)
    assert_refused(clover(*w.convert()), before, tmp_path, words)


def _graft(w: Work, official: Path, source, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return clover("graft", official, "--from", source, "-o", w.out, "--quiet", env=env)


GRAFT_FOLDER_CASES: dict[str, tuple[Callable[[Work], None], str]] = {
    **SIDE_FILE_CASES,
    # 2: a checkpoint that is not the file's model
    "two-layer-config": (_cfg(num_hidden_layers=2, layer_types=["linear_attention"] * 2), "has 4 blocks"),
    "layer-pattern-differs": (_cfg(layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"]), "layer 2 is linear_attention in the file"),
}


@pytest.mark.parametrize("case", list(GRAFT_FOLDER_CASES))
def test_graft_from_a_folder_refuses(base, official, tmp_path, case):
    breaker, words = GRAFT_FOLDER_CASES[case]
    w = Work(tmp_path, base)
    breaker(w)
    shutil.copy(official, tmp_path / "ar.gguf")
    before = snapshot(tmp_path)
    assert_refused(_graft(w, tmp_path / "ar.gguf", w.ck), before, tmp_path, words)


def test_graft_from_a_folder_writes_what_convert_writes(base, official, tmp_path):
    """The good case beside the table: the grafted file has the converted file's block tensors, value for value."""
    from gguf import GGUFReader

    w = Work(tmp_path, base)
    p = _graft(w, official, w.ck)
    assert p.returncode == 0, p.stderr
    got = {t.name: np.array(t.data) for t in GGUFReader(w.out).tensors}
    want = {t.name: np.array(t.data) for t in GGUFReader(base["gguf"]).tensors}
    assert set(got) == set(want)
    assert all(np.array_equal(got[n], want[n]) for n in want)


# ---- 6. check-block: prompt files ----------------------------------------------------------------------------------
CHECK_BLOCK_ROWS = {
    "prompt-5": '{"prompt": 5}',
    "prompt-null": '{"prompt": null}',
    "prompt-list": '{"prompt": ["a"]}',
    "prompt-nan": '{"prompt": NaN}',
    "row-a-list": '[1, 2]',
    "content-null": '{"messages": [{"role": "user", "content": null}]}',
    "content-list": '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}',
    "messages-null": '{"messages": null}',
    "message-a-string": '{"messages": ["hi"]}',
    "row-100000-deep": DEEP,
}


@pytest.mark.parametrize("case", list(CHECK_BLOCK_ROWS))
def test_check_block_refuses_bad_prompt_rows(base, tmp_path, case):
    model = Work(tmp_path, base).gguf
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n' + CHECK_BLOCK_ROWS[case] + "\n")
    before = snapshot(tmp_path)
    assert_refused(clover("check-block", model, "--prompts", prompts), before, tmp_path, "row 2")


# ---- 1. serve: the API key -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,env", [
    (["--api-key", ""], {}),
    ([], {"CLOVER_GGUF_API_KEY": ""}),
    (["--host", "0.0.0.0", "--api-key", ""], {}),
], ids=["option", "environment", "open-host"])
def test_serve_refuses_an_empty_api_key(base, tmp_path, argv, env):
    model = Work(tmp_path, base).gguf
    before = snapshot(tmp_path)
    assert_refused(clover("serve", model, "--port", "0", *argv, env=env), before, tmp_path, "API key is empty")


def test_serve_refuses_an_api_key_no_client_sends_alike(base, tmp_path):
    model = Work(tmp_path, base).gguf
    before = snapshot(tmp_path)
    for key in ("cl\u00e9", "two words", "\u4f60\u597d"):
        assert_refused(clover("serve", model, "--port", "0", "--api-key", key), before, tmp_path, "printable ASCII")


# ---- 5. graft --from a hub id, against a server that misbehaves ----------------------------------------------------
class _Hub:
    """A stand-in for the Hub on 127.0.0.1 (/{owner}/{name}/resolve/{revision}/{file}) serving a checkpoint folder
    with byte ranges, or misbehaving as `mode` says: the mode's function writes the whole answer itself (raw bytes)
    and returns True, or returns False for a normal answer. It records each request's headers and counts the body
    bytes it got out."""

    def __init__(self, folder: Path, mode: Callable | None = None, redirect_to: str | None = None):
        import http.server
        import threading

        hub = self
        self.folder, self.mode, self.redirect_to = folder, mode, redirect_to
        self.requests: list[dict[str, str]] = []
        self.sent = 0
        self.trickled = 0  # bytes _trickle wrote before the client hung up

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):
                hub.requests.append(dict(self.headers))
                try:
                    hub.answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, h) -> None:
        if self.redirect_to is not None:
            h.send_response(302)
            h.send_header("Location", self.redirect_to + h.path)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        parts = h.path.split("/")  # '', owner, name, 'resolve', revision, file
        f = self.folder / parts[-1]
        if len(parts) != 6 or parts[3] != "resolve" or not f.is_file():
            h.send_error(404)
            return
        data = f.read_bytes()
        start, end, rng = 0, len(data) - 1, h.headers.get("Range")
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
        if self.mode is not None and self.mode(self, h, f.name, data, start, end, rng):
            return
        self.send(h, 206 if rng else 200, data[start:end + 1],
                  {"Content-Range": f"bytes {start}-{end}/{len(data)}"} if rng else {})

    def send(self, h, status: int, body: bytes, headers: dict[str, str] | None = None, length: int | None = None):
        h.send_response(status)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        for i in range(0, len(body), 1 << 16):
            h.wfile.write(body[i:i + (1 << 16)])
            self.sent += len(body[i:i + (1 << 16)])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _tensor_read(name: str, start: int, rng) -> bool:
    """A ranged read inside the shard past its 8-byte length: a header or tensor read, not a size probe."""
    return name == "model.safetensors" and bool(rng) and start >= 8


def _raw(text: bytes, only_tensors: bool = False):
    def mode(hub, h, name, data, start, end, rng) -> bool:
        if only_tensors and not _tensor_read(name, start, rng):
            return False
        h.wfile.write(text)
        return True
    return mode


def _truncated(hub, h, name, data, start, end, rng) -> bool:
    if not _tensor_read(name, start, rng):
        return False
    body = data[start:end + 1]
    h.send_response(206)
    h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body[:len(body) // 2])  # then the connection closes
    return True


def _short_body(hub, h, name, data, start, end, rng) -> bool:
    if not _tensor_read(name, start, rng):
        return False
    hub.send(h, 206, data[start:end], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})  # one byte short
    return True


def _empty_206(hub, h, name, data, start, end, rng) -> bool:
    if not _tensor_read(name, start, rng):
        return False
    hub.send(h, 206, b"", {"Content-Range": f"bytes {start}-{end}/{len(data)}"})
    return True


def _superscript_total(hub, h, name, data, start, end, rng) -> bool:
    if not rng:
        return False
    hub.send(h, 206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/\u00b2"})  # latin-1 byte 0xB2
    return True


def _wrong_offset(hub, h, name, data, start, end, rng) -> bool:
    if not _tensor_read(name, start, rng) or end - start > 1024:  # the tensors, not the header
        return False
    s = start + 4
    hub.send(h, 206, data[s:s + end - start + 1], {"Content-Range": f"bytes {s}-{s + end - start}/{len(data)}"})
    return True


def _wrong_offset_claimed(hub, h, name, data, start, end, rng) -> bool:
    """The other lie: the Content-Range says what was asked, the bytes come from elsewhere (nothing can see
    that but the values; here the body is also one byte longer than the range, which is seen)."""
    if not _tensor_read(name, start, rng) or end - start > 1024:
        return False
    hub.send(h, 206, data[start + 4:end + 6], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})
    return True


def _ignores_ranges(hub, h, name, data, start, end, rng) -> bool:
    if name != "model.safetensors":
        return False
    hub.send(h, 200, data)
    return True


def _ignores_ranges_with_content_range(hub, h, name, data, start, end, rng) -> bool:
    if name != "model.safetensors":
        return False
    hub.send(h, 200, data, {"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"})
    return True


def _huge_config(hub, h, name, data, start, end, rng) -> bool:
    if name != "config.json":
        return False
    h.send_response(200)
    h.send_header("Content-Length", str(300 * 2**20))
    h.end_headers()
    h.wfile.write(data)
    return True


def _endless_config(hub, h, name, data, start, end, rng) -> bool:
    """No Content-Length: a body that goes on until the reader stops."""
    if name != "config.json":
        return False
    h.send_response(200)
    h.end_headers()
    chunk = b" " * (1 << 20)
    for _ in range(100):
        h.wfile.write(chunk)
        hub.sent += len(chunk)
    return True


TRICKLE = 60  # header bytes the trickling hub sends, one every half second (30 s: longer than any deadline here)


def _trickle(hub, h, name, data, start, end, rng) -> bool:
    h.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n")
    for _ in range(TRICKLE):  # one header byte every half second: each read is quick, the answer never ends
        h.wfile.write(b"X")
        h.wfile.flush()
        hub.trickled += 1
        time.sleep(0.5)
    return True


HUB_CASES: dict[str, tuple[Callable, str]] = {
    "truncated-body": (_truncated, "cut short"),
    "bad-chunking": (_raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"), "malformed"),
    "bad-status-line": (_raw(b"HELLO THERE\r\n\r\n"), "malformed (BadStatusLine"),
    "101-headers": (_raw(b"HTTP/1.0 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(101)) + b"\r\n"),
                    "malformed"),
    "line-too-long": (_raw(b"HTTP/1.0 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n"), "malformed (LineTooLong"),
    "short-tensor-body": (_short_body, "bytes"),
    "empty-206": (_empty_206, "sent 0 bytes"),
    "superscript-total": (_superscript_total, "no valid Content-Range"),
    "wrong-offset": (_wrong_offset, "for a request of bytes"),
    "wrong-offset-claimed": (_wrong_offset_claimed, "bytes"),
    "ignores-ranges": (_ignores_ranges, "ignores byte ranges"),
    "ignores-ranges-with-content-range": (_ignores_ranges_with_content_range, "ignores byte ranges"),
    "300MB-config": (_huge_config, "more than the"),
    "endless-config": (_endless_config, "more than the"),
}


def _hub_env(hub_url: str, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "", "HF_HOME": "/nonexistent-hf-home",
            **extra}


@pytest.mark.parametrize("case", list(HUB_CASES))
def test_graft_from_a_misbehaving_hub_is_one_line(base, official, tmp_path, case):
    mode, words = HUB_CASES[case]
    w = Work(tmp_path, base)
    folder = w.ck
    hub = _Hub(folder, mode)
    before = snapshot(tmp_path)
    try:
        p = _graft(w, official, "Diffuspace/Clover-35B-A3B-Preview", env=_hub_env(hub.url))
    finally:
        hub.close()
    assert_refused(p, before, tmp_path, words)
    shard = (folder / "model.safetensors").stat().st_size
    assert hub.sent <= 2 * shard + 70 * 2**20, hub.sent  # the endless body: at most the 64 MiB cap and a buffer
    if "ignores-ranges" in case:
        assert hub.sent <= 2 * shard


def test_graft_from_a_trickling_hub_stops_at_its_deadline(base, official, tmp_path):
    w = Work(tmp_path, base)
    hub = _Hub(w.ck, _trickle)
    before = snapshot(tmp_path)
    try:
        p = _graft(w, official, "Diffuspace/Clover-35B-A3B-Preview",
                   env=_hub_env(hub.url, CLOVER_GGUF_HUB_TIMEOUT="2"))
    finally:
        hub.close()
    assert_refused(p, before, tmp_path, "did not finish answering within 2 s")
    # it hung up on the hub long before the answer's end (about 4 bytes at 2 s; the whole graft's wall time, start-up
    # included, is no bound: on a busy machine the start-up alone took longer than the test's old 20 s)
    assert hub.trickled < TRICKLE // 2, hub.trickled


def test_graft_keeps_the_token_on_the_endpoints_host(base, official, tmp_path):
    """The endpoint redirects every file to another host:port (as the Hub does to its CDN): the file is grafted, and
    the token went to the endpoint only."""
    w = Work(tmp_path, base)
    cdn = _Hub(w.ck)
    endpoint = _Hub(w.ck, redirect_to=cdn.url)
    try:
        p = _graft(w, official, "Diffuspace/Clover-35B-A3B-Preview",
                   env=_hub_env(endpoint.url, HF_TOKEN="hf_secret_token_of_the_user"))
    finally:
        cdn.close()
        endpoint.close()
    assert p.returncode == 0, p.stderr
    ours = [{k.lower(): v for k, v in r.items()} for r in endpoint.requests]
    ours = [r for r in ours if "hf_hub" in r.get("user-agent", "")]  # not a stray probe of another test's port
    assert ours and all("hf_secret" in r.get("authorization", "") for r in ours)
    assert cdn.requests and not [r for r in cdn.requests if "hf_secret" in str(r)]


HUB_SPEC_CASES = [  # (name, --from, HF_ENDPOINT or None for a live stand-in, words)
    ("repo-id-with-space", "Diffuspace/Clover 35B", None, "not a checkpoint folder, nor a Hugging Face repo id"),
    ("repo-id-dotdot", "Diffuspace/..", None, "not a checkpoint folder"),
    ("repo-id-dotdot-inside", "Diffu..space/x", None, "not a checkpoint folder"),
    ("endpoint-port-99999", "Diffuspace/Clover", "http://127.0.0.1:99999", "port outside 0-65535"),
    ("endpoint-with-crlf", "Diffuspace/Clover", "http://127.0.0.1:1\r\nX-Injected: 1", "control characters"),
    ("endpoint-not-http", "Diffuspace/Clover", "ftp://127.0.0.1", "not an http(s) URL"),
    ("timeout-not-a-number", "Diffuspace/Clover", "TIMEOUT", "CLOVER_GGUF_HUB_TIMEOUT"),
]


@pytest.mark.parametrize("name,spec,endpoint,words", HUB_SPEC_CASES, ids=[c[0] for c in HUB_SPEC_CASES])
def test_graft_refuses_a_bad_repo_id_or_endpoint(base, official, tmp_path, name, spec, endpoint, words):
    w = Work(tmp_path, base)
    env = _hub_env(endpoint or "http://127.0.0.1:9")
    if endpoint == "TIMEOUT":
        env = _hub_env("http://127.0.0.1:9", CLOVER_GGUF_HUB_TIMEOUT="\u00b2")
    before = snapshot(tmp_path)
    assert_refused(_graft(w, official, spec, env=env), before, tmp_path, words)


def test_a_stop_string_that_is_not_utf8_is_a_400():
    """A lone surrogate in a stop string ("\\ud800" in the JSON) can never match any output: 400, as for the prompt
    (docs/serve.md). Also in the table of tests/test_hostile_serve.py, through a running server."""
    pytest.importorskip("fastapi")
    from clover_gguf.serve.schema import APIError, _models, plan_from

    chat, completion = _models()
    for stop in ("\ud800", ["ok", "a\udfffb"]):
        for req, is_chat in ((chat(messages=[{"role": "user", "content": "hi"}], stop=stop), True),
                             (completion(prompt="hi", stop=stop), False)):
            with pytest.raises(APIError) as e:
                plan_from(req, is_chat, "ar")
            assert e.value.status == 400 and e.value.param == "stop" and "not valid UTF-8" in e.value.message


def test_the_key_middleware_takes_no_empty_or_non_ascii_key():
    """create_app and serve check the key first (above, through the CLI); the middleware itself never runs with a key
    that would let everyone in or that clients send as different bytes."""
    from clover_gguf.errors import UserError
    from clover_gguf.serve.auth import RequireKey

    for key in ("", "cl\u00e9", " key"):
        with pytest.raises(UserError):
            RequireKey(None, key)


# =================================================================================================================
# Issue 52, the fourth round: folder outputs, the MLX path's side files and checks, sampling values the samplers
# cannot take, check-block --write through a link, an early Ctrl-C. `item` numbers are the issue's.
# =================================================================================================================
@pytest.fixture(scope="session")
def mlx_base(base, tmp_path_factory) -> dict[str, Path]:
    """base, and mlx-convert's folders of its checkpoint: "mlx" (float32) and "q4" (4-bit, groups of 32)."""
    root = tmp_path_factory.mktemp("hostile-mlx")
    for name, extra in (("mlx", []), ("q4", ["--q-bits", "4", "--q-group-size", "32"])):
        p = clover("mlx-convert", base["ck"], "-o", root / name, *extra)
        assert p.returncode == 0, p.stderr
    return {**base, "mlx": root / "mlx", "q4": root / "q4"}


# ---- 2, 4: folder outputs that are or hold inputs, or that cannot be made --------------------------------------
def _onto(command: str, target: Callable[[Work], Path], force: bool = True) -> Callable[[Work], tuple[list, dict]]:
    """mlx-convert of the checkpoint, or graft of a community folder from the checkpoint, onto target(w)."""
    def make(w: Work) -> tuple[list, dict]:
        src = w.ck if command == "mlx-convert" else w.community
        argv = [command, src, *(["--from", w.ck] if command == "graft" else []), "-o", target(w),
                *(["--force"] if force else []), *(["--quiet"] if command == "graft" else [])]
        return argv, {}
    return make


def _in_out(w: Work, cwd: bool = False) -> dict:
    return {"cwd": w.folder / "out"} if cwd else {}


def _under_a_file(w: Work) -> Path:
    (w.folder / "out" / "f").write_text("a file")
    return w.folder / "out" / "f" / "mlx"


def _existing_file(w: Work) -> Path:
    (w.folder / "out" / "f").write_text("a file")
    return w.folder / "out" / "f"


def _link_to_folder(w: Work) -> Path:
    (w.folder / "out" / "real").mkdir()
    (w.folder / "out" / "link").symlink_to(w.folder / "out" / "real")
    return w.folder / "out" / "link"


def _read_only(w: Work) -> tuple[list, dict]:
    os.chmod(w.folder / "out", 0o555)
    argv, _ = _onto("mlx-convert", lambda w: w.folder / "out" / "mlx", force=False)(w)
    return argv, {"read_only": True}


def _dot(command: str) -> Callable[[Work], tuple[list, dict]]:
    def make(w: Work) -> tuple[list, dict]:
        argv, _ = _onto(command, lambda w: Path("."))(w)
        return argv, {"cwd": w.folder / "out"}
    return make


FOLDER_OUTPUT_CASES: dict[str, tuple[str, Callable[[Work], tuple[list, dict]], str]] = {
    # 2: --force replaced the checkpoint (or the folder beside it) with the output
    "mlx-convert-onto-the-checkpoints-parent": ("2", _onto("mlx-convert", lambda w: w.folder), "holds it"),
    "mlx-convert-onto-the-checkpoint": ("2", _onto("mlx-convert", lambda w: w.ck), "one of the inputs"),
    "graft-onto-the-checkpoint": ("2", _onto("graft", lambda w: w.ck), "one of the inputs"),
    "graft-onto-its-input": ("2", _onto("graft", lambda w: w.community), "one of the inputs"),
    "graft-onto-the-inputs-parent": ("2", _onto("graft", lambda w: w.folder), "holds it"),
    # 4: tracebacks
    "mlx-convert-under-a-file": ("4", _onto("mlx-convert", _under_a_file), "Not a directory"),
    "mlx-convert-onto-a-file": ("4", _onto("mlx-convert", _existing_file), "exists and is not a folder"),
    "mlx-convert-in-a-read-only-folder": ("4", _read_only, "is not writable"),
    "mlx-convert-onto-a-link-with-force": ("4", _onto("mlx-convert", _link_to_folder), "is a link"),
    "graft-onto-a-link-with-force": ("4", _onto("graft", _link_to_folder), "is a link"),
    "mlx-convert-dot": ("4", _dot("mlx-convert"), "the working folder"),
    "graft-dot": ("4", _dot("graft"), "the working folder"),
    "mlx-convert-root": ("4", _onto("mlx-convert", lambda w: Path("/")), "the root folder"),
    "mlx-convert-exists-without-force": ("own", _onto("mlx-convert", lambda w: w.mlx, force=False), "--force"),
}


@pytest.mark.parametrize("case", list(FOLDER_OUTPUT_CASES))
def test_a_folder_output_never_replaces_an_input_and_is_one_line(mlx_base, tmp_path, case):
    _, make, expect = FOLDER_OUTPUT_CASES[case]
    w = Work(tmp_path, mlx_base)
    argv, kw = make(w)
    before = snapshot(tmp_path)
    try:
        p = clover(*argv, **kw)
    finally:
        os.chmod(w.folder / "out", 0o755)
    assert_refused(p, before, tmp_path, expect)


@pytest.mark.parametrize("command", ["mlx-convert", "graft"])
def test_a_full_disk_while_a_folder_is_written_is_one_line(mlx_base, tmp_path, command):
    """4: writes past RLIMIT_FSIZE fail (EFBIG) as on a full disk: MLX's writer raised a RuntimeError traceback."""
    w = Work(tmp_path, mlx_base)
    argv, _ = _onto(command, lambda w: w.folder / "out" / "mlx", force=False)(w)
    before = snapshot(tmp_path)
    assert_refused(clover(*argv, fsize=4096), before, tmp_path, "could not write")


@pytest.mark.parametrize("command", ["mlx-convert", "graft"])
def test_a_folder_output_checks_the_free_space_first(mlx_base, tmp_path, monkeypatch, command):
    """4: the room a folder output needs is checked before it is written (a disk with 1 MiB free here)."""
    import collections

    from clover_gguf import fsutil
    from clover_gguf.errors import UserError

    monkeypatch.setattr(fsutil.shutil, "disk_usage", lambda p: collections.namedtuple("u", "total used free")(
        2**30, 2**30 - 2**20, 2**20))
    w = Work(tmp_path, mlx_base)
    ck, src = w.ck, w.community
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="not enough disk space"):
        if command == "mlx-convert":
            from clover_gguf.mlx_backend import convert as mlx_convert

            mlx_convert(ck, w.folder / "out" / "mlx")
        else:
            from clover_gguf.graft import graft

            graft(src, str(ck), w.folder / "out" / "mlx", quiet=True)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("how", ["cache-dir-a-file", "cache-dir-under-a-file", "read-only-home"])
def test_build_llama_with_a_cache_it_cannot_write_is_one_line(tmp_path, how):
    """4: build-llama made its cache folder (and lock files) with tracebacks for a file there or a read-only home."""
    (tmp_path / "f").write_text("a file")
    (tmp_path / "home").mkdir(mode=0o555)
    env = {"CLOVER_GGUF_CACHE_DIR": str(tmp_path / "f")} if how == "cache-dir-a-file" else \
        {"CLOVER_GGUF_CACHE_DIR": str(tmp_path / "f" / "cache")} if how == "cache-dir-under-a-file" else \
        {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": "", "CLOVER_GGUF_CACHE_DIR": ""}
    before = snapshot(tmp_path)
    p = clover("build-llama", env=env, read_only=True)
    assert_refused(p, before, tmp_path, "set CLOVER_GGUF_CACHE_DIR to a writable folder")


# ---- 3: a folder replaced with --force is replaced whole ----------------------------------------------------------
def test_a_folder_is_replaced_whole_or_not_at_all(mlx_base, tmp_path, monkeypatch):
    """The old folder was removed, then the new one renamed in: a signal between the two lost both. Now the old one
    is renamed aside, the new one in, the old one removed; a failure (here: the rename of the new folder, as a
    signal would stop it) puts the old one back."""
    from clover_gguf import fsutil
    from clover_gguf.mlx_backend import convert as mlx_convert

    w = Work(tmp_path, mlx_base)
    out = w.folder / "out" / "mlx"
    shutil.copytree(w.mlx, out)
    (out / "mine.txt").write_text("the old folder")
    old = snapshot(w.folder / "out")
    rename = os.rename

    def stopped(a, b, *args, **kw):
        if Path(a).name.startswith(".mlx.partial-"):
            raise KeyboardInterrupt
        return rename(a, b, *args, **kw)

    monkeypatch.setattr(fsutil.os, "rename", stopped)
    with pytest.raises(KeyboardInterrupt):
        mlx_convert(w.ck, out, force=True)
    assert snapshot(w.folder / "out") == old  # the old folder, whole, and nothing beside it
    monkeypatch.setattr(fsutil.os, "rename", rename)
    mlx_convert(w.ck, out, force=True)
    assert not (out / "mine.txt").exists() and sorted(p.name for p in (w.folder / "out").iterdir()) == ["mlx"]

    # a real SIGTERM between the two renames: it takes effect once both are done (the new folder in, the old gone)
    def signalled(a, b, *args, **kw):
        if Path(b).name.startswith(".mlx.old-"):
            os.kill(os.getpid(), signal.SIGTERM)
        return rename(a, b, *args, **kw)

    monkeypatch.setattr(fsutil.os, "rename", signalled)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with fsutil.atomic_folder(out) as tmp:
            (tmp / "new.txt").write_text("the new folder")
    assert sorted(p.name for p in (w.folder / "out").iterdir()) == ["mlx"] and (out / "new.txt").is_file()


# ---- 5, 8: what the MLX loader hands mlx-lm, and the one reader of JSON side files ----------------------------------
GATE = "language_model.model.layers.0.mlp.gate"  # a module the 4-bit folder quantizes on its own (8 bits)


def _quant(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        fn(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return apply


def _set(d: dict, key: str, value) -> None:
    d[key] = value


def _fifo(name: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        (folder / name).unlink()
        os.mkfifo(folder / name)
    return apply


def _sparse(name: str, size: int = 16 * 2**30) -> Callable[[Path], None]:
    """`name` grown to 16 GB without taking the room (a sparse file): read whole, a MemoryError under the limit."""
    def apply(folder: Path) -> None:
        with open(folder / name, "r+b") as f:
            f.truncate(size)
    return apply


def _gen_json(text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / "generation_config.json").write_text(text)


def _gen_eos(value) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        g = json.loads((folder / "generation_config.json").read_text())
        g["eos_token_id"] = value
        (folder / "generation_config.json").write_text(json.dumps(g))
    return apply


MLX_FOLDER_CASES: dict[str, tuple[str, str, Callable[[Path], None], str]] = {  # (item, folder, breaker, words)
    "per-module-group-size-0": ("5", "q4", _quant(lambda d: d["quantization"][GATE].update(group_size=0)),
                                "group_size must be one of 32, 64, 128"),
    "quantization-empty": ("5", "q4", _quant(lambda d: _set(d, "quantization", {})), "group_size must be"),
    "quantization-a-list": ("5", "q4", _quant(lambda d: _set(d, "quantization", [4, 64])), "must be an object"),
    "quantization-a-string": ("5", "q4", _quant(lambda d: _set(d, "quantization", "4bit")), "must be an object"),
    "quantization-without-bits": ("5", "q4", _quant(lambda d: d["quantization"].pop("bits")), "bits must be"),
    "per-module-a-string": ("5", "q4", _quant(lambda d: _set(d["quantization"], GATE, "8")), "must be an object"),
    "per-module-bits-a-string": ("5", "q4", _quant(lambda d: d["quantization"][GATE].update(bits="8")),
                                 "bits must be"),
    "per-module-bits-a-float": ("5", "q4", _quant(lambda d: d["quantization"][GATE].update(bits=8.0)),
                                "bits must be"),
    "per-module-bits-huge": ("5", "q4", _quant(lambda d: d["quantization"][GATE].update(bits=2**70)),
                             "bits must be"),
    # issue 68, cause 11: a TypeError from Linear.to_quantized, as a traceback
    "per-module-extra-key": ("5", "q4", _quant(lambda d: d["quantization"][GATE].update(foo=1)),
                             "holds 'foo': a module's entry has only group_size, bits and mode"),
    "generation-config-a-list": ("5", "mlx", _gen_json("[1]"), "must be a JSON object"),
    "eos-token-id-1e23": ("5", "mlx", _gen_eos(1e23), "eos_token_id must be an integer in 0..447"),
    "config-100000-deep": ("5", "mlx", lambda f: (f / "config.json").write_text(DEEP), "nested too deeply"),
    "weights-a-fifo": ("5", "mlx", _fifo("model.safetensors"), "is not a regular file"),
    "generation-config-a-fifo": ("own", "mlx", _fifo("generation_config.json"), "is not a regular file"),
    "config-16GB": ("8", "mlx", _sparse("config.json"), "over 64 MiB"),
    "block-file-nan": ("10", "mlx", lambda f: _save_block(f, RIGHT_CONV, float("nan")), "NaN or infinite"),
    "block-file-logit-scale-1000": ("10", "mlx", lambda f: _save_block(f, LOGIT_SCALE, 1000.0),
                                    "stored as exp(value)"),
}
# what killed the process (SIGFPE), hung it (a FIFO) or would fill this machine's memory (16 GB read whole): these
# run only in a process of their own, under the limits
IN_A_PROCESS_ONLY = ("per-module-group-size-0", "weights-a-fifo", "generation-config-a-fifo", "config-16GB")
# in a process of their own: those, serve's two, and one more
MLX_FOLDER_RUNS = [(c, "generate") for c in (*IN_A_PROCESS_ONLY, "quantization-empty", "per-module-extra-key")] + \
    [("per-module-group-size-0", "serve"), ("weights-a-fifo", "serve")]


def _save_block(folder: Path, name: str, value: float) -> None:
    from safetensors.numpy import load_file, save_file

    from clover_gguf.graft import MLX_BLOCK_FILE

    t = load_file(folder / MLX_BLOCK_FILE)
    t[name] = np.full_like(t[name], value)
    save_file(t, folder / MLX_BLOCK_FILE)


def _folder_command(cmd: str, folder: Path, out: Path) -> list:
    return {"generate": ["generate", folder, "-p", PROMPT, "-n", "4"], "serve": ["serve", folder, "--port", "0"],
            "mlx-convert": ["mlx-convert", folder, "-o", out], "convert": ["convert", folder, "-o", out / "m.gguf"]
            }[cmd]


@pytest.mark.parametrize("case,cmd", MLX_FOLDER_RUNS, ids=[f"{c}-{m}" for c, m in MLX_FOLDER_RUNS])
def test_the_mlx_loader_checks_what_it_hands_mlx_lm(mlx_base, tmp_path, case, cmd):
    """5: mlx-lm's loader read config.json's quantization (a group_size of 0: SIGFPE, exit 136), the generation
    config and the weight files unchecked (a FIFO: generate and serve hung); 8: a 16 GB config.json was read whole."""
    _, folder, breaker, words = MLX_FOLDER_CASES[case]
    w = Work(tmp_path, mlx_base)
    model = getattr(w, folder)
    breaker(model)
    before = snapshot(tmp_path)
    assert_refused(clover(*_folder_command(cmd, model, w.folder / "out" / "mlx")), before, tmp_path, words)


@pytest.mark.parametrize("case", [c for c in MLX_FOLDER_CASES if c not in IN_A_PROCESS_ONLY])
def test_the_mlx_loader_refuses_each_case_in_one_line(mlx_base, tmp_path, case):
    """The whole table through mlx_backend.load in this process (the CLI turns its UserError into the one line, as
    the runs above show); the cases that kill or hang a process run only above."""
    from clover_gguf import mlx_backend
    from clover_gguf.errors import UserError

    _, folder, breaker, words = MLX_FOLDER_CASES[case]
    model = getattr(Work(tmp_path, mlx_base), folder)
    breaker(model)
    with pytest.raises(UserError, match=re.escape(words)):
        mlx_backend.load(model)


@pytest.mark.parametrize("cmd", ["convert", "mlx-convert", "generate"])
def test_a_16GB_checkpoint_config_is_refused_unread(base, tmp_path, cmd):
    """8: config.json read whole with no limit: a MemoryError under the 4 GiB address space (and 6 GB in the
    issue) in convert, mlx-convert and generate on a checkpoint folder."""
    w = Work(tmp_path, base)
    _sparse("config.json")(w.ck)
    before = snapshot(tmp_path)
    assert_refused(clover(*_folder_command(cmd, w.ck, w.folder / "out" / "mlx")), before, tmp_path, "over 64 MiB")


# ---- 6, 10: a checkpoint folder passes convert's checks wherever it is read ---------------------------------------
def _experts_without_down(t: dict) -> None:
    for k in [k for k in t if k.startswith("model.layers.0.mlp.experts.") and ".down_proj." in k]:
        del t[k]


def _typed(name: str, dtype) -> Callable[[Work], None]:
    def fn(t: dict) -> None:
        t[name] = (t[name] > 0) if dtype is bool else t[name].astype(dtype)
    return _tensors(fn)


CHECKPOINT_CASES: dict[str, tuple[str, Callable[[Work], None], str]] = {  # (item, breaker, words)
    **{name: ("10", breaker, words) for name, (breaker, words) in SIDE_FILE_CASES.items()
       if not name.startswith("index-")},  # the index: one reader, convert's and the loader's already
    "weights-int32": ("10", _typed("model.norm.weight", np.int32), "unsupported dtype I32"),
    "weights-bool": ("10", _typed("model.norm.weight", bool), "unsupported dtype BOOL"),
    "block-softmax-2x2": ("10", _tensors(lambda t: _set(t, "model.layers.0.linear_attn.bd_softmax_history_c",
                                                        np.ones((2, 2), np.float32))), "has shape [2, 2]"),
    "tokenizer-missing": ("10", lambda w: (w.ck / "tokenizer.json").unlink(), "missing tokenizer.json"),
    "tokenizer-broken": ("10", _write("tokenizer.json", b"{"), "tokenizer.json is not valid JSON"),
    "generation-config-broken": ("10", _gen(top_k="5"), "top_k must be an integer"),
    # 6: the stacked experts
    "every-down-proj-of-a-layer-missing": ("6", _tensors(_experts_without_down), "blk.0.ffn_down_exps.weight"),
    "an-expert-of-another-shape": ("6", _tensors(lambda t: _set(t, "model.layers.0.mlp.experts.1.down_proj.weight",
                                                                np.ones((3, 3), np.float32))), "has shape [3, 3]"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_the_mlx_path_runs_converts_checks(base, tmp_path, case):
    """10: mlx-convert and the MLX loader took what convert refuses (exit 0, a folder that failed later); 6: the
    stacked experts were a KeyError or ValueError traceback. One check (convert.check_checkpoint), the same line
    from mlx-convert (mlx_backend.convert) and from generate, chat and serve (mlx_backend.load)."""
    from clover_gguf import mlx_backend
    from clover_gguf.errors import UserError

    _, breaker, words = CHECKPOINT_CASES[case]
    w = Work(tmp_path, base)
    breaker(w)
    before = snapshot(tmp_path)
    for run in (lambda: mlx_backend.convert(w.ck, w.folder / "out" / "mlx"), lambda: mlx_backend.load(w.ck)):
        with pytest.raises(UserError, match=re.escape(words)):
            run()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case,cmd", [(c, m) for c in ("block-nan", "every-down-proj-of-a-layer-missing")
                                      for m in ("mlx-convert", "generate")])
def test_the_mlx_path_refuses_a_checkpoint_in_one_line(base, tmp_path, case, cmd):
    _, breaker, words = CHECKPOINT_CASES[case]
    w = Work(tmp_path, base)
    breaker(w)
    before = snapshot(tmp_path)
    assert_refused(clover(*_folder_command(cmd, w.ck, w.folder / "out" / "mlx")), before, tmp_path, words)



# ---- 7: half-precision weights on MLX's CPU device ------------------------------------------------------------------
@pytest.fixture(scope="session")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """The base model's shapes stored in bfloat16, as the real checkpoint is."""
    out = tmp_path_factory.mktemp("hostile-bf16") / "ck"
    make_tiny(out, seed=21, dtype="bf16")
    return out


def test_half_precision_runs_on_mlxs_cpu_device_as_float32(bf16_checkpoint, tmp_path):
    """7: unquantized BF16/F16 experts failed on MLX's CPU device ("[GatherMM::eval] Currently only supports
    float32"): the BF16 checkpoint folder itself, and mlx-convert --dtype bfloat16 / float16. They are upcast there
    (mlx_backend.runnable_here): the logits are those of the same weights loaded as float32, and the commands
    answer."""
    from clover_gguf import mlx_backend as mb

    ids = list(range(5, 17))
    half, full = mb.MlxBackend(mb.load(bf16_checkpoint)), mb.MlxBackend(mb.load(bf16_checkpoint, dtype="float32"))
    assert np.array_equal(half.commit(ids), full.commit(ids))
    assert np.array_equal(half.block_logits([3] * 8), full.block_logits([3] * 8))
    for dtype in ("bfloat16", "float16"):
        assert clover("mlx-convert", bf16_checkpoint, "-o", tmp_path / dtype, "--dtype", dtype).returncode == 0
    for model in (bf16_checkpoint, tmp_path / "bfloat16", tmp_path / "float16"):
        p = clover("generate", model, "-p", PROMPT, "-n", "8", "--json")
        assert p.returncode == 0 and not p.stderr, p.stderr[-2000:]
        assert json.loads(p.stdout)["stats"]["generated_tokens"] >= 1


# ---- 9: sampling values the samplers cannot take, on MLX too (the llama.cpp cases: tests/test_hostile_serve.py) ---
@pytest.mark.parametrize("argv,words", [
    (["--temp", "1e-320"], "temperature must be 0 (greedy) or in [1e-06, 1e+06]"),
    (["--temp", "1", "--top-k", str(10**12)], "top_k must be in 0..2147483647"),
], ids=["temp-1e-320", "top-k-10^12"])
def test_sampling_values_the_samplers_cannot_take_are_one_line_on_mlx(mlx_base, tmp_path, argv, words):
    model = Work(tmp_path, mlx_base).mlx
    before = snapshot(tmp_path)
    assert_refused(clover("generate", model, "-p", PROMPT, "-n", "4", *argv), before, tmp_path, words)


# ---- 11: check-block --write through a link ------------------------------------------------------------------------
@pytest.mark.parametrize("keys", ["present", "absent"], ids=["in-place", "rewritten"])
def test_check_block_write_through_a_link_stamps_the_file_it_names(base, tmp_path, keys):
    """The Hugging Face cache keeps a model as a link to its blob: --write replaced the link with a stamped copy and
    left the blob as it was (when the keys had to be added: the file rewritten). The file the link names is stamped,
    in place or rewritten, and the link stays a link to it."""
    from clover_gguf.check_block import CheckResult, Ranking, stamp
    from clover_gguf.gguf_header import read_header

    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    drop = {md.BLOCK_READING: None, md.BLOCK_READING_VERIFIED: None} if keys == "absent" else {}
    edit_gguf(base["gguf"], blob, drop)
    link = tmp_path / "snapshots" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(os.path.relpath(blob, link.parent))
    winner = CheckResult(str(link), "hist-read-add", False, drafted=100, accepted=99)
    assert winner.verdict == "holds"
    ranking = Ranking(str(link), "hist-sink-add", [winner])  # a reading that holds, alone: the pick
    done = stamp(link, ranking, "hist-sink-add", False)
    assert done == ("rewritten" if keys == "absent" else "in place")
    assert link.is_symlink() and link.resolve() == blob.resolve()
    kv = read_header(blob).kv
    assert kv[md.BLOCK_READING] == "hist-read-add" and kv[md.BLOCK_READING_VERIFIED] is True
    assert sorted(p.name for p in blob.parent.iterdir()) == ["0123abcd"]  # no temporary file left


# ---- 13: Ctrl-C while the command line is still importing --------------------------------------------------------
@pytest.mark.parametrize("command", [["info", "M"], ["generate", "M", "-p", PROMPT], ["--help"]],
                         ids=["info", "generate", "help"])
def test_ctrl_c_while_the_imports_run_is_one_line(base, tmp_path, command):
    """A Ctrl-C in the first quarter second came while numpy and typer were imported, before main's handling: a
    KeyboardInterrupt traceback and death by SIGINT (exit -2). The handler is in place before those imports
    (clover_gguf.__main__): the Ctrl-C is sent as soon as `-X importtime` shows numpy being imported."""
    model = Work(tmp_path, base).gguf
    argv = [sys.executable, "-X", "importtime", "-m", "clover_gguf", *[model if a == "M" else a for a in command]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT,
                            preexec_fn=_limits())
    lines = []
    try:
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            if lines[-1].rsplit("|", 1)[-1].strip().split(".")[0] == "numpy":  # "import time: self | total | name"
                proc.send_signal(signal.SIGINT)
                break
        else:
            raise AssertionError("numpy was never imported: " + "".join(lines[-5:]))
        rest = proc.stderr.read().decode(errors="replace")
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = [x for x in (*lines, *rest.splitlines(keepends=True)) if not x.startswith("import time:")]
    assert "Traceback" not in "".join(err), "".join(err)[-3000:]
    assert proc.returncode == 130 and [x.strip() for x in err] == ["clover-gguf: error: interrupted"], \
        (proc.returncode, "".join(err)[-2000:])


# ---- 14: help and docs say what the commands take --------------------------------------------------------------
@pytest.mark.parametrize("command", [["info", "F"], ["quantize", "F", "OUT", "--type", "Q8_0"], ["fit", "F"],
                                     ["check-block", "F"], ["export-ar", "F", "OUT"]],
                         ids=["info", "quantize", "fit", "check-block", "export-ar"])
def test_a_gguf_only_command_given_a_folder_says_so(mlx_base, tmp_path, command):
    """They said "no such model file" (or "no such file") for a folder that is there (gguf_header.check_gguf_file)."""
    w = Work(tmp_path, mlx_base)
    argv = [w.mlx if a == "F" else w.out if a == "OUT" else a for a in command]
    before = snapshot(tmp_path)
    assert_refused(clover(*argv), before, tmp_path, "is a folder, not a GGUF file: generate, chat and serve run")


def test_help_and_docs_say_what_runs():
    """generate, chat and serve said "a Clover GGUF" where folders run too; mlx-convert's --q-bits said 4 or 8 where
    2-6 and 8 work; docs/serve.md gave --mode's default as draft-self, the code's is auto."""
    for cmd in ("generate", "chat", "serve"):
        text = " ".join(clover(cmd, "--help").stdout.split())
        assert "a Clover GGUF file, or a model folder (an MLX folder or the checkpoint" in text, (cmd, text[:600])
    text = " ".join(clover("mlx-convert", "--help").stdout.split())
    assert "quantize to 2, 3, 4, 5, 6 or 8 bits" in text, text
    row = next(x for x in (ROOT / "docs" / "serve.md").read_text().splitlines() if x.startswith("| `--mode` |"))
    assert row.split("|")[2].strip() == "`auto`", row
    assert "(default: auto; ar for an AR-only file)" in " ".join(clover("serve", "--help").stdout.split())
