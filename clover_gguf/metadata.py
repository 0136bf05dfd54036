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
BLOCK_MODE = f"{ARCH}.block_mode"  # bool: the file has the Clover block-mode tensors
# which reading of the block tensors' math the file was made for (docs/architecture.md section 3), and whether the
# checkpoint was trained under that reading (our own models) rather than read under it (the real one, until a
# user with the real weights confirms it with check-block)
BLOCK_READING = f"{ARCH}.block_reading"
BLOCK_READING_VERIFIED = f"{ARCH}.block_reading_verified"
READING = "clover-gguf-1"  # the default reading: a file without BLOCK_READING is read under it
# Every reading of the block softmax's tensors (bd_softmax_*) this version knows, name -> what it does; each written
# out exactly in docs/architecture.md 3b and computed by clover_gguf.reference (every reading) and the llama.cpp and
# MLX backends (the readings they declare: their READINGS). Every name has the same length, so that a file's reading
# can be restamped in place (export.restamp).
READINGS = {
    "clover-gguf-1": "history slot: a logit b_h and no value (a sink); o = o_gdn + c_h * o_sm",
    "clover-gguf-2": "history slot: a logit b_h whose value is the clean prefix state's readout for the query; "
                     "o = o_gdn + c_h * o_sm",
    "clover-gguf-3": "as clover-gguf-2, with c_h mixing: o = (1 - c_h) * o_gdn + c_h * o_sm",
}
assert len({len(r) for r in READINGS}) == 1 and READING in READINGS
# the config.json field with which our own checkpoints (make_tiny, train_tiny) declare the reading they were made
# under; the real checkpoint has none, so its files say "unverified" until check-block confirms the reading
READING_FIELD = "clover_gguf_block_reading"
BLOCK_SIZE = f"{ARCH}.diffusion.block_size"
THRESHOLD = f"{ARCH}.diffusion.threshold"
CORESET_ENABLED = f"{ARCH}.moe_block_coreset.enabled"
CORESET_TOP_P = f"{ARCH}.moe_block_coreset.top_p"
GENERATION_PREFIX = f"{ARCH}.generation."  # + a Controls field name
QUANT_RECIPE = f"{ARCH}.quant.recipe"  # the recipe a quantized file was made with
MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"
CHAT_TEMPLATE = "tokenizer.chat_template"


def check_reading(name: Any, where: str) -> str:
    """A reading's name as given (a file's key, an option, a config field) if this version knows it; one line
    naming the known ones otherwise."""
    if name not in READINGS:
        raise UserError(f"{where}: unknown block reading {name!r}: this version knows {', '.join(READINGS)}")
    return name


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
