"""Clover on Apple's MLX: the decoding Backend (decoding.py) over mlx-lm's Qwen3.5-MoE model, with Clover's block
mode added (docs/architecture.md section 3; docs/mac.md).

The causal path is mlx-lm's own: its `qwen3_5_moe` model class, its `sanitize`, its quantized layers, its KV and
recurrent caches (`prefill` and `commit` call the model with its cache, nothing else). Block mode walks the same
modules once more without writing any cache: the GDN layers add the right convolution and the block softmax and
continue the delta rule from a copy of the prefix state; full attention sees the prefix's cached keys and the whole
block, positions continuing the prefix; the MoE layers route within the block's coreset. The four block tensors of
each GDN layer are held here, unquantized (float32), beside the model.

Folders it loads (`load`):
- a Clover checkpoint (config.json with model_type clover_moe, HF safetensors with the four block tensors): the
  weights go through mlx-lm's sanitize as they are;
- an MLX folder, as `clover-gguf mlx-convert` writes it (mlx-lm's layout, model*.safetensors, quantized or not) with
  the block tensors in `clover-block.safetensors` (mlx-lm's own loader never reads that file, so `mlx_lm.generate`
  runs the same folder AR); a community MLX conversion without that file runs AR only, and `clover-gguf graft
  FOLDER --from CHECKPOINT` adds it.

Importing this module imports mlx; nothing else in clover_gguf does, except the commands that run MLX (lazily).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from clover_gguf.config import CloverConfig
from clover_gguf.controls import Gather, GraphRows
from clover_gguf.errors import UserError
from clover_gguf.metadata import READING

from clover_gguf.graft import BLOCK_RULES, MLX_BLOCK_FILE as BLOCK_FILE

# the one install line, wherever MLX is named (doctor, the errors, docs/mac.md, README): from the checkout, keeping the
# editable install (clover-gguf is not on PyPI; `pip install '.[mlx]'` would replace it with a copy)
INSTALL_HINT = "make mlx (in the checkout; without make: pip install -e '.[mlx]')"
# the four block tensors' short names (tensor_map's rules), found by layer in HF-named (normalised) tensors
BLOCK_NAMES = tuple(r.hf.rsplit(".", 1)[1] for r in BLOCK_RULES)
_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(" + "|".join(BLOCK_NAMES) + r")$")

try:  # the one place that imports MLX; everything below needs it
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
except ImportError as _e:  # pragma: no cover - exercised by tests in a separate process
    raise UserError(f"MLX is not installed ({_e.name or _e}): {INSTALL_HINT}. MLX runs on Apple silicon, and on "
                    "Linux on the CPU (mlx[cpu], which the extra brings)") from None


# ---------------------------------------------------------------------------------------------------------------
# Availability (doctor)
# ---------------------------------------------------------------------------------------------------------------
def availability() -> dict[str, Any]:
    """What MLX this process has: versions, the default device, whether Metal is there."""
    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "metal": bool(mx.metal.is_available()),
            "device": str(mx.default_device())}


# ---------------------------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------------------------
def is_mlx_folder(path: Path) -> bool:
    """An MLX folder (mlx-lm's layout) rather than an HF checkpoint: its weights are named as mlx-lm's model holds
    them, or its config.json carries mlx-lm's `quantization`."""
    from clover_gguf.config import read_json

    path = Path(path)
    try:  # the one reader (regular, at most 64 MiB, not nested past the stack); a bad file is refused by the load
        raw = read_json(path / "config.json", "config.json")
    except UserError:
        return False
    if isinstance(raw, dict) and isinstance(raw.get("quantization"), dict):
        return True
    from clover_gguf.checkpoint import list_shards, read_shard_header

    try:
        shards = list_shards(path)
    except UserError:
        return False
    names = [h[0] for h in read_shard_header(shards[0])] if shards else []
    return any(n.startswith("language_model.") or ".switch_mlp." in n for n in names)


def _read_config(path: Path, has_block: bool) -> tuple[CloverConfig, dict]:
    """CloverConfig of a checkpoint or MLX folder, and the raw config.json. An MLX folder says model_type
    qwen3_5_moe (so that mlx-lm loads it); with the block file it is Clover."""
    from clover_gguf.config import CLOVER_MODEL_TYPE, read_json

    raw = read_json(path / "config.json", "config.json")
    if not isinstance(raw, dict):
        raise UserError(f"{path}/config.json must be a JSON object")
    d = dict(raw)
    if has_block:
        d["model_type"] = CLOVER_MODEL_TYPE
    cfg = CloverConfig.from_dict(d)
    expect = tuple((i + 1) % cfg.full_attention_interval == 0 for i in range(cfg.num_hidden_layers))
    if tuple(cfg.is_full_attention(i) for i in range(cfg.num_hidden_layers)) != expect:
        raise UserError("layer_types is not every full_attention_interval-th layer full attention, the only pattern "
                        "mlx-lm's qwen3_5_moe builds")
    return cfg, raw


# MLX's quantization modes and the (group sizes, bits) each takes (mx.quantize, MLX 0.32)
QUANT_MODES = {"affine": ((32, 64, 128), (1, 2, 3, 4, 5, 6, 8)), "mxfp4": ((32,), (4,)), "mxfp8": ((32,), (8,)),
               "nvfp4": ((16,), (4,))}


def check_quantization(q: Any, where: str) -> None:
    """An MLX folder's config.json `quantization`, as mlx-lm's loader applies it: an object with a mode MLX has and
    its group_size and bits, and per-module entries (mlx-lm's predicate: a module's path -> false, true or such an
    object). A group_size of 0 killed the process with SIGFPE; {}, a list, a string, a missing bits, a string,
    float or huge value were tracebacks."""
    def one(d: Any, what: str, top: bool) -> None:
        if not isinstance(d, dict):
            raise UserError(f"{where}: {what} must be an object with group_size and bits, not {_shown(d)}")
        mode = d.get("mode", "affine")
        if mode not in QUANT_MODES:
            raise UserError(f"{where}: {what}'s mode must be one of {', '.join(QUANT_MODES)}, not {_shown(mode)}")
        groups, bits = QUANT_MODES[mode]
        for key, allowed in (("group_size", groups), ("bits", bits)):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
                raise UserError(f"{where}: {what}'s {key} must be one of {', '.join(map(str, allowed))} "
                                f"({mode}), not {_shown(v)}")
        if top:  # a module's path (this model's are all dotted: language_model.model.layers.0.mlp.gate); other
            for key, v in d.items():  # keys (a quant_method) mlx-lm never reads
                if "." in key and not isinstance(v, bool):
                    one(v, f"quantization[{key!r}]", top=False)
        else:  # mlx-lm passes a module's entry on as keyword arguments (Linear.to_quantized): nothing else may stand
            extra = sorted(set(d) - {"group_size", "bits", "mode"})
            if extra:
                raise UserError(f"{where}: {what} holds {', '.join(map(repr, extra))}: a module's entry has only "
                                "group_size, bits and mode")

    one(q, "quantization", top=True)


def _shown(v: Any) -> str:
    text = "nothing" if v is None else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_mlx_folder(path: Path, raw: dict, cfg: CloverConfig) -> None:
    """What mlx-lm's loader reads of an MLX folder, checked before it reads it: config.json's quantization, the
    generation_config.json its load_config reads (an object; eos_token_id ids of the vocabulary), and the weight
    files it reads whole: regular files (a FIFO blocked it for ever) with well-formed headers."""
    import os

    from clover_gguf.checkpoint import read_shard_header
    from clover_gguf.config import generation_defaults, read_json

    if "quantization" in raw:
        check_quantization(raw["quantization"], f"{path}/config.json")
    elif "quantization_config" in raw and not isinstance(raw["quantization_config"], dict):
        raise UserError(f"{path}/config.json: quantization_config must be an object")
    gen = read_json(path / "generation_config.json", "generation_config.json", missing=None)
    if gen is not None:
        generation_defaults(gen, where=str(path / "generation_config.json"), vocab=cfg.vocab_size)
    files = sorted(path.glob("model*.safetensors")) + ([path / BLOCK_FILE] if os.path.lexists(path / BLOCK_FILE)
                                                       else [])
    for f in files:
        if not f.is_file():
            raise UserError(f"{f} is not a regular file (a safetensors file must be one)")
        read_shard_header(f)


def _mlx_args(cfg: CloverConfig) -> Any:
    """mlx-lm's ModelArgs for this config (text fields only)."""
    text = cfg.to_hf_dict(our_reading=False)
    text["model_type"] = "qwen3_5_moe_text"
    text["norm_topk_prob"] = True
    return qwen3_5_moe.ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": text})


@dataclass
class BlockTensors:
    """One GDN layer's block-mode tensors (spec 3a, 3b), float32: right conv weights [Kr, C] (tap j-1 at row j-1),
    tau = exp(logit scale), the history's logit and the block term's weight, each [Hv]."""

    right: Any
    tau: Any
    history_bias: Any
    history_c: Any


def _block_tensors(raw: dict[str, Any], cfg: CloverConfig) -> dict[int, BlockTensors]:
    """layer -> BlockTensors from HF-named arrays (checkpoint or clover-block.safetensors); checks every GDN layer
    has all four, and each as convert checks it (convert.block_tensor: a GDN layer's, finite, within range; of a
    floating type and the shape config.json implies)."""
    from clover_gguf.convert import block_tensor, right_kernel_from_shapes
    from clover_gguf.tensor_map import match_rule

    per: dict[int, dict[str, Any]] = {}
    shaped = right_kernel_from_shapes({n: tuple(a.shape) for n, a in raw.items() if _BLOCK_RE.match(n)}, cfg)
    for name, a in raw.items():
        m = _BLOCK_RE.match(name)
        if m:
            rule, layer = match_rule(name)
            if not mx.issubdtype(a.dtype, mx.floating):
                raise UserError(f"tensor {name} has dtype {a.dtype}: a block tensor is floating point")
            if not rule.accepts(tuple(a.shape), shaped):
                raise UserError(f"tensor {name} has shape {list(a.shape)}, config.json implies "
                                f"{list(rule.hf_shape(shaped))}")
            block_tensor(rule, name, layer, np.array(a.astype(mx.float32)), shaped)
            per.setdefault(int(m[1]), {})[m[2]] = a.astype(mx.float32)
    hv, out = cfg.linear_num_value_heads, {}
    for i in range(cfg.num_hidden_layers):
        if cfg.is_full_attention(i):
            continue
        t = per.get(i, {})
        missing = [n for n in BLOCK_NAMES if n not in t]
        if missing:
            raise UserError(f"layer {i} lacks the block tensor(s) {', '.join(missing)}")
        right = t["conv_right_weight"]
        if right.ndim == 3:
            right = right.reshape(right.shape[0], right.shape[-1])
        if right.ndim != 2 or right.shape[0] != cfg.conv_dim or (
                cfg.linear_conv_right_kernel_dim and right.shape[1] != cfg.linear_conv_right_kernel_dim):
            raise UserError(f"layer {i}: conv_right_weight has shape {tuple(right.shape)}, config.json implies "
                            f"({cfg.conv_dim}, 1, {cfg.right_kernel})")

        def heads(name: str):
            a = t[name].reshape(-1)
            if a.size == 1:
                return mx.broadcast_to(a, (hv,))
            if a.size != hv:
                raise UserError(f"layer {i}: {name} has {a.size} values, config.json implies {hv} (or one)")
            return a

        out[i] = BlockTensors(right=right.T, tau=mx.exp(heads("bd_softmax_logit_scale")),
                              history_bias=heads("bd_softmax_history_bias"), history_c=heads("bd_softmax_history_c"))
    return out


def _checkpoint_weights(path: Path, cfg: CloverConfig) -> dict[str, Any]:
    """An HF checkpoint's tensors as lazy MLX arrays under the names mlx-lm's sanitize takes (experts fused)."""
    from clover_gguf.checkpoint import EXPERT_RE, list_shards, normalise_name

    weights: dict[str, Any] = {}
    experts: dict[tuple[int, str], dict[int, Any]] = {}
    for shard in list_shards(path):
        for name, a in _mx_load(shard).items():
            norm = normalise_name(name)
            if norm is None or norm.startswith("mtp."):
                continue
            if m := EXPERT_RE.match(norm):
                experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = a
            else:
                weights[norm] = a
    for (layer, kind), per in experts.items():
        if sorted(per) != list(range(cfg.num_experts)):
            raise UserError(f"layer {layer}: {kind}_proj experts are not numbered 0..{cfg.num_experts - 1}")
        weights[f"model.layers.{layer}.mlp.experts.{kind}"] = mx.stack([per[e] for e in range(cfg.num_experts)])
    for layer in {k[0] for k in experts}:
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate" in weights and p + "up" in weights:
            weights[p + "gate_up_proj"] = mx.concatenate([weights.pop(p + "gate"), weights.pop(p + "up")], axis=1)
            weights[p + "down_proj"] = weights.pop(p + "down")
    return weights


def _cast(model, dtype: str) -> None:
    """Floating parameters to `dtype`, except those mlx-lm keeps as they are (its cast_predicate: A_log)."""
    from mlx.utils import tree_map_with_path

    keep, to = model.cast_predicate, getattr(mx, dtype)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(to) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))


