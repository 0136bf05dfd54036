"""A fast GGUF header reader: every key's value (long arrays only counted) and every tensor's shape and type; and
`check_model`, the one check a Clover GGUF passes before llama.cpp (or our own code) uses its hyperparameters.

gguf's GGUFReader builds numpy views of every token of a 248k-token vocabulary, about 12 s on the 35B file; this
reads the same header in well under a second, which matters for `info`, `quantize` and loading the runtime.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from clover_gguf import metadata as md
from clover_gguf.config import MAX_BLOCK, MAX_CONTEXT
from clover_gguf.errors import UserError

GGUF_MAGIC = b"GGUF"
# GGUF value types: UINT8 0, INT8 1, UINT16 2, INT16 3, UINT32 4, INT32 5, FLOAT32 6, BOOL 7, STRING 8, ARRAY 9,
# UINT64 10, INT64 11, FLOAT64 12
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
              8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
MAX_ARRAY = 256  # arrays up to this length are read; longer ones (vocabularies) are only counted
MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class ArrayInfo:
    """A long array that was skipped: its element type and length."""

    element_type: int
    length: int


@dataclass
class GGUFHeader:
    path: Path
    kv: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], QT]]  # name -> (numpy-order shape, type), in file order
    data_offset: int
    alignment: int
    types: dict[str, tuple[int, int | None]] | None = None  # key -> (GGUF type, element type of an array)
    file_size: int = 0
    offsets: dict[str, int] = field(default_factory=dict)  # tensor -> byte offset from data_offset
    header_bytes: int = 0  # where the tensor infos end: data_offset is this padded to the alignment
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> where its value's bytes start, end
    # block-mode keys the file holds under an earlier name (metadata.LEGACY_KEYS): kv and types give them their new
    # names (spans keep the file's), and these new name -> value pairs are what llama.cpp must be told
    upgraded: dict[str, Any] = field(default_factory=dict)

    @property
    def arch(self) -> str | None:
        return self.kv.get("general.architecture")

    @property
    def file_type(self) -> int | None:
        return self.kv.get("general.file_type")

    @property
    def keys(self) -> set[str]:
        return set(self.kv)

    @property
    def names(self) -> list[str]:
        return list(self.tensors)


def tensor_bytes(qtype: QT, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy-order `shape` stored as qtype (rows along the last axis)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def check_gguf_file(path: Path, missing: str = "no such file") -> None:
    """The one check that a path given as a GGUF is a file: a folder there gets its own line (a model folder runs
    under generate, chat and serve, but the GGUF tools read files), anything else absent is `missing`."""
    if Path(path).is_dir():
        raise UserError(f"{path} is a folder, not a GGUF file: generate, chat and serve run model folders; this "
                        "command takes a .gguf file")
    if not Path(path).is_file():
        raise UserError(f"{missing}: {path}")


def read_header(path: Path, full: bool = False) -> GGUFHeader:
    """The header, checked as llama.cpp's gguf reader checks it (no nested arrays, no repeated key, known types,
    at most 4 dimensions, a power-of-two alignment) and with every tensor's data inside the file.

    full=True reads every array whole (vocabularies too) and strings as they are stored (surrogateescape), so the
    values can be written back unchanged (export-ar)."""
    path = Path(path)
    max_array = None if full else MAX_ARRAY
    errors = "surrogateescape" if full else "replace"
    check_gguf_file(path)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UserError(f"{path} is not a GGUF file")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 4

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, m, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if pos + n > len(m):
            raise ValueError("a string runs past the end of the file")
        v = m[pos:pos + n].decode("utf-8", errors)
        pos += n
        return v

    def value(key: str, vtype: int) -> Any:
        nonlocal pos
        if vtype == STRING:
            return string()
        if vtype == ARRAY:
            sub, n = take("I"), take("Q")
            if sub == ARRAY:
                raise UserError(f"{path}: {key} is an array of arrays, which GGUF readers (llama.cpp's) refuse")
            if sub != STRING and sub not in _SCALAR:
                raise ValueError(f"{key} has unknown element type {sub}")
            if max_array is None or n <= max_array:
                return [value(key, sub) for _ in range(n)]
            if sub in _SCALAR:
                pos += struct.calcsize("<" + _SCALAR[sub]) * n
                if pos > len(m):
                    raise ValueError(f"{key} runs past the end of the file")
            else:  # strings: step over each by its length, without decoding
                for _ in range(n):
                    pos += 8 + struct.unpack_from("<Q", m, pos)[0]
                if pos > len(m):
                    raise ValueError(f"{key} runs past the end of the file")
            return ArrayInfo(sub, n)
        if vtype not in _SCALAR:
            raise ValueError(f"{key} has unknown type {vtype}")
        return take(_SCALAR[vtype])

    try:
        version = take("I")
        if version < 2:
            raise UserError(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = take("Q"), take("Q")
        kv: dict[str, Any] = {}
        types: dict[str, tuple[int, int | None]] = {}
        spans: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            key, vtype = string(), take("I")
            if key in kv:
                raise UserError(f"{path}: key {key} appears twice")
            sub = struct.unpack_from("<I", m, pos)[0] if vtype == ARRAY else None
            start = pos
            kv[key] = value(key, vtype)
            types[key] = (vtype, sub)
            spans[key] = (start, pos)
        align = kv.get("general.alignment", 32)
        if types.get("general.alignment", (U32,))[0] != U32 or align <= 0 or align & (align - 1):
            raise UserError(f"{path}: general.alignment must be a UINT32 power of two, not {align!r}")
        tensors, offsets, ends = {}, {}, []
        for _ in range(n_tensors):
            name, nd = string(), take("I")
            if nd > MAX_DIMS:
                raise ValueError(f"tensor {name} has {nd} dimensions")
            ne = [take("Q") for _ in range(nd)]
            qt, offset = QT(take("I")), take("Q")
            if name in tensors:
                raise UserError(f"{path}: tensor {name} appears twice")
            tensors[name] = (tuple(reversed(ne)), qt)
            offsets[name] = offset
            ends.append((offset + tensor_bytes(qt, tuple(ne)), name))
        data_offset = (pos + align - 1) // align * align
    except (struct.error, ValueError, KeyError, IndexError, OverflowError) as e:
        raise UserError(f"{path}: damaged GGUF header ({e})") from None
    finally:
        size = len(m)
        m.close()
    if ends:
        end, name = max(ends)
        if data_offset + end > size:
            raise UserError(f"{path} is truncated: tensor {name} ends {data_offset + end - size} bytes past the end "
                            "of the file")
    upgraded = md.upgrade_legacy(kv, types)
    return GGUFHeader(path, kv, tensors, data_offset, align, types, size, offsets, header_bytes=pos, spans=spans,
                      upgraded=upgraded)


def encode_value(vtype: int, value: Any) -> bytes:
    """A STRING, BOOL, UINT32 or FLOAT32 value as GGUF stores it."""
    if vtype == STRING:
        raw = str(value).encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw
    return struct.pack("<" + _SCALAR[vtype], value)


# ---- the hyperparameters of a Clover GGUF -------------------------------------------------------------------------
# clover.<key>: (GGUF type, required). convert.write_metadata writes each with this type; check_model refuses any
# other type (llama.cpp throws on a wrong type, and our own readers would crash on it).
HPARAMS: dict[str, tuple[int, bool]] = {
    "context_length": (U32, True), "embedding_length": (U32, True), "block_count": (U32, True),
    "attention.head_count": (U32, True), "attention.head_count_kv": (U32, True),
    "attention.key_length": (U32, True), "attention.value_length": (U32, True),
    "rope.dimension_count": (U32, True), "expert_count": (U32, True), "expert_used_count": (U32, True),
    "expert_feed_forward_length": (U32, True), "expert_shared_feed_forward_length": (U32, True),
    "ssm.conv_kernel": (U32, True), "ssm.state_size": (U32, True), "ssm.group_count": (U32, True),
    "ssm.time_step_rank": (U32, True), "ssm.inner_size": (U32, True), "full_attention_interval": (U32, False),
    "nextn_predict_layers": (U32, False),
    "expert_group_count": (U32, False), "expert_group_used_count": (U32, False),
    "generation.length_penalty_start": (U32, False), "generation.length_penalty_ramp": (U32, False),
    "generation.think_end_bias_start": (U32, False), "generation.think_end_bias_ramp": (U32, False),
    "attention.layer_norm_rms_epsilon": (F32, True), "rope.freq_base": (F32, False),
    "generation.presence_penalty": (F32, False), "generation.frequency_penalty": (F32, False),
    "generation.repetition_penalty": (F32, False), "generation.length_penalty": (F32, False),
    "generation.think_end_bias": (F32, False),
    "rope.scaling.type": (STRING, False), "quant.recipe": (STRING, False), "expert_shared_count": (U32, False),
}
# block mode's keys (the diffusion.* family, metadata.py): (GGUF type, required), checked like HPARAMS
DIFFUSION_KEYS: dict[str, tuple[int, bool]] = {
    md.BLOCK_MODE: (BOOL, False), md.BLOCK_SIZE: (U32, False), md.RIGHT_KERNEL: (U32, False),
    md.CORESET_ENABLED: (BOOL, False), md.CORESET_TOP_P: (F32, False), md.BLOCK_READING: (STRING, False),
    md.BLOCK_READING_VERIFIED: (BOOL, False), md.THRESHOLD: (F32, False),
}
# arrays: (the element types llama.cpp's loader takes, required). Its get_arr reads a BOOL, UINT32 or INT32 array
# into int arrays (convert writes BOOL and INT32; llama_model_save_to_file writes recurrent_layers as UINT32). It
# would also take one value for every layer, which no hybrid model can be: refused as a wrong type.
HPARAM_ARRAYS: dict[str, tuple[tuple[int, ...], bool]] = {
    "rope.dimension_sections": ((I32, U32, BOOL), True), "attention.recurrent_layers": ((BOOL, U32, I32), False),
}
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's; another name aborts it
MAX_LAYERS, MAX_EXPERTS = 512, 1024  # LLAMA_MAX_LAYERS, LLAMA_MAX_EXPERTS


class _Checker:
    def __init__(self, h: GGUFHeader):
        self.h, self.types = h, h.types or {}

    def fail(self, key: str, why: str) -> UserError:
        return UserError(f"{self.h.path.name}: {key} {why}")

    def typed(self, key: str, want: int, sub: int | tuple[int, ...] | None = None, required: bool = False) -> Any:
        """The key's value if its GGUF type is `want` (an ARRAY: of `sub` or one of them)."""
        if key not in self.h.kv:
            if required:
                raise self.fail(key, "is missing")
            return None
        subs = (sub,) if isinstance(sub, int) else sub
        got, got_sub = self.types.get(key, (None, None))
        if got != want or (subs is not None and got_sub not in subs):
            have = TYPE_NAMES.get(got, got) if got != ARRAY else f"ARRAY of {TYPE_NAMES.get(got_sub, got_sub)}"
            need = TYPE_NAMES[want] if want != ARRAY else f"ARRAY of {' or '.join(TYPE_NAMES[t] for t in subs)}"
            raise self.fail(key, f"has GGUF type {have}; it must be {need}")
        return self.h.kv[key]

    def count(self, key: str, lo: int, hi: int, value: int | None) -> None:
        if value is not None and not lo <= value <= hi:
            raise self.fail(key, f"is {value}; it must be in {lo}..{hi}")

    def number(self, key: str, value: float | None, ok: bool, want: str) -> None:
        if value is not None and not (math.isfinite(value) and ok):
            raise self.fail(key, f"is {value}; it must be {want}")


