"""Clover's shapes and settings, read from a checkpoint's config.json with the HF field names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_gguf.errors import UserError
from clover_gguf.metadata import GenerationDefaults  # noqa: F401  (its home is metadata.py)

CLOVER_MODEL_TYPES = {"clover", "clover_text"}
PLAIN_QWEN_MODEL_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text"}
FULL_ATTENTION = "full_attention"
# The 35B's config.json shape with the Clover keys (rope_theta and mask_token_id are placeholders): package data,
# for size planning (`quantize --plan`, `fit`) and the slice35b test model. Use shapes, not values.
SHAPE_35B = Path(__file__).resolve().parent / "data" / "clover-35b-a3b-shape.json"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class CloverConfig:
    """One dataclass for the shapes: every field is the HF config.json name."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    full_attention_interval: int = 4
    hidden_act: str = "silu"
    # Clover's additions; a plain Qwen3.5-MoE checkpoint has none of them.
    model_type: str = "clover"
    mask_token_id: int | None = None
    block_size: int = 32
    linear_conv_right_kernel_dim: int | None = None
    moe_block_coreset_enabled: bool = True
    moe_block_coreset_top_p: float = 0.9
    mtp_num_hidden_layers: int = 0
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------------------
    @property
    def is_clover(self) -> bool:
        return self.model_type in CLOVER_MODEL_TYPES

    @property
    def right_kernel(self) -> int:
        return self.linear_conv_right_kernel_dim or self.linear_conv_kernel_dim

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    # ---- reading ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "CloverConfig":
        """Accept a text config, or a ForConditionalGeneration config with `text_config` inside."""
        outer_type = raw.get("model_type", "")
        d = dict(raw)
        if isinstance(raw.get("text_config"), dict):
            d = {**raw["text_config"]}
            # Clover keys may sit at either level; the text config wins.
            for key in ("mask_token_id", "block_size", "linear_conv_right_kernel_dim", "moe_block_coreset_enabled",
                        "moe_block_coreset_top_p", "eos_token_id", "tie_word_embeddings"):
                if key not in d and key in raw:
                    d[key] = raw[key]
            d.setdefault("model_type", outer_type)
            if outer_type in CLOVER_MODEL_TYPES:
                d["model_type"] = "clover"
        model_type = d.get("model_type", "")
        if model_type not in CLOVER_MODEL_TYPES | PLAIN_QWEN_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r}: expected clover or qwen3_5_moe (Qwen3.5/3.6-MoE text)"
            )
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size", "shared_expert_intermediate_size"]
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise UserError(f"config.json lacks required field(s): {', '.join(missing)}")

        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10_000_000.0)))
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        mrope = rope.get("mrope_section")
        n_layers = int(d["num_hidden_layers"])
        interval = int(d.get("full_attention_interval") or 4)
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        if len(layer_types) != n_layers:
            raise UserError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
        bad = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise UserError(f"unknown layer type(s) in layer_types: {', '.join(bad)}")
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"])
        known = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(head_dim),
            linear_num_key_heads=int(d["linear_num_key_heads"]),
            linear_num_value_heads=int(d["linear_num_value_heads"]),
            linear_key_head_dim=int(d["linear_key_head_dim"]),
            linear_value_head_dim=int(d["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]),
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"]),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            mrope_section=tuple(mrope) if mrope else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            full_attention_interval=interval,
            hidden_act=str(d.get("hidden_act", "silu")),
            model_type="clover" if model_type in CLOVER_MODEL_TYPES else model_type,
            mask_token_id=d.get("mask_token_id"),
            block_size=int(d.get("block_size") or 32),
            linear_conv_right_kernel_dim=d.get("linear_conv_right_kernel_dim"),
            moe_block_coreset_enabled=bool(d.get("moe_block_coreset_enabled", True)),
            moe_block_coreset_top_p=float(d.get("moe_block_coreset_top_p", 0.9)),
            mtp_num_hidden_layers=int(d.get("mtp_num_hidden_layers") or 0),
            eos_token_id=d.get("eos_token_id"),
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in known},
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "CloverConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"missing config.json: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}") from None
        return cls.from_dict(raw)

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise UserError(f"hidden_act {self.hidden_act!r} is not supported (Clover uses silu)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UserError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise UserError("num_experts_per_tok exceeds num_experts")
        if not 0.0 < self.moe_block_coreset_top_p <= 1.0:
            raise UserError("moe_block_coreset_top_p must be in (0, 1]")
        if self.rotary_dim % 2:
            raise UserError("head_dim * partial_rotary_factor must be even")

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Clover checkpoint carries (used by make_tiny)."""
        d: dict[str, Any] = {
            "architectures": ["CloverForCausalLM"] if self.is_clover else ["Qwen3_5MoeForCausalLM"],
            "model_type": "clover" if self.is_clover else "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {"rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor,
                                "rope_type": "default"},
            "attention_bias": False,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_experts": self.num_experts,
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.mtp_num_hidden_layers:
            d["mtp_num_hidden_layers"] = self.mtp_num_hidden_layers
        if self.is_clover:
            d.update(
                mask_token_id=self.mask_token_id,
                block_size=self.block_size,
                linear_conv_right_kernel_dim=self.right_kernel,
                moe_block_coreset_enabled=self.moe_block_coreset_enabled,
                moe_block_coreset_top_p=self.moe_block_coreset_top_p,
            )
        return d