def runnable_here(model) -> bool:
    """Make the model one this process's device runs: MLX's CPU device multiplies unquantized experts (gather_mm) in
    float32 only ("[GatherMM::eval] Currently only supports float32" for the BF16 checkpoint, or after mlx-convert
    --dtype bfloat16/float16), so there a model with half-precision unquantized experts is upcast to float32 (twice
    its memory; docs/mac.md has the figures). Metal runs them as they are. -> whether it was upcast."""
    from mlx_lm.models.switch_layers import SwitchLinear

    half = _half_experts_on_cpu(m.weight.dtype for _, m in model.named_modules() if isinstance(m, SwitchLinear))
    if half:
        _cast(model, "float32")
    return half


def _half_experts_on_cpu(expert_dtypes) -> bool:
    """Whether unquantized experts of these dtypes must be upcast to run here (runnable_here)."""
    return mx.default_device().type == mx.DeviceType.cpu and any(d != mx.float32 for d in expert_dtypes)


def _mx_load(path: Path) -> dict[str, Any]:
    """A safetensors file's arrays (lazy), or one UserError line for a file MLX cannot read."""
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@dataclass
class Loaded:
    """A model ready to run: mlx-lm's model, our config, the block tensors (None: AR only) and the folder's kind."""

    model: Any
    cfg: CloverConfig
    block: dict[int, BlockTensors] | None
    path: Path
    kind: str  # "checkpoint" or "mlx"
    config: dict  # config.json as mlx-lm keeps it (quantization included)
    block_raw: dict[str, Any] | None = None  # the block tensors as stored, HF names (what mlx-convert writes)


