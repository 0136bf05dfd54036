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


def _per_head(a: np.ndarray, cfg: CloverConfig) -> np.ndarray:
    """[Hv], or one value ([] / [1]) for every value head."""
    a = _as_f32(a).reshape(-1)
    return np.repeat(a, cfg.linear_num_value_heads) if a.size == 1 else a


TRANSFORMS: dict[str, Callable[[np.ndarray, CloverConfig], np.ndarray]] = {
    "copy": lambda a, cfg: a,
    # zero-centred RMSNorm weight w: the runtime multiplies by the stored value, so store 1 + w
    "plus_one": lambda a, cfg: _as_f32(a) + np.float32(1.0),
    # A_log -> -exp(A_log): the per-head log-decay factor the runtime multiplies softplus(a + dt) by
    # (computed in float64 and rounded once: what upstream's converter writes, bit for bit)
    "neg_exp_heads": lambda a, cfg: grouped_to_tiled((-np.exp(a.astype(np.float64))).astype(np.float32), 0, cfg, 1),
    "heads": lambda a, cfg: grouped_to_tiled(_as_f32(a), 0, cfg, 1),
    # Clover's per-head block-mode vectors; a checkpoint may hold one value for every head ([] or [1]): broadcast
    "block_heads": lambda a, cfg: grouped_to_tiled(_per_head(a, cfg), 0, cfg, 1),
    # bd_softmax_logit_scale -> tau = exp(.), stored ready to multiply (float64, rounded once)
    "exp_block_heads": lambda a, cfg: grouped_to_tiled(np.exp(_per_head(a, cfg).astype(np.float64)).astype(np.float32),
                                                       0, cfg, 1),
    # [C, 1, K] -> [C, K] (ggml ne {K, C}, what ggml_ssm_conv takes), v channels tiled
    "conv": lambda a, cfg: _tile_v_part(_as_f32(a).reshape(a.shape[0], a.shape[-1]), cfg),
    "qkv_rows": lambda a, cfg: _tile_v_part(a, cfg),
    "v_rows": lambda a, cfg: grouped_to_tiled(a, 0, cfg, cfg.linear_value_head_dim),
    "head_rows": lambda a, cfg: grouped_to_tiled(a, 0, cfg, 1),
    "v_cols": lambda a, cfg: grouped_to_tiled(a, 1, cfg, cfg.linear_value_head_dim),
}

