"""The tensor table of a Clover checkpoint: every HF tensor name with its shape (and the random init make_tiny uses).

Shared by the test-model generator (clover_gguf.testing.make_tiny) and the header-only skeleton that plans a
quantization from a config.json alone (clover_gguf.skeleton).
"""

from __future__ import annotations

from clover_gguf.config import CloverConfig


def layer_tensors(cfg: CloverConfig, prefix: str, full_attention: bool, experts: str, extras: bool):
    """(name, shape, init) for one decoder layer. init: ('normal', std) | ('uniform', lo, hi) | ('log_uniform', lo, hi)."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hv, e, i, si = cfg.linear_num_value_heads, cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    w = lambda fan_in: ("normal", fan_in ** -0.5)  # noqa: E731 - unit-variance activations
    # residual-branch outputs at half scale: like trained models, each layer nudges the residual stream, which
    # keeps float32 round-off from being amplified layer after layer
    wo = lambda fan_in: ("normal", 0.5 * fan_in ** -0.5)  # noqa: E731
    out = [(prefix + "input_layernorm.weight", (h,), ("normal", 0.1)),
           (prefix + "post_attention_layernorm.weight", (h,), ("normal", 0.1))]
    if full_attention:
        a = prefix + "self_attn."
        out += [(a + "q_proj.weight", (nh * hd * 2, h), w(h)), (a + "k_proj.weight", (nkv * hd, h), w(h)),
                (a + "v_proj.weight", (nkv * hd, h), w(h)), (a + "o_proj.weight", (h, nh * hd), wo(nh * hd)),
                (a + "q_norm.weight", (hd,), ("normal", 0.1)), (a + "k_norm.weight", (hd,), ("normal", 0.1))]
    else:
        g = prefix + "linear_attn."
        out += [(g + "in_proj_qkv.weight", (cfg.conv_dim, h), w(h)), (g + "in_proj_z.weight", (cfg.value_dim, h), w(h)),
                (g + "in_proj_b.weight", (hv, h), w(h)), (g + "in_proj_a.weight", (hv, h), w(h)),
                (g + "conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), ("normal", 0.5)),
                (g + "dt_bias", (hv,), ("normal", 0.5)), (g + "A_log", (hv,), ("log_uniform", 1.0, 16.0)),
                (g + "norm.weight", (cfg.linear_value_head_dim,), ("uniform", 0.8, 1.2)),
                (g + "out_proj.weight", (h, cfg.value_dim), wo(cfg.value_dim))]
        if extras:
            out += [(g + "conv1d_right.weight", (cfg.conv_dim, 1, cfg.right_kernel), ("normal", 0.3)),
                    (g + "block_attn_log_scale", (hv,), ("uniform", 0.5, 2.0)),
                    (g + "block_attn_gate", (hv,), ("normal", 1.0))]
    m = prefix + "mlp."
    out.append((m + "gate.weight", (e, h), ("normal", 2 * h ** -0.5)))
    if experts == "fused":
        out += [(m + "experts.gate_up_proj", (e, 2 * i, h), w(h)), (m + "experts.down_proj", (e, h, i), wo(i))]
    else:
        for x in range(e):
            out += [(m + f"experts.{x}.gate_proj.weight", (i, h), w(h)), (m + f"experts.{x}.up_proj.weight", (i, h), w(h)),
                    (m + f"experts.{x}.down_proj.weight", (h, i), wo(i))]
    out += [(m + "shared_expert.gate_proj.weight", (si, h), w(h)), (m + "shared_expert.up_proj.weight", (si, h), w(h)),
            (m + "shared_expert.down_proj.weight", (h, si), wo(si)), (m + "shared_expert_gate.weight", (1, h), w(h))]
    return out


def checkpoint_tensors(cfg: CloverConfig, experts: str = "per-expert", prefix: bool = False, mtp: bool = False,
                       zero_extras: bool = False):
    """The full (name, shape, init) table of a checkpoint, in a natural file order."""
    root = "model.language_model." if prefix else "model."
    h = cfg.hidden_size
    out = [(root + "embed_tokens.weight", (cfg.vocab_size, h), ("normal", 0.5))]  # tied logits stay O(10)
    for layer in range(cfg.num_hidden_layers):
        out += layer_tensors(cfg, f"{root}layers.{layer}.", cfg.is_full_attention(layer), experts, cfg.is_clover)
    out.append((root + "norm.weight", (h,), ("normal", 0.1)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, h), ("normal", h ** -0.5)))
    if mtp:
        mp = "mtp."
        out += [(mp + "fc.weight", (h, 2 * h), ("normal", (2 * h) ** -0.5)),
                (mp + "pre_fc_norm_embedding.weight", (h,), ("normal", 0.1)),
                (mp + "pre_fc_norm_hidden.weight", (h,), ("normal", 0.1)), (mp + "norm.weight", (h,), ("normal", 0.1))]
        out += layer_tensors(cfg, mp + "layers.0.", True, experts, False)
    if prefix:
        out.append(("model.visual.patch_embed.proj.weight", (16, 3, 2, 2), ("normal", 0.1)))
    if zero_extras:
        out = [(n, s, ("zero",) if n.endswith(("conv1d_right.weight", "block_attn_log_scale", "block_attn_gate"))
                else init) for n, s, init in out]
    return out