def load(path: str | Path, dtype: str | None = None, quantize: tuple[int, int] | None = None,
         run: bool = True) -> Loaded:
    """A Clover checkpoint folder or an MLX folder -> Loaded. dtype: "float32", "bfloat16", "float16" (default: the
    stored type, float32 for a checkpoint in float32); quantize: (bits, group_size) for a checkpoint (mlx-lm's
    quantization; the routers at 8 bits as mlx-lm's predicate says; the block tensors never). run: to be run here
    (runnable_here), not written (mlx-convert)."""
    import os

    from mlx_lm.utils import load_model, quantize_model

    path = Path(path)
    if not os.path.lexists(path / "config.json"):
        raise UserError(f"{path} is not a model folder (no config.json)")
    if is_mlx_folder(path):
        has_block = os.path.lexists(path / BLOCK_FILE)
        cfg, raw = _read_config(path, has_block)
        if quantize is not None:
            raise UserError(f"{path} is an MLX folder already: quantize the checkpoint instead")
        _check_mlx_folder(path, raw, cfg)
        try:
            model, config = load_model(path, lazy=True, strict=True,
                                       get_model_classes=lambda config: (qwen3_5_moe.Model, qwen3_5_moe.ModelArgs),
                                       model_config={"model_type": "qwen3_5_moe"})
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            raise UserError(f"mlx-lm cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
        block_raw = _mx_load(path / BLOCK_FILE) if has_block else None
        block = _block_tensors(block_raw, cfg) if has_block else None
        kind = "mlx"
    else:
        from clover_gguf.convert import check_checkpoint

        check_checkpoint(path)  # every check convert makes: the same folder converts and loads, or neither does
        cfg, raw = _read_config(path, has_block=False)
        model = qwen3_5_moe.Model(_mlx_args(cfg))
        weights = _checkpoint_weights(path, cfg)
        if run and dtype is None and quantize is None and \
                _half_experts_on_cpu(v.dtype for k, v in weights.items() if ".mlp.experts." in k):
            dtype = "float32"  # runnable_here, decided before sanitize (its `1 + w` of the norms in float32)
        block_raw = {k: weights.pop(k) for k in [k for k in weights if _BLOCK_RE.match(k)]}
        block = _block_tensors(block_raw, cfg) if cfg.is_clover else None
        if not cfg.is_clover and block_raw:
            raise UserError(f"{path} has block tensors but model_type {cfg.model_type!r}")
        model.eval()
        if dtype:  # before sanitize: its `1 + w` of the norms is then computed in the dtype asked for
            keep = model.cast_predicate
            weights = {k: v.astype(getattr(mx, dtype)) if keep(k) else v for k, v in weights.items()}
        try:
            model.load_weights(list(model.sanitize(weights).items()), strict=True)
        except ValueError as e:
            raise UserError(f"{path}: the weights do not fit config.json: {e}") from None
        config = dict(raw)
        if quantize is not None:
            bits, group = quantize
            if dtype:
                _cast(model, dtype)
            model, config = quantize_model(model, config, group, bits)
        kind = "checkpoint"
    if dtype:
        _cast(model, dtype)
    if run:
        runnable_here(model)
    mx.eval(model.parameters())
    if block is not None:
        mx.eval([[b.right, b.tau, b.history_bias, b.history_c] for b in block.values()])
    return Loaded(model, cfg, block, path, kind, config, block_raw if block is not None else None)


# files of a checkpoint folder an MLX folder keeps as they are (tokenizer, chat template, generation defaults)
_KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "generation_config.json")