def tiled_to_grouped(a: np.ndarray, axis: int, cfg: CloverConfig, head_dim: int) -> np.ndarray:
    """grouped_to_tiled undone: value heads along `axis` back in HF's grouped order."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk == hv:
        return a
    axis = axis % a.ndim
    shape = a.shape
    a = a.reshape(shape[:axis] + (hv // hk, hk, head_dim) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def _untile_v_part(a: np.ndarray, cfg: CloverConfig) -> np.ndarray:
    qk = 2 * cfg.key_dim
    return np.concatenate([a[:qk], tiled_to_grouped(a[qk:], 0, cfg, cfg.linear_value_head_dim)], axis=0)


# Each transform undone, GGUF values (float32) -> the HF tensor's values: how the reference reads a GGUF
# (reference.load_gguf). Shapes come back as the reference holds them: a conv as [C, K], a per-head vector as [Hv].
INVERSE: dict[str, Callable[[np.ndarray, CloverConfig], np.ndarray]] = {
    "copy": lambda a, cfg: a,
    "plus_one": lambda a, cfg: a - np.float32(1.0),
    "neg_exp_heads": lambda a, cfg: tiled_to_grouped(np.log(-a.astype(np.float64)).astype(np.float32), 0, cfg, 1),
    "heads": lambda a, cfg: tiled_to_grouped(a, 0, cfg, 1),
    "block_heads": lambda a, cfg: tiled_to_grouped(a, 0, cfg, 1),
    "exp_block_heads": lambda a, cfg: tiled_to_grouped(np.log(a.astype(np.float64)).astype(np.float32), 0, cfg, 1),
    "conv": lambda a, cfg: _untile_v_part(a, cfg),
    "qkv_rows": lambda a, cfg: _untile_v_part(a, cfg),
    "v_rows": lambda a, cfg: tiled_to_grouped(a, 0, cfg, cfg.linear_value_head_dim),
    "head_rows": lambda a, cfg: tiled_to_grouped(a, 0, cfg, 1),
    "v_cols": lambda a, cfg: tiled_to_grouped(a, 1, cfg, cfg.linear_value_head_dim),
}
assert set(INVERSE) == set(TRANSFORMS)

# the transforms that accept one value for every value head ([] or [1]) besides [Hv]
BROADCAST_HEADS = {"block_heads", "exp_block_heads"}

# The transforms that change a shape (the others keep it): out_shape computes the GGUF shape without any data.
SHAPE_CHANGES: dict[str, Callable[[Shape], Shape]] = {
    "conv": lambda s: (s[0], s[-1]),
}


def out_shape(transform: str, shape: Shape) -> Shape:
    return tuple(SHAPE_CHANGES.get(transform, tuple)(tuple(shape)))


# Transforms that only move elements: they can act on the stored bits (BF16 kept as uint16) without a float trip.
REORDER_ONLY = {"copy", "qkv_rows", "v_rows", "head_rows", "v_cols"}


# How make_tiny initialises a tensor of a random test model: ("normal", std), ("fan_in", scale) = normal with
# std scale / sqrt(last dimension), ("uniform", lo, hi), ("log_uniform", lo, hi) (log of a uniform draw).
Init = tuple

LAYER_SCOPES = ("layer", "attention", "gdn")


def _pattern(template: str, **groups: str) -> re.Pattern:
    """A name template ("model.layers.{i}.x") as a regex whose {fields} are named groups matching `groups`."""
    rx = re.escape(template)
    for name, sub in groups.items():
        rx = rx.replace(re.escape("{" + name + "}"), f"(?P<{name}>{sub})")
    return re.compile("^" + rx + "$")


@dataclass(frozen=True)
class TensorRule:
    hf: str  # pattern over normalised HF names; {i} = layer index
    gguf: str  # GGUF name; {i} = block index
    transform: str
    hf_shape: Callable[[CloverConfig], Shape]  # what config.json implies
    f32: bool = False  # always stored as F32 (small, numerically sensitive, or never quantized by llama.cpp)
    clover_extra: bool = False
    init: Init = ("fan_in", 1.0)  # unit-variance activations
    # other shapes a checkpoint may store the tensor in (the real Clover's block tensors are not documented: we
    # take what the transform can read), besides hf_shape
    also: Callable[[CloverConfig], tuple[Shape, ...]] = lambda c: ()

    def accepts(self, shape: Shape, cfg: CloverConfig) -> bool:
        return tuple(shape) == tuple(self.hf_shape(cfg)) or tuple(shape) in self.also(cfg)

    @property
    def regex(self) -> re.Pattern:
        return _pattern(self.hf, i=r"\d+")

    @property
    def scope(self) -> str:
        """model (once), layer (every decoder layer), attention / gdn (full-attention / linear-attention layers
        only), mtp (the MTP block's own tensors)."""
        if "{i}" not in self.hf:
            return "mtp" if self.hf.startswith("mtp.") else "model"
        return "attention" if ".self_attn." in self.hf else "gdn" if ".linear_attn." in self.hf else "layer"


def _h(c: CloverConfig) -> Shape:
    return (c.hidden_size,)


NORM: Init = ("normal", 0.1)  # zero-centred norm weights
# residual-branch outputs at half scale: like trained models, each layer nudges the residual stream, which keeps
# float32 round-off from being amplified layer after layer
RESIDUAL: Init = ("fan_in", 0.5)

# One row per role, in a checkpoint's natural order (embedding, layers, final norm, head, MTP). Layout comments
# give the HF shape -> GGUF shape (numpy order). Everything else that lists tensors is derived from this table:
# the converter's expected names, the test-model generator (shapes.py) and the reference's parameter names.
TENSOR_RULES: tuple[TensorRule, ...] = (
    # [V, H] -> [V, H]; tied logits stay O(10)
    TensorRule("model.embed_tokens.weight", "token_embd.weight", "copy", lambda c: (c.vocab_size, c.hidden_size),
               init=("normal", 0.5)),
    TensorRule("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "plus_one", _h, f32=True,
               init=NORM),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight", "plus_one",
               _h, f32=True, init=NORM),
    # gated attention. q_proj [nh*2*hd, H]: per head [query | gate] rows, kept as is (qwen35moe splits it)
    TensorRule("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "copy",
               lambda c: (c.num_attention_heads * c.head_dim * 2, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "copy",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "copy",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "copy",
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), init=RESIDUAL),
    TensorRule("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "plus_one",
               lambda c: (c.head_dim,), f32=True, init=NORM),
    TensorRule("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "plus_one",
               lambda c: (c.head_dim,), f32=True, init=NORM),
    # gated deltanet. in_proj_qkv [conv_dim, H], rows q | k | v, v rows tiled
    TensorRule("model.layers.{i}.linear_attn.in_proj_qkv.weight", "blk.{i}.attn_qkv.weight", "qkv_rows",
               lambda c: (c.conv_dim, c.hidden_size)),
    TensorRule("model.layers.{i}.linear_attn.in_proj_z.weight", "blk.{i}.attn_gate.weight", "v_rows",
               lambda c: (c.value_dim, c.hidden_size)),
    # [Hv, H] in the output type, as upstream's converter writes them (the quantize recipes keep them F32)
    TensorRule("model.layers.{i}.linear_attn.in_proj_b.weight", "blk.{i}.ssm_beta.weight", "head_rows",
               lambda c: (c.linear_num_value_heads, c.hidden_size)),
    TensorRule("model.layers.{i}.linear_attn.in_proj_a.weight", "blk.{i}.ssm_alpha.weight", "head_rows",
               lambda c: (c.linear_num_value_heads, c.hidden_size)),
    # [conv_dim, 1, K] -> [conv_dim, K]
    TensorRule("model.layers.{i}.linear_attn.conv1d.weight", "blk.{i}.ssm_conv1d.weight", "conv",
               lambda c: (c.conv_dim, 1, c.linear_conv_kernel_dim), f32=True, init=("normal", 0.5)),
    TensorRule("model.layers.{i}.linear_attn.dt_bias", "blk.{i}.ssm_dt.bias", "heads",
               lambda c: (c.linear_num_value_heads,), f32=True, init=("normal", 0.5)),
    TensorRule("model.layers.{i}.linear_attn.A_log", "blk.{i}.ssm_a", "neg_exp_heads",
               lambda c: (c.linear_num_value_heads,), f32=True, init=("log_uniform", 1.0, 16.0)),
    # gated RMSNorm weight [dv], used as is (not zero-centred)
    TensorRule("model.layers.{i}.linear_attn.norm.weight", "blk.{i}.ssm_norm.weight", "copy",
               lambda c: (c.linear_value_head_dim,), f32=True, init=("uniform", 0.8, 1.2)),
    # out_proj [H, value_dim], columns tiled
    TensorRule("model.layers.{i}.linear_attn.out_proj.weight", "blk.{i}.ssm_out.weight", "v_cols",
               lambda c: (c.hidden_size, c.value_dim), init=RESIDUAL),
    # Clover's block-mode tensors, the real checkpoint's names (upstream's converter drops exactly these four);
    # their roles are our reading (docs/architecture.md 3a-3b). [conv_dim, 1, Kr] (or [conv_dim, Kr]) -> [conv_dim, Kr]
    TensorRule("model.layers.{i}.linear_attn.conv_right_weight", "blk.{i}.ssm_conv1d_right.weight", "conv",
               lambda c: (c.conv_dim, 1, c.right_kernel), f32=True, clover_extra=True, init=("normal", 0.3),
               also=lambda c: ((c.conv_dim, c.right_kernel),)),
    # [Hv] (or one value) -> tau = exp(.)
    TensorRule("model.layers.{i}.linear_attn.bd_softmax_logit_scale", "blk.{i}.ssm_block_scale", "exp_block_heads",
               lambda c: (c.linear_num_value_heads,), f32=True, clover_extra=True, init=("uniform", 0.5, 2.0),
               also=lambda c: ((), (1,))),
    # [Hv] (or one value): the history's logit in the block softmax, and the weight of the block term
    TensorRule("model.layers.{i}.linear_attn.bd_softmax_history_bias", "blk.{i}.ssm_block_history_bias",
               "block_heads", lambda c: (c.linear_num_value_heads,), f32=True, clover_extra=True,
               init=("normal", 1.0), also=lambda c: ((), (1,))),
    TensorRule("model.layers.{i}.linear_attn.bd_softmax_history_c", "blk.{i}.ssm_block_history_c", "block_heads",
               lambda c: (c.linear_num_value_heads,), f32=True, clover_extra=True, init=("uniform", 0.3, 1.0),
               also=lambda c: ((), (1,))),
    # MoE. router [E, H] kept F32: routing decisions are sensitive. The experts follow it (EXPERT_KINDS below).
    TensorRule("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", "copy",
               lambda c: (c.num_experts, c.hidden_size), f32=True, init=("fan_in", 2.0)),
    TensorRule("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "blk.{i}.ffn_gate_shexp.weight", "copy",
               lambda c: (c.shared_expert_intermediate_size, c.hidden_size)),
    TensorRule("model.layers.{i}.mlp.shared_expert.up_proj.weight", "blk.{i}.ffn_up_shexp.weight", "copy",
               lambda c: (c.shared_expert_intermediate_size, c.hidden_size)),
    TensorRule("model.layers.{i}.mlp.shared_expert.down_proj.weight", "blk.{i}.ffn_down_shexp.weight", "copy",
               lambda c: (c.hidden_size, c.shared_expert_intermediate_size), init=RESIDUAL),
    # [1, H], kept as upstream's converter writes it (ggml ne {H, 1}; llama.cpp loads it as the [H] gate)
    TensorRule("model.layers.{i}.mlp.shared_expert_gate.weight", "blk.{i}.ffn_gate_inp_shexp.weight", "copy",
               lambda c: (1, c.hidden_size), f32=True),
    TensorRule("model.norm.weight", "output_norm.weight", "plus_one", _h, f32=True, init=NORM),
    TensorRule("lm_head.weight", "output.weight", "copy", lambda c: (c.vocab_size, c.hidden_size)),
    # MTP block (layer index L = num_hidden_layers in GGUF); its decoder layer reuses the rows above
    TensorRule("mtp.fc.weight", "blk.{L}.nextn.eh_proj.weight", "copy", lambda c: (c.hidden_size, 2 * c.hidden_size)),
    TensorRule("mtp.pre_fc_norm_embedding.weight", "blk.{L}.nextn.enorm.weight", "plus_one", _h, f32=True, init=NORM),
    TensorRule("mtp.pre_fc_norm_hidden.weight", "blk.{L}.nextn.hnorm.weight", "plus_one", _h, f32=True, init=NORM),
    TensorRule("mtp.norm.weight", "blk.{L}.nextn.shared_head_norm.weight", "plus_one", _h, f32=True, init=NORM),
)
ROUTER = "model.layers.{i}.mlp.gate.weight"  # the experts come right after it in a layer

