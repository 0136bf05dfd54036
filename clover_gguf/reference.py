"""A readable PyTorch implementation of Clover (docs/architecture.md): the executable definition every other
numeric path in this project is checked against.

Written for clarity, not speed: the gated delta rule runs token by token, experts run one by one. CPU, float32
or float64, autograd works. Tensors carry a batch dimension `N` internally; the public methods also take 1-D ids.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from clover_gguf.config import CloverConfig
from clover_gguf.errors import UserError
from clover_gguf.metadata import READING, READING_FIELD, READINGS, check_reading


# ---------------------------------------------------------------------------------------------------------------
# State carried from a prefix: what llama.cpp keeps in its KV cache and recurrent memory.
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerState:
    # full attention: keys/values after norm and RoPE, [N, n_kv_heads, P, head_dim]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    # gated deltanet: last K-1 conv inputs [N, K-1, conv_dim] and the delta-rule state [N, Hv, dk, dv]
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefixState:
    """Immutable: every forward returns a new state, so block mode cannot touch the prefix by construction."""

    layers: tuple[LayerState, ...]
    n_past: int


# ---------------------------------------------------------------------------------------------------------------
# The decoding backend on this model (clover_gguf.decoding runs ar / diffusion / draft-self on it)
# ---------------------------------------------------------------------------------------------------------------
class ReferenceBackend:
    """decoding.Backend over CloverModel (as runtime.LlamaBackend is over llama.cpp). Its PrefixState is immutable, so rollback just returns
    to the state before the latest commit and re-runs the kept tokens (backend work, not a counted pass). It runs
    every reading of the block tensors (the model's `reading`)."""

    READINGS = tuple(READINGS)  # the readings of the block softmax this backend can run
    # what runtime.CloverRuntime reads and writes of its backend around an answer (LlamaBackend's figures)
    extra_passes, prefill_seconds, keep_at, reused = 0, 0.0, None, 0

    def __init__(self, model: CloverModel, eos_ids: Sequence[int] | None = None,
                 coreset: bool | float | None = None):
        self.model = model
        cfg = model.cfg
        if cfg.mask_token_id is None:
            raise ValueError("the checkpoint has no mask_token_id: block mode is unavailable")
        self.mask_token_id = int(cfg.mask_token_id)
        eos = eos_ids if eos_ids is not None else cfg.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.block_size = int(cfg.block_size)
        self.coreset = coreset
        self.reset()

    @property
    def n_past(self) -> int:
        return len(self._ids)

    def reset(self) -> None:
        self._ids: list[int] = []
        self._state = self.model.empty_state()
        self._before_last: tuple[PrefixState, int] | None = None  # (state, n_past) before the latest commit

    def _run(self, ids: Sequence[int], state: PrefixState, block: bool = False):
        with torch.no_grad():
            x = torch.tensor([list(ids)], dtype=torch.long)
            logits, new = self.model.run(x, state, block=block, coreset=self.coreset if block else None)
        return logits[0].numpy(), new

    def commit(self, ids: Sequence[int]) -> np.ndarray:
        if not len(ids):
            raise ValueError("commit needs at least one token")
        self._before_last = (self._state, len(self._ids))
        logits, self._state = self._run(ids, self._state)
        self._ids.extend(int(t) for t in ids)
        return logits

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        return self.commit(ids)[-1]

    def block_logits(self, block: Sequence[int]) -> np.ndarray:
        logits, _ = self._run(block, self._state, block=True)  # the new state is thrown away
        return logits

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._before_last is None or len(self._ids) - n < self._before_last[1]:
            raise ValueError("rollback reaches past the latest commit")
        state, n0 = self._before_last
        keep = self._ids[n0:len(self._ids) - n]
        self._ids = self._ids[:n0]
        self._state = state
        if keep:
            _, self._state = self._run(keep, state)
            self._ids.extend(keep)
        self._before_last = None


def zero_centred_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """RoPE on the first `rotary_dim` dims of the last axis, pairs (j, j + rotary_dim/2). x: [..., T, d]."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / rotary_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def coreset_keep_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Block coreset routing (spec 3d). probs: [T, E] router softmax of the block's tokens -> bool [E] (the set S)."""
    n_exp = probs.shape[-1]
    top_idx = probs.topk(top_k, dim=-1).indices  # [T, k]
    candidate = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top_idx, True)
    mass = (probs * candidate).sum(0)  # [E] aggregated mass of each expert over the tokens that picked it
    # rank by mass descending, ties to the lower index: a stable sort of the negated mass does exactly that
    order = torch.sort(-mass, stable=True).indices
    ranked = mass[order]
    cum = ranked.cumsum(0)
    # smallest leading set whose sum reaches top_p of the total; cum - ranked is the sum *before* each expert
    n_keep = int((cum - ranked < top_p * cum[-1]).sum().item())
    n_keep = min(n_exp, max(n_keep, top_k))  # our reading: never fewer than k experts
    keep = torch.zeros(n_exp, dtype=torch.bool)
    keep[order[:n_keep]] = True
    return keep


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (spec 2, step 6).

    q (already scaled by 1/sqrt(dk)), k: [N, T, Hv, dk]; v: [N, T, Hv, dv]; g (log decay), beta: [N, T, Hv];
    s: the state [N, Hv, dk, dv] -> (o [N, T, Hv, dv], the state after the last token)."""
    outs = []
    for i in range(q.shape[1]):
        s = s * torch.exp(g[:, i])[..., None, None]
        kv_mem = torch.einsum("nhk,nhkv->nhv", k[:, i], s)
        delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
        s = s + torch.einsum("nhk,nhv->nhkv", k[:, i], delta)
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, i], s))
    return torch.stack(outs, dim=1), s


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------
class GatedAttention(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, nh * hd * 2, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = nn.Parameter(torch.zeros(hd))
        self.k_norm = nn.Parameter(torch.zeros(hd))

    def forward(self, x: torch.Tensor, st: LayerState, n_past: int, block: bool) -> tuple[torch.Tensor, LayerState]:
        cfg = self.cfg
        n, t, _ = x.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self.q_proj(x).view(n, t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, t, nh * hd)  # per head: [query | gate]
        q = zero_centred_rms_norm(q, self.q_norm, cfg.rms_norm_eps).transpose(1, 2)  # [N, nh, T, hd]
        k = zero_centred_rms_norm(self.k_proj(x).view(n, t, nkv, hd), self.k_norm, cfg.rms_norm_eps).transpose(1, 2)
        v = self.v_proj(x).view(n, t, nkv, hd).transpose(1, 2)
        pos = torch.arange(n_past, n_past + t)
        q = rotate_neox(q, pos, cfg.rotary_dim, cfg.rope_theta)
        k = rotate_neox(k, pos, cfg.rotary_dim, cfg.rope_theta)
        if st.k is not None:
            k, v = torch.cat([st.k, k], dim=2), torch.cat([st.v, v], dim=2)
        rep = nh // nkv
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ kk.transpose(-1, -2) / math.sqrt(hd)  # [N, nh, T, P+T]
        if not block:  # causal: query t sees keys up to n_past + t; block mode sees the whole block (spec 3c)
            qpos = torch.arange(t)[:, None] + n_past
            kpos = torch.arange(k.shape[2])[None, :]
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
        att = scores.softmax(-1) @ vv  # [N, nh, T, hd]
        att = att.transpose(1, 2).reshape(n, t, nh * hd)
        return self.o_proj(att * torch.sigmoid(gate)), LayerState(k=k, v=v)


def block_softmax(reading: str, o_gdn: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  s0: torch.Tensor, logit_scale: torch.Tensor, history_bias: torch.Tensor, history_c: torch.Tensor
                  ) -> torch.Tensor:
    """The GDN core output of a block under `reading` (metadata.READINGS; spec 3b writes each out).

    o_gdn: the gated delta rule's output over the block [N, T, Hv, dv]; q, k: L2-normalised, heads repeated to the
    value heads, no 1/sqrt(dk) [N, T, Hv, dk]; v [N, T, Hv, dv]; s0: the clean prefix state [N, Hv, dk, dv];
    the three bd_softmax tensors [Hv] as the checkpoint holds them (logit_scale is log tau)."""
    n, t, hv, dk = q.shape
    tau = torch.exp(logit_scale)  # [Hv]
    scores = torch.einsum("nthd,nshd->nhts", q, k) * tau[None, :, None, None]  # [N, Hv, T, T], both directions
    history = history_bias[None, :, None, None].expand(n, hv, t, 1).to(scores.dtype)  # the history's logit b_h
    p = torch.cat([scores, history], dim=-1).softmax(-1)  # over [block | history]
    o_sm = torch.einsum("nhts,nshv->nthv", p[..., :t], v)
    c = history_c[None, None, :, None]
    if reading == "hist-sink-add":  # a sink: the history's share is left out
        return o_gdn + c * o_sm
    # the history's value: what the delta rule's output reads from the clean prefix state for q_t
    v_hist = torch.einsum("nthk,nhkv->nthv", q / math.sqrt(dk), s0)
    o_sm = o_sm + p[..., t].permute(0, 2, 1)[..., None] * v_hist
    if reading == "hist-read-add":
        return o_gdn + c * o_sm
    if reading == "hist-read-mix":
        return (1 - c) * o_gdn + c * o_sm
    raise ValueError(f"unknown block reading {reading!r}")


class GatedDeltaNet(nn.Module):
    # the recurrence itself; training swaps in a parallel form of the same function (testing/train_tiny.py)
    delta_rule = staticmethod(gated_delta_rule)
    reading = READING  # the block softmax's reading (CloverModel.reading sets it on every GDN layer)

    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.cfg = cfg
        h, hv = cfg.hidden_size, cfg.linear_num_value_heads
        self.in_proj_qkv = nn.Linear(h, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hv, bias=False)
        self.in_proj_a = nn.Linear(h, hv, bias=False)
        self.conv1d = nn.Parameter(torch.zeros(cfg.conv_dim, cfg.linear_conv_kernel_dim))  # HF [C, 1, K] squeezed
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = nn.Parameter(torch.ones(cfg.linear_value_head_dim))  # gated RMSNorm weight, used as is
        self.out_proj = nn.Linear(cfg.value_dim, h, bias=False)
        # Clover's block-mode tensors under the real checkpoint's names; their roles are our reading (spec 3a, 3b)
        self.conv_right_weight = nn.Parameter(torch.zeros(cfg.conv_dim, cfg.right_kernel))  # HF [C, 1, Kr] squeezed
        self.bd_softmax_logit_scale = nn.Parameter(torch.zeros(hv))
        self.bd_softmax_history_bias = nn.Parameter(torch.zeros(hv))
        self.bd_softmax_history_c = nn.Parameter(torch.zeros(hv))

    def forward(self, x: torch.Tensor, st: LayerState, block: bool) -> tuple[torch.Tensor, LayerState]:
        cfg = self.cfg
        n, t, _ = x.shape
        hk, hv, dk, dv, kconv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
        mixed = self.in_proj_qkv(x)  # [N, T, C], channels q | k | v
        past = st.conv if st.conv is not None else mixed.new_zeros(n, kconv - 1, cfg.conv_dim)
        xs = torch.cat([past, mixed], dim=1)  # [N, K-1+T, C]
        # causal depthwise conv: conv[t] = sum_j w[:, j] * xs[t + j]  (xs[t + K-1] is the token itself)
        conv = sum(self.conv1d[:, j] * xs[:, j:j + t] for j in range(kconv))
        if block:
            # right conv: right[t] = sum_{j=1..Kr} wr[:, j-1] * mixed[t + j], zeros past the block's end
            kr = cfg.right_kernel
            padded = torch.cat([mixed, mixed.new_zeros(n, kr, cfg.conv_dim)], dim=1)
            conv = conv + sum(self.conv_right_weight[:, j - 1] * padded[:, j:j + t] for j in range(1, kr + 1))
        u = F.silu(conv)
        q, k, v = torch.split(u, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        rep = hv // hk  # HF order: value head h uses key head h // rep
        q = l2norm(q.reshape(n, t, hk, dk)).repeat_interleave(rep, dim=2)  # [N, T, Hv, dk]
        k = l2norm(k.reshape(n, t, hk, dk)).repeat_interleave(rep, dim=2)
        v = v.reshape(n, t, hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x))  # [N, T, Hv]
        g = -torch.exp(self.A_log) * F.softplus(self.in_proj_a(x) + self.dt_bias)  # log decay, [N, T, Hv]

        s0 = st.ssm if st.ssm is not None else x.new_zeros(n, hv, dk, dv)
        o, s = self.delta_rule(q / math.sqrt(dk), k, v, g, beta, s0)  # [N, T, Hv, dv]

        if block:
            o = block_softmax(self.reading, o, q, k, v, s0, self.bd_softmax_logit_scale,
                              self.bd_softmax_history_bias, self.bd_softmax_history_c)

        z = self.in_proj_z(x).reshape(n, t, hv, dv)
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * self.norm * F.silu(z)
        new_state = LayerState(conv=xs[:, -(kconv - 1):] if kconv > 1 else xs[:, :0], ssm=s)
        return self.out_proj(y.reshape(n, t, cfg.value_dim)), new_state


class SparseMoe(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.cfg = cfg
        h, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_proj = nn.Parameter(torch.zeros(e, i, h))
        self.up_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.shared_gate_proj = nn.Linear(h, si, bias=False)
        self.shared_up_proj = nn.Linear(h, si, bias=False)
        self.shared_down_proj = nn.Linear(si, h, bias=False)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor, coreset_top_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [N, T, k], weights [N, T, k])."""
        k = self.cfg.num_experts_per_tok
        logits = self.gate(x)  # [N, T, E]
        probs = logits.softmax(-1)
        if coreset_top_p is not None:  # restrict each sequence's block to its coreset S
            keep = torch.stack([coreset_keep_mask(p.detach(), k, coreset_top_p) for p in probs])  # [N, E]
            probs = probs * keep[:, None, :]
        w, idx = probs.topk(k, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor, coreset_top_p: float | None) -> torch.Tensor:
        idx, w = self.route(x, coreset_top_p)
        out = torch.zeros_like(x)
        for e in range(self.cfg.num_experts):
            weight = (w * (idx == e)).sum(-1, keepdim=True)  # [N, T, 1], zero where e was not chosen
            if not bool((idx == e).any()):
                continue
            hid = F.silu(x @ self.gate_proj[e].T) * (x @ self.up_proj[e].T)
            out = out + weight * (hid @ self.down_proj[e].T)
        shared = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * shared