@dataclass
class ConvertResult:
    out: Path
    bits: int | None
    group_size: int | None
    block_tensors: int
    size_bytes: int
    seconds: float
    # what "4-bit" costs: each group of q_group_size weights also stores a scale and a bias (in the weights' dtype),
    # so a quantized weight takes bits + 2 x scale bits / group size; mlx-lm's "bits per weight" (printed as it
    # quantizes) is every stored bit over every parameter: the 8-bit routers and the unquantized norms included
    scale_bits: int | None = None
    bits_per_weight: float | None = None

    @property
    def bits_per_quantized_weight(self) -> float | None:
        if not (self.bits and self.group_size and self.scale_bits):
            return None
        return self.bits + 2 * self.scale_bits / self.group_size

    def to_json(self) -> dict[str, Any]:
        bpq, bpw = self.bits_per_quantized_weight, self.bits_per_weight
        return {"out": str(self.out), "q_bits": self.bits, "q_group_size": self.group_size,
                "block_tensors": self.block_tensors, "size_bytes": self.size_bytes, "seconds": round(self.seconds, 3),
                "bits_per_quantized_weight": None if bpq is None else round(bpq, 4),
                "bits_per_weight": None if bpw is None else round(bpw, 3)}

    def summary(self) -> str:
        q = f"{self.bits}-bit, groups of {self.group_size}" if self.bits else "not quantized"
        if self.bits_per_quantized_weight is not None and self.bits_per_weight is not None:
            q += (f" ({self.bits_per_quantized_weight:g} bits per quantized weight: each group adds a "
                  f"{self.scale_bits}-bit scale and bias; {self.bits_per_weight:.3f} bits per weight over the whole "
                  "model, as mlx-lm counts it: routers at 8 bits, norms unquantized)")
        blk = (f"{self.block_tensors} block tensors kept unquantized" if self.block_tensors
               else "no block tensors (AR only)")
        return f"wrote {self.out}: MLX folder, {q}, {blk}, {self.size_bytes / 2**30:.3f} GiB in {self.seconds:.1f} s"


