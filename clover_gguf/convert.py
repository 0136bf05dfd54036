"""Clover safetensors -> GGUF, streaming: one tensor (or one layer's expert stack) in memory at a time."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_VERSION, GGUFType, GGUFWriter, LlamaFileType, Metadata, quants

from clover_gguf.checkpoint import Checkpoint
from clover_gguf.config import MAX_KERNEL, CloverConfig, generation_defaults, read_json
from clover_gguf.errors import UserError
from clover_gguf.fsutil import atomic_output, check_free_disk, check_output
from clover_gguf.gguf_header import BOOL, DIFFUSION_KEYS, F32, HPARAMS, STRING, U32
from clover_gguf.metadata import (ARCH, BLOCK_MODE, BLOCK_READING, BLOCK_READING_VERIFIED, CORESET_ENABLED,
                                  CORESET_TOP_P, READING, READING_FIELD, RIGHT_KERNEL, GenerationDefaults,
                                  check_reading)
from clover_gguf.tensor_map import (CLOVER_EXTRA_RE, EXPERT_KINDS, FUSED_RE, PER_EXPERT_RE, REORDER_ONLY, TRANSFORMS, TensorRule,
                                    expert_shape, gguf_names, match_rule, mtp_as_layer, out_shape)
from clover_gguf.vocab import Vocab, load_vocab

OUTTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
# general.file_type of each output type, as upstream's converter writes it
FILE_TYPES = {QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.BF16: LlamaFileType.MOSTLY_BF16,
              QT.Q8_0: LlamaFileType.MOSTLY_Q8_0}
# what each safetensors storage dtype is in GGML terms: a reorder-only tensor whose output type equals its source
# type is copied bit for bit
SOURCE_TYPES = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16}
BYTES_PER_ELEMENT = {QT.F32: 4.0, QT.F16: 2.0, QT.BF16: 2.0, QT.Q8_0: 34 / 32}
# Large tensors (the 248k-row embedding and output, a layer's expert stack) are read, converted and written in
# pieces of about this many source bytes, and the mapped source pages are dropped as the pieces go: a whole one in
# memory plus its mapped pages would take the converter past 1 GiB (measured on the 35B's shapes: 1.16 GiB).
PIECE_BYTES = 64 << 20


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: QT
    # the tensor in pieces along its first axis (one piece for most): f32 and transformed, or when `raw` the
    # stored bits, already in the output type
    pieces: Callable[[], Iterator[np.ndarray]]
    raw: bool

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * BYTES_PER_ELEMENT[self.qtype])


@dataclass
class ConversionPlan:
    cfg: CloverConfig
    tensors: list[PlannedTensor]
    notices: list[str]
    skipped_unknown: list[str]
    n_blocks: int  # GGUF blocks: the decoder layers, then the MTP layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _encode(a: np.ndarray, qtype: QT) -> np.ndarray:
    """f32 -> the storage array for qtype."""
    if qtype == QT.F32:
        return np.ascontiguousarray(a, dtype=np.float32)
    if qtype == QT.F16:
        return a.astype(np.float16)
    if qtype == QT.BF16:
        u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)  # round to nearest even
    return quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)


def _output_type(rule_f32: bool, shape: tuple[int, ...], outtype: QT) -> QT:
    if rule_f32 or len(shape) == 1:
        return QT.F32
    if outtype == QT.Q8_0 and shape[-1] % 32:
        return QT.F16  # Q8_0 needs rows in blocks of 32
    return outtype


# conv widths llama.cpp's CUDA ssm_conv has kernels for (ggml-cuda/ssm-conv.cu of the pinned tree; patch 0002 makes
# its supports_op say so, so another width falls back to the CPU instead of aborting)
CUDA_SSM_CONV_WIDTHS = (3, 4, 5, 9, 15)
# --arch: a Clover GGUF (upstream's clover_moe plus our block-mode tensors and keys), or llama.cpp's qwen35moe
# without them (AR decoding in any llama.cpp that has qwen35moe, for builds older than b12060)
AR_ARCH = "qwen35moe"
ARCHS = (ARCH, AR_ARCH)
RIGHT_CONV = ".linear_attn.conv_right_weight"


def right_kernel_from_shapes(shapes: dict[str, tuple[int, ...]], cfg: CloverConfig) -> CloverConfig:
    """The right convolution's width Kr, read from the checkpoint's conv_right_weight ([conv_dim, 1, Kr] or
    [conv_dim, Kr]; `shapes`: tensor name -> shape): the real config.json does not give it. A config that does give
    it must agree."""
    name = next((n for n in sorted(shapes) if n.endswith(RIGHT_CONV)), None)
    if not cfg.is_clover or name is None:
        return cfg
    shape = tuple(shapes[name])
    if len(shape) not in (2, 3) or shape[0] != cfg.conv_dim or (len(shape) == 3 and shape[1] != 1):
        raise UserError(f"tensor {name} has shape {list(shape)}; a right convolution is "
                        f"[{cfg.conv_dim}, 1, Kr] or [{cfg.conv_dim}, Kr] (conv_dim from config.json)")
    kr = shape[-1]
    if not 1 <= kr <= MAX_KERNEL:
        raise UserError(f"tensor {name}: right convolution width {kr} is not in 1..{MAX_KERNEL}")
    if cfg.linear_conv_right_kernel_dim not in (None, kr):
        raise UserError(f"tensor {name} has width {kr}, config.json's linear_conv_right_kernel_dim is "
                        f"{cfg.linear_conv_right_kernel_dim}")
    return dataclasses.replace(cfg, linear_conv_right_kernel_dim=kr)


# the largest magnitude a block-mode value may have in the GGUF (float16's largest): trained right-conv taps and
# block-softmax controls are O(1)-O(100); 1e30, or a logit scale whose exp overflows, is no model and only makes
# block passes write nothing
BLOCK_VALUE_LIMIT = 65504.0


def check_layer_kind(rule: TensorRule, name: str, layer: int | None, cfg: CloverConfig) -> None:
    """A layer's tensor must belong to a layer config.json has, and one of its kind: GDN tensors (the block-mode ones
    among them) on linear-attention layers, attention tensors on full-attention layers. (MTP layers, at index
    num_hidden_layers and up, are checked by their own count.)"""
    if layer is None or rule.scope not in ("attention", "gdn"):
        return
    n_layers = cfg.num_hidden_layers
    if layer >= n_layers:
        raise UserError(f"tensor {name} belongs to layer {layer}, but config.json has {n_layers} layers "
                        f"(0..{n_layers - 1})")
    if (rule.scope == "gdn") == cfg.is_full_attention(layer):
        kind = "a linear-attention (GDN)" if rule.scope == "gdn" else "a full-attention"
        raise UserError(f"tensor {name} belongs to {kind} layer, but config.json's layer_types makes layer {layer} "
                        f"{cfg.layer_types[layer]}")


def block_tensor(rule: TensorRule, name: str, layer: int, a: np.ndarray, cfg: CloverConfig) -> np.ndarray:
    """One block-mode tensor as both convert and graft take it: on a GDN layer (check_layer_kind), finite stored values,
    the transform (tensor_map), and finite values within +-BLOCK_VALUE_LIMIT after it. -> the F32 GGUF array."""
    check_layer_kind(rule, name, layer, cfg)
    if not np.isfinite(a).all():
        raise UserError(f"tensor {name} holds NaN or infinite values")
    with np.errstate(all="ignore"):  # an overflow is refused below, not printed as a RuntimeWarning
        out = np.ascontiguousarray(TRANSFORMS[rule.transform](a, cfg), dtype=np.float32)
    if out.size and not (np.isfinite(out).all() and np.abs(out).max() <= BLOCK_VALUE_LIMIT):
        worst = float(np.nanmax(np.abs(a))) if a.size else 0.0
        raise UserError(f"tensor {name}: its values (up to {worst:.4g} in magnitude) make GGUF values beyond "
                        f"+-{BLOCK_VALUE_LIMIT:g}" + (" (it is stored as exp(value))" if rule.transform.startswith("exp")
                                                    else "") + ": not a trained model's block-mode tensor")
    return out


def plan_conversion(ck: Checkpoint, cfg: CloverConfig, outtype: str = "bf16", skip_unknown: bool = False,
                    arch: str = ARCH) -> ConversionPlan:
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise UserError(
            f"linear_key_head_dim ({cfg.linear_key_head_dim}) != linear_value_head_dim "
            f"({cfg.linear_value_head_dim}): llama.cpp's qwen35moe graph, which clover reuses, needs them equal"
        )
    qt = OUTTYPES[outtype]
    cfg = right_kernel_from_shapes({n: ck.tensors[n].shape for n in ck.names()}, cfg)
    n_layers = cfg.num_hidden_layers
    notices: list[str] = []
    if not cfg.is_clover:
        notices.append("plain Qwen3.5-MoE checkpoint: converting the causal model; block mode will be unavailable")
    elif arch != ARCH:
        notices.append(f"{arch}: the block-mode tensors and Clover's own keys are left out (AR decoding only)")
    if ck.dropped:
        notices.append(f"dropped {len(ck.dropped)} vision tensor(s) (model.visual.*): Clover is text-only")
    if cfg.is_clover and arch == ARCH and cfg.right_kernel not in CUDA_SSM_CONV_WIDTHS:
        notices.append(f"right conv kernel {cfg.right_kernel}: llama.cpp's CUDA ssm_conv has kernels for widths "
                       f"{', '.join(map(str, CUDA_SSM_CONV_WIDTHS))} only, so on CUDA that op of block passes runs "
                       "on the CPU (slower, still correct)")

    by_gguf: dict[str, PlannedTensor] = {}
    experts: dict[tuple[int, str], dict] = {}
    unknown: list[str] = []
    mtp_layers: set[int] = set()

    def plan_rule(rule: TensorRule, src_name: str, bid: int) -> None:
        ref = ck.tensors[src_name]
        want = rule.hf_shape(cfg)
        if bid < n_layers:
            check_layer_kind(rule, ref.source_name, bid, cfg)
        if not rule.accepts(ref.shape, cfg):
            raise UserError(f"tensor {ref.source_name} has shape {list(ref.shape)}, config.json implies {list(want)}")
        if ref.dtype not in SOURCE_TYPES:
            raise UserError(f"tensor {ref.source_name} has unsupported dtype {ref.dtype} (supported: F32, F16, BF16)")
        # small (a few MB in the 35B): read and checked now, as graft does (a plan from a config alone has no data)
        if rule.clover_extra and getattr(ck, "has_data", True):
            a = block_tensor(rule, ref.source_name, bid, ck.f32(src_name), cfg)
            name = rule.gguf.format(i=bid, L=n_layers)
            by_gguf[name] = PlannedTensor(name, a.shape, QT.F32, lambda a=a: iter([a]), False)
            return
        fn = TRANSFORMS[rule.transform]
        shape = out_shape(rule.transform, want)
        out_type = _output_type(rule.f32, shape, qt)
        gguf_name = rule.gguf.format(i=bid, L=n_layers)
        raw = rule.transform in REORDER_ONLY and SOURCE_TYPES[ref.dtype] == out_type
        read = ck.raw if raw else ck.f32  # raw: bits moved, never converted
        if rule.transform == "copy" and ref.nbytes > PIECE_BYTES and tuple(ref.shape) == tuple(want):  # row by row
            step = max(1, PIECE_BYTES // (ref.nbytes // want[0]))
            pieces = lambda: (read(src_name, slice(r, r + step)) for r in range(0, want[0], step))  # noqa: E731
        else:
            pieces = lambda: iter([fn(read(src_name), cfg)])  # noqa: E731
        by_gguf[gguf_name] = PlannedTensor(gguf_name, tuple(shape), out_type, pieces, raw)

    def check_layer(name: str, layer: int, mtp: bool) -> None:
        if not mtp and layer >= n_layers:
            raise UserError(f"tensor {name} belongs to layer {layer}, but config.json has {n_layers} layers "
                            f"(0..{n_layers - 1})")

    for name in ck.names():
        mapped, j = mtp_as_layer(name, n_layers)  # the MTP decoder layer is an ordinary layer at index L + j
        if j is not None:
            mtp_layers.add(j)
        if m := PER_EXPERT_RE.match(mapped) or FUSED_RE.match(mapped):
            check_layer(name, int(m["i"]), j is not None)
            key = int(m["e"]) if "e" in m.groupdict() else "fused"
            experts.setdefault((int(m["i"]), m["kind"]), {})[key] = name
            continue
        hit = match_rule(mapped)
        if hit is None:
            unknown.append(name)
            continue
        rule, bid = hit
        if bid is not None:
            check_layer(name, bid, j is not None)
        if rule.clover_extra and arch != ARCH:
            continue
        plan_rule(rule, name, n_layers if bid is None else bid)

    if unknown and not skip_unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise UserError(f"{len(unknown)} tensor(s) the Clover map does not know: {shown} (--skip-unknown drops them)")

    for (layer, kind), srcs in sorted(experts.items()):
        _plan_experts(ck, cfg, layer, kind, srcs, qt, by_gguf)

    if sorted(mtp_layers) != list(range(len(mtp_layers))):
        raise UserError(f"MTP layers must be numbered from 0 without gaps, found {sorted(mtp_layers)}")
    n_blocks = n_layers + len(mtp_layers)
    beyond = [n for n in by_gguf if n.startswith("blk.") and int(n.split(".")[1]) >= n_blocks]
    if beyond:
        raise UserError(f"tensor {beyond[0]} has no layer to belong to ({n_layers} layers, "
                        f"{len(mtp_layers)} MTP layers)")
    _check_complete(cfg, by_gguf, n_layers, n_blocks, extras=arch == ARCH)
    order = sorted(by_gguf.values(), key=lambda t: _order_key(t.name))
    return ConversionPlan(cfg, order, notices, unknown, n_blocks)


def _plan_experts(ck: Checkpoint, cfg: CloverConfig, layer: int, kind: str, srcs: dict, qt: QT,
                  by_gguf: dict[str, PlannedTensor]) -> None:
    n_exp, inter, hid = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if "fused" in srcs:
        name = srcs["fused"]
        ref = ck.tensors[name]
        want = (n_exp, 2 * inter, hid) if kind == "gate_up_proj" else (n_exp, hid, inter)
        if tuple(ref.shape) != want:
            raise UserError(f"tensor {ref.source_name} has shape {list(ref.shape)}, config.json implies {list(want)}")
        parts = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)} if kind == "gate_up_proj" else {"down": None}
        for part, rows in parts.items():
            shape = expert_shape(cfg, part)
            out_type = _output_type(False, shape, qt)
            raw = SOURCE_TYPES.get(ref.dtype) == out_type
            read = ck.raw if raw else ck.f32
            # [E, 2I, H]: gate rows first, then up rows; one expert per piece
            pieces = (lambda n=name, r=rows, rd=read: (rd(n, slice(e, e + 1)) if r is None else
                                                       rd(n, slice(e, e + 1))[:, r] for e in range(n_exp)))
            gguf_name = EXPERT_KINDS[part].format(i=layer)
            by_gguf[gguf_name] = PlannedTensor(gguf_name, shape, out_type, pieces, raw)
        return
    # per expert: [I, H] (gate, up) or [H, I] (down) each, stacked to [E, ...]
    if sorted(srcs) != list(range(n_exp)):
        raise UserError(f"layer {layer}: {kind}_proj experts found for {len(srcs)} of {n_exp} experts")
    shape = expert_shape(cfg, kind)
    for e, name in srcs.items():
        ref = ck.tensors[name]
        if tuple(ref.shape) != shape[1:]:
            raise UserError(f"tensor {ref.source_name} has shape {list(ref.shape)}, config.json implies {list(shape[1:])}")
        if ref.dtype not in SOURCE_TYPES:
            raise UserError(f"tensor {ref.source_name} has unsupported dtype {ref.dtype} (supported: F32, F16, BF16)")
    out_type = _output_type(False, shape, qt)
    dtypes = {ck.tensors[n].dtype for n in srcs.values()}
    raw = len(dtypes) == 1 and SOURCE_TYPES[dtypes.pop()] == out_type
    read = ck.raw if raw else ck.f32
    names = [srcs[e] for e in range(n_exp)]
    gguf_name = EXPERT_KINDS[kind].format(i=layer)
    # one expert per piece: the stack ([E, ...], 512 MiB a tensor in BF16 on the 35B) is never whole in memory
    by_gguf[gguf_name] = PlannedTensor(gguf_name, shape, out_type, lambda ns=names, rd=read: (rd(n)[None] for n in ns),
                                       raw)


def _expected_names(cfg: CloverConfig, n_layers: int, n_blocks: int, extras: bool = True) -> list[str]:
    """Every GGUF tensor config.json implies: the tensor table (shapes.checkpoint_tensors, from TENSOR_RULES)
    mapped to GGUF names; without the Clover extras for extras=False (a qwen35moe output)."""
    from clover_gguf.shapes import checkpoint_tensors

    names: dict[str, None] = {}
    for hf, _, _ in checkpoint_tensors(cfg, experts="fused", mtp=n_blocks - n_layers):
        hit = match_rule(hf)
        if not extras and hit is not None and hit[0].clover_extra:
            continue
        names.update(dict.fromkeys(gguf_names(hf, n_layers)))
    return list(names)


def _check_complete(cfg: CloverConfig, by_gguf: dict, n_layers: int, n_blocks: int, extras: bool = True) -> None:
    missing = [n for n in _expected_names(cfg, n_layers, n_blocks, extras) if n not in by_gguf]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise UserError(f"checkpoint lacks {len(missing)} tensor(s) config.json implies: {shown}")


def _order_key(name: str) -> tuple:
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name == "token_embd.weight" else 2, 0, name)


# ---- metadata -------------------------------------------------------------------------------------------------
# The "<arch>.<key>" hyperparameters llama.cpp's qwen35moe reads: a clover file and a qwen35moe file carry the same
# ones (export-ar renames them); upstream's clover_moe adds expert_shared_count; every other "clover_moe." key is
# our block-mode addition and stays out of the AR files.
QWEN35MOE_HPARAMS = frozenset({
    "context_length", "embedding_length", "block_count", "nextn_predict_layers", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.dimension_sections", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.state_size",
    "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
    "attention.recurrent_layers",
})
# what upstream's converters write under each architecture: the AR files (export-ar) carry exactly these
UPSTREAM_HPARAMS = {AR_ARCH: QWEN35MOE_HPARAMS, ARCH: QWEN35MOE_HPARAMS | {"expert_shared_count"}}


def block_mode_keys(cfg: CloverConfig, gen: GenerationDefaults, reading: str | None = None
                    ) -> dict[str, tuple[int, Any]]:
    """The keys only we write (upstream's clover_moe has none of them): block mode's settings (the diffusion.*
    family the patched llama.cpp reads), the card's controls and which reading of the block tensors the file is made
    for: `reading` (convert --reading), else the one the checkpoint says it was made under (our own models), else
    the default; verified when the checkpoint was made under that reading. GGUF key -> (GGUF type, value). convert
    writes them into every clover_moe file, graft into an AR-only one."""
    keys: dict[str, Any] = {
        RIGHT_KERNEL: cfg.right_kernel, CORESET_TOP_P: cfg.moe_block_coreset_top_p, **gen.gguf_items(),
        BLOCK_MODE: cfg.is_clover, CORESET_ENABLED: cfg.is_clover and cfg.moe_block_coreset_enabled,
    }
    # each key with the GGUF type gguf_header gives it, the type check_model and llama.cpp require
    out = {k: (_key_type(k), v) for k, v in keys.items()}
    if cfg.is_clover:
        made = cfg.extra.get(READING_FIELD)
        if made is not None:
            made = check_reading(made, f"config.json {READING_FIELD}")
        name = check_reading(reading, "--reading") if reading is not None else made or READING
        out[BLOCK_READING] = (STRING, name)
        out[BLOCK_READING_VERIFIED] = (BOOL, made == name)
    return out


def _key_type(key: str) -> int:
    """The GGUF type of one of our keys: gguf_header's tables (DIFFUSION_KEYS, HPARAMS under the architecture)."""
    if key in DIFFUSION_KEYS:
        return DIFFUSION_KEYS[key][0]
    return HPARAMS[key.removeprefix(ARCH + ".")][0]


def write_keys(w: GGUFWriter, keys: dict[str, tuple[int, Any]]) -> None:
    write = {U32: lambda k, v: w.add_uint32(k, int(v)), F32: lambda k, v: w.add_float32(k, float(v)),
             BOOL: w.add_bool, STRING: w.add_string}
    for k, (t, v) in keys.items():
        write[t](k, v)


def describe(src: Path | None, plan: ConversionPlan, gen: GenerationDefaults, outtype: str,
             name: str | None = None) -> tuple[Metadata, LlamaFileType]:
    """The general.* description upstream's converter writes, made the same way, with gguf-py's Metadata: the
    model card and the folder's name (name, size label, licence, base models, tags ...), generation_config.json's
    sampling keys, and the size label from the parameter count when neither names one. The count leaves out our
    block-mode tensors, so a checkpoint gets the label upstream gives it. The card's repetition penalty is written
    where llama.cpp's own tools read sampling defaults when the checkpoint names none."""
    counter = GGUFWriter(path=None, arch=ARCH)  # gguf-py's own count: experts told apart by "_exps." and shape
    for t in plan.tensors:
        if not CLOVER_EXTRA_RE.match(t.name):
            counter.add_tensor_info(t.name, t.shape, np.dtype(np.float32), 0, raw_dtype=QT.F32)
    total, shared, expert, n_expert = counter.get_total_parameter_count()
    meta = Metadata.load(None, src, name, total)
    if meta.name is None:
        meta.name = name or (src.name if src is not None else "clover")
    if meta.size_label is None and total > 0:
        from gguf import size_label

        meta.size_label = size_label(total, shared, expert, n_expert)
    if meta.sampling_penalty_repeat is None:
        meta.sampling_penalty_repeat = float(gen.repetition_penalty)
    return meta, FILE_TYPES[OUTTYPES[outtype]]


def write_metadata(w: GGUFWriter, cfg: CloverConfig, vocab: Vocab, gen: GenerationDefaults, n_blocks: int,
                   meta: Metadata, file_type: LlamaFileType, arch: str = ARCH, reading: str | None = None) -> None:
    """What upstream's converter writes for `arch`: the general.* description (describe), the hyperparameters
    (UPSTREAM_HPARAMS, under its prefix) and the tokenizer; for clover_moe also our block-mode keys."""
    rope_sections = list(cfg.rope_sections) + [0] * (4 - len(cfg.rope_sections))
    recurrent = [not cfg.is_full_attention(i) if i < cfg.num_hidden_layers else False for i in range(n_blocks)]
    w.add_type(GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    w.add_file_type(file_type)
    w.add_quantization_version(GGML_QUANT_VERSION)
    upstream = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size, "block_count": n_blocks,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.dimension_count": cfg.rotary_dim, "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok, "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        "ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": cfg.linear_key_head_dim,
        "ssm.group_count": cfg.linear_num_key_heads, "ssm.time_step_rank": cfg.linear_num_value_heads,
        "ssm.inner_size": cfg.value_dim, "full_attention_interval": cfg.full_attention_interval,
        "expert_shared_count": cfg.num_shared_experts,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "rope.freq_base": cfg.rope_theta,
    }
    if n_blocks > cfg.num_hidden_layers:
        upstream["nextn_predict_layers"] = n_blocks - cfg.num_hidden_layers
    write_keys(w, {f"{arch}.{k}": (HPARAMS[k][0], v) for k, v in upstream.items() if k in UPSTREAM_HPARAMS[arch]})
    if arch == ARCH:
        write_keys(w, block_mode_keys(cfg, gen, reading))
    w.add_array(f"{arch}.rope.dimension_sections", rope_sections)
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    ids = vocab.special_ids
    if "eos" in ids:
        w.add_eos_token_id(ids["eos"])
    if "pad" in ids:
        w.add_pad_token_id(ids["pad"])
    if "bos" in ids:
        w.add_bos_token_id(ids["bos"])
    if "mask" in ids:
        w.add_mask_token_id(ids["mask"])
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def read_generation_defaults(src: Path) -> GenerationDefaults:
    p = Path(src) / "generation_config.json"
    gen = read_json(p, "generation_config.json", missing=None)
    return GenerationDefaults() if gen is None else generation_defaults(gen, where=str(p))


def _checked(src: Path, ck: Checkpoint, outtype: str = "f32", skip_unknown: bool = False, arch: str = ARCH,
             reading: str | None = None) -> tuple[ConversionPlan, GenerationDefaults, Vocab]:
    """Every check of a checkpoint folder before anything is written: config.json, generation_config.json, the block
    reading, every tensor (plan_conversion: header, layer, kind, shape, dtype, the block tensors' values) and the
    tokenizer files -> (the plan, the generation defaults, the vocabulary)."""
    cfg = CloverConfig.from_file(src)
    gen = read_generation_defaults(src)
    if arch == ARCH:
        block_mode_keys(cfg, gen, reading)  # a reading this version does not know: refused before any work
    # the tensors' shapes are checked against config.json before anything (the vocabulary) is sized from it
    plan = plan_conversion(ck, cfg, outtype, skip_unknown, arch)
    return plan, gen, load_vocab(src, cfg)


def check_checkpoint(src: Path) -> tuple[CloverConfig, GenerationDefaults, Vocab]:
    """convert's checks (_checked) for a path that reads a checkpoint without converting it (mlx-convert, the MLX
    loader), so a folder one refuses the other refuses with the same line -> (the config with the right kernel read
    from the tensors, the generation defaults, the vocabulary)."""
    with Checkpoint(src) as ck:
        plan, gen, vocab = _checked(Path(src), ck)
    return plan.cfg, gen, vocab


@dataclass
class ConvertResult:
    out: Path | None
    n_tensors: int
    nbytes: int
    notices: list[str]
    skipped_unknown: list[str]
    plan: ConversionPlan


def convert(src: Path, out: Path, outtype: str = "bf16", skip_unknown: bool = False, dry_run: bool = False,
            quiet: bool = False, force: bool = False, log=lambda msg: print(msg, file=sys.stderr),
            arch: str = ARCH, reading: str | None = None) -> ConvertResult:
    """Convert the checkpoint folder `src` to the GGUF file `out`. A dry run plans and validates, writes nothing.
    reading: the block reading to stamp (metadata.READINGS; default: the checkpoint's own, else the default one).

    `out` must not be one of the checkpoint's files or a special file, and an existing file is replaced only with
    `force` (fsutil.check_output)."""
    if outtype not in OUTTYPES:
        raise UserError(f"unknown --outtype {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r}: choose one of {', '.join(ARCHS)}")
    if reading is not None:
        check_reading(reading, "--reading")
        if arch != ARCH:
            raise UserError(f"--reading stamps the block reading of a {ARCH} file; --arch {arch} writes no block "
                            "tensors")
    src, out = Path(src), Path(out)
    with Checkpoint(src) as ck:
        plan, gen, vocab = _checked(src, ck, outtype, skip_unknown, arch, reading)
        for n in plan.notices:
            log(f"notice: {n}")
        if plan.skipped_unknown:
            log(f"warning: dropped {len(plan.skipped_unknown)} unknown tensor(s): {', '.join(plan.skipped_unknown)}")
        if dry_run:
            return ConvertResult(None, len(plan.tensors), plan.nbytes, plan.notices, plan.skipped_unknown, plan)
        inputs = [p for p in src.iterdir() if p.is_file()] + ck.shards
        check_output(out, inputs, force=force)
        check_free_disk(out, plan.nbytes + 16 * 2**20)
        with atomic_output(out) as tmp:
            _write(tmp, plan, vocab, gen, describe(src, plan, gen, outtype), quiet,
                   after_tensor=ck.drop_resident_pages, arch=arch, reading=reading)
    return ConvertResult(out, len(plan.tensors), plan.nbytes, plan.notices, plan.skipped_unknown, plan)


def _write(path: Path, plan: ConversionPlan, vocab: Vocab, gen: GenerationDefaults,
           description: tuple[Metadata, LlamaFileType], quiet: bool, after_tensor: Callable[[], None] = lambda: None,
           arch: str = ARCH, reading: str | None = None) -> None:
    from tqdm import tqdm

    w = GGUFWriter(path=None, arch=arch)
    write_metadata(w, plan.cfg, vocab, gen, plan.n_blocks, *description, arch, reading)
    for t in plan.tensors:
        nbytes = t.nbytes
        storage = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16, QT.Q8_0: np.uint8}[t.qtype]
        shape = t.shape if t.qtype != QT.Q8_0 else (*t.shape[:-1], t.shape[-1] // 32 * 34)
        w.add_tensor_info(t.name, shape, np.dtype(storage), nbytes, raw_dtype=t.qtype)
    try:
        w.open_output_file(path)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=quiet,
                  dynamic_ncols=True) as bar:
            for t in plan.tensors:
                w.write_tensor_data(_TensorPieces(t, bar.update, after_tensor))
    finally:
        w.close()


class _TensorPieces:
    """What GGUFWriter.write_tensor_data uses of an array (nbytes, tofile), over a planned tensor's pieces: each is
    encoded and written on its own, and the mapped source pages are dropped every PIECE_BYTES."""

    def __init__(self, t: PlannedTensor, progress: Callable[[int], None], drop_pages: Callable[[], None]):
        self.t, self.nbytes, self.progress, self.drop_pages = t, t.nbytes, progress, drop_pages

    def tofile(self, f) -> None:
        written = since_drop = 0
        for piece in self.t.pieces():
            data = np.ascontiguousarray(piece if self.t.raw else _encode(piece, self.t.qtype))
            data.tofile(f)
            written += data.nbytes
            since_drop += data.nbytes
            self.progress(data.nbytes)
            del data, piece
            if since_drop >= PIECE_BYTES:
                self.drop_pages()
                since_drop = 0
        self.drop_pages()
        if written != self.nbytes:
            raise RuntimeError(f"{self.t.name}: wrote {written} bytes, the plan says {self.nbytes}")
