"""Quantize a Clover GGUF with llama.cpp's own quantizer (llama_model_quantize in the patched library).

    quantize(IN, OUT, "Q4_K_M")          recipe rules -> tensor-type overrides, progress from llama.cpp's log
    plan("Q4_K_M", src=IN)               per-tensor types and the predicted size (llama.cpp dry run)
    plan("Q4_K_M", config=config.json)   the same on a header-only skeleton of the model (no weights needed)
    imatrix(MODEL, TEXT, OUT)            the patched llama-imatrix, for IQ types and importance-weighted K-quants

Every per-tensor decision is llama.cpp's: we only pass the recipe's overrides and read back what its log says.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from clover_gguf.build import llama_tool
from clover_gguf.errors import UserError
from clover_gguf.fsutil import atomic_output, check_free_disk, check_output, temp_dir
from clover_gguf.gguf_header import (GGUF_MAGIC, GGUFHeader, check_model, read_header,  # noqa: F401 - re-exported
                                     tensor_bytes)
from clover_gguf.offload import Offload, no_offload_notice
from clover_gguf.metadata import ARCH
from clover_gguf.metadata import QUANT_RECIPE as RECIPE_KEY
from clover_gguf.recipes import FTYPES, NEEDS_IMATRIX, Recipe, check_rules, recipe_for

# sizes of the published files of Clover-35B-A3B-Preview, GiB (docs/quantization.md)
OFFICIAL_GIB = {"Q4_0": 18.24, "Q4_K_M": 21.42, "Q8_0": 35.26}
COMMUNITY_GIB = {"Q3_K_S": 14.14, "Q3_K_M": 15.62, "IQ4_XS": 17.64, "Q4_K_M": 19.72, "Q6_K": 26.56, "Q8_0": 34.37}
UNQUANTIZED = {QT.F32, QT.F16, QT.BF16}


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# ---- the input file ----------------------------------------------------------------------------------------------
def _added_kv_bytes(h: GGUFHeader, kvs: list[tuple[str, str | int]]) -> int:
    """Header bytes llama.cpp adds: general.quantization_version, general.file_type and our overrides (INT -> u32)."""
    added = [("general.quantization_version", 0), ("general.file_type", 0), *kvs]
    n = 0
    for key, val in added:
        if key in h.keys:
            continue
        n += 8 + len(key.encode()) + 4 + (4 if isinstance(val, int) else 8 + len(str(val).encode()[:127]))
    return n


def check_clover(h: GGUFHeader) -> None:
    if h.arch != ARCH:
        raise UserError(f"{h.path} is not a Clover GGUF (general.architecture = {h.arch!r}); "
                        "convert the checkpoint with `clover-gguf convert` first")


# ---- the plan --------------------------------------------------------------------------------------------------
@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order
    src_type: QT
    type: QT
    bytes: int
    wanted: QT | None = None  # the type llama.cpp chose before falling back to `type` (None: no fallback)


# what a K-quant's fallback type costs, and why it happens: llama.cpp quantizes a row in blocks, and a row whose length
# is not a multiple of the type's block (256 values for the K-quants) takes the fallback type (llama-quant.cpp,
# tensor_type_fallback: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, IQ4_XS and the IQ types -> IQ4_NL)


@dataclass
class QuantPlan:
    ftype: str
    recipe: Recipe
    tensors: list[TensorPlan]
    header_bytes: int  # metadata + tensor infos of the output (the input's plus the keys llama.cpp adds)
    alignment: int
    notes: list[str] = field(default_factory=list)
    source: str = ""
    shape_35b: bool = False  # the model has the 35B's tensor shapes: compare with the published files' sizes

    @property
    def size_bytes(self) -> int:
        return _pad(self.header_bytes, self.alignment) + sum(_pad(t.bytes, self.alignment) for t in self.tensors)

    @property
    def size_gib(self) -> float:
        return self.size_bytes / 2**30

    def by_type(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for t in self.tensors:
            n, b = out.get(t.type.name, (0, 0))
            out[t.type.name] = (n + 1, b + t.bytes)
        return out

    def fallbacks(self) -> list[str]:
        """One line per (wanted, fallback) pair: how many tensors llama.cpp could not give the type it chose, what
        they got, and why (their row lengths against the type's block)."""
        groups: dict[tuple[QT, QT], list[TensorPlan]] = {}
        for t in self.tensors:
            if t.wanted is not None and t.wanted != t.type:
                groups.setdefault((t.wanted, t.type), []).append(t)
        lines = []
        for (wanted, got), ts in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            rows = sorted({t.shape[-1] for t in ts})
            block = _block_size(wanted)
            lengths = " or ".join(str(r) for r in rows) if len(rows) <= 3 else f"{rows[0]} to {rows[-1]}"
            lines.append(f"{len(ts)} tensor{'s' if len(ts) != 1 else ''} at {got.name} instead of {wanted.name}: "
                         f"rows of {lengths} values are not a multiple of {block} ({wanted.name}'s block)")
        return lines

    def to_json(self) -> dict:
        return {"type": self.ftype, "recipe": self.recipe.name, "recipe_file": self.recipe.source,
                "source": self.source, "size_bytes": self.size_bytes, "size_gib": round(self.size_gib, 4),
                "official_gib": OFFICIAL_GIB.get(self.ftype) if self.shape_35b else None,
                "community_gib": COMMUNITY_GIB.get(self.ftype) if self.shape_35b else None,
                "notes": self.notes, "fallbacks": self.fallbacks(),
                "tensors": [{"name": t.name, "type": t.type.name, "bytes": t.bytes, "shape": list(t.shape),
                             "src_type": t.src_type.name, **({"wanted": t.wanted.name} if t.wanted else {})}
                            for t in self.tensors]}

    def format(self, verbose: bool = False) -> str:
        """The summary (tensors and GiB by type, the predicted size, fallbacks, notes); verbose: then one line per
        tensor (the 35B has some 860: --json has them too)."""
        lines = []
        for name, (n, b) in sorted(self.by_type().items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {name:<7} {n:5d} tensors {b / 2**30:9.3f} GiB")
        lines.append(f"{self.ftype} ({self.recipe.name}): {self.size_bytes} bytes = {self.size_gib:.3f} GiB predicted")
        if self.shape_35b and self.ftype in COMMUNITY_GIB:
            c = COMMUNITY_GIB[self.ftype]
            lines.append(f"  community {self.ftype} of Clover-35B-A3B: {c:.2f} GiB "
                         f"(ours {100 * (self.size_gib / c - 1):+.2f}%)")
        if self.shape_35b and self.ftype in OFFICIAL_GIB:
            o = OFFICIAL_GIB[self.ftype]
            lines.append(f"  official  {self.ftype} of Clover-35B-A3B: {o:.2f} GiB "
                         f"(ours {100 * (self.size_gib / o - 1):+.2f}%)")
        lines += [f"fallback: {f}" for f in self.fallbacks()]
        lines += [f"note: {n}" for n in self.notes]
        if verbose:
            lines += ["", f"{'tensor':<44} {'src':<6} {'type':<7} {'shape':<22} {'MiB':>10}"]
            lines += [f"{t.name:<44} {t.src_type.name:<6} {t.type.name:<7} {str(list(t.shape)):<22} "
                      f"{t.bytes / 2**20:10.3f}" for t in self.tensors]
        else:
            lines.append(f"({len(self.tensors)} tensors: --verbose lists each, --json too)")
        return "\n".join(lines)


def _block_size(qt: QT) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qt][0]


# ---- llama.cpp's log ------------------------------------------------------------------------------------------
HEAD_RE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+-\s+\[[^\]]*\],\s+type\s*=\s*(\w+),")
CONVERT_RE = re.compile(r"converting to (\w+)")
SIZE_RE = re.compile(r"size\s*=\s*([\d.]+) MiB(?:\s*->\s*([\d.]+) MiB)?(?:\s*\((\w+)\))?")
FAIL_RE = re.compile(r"failed to quantize: (.*)")
# llama-quant.cpp's tensor_type_fallback: "warning: NAME - ncols N not divisible by B (required for type T) [(WARNING:
# must use F16 due to unusual shape) ]-> falling back to F"
FALLBACK_RE = re.compile(r"warning:\s+(\S+)\s+-\s+ncols\s+\d+\s+not divisible by\s+\d+\s+\(required for type\s+(\w+)\)"
                         r".*->\s*falling back to\s+(\w+)")