def write_folder(loaded: Loaded, tmp: Path, src: Path | None = None) -> int:
    """Write `loaded` as an MLX folder into the empty folder `tmp` (mlx-lm's save_model and save_config; the block
    tensors in BLOCK_FILE; the tokenizer files copied from `src`) -> the number of block tensors written."""
    import shutil

    from mlx_lm.utils import save_config, save_model

    config = {k: v for k, v in loaded.config.items()}
    config["model_type"] = "qwen3_5_moe"  # mlx-lm's class for it; the block file makes it Clover again
    config["architectures"] = ["Qwen3_5MoeForCausalLM"]
    try:  # MLX reports a failed write (a full disk) as a RuntimeError: an OSError for atomic_folder's one line
        save_model(tmp, loaded.model, donate_model=True)
        save_config(config, tmp / "config.json")
        if loaded.block_raw:
            mx.save_safetensors(str(tmp / BLOCK_FILE), {k: v.astype(mx.float32) for k, v in loaded.block_raw.items()},
                                metadata={"format": "mlx", "clover": "block-mode tensors, HF names"})
    except RuntimeError as e:
        raise OSError(str(e).splitlines()[0] if str(e) else "MLX could not write the folder") from None
    n = len(loaded.block_raw or {})
    for name in _KEPT_FILES if src is not None else ():
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    return n


def _folder_bytes(loaded: Loaded, src: Path) -> int:
    """About what write_folder writes: the model's arrays as they are held, the block tensors in float32, the kept
    files."""
    from mlx.utils import tree_flatten

    arrays = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    block = sum(v.size * 4 for v in (loaded.block_raw or {}).values())
    kept = sum((src / n).stat().st_size for n in _KEPT_FILES if (src / n).is_file())
    return arrays + block + kept + 2**20


def convert(src: str | Path, out: str | Path, q_bits: int | None = None, q_group_size: int = 64,
            dtype: str | None = None, force: bool = False) -> ConvertResult:
    """A Clover checkpoint folder -> an MLX folder (mlx-lm's layout and quantization; the block tensors kept
    unquantized in BLOCK_FILE). The folder appears whole or not at all."""
    import contextlib
    import sys
    import time

    from clover_gguf.fsutil import atomic_folder, check_free_disk, check_output_folder

    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if q_bits is not None and q_bits not in (2, 3, 4, 5, 6, 8):
        raise UserError(f"--q-bits must be 2, 3, 4, 5, 6 or 8, not {q_bits}")
    if q_group_size not in (32, 64, 128):
        raise UserError(f"--q-group-size must be 32, 64 or 128, not {q_group_size}")
    if not src.is_dir():
        raise UserError(f"{src} is not a checkpoint folder")
    if is_mlx_folder(src):
        raise UserError(f"{src} is an MLX folder already: mlx-convert takes the checkpoint")
    check_output_folder(out, [src, *src.iterdir()], force=force)
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its bits per weight (the summary says it again)
        loaded = load(src, dtype=dtype, quantize=(q_bits, q_group_size) if q_bits else None, run=False)
    check_free_disk(out, _folder_bytes(loaded, src))
    scale_bits = bpw = None
    if q_bits:  # before writing: save_model gives the model's arrays away
        from mlx_lm.utils import compute_bits_per_weight

        bpw = float(compute_bits_per_weight(loaded.model))
        scales = next((m.scales for _, m in loaded.model.named_modules() if hasattr(m, "scales")), None)
        scale_bits = None if scales is None else scales.dtype.size * 8
    with atomic_folder(out) as tmp:
        n = write_folder(loaded, tmp, src)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return ConvertResult(out, q_bits, q_group_size if q_bits else None, n, size, time.perf_counter() - t0,
                         scale_bits=scale_bits, bits_per_weight=bpw)


