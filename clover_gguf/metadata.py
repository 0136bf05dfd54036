"""Clover's GGUF metadata: the `clover_moe.*` key names and the model card's generation defaults they carry.

The architecture is upstream llama.cpp's `clover_moe` (b12060, AR-only); the keys below that upstream does not
write are our block-mode additions (docs/gguf.md). The converter writes these keys, the runtime, the quantizer and
the benches read them; every module takes the names from here. llama.cpp's own hyperparameters
(`clover_moe.embedding_length`, `clover_moe.expert_count`, ...) are written by the converter's hparam table and read
by llama.cpp; `hparam(name)` names one of them for a Python reader.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from clover_gguf.errors import UserError

ARCH = "clover_moe"  # general.architecture (upstream's name), and the prefix of every key below
HF_REPO = "Diffuspace/Clover-35B-A3B-Preview"  # the real checkpoint (graft reads its block tensors from here)
OLD_ARCH = "clover"  # what clover-gguf wrote before upstream named the architecture: convert again
ARCHITECTURE = "general.architecture"
# Block mode's keys (patches/: the ones the patched llama.cpp reads; docs/gguf.md): the span length joins llama.cpp's
# arch-less diffusion.* family (diffusion.shift_logits); the rest is Clover's own (its block tensors, its coreset
# routing, its reading of the block softmax) and lives under the architecture's prefix
BLOCK_MODE = f"{ARCH}.diffusion.enabled"  # bool: the file has the Clover block-mode tensors
BLOCK_SIZE = "diffusion.span_length"  # u32: the tokens of one block (a diffusion span)
RIGHT_KERNEL = f"{ARCH}.diffusion.conv_right_kernel"  # u32: the right (anti-causal) GDN conv's kernel
CORESET_ENABLED = f"{ARCH}.diffusion.expert_coreset"  # bool: a block's experts restricted to its coreset
CORESET_TOP_P = f"{ARCH}.diffusion.expert_coreset_top_p"  # f32: the share of the block's routing mass the coreset holds
# which reading of the block tensors' math the file was made for (docs/architecture.md section 3: the form of the
# block softmax term), and whether the checkpoint was trained under that reading (our own models) rather than read
# under it (the real one, until a user with the real weights confirms it with check-block)
BLOCK_READING = f"{ARCH}.diffusion.softmax_form"
BLOCK_READING_VERIFIED = f"{ARCH}.diffusion.softmax_form_verified"
THRESHOLD = "diffusion.threshold"  # f32: the model card's confidence threshold (ours; llama.cpp reads none)
READING = "hist-sink-add"  # the default reading: a file without BLOCK_READING is read under it
# Every reading of the block softmax's tensors (bd_softmax_*) this version knows, name -> what it does; named for
# its math (the history slot: a sink or the prefix state's readout; the block term added or mixed), each written
# out exactly in docs/architecture.md 3b and computed by clover_gguf.reference (every reading) and the llama.cpp and
# MLX backends (the readings they declare: their READINGS). Every name has the same length, so that a file's reading
# can be restamped in place (export.restamp).
READINGS = {
    "hist-sink-add": "history slot: a logit b_h and no value (a sink); o = o_gdn + c_h * o_sm",
    "hist-read-add": "history slot: a logit b_h whose value is the clean prefix state's readout for the query; "
                     "o = o_gdn + c_h * o_sm",
    "hist-read-mix": "as hist-read-add, with c_h mixing: o = (1 - c_h) * o_gdn + c_h * o_sm",
}
assert len({len(r) for r in READINGS}) == 1 and READING in READINGS
# Files and checkpoints made before the readings had these names (clover-gguf 2026-12-05 and earlier): read as the
# new ones (the same math), never written
LEGACY_READINGS = {"clover-gguf-1": "hist-sink-add", "clover-gguf-2": "hist-read-add", "clover-gguf-3": "hist-read-mix"}
assert set(LEGACY_READINGS.values()) == set(READINGS)
# the block-mode keys' earlier names: read_header gives a file that has them the new names (and LlamaContext passes
# their values to llama.cpp under the new names), so such files keep loading. Two generations: the names up to
# 2026-12-05 (all under the architecture, "block" in them), and the arch-less diffusion.* names of 2026-12-05/07
LEGACY_KEYS_ARCH = {
    f"{ARCH}.block_mode": BLOCK_MODE,
    f"{ARCH}.diffusion.block_size": BLOCK_SIZE,
    f"{ARCH}.ssm.conv_right_kernel": RIGHT_KERNEL,
    f"{ARCH}.moe_block_coreset.enabled": CORESET_ENABLED,
    f"{ARCH}.moe_block_coreset.top_p": CORESET_TOP_P,
    f"{ARCH}.block_reading": BLOCK_READING,
    f"{ARCH}.block_reading_verified": BLOCK_READING_VERIFIED,
    f"{ARCH}.diffusion.threshold": THRESHOLD,
}
LEGACY_KEYS_DIFFUSION = {
    "diffusion.enabled": BLOCK_MODE,
    "diffusion.conv_right_kernel": RIGHT_KERNEL,
    "diffusion.expert_coreset": CORESET_ENABLED,
    "diffusion.expert_coreset_top_p": CORESET_TOP_P,
    "diffusion.softmax_form": BLOCK_READING,
    "diffusion.softmax_form_verified": BLOCK_READING_VERIFIED,
}
LEGACY_KEYS = {**LEGACY_KEYS_ARCH, **LEGACY_KEYS_DIFFUSION}
# every block-mode key (an AR export leaves them out); info shows the arch-less ones beside the architecture's
BLOCK_KEYS = frozenset(LEGACY_KEYS.values())
DIFFUSION_PREFIX = "diffusion."
assert all(k.startswith((DIFFUSION_PREFIX, f"{ARCH}.diffusion.")) for k in BLOCK_KEYS)
assert not set(LEGACY_KEYS) & BLOCK_KEYS
# the config.json field with which our own checkpoints (make_tiny, train_tiny) declare the reading they were made
# under; the real checkpoint has none, so its files say "unverified" until check-block confirms the reading
READING_FIELD = "clover_gguf_block_reading"
GENERATION_PREFIX = f"{ARCH}.generation."  # + a Controls field name
QUANT_RECIPE = f"{ARCH}.quant.recipe"  # the recipe a quantized file was made with
MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"
CHAT_TEMPLATE = "tokenizer.chat_template"


def check_reading(name: Any, where: str) -> str:
    """A reading's name (a file's key, an option, a config field) if this version knows it, an earlier name mapped
    to its new one (LEGACY_READINGS); one line naming the known ones otherwise."""
    name = LEGACY_READINGS.get(name, name) if isinstance(name, str) else name
    if name not in READINGS:
        raise UserError(f"{where}: unknown block reading {name!r}: this version knows {', '.join(READINGS)}")
    return name


def upgrade_legacy(kv: dict[str, Any], types: dict[str, Any]) -> dict[str, Any]:
    """Give a header's block-mode keys of an earlier name (LEGACY_KEYS) their new names, in place, and an earlier
    reading name its new one (LEGACY_READINGS); a key present under both names keeps the new one's value.
    -> {new name: value} of the keys set here (what llama.cpp must be told: LlamaContext passes them as overrides)."""
    set_here: dict[str, Any] = {}
    for old, new in LEGACY_KEYS.items():
        if old in kv:
            value, vtype = kv.pop(old), types.pop(old, None)
            if new not in kv:
                kv[new] = value
                if vtype is not None:
                    types[new] = vtype
                set_here[new] = value
    reading = kv.get(BLOCK_READING)
    if isinstance(reading, str) and reading in LEGACY_READINGS:
        kv[BLOCK_READING] = set_here[BLOCK_READING] = LEGACY_READINGS[reading]
    return set_here


def hparam(name: str) -> str:
    """The key of one of llama.cpp's hyperparameters for this architecture, e.g. hparam("context_length")."""
    return f"{ARCH}.{name}"