def check_model(h: GGUFHeader) -> None:
    """Refuse, with one line naming the key, a Clover GGUF that llama.cpp would abort on (GGML_ASSERT, division by
    zero), hang on (NaN arithmetic: a zero epsilon or rope base), or that our own code would crash on (a value of
    the wrong type, an id outside the vocabulary, a template that does not compile). Called by info, quantize and
    the runtime and fit (read_clover) before llama.cpp sees the file; other architectures pass unchecked."""
    if h.arch == md.OLD_ARCH:
        raise UserError(f"{h.path} was written by an earlier clover-gguf (architecture {md.OLD_ARCH!r}); the architecture "
                        f"is now upstream llama.cpp's {md.ARCH!r}: convert the checkpoint again with `clover-gguf convert`")
    if h.arch != md.ARCH:
        return
    c = _Checker(h)
    hp: dict[str, Any] = {}
    for key, (t, required) in HPARAMS.items():
        hp[key] = c.typed(md.hparam(key), t, required=required)
    for key, (subs, required) in HPARAM_ARRAYS.items():
        hp[key] = c.typed(md.hparam(key), ARRAY, subs, required=required)
    dk = {key: c.typed(key, t, required=required) for key, (t, required) in DIFFUSION_KEYS.items()}

    def count(key: str, lo: int, hi: int) -> None:
        c.count(md.hparam(key), lo, hi, hp[key])

    def number(key: str, ok: Any, want: str) -> None:
        v = hp[key]
        c.number(md.hparam(key), v, v is not None and ok(v), want)

    big = 2**32 - 1
    for key in ("context_length", "embedding_length", "attention.key_length", "attention.value_length",
                "expert_feed_forward_length", "expert_shared_feed_forward_length", "ssm.conv_kernel",
                "ssm.state_size", "ssm.group_count", "ssm.inner_size", "full_attention_interval",
                "attention.head_count", "attention.head_count_kv", "ssm.time_step_rank"):
        count(key, 1, big)
    c.count(md.RIGHT_KERNEL, 1, big, dk[md.RIGHT_KERNEL])
    count("context_length", 1, MAX_CONTEXT)
    n_blocks, n_experts, head_k = hp["block_count"], hp["expert_count"], hp["attention.key_length"]
    count("block_count", 1, MAX_LAYERS)
    count("nextn_predict_layers", 0, n_blocks - 1)
    count("expert_count", 1, MAX_EXPERTS)
    count("expert_used_count", 1, n_experts)
    count("expert_group_count", 0, 1)  # Clover routes without expert groups; llama.cpp asserts on bad ones
    count("expert_group_used_count", 0, 0)
    if hp["attention.head_count"] % hp["attention.head_count_kv"]:
        raise c.fail(md.hparam("attention.head_count_kv"), f"({hp['attention.head_count_kv']}) must divide "
                     f"attention.head_count ({hp['attention.head_count']})")
    if hp["ssm.time_step_rank"] % hp["ssm.group_count"]:
        raise c.fail(md.hparam("ssm.time_step_rank"), f"({hp['ssm.time_step_rank']}) must be a multiple of "
                     f"ssm.group_count ({hp['ssm.group_count']})")
    rot = hp["rope.dimension_count"]
    if rot % 2 or not 2 <= rot <= head_k:
        raise c.fail(md.hparam("rope.dimension_count"), f"is {rot}; it must be even and in 2..{head_k} "
                     "(attention.key_length)")
    sections = hp["rope.dimension_sections"]
    if not isinstance(sections, list) or len(sections) != 4 or min(sections) < 0 or not 0 < sum(sections) <= head_k:
        raise c.fail(md.hparam("rope.dimension_sections"), f"is {sections}; it must be 4 non-negative numbers summing "
                     f"to 1..{head_k} (attention.key_length)")
    recurrent = hp["attention.recurrent_layers"]
    length = recurrent.length if isinstance(recurrent, ArrayInfo) else len(recurrent or [])
    if recurrent is not None and length != n_blocks:
        raise c.fail(md.hparam("attention.recurrent_layers"), f"has {length} entries for {n_blocks} blocks")
    c.count(md.BLOCK_SIZE, 1, min(MAX_BLOCK, hp["context_length"]), dk[md.BLOCK_SIZE])
    number("attention.layer_norm_rms_epsilon", lambda v: v > 0, "a positive number")
    number("rope.freq_base", lambda v: v > 0, "a positive number")
    for key, ok, want in ((md.THRESHOLD, lambda v: 0 <= v <= 1, "in [0, 1]"),
                          (md.CORESET_TOP_P, lambda v: 0 < v <= 1, "in (0, 1]")):
        c.number(key, dk[key], dk[key] is not None and ok(dk[key]), want)
    number("generation.repetition_penalty", lambda v: v > 0, "a positive number")
    for key in ("generation.presence_penalty", "generation.frequency_penalty", "generation.length_penalty",
                "generation.think_end_bias"):
        number(key, lambda v: True, "a finite number")
    if hp["rope.scaling.type"] is not None and hp["rope.scaling.type"] not in ROPE_SCALING_TYPES:
        raise c.fail(md.hparam("rope.scaling.type"), f"is {hp['rope.scaling.type']!r}; llama.cpp knows "
                     f"{', '.join(ROPE_SCALING_TYPES)}")
    _check_tokenizer(c)


