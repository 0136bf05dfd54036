"""Write a complete HF-style Clover checkpoint with random weights.

    python -m clover_gguf.testing.make_tiny OUT --seed S [--preset tiny|small|wide|large] [--dtype f32|bf16]
        [--experts per-expert|fused] [--prefix] [--mtp] [--zero-extras] [--plain-qwen] [--shard-size BYTES]

Tensors are generated one at a time from a shape table and written shard by shard, so `--preset large`
(over 2 GB) never needs the model in memory.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from clover_gguf.config import CloverConfig, GenerationDefaults
from clover_gguf.shapes import checkpoint_tensors, layer_tensors  # noqa: F401 - re-exported
from clover_gguf.testing.tokenizer import write_tokenizer

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
}

ST_DTYPE = {"f32": "F32", "bf16": "BF16"}


def make_config(preset: str, vocab_size: int, special: dict[str, int], plain_qwen: bool = False, mtp: bool = False,
                tie: bool = False) -> CloverConfig:
    p = PRESETS[preset]
    n = p["num_hidden_layers"]
    d = dict(p, vocab_size=vocab_size, model_type="qwen3_5_moe_text" if plain_qwen else "clover",
             layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
             rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
             tie_word_embeddings=tie, max_position_embeddings=4096,
             eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]], pad_token_id=special["<|endoftext|>"],
             mtp_num_hidden_layers=1 if mtp else 0)
    if not plain_qwen:
        d.update(mask_token_id=special["<|mask|>"], block_size=32, linear_conv_right_kernel_dim=4,
                 moe_block_coreset_enabled=True, moe_block_coreset_top_p=0.9)
    return CloverConfig.from_dict(d)


def generate(name: str, shape: tuple[int, ...], init: tuple, seed: int) -> np.ndarray:
    """Deterministic per (seed, name): a tensor's values do not depend on which other tensors exist."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    kind = init[0]
    if kind == "zero":
        return np.zeros(shape, np.float32)
    if kind == "normal":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(init[1])).astype(np.float32)
    if kind == "uniform":
        return rng.uniform(init[1], init[2], shape).astype(np.float32)
    if kind == "log_uniform":
        return np.log(rng.uniform(init[1], init[2], shape)).astype(np.float32)
    raise ValueError(kind)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]]) -> None:
    """Our own small writer (numpy has no bfloat16): [(name, dtype, shape, raw array)]."""
    header, offset = {}, 0
    for name, dtype, shape, arr in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())


def make_tiny(out: Path, seed: int = 0, preset: str = "tiny", dtype: str = "f32", experts: str = "per-expert",
              prefix: bool = False, mtp: bool = False, zero_extras: bool = False, plain_qwen: bool = False,
              shard_size: int | None = None, tie: bool = False) -> CloverConfig:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(out)
    n_tokens = max(special.values()) + 1
    vocab_size = -(-n_tokens // 64) * 64  # padded like real checkpoints (rows past the tokenizer are unused)
    cfg = make_config(preset, vocab_size, special, plain_qwen=plain_qwen, mtp=mtp, tie=tie)
    hf = cfg.to_hf_dict()
    if prefix:  # ForConditionalGeneration layout: text fields under text_config
        hf = {"architectures": ["CloverForConditionalGeneration" if cfg.is_clover else
                                "Qwen3_5MoeForConditionalGeneration"],
              "model_type": "clover" if cfg.is_clover else "qwen3_5_moe",
              "text_config": hf, "vision_config": {"depth": 1}, "tie_word_embeddings": cfg.tie_word_embeddings}
    (out / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    gen = {**GenerationDefaults().to_hf(), "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")

    table = checkpoint_tensors(cfg, experts=experts, prefix=prefix, mtp=mtp, zero_extras=zero_extras)
    # group tensors into shards of about shard_size bytes (one shard when not sharding)
    groups: list[list[tuple[str, tuple[int, ...], tuple]]] = [[]]
    size = 0
    itemsize = 2 if dtype == "bf16" else 4
    for name, shape, init in table:
        nbytes = int(np.prod(shape)) * itemsize
        if shard_size and size and size + nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, init))
        size += nbytes
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors" if shard_size else "model.safetensors"
        tensors = []
        for name, shape, init in group:  # one shard's tensors in memory at a time
            a = generate(name, shape, init, seed)
            tensors.append((name, ST_DTYPE[dtype], shape, to_bf16_bits(a) if dtype == "bf16" else a))
            weight_map[name] = fname
        write_safetensors(out / fname, tensors)
    if shard_size:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clover_gguf.testing.make_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=sorted(ST_DTYPE), default="f32")
    ap.add_argument("--experts", choices=["per-expert", "fused"], default="per-expert")
    ap.add_argument("--prefix", action="store_true", help="model.language_model. prefix and a text_config")
    ap.add_argument("--mtp", action="store_true", help="add an MTP block (mtp.*)")
    ap.add_argument("--zero-extras", action="store_true", help="Clover extras present but zero")
    ap.add_argument("--plain-qwen", action="store_true", help="a plain Qwen3.5-MoE checkpoint (no Clover extras)")
    ap.add_argument("--tie", action="store_true", help="tie word embeddings (no lm_head)")
    ap.add_argument("--shard-size", type=int, default=None, help="split into shards of about this many bytes")
    a = ap.parse_args(argv)
    cfg = make_tiny(a.out, seed=a.seed, preset=a.preset, dtype=a.dtype, experts=a.experts, prefix=a.prefix,
                    mtp=a.mtp, zero_extras=a.zero_extras, plain_qwen=a.plain_qwen, shard_size=a.shard_size, tie=a.tie)
    print(f"wrote {a.out} ({a.preset}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
