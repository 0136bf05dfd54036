"""HF tensor -> GGUF tensor: the whole map as data, one row per tensor role, each with its layout and transform.

Names on the left are normalised HF names (`model.` prefix, see checkpoint.normalise_name); `{i}` is the layer.
Transforms are pure functions of (array, config) in TRANSFORMS; docs/gguf.md explains each one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from clover_gguf.config import CloverConfig

Shape = tuple[int, ...]


# ---- value transforms ---------------------------------------------------------------------------------------
def grouped_to_tiled(a: np.ndarray, axis: int, cfg: CloverConfig, head_dim: int) -> np.ndarray:
    """Reorder value heads along `axis` from HF's grouped order [k0v0, k0v1, .., k1v0, ..] to ggml's tiled
    broadcast order [k0v0, k1v0, .., k0v1, ..], so a [Hk] tensor repeats over [Hv] by plain broadcasting."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk == hv:
        return a
    axis = axis % a.ndim
    shape = a.shape
    a = a.reshape(shape[:axis] + (hk, hv // hk, head_dim) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def _tile_v_part(a: np.ndarray, cfg: CloverConfig) -> np.ndarray:
    """Rows (or conv channels) ordered q | k | v: only the v block is per value head."""
    qk = 2 * cfg.key_dim
    return np.concatenate([a[:qk], grouped_to_tiled(a[qk:], 0, cfg, cfg.linear_value_head_dim)], axis=0)


def _as_f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


TRANSFORMS: dict[str, Callable[[np.ndarray, CloverConfig], np.ndarray]] = {
    "copy": lambda a, cfg: a,
    # zero-centred RMSNorm weight w: the runtime multiplies by the stored value, so store 1 + w
    "plus_one": lambda a, cfg: _as_f32(a) + np.float32(1.0),
    # A_log -> -exp(A_log): the per-head log-decay factor the runtime multiplies softplus(a + dt) by
    "neg_exp_heads": lambda a, cfg: grouped_to_tiled(-np.exp(_as_f32(a)), 0, cfg, 1),
    "heads": lambda a, cfg: grouped_to_tiled(_as_f32(a), 0, cfg, 1),
    # block_attn_log_scale -> tau = exp(.), block_attn_gate -> sigmoid(.): stored ready to multiply
    "exp_heads": lambda a, cfg: grouped_to_tiled(np.exp(_as_f32(a)), 0, cfg, 1),
    "sigmoid_heads": lambda a, cfg: grouped_to_tiled(1.0 / (1.0 + np.exp(-_as_f32(a))), 0, cfg, 1),
    # [C, 1, K] -> [C, K] (ggml ne {K, C}, what ggml_ssm_conv takes), v channels tiled
    "conv": lambda a, cfg: _tile_v_part(_as_f32(a).reshape(a.shape[0], a.shape[-1]), cfg),
    "qkv_rows": lambda a, cfg: _tile_v_part(a, cfg),
    "v_rows": lambda a, cfg: grouped_to_tiled(a, 0, cfg, cfg.linear_value_head_dim),
    "head_rows": lambda a, cfg: grouped_to_tiled(a, 0, cfg, 1),
    "v_cols": lambda a, cfg: grouped_to_tiled(a, 1, cfg, cfg.linear_value_head_dim),
    # [1, H] -> [H]: qwen35moe's shared-expert gate is a vector
    "squeeze": lambda a, cfg: a.reshape(a.shape[-1]),
}

# Transforms that only move elements: they can act on the stored bits (BF16 kept as uint16) without a float trip.
REORDER_ONLY = {"copy", "qkv_rows", "v_rows", "head_rows", "v_cols", "squeeze"}


@dataclass(frozen=True)
class TensorRule:
    hf: str  # pattern over normalised HF names; {i} = layer index
    gguf: str  # GGUF name; {i} = block index
    transform: str
    hf_shape: Callable[[CloverConfig], Shape]  # what config.json implies
    f32: bool = False  # always stored as F32 (small, numerically sensitive, or never quantized by llama.cpp)
    clover_extra: bool = False

    @property
    def regex(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.hf).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def _h(c: CloverConfig) -> Shape:
    return (c.hidden_size,)


# One row per role. Layout comments give the HF shape -> GGUF shape (numpy order).
TENSOR_RULES: tuple[TensorRule, ...] = (
    # [V, H] -> [V, H]
    TensorRule("model.embed_tokens.weight", "token_embd.weight", "copy", lambda c: (c.vocab_size, c.hidden_size)),
    TensorRule("model.norm.weight", "output_norm.weight", "plus_one", _h, f32=True),
    TensorRule("lm_head.weight", "output.weight", "copy", lambda c: (c.vocab_size, c.hidden_size)),
    TensorRule("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "plus_one", _h, f32=True),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", "plus_one",
               _h, f32=True),
    # gated attention. q_proj [nh*2*hd, H]: per head [query | gate] rows, kept as is (qwen35moe splits it)
    TensorRule("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "copy",
               lambda c: (c.num_attention_heads * c.head_dim * 2, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "copy",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "copy",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "copy",
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim)),
    TensorRule("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "plus_one",
               lambda c: (c.head_dim,), f32=True),
    TensorRule("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "plus_one",
               lambda c: (c.head_dim,), f32=True),
    # gated deltanet. in_proj_qkv [conv_dim, H], rows q | k | v, v rows tiled
    TensorRule("model.layers.{i}.linear_attn.in_proj_qkv.weight", "blk.{i}.attn_qkv.weight", "qkv_rows",
               lambda c: (c.conv_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.linear_attn.in_proj_z.weight", "blk.{i}.attn_gate.weight", "v_rows",
               lambda c: (c.value_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.linear_attn.in_proj_b.weight", "blk.{i}.ssm_beta.weight", "head_rows",
               lambda c: (c.linear_num_value_heads, c.hidden_size), f32=True),
    TensorRule("model.layers.{i}.linear_attn.in_proj_a.weight", "blk.{i}.ssm_alpha.weight", "head_rows",
               lambda c: (c.linear_num_value_heads, c.hidden_size), f32=True),
    # [conv_dim, 1, K] -> [conv_dim, K]
    TensorRule("model.layers.{i}.linear_attn.conv1d.weight", "blk.{i}.ssm_conv1d.weight", "conv",
               lambda c: (c.conv_dim, 1, c.linear_conv_kernel_dim), f32=True),
    TensorRule("model.layers.{i}.linear_attn.dt_bias", "blk.{i}.ssm_dt.bias", "heads",
               lambda c: (c.linear_num_value_heads,), f32=True),
    TensorRule("model.layers.{i}.linear_attn.A_log", "blk.{i}.ssm_a", "neg_exp_heads",
               lambda c: (c.linear_num_value_heads,), f32=True),
    # gated RMSNorm weight [dv], used as is (not zero-centred)
    TensorRule("model.layers.{i}.linear_attn.norm.weight", "blk.{i}.ssm_norm.weight", "copy",
               lambda c: (c.linear_value_head_dim,), f32=True),
    # out_proj [H, value_dim], columns tiled
    TensorRule("model.layers.{i}.linear_attn.out_proj.weight", "blk.{i}.ssm_out.weight", "v_cols",
               lambda c: (c.hidden_size, c.value_dim)),
    # Clover extras: [conv_dim, 1, Kr] -> [conv_dim, Kr]; [Hv] -> tau = exp; [Hv] -> sigmoid
    TensorRule("model.layers.{i}.linear_attn.conv1d_right.weight", "blk.{i}.ssm_conv1d_right.weight", "conv",
               lambda c: (c.conv_dim, 1, c.right_kernel), f32=True, clover_extra=True),
    TensorRule("model.layers.{i}.linear_attn.block_attn_log_scale", "blk.{i}.ssm_block_scale", "exp_heads",
               lambda c: (c.linear_num_value_heads,), f32=True, clover_extra=True),
    TensorRule("model.layers.{i}.linear_attn.block_attn_gate", "blk.{i}.ssm_block_gate", "sigmoid_heads",
               lambda c: (c.linear_num_value_heads,), f32=True, clover_extra=True),
    # MoE. router [E, H] kept F32: routing decisions are sensitive
    TensorRule("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", "copy",
               lambda c: (c.num_experts, c.hidden_size), f32=True),
    TensorRule("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "blk.{i}.ffn_gate_shexp.weight", "copy",
               lambda c: (c.shared_expert_intermediate_size, c.hidden_size)),
    TensorRule("model.layers.{i}.mlp.shared_expert.up_proj.weight", "blk.{i}.ffn_up_shexp.weight", "copy",
               lambda c: (c.shared_expert_intermediate_size, c.hidden_size)),
    TensorRule("model.layers.{i}.mlp.shared_expert.down_proj.weight", "blk.{i}.ffn_down_shexp.weight", "copy",
               lambda c: (c.hidden_size, c.shared_expert_intermediate_size)),
    # [1, H] -> [H]
    TensorRule("model.layers.{i}.mlp.shared_expert_gate.weight", "blk.{i}.ffn_gate_inp_shexp.weight", "squeeze",
               lambda c: (1, c.hidden_size), f32=True),
    # MTP block (layer index L = num_hidden_layers in GGUF); its decoder layer reuses the rows above
    TensorRule("mtp.fc.weight", "blk.{L}.nextn.eh_proj.weight", "copy", lambda c: (c.hidden_size, 2 * c.hidden_size)),
    TensorRule("mtp.pre_fc_norm_embedding.weight", "blk.{L}.nextn.enorm.weight", "plus_one", _h, f32=True),
    TensorRule("mtp.pre_fc_norm_hidden.weight", "blk.{L}.nextn.hnorm.weight", "plus_one", _h, f32=True),
    TensorRule("mtp.norm.weight", "blk.{L}.nextn.shared_head_norm.weight", "plus_one", _h, f32=True),
)

# Experts: stacked into one 3-D tensor per layer and kind. Per-expert HF tensors [I, H] / [H, I]; fused HF
# gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I].
EXPERT_KINDS = {"gate": "blk.{i}.ffn_gate_exps.weight", "up": "blk.{i}.ffn_up_exps.weight",
                "down": "blk.{i}.ffn_down_exps.weight"}
PER_EXPERT_RE = re.compile(r"^model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")
FUSED_RE = re.compile(r"^model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(?P<j>\d+)\.(?P<rest>.+)$")


# GGUF names of the Clover extras (the block-mode tensors a qwen35moe file leaves out)
CLOVER_EXTRA_RE = re.compile("^(?:" + "|".join(re.escape(r.gguf).replace(r"\{i\}", r"\d+")
                                               for r in TENSOR_RULES if r.clover_extra) + ")$")


def expert_shape(cfg: CloverConfig, kind: str) -> Shape:
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    return (cfg.num_experts, h, i) if kind == "down" else (cfg.num_experts, i, h)


def match_rule(name: str) -> tuple[TensorRule, int | None] | None:
    for rule in TENSOR_RULES:
        if m := rule.regex.match(name):
            return rule, int(m["i"]) if "i" in m.groupdict() else None
    return None