class DecoderLayer(nn.Module):
    def __init__(self, cfg: CloverConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.full_attention = cfg.is_full_attention(layer)
        self.input_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        if self.full_attention:
            self.self_attn = GatedAttention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.mlp = SparseMoe(cfg)

    def forward(self, h: torch.Tensor, st: LayerState, n_past: int, block: bool,
                coreset_top_p: float | None) -> tuple[torch.Tensor, LayerState]:
        eps = self.cfg.rms_norm_eps
        x = zero_centred_rms_norm(h, self.input_layernorm, eps)
        if self.full_attention:
            mixed, st = self.self_attn(x, st, n_past, block)
        else:
            mixed, st = self.linear_attn(x, st, block)
        h = h + mixed
        return h + self.mlp(zero_centred_rms_norm(h, self.post_attention_layernorm, eps), coreset_top_p), st


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------
class CloverModel(nn.Module):
    def __init__(self, cfg: CloverConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        # the block softmax's reading: the one the checkpoint says it was made under, else the default
        self.reading = check_reading(cfg.extra.get(READING_FIELD, READING), f"config.json {READING_FIELD}")

    @property
    def reading(self) -> str:
        return self._reading

    @reading.setter
    def reading(self, name: str) -> None:
        """Every GDN layer's block softmax under this reading (metadata.READINGS)."""
        self._reading = check_reading(name, "the reference model")
        for layer in self.layers:
            if not layer.full_attention:
                layer.linear_attn.reading = name

    # ---- state ------------------------------------------------------------------------------------------
    def empty_state(self, batch: int = 1) -> PrefixState:
        return PrefixState(layers=tuple(LayerState() for _ in self.layers), n_past=0)

    def run(self, ids: torch.Tensor, state: PrefixState | None = None, block: bool = False,
            coreset: bool | float | None = None) -> tuple[torch.Tensor, PrefixState]:
        """ids [N, T] after `state` -> (logits [N, T, V], the state after these tokens).

        block=True evaluates `ids` as one block in block mode (spec section 3); its returned state is what llama.cpp
        would hold on a scratch sequence and is meant to be thrown away.
        """
        state = state or self.empty_state()
        top_p = self._coreset_top_p(coreset) if block else None
        h = self.embed_tokens[ids]
        new_layers = []
        for layer, st in zip(self.layers, state.layers):
            h, st = layer(h, st, state.n_past, block, top_p)
            new_layers.append(st)
        h = zero_centred_rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return h @ head.T, PrefixState(layers=tuple(new_layers), n_past=state.n_past + ids.shape[-1])

    def _coreset_top_p(self, coreset: bool | float | None) -> float | None:
        if coreset is None:
            coreset = self.cfg.moe_block_coreset_enabled
        if coreset is False:
            return None
        return self.cfg.moe_block_coreset_top_p if coreset is True else float(coreset)

    # ---- public API -------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | Iterable[int]) -> torch.Tensor:
        """Causal logits: ids [T] -> [T, V] (or [N, T] -> [N, T, V])."""
        ids = _as_ids(input_ids)
        logits, _ = self.run(ids.view(1, -1) if ids.dim() == 1 else ids)
        return logits[0] if ids.dim() == 1 else logits

    def prefill(self, prefix_ids: torch.Tensor | Iterable[int], state: PrefixState | None = None
                ) -> tuple[torch.Tensor, PrefixState]:
        """Causal pass over `prefix_ids` (1-D) continuing `state` -> (logits [T, V], new state)."""
        ids = _as_ids(prefix_ids).view(1, -1)
        logits, st = self.run(ids, state)
        return logits[0], st

    def block_logits(self, prefix_ids: torch.Tensor | Iterable[int] | None, block_ids: torch.Tensor | Iterable[int],
                     coreset: bool | float | None = None, state: PrefixState | None = None) -> torch.Tensor:
        """Block-mode logits [B, V] for the block positions after a causal prefix.

        Either pass `prefix_ids` (the prefix is run causally here) or a cached `state` (left untouched).
        coreset: None = as config.json says, False = off, True = config top_p, a float = that top_p.
        """
        if not self.cfg.is_clover:
            raise UserError("block mode needs a Clover checkpoint (this is a plain Qwen3.5-MoE model)")
        if state is None:
            state = self.empty_state()
            if prefix_ids is not None and len(_as_ids(prefix_ids)):
                _, state = self.prefill(prefix_ids)
        logits, _ = self.run(_as_ids(block_ids).view(1, -1), state, block=True, coreset=coreset)
        return logits[0]

    # ---- weights ----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "CloverModel":
        from clover_gguf import checkpoint

        path = Path(path)
        cfg = CloverConfig.from_file(path)
        model = cls(cfg)
        model.load_hf_state_dict(checkpoint.load_hf_tensors(path), strict=True)
        return model.to(dtype)

    def hf_name_map(self) -> dict[str, tuple[str, str | None]]:
        """HF tensor name -> (our parameter name, layout note), for every tensor of the table (shapes, from
        tensor_map.TENSOR_RULES) except the experts, which are handled separately (stacked here)."""
        from clover_gguf.shapes import checkpoint_tensors
        from clover_gguf.tensor_map import BROADCAST_HEADS, PER_EXPERT_RE, match_rule

        params = dict(self.named_parameters())
        m: dict[str, tuple[str, str | None]] = {}
        for hf_name, _, _ in checkpoint_tensors(self.cfg):
            if PER_EXPERT_RE.match(hf_name):
                continue
            rule, _ = match_rule(hf_name)
            note = "conv" if rule.transform == "conv" else "heads" if rule.transform in BROADCAST_HEADS else None
            m[hf_name] = (sanitize(hf_name, params), note)
        return m

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load HF-named tensors (prefix and expert layout already normalised by clover_gguf.checkpoint)."""
        params = dict(self.named_parameters())
        consumed = set()
        with torch.no_grad():
            for hf_name, (ours, note) in self.hf_name_map().items():
                if hf_name not in tensors:
                    raise UserError(f"checkpoint lacks tensor {hf_name}")
                t = tensors[hf_name]
                if note == "conv":
                    t = t.reshape(t.shape[0], t.shape[-1])
                elif note == "heads" and t.numel() == 1:  # one value for every head (tensor_map._per_head)
                    t = t.reshape(1).expand(params[ours].shape[0])
                _copy_checked(params[ours], t, hf_name)
                consumed.add(hf_name)
            for i, layer in enumerate(self.layers):
                for n in ("gate_proj", "up_proj", "down_proj"):
                    hf_name = f"model.layers.{i}.mlp.experts.{n}"
                    if hf_name not in tensors:
                        raise UserError(f"checkpoint lacks experts {hf_name}")
                    _copy_checked(getattr(layer.mlp, n), tensors[hf_name], hf_name)
                    consumed.add(hf_name)
        unused = sorted(set(tensors) - consumed)
        if strict and unused:
            raise UserError(f"{len(unused)} tensor(s) nobody consumed: {', '.join(unused[:5])}")

    def hf_state_dict(self, experts: str = "per-expert") -> dict[str, torch.Tensor]:
        """Our weights under HF names, experts per expert (`mlp.experts.{e}.gate_proj.weight`) or fused."""
        params = dict(self.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for hf_name, (ours, note) in self.hf_name_map().items():
            t = params[ours].detach()
            out[hf_name] = t.unsqueeze(1) if note == "conv" else t
        for i, layer in enumerate(self.layers):
            g, u, d = (getattr(layer.mlp, n).detach() for n in ("gate_proj", "up_proj", "down_proj"))
            p = f"model.layers.{i}.mlp.experts."
            if experts == "fused":
                out[p + "gate_up_proj"] = torch.cat([g, u], dim=1)  # [E, 2I, H], gate rows first
                out[p + "down_proj"] = d
            else:
                for e in range(self.cfg.num_experts):
                    out[p + f"{e}.gate_proj.weight"] = g[e]
                    out[p + f"{e}.up_proj.weight"] = u[e]
                    out[p + f"{e}.down_proj.weight"] = d[e]
        return {k: v.contiguous() for k, v in out.items()}


def load_gguf(path: str | Path, reading: str | None = None, dtype: torch.dtype = torch.float32) -> CloverModel:
    """The reference model holding a Clover GGUF's weights (any tensor type gguf-py dequantizes: F32, F16, BF16,
    Q8_0, the K-quants ...), every converter transform undone (tensor_map.INVERSE), under `reading` (default: the
    file's BLOCK_READING, else the default reading). What check-block runs a reading on that llama.cpp does not
    run. The whole model in memory as `dtype`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from clover_gguf.gguf_header import config_from_header, read_clover
    from clover_gguf.metadata import BLOCK_READING
    from clover_gguf.tensor_map import EXPERT_KINDS, INVERSE, match_rule

    h = read_clover(Path(path))
    need = sum(math.prod(shape) for shape, _ in h.tensors.values()) * torch.finfo(dtype).bits // 8
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > 0.8 * have:
        raise UserError(f"the PyTorch reference would hold {Path(path).name} in {need / 2**30:.1f} GiB, more than this "
                        f"machine's memory allows ({have / 2**30:.1f} GiB): it runs the readings llama.cpp lacks on "
                        "small models only")
    cfg = config_from_header(h)
    model = CloverModel(cfg)
    stored = {t.name: t for t in GGUFReader(str(path)).tensors}

    def values(name: str) -> np.ndarray:
        if name not in stored:
            raise UserError(f"{Path(path).name} lacks tensor {name}")
        t = stored[name]
        return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(h.tensors[name][0])

    tensors: dict[str, torch.Tensor] = {}
    for hf_name in model.hf_name_map():
        rule, i = match_rule(hf_name)
        hf_values = INVERSE[rule.transform](values(rule.gguf.format(i=i)), cfg)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(hf_values))
    for i in range(cfg.num_hidden_layers):
        for kind, gguf_name in EXPERT_KINDS.items():
            tensors[f"model.layers.{i}.mlp.experts.{kind}_proj"] = torch.from_numpy(values(gguf_name.format(i=i)))
    model.load_hf_state_dict(tensors)
    model.reading = reading or h.kv.get(BLOCK_READING) or READING
    return model.to(dtype)


def sanitize(hf_name: str, params: Collection[str]) -> str:
    """An HF tensor name as our parameter name (mlx-lm style): no `model.` prefix, `shared_expert.` modules as
    `shared_` parameters, and `.weight` dropped where we hold a bare parameter (norms, convs) instead of a Linear."""
    name = hf_name.removeprefix("model.").replace(".mlp.shared_expert.", ".mlp.shared_")
    return name if name in params else name.removesuffix(".weight")


@contextlib.contextmanager
def recorded_routes(model: CloverModel) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """[(layer, expert ids [N, T, k])] of every MoE call of the forward passes run inside the block, in call order:
    the routing each layer decided (the block's coreset applied), read back without changing the model."""
    calls: list[tuple[int, torch.Tensor]] = []

    def hook(layer: int):
        return lambda mlp, args, out: calls.append((layer, mlp.route(*args)[0]))

    handles = [layer.mlp.register_forward_hook(hook(i)) for i, layer in enumerate(model.layers)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise UserError(f"tensor {name} has shape {tuple(value.shape)}, config.json implies {tuple(param.shape)}")
    param.copy_(value.to(param.dtype))


def _as_ids(ids: torch.Tensor | Iterable[int]) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.long()
    return torch.tensor(list(ids), dtype=torch.long)
