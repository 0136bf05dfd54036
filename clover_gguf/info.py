"""`clover-gguf info`: what a GGUF file holds and which Clover features it supports."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from clover_gguf.errors import UserError
from clover_gguf.metadata import (ARCH, BLOCK_MODE, BLOCK_READING, BLOCK_READING_VERIFIED, CORESET_ENABLED,
                                  DIFFUSION_PREFIX)
from clover_gguf.tensor_map import CLOVER_EXTRA_RE

# what each kind of file is for; `kind` in read_info
KINDS = {
    "clover_moe": "Clover with the block-mode tensors: block decoding (diffusion, draft-self) and AR; needs the "
                  "patched llama.cpp",
    "clover_moe-ar": "clover_moe without the block-mode tensors (upstream's file, the official GGUFs, export-ar): AR "
                     "in llama.cpp b12060+ and ours; `clover-gguf graft` adds the block tensors",
    "qwen35moe": "qwen35moe (export-ar --arch qwen35moe): AR only; loads in stock llama.cpp, older builds too, and "
                 "the apps built on them",
}


def _as_written(value: Any, gguf_type: int | None) -> Any:
    """A FLOAT32 value as a person writes it: the shortest decimal that reads back as the same float32
    (1e-06, not 9.999999974752427e-07)."""
    from clover_gguf.gguf_header import F32

    if gguf_type == F32 and isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, list) and value and isinstance(value[0], float):
        return [float(str(np.float32(v))) for v in value]
    return value


def read_info(path: Path) -> dict[str, Any]:
    from clover_gguf.gguf_header import ARRAY, ArrayInfo, check_model, read_header, tensor_bytes

    path = Path(path)
    try:
        h = read_header(path)
    except UserError as e:
        raise UserError(f"{path} is not a readable GGUF file ({e})") from None
    check_model(h)
    types = h.types or {}

    def shown(k: str, v: Any) -> Any:
        if isinstance(v, ArrayInfo):
            return f"[{v.length} values]"
        t, sub = types.get(k, (None, None))
        return _as_written(v, sub if t == ARRAY else t)

    kv = {k: shown(k, v) for k, v in h.kv.items()}
    arch = h.arch
    by_type: Counter = Counter()
    count_by_type: Counter = Counter()
    for shape, qtype in h.tensors.values():
        by_type[qtype.name] += tensor_bytes(qtype, shape)
        count_by_type[qtype.name] += 1
    prefix = f"{arch}."
    # the architecture's keys (without its prefix) and block mode's diffusion.* family (with theirs)
    hparams = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in kv.items()
               if arch and (k.startswith(prefix) or k.startswith(DIFFUSION_PREFIX))}
    has_extras = any(CLOVER_EXTRA_RE.match(n) for n in h.tensors)
    nextn = hparams.get("nextn_predict_layers", 0)
    features = {
        "block_mode": kv.get(BLOCK_MODE, False) is True and has_extras,
        "coreset": kv.get(CORESET_ENABLED, False) is True,
        "mtp": isinstance(nextn, int) and nextn > 0,
    }
    kind = arch if arch != ARCH else (ARCH if features["block_mode"] else f"{ARCH}-ar")
    tokens = h.kv.get("tokenizer.ggml.tokens")
    size = path.stat().st_size
    return {
        "path": str(path),
        "architecture": arch,
        "kind": kind,
        "name": kv.get("general.name"),
        "file_type": kv.get("general.file_type"),
        "quant_recipe": kv.get(f"{prefix}quant.recipe"),
        "block_reading": kv.get(BLOCK_READING), "block_reading_verified": kv.get(BLOCK_READING_VERIFIED),
        "hparams": hparams,
        "tensor_count": len(h.tensors),
        "bytes_by_type": dict(by_type),
        "tensors_by_type": dict(count_by_type),
        "file_size_bytes": size,
        "file_size_gib": round(size / 2**30, 4),
        "features": features,
        "vocab_size": tokens.length if isinstance(tokens, ArrayInfo) else (len(tokens) if tokens else None),
        "mask_token_id": kv.get("tokenizer.ggml.mask_token_id"),
    }


def format_info(info: dict[str, Any]) -> str:
    lines = [f"file          {info['path']} ({info['file_size_gib']:.3f} GiB)",
             f"architecture  {info['architecture']}   name: {info['name']}",
             f"kind          {KINDS.get(info['kind'], 'not a Clover or qwen35moe file')}"]
    if info.get("quant_recipe"):
        lines.append(f"quant recipe  {info['quant_recipe']}")
    if info.get("block_reading"):
        how = "trained under it" if info.get("block_reading_verified") else "not verified: see `clover-gguf check-block`"
        lines.append(f"block reading {info['block_reading']} ({how})")
    feats = info["features"]
    lines.append("features      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()))
    lines.append(f"tensors       {info['tensor_count']}")
    for t, b in sorted(info["bytes_by_type"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {t:<6} {info['tensors_by_type'][t]:>5} tensors  {b / 2**30:9.4f} GiB")
    lines.append("hparams")
    for k, v in sorted(info["hparams"].items()):
        lines.append(f"  {k:<40} {v}")
    return "\n".join(lines)