def _qt(ggml_name: str) -> QT:
    return QT[ggml_name.upper()]


class LogParser:
    """Reassembles llama.cpp's log into lines and turns the per-tensor lines into (name, target type) events."""

    def __init__(self, on_tensor: Callable[[str, QT | None], None], echo: bool = False):
        self.buf = ""
        self.on_tensor = on_tensor
        self.echo = echo
        self.current: str | None = None
        self.target: QT | None = None
        self.lines: list[str] = []  # warnings and errors, for error messages
        self.failure: str | None = None
        self.fallbacks: dict[str, str] = {}  # tensor -> the type llama.cpp chose before falling back

    def feed(self, level: int, text: str) -> None:
        if self.echo:
            sys.stderr.write(text)
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self._line(line, level)

    def _line(self, line: str, level: int) -> None:
        if m := FALLBACK_RE.search(line):
            self.fallbacks[m[1]] = _qt(m[2]).name
        if m := HEAD_RE.search(line):
            self.current, self.target = m[3], None
            line = line[m.end():]
        if self.current is not None:
            if m := CONVERT_RE.search(line):
                self.target = _qt(m[1])
            if m := SIZE_RE.search(line):
                target = _qt(m[3]) if m[3] else self.target
                name, self.current, self.target = self.current, None, None
                self.on_tensor(name, target)
                return
        if m := FAIL_RE.search(line):
            self.failure = m[1].strip()
        if line.strip() and level >= 3:  # warnings, errors
            self.lines.append(line.strip())


