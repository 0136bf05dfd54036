"""A header-only GGUF of a Clover model: real metadata and tensor infos, the data section a sparse hole.

`clover-gguf quantize --plan --config config.json` runs llama.cpp's quantizer in dry-run mode on it, and
`clover-gguf fit --config` llama.cpp's graph allocator without allocating, so both work for the 35B model from its
config.json and nothing else (no 69 GB of weights, and a few MB of disk: the file is
sparse). The tensor list is the converter's own plan for a virtual BF16 checkpoint whose shapes come from the
config (clover_gguf.shapes), so it names and shapes every tensor exactly as `clover-gguf convert` would.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from clover_gguf.checkpoint import TensorRef
from clover_gguf.config import CloverConfig
from clover_gguf.convert import ARCH, ConversionPlan, describe, plan_conversion, write_metadata
from clover_gguf.metadata import GenerationDefaults
from clover_gguf.errors import UserError
from clover_gguf.shapes import checkpoint_tensors
from clover_gguf.vocab import Vocab

VIRTUAL = Path("<virtual>")
# The largest model a plan is made for: 16 TiB, ext4's largest file (the skeleton is a sparse file of that size).
MAX_SKELETON_BYTES = 2**44


class VirtualCheckpoint:
    """What plan_conversion reads from a Checkpoint (names, shapes, dtypes), with no data behind it."""

    has_data = False  # plan_conversion reads no block tensor of it

    def __init__(self, cfg: CloverConfig, dtype: str = "BF16"):
        self.tensors: dict[str, TensorRef] = {}
        self.dropped: list[str] = []
        itemsize = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
        for name, shape, _init in checkpoint_tensors(cfg, experts="fused", mtp=cfg.mtp_num_hidden_layers > 0):
            n = math.prod(shape) * itemsize
            self.tensors[name] = TensorRef(name, name, dtype, tuple(shape), VIRTUAL, 0, n)

    def names(self) -> list[str]:
        return list(self.tensors)

    def raw(self, name: str):
        raise RuntimeError("a virtual checkpoint has no data")

    f32 = raw


def placeholder_vocab(n: int) -> Vocab:
    """n tokens named by their id: the tokenizer of the real model is not needed to plan a quantization. One merge,
    because llama.cpp refuses to load a BPE vocabulary without merges (`fit` dry-runs the model on the skeleton)."""
    return Vocab(tokens=[f"<{i}>" for i in range(n)], token_types=[1] * n, merges=["<0> <1>"])


def write_skeleton(config: Path, out: Path, outtype: str = "bf16") -> ConversionPlan:
    cfg = CloverConfig.from_file(Path(config))
    plan = plan_conversion(VirtualCheckpoint(cfg), cfg, outtype)
    if plan.nbytes > MAX_SKELETON_BYTES:
        raise UserError(f"{config} describes a model of {plan.nbytes / 2**40:.1f} TiB, more than the "
                        f"{MAX_SKELETON_BYTES // 2**40} TiB a plan is made for: check its sizes")
    w = GGUFWriter(path=None, arch=ARCH)
    gen = GenerationDefaults()
    write_metadata(w, cfg, placeholder_vocab(cfg.vocab_size), gen, plan.n_blocks,
                   *describe(None, plan, gen, outtype, name="skeleton"))
    from gguf import GGMLQuantizationType as QT

    storage = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}
    data = 0
    for t in plan.tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(storage[t.qtype]), t.nbytes, raw_dtype=t.qtype)
        data += GGUFWriter.ggml_pad(t.nbytes, w.data_alignment)
    try:
        w.open_output_file(Path(out))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()
    header = Path(out).stat().st_size
    try:
        with open(out, "r+b") as f:
            f.truncate(GGUFWriter.ggml_pad(header, w.data_alignment) + data)  # a hole: no blocks allocated
    except OSError as e:
        raise UserError(f"cannot make the header-only skeleton of {config}: {e.strerror}") from None
    return plan
