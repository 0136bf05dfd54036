"""`clover-gguf info`: what a GGUF file holds and which Clover features it supports."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from clover_gguf.errors import UserError


def _value(field) -> Any:
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return f"[{len(field.data)} strings]"
        vals = [field.parts[i].tolist()[0] for i in field.data]
        return vals if len(vals) <= 64 else f"[{len(vals)} values]"
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    v = field.parts[field.data[0]].tolist()[0]
    return bool(v) if types[0] == GGUFValueType.BOOL else v


def read_info(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such file: {path}")
    try:
        r = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on anything not GGUF
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    kv = {name: _value(f) for name, f in r.fields.items() if not name.startswith("GGUF.")}
    arch = kv.get("general.architecture")
    by_type: Counter = Counter()
    count_by_type: Counter = Counter()
    names = set()
    for t in r.tensors:
        by_type[t.tensor_type.name] += int(t.n_bytes)
        count_by_type[t.tensor_type.name] += 1
        names.add(t.name)
    prefix = f"{arch}."
    hparams = {k[len(prefix):]: v for k, v in kv.items() if arch and k.startswith(prefix)}
    has_extras = any(n.endswith("ssm_conv1d_right.weight") for n in names)
    features = {
        "block_mode": bool(hparams.get("block_mode", False)) and has_extras,
        "coreset": bool(hparams.get("moe_block_coreset.enabled", False)),
        "mtp": int(hparams.get("nextn_predict_layers", 0) or 0) > 0,
    }
    size = path.stat().st_size
    return {
        "path": str(path),
        "architecture": arch,
        "name": kv.get("general.name"),
        "file_type": kv.get("general.file_type"),
        "quant_recipe": kv.get(f"{prefix}quant.recipe"),
        "hparams": hparams,
        "tensor_count": len(r.tensors),
        "bytes_by_type": dict(by_type),
        "tensors_by_type": dict(count_by_type),
        "file_size_bytes": size,
        "file_size_gib": round(size / 2**30, 4),
        "features": features,
        "vocab_size": len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None,
        "mask_token_id": kv.get("tokenizer.ggml.mask_token_id"),
    }


def format_info(info: dict[str, Any]) -> str:
    lines = [f"file          {info['path']} ({info['file_size_gib']:.3f} GiB)",
             f"architecture  {info['architecture']}   name: {info['name']}"]
    if info.get("quant_recipe"):
        lines.append(f"quant recipe  {info['quant_recipe']}")
    feats = info["features"]
    lines.append("features      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()))
    lines.append(f"tensors       {info['tensor_count']}")
    for t, b in sorted(info["bytes_by_type"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {t:<6} {info['tensors_by_type'][t]:>5} tensors  {b / 2**30:9.4f} GiB")
    lines.append("hparams")
    for k, v in sorted(info["hparams"].items()):
        lines.append(f"  {k:<40} {v}")
    return "\n".join(lines)
