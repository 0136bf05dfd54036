"""`clover-gguf export-ar`: a Clover GGUF -> llama.cpp's `qwen35moe`, which stock llama.cpp and the apps built on it
(Ollama, LM Studio) run for AR decoding.

The Clover extras (block-mode tensors) and Clover's own `clover.*` keys are left out, the hyperparameters qwen35moe
reads are renamed `qwen35moe.*` (convert.QWEN35MOE_HPARAMS), every other key is copied with its type, and every
kept tensor is copied byte for byte: a quantized file stays exactly as quantized. One tensor in memory at a time;
the output appears whole or not at all. `clover-gguf convert --arch qwen35moe` writes the same file from a checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from clover_gguf.convert import AR_ARCH, ARCH, QWEN35MOE_HPARAMS
from clover_gguf.errors import UserError
from clover_gguf.fsutil import atomic_output, check_free_disk, check_output, check_writable_dir
from clover_gguf.gguf_header import GGUFHeader, read_header, tensor_bytes
from clover_gguf.tensor_map import CLOVER_EXTRA_RE

REPEAT_PENALTY_KEY = "general.sampling.penalty_repeat"


def ar_key(key: str) -> str | None:
    """The name a clover file's key has in the qwen35moe file; None for Clover's own keys (left out)."""
    if not key.startswith(ARCH + "."):
        return key
    rest = key[len(ARCH) + 1:]
    return f"{AR_ARCH}.{rest}" if rest in QWEN35MOE_HPARAMS else None


def _stored(value: Any, vtype: int) -> Any:
    """A value as read_header(full=True) gives it -> what GGUFWriter writes back unchanged (strings as bytes)."""
    if vtype == GGUFValueType.STRING:
        return value.encode("utf-8", "surrogateescape")
    if vtype == GGUFValueType.ARRAY and value and isinstance(value[0], str):
        return [v.encode("utf-8", "surrogateescape") for v in value]
    return value


@dataclass
class ExportResult:
    out: Path
    n_tensors: int
    dropped_tensors: list[str]
    dropped_keys: list[str]
    size_bytes: int


def export_ar(src: Path, out: Path, force: bool = False, quiet: bool = False,
              log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> ExportResult:
    from tqdm import tqdm

    from clover_gguf.quantize import check_clover

    src, out = Path(src), Path(out)
    try:
        h = read_header(src, full=True)
    except UserError as e:
        raise UserError(f"{src} is not a readable GGUF file ({e})") from None
    if h.arch == AR_ARCH:
        raise UserError(f"{src} is already a {AR_ARCH} GGUF: export-ar takes a clover GGUF")
    check_clover(h)
    check_output(out, [src], force=force)
    kept = [n for n in h.tensors if not CLOVER_EXTRA_RE.match(n)]
    dropped_tensors = [n for n in h.tensors if CLOVER_EXTRA_RE.match(n)]
    nbytes = {n: tensor_bytes(h.tensors[n][1], h.tensors[n][0]) for n in kept}
    check_writable_dir(out)
    check_free_disk(out, sum(nbytes.values()) + h.data_offset)

    w = GGUFWriter(path=None, arch=AR_ARCH)
    dropped_keys = _write_kv(w, h)
    for n in kept:
        shape, qt = h.tensors[n]
        block, size = GGML_QUANT_SIZES[qt]
        w.add_tensor_info(n, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes[n], raw_dtype=qt)
    if not quiet and dropped_tensors:
        log(f"left out {len(dropped_tensors)} block-mode tensor(s) and {len(dropped_keys)} clover key(s)")
    with atomic_output(out) as tmp, open(src, "rb") as f:
        try:
            w.open_output_file(tmp)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            with tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, unit_divisor=1024, desc="export-ar",
                      disable=quiet, dynamic_ncols=True) as bar:
                for n in kept:
                    f.seek(h.data_offset + h.offsets[n])
                    data = np.fromfile(f, dtype=np.uint8, count=nbytes[n])
                    if data.size != nbytes[n]:
                        raise UserError(f"{src} is truncated: tensor {n} ends past the end of the file")
                    w.write_tensor_data(data)
                    bar.update(nbytes[n])
                    del data
        finally:
            w.close()
    return ExportResult(out, len(kept), dropped_tensors, dropped_keys, out.stat().st_size)


def _write_kv(w: GGUFWriter, h: GGUFHeader) -> list[str]:
    """Copy the keys qwen35moe keeps (renamed where they are hyperparameters); -> the keys left out."""
    dropped = []
    w.data_alignment = h.alignment
    for key, value in h.kv.items():
        name = ar_key(key)
        if name is None:
            dropped.append(key)
            continue
        if key == "general.architecture":  # the writer wrote it
            continue
        vtype, sub = h.types[key]
        w.add_key_value(name, _stored(value, vtype), GGUFValueType(vtype),
                        None if sub is None else GGUFValueType(sub))
    # files converted before the sampling key existed: the card's repetition penalty from Clover's own key
    card = h.kv.get(f"{ARCH}.generation.repetition_penalty")
    if REPEAT_PENALTY_KEY not in h.kv and card is not None:
        w.add_sampling_penalty_repeat(float(card))
    return dropped