@dataclass
class _Run:
    types: dict[str, QT | None]  # name -> target type reported by llama.cpp (None: kept)
    log: LogParser
    kvs: list[tuple[str, str | int]]
    fallbacks: dict[str, str] = field(default_factory=dict)  # name -> the type llama.cpp wanted (LogParser)


def _binding() -> Any:
    from clover_gguf.llama_context import load_binding

    L = load_binding()
    for name, value in FTYPES.items():
        const = "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}"
        if getattr(L, const, value) != value:
            raise UserError(f"the llama-cpp-python binding's {const} is {getattr(L, const)}, expected {value}")
    return L


def load_imatrix(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An imatrix GGUF (llama-imatrix) -> ({tensor name: mean squared activation per column [and expert]}, meta).

    Same normalisation as llama.cpp's tools/quantize: in_sum2 / counts per expert; an expert never hit gets ones."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such imatrix file: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UserError(f"{path} is not an imatrix GGUF (make one with `clover-gguf imatrix`)")
    read_header(path)  # a truncated or damaged file fails here, as one line
    try:
        r = GGUFReader(path)
        keys = {k: r.fields[k].contents() for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
                if k in r.fields}
        tensors = [(t.name, np.asarray(t.data, dtype=np.float32).reshape(-1)) for t in r.tensors]
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:
        raise UserError(f"{path}: damaged imatrix file ({e})") from None
    if len(keys) < 3:
        raise UserError(f"{path}: missing imatrix metadata (imatrix.datasets / chunk_count / chunk_size)")
    sums, counts = {}, {}
    for name, data in tensors:
        if name.endswith(".in_sum2"):
            sums[name[:-len(".in_sum2")]] = data
        elif name.endswith(".counts"):
            counts[name[:-len(".counts")]] = data
    if not sums:
        raise UserError(f"{path}: no imatrix entries")
    out = {}
    for name, s in sums.items():
        if name not in counts:
            raise UserError(f"{path}: {name} has sums but no counts")
        c = np.rint(counts[name]).astype(np.float32)
        if len(c) == 0 or s.size % len(c) or not np.isfinite(s).all() or (c < 0).any():
            raise UserError(f"{path}: {name} has {s.size} sums for {len(c)} expert count(s): not an imatrix entry")
        per = s.reshape(len(c), -1)
        e = np.where(c[:, None] > 0, per / np.maximum(c, 1)[:, None], np.float32(1.0)).astype(np.float32)
        out[name] = np.ascontiguousarray(e.reshape(-1))
    return out, keys


def _run_llama(src: Path, dst: Path | None, recipe: Recipe, names: list[str], dry_run: bool, threads: int | None,
               imatrix: tuple[dict[str, np.ndarray], dict[str, Any], Path] | None,
               on_tensor: Callable[[str, QT | None], None] = lambda n, t: None, echo: bool = False) -> _Run:
    L = _binding()
    from clover_gguf.llama_context import _quiet_log

    L.llama_backend_init()
    p = L.llama_model_quantize_default_params()
    p.ftype = FTYPES[recipe.ftype]
    p.nthread = int(threads or 0)
    p.dry_run = dry_run
    keep: list[Any] = []  # every buffer llama.cpp reads through a pointer, alive until the call returns

    overrides = recipe.overrides(names)
    tt = (L.llama_model_tensor_override * (len(overrides) + 1))()
    for i, (pattern, qtype) in enumerate(overrides):
        b = ctypes.c_char_p(pattern.encode())
        keep.append(b)
        tt[i].pattern, tt[i].type = b.value, int(qtype)
    tt[len(overrides)].pattern, tt[len(overrides)].type = None, 0
    p.tt_overrides = ctypes.cast(tt, ctypes.POINTER(L.llama_model_tensor_override))

    kvs: list[tuple[str, str | int]] = [(RECIPE_KEY, recipe.stamp())]
    if imatrix is not None:
        data, meta, ipath = imatrix
        arr = (L.llama_model_imatrix_data * (len(data) + 1))()
        for i, (name, values) in enumerate(data.items()):
            arr[i].name = name.encode()
            arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = values.size
        arr[len(data)].name = None
        keep += [arr, data]
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(L.llama_model_imatrix_data))
        kvs += [("quantize.imatrix.file", str(ipath)[-127:]), ("quantize.imatrix.entries_count", len(data)),
                ("quantize.imatrix.chunks_count", int(meta["imatrix.chunk_count"]))]
        ds = meta.get("imatrix.datasets") or []
        if ds:
            kvs.append(("quantize.imatrix.dataset", str(ds[0])[:127]))
    kv = (L.llama_model_kv_override * (len(kvs) + 1))()
    for i, (key, val) in enumerate(kvs):
        kv[i].key = key.encode()
        if isinstance(val, int):
            kv[i].tag, kv[i].value.val_i64 = L.LLAMA_KV_OVERRIDE_TYPE_INT, val
        else:
            kv[i].tag, kv[i].value.val_str = L.LLAMA_KV_OVERRIDE_TYPE_STR, val.encode()[:127]
    kv[len(kvs)].key = b""
    p.kv_overrides = ctypes.cast(kv, ctypes.POINTER(L.llama_model_kv_override))
    keep += [tt, kv]

    types: dict[str, QT | None] = {}

    def tensor_done(name: str, target: QT | None) -> None:
        types[name] = target
        on_tensor(name, target)

    parser = LogParser(tensor_done, echo=echo)

    def cb(level, text, user_data):
        try:
            parser.feed(int(level), text.decode("utf-8", "replace"))
        except Exception as e:  # noqa: BLE001 - never let an exception cross into C
            parser.lines.append(f"log parser: {e}")

    callback = L.llama_log_callback(cb)
    L.llama_log_set(callback, ctypes.c_void_p())
    try:
        out = str(dst) if dst is not None else os.devnull
        rc = L.llama_model_quantize(str(src).encode(), out.encode(), ctypes.byref(p))
    finally:
        L.llama_log_set(_quiet_log(L), ctypes.c_void_p())
    if rc != 0:
        why = parser.failure or (parser.lines[-1] if parser.lines else "unknown error")
        raise UserError(f"llama.cpp could not quantize {src}" + (f" to {dst.name}" if dst else "") + f": {why}")
    return _Run(types, parser, kvs, parser.fallbacks)


