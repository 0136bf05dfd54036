"""Write a complete HF-style Clover checkpoint with random weights.

    python -m clover_gguf.testing.make_tiny OUT --seed S [--preset tiny|small|wide|large|slice35b] [--dtype f32|bf16]
        [--experts per-expert|fused] [--prefix] [--mtp] [--zero-extras] [--plain-qwen] [--shard-size BYTES]
        [--num-experts N] [--vocab-size V] [--num-layers L] [--quiet]

Tensors are generated and written one at a time, in row chunks, straight into their shard (the safetensors header
is known from the shapes), so `--preset slice35b` (about 8.6 GB) needs well under 100 MB of memory.

`slice35b` is the 35B's per-layer shape (clover_gguf/data/clover-35b-a3b-shape.json) with 4 layers (3 GDN + 1
attention, the 35B's pattern), its 248,320-row vocabulary and BF16 weights: real kernel, quantization and vocabulary
sizes at a fraction of the model. `--num-experts` / `--vocab-size` / `--num-layers` make cheaper variants of any
preset. Its router is drawn so that some experts are popular (see ROUTER_SPREAD).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from clover_gguf.config import SHAPE_35B, CloverConfig
from clover_gguf.metadata import GenerationDefaults
from clover_gguf.shapes import checkpoint_tensors, layer_tensors  # noqa: F401 - re-exported
from clover_gguf.testing.tokenizer import write_tokenizer

# the 35B's per-layer fields, copied from its config.json shape
_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def _slice35b() -> dict:
    shape = json.loads(SHAPE_35B.read_text())
    return dict({k: shape[k] for k in _SHAPE_FIELDS}, num_hidden_layers=4)


PRESETS: dict[str, dict] = {
    # key heads != value heads, a full-attention layer every 4th, 8 experts top-2
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "small": dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64),
    # rows of 256 (hidden and expert widths), so that llama.cpp's K-quants apply without falling back to 32-blocks
    "wide": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=256, shared_expert_intermediate_size=256),
    # over 2 GB in bf16, for benchmarks
    "large": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512),
    # the 35B's layers at their real size
    "slice35b": _slice35b(),
}
# what a preset sets besides its shape (make_tiny's arguments win when given)
PRESET_SETTINGS: dict[str, dict] = {
    "slice35b": dict(vocab_size=248_320, dtype="bf16", context_length=131_072, router_spread=0.2),
}
# Rows past the tokenizer when a vocabulary size is set: Qwen's checkpoints leave their last embedding rows unused
# (Qwen2: 151,665 tokens in 151,936 rows). 248,320 - 243 = 248,077 tokens is our recollection of the Qwen3.5
# tokenizer, not checked here; it only shapes load-time figures.
UNUSED_VOCAB_ROWS = 243
ST_DTYPE = {"f32": "F32", "bf16": "BF16"}
ST_ITEMSIZE = {"F32": 4, "BF16": 2}
CHUNK_ELEMENTS = 1 << 23  # rows are generated and written in pieces of about this many values


def make_config(preset: str, vocab_size: int, special: dict[str, int], plain_qwen: bool = False, mtp: bool = False,
                tie: bool = False, num_experts: int | None = None, num_layers: int | None = None,
                context_length: int = 4096) -> CloverConfig:
    p = dict(PRESETS[preset])
    if num_experts is not None:
        p["num_experts"] = num_experts
        p["num_experts_per_tok"] = min(p["num_experts_per_tok"], num_experts)
    if num_layers is not None:
        p["num_hidden_layers"] = num_layers
    n = p["num_hidden_layers"]
    d = dict(p, vocab_size=vocab_size, model_type="qwen3_5_moe_text" if plain_qwen else "clover_moe",
             layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
             rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
             tie_word_embeddings=tie, max_position_embeddings=context_length,
             eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]], pad_token_id=special["<|endoftext|>"],
             mtp_num_hidden_layers=1 if mtp else 0)
    if not plain_qwen:
        d.update(mask_token_id=special["<|mask|>"], block_size=32, linear_conv_right_kernel_dim=4,
                 moe_block_coreset_enabled=True, moe_block_coreset_top_p=0.9)
    return CloverConfig.from_dict(d)


def generate_chunks(name: str, shape: tuple[int, ...], init: tuple, seed: int) -> Iterator[np.ndarray]:
    """The tensor as float32 pieces along its first axis. Deterministic per (seed, name): a tensor's values do not
    depend on which other tensors exist, nor on the piece size (numpy's generators draw the same stream in pieces).

    init ("router", std, spread): normal(0, std) rows, row e scaled by exp(spread * z_e), z_e ~ N(0, 1) from a
    stream of its own. A router row's scale sets the spread of that expert's logits, and top-k favours wide
    spreads: with spread 0.2 over 256 experts top-8 the most popular expert is picked about 4x as often as the mean
    and a 32-token block of random tokens touches about 140 distinct experts (uniform logits: about 160), so the
    block coreset has a skewed routing mass to cut, as real routers give it."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    kind = init[0]
    rows = shape[0] if shape else 1
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, CHUNK_ELEMENTS // max(row, 1))
    scale = None
    if kind == "router":
        z = np.random.default_rng([seed, zlib.crc32(name.encode()), 1]).standard_normal(rows)
        scale = np.exp(init[2] * z).astype(np.float32).reshape((rows,) + (1,) * (len(shape) - 1))
    for r0 in range(0, rows, step):
        sub = (min(step, rows - r0),) + tuple(shape[1:]) if shape else ()
        if kind == "zero":
            a = np.zeros(sub, np.float32)
        elif kind in ("normal", "router"):
            a = rng.standard_normal(sub, dtype=np.float32) * np.float32(init[1])
            if scale is not None:
                a *= scale[r0:r0 + sub[0]]
        elif kind == "uniform":
            a = rng.uniform(init[1], init[2], sub).astype(np.float32)
        elif kind == "log_uniform":
            a = np.log(rng.uniform(init[1], init[2], sub)).astype(np.float32)
        else:
            raise ValueError(kind)
        yield a.astype(np.float32, copy=False)


def generate(name: str, shape: tuple[int, ...], init: tuple, seed: int) -> np.ndarray:
    """The whole tensor as float32 (generate_chunks joined)."""
    return np.concatenate(list(generate_chunks(name, shape, init, seed))).reshape(shape)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


# a tensor to write: an array, or a function that yields its pieces in order (already in the storage dtype)
TensorData = np.ndarray | Callable[[], Iterator[np.ndarray]]


def write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], TensorData]],
                      progress: Callable[[int], None] = lambda n: None) -> None:
    """Our own small writer (numpy has no bfloat16): [(name, dtype, shape, data)]. The header comes from the
    shapes, so each tensor's pieces go straight to the file: memory is one piece, whatever the model's size."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        nbytes = int(np.prod(shape)) * ST_ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape, data in tensors:
            written = 0
            for piece in ([data] if isinstance(data, np.ndarray) else data()):
                b = np.ascontiguousarray(piece)
                f.write(b.data)
                written += b.nbytes
                progress(b.nbytes)
            if written != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise RuntimeError(f"{name}: wrote {written} bytes, its shape needs more or fewer")


def make_tiny(out: Path, seed: int = 0, preset: str = "tiny", dtype: str | None = None, experts: str = "per-expert",
              prefix: bool = False, mtp: bool = False, zero_extras: bool = False, plain_qwen: bool = False,
              shard_size: int | None = None, tie: bool = False, num_experts: int | None = None,
              vocab_size: int | None = None, num_layers: int | None = None, quiet: bool = True) -> CloverConfig:
    """dtype, vocab_size: the preset's (PRESET_SETTINGS) unless given; else f32 and the tokenizer padded to 64."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = PRESET_SETTINGS.get(preset, {})
    dtype = dtype or settings.get("dtype", "f32")
    vocab_size = vocab_size or settings.get("vocab_size")
    if vocab_size is None:
        special = write_tokenizer(out)
        n_tokens = max(special.values()) + 1
        vocab_size = -(-n_tokens // 64) * 64  # padded like real checkpoints (rows past the tokenizer are unused)
    else:
        base = max(write_tokenizer(out).values()) + 1
        if vocab_size < base:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's own {base} tokens")
        special = write_tokenizer(out, n_tokens=max(base, vocab_size - UNUSED_VOCAB_ROWS))
    cfg = make_config(preset, vocab_size, special, plain_qwen=plain_qwen, mtp=mtp, tie=tie, num_experts=num_experts,
                      num_layers=num_layers, context_length=settings.get("context_length", 4096))
    hf = cfg.to_hf_dict()
    if prefix:  # ForConditionalGeneration layout: text fields under text_config
        hf = {"architectures": [hf["architectures"][0] if cfg.is_clover else "Qwen3_5MoeForConditionalGeneration"],
              "model_type": hf["model_type"] if cfg.is_clover else "qwen3_5_moe",
              "text_config": hf, "vision_config": {"depth": 1}, "tie_word_embeddings": cfg.tie_word_embeddings}
    (out / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    gen = {**GenerationDefaults().to_hf(), "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")

    table = checkpoint_tensors(cfg, experts=experts, prefix=prefix, mtp=mtp, zero_extras=zero_extras)
    spread = settings.get("router_spread")
    if spread:
        table = [(n, s, ("router", init[1], spread) if n.endswith("mlp.gate.weight") else init)
                 for n, s, init in table]
    # group tensors into shards of about shard_size bytes (one shard when not sharding)
    groups: list[list[tuple[str, tuple[int, ...], tuple]]] = [[]]
    size = 0
    itemsize = ST_ITEMSIZE[ST_DTYPE[dtype]]
    for name, shape, init in table:
        nbytes = int(np.prod(shape)) * itemsize
        if shard_size and size and size + nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, init))
        size += nbytes
    total = sum(int(np.prod(shape)) * itemsize for _, shape, _ in table)
    encode = to_bf16_bits if dtype == "bf16" else (lambda a: a)
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="make_tiny", disable=quiet,
              dynamic_ncols=True) as bar:
        for k, group in enumerate(groups, start=1):
            fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors" if shard_size else "model.safetensors"
            tensors = []
            for name, shape, init in group:
                pieces = (lambda n=name, s=shape, i=init: (encode(a) for a in generate_chunks(n, s, i, seed)))
                tensors.append((name, ST_DTYPE[dtype], shape, pieces))
                weight_map[name] = fname
            write_safetensors(out / fname, tensors, progress=bar.update)
    if shard_size:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return cfg


