"""`clover-gguf export-ar`: a Clover GGUF -> the AR-only file stock llama.cpp runs.

By default the file upstream's converter writes (llama.cpp b12060 and later): `clover_moe` without our block-mode
tensors and keys. With arch `qwen35moe`: llama.cpp's `qwen35moe`, for older builds and the apps built on them
(Ollama, LM Studio), the hyperparameters renamed `qwen35moe.*`.

What upstream does not write under the target architecture (convert.UPSTREAM_HPARAMS) is left out, every other key
is copied with its type, and every kept tensor is copied byte for byte: a quantized file stays exactly as
quantized. One tensor in memory at a time; the output appears whole or not at all. `clover-gguf convert --arch
qwen35moe` writes the same qwen35moe file from a checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from clover_gguf.convert import AR_ARCH, ARCH, ARCHS, UPSTREAM_HPARAMS
from clover_gguf.errors import UserError
from clover_gguf.fsutil import atomic_output, check_free_disk, check_output, check_writable_dir
from clover_gguf.gguf_header import GGUFHeader, encode_value, read_header, tensor_bytes
from clover_gguf.metadata import BLOCK_KEYS
from clover_gguf.tensor_map import CLOVER_EXTRA_RE

REPEAT_PENALTY_KEY = "general.sampling.penalty_repeat"


def ar_key(key: str, arch: str = ARCH) -> str | None:
    """The name a clover_moe file's key has in the AR file of `arch`; None for our own keys (left out)."""
    if key in BLOCK_KEYS:
        return None
    if not key.startswith(ARCH + "."):
        return key
    rest = key[len(ARCH) + 1:]
    return f"{arch}.{rest}" if rest in UPSTREAM_HPARAMS[arch] else None


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
              log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr), arch: str = ARCH) -> ExportResult:
    from clover_gguf.quantize import check_clover

    src, out = Path(src), Path(out)
    try:
        h = read_header(src, full=True)
    except UserError as e:
        raise UserError(f"{src} is not a readable GGUF file ({e})") from None
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if h.arch == AR_ARCH:
        raise UserError(f"{src} is already a {AR_ARCH} GGUF: export-ar takes a {ARCH} GGUF")
    check_clover(h)
    dropped_tensors = [n for n in h.tensors if CLOVER_EXTRA_RE.match(n)]
    if arch == ARCH and not dropped_tensors:
        raise UserError(f"{src} has no block-mode tensors: it already is the AR-only {ARCH} file "
                        f"(--arch {AR_ARCH} makes the qwen35moe one)")
    kept = [n for n in h.tensors if not CLOVER_EXTRA_RE.match(n)]
    if not quiet and dropped_tensors:
        log(f"left out {len(dropped_tensors)} block-mode tensor(s) and our own keys")
    w_keys = {key: ar_key(key, arch) for key in h.kv}
    dropped_keys = [k for k, name in w_keys.items() if name is None]
    # files converted before the sampling key existed: the card's repetition penalty from Clover's own key
    card = h.kv.get(f"{ARCH}.generation.repetition_penalty")
    add = {REPEAT_PENALTY_KEY: (GGUFValueType.FLOAT32, float(card))} if REPEAT_PENALTY_KEY not in h.kv and \
        card is not None else {}
    copy_gguf(h, src, out, keep=kept, rename=w_keys, add_keys=add, force=force, quiet=quiet, desc="export-ar",
              arch=arch)
    return ExportResult(out, len(kept), dropped_tensors, dropped_keys, out.stat().st_size)