def _make_plan(h: GGUFHeader, recipe: Recipe, run: _Run, source: str) -> QuantPlan:
    missing = [n for n in h.names if n not in run.types]
    if missing:
        raise RuntimeError(f"llama.cpp's log did not report {len(missing)} tensor(s), e.g. {missing[0]}")
    tensors = []
    for name, (shape, src_type) in h.tensors.items():
        target = run.types[name]
        qt = src_type if target is None else target  # not `or`: QT.F32 is 0, and a conversion to F32 is one
        wanted = QT[run.fallbacks[name]] if name in run.fallbacks else None
        tensors.append(TensorPlan(name, shape, src_type, qt, tensor_bytes(qt, shape), wanted))
    notes = []
    # a rule llama.cpp did not apply (a tensor it never quantizes, kept in its source type) is worth saying: one line
    # per rule and outcome, with the count (a fallback is said by QuantPlan.fallbacks, with its reason)
    claimed: set[str] = set()
    missed: dict[tuple[str, QT, QT, bool], list[str]] = {}
    for pattern, qtype in recipe.overrides(h.names):
        rx = re.compile(pattern)
        for t in tensors:
            if t.name in claimed or not rx.search(t.name):
                continue
            claimed.add(t.name)
            if t.type != qtype and t.wanted is None:
                missed.setdefault((pattern, qtype, t.type, t.type == t.src_type), []).append(t.name)
    for (pattern, qtype, got, kept), names in missed.items():
        n, them = len(names), "them" if len(names) != 1 else "it"
        how = (f"kept at {got.name} as in the input (llama.cpp never quantizes {them})" if kept
               else f"made {got.name} by llama.cpp")
        notes.append(f"rule {pattern!r} -> {qtype.name}: {n} tensor{'s' if n != 1 else ''} {how}: {names[0]}"
                     + (f" and {n - 1} more" if n > 1 else ""))
    # the input's header as it is (not padded: llama.cpp pads once, after the keys it adds)
    header = h.header_bytes + _added_kv_bytes(h, run.kvs) - _trailing_dim_bytes(h)
    return QuantPlan(recipe.ftype, recipe, tensors, header, h.alignment, _dedupe(notes), source)