# Experts: stacked into one 3-D tensor per layer and kind, [E, I, H] (gate, up) or [E, H, I] (down). HF stores
# them per expert (PER_EXPERT: [I, H] / [H, I] each) or fused (FUSED: gate_up_proj [E, 2I, H], gate rows first;
# down_proj [E, H, I]).
EXPERT_KINDS = {"gate": "blk.{i}.ffn_gate_exps.weight", "up": "blk.{i}.ffn_up_exps.weight",
                "down": "blk.{i}.ffn_down_exps.weight"}
EXPERT_INIT: dict[str, Init] = {"gate": ("fan_in", 1.0), "up": ("fan_in", 1.0), "down": RESIDUAL}
PER_EXPERT = "model.layers.{i}.mlp.experts.{e}.{kind}_proj.weight"
FUSED = "model.layers.{i}.mlp.experts.{kind}"
FUSED_KINDS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}  # HF fused tensor -> the kinds it holds
PER_EXPERT_RE = _pattern(PER_EXPERT, i=r"\d+", e=r"\d+", kind="|".join(EXPERT_KINDS))
FUSED_RE = _pattern(FUSED, i=r"\d+", kind="|".join(FUSED_KINDS))
MTP_LAYER = "mtp.layers.{j}.{rest}"
MTP_LAYER_RE = _pattern(MTP_LAYER, j=r"\d+", rest=".+")


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


def mtp_as_layer(name: str, n_layers: int) -> tuple[str, int | None]:
    """An MTP decoder layer's tensor is an ordinary layer's at index L + j: -> (the name as such, j or None)."""
    if m := MTP_LAYER_RE.match(name):
        return f"model.layers.{n_layers + int(m['j'])}.{m['rest']}", int(m["j"])
    return name, None


def gguf_names(name: str, n_layers: int) -> list[str]:
    """The GGUF tensor(s) a normalised HF tensor goes into ([] for a name the map does not know)."""
    mapped, _ = mtp_as_layer(name, n_layers)
    if m := PER_EXPERT_RE.match(mapped):
        return [EXPERT_KINDS[m["kind"]].format(i=m["i"])]
    if m := FUSED_RE.match(mapped):
        return [EXPERT_KINDS[k].format(i=m["i"]) for k in FUSED_KINDS[m["kind"]]]
    if hit := match_rule(mapped):
        rule, bid = hit
        return [rule.gguf.format(i=bid, L=n_layers)]
    return []
