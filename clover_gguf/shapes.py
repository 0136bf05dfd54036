"""The tensor table of a Clover checkpoint: every HF tensor name with its shape (and the random init make_tiny uses),
derived from tensor_map.TENSOR_RULES for a given config.

Shared by the test-model generator (clover_gguf.testing.make_tiny), the header-only skeleton that plans a
quantization from a config.json alone (clover_gguf.skeleton), the converter's list of expected tensors and the
reference model's parameter names.
"""

from __future__ import annotations

from clover_gguf.config import CloverConfig
from clover_gguf.tensor_map import (EXPERT_INIT, FUSED, FUSED_KINDS, LAYER_SCOPES, MTP_LAYER, PER_EXPERT, ROUTER,
                                    TENSOR_RULES, Init, expert_shape)

Entry = tuple[str, tuple[int, ...], tuple]  # (HF name, shape, init)


def _init(spec: Init, shape: tuple[int, ...]) -> tuple:
    """A table init spec as generate() takes it: ('fan_in', s) becomes a normal of std s / sqrt(last dim)."""
    if spec[0] == "fan_in":
        return ("normal", spec[1] * shape[-1] ** -0.5)
    return spec


def _in_layer(template: str) -> str:
    """"model.layers.{i}.mlp.x" -> "mlp.x": the part of a layer tensor's name after the layer prefix."""
    return template.split("{i}.", 1)[1]


def _experts(cfg: CloverConfig, prefix: str, experts: str) -> list[Entry]:
    out = []
    if experts == "fused":
        for name, kinds in FUSED_KINDS.items():
            e, rows, cols = expert_shape(cfg, kinds[0])
            shape = (e, rows * len(kinds), cols)  # gate_up: gate rows, then up rows
            out.append((prefix + _in_layer(FUSED).format(kind=name), shape, _init(EXPERT_INIT[kinds[0]], shape)))
        return out
    for x in range(cfg.num_experts):
        for kind in EXPERT_INIT:
            shape = expert_shape(cfg, kind)[1:]
            out.append((prefix + _in_layer(PER_EXPERT).format(e=x, kind=kind), shape,
                        _init(EXPERT_INIT[kind], shape)))
    return out


def layer_tensors(cfg: CloverConfig, prefix: str, full_attention: bool, experts: str, extras: bool) -> list[Entry]:
    """(name, shape, init) for one decoder layer; its names start with `prefix` instead of `model.layers.{i}.`."""
    scopes = {"layer", "attention" if full_attention else "gdn"}
    out: list[Entry] = []
    for rule in TENSOR_RULES:
        if rule.scope not in scopes or (rule.clover_extra and not extras):
            continue
        shape = rule.hf_shape(cfg)
        out.append((prefix + _in_layer(rule.hf), shape, _init(rule.init, shape)))
        if rule.hf == ROUTER:
            out += _experts(cfg, prefix, experts)
    return out


def checkpoint_tensors(cfg: CloverConfig, experts: str = "per-expert", prefix: bool = False, mtp: int = 0,
                       zero_extras: bool = False) -> list[Entry]:
    """The full (name, shape, init) table of a checkpoint in a natural file order, with `mtp` MTP layers
    (True = 1). prefix: the ForConditionalGeneration layout (`model.language_model.`, plus a vision tensor)."""
    root = "model.language_model." if prefix else "model."
    out: list[Entry] = []
    layers_done = False
    for rule in TENSOR_RULES:
        if rule.scope in LAYER_SCOPES:
            if not layers_done:
                for layer in range(cfg.num_hidden_layers):
                    out += layer_tensors(cfg, f"{root}layers.{layer}.", cfg.is_full_attention(layer), experts,
                                         cfg.is_clover)
                layers_done = True
            continue
        if rule.scope == "mtp" and not mtp or rule.gguf == "output.weight" and cfg.tie_word_embeddings:
            continue
        shape = rule.hf_shape(cfg)
        name = root + rule.hf[len("model."):] if rule.hf.startswith("model.") else rule.hf
        out.append((name, shape, _init(rule.init, shape)))
    for j in range(int(mtp)):
        out += layer_tensors(cfg, MTP_LAYER.format(j=j, rest=""), True, experts, False)
    if prefix:
        out.append(("model.visual.patch_embed.proj.weight", (16, 3, 2, 2), ("normal", 0.1)))
    if zero_extras:
        extras = tuple(_in_layer(rule.hf) for rule in TENSOR_RULES if rule.clover_extra)
        out = [(n, s, ("zero",) if n.endswith(extras) else init) for n, s, init in out]
    return out