def with_random_block_tensors(src: Path, out: Path, seed: int = 0, std: float = 2.0) -> Path:
    """A copy of the single-shard checkpoint `src` whose block-mode tensors (tensor_map's clover_extra rules) are
    drawn from N(0, std): what running real weights under a reading that does not fit them looks like (the block
    path proposes noise; the causal path is untouched). -> out."""
    from safetensors.numpy import load_file, save_file

    from clover_gguf.tensor_map import match_rule

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    rng = np.random.default_rng(seed)
    tensors = load_file(src / "model.safetensors")
    n = 0
    for name, t in tensors.items():
        hit = match_rule(name)
        if hit is not None and hit[0].clover_extra:
            tensors[name] = rng.normal(0.0, std, t.shape).astype(t.dtype)
            n += 1
    if not n:
        raise ValueError(f"{src} has no block-mode tensors")
    save_file(tensors, out / "model.safetensors")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clover_gguf.testing.make_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=sorted(ST_DTYPE), default=None, help="f32, or the preset's (slice35b: bf16)")
    ap.add_argument("--experts", choices=["per-expert", "fused"], default="per-expert")
    ap.add_argument("--prefix", action="store_true", help="model.language_model. prefix and a text_config")
    ap.add_argument("--mtp", action="store_true", help="add an MTP block (mtp.*)")
    ap.add_argument("--zero-extras", action="store_true", help="Clover extras present but zero")
    ap.add_argument("--plain-qwen", action="store_true", help="a plain Qwen3.5-MoE checkpoint (no Clover extras)")
    ap.add_argument("--tie", action="store_true", help="tie word embeddings (no lm_head)")
    ap.add_argument("--shard-size", type=int, default=None, help="split into shards of about this many bytes")
    ap.add_argument("--num-experts", type=int, default=None, help="override the preset's expert count")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help=f"embedding rows; the tokenizer is grown to fill all but the last {UNUSED_VOCAB_ROWS}")
    ap.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count (every 4th "
                                                                  "is full attention)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    for opt in ("num_experts", "vocab_size", "num_layers"):
        if getattr(a, opt) is not None and getattr(a, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} must be positive")
    try:
        cfg = make_tiny(a.out, seed=a.seed, preset=a.preset, dtype=a.dtype, experts=a.experts, prefix=a.prefix,
                        mtp=a.mtp, zero_extras=a.zero_extras, plain_qwen=a.plain_qwen, shard_size=a.shard_size,
                        tie=a.tie, num_experts=a.num_experts, vocab_size=a.vocab_size, num_layers=a.num_layers,
                        quiet=a.quiet)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {a.out} ({a.preset}, {cfg.num_hidden_layers} layers, {cfg.num_experts} experts, "
          f"vocab {cfg.vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