def read_clover(path: Path) -> GGUFHeader:
    """The one way in for a Clover GGUF that llama.cpp is about to load (generate, chat, serve, fit): the file is
    there, its header reads, its architecture is Clover and check_model passes; one line naming the problem
    otherwise."""
    path = Path(path)
    check_gguf_file(path, "no such model file")
    try:
        h = read_header(path)
    except UserError as e:
        raise UserError(f"{path} is not a readable GGUF file ({e})") from None
    check_model(h)  # an earlier clover-gguf's file gets its own line (convert again)
    if h.kv.get(md.ARCHITECTURE) != md.ARCH:
        raise UserError(f"{path} is not a Clover GGUF (architecture {h.kv.get(md.ARCHITECTURE)!r})")
    return h


def _check_tokenizer(c: _Checker) -> None:
    tokens = c.typed("tokenizer.ggml.tokens", ARRAY, STRING, required=True)
    n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens)
    if n_vocab < 1:
        raise c.fail("tokenizer.ggml.tokens", "is empty")
    types = c.typed("tokenizer.ggml.token_type", ARRAY, I32)
    if types is not None and (types.length if isinstance(types, ArrayInfo) else len(types)) != n_vocab:
        raise c.fail("tokenizer.ggml.token_type", f"does not have one entry per token ({n_vocab})")
    for key in c.h.kv:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            c.count(key, 0, n_vocab - 1, c.typed(key, U32))
    c.typed("tokenizer.ggml.add_bos_token", BOOL)
    template = c.typed("tokenizer.chat_template", STRING)
    if template is not None:
        from clover_gguf.vocab import chat_template_error

        if why := chat_template_error(template):
            raise c.fail("tokenizer.chat_template", f"is not a chat template that compiles: {why}")


