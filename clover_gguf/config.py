"""Clover's shapes and settings, read from a checkpoint's config.json with the HF field names."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_gguf.errors import UserError
from clover_gguf.metadata import READING, READING_FIELD, GenerationDefaults

# the real checkpoint's identity (Diffuspace/Clover-35B-A3B-Preview, custom code)
CLOVER_MODEL_TYPE = "clover_moe"
CLOVER_ARCHITECTURE = "CloverMoeModelLM"
CLOVER_MODEL_TYPES = {CLOVER_MODEL_TYPE, "clover_moe_text"}
PLAIN_QWEN_MODEL_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text"}
FULL_ATTENTION = "full_attention"
# The 35B's config.json shape with the Clover keys (rope_theta and mask_token_id are placeholders): package data,
# for size planning (`quantize --plan`, `fit`) and the slice35b test model. Use shapes, not values.
SHAPE_35B = Path(__file__).resolve().parent / "data" / "clover-35b-a3b-shape.json"
LINEAR_ATTENTION = "linear_attention"

# Limits a config.json must stay within, checked before anything is sized from it. Layers and experts are
# llama.cpp's own limits (LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS: above them it aborts); the others are far above any
# model (the 35B: vocabulary 248,320, widths up to 8,192) yet small enough that nothing we build from them (a token
# list, a header-only skeleton) can exhaust memory.
MAX_LAYERS = 512
MAX_EXPERTS = 1024
MAX_VOCAB = 2**22
MAX_WIDTH = 2**20  # any one width or head count
MAX_KERNEL = 64
MAX_BLOCK = 4096  # a diffusion block: one block pass holds it in a single ubatch
# the context a model may claim: 128 times the 35B's 131,072 and above any published model. llama.cpp pads n_ctx to
# a multiple of 256 in a u32 (2^32 - 1 wraps to 0 and aborts), and a context is sized before it is refused:
# planning 2^31 tokens took 50 s, planning 2^24 takes about 2 s and 1 GB
MAX_CONTEXT = 2**24
MAX_U32 = 2**32 - 1
MAX_I32 = 2**31 - 1
# a checkpoint's or an MLX folder's JSON side file (config, generation config, tokenizer files, safetensors index; the
# 35B's index is about 2 MB, every expert of every layer named, its tokenizer.json about 13 MB): a larger one is
# refused before it is read whole
MAX_JSON_BYTES = 64 * 2**20
MAX_F32 = 3.4028234663852886e38  # the largest float32: a larger value is written to the GGUF as inf
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size")


_REQUIRED = object()


def read_json(path: Path, what: str, missing: Any = _REQUIRED) -> Any:
    """A JSON side file (config, generation config, tokenizer files: read_json_bytes), or one UserError line saying
    why it is not one (binary, invalid, nested past the stack). missing: what an absent file gives (default: the
    error)."""
    blob = read_json_bytes(path, what, missing=missing is not _REQUIRED)
    return missing if blob is None else parse_json(blob, str(path), what)


def read_json_bytes(path: Path, what: str, missing: bool = False) -> bytes | None:
    """The bytes of a JSON side file, the one reader of convert, graft, mlx-convert and the MLX loader: a regular file
    (a FIFO would block its reader for ever, a device never end) of at most MAX_JSON_BYTES, else one UserError line.
    missing: None for a file that is not there (no entry of that name), instead of the error."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path} is not a regular file ({what} must be one)")
        if st.st_size > MAX_JSON_BYTES:
            raise UserError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB: not a {what}")
        with open(path, "rb") as f:
            blob = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        if missing and not os.path.lexists(path):
            return None
        raise UserError(f"cannot read {path}: no such file" + (" (a link to nothing)" if os.path.lexists(path)
                                                                else "")) from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if len(blob) > MAX_JSON_BYTES:  # it grew while it was read
        raise UserError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB: not a {what}")
    return blob


