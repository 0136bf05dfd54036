"""Reading HF safetensors checkpoints without loading them: our own header parser over mmap, one tensor at a time.

safetensors layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
then the data area; offsets are relative to the data area's start.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import numpy as np

from clover_gguf.errors import UserError

# safetensors dtype -> (numpy storage dtype, element size). BF16 is kept as raw uint16 (numpy has no bfloat16).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
}

TEXT_PREFIX = "model."
MULTIMODAL_TEXT_PREFIX = "model.language_model."
DROPPED_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class TensorRef:
    """One tensor of one shard: enough to read it later through the shard's mmap."""

    name: str  # normalised HF name (see normalise_name)
    source_name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    shard: Path
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def normalise_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the text-model name `model.*` / `lm_head.*` / `mtp.*`; None = drop."""
    if name.startswith(DROPPED_PREFIXES):
        return None
    if name.startswith(MULTIMODAL_TEXT_PREFIX):
        return TEXT_PREFIX + name[len(MULTIMODAL_TEXT_PREFIX):]
    if name.startswith("model.mtp."):
        return name[len("model."):]
    return name


INDEX = "model.safetensors.index.json"


def parse_index(blob: bytes, where: str) -> dict[str, str]:
    """A safetensors index's bytes -> its weight_map (tensor name -> shard), checked: one reader for `convert`
    (a folder) and `graft` (a folder or the Hub). Valid JSON (not nested past Python's stack), an object with a
    non-empty weight_map object whose keys are strings and whose values are shard names: plain relative paths inside
    the checkpoint (not absolute, no `..`). Shards may be links (the Hugging Face cache links them to its blobs), so
    the name is checked, not where it resolves to."""
    from clover_gguf.config import parse_json

    data = parse_json(blob, where, "a safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{where} is not a valid safetensors index (no weight_map object)")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "\0" in shard:
            shown = repr(shard) if len(repr(shard)) <= 40 else repr(shard)[:37] + "..."
            raise UserError(f"{where} names a shard {shown} for {tensor}: shard names are file names")
        rel = PurePosixPath(shard)
        if rel.is_absolute() or ".." in rel.parts or Path(shard).is_absolute():
            raise UserError(f"{where} names a shard outside the checkpoint folder: {shard}")
    return weight_map


def list_shards(src: Path) -> list[Path]:
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"not a checkpoint folder: {src}")
    index = src / INDEX
    if os.path.lexists(index):
        from clover_gguf.config import read_json_bytes

        blob = read_json_bytes(index, "safetensors index")
        shards = sorted({src / f for f in parse_index(blob, str(index)).values()})
        for s in shards:
            if not s.is_file():
                what = "a folder" if s.is_dir() else "is not a regular file" if os.path.lexists(s) else "absent"
                raise UserError(f"shard {s.name} is named in {index.name} but {what}")
        return shards
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise UserError(f"no safetensors shard in {src}")
    for s in shards:
        if not s.is_file():
            raise UserError(f"{s} is not a file (a safetensors shard must be one)")
    return shards


def read_shard_header(path: Path) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """-> [(name, dtype, shape, abs_begin, abs_end)], checked against the file size: every tensor's bytes lie in
    the data area, match its shape, and no two tensors share a byte."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            def read(offset: int, n: int) -> bytes:
                f.seek(offset)
                return f.read(n)

            return parse_shard_header(path, read, size)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def parse_shard_header(path: Path, read: Callable[[int, int], bytes], size: int
                       ) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """read_shard_header over any reader: read(offset, n) -> bytes (a local file, or ranged HTTP reads)."""
    head = read(0, 8)
    if len(head) < 8:
        raise UserError(f"{path.name}: truncated safetensors file (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > 100 * 2**20:
        raise UserError(f"{path.name}: corrupt safetensors header (length {n})")
    blob = read(8, n)
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise UserError(f"{path.name}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path.name}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path.name}: corrupt safetensors entry for {name}") from None
        if not isinstance(dtype, str) or not all(_is_count(x) for x in (*shape, b, e)):
            raise UserError(f"{path.name}: corrupt safetensors entry for {name} (dtype, shape and data_offsets "
                            "must be a string and non-negative integers)")
        if b > e or base + e > size:
            raise UserError(f"{path.name}: truncated safetensors file ({name} ends past the end of the file)"
                            if b <= e else f"{path.name}: corrupt safetensors entry for {name} (offsets reversed)")
        if dtype in SAFETENSORS_DTYPES and (e - b) != math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize:
            raise UserError(f"{path.name}: corrupt safetensors entry for {name} (size does not match shape)")
        out.append((name, dtype, shape, base + b, base + e))
    spans = sorted((b, e, name) for name, _, _, b, e in out if e > b)
    for (_, e0, first), (b1, _, second) in zip(spans, spans[1:]):
        if b1 < e0:
            raise UserError(f"{path.name}: the data of {first} and {second} overlap")
    return out


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class Checkpoint:
    """All tensors of a checkpoint folder, indexed by normalised name; data is read lazily through mmap."""

    def __init__(self, src: Path):
        self.src = Path(src)
        self.shards = list_shards(self.src)
        self.tensors: dict[str, TensorRef] = {}
        self.dropped: list[str] = []
        self._maps: dict[Path, mmap.mmap] = {}
        for shard in self.shards:
            for name, dtype, shape, b, e in read_shard_header(shard):
                norm = normalise_name(name)
                if norm is None:
                    self.dropped.append(name)
                    continue
                if norm in self.tensors:
                    raise UserError(f"tensor {name} appears twice in the checkpoint")
                self.tensors[norm] = TensorRef(norm, name, dtype, shape, shard, b, e)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _map(self, shard: Path) -> mmap.mmap:
        if shard not in self._maps:
            with open(shard, "rb") as f:
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[shard]

    def raw(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The stored elements without conversion (BF16 as uint16), a zero-copy view of the mmap; `rows`: only
        those indices of the first axis."""
        ref = self.tensors[name]
        if ref.dtype not in SAFETENSORS_DTYPES:
            raise UserError(f"tensor {ref.source_name} has unsupported dtype {ref.dtype} (supported: F32, F16, BF16)")
        buf = memoryview(self._map(ref.shard))[ref.begin:ref.end]
        a = np.frombuffer(buf, dtype=SAFETENSORS_DTYPES[ref.dtype]).reshape(ref.shape)
        return a if rows is None else a[rows]

    def f32(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor (or those rows of its first axis) as float32, a new array."""
        ref = self.tensors[name]
        a = self.raw(name, rows)
        if ref.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)

    def drop_resident_pages(self) -> None:
        """Drop the mapped shard pages from this process's resident set (they stay in the page cache).

        Reading through mmap makes every touched page count as resident; without this, converting a 69 GB
        checkpoint would show a peak RSS near the file size even though only one tensor is in use at a time."""
        for m in self._maps.values():
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the map closes when it is collected
                pass
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def load_hf_tensors(src: Path) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """Every text tensor as float32 torch, experts stacked to `model.layers.i.mlp.experts.{gate,up,down}_proj`
    ([E, I, H], [E, I, H], [E, H, I]); MTP tensors are left out (decoding does not use them). For the reference
    model and tests only: this loads the whole model into memory."""
    import torch

    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    with Checkpoint(src) as ck:
        for name in ck.names():
            if name.startswith("mtp."):
                continue
            if m := EXPERT_RE.match(name):
                per_expert.setdefault((int(m[1]), m[3]), {})[int(m[2])] = ck.f32(name)
            elif m := FUSED_EXPERT_RE.match(name):
                a = ck.f32(name)
                p = f"model.layers.{m[1]}.mlp.experts."
                if m[2] == "gate_up_proj":
                    half = a.shape[1] // 2
                    out[p + "gate_proj"] = torch.from_numpy(np.ascontiguousarray(a[:, :half]))
                    out[p + "up_proj"] = torch.from_numpy(np.ascontiguousarray(a[:, half:]))
                else:
                    out[p + "down_proj"] = torch.from_numpy(a)
            else:
                out[name] = torch.from_numpy(ck.f32(name))
    for (layer, kind), experts in per_expert.items():
        n = max(experts) + 1
        if sorted(experts) != list(range(n)):
            raise UserError(f"layer {layer}: {kind}_proj experts are not numbered 0..{n - 1}")
        out[f"model.layers.{layer}.mlp.experts.{kind}_proj"] = torch.from_numpy(np.stack([experts[e] for e in range(n)]))
    return out