def _trailing_dim_bytes(h: GGUFHeader) -> int:
    """llama.cpp writes a tensor's dimensions up to its last one above 1 (ggml_n_dims): a [1, H] tensor as the
    input stores it (ffn_gate_inp_shexp, as upstream's converter writes it) loses 8 bytes of header in the output."""
    n = 0
    for shape, _ in h.tensors.values():  # numpy order: ggml's trailing dimensions come first
        lead = next((i for i, d in enumerate(shape) if d != 1), len(shape) - 1)
        n += 8 * min(lead, len(shape) - 1)
    return n


def _dedupe(notes: list[str], limit: int = 12) -> list[str]:
    if len(notes) <= limit:
        return notes
    return notes[:limit] + [f"... and {len(notes) - limit} more such notes"]


def _check_source_types(h: GGUFHeader) -> None:
    quantized = sorted({qt.name for _, qt in h.tensors.values() if qt not in UNQUANTIZED})
    if quantized:
        raise UserError(f"{h.path} is already quantized ({', '.join(quantized)} tensors): quantize from an F32, F16 "
                        "or BF16 GGUF (`clover-gguf convert --outtype bf16`)")


def _prepare(src: Path, type_name: str, recipe_file: Path | None) -> tuple[GGUFHeader, Recipe]:
    recipe = recipe_for(type_name, recipe_file)
    h = read_header(src)
    check_clover(h)
    check_model(h)
    check_rules(recipe, h.names)
    return h, recipe


@functools.lru_cache(maxsize=1)
def _shapes_35b() -> dict[str, tuple[int, ...]]:
    """Every tensor of the 35B (config.SHAPE_35B) with its GGUF shape, as the converter plans it."""
    from clover_gguf.config import SHAPE_35B, CloverConfig
    from clover_gguf.convert import plan_conversion
    from clover_gguf.skeleton import VirtualCheckpoint

    cfg = CloverConfig.from_file(SHAPE_35B)
    return {t.name: t.shape for t in plan_conversion(VirtualCheckpoint(cfg), cfg).tensors}


def has_35b_shape(h: GGUFHeader) -> bool:
    """The file holds every tensor of the 35B with its shape (an MTP block may come on top): only then are the
    published files' sizes a comparison."""
    return all(n in h.tensors and h.tensors[n][0] == shape for n, shape in _shapes_35b().items())


def _library_for_plan() -> None:
    try:
        _binding()
    except UserError as e:
        raise UserError(f"--plan runs llama.cpp's own quantizer (a dry run), so it needs the patched llama.cpp: {e}"
                        ) from None