def copy_gguf(h: GGUFHeader, src: Path, out: Path, keep: list[str], rename: dict[str, str | None] | None = None,
              drop_keys: set[str] = frozenset(), add_keys: dict[str, tuple[int, Any]] | None = None,
              add_tensors: dict[str, np.ndarray] | None = None, force: bool = False, quiet: bool = False,
              desc: str = "copy", arch: str = ARCH) -> None:
    """A new GGUF from `h` (read_header(full=True) of `src`): its keys (renamed by `rename`, None = left out; minus
    `drop_keys`) with their types, then `add_keys` (key -> (GGUF type, value)); the tensors `keep` copied byte for
    byte, one in memory at a time, then `add_tensors` (F32). Written whole or not at all."""
    from tqdm import tqdm

    add_keys, add_tensors = add_keys or {}, add_tensors or {}
    check_output(out, [src], force=force)
    nbytes = {n: tensor_bytes(h.tensors[n][1], h.tensors[n][0]) for n in keep}
    total = sum(nbytes.values()) + sum(a.nbytes for a in add_tensors.values())
    check_writable_dir(out)
    check_free_disk(out, total + h.data_offset)

    w = GGUFWriter(path=None, arch=arch)
    w.data_alignment = h.alignment
    for key, value in h.kv.items():
        name = key if rename is None else rename.get(key, key)
        if name is None or key in drop_keys or key == "general.architecture":  # the writer wrote the last
            continue
        vtype, sub = h.types[key]
        w.add_key_value(name, _stored(value, vtype), GGUFValueType(vtype),
                        None if sub is None else GGUFValueType(sub))
    for key, (vtype, value) in add_keys.items():
        w.add_key_value(key, value, GGUFValueType(vtype))
    for n in keep:
        shape, qt = h.tensors[n]
        block, size = GGML_QUANT_SIZES[qt]
        w.add_tensor_info(n, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes[n], raw_dtype=qt)
    for n, a in add_tensors.items():
        w.add_tensor_info(n, a.shape, a.dtype, a.nbytes)
    with atomic_output(out) as tmp, open(src, "rb") as f:
        try:
            w.open_output_file(tmp)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=quiet,
                      dynamic_ncols=True) as bar:
                for n in keep:
                    f.seek(h.data_offset + h.offsets[n])
                    data = np.fromfile(f, dtype=np.uint8, count=nbytes[n])
                    if data.size != nbytes[n]:
                        raise UserError(f"{src} is truncated: tensor {n} ends past the end of the file")
                    w.write_tensor_data(data)
                    bar.update(nbytes[n])
                    del data
                for n, a in add_tensors.items():
                    w.write_tensor_data(a)
                    bar.update(a.nbytes)
        finally:
            w.close()


def restamp(path: Path, keys: dict[str, tuple[int, Any]], quiet: bool = True) -> str:
    """Set these keys (key -> (GGUF type, value); STRING, BOOL, UINT32 or FLOAT32) in a GGUF file, whole or not
    at all. In place when each key is there with the same type and its new value takes as many bytes (a reading's
    name for another: metadata.READINGS are all one length): the bytes from the first changed value to the last are
    written back in one write, then synced, so a reader sees the old header or the new one and the tensors never
    move. Otherwise the file is copied with the keys set (its tensors byte for byte) and the copy renamed over it.
    A link is followed: the file it names is the one stamped (the Hugging Face cache keeps files as links to its
    blobs; renaming the copy over the link left the blob unchanged and the link a copy). -> "in place" or
    "rewritten"."""
    import os

    path = Path(os.path.realpath(path))
    h = read_header(path)
    types = h.types or {}
    if all(k in h.spans and types.get(k, (None,))[0] == t and
           len(encode_value(t, v)) == h.spans[k][1] - h.spans[k][0] for k, (t, v) in keys.items()):
        first = min(h.spans[k][0] for k in keys)
        last = max(h.spans[k][1] for k in keys)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            buf = bytearray(os.pread(fd, last - first, first))
            for k, (t, v) in keys.items():
                a, b = h.spans[k]
                buf[a - first:b - first] = encode_value(t, v)
            if os.pwrite(fd, bytes(buf), first) != len(buf):
                raise UserError(f"{path}: the header write was cut short (disk full?)")
            os.fsync(fd)
        finally:
            os.close(fd)
        return "in place"
    from clover_gguf.fsutil import temp_name

    full = read_header(path, full=True)
    tmp = temp_name(path).with_name(temp_name(path).name + "-restamp")
    try:
        copy_gguf(full, path, tmp, keep=list(full.tensors), drop_keys=set(keys), add_keys=keys, quiet=quiet,
                  desc="restamp", arch=full.arch or ARCH)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return "rewritten"