@dataclass(frozen=True)
class Controls:
    """The model card's generation controls (clover_gguf.controls applies them), with the card's values."""

    presence_penalty: float = 0.9
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.05
    length_penalty: float = 10.0
    length_penalty_start: int = 8192
    length_penalty_ramp: int = 8192
    think_end_bias: float = 10.0
    think_end_bias_start: int = 4096
    think_end_bias_ramp: int = 4096

    @classmethod
    def control_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(Controls))

    @classmethod
    def from_meta(cls, meta: Callable[[str], Any], **overrides) -> "Controls":
        """From a GGUF's `clover_moe.generation.*` keys (meta(key) -> value or None), then explicit overrides."""
        kw = {}
        for k in Controls.control_names():
            v = meta(GENERATION_PREFIX + k)
            if v is not None:
                kw[k] = type(getattr(Controls, k))(float(v))
        c = Controls(**kw)
        return replace(c, **{k: v for k, v in overrides.items() if v is not None})

    def off(self) -> "Controls":
        return replace(self, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, length_penalty=0.0,
                       think_end_bias=0.0)


@dataclass(frozen=True)
class GenerationDefaults(Controls):
    """A checkpoint's generation_config.json: the controls plus the block decoding defaults; our key names for
    start/ramp. config.generation_defaults reads one (checked), to_hf writes one."""

    block_size: int = 32
    threshold: float = 0.95

    # generation_config.json key -> field
    HF_KEYS = {
        "block_size": "block_size",
        "threshold": "threshold",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
        "repetition_penalty": "repetition_penalty",
        "dllm_length_penalty": "length_penalty",
        "dllm_length_penalty_start": "length_penalty_start",
        "dllm_length_penalty_ramp": "length_penalty_ramp",
        "dllm_think_end_bias": "think_end_bias",
        "dllm_think_end_bias_start": "think_end_bias_start",
        "dllm_think_end_bias_ramp": "think_end_bias_ramp",
    }

    def to_hf(self) -> dict[str, Any]:
        return {hf: getattr(self, name) for hf, name in self.HF_KEYS.items()}

    def gguf_items(self) -> dict[str, int | float]:
        """GGUF key -> value for everything here (ints are written as u32, floats as f32)."""
        out: dict[str, int | float] = {BLOCK_SIZE: self.block_size, THRESHOLD: self.threshold}
        out.update({GENERATION_PREFIX + k: getattr(self, k) for k in Controls.control_names()})
        return out