# ---- public functions ------------------------------------------------------------------------------------------
def plan(type_name: str, src: Path | None = None, config: Path | None = None, recipe_file: Path | None = None,
         imatrix: Path | None = None) -> QuantPlan:
    """The per-tensor types and predicted size of quantizing `src` (a GGUF) or, from `config` alone, a model of
    that shape (BF16 weights, as `clover-gguf convert` writes them), without quantizing anything."""
    if (src is None) == (config is None):
        raise UserError("give either a GGUF file or --config config.json")
    if src is not None:
        h, recipe = _prepare(Path(src), type_name, recipe_file)
        im = _imatrix_arg(imatrix)
        _library_for_plan()
        run = _run_llama(Path(src), None, recipe, h.names, True, None, im)
        qp = _make_plan(h, recipe, run, str(src))
        qp.shape_35b = has_35b_shape(h)
        return qp
    from clover_gguf.skeleton import write_skeleton

    recipe_for(type_name, recipe_file)  # a bad --type or recipe is named before anything else
    _library_for_plan()
    with temp_dir("clover-skeleton-") as tmp:  # removed on TERM and HUP too
        path = tmp / "skeleton.gguf"
        write_skeleton(Path(config), path)
        h, recipe = _prepare(path, type_name, recipe_file)
        run = _run_llama(path, None, recipe, h.names, True, None, _imatrix_arg(imatrix))
        qp = _make_plan(h, recipe, run, f"{config} (header-only skeleton, BF16 weights)")
        qp.shape_35b = has_35b_shape(h)
    qp.notes.append("planned from config.json: tokenizer metadata (a few MB) is not counted")
    return qp


def _imatrix_arg(imatrix: Path | None):
    if imatrix is None:
        return None
    data, meta = load_imatrix(Path(imatrix))
    return data, meta, Path(imatrix)


@dataclass
class QuantizeResult:
    out: Path
    plan: QuantPlan
    size_bytes: int
    seconds: float

    def summary(self) -> str:
        """What `quantize` prints: the file, its types by tensor count, and each fallback with its reason (a model
        whose widths are not multiples of 256 holds no K-quant: the name of the mixture alone would not say so)."""
        by_type = sorted(self.plan.by_type().items(), key=lambda kv: -kv[1][0])
        lines = [f"wrote {self.out}: {self.plan.ftype} ({self.plan.recipe.name}), {self.size_bytes / 2**30:.3f} GiB in "
                 f"{self.seconds:.1f} s; tensors: " + ", ".join(f"{n} {name}" for name, (n, _) in by_type)]
        lines += [f"fallback: {f}" for f in self.plan.fallbacks()]
        return "\n".join(lines)