def parse_json(blob: bytes, where: str, what: str) -> Any:
    """JSON bytes (from a file, or from the Hub) -> the object, or one UserError line saying why they are not JSON:
    not UTF-8, invalid, or nested so deeply that Python's reader runs out of stack (RecursionError)."""
    try:
        return json.loads(blob.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{where} is not a text file ({what} must be UTF-8 JSON)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise UserError(f"{where}: {what} is nested too deeply") from None


class _Fields:
    """Typed, range-checked reads from one JSON object; every failure names the field."""

    def __init__(self, d: dict[str, Any], where: str = "config.json"):
        self.d, self.where = d, where

    def _fail(self, key: str, want: str, v: Any) -> UserError:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
        return UserError(f"{self.where}: {key} must be {want}, not {shown}")

    def int(self, key: str, lo: int, hi: int, default: Any = ...) -> Any:
        v = self.d.get(key)
        if v is None:
            if default is ...:
                raise UserError(f"{self.where} lacks required field {key}")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, "an integer", v)
        if not lo <= v <= hi:
            raise self._fail(key, f"an integer in {lo}..{hi}", v)
        return v

    def float(self, key: str, default: float) -> float:
        v = self.d.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > MAX_F32:
            raise self._fail(key, "a finite number (within float32's range: it is written as one)", v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._fail(key, "true or false", v)
        return v

    def str(self, key: str, default: str) -> str:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v

    def obj(self, key: str) -> dict[str, Any] | None:
        v = self.d.get(key)
        if v is not None and not isinstance(v, dict):
            raise self._fail(key, "an object", v)
        return v

    def int_list(self, key: str, lo: int, hi: int) -> list[int]:
        v = self.d.get(key)
        if not isinstance(v, list) or len(v) > 8 or not all(
                isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v):
            raise self._fail(key, f"a short list of integers in {lo}..{hi}", v)
        return v

    def token_id(self, key: str, vocab: int) -> int | None:
        return self.int(key, 0, vocab - 1, default=None) if self.d.get(key) is not None else None

    def token_ids(self, key: str, vocab: int) -> int | list[int] | None:
        v = self.d.get(key)
        if isinstance(v, list):
            return [_Fields({key: x}, self.where).int(key, 0, vocab - 1) for x in v]
        return self.token_id(key, vocab)


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
    model_type: str = CLOVER_MODEL_TYPE
    num_shared_experts: int = 1
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
    def from_dict(cls, raw: Any) -> "CloverConfig":
        """Accept a text config, or a ForConditionalGeneration config with `text_config` inside. Every field is
        type- and range-checked here, before anything is sized from it (see `LIMITS`)."""
        if not isinstance(raw, dict):
            raise UserError(f"config.json must be a JSON object, not {type(raw).__name__}")
        outer_type = raw.get("model_type", "")
        d = dict(raw)
        text_config = raw.get("text_config")
        if text_config is not None and not isinstance(text_config, dict):
            raise UserError(f"config.json: text_config must be an object, not {type(text_config).__name__}")
        if text_config is not None:
            d = {**text_config}
            # Clover keys may sit at either level; the text config wins.
            for key in ("mask_token_id", "block_size", "linear_conv_right_kernel_dim", "moe_block_coreset_enabled",
                        "moe_block_coreset_top_p", "eos_token_id", "tie_word_embeddings", "num_shared_experts"):
                if key not in d and key in raw:
                    d[key] = raw[key]
            d.setdefault("model_type", outer_type)
            if outer_type in CLOVER_MODEL_TYPES:
                d["model_type"] = CLOVER_MODEL_TYPE
        model_type = d.get("model_type", "")
        if model_type == "clover":
            raise UserError("model_type 'clover' was clover-gguf's own name for Clover before the real checkpoint's; "
                            f"the real Clover is {CLOVER_MODEL_TYPE!r} ({CLOVER_ARCHITECTURE}): remake this checkpoint "
                            "with the current make_tiny, or set its model_type and tensor names as docs/architecture.md says")
        if not isinstance(model_type, str) or model_type not in CLOVER_MODEL_TYPES | PLAIN_QWEN_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r}: expected {CLOVER_MODEL_TYPE} or qwen3_5_moe "
                "(Qwen3.5/3.6-MoE text)"
            )
        missing = [k for k in REQUIRED if d.get(k) is None]
        if missing:
            raise UserError(f"config.json lacks required field(s): {', '.join(missing)}")
        f = _Fields(d)
        n_layers = f.int("num_hidden_layers", 1, MAX_LAYERS)
        vocab = f.int("vocab_size", 1, MAX_VOCAB)
        hidden = f.int("hidden_size", 1, MAX_WIDTH)
        n_heads = f.int("num_attention_heads", 1, MAX_WIDTH)
        n_kv = f.int("num_key_value_heads", 1, MAX_WIDTH)
        head_dim = f.int("head_dim", 1, MAX_WIDTH, default=max(1, hidden // n_heads))
        n_experts = f.int("num_experts", 1, MAX_EXPERTS)

        rope = f.obj("rope_parameters") or f.obj("rope_scaling") or {}
        r = _Fields(rope, "config.json rope_parameters")
        rope_theta = r.float("rope_theta", default=f.float("rope_theta", default=10_000_000.0))
        partial = r.float("partial_rotary_factor", default=f.float("partial_rotary_factor", default=0.25))
        mrope = r.int_list("mrope_section", 0, MAX_WIDTH) if rope.get("mrope_section") is not None else None
        interval = f.int("full_attention_interval", 1, MAX_LAYERS, default=4)
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise UserError("config.json: layer_types must be a list of strings")
        if len(layer_types) != n_layers:
            raise UserError(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {n_layers}")
        bad = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise UserError(f"unknown layer type(s) in layer_types: {', '.join(bad)}")
        known = {fl.name for fl in dataclasses.fields(cls)}
        cfg = cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            linear_num_key_heads=f.int("linear_num_key_heads", 1, MAX_WIDTH),
            linear_num_value_heads=f.int("linear_num_value_heads", 1, MAX_WIDTH),
            linear_key_head_dim=f.int("linear_key_head_dim", 1, MAX_WIDTH),
            linear_value_head_dim=f.int("linear_value_head_dim", 1, MAX_WIDTH),
            linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", 1, MAX_KERNEL),
            num_experts=n_experts,
            num_experts_per_tok=f.int("num_experts_per_tok", 1, n_experts),
            moe_intermediate_size=f.int("moe_intermediate_size", 1, MAX_WIDTH),
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", 1, MAX_WIDTH),
            layer_types=tuple(layer_types),
            rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            mrope_section=tuple(mrope) if mrope else None,
            max_position_embeddings=f.int("max_position_embeddings", 1, MAX_CONTEXT, default=131072),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            full_attention_interval=interval,
            hidden_act=f.str("hidden_act", default="silu"),
            model_type=CLOVER_MODEL_TYPE if model_type in CLOVER_MODEL_TYPES else model_type,
            num_shared_experts=f.int("num_shared_experts", 1, 1, default=1),
            mask_token_id=f.token_id("mask_token_id", vocab),
            block_size=f.int("block_size", 1, MAX_BLOCK, default=32),
            linear_conv_right_kernel_dim=f.int("linear_conv_right_kernel_dim", 1, MAX_KERNEL, default=None),
            moe_block_coreset_enabled=f.bool("moe_block_coreset_enabled", default=True),
            moe_block_coreset_top_p=f.float("moe_block_coreset_top_p", default=0.9),
            mtp_num_hidden_layers=f.int("mtp_num_hidden_layers", 0, MAX_LAYERS - n_layers, default=0),
            eos_token_id=f.token_ids("eos_token_id", vocab),
            bos_token_id=f.token_id("bos_token_id", vocab),
            pad_token_id=f.token_id("pad_token_id", vocab),
            extra={k: v for k, v in d.items() if k not in known},
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "CloverConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not os.path.lexists(path):
            raise UserError(f"missing config.json: {path}")
        return cls.from_dict(read_json(path, "config.json"))

    def validate(self) -> None:
        """The relations between fields that llama.cpp (or the reference) relies on; each field's own range is
        checked when it is read."""
        if self.hidden_act != "silu":
            raise UserError(f"hidden_act {self.hidden_act!r} is not supported (Clover uses silu)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UserError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"num_experts_per_tok must be 1..num_experts ({self.num_experts}), "
                            f"not {self.num_experts_per_tok}")
        if not 0.0 < self.moe_block_coreset_top_p <= 1.0:
            raise UserError(f"moe_block_coreset_top_p must be in (0, 1], not {self.moe_block_coreset_top_p}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise UserError(f"rope partial_rotary_factor must be in (0, 1], not {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise UserError(f"head_dim * partial_rotary_factor must be even and at least 2, not {self.rotary_dim}")
        if not self.rms_norm_eps > 0.0:
            raise UserError(f"rms_norm_eps must be a positive number, not {self.rms_norm_eps}")
        if not self.rope_theta > 0.0:
            raise UserError(f"rope_theta must be a positive number, not {self.rope_theta}")
        sections = self.rope_sections
        if len(sections) > 4 or not 0 < sum(sections) <= self.head_dim:
            raise UserError(f"rope mrope_section {list(sections)}: at most 4 sections summing to 1..head_dim "
                            f"({self.head_dim}) (llama.cpp's rope needs that)")
        if self.num_hidden_layers + self.mtp_num_hidden_layers > MAX_LAYERS:
            raise UserError(f"num_hidden_layers + mtp_num_hidden_layers is over llama.cpp's {MAX_LAYERS} layers")

    @property
    def rope_sections(self) -> tuple[int, ...]:
        """The rope sections written to the GGUF: mrope_section, or Qwen3.5's (11, 11, 10) (text positions are
        the same in every section, so for text only the total matters)."""
        return tuple(self.mrope_section or (11, 11, 10))

    def to_hf_dict(self, our_reading: bool = True) -> dict[str, Any]:
        """The config.json a Clover checkpoint carries (used by make_tiny and train_tiny, whose block tensors are
        made under our reading of their math: `our_reading` says so in the file)."""
        d: dict[str, Any] = {
            "architectures": [CLOVER_ARCHITECTURE] if self.is_clover else ["Qwen3_5MoeForCausalLM"],
            "model_type": CLOVER_MODEL_TYPE if self.is_clover else "qwen3_5_moe_text",
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
                num_shared_experts=self.num_shared_experts,
                mask_token_id=self.mask_token_id,
                block_size=self.block_size,
                linear_conv_right_kernel_dim=self.right_kernel,
                moe_block_coreset_enabled=self.moe_block_coreset_enabled,
                moe_block_coreset_top_p=self.moe_block_coreset_top_p,
            )
            if our_reading:  # the reading they were made under (train_tiny --reading), else the default
                d[READING_FIELD] = self.extra.get(READING_FIELD, READING)
        return d


def generation_defaults(d: Any, where: str = "generation_config.json", vocab: int = MAX_VOCAB) -> GenerationDefaults:
    """A generation_config.json object -> GenerationDefaults, every value type- and range-checked (one line, exit 2
    for a bad one); its eos_token_id (which the MLX path and mlx-lm read) ids in 0..vocab-1."""
    if not isinstance(d, dict):
        raise UserError(f"{where} must be a JSON object, not {type(d).__name__}")
    f = _Fields(d, where)
    f.token_ids("eos_token_id", vocab)
    kwargs: dict[str, Any] = {}
    for hf_key, name in GenerationDefaults.HF_KEYS.items():
        default = getattr(GenerationDefaults, name)
        if isinstance(default, int):
            lo, hi = (1, MAX_BLOCK) if name == "block_size" else (0, MAX_U32)
            kwargs[name] = f.int(hf_key, lo, hi, default=default)
        else:
            kwargs[name] = f.float(hf_key, default=default)
    _check_sampling_keys(f, where)
    if not 0.0 <= kwargs["threshold"] <= 1.0:
        raise UserError(f"{where}: threshold must be in [0, 1], not {kwargs['threshold']}")
    if not kwargs["repetition_penalty"] > 0.0:
        raise UserError(f"{where}: repetition_penalty must be positive, not {kwargs['repetition_penalty']}")
    return GenerationDefaults(**kwargs)


# generation_config.json's sampling keys that gguf-py's Metadata.load copies into general.sampling.* (convert's
# describe): key -> (kind, low, high), the GGUF type it is written as (int32, float32, string) and its range
SAMPLING_KEYS: dict[str, tuple[str, float, float]] = {
    "top_k": ("int", 0, MAX_I32), "penalty_last_n": ("int", -1, MAX_I32), "mirostat": ("int", 0, 2),
    "temperature": ("float", 0.0, MAX_F32), "top_p": ("float", 0.0, 1.0), "min_p": ("float", 0.0, 1.0),
    "xtc_probability": ("float", 0.0, 1.0), "xtc_threshold": ("float", 0.0, 1.0),
    "penalty_repeat": ("float", 0.0, MAX_F32), "mirostat_tau": ("float", 0.0, MAX_F32),
    "mirostat_eta": ("float", 0.0, MAX_F32), "sequence": ("str", 0, 0),
}


def _check_sampling_keys(f: _Fields, where: str) -> None:
    """The sampling keys a converted file carries (SAMPLING_KEYS): of their type and in range, so a bad one is one
    line here rather than gguf-py's struct.error while writing (or an inf / out-of-range value in the file)."""
    for key, (kind, lo, hi) in SAMPLING_KEYS.items():
        if kind == "int":
            f.int(key, int(lo), int(hi), default=None)
        elif kind == "str":
            f.str(key, default="")
        else:
            v = f.float(key, default=lo)
            if not lo <= v <= hi:
                want = f"at least {lo:g}" if hi == MAX_F32 else f"in [{lo:g}, {hi:g}]"
                raise UserError(f"{where}: {key} must be {want}, not {v:g}")
