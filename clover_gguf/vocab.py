"""The HF byte-level BPE tokenizer (tokenizer.json) as GGUF tokenizer metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gguf import TokenType

from clover_gguf.config import CloverConfig
from clover_gguf.errors import UserError


@dataclass
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # eos, pad, bos, mask -> id
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)


def _token_id(added: dict[str, int], vocab: dict[str, int], token) -> int | None:
    if isinstance(token, dict):  # {"content": ...} in older tokenizer_config files
        token = token.get("content")
    if not token:
        return None
    return added.get(token, vocab.get(token))


def load_vocab(src: Path, cfg: CloverConfig) -> Vocab:
    src = Path(src)
    tj = src / "tokenizer.json"
    if not tj.is_file():
        raise UserError(f"missing tokenizer.json in {src}")
    try:
        tok = json.loads(tj.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{tj} is not valid JSON: {e.msg}") from None
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"unsupported tokenizer model {model.get('type')!r}: Clover uses byte-level BPE")
    vocab: dict[str, int] = model["vocab"]
    added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    n = max([*vocab.values(), *added.values()]) + 1
    if n > cfg.vocab_size:
        raise UserError(f"the tokenizer has {n} tokens but config.json says vocab_size {cfg.vocab_size}")

    # Rows past the tokenizer (embedding padding) get placeholder tokens, as llama.cpp expects one per row.
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [int(TokenType.UNUSED)] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(TokenType.NORMAL)
    for text, i in added.items():
        tokens[i] = text
        types[i] = int(TokenType.CONTROL if text in special else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tc_path = src / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    ids: dict[str, int] = {}
    for role in ("eos", "pad", "bos"):
        if (i := _token_id(added, vocab, tc.get(f"{role}_token"))) is not None:
            ids[role] = i
    if "eos" not in ids and cfg.eos_token_id is not None:
        eos = cfg.eos_token_id
        ids["eos"] = eos[0] if isinstance(eos, list) else eos
    if cfg.mask_token_id is not None:
        ids["mask"] = int(cfg.mask_token_id)
    elif (i := _token_id(added, vocab, tc.get("mask_token"))) is not None:
        ids["mask"] = i

    template = None
    if (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text()
    elif isinstance(tc.get("chat_template"), str):
        template = tc["chat_template"]
    return Vocab(tokens=tokens, token_types=types, merges=merges, special_ids=ids,
                 add_bos=bool(tc.get("add_bos_token", False)), chat_template=template)