def quantize(src: Path, out: Path, type_name: str, recipe_file: Path | None = None, imatrix: Path | None = None,
             threads: int | None = None, force: bool = False, quiet: bool = False,
             log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> QuantizeResult:
    """Quantize the Clover GGUF `src` to `out` with llama.cpp; the file appears whole or not at all."""
    import time

    from tqdm import tqdm

    from clover_gguf.offload import check_threads

    check_threads(threads)
    src, out = Path(src), Path(out)
    h, recipe = _prepare(src, type_name, recipe_file)
    _check_source_types(h)
    if recipe.ftype in NEEDS_IMATRIX and imatrix is None:
        raise UserError(f"{recipe.ftype} needs an importance matrix: make one with `clover-gguf imatrix` "
                        "and pass --imatrix FILE")
    check_output(out, [p for p in (src, imatrix, recipe_file) if p is not None], force=force)
    src_bytes = sum(tensor_bytes(qt, shape) for shape, qt in h.tensors.values())
    check_free_disk(out, src_bytes // 2 + h.data_offset)
    im = _imatrix_arg(imatrix)  # checked here, loaded again by the worker
    if im is not None and not quiet:
        log(f"imatrix: {len(im[0])} entries from {imatrix}")
    t0 = time.perf_counter()
    with tqdm(total=src_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"quantize {recipe.ftype}",
              disable=quiet, dynamic_ncols=True) as bar:
        def advance(name: str, target: QT | None) -> None:
            shape, qt = h.tensors.get(name, ((0,), QT.F32))
            bar.update(tensor_bytes(qt, shape))
            bar.set_postfix_str(name, refresh=False)

        with atomic_output(out) as tmp:
            spec = {"src": str(src), "dst": str(tmp), "out": out.name, "type": type_name, "threads": threads,
                    "recipe": None if recipe_file is None else str(recipe_file),
                    "imatrix": None if imatrix is None else str(imatrix),
                    "echo": bool(os.environ.get("CLOVER_GGUF_LLAMA_LOG"))}
            run = _run_in_worker(spec, advance)
    seconds = time.perf_counter() - t0
    qp = _make_plan(h, recipe, run, str(src))
    return QuantizeResult(out, qp, out.stat().st_size, seconds)


# ---- the quantizer in a process of its own ------------------------------------------------------------------------
# llama_model_quantize cannot be stopped once called, and Python runs signal handlers only between its log
# callbacks (where an exception cannot cross into C). So the real quantization runs in a child process: Ctrl-C,
# SIGTERM or SIGHUP reach this process at once, which kills the child and removes the temporary output; and an
# abort inside llama.cpp ends the child, not the command, and is reported as one line.
def _run_in_worker(spec: dict[str, Any], on_tensor: Callable[[str, QT | None], None]) -> _Run:
    package_parent = str(Path(__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {package_parent!r}); from clover_gguf.quantize import _worker; _worker()"
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=None if spec["echo"] else err, text=True, errors="replace")
        done: dict[str, Any] | None = None
        failure: str | None = None
        try:
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:  # something in the library printed to stdout: not ours
                    continue
                if not isinstance(msg, dict):
                    continue
                if "tensor" in msg:
                    on_tensor(msg["tensor"], None if msg["type"] is None else QT[msg["type"]])
                elif "error" in msg:
                    failure = msg["error"]
                elif "done" in msg:
                    done = msg["done"]
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: the child must not go on writing
                proc.kill()
                proc.wait()
            proc.stdin.close()
        if failure is not None:
            raise UserError(failure)
        if proc.returncode == -signal.SIGINT:
            # a terminal's Ctrl-C reaches the whole process group: the child may die of it before this process
            # takes its own KeyboardInterrupt; either way it is the user's interruption, not a llama.cpp failure
            raise KeyboardInterrupt
        if done is None or proc.returncode != 0:
            err.seek(0)
            tail = [ln.strip() for ln in err.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit code {proc.returncode}")
            raise UserError(f"llama.cpp stopped while quantizing {spec['src']} ({how})"
                            + (f": {tail[-1]}" if tail else ""))
    types = {n: None if t is None else QT[t] for n, t in done["types"].items()}
    return _Run(types, LogParser(lambda n, t: None), [tuple(kv) for kv in done["kvs"]], done.get("fallbacks", {}))


def _worker() -> None:
    """The child's side of _run_in_worker: one JSON spec on stdin, one JSON line per event on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a terminal's Ctrl-C ends the child at once
    spec = json.loads(sys.stdin.readline())

    def orphaned() -> None:  # the parent is gone (even by SIGKILL): stop writing
        sys.stdin.read()
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    src, dst = Path(spec["src"]), Path(spec["dst"])
    try:
        recipe = recipe_for(spec["type"], None if spec["recipe"] is None else Path(spec["recipe"]))
        run = _run_llama(src, dst, recipe, read_header(src).names, False, spec["threads"],
                         _imatrix_arg(None if spec["imatrix"] is None else Path(spec["imatrix"])),
                         lambda n, t: emit({"tensor": n, "type": None if t is None else t.name}), echo=spec["echo"])
    except UserError as e:
        emit({"error": str(e).replace(dst.name, spec["out"])})
        return
    emit({"done": {"types": {n: None if t is None else t.name for n, t in run.types.items()},
                   "kvs": [list(kv) for kv in run.kvs], "fallbacks": run.fallbacks}})


# ---- imatrix ---------------------------------------------------------------------------------------------------
def count_tokens(model: Path, text: bytes) -> int:
    """Tokens of `text` as llama-imatrix counts them (special tokens added, none parsed), from the vocabulary
    alone (no weights are loaded)."""
    from clover_gguf.llama_context import _quiet_log

    L = _binding()
    L.llama_backend_init()
    L.llama_log_set(_quiet_log(L), ctypes.c_void_p())
    params = L.llama_model_default_params()
    params.vocab_only = True
    m = L.llama_model_load_from_file(str(model).encode(), params)
    if not m:
        raise UserError(f"llama.cpp could not load the vocabulary of {model}")
    try:
        n = L.llama_tokenize(L.llama_model_get_vocab(m), text, len(text), None, 0, True, False)
    finally:
        L.llama_model_free(m)
    return abs(n)  # with no room for tokens it returns minus their count


# llama-imatrix's own words for why it stopped (its LOG_ERR lines), most telling first
IMATRIX_REASON_RE = re.compile(r"(you need at least \d+ tokens.*|the data file you provided tokenizes to only.*"
                               r"|there will be not enough tokens.*|failed to .*|error: .*)", re.IGNORECASE)


def imatrix_failure(output: str) -> str:
    """The reason llama-imatrix gives when it fails, from its log: its error lines joined, else the last line."""
    reasons = []
    for line in output.splitlines():
        if m := IMATRIX_REASON_RE.search(line):
            reasons.append(m[1].strip().rstrip("."))
    if reasons:
        return "; ".join(dict.fromkeys(reasons))
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def imatrix(model: Path, text: Path, out: Path, ctx: int = 512, chunks: int | None = None, force: bool = False,
            quiet: bool = False, offload: Offload | None = None, verbose: bool = False) -> Path:
    """Importance matrix of `model` over the text file `text`, written by the patched llama-imatrix as GGUF, with
    the offload options passed on as llama.cpp spells them; a progress bar over its chunks (verbose: its log)."""
    model, text, out = Path(model), Path(text), Path(out)
    h = read_header(model)
    check_clover(h)
    check_model(h)
    if not text.is_file():
        raise UserError(f"no such text file: {text}")
    check_output(out, [model, text], force=force)
    if ctx < 1:
        raise UserError(f"--ctx must be at least 1, not {ctx}")
    tool = llama_tool("llama-imatrix")
    offload = offload or Offload()
    offload.cpu_moe_layers(int(h.kv.get(f"{h.arch}.block_count", 0)))  # --n-cpu-moe above the layer count: exit 2
    gpu_offload = bool(_binding().llama_supports_gpu_offload())
    if not gpu_offload:
        no_offload_notice(offload)
    # llama-imatrix's own check, made here: it logs its reason asynchronously and often exits before the line is
    # written (llama.cpp issue 22142), which left only an unrelated last line to report
    prompt = text.read_bytes()
    n_tokens = count_tokens(model, prompt[:-1] if prompt.endswith(b"\n") else prompt)  # -f drops one final \n
    if n_tokens < 2 * ctx:
        raise UserError(f"llama-imatrix needs at least {2 * ctx} tokens for a context of {ctx} tokens; {text} "
                        f"tokenizes to only {n_tokens} tokens (give more text or a smaller --ctx)")
    n_chunks = n_tokens // ctx if not chunks else min(chunks, n_tokens // ctx)  # llama-imatrix's own count
    with atomic_output(out) as tmp:
        # not --no-ppl: the perplexity it then prints per chunk ("[3]12.34,") is its only per-chunk line, the
        # progress shown here; it reads logits llama-imatrix computes anyway (the imatrix is the same)
        cmd = [str(tool), "-m", str(model), "-f", str(text), "-o", str(tmp), "--output-format", "gguf",
               "-c", str(ctx), *offload.llama_args(gpu_offload)]
        if chunks:
            cmd += ["--chunks", str(chunks)]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(tool.parent), env.get("LD_LIBRARY_PATH")]))
        returncode, log = _run_imatrix(cmd, env, n_chunks, quiet=quiet, verbose=verbose)
        if returncode != 0 or not tmp.is_file():
            raise UserError(f"llama-imatrix failed on {model}: {imatrix_failure(log)}")
    return out


CHUNK_DONE_RE = re.compile(rb"\[(\d+)\][^\s,\[\]]*,")  # llama-imatrix's "[chunk]perplexity," after each chunk


def _run_imatrix(cmd: list[str], env: dict, n_chunks: int, quiet: bool, verbose: bool) -> tuple[int, str]:
    """Run llama-imatrix: a progress bar over its chunks (as every other command shows progress), its log echoed
    only when verbose -> (exit code, the whole log, for the reason of a failure)."""
    from tqdm import tqdm

    log = bytearray()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with tqdm(total=n_chunks, unit="chunk", desc="imatrix", disable=quiet or verbose, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            while piece := proc.stdout.read1(65536):
                log += piece
                if verbose:
                    sys.stderr.write(piece.decode("utf-8", "replace"))
                    sys.stderr.flush()
                done = max((int(m[1]) for m in CHUNK_DONE_RE.finditer(log[-4096 - len(piece):])), default=bar.n)
                bar.update(max(0, min(done, n_chunks) - bar.n))
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: llama-imatrix must not go on writing
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return proc.returncode, log.decode("utf-8", "replace")