def config_from_header(h: GGUFHeader) -> "CloverConfig":  # noqa: F821
    """The CloverConfig a Clover GGUF was converted from, as far as the reference model needs it (shapes, norms,
    RoPE, routing, block settings), from its hyperparameters (check_model passed). The block reading is not here:
    it is the file's BLOCK_READING, read by its user."""
    from clover_gguf.config import CLOVER_MODEL_TYPE, CloverConfig

    kv = h.kv

    def hp(key: str, default: Any = None) -> Any:
        return kv.get(md.hparam(key), default)

    extra = int(hp("nextn_predict_layers", 0) or 0)
    n_layers = int(hp("block_count")) - extra
    recurrent = hp("attention.recurrent_layers")
    head_dim = int(hp("attention.key_length"))
    d = {
        "model_type": CLOVER_MODEL_TYPE if kv.get(md.BLOCK_MODE) else "qwen3_5_moe_text",
        "vocab_size": h.tensors["token_embd.weight"][0][0], "hidden_size": hp("embedding_length"),
        "num_hidden_layers": n_layers, "num_attention_heads": hp("attention.head_count"),
        "num_key_value_heads": hp("attention.head_count_kv"), "head_dim": head_dim,
        "max_position_embeddings": hp("context_length"), "rms_norm_eps": hp("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        "rope_parameters": {"rope_theta": hp("rope.freq_base", 10_000.0),
                            "partial_rotary_factor": hp("rope.dimension_count") / head_dim},
        "linear_conv_kernel_dim": hp("ssm.conv_kernel"), "linear_key_head_dim": hp("ssm.state_size"),
        "linear_value_head_dim": hp("ssm.state_size"), "linear_num_key_heads": hp("ssm.group_count"),
        "linear_num_value_heads": hp("ssm.time_step_rank"), "num_experts": hp("expert_count"),
        "num_experts_per_tok": hp("expert_used_count"), "moe_intermediate_size": hp("expert_feed_forward_length"),
        "shared_expert_intermediate_size": hp("expert_shared_feed_forward_length"),
        "full_attention_interval": hp("full_attention_interval", 4),
    }
    if isinstance(recurrent, list):
        d["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
    if kv.get(md.BLOCK_MODE):
        d.update(mask_token_id=kv.get(md.MASK_TOKEN_ID), block_size=kv.get(md.BLOCK_SIZE, 32),
                 linear_conv_right_kernel_dim=kv.get(md.RIGHT_KERNEL, hp("ssm.conv_kernel")),
                 moe_block_coreset_enabled=bool(kv.get(md.CORESET_ENABLED, True)),
                 moe_block_coreset_top_p=kv.get(md.CORESET_TOP_P, 0.9))
    return CloverConfig.from_dict(d)