# ---------------------------------------------------------------------------------------------------------------
# Block mode on mlx-lm's modules (docs/architecture.md section 3); nothing here writes a cache
# ---------------------------------------------------------------------------------------------------------------
def coreset_keep(probs, top_k: int, top_p: float):
    """Spec 3d on one block: router probabilities [T, E] -> bool [E], the experts of the coreset S (every token's
    top-k candidates ranked by aggregated mass, ties to the lower index, the smallest leading set reaching top_p of
    the mass, extended to at least k)."""
    n_exp = probs.shape[-1]
    top = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k]  # [T, k]
    cand = mx.put_along_axis(mx.zeros(probs.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
    mass = mx.sum(mx.where(cand, probs, 0.0), axis=0)  # [E]
    ranked = mx.sort(mass)[::-1]  # descending
    before = mx.cumsum(ranked) - ranked  # the mass ranked ahead of each
    n_keep = mx.sum(before < top_p * mx.sum(mass))
    n_keep = mx.minimum(mx.maximum(n_keep, top_k), n_exp)
    # each expert's rank: heavier experts, and equal ones with a lower index, come first
    idx = mx.arange(n_exp)
    ahead = (mass[None, :] > mass[:, None]) | ((mass[None, :] == mass[:, None]) & (idx[None, :] < idx[:, None]))
    return mx.sum(ahead, axis=1) < n_keep


def _moe(mlp, x, coreset_top_p: float | None):
    """mlx-lm's sparse MoE block, with the block's coreset (spec 3d) when coreset_top_p is given."""
    if coreset_top_p is None:
        return mlp(x)
    probs = mx.softmax(mlp.gate(x), axis=-1, precise=True)  # [1, T, E]
    keep = coreset_keep(probs[0], mlp.top_k, coreset_top_p)
    probs = mx.where(keep, probs, 0.0)
    k = mlp.top_k
    inds = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(probs, inds, axis=-1)
    scores = scores / scores.sum(axis=-1, keepdims=True)
    y = (mlp.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
    return y + mx.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)


def _gdn_block(la, x, cache, bt: BlockTensors):
    """A GDN layer in block mode: right convolution (3a), the delta rule continued from the prefix state, the
    block softmax (3b); the cache is read, never written."""
    b_, t, _ = x.shape
    qkv = la.in_proj_qkv(x)
    z = la.in_proj_z(x).reshape(b_, t, la.num_v_heads, la.head_v_dim)
    beta_in, a_in = la.in_proj_b(x), la.in_proj_a(x)
    conv_state = cache[0] if cache is not None and cache[0] is not None else \
        mx.zeros((b_, la.conv_kernel_size - 1, la.conv_dim), dtype=x.dtype)
    conv = la.conv1d(mx.concatenate([conv_state, qkv], axis=1))  # [B, T, C], the causal conv
    kr = bt.right.shape[0]
    padded = mx.concatenate([qkv, mx.zeros((b_, kr, la.conv_dim), dtype=qkv.dtype)], axis=1)
    for j in range(1, kr + 1):  # right[t] = sum_j wr[:, j-1] * mixed[t + j], zeros past the block
        conv = conv + bt.right[j - 1].astype(qkv.dtype) * padded[:, j:j + t]
    u = nn.silu(conv)
    q, k, v = [a.reshape(b_, t, h, d) for a, h, d in zip(
        mx.split(u, [la.key_dim, 2 * la.key_dim], -1), [la.num_k_heads, la.num_k_heads, la.num_v_heads],
        [la.head_k_dim, la.head_k_dim, la.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=la.head_k_dim ** -0.5, eps=1e-6)  # q carries 1/sqrt(dk), as mlx-lm's
    state = cache[1] if cache is not None else None
    o, _ = gated_delta_update(q, k, v, a_in, beta_in, la.A_log, la.dt_bias, state, None,
                              use_kernel=not la.training)  # the new state is dropped
    # block softmax over the block, both directions, plus the history's logit; q without the 1/sqrt(dk)
    rep = la.num_v_heads // la.num_k_heads
    qh = mx.repeat(q * math.sqrt(la.head_k_dim), rep, axis=2).astype(mx.float32).transpose(0, 2, 1, 3)
    kh = mx.repeat(k, rep, axis=2).astype(mx.float32).transpose(0, 2, 1, 3)  # [B, Hv, T, dk]
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * bt.tau[None, :, None, None]  # [B, Hv, T, T]
    hist = mx.broadcast_to(bt.history_bias[None, :, None, None], (b_, la.num_v_heads, t, 1))
    p = mx.softmax(mx.concatenate([scores, hist], axis=-1), axis=-1, precise=True)[..., :t]
    o_sm = (p @ v.astype(mx.float32).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, T, Hv, dv]
    o = o + (bt.history_c[None, None, :, None] * o_sm).astype(o.dtype)
    return la.out_proj(la.norm(o, z).reshape(b_, t, -1))


def _attention_block(attn, x, cache):
    """Gated full attention in block mode (3c): every prefix key and every block key, positions continuing the
    prefix; the KV cache is read, never written."""
    b_, t, _ = x.shape
    queries, gate = mx.split(attn.q_proj(x).reshape(b_, t, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(b_, t, -1)
    keys = attn.k_norm(attn.k_proj(x).reshape(b_, t, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(b_, t, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    offset = cache.offset if cache is not None else 0
    queries, keys = attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)
    if offset:
        pk, pv = cache.keys[..., :offset, :], cache.values[..., :offset, :]
        keys, values = mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=None)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b_, t, -1) * mx.sigmoid(gate))


def block_forward(loaded: Loaded, ids, cache, coreset_top_p: float | None):
    """Block-mode logits [1, T, V] for the block `ids` [1, T] after the prefix held in `cache` (left as it is)."""
    lm = loaded.model.language_model
    h = lm.model.embed_tokens(ids)
    for i, (layer, c) in enumerate(zip(lm.model.layers, cache)):
        x = layer.input_layernorm(h)
        r = _gdn_block(layer.linear_attn, x, c, loaded.block[i]) if layer.is_linear else \
            _attention_block(layer.self_attn, x, c)
        h = h + r
        h = h + _moe(layer.mlp, layer.post_attention_layernorm(h), coreset_top_p)
    h = lm.model.norm(h)
    return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)


# ---------------------------------------------------------------------------------------------------------------
# The selection's rows in MLX (decoding.GraphBackend): what llama.cpp's graph returns (controls.GraphRows)
# ---------------------------------------------------------------------------------------------------------------
MAX_CHUNKS = 256
PREFILL_CHUNK = 2048  # mlx-lm's prefill_step_size


def _chunks(n_vocab: int) -> int:
    """How many equal chunks of consecutive ids the rest of a row is read in: the most up to MAX_CHUNKS."""
    return max(d for d in range(1, min(MAX_CHUNKS, n_vocab) + 1) if n_vocab % d == 0)


def _rows(logits, gather: Gather) -> GraphRows:
    """Rows [T, V] of logits (MLX) -> the greedy GraphRows controls.Selector.choose reads, as libclover_sampler
    computes them in llama.cpp's graph: the processed logits at the gathered ids (gather.coef applied), for the rest
    of each row (the gathered ids left out) each chunk's largest logit, its id (the lowest on ties) and, with
    gather.probs, its probability within the chunk's softmax; and the row's choice, the largest of those (the lowest
    id among equal ones). A row a mask restricts (gather.masks) has -inf wherever its mask does not allow (the
    bitmask unpacked in MLX); with gather.top_n the processed row's top_n most likely tokens, with gather.save_last
    the last row's raw logits kept in MLX for a token asked for later. Only these leave MLX."""
    if gather.temp > 0:
        raise ValueError("the MLX backend selects greedily in MLX; sampling runs on numpy logits")
    t, v = logits.shape
    logits = logits.astype(mx.float32)
    raw_last = logits[-1] if gather.save_last else None
    if gather.masks:  # [K, words] bitmasks -> [T, V] allowed, for the rows that have one
        words = mx.array(np.stack([m.words for m in gather.masks]).view(np.uint32))
        bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        allowed = bits.reshape(len(gather.masks), -1)[:, :v].astype(mx.bool_)
        row = np.asarray(gather.row_mask, dtype=np.int32)
        allowed = mx.where(mx.array(row >= 0)[:, None], allowed[mx.array(np.maximum(row, 0))], True)
        logits = mx.where(allowed, logits, -mx.inf)
    ids = mx.array(np.asarray(gather.ids, dtype=np.int32))
    at = mx.take(logits, ids, axis=1)  # [T, W]
    if gather.coef is not None:
        c = mx.array(np.asarray(gather.coef, dtype=np.float32))  # [3, T, W]
        at = at * mx.where(at > 0, c[0], c[1]) + c[2]
    gathered = mx.zeros((v,), dtype=mx.bool_)
    gathered[ids] = True
    n = _chunks(v)
    rest = mx.where(gathered, -mx.inf, logits).reshape(t, n, v // n)
    best = mx.max(rest, axis=-1)  # [T, n]
    arg = mx.argmax(rest, axis=-1).astype(mx.int64) + mx.arange(n, dtype=mx.int64) * (v // n)
    values = mx.concatenate([at, best], axis=1)  # [T, W + n]
    cand = mx.concatenate([mx.broadcast_to(ids.astype(mx.int64)[None], at.shape), arg], axis=1)
    top = mx.max(values, axis=-1, keepdims=True)
    pick = mx.argmax(mx.where(values == top, (1 << 24) - cand, 0), axis=-1)  # the lowest id among the largest
    token = mx.take_along_axis(cand, pick[:, None], axis=1)[:, 0]
    outs = [at, best, arg, token, top[:, 0]]
    if gather.probs:
        outs.append(1.0 / mx.sum(mx.exp(rest - best[..., None]), axis=-1))
    k = gather.top_n
    if k:  # the processed row: the rest, the corrected logits back at the ids
        z = mx.where(gathered, -mx.inf, logits)
        z[:, ids] = at
        top_ids = mx.argpartition(-z, kth=k - 1, axis=-1)[:, :k]
        outs += [top_ids, mx.take_along_axis(z, top_ids, axis=-1)]
    mx.eval(outs + ([raw_last] if raw_last is not None else []))
    at_, best_, arg_, token_, top_, *more = (np.array(o) for o in outs)
    p = more.pop(0) if gather.probs else None
    out = GraphRows(at_ids=at_, rest_ids=arg_, rest_logits=best_, rest_probs=p, tokens=token_, token_logits=top_)
    if k:
        out.top_ids, out.top_logits = more
    if raw_last is not None:
        out.saved = lambda tok: float(raw_last[int(tok)].item())
    return out


# ---------------------------------------------------------------------------------------------------------------
# The decoding backend
# ---------------------------------------------------------------------------------------------------------------
def _on_stream(method):
    """Run a pass's MLX work on the backend's thread-local stream (as mlx-lm's generation stream): a server runs its
    requests in worker threads, and an MLX stream belongs to the thread that made it."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with mx.stream(self._stream):
            return method(self, *args, **kwargs)

    return wrapper


class MlxBackend:
    """decoding.Backend on MLX (as runtime.LlamaBackend is on llama.cpp and reference.ReferenceBackend on PyTorch).

    The committed prefix lives in mlx-lm's caches. Rollback: the KV caches are trimmed to before the latest commit,
    the GDN layers' (conv, delta-rule) states taken back to the copy held from before it (MLX arrays are values:
    holding them costs nothing), and the kept tokens are run again (backend work, not a counted pass)."""

    READINGS = (READING,)  # the readings of the block softmax this backend computes (metadata.READINGS)

    def __init__(self, loaded: Loaded, eos_ids: Sequence[int] | None = None, coreset: bool | float | None = None):
        self.loaded, self.model, self.cfg = loaded, loaded.model, loaded.cfg
        cfg = self.cfg
        self.block_mode = loaded.block is not None and cfg.mask_token_id is not None
        self.mask_token_id = int(cfg.mask_token_id) if cfg.mask_token_id is not None else -1
        eos = eos_ids if eos_ids is not None else cfg.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.block_size = int(cfg.block_size)
        if coreset is None:
            coreset = cfg.moe_block_coreset_enabled
        self.coreset_top_p = None if coreset is False else \
            (cfg.moe_block_coreset_top_p if coreset is True else float(coreset))
        # decoding._Passes reads it: select in MLX (the GraphBackend methods below) rather than on numpy logits; off
        # by default, as those methods serve the greedy selection only (MlxRuntime turns it on for greedy answers)
        self.select_in_graph = False
        # a prompt runs in passes of this many tokens, as mlx-lm's prefill does: a long one's attention scores in one
        # pass would not fit (16 heads x T x T floats)
        self.prefill_chunk = PREFILL_CHUNK
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self.keep_backup = True  # the runtime's switches (runtime.CloverRuntime.stream_ids sets them)
        self.keep_at = None
        self.extra_passes = 0
        self.prefill_seconds = 0.0
        self.reused = 0
        self.reset()

    @property
    def n_past(self) -> int:
        return len(self._ids)

    @property
    def n_vocab(self) -> int:
        return int(self.cfg.vocab_size)

    def reset(self) -> None:
        self._ids: list[int] = []
        self._cache = self.model.make_cache()
        self._before: tuple[int, list] | None = None  # (n_past, the GDN states) before the latest commit

    def forget_prefix(self) -> None:
        self.reset()

    def _forward(self, ids: Sequence[int]):
        return self.model(mx.array([list(ids)], dtype=mx.int32), cache=self._cache)

    def _logits(self, out) -> np.ndarray:
        return np.array(out[0].astype(mx.float32))

    def _commit(self, ids: Sequence[int], chunk: int | None = None):
        """Run `ids` causally (in passes of `chunk` tokens, the logits of all but the last dropped) -> the last
        pass's logits [T, V], not evaluated yet."""
        if not len(ids):
            raise ValueError("commit needs at least one token")
        self._before = (len(self._ids), [list(c.cache) if not hasattr(c, "offset") else None for c in self._cache])
        ids, done = [int(t) for t in ids], 0
        while chunk and len(ids) - done > chunk:
            self._forward(ids[done:done + chunk])
            mx.eval([a for c in self._cache for a in ([c.keys, c.values] if hasattr(c, "offset") else c.cache)])
            done += chunk
        out = self._forward(ids[done:])[0]
        self._ids.extend(ids)
        return out

    @_on_stream
    def commit(self, ids: Sequence[int]) -> np.ndarray:
        return self._logits(self._commit(ids)[None])

    @_on_stream
    def commit_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None:
        out = self._commit(ids)
        return _rows(out, gather) if gather is not None else mx.eval(out)

    @_on_stream
    def _prefill(self, ids: Sequence[int], gather: Gather | None, dense: bool):
        import time

        t0 = time.perf_counter()
        self.reused = 0
        last = self._commit(ids, chunk=self.prefill_chunk)[-1:]
        out = self._logits(last[None])[-1] if dense else _rows(last, gather) if gather is not None else mx.eval(last)
        self.prefill_seconds += time.perf_counter() - t0
        return out

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        return self._prefill(ids, None, dense=True)

    def prefill_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None:
        return self._prefill(ids, gather, dense=False)

    def _block(self, block: Sequence[int]):
        if not self.block_mode:
            raise UserError("this model has no block-mode tensors (or no mask_token_id): block mode is unavailable")
        ids = mx.array([list(block)], dtype=mx.int32)
        return block_forward(self.loaded, ids, self._cache, self.coreset_top_p)[0]

    @_on_stream
    def block_logits(self, block: Sequence[int]) -> np.ndarray:
        return self._logits(self._block(block)[None])

    @_on_stream
    def block_rows(self, block: Sequence[int], positions: Sequence[int], gather: Gather) -> GraphRows:
        return _rows(self._block(block)[mx.array(list(positions), dtype=mx.int32)], gather)

    @_on_stream
    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._before is None or len(self._ids) - n < self._before[0]:
            raise ValueError("rollback reaches past the latest commit")
        n0, states = self._before
        keep = self._ids[n0:len(self._ids) - n]
        for c, st in zip(self._cache, states):
            if st is None:
                c.trim(len(self._ids) - n0)
            else:
                c.cache = st
        self._ids = self._ids[:n0]
        self._before = None
        if keep:
            mx.eval(self._forward(keep))
            self._ids.extend(keep)
        self.extra_passes += 1
