"""The HF byte-level BPE tokenizer (tokenizer.json) as GGUF tokenizer metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import TokenType

from clover_gguf.config import CloverConfig, read_json
from clover_gguf.errors import UserError


@dataclass
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)  # eos, pad, bos, mask -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)


def compile_chat_template(template: str) -> Any:
    """The chat template compiled as the runtime renders it: a sandboxed Jinja environment, made here and nowhere
    else. Raises jinja2.TemplateSyntaxError (or RecursionError) for a template that does not compile."""
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


class TemplateRefusal(Exception):
    """A chat template's own refusal (`raise_exception(message)`, which transformers and llama.cpp give every
    template): the request fails with the template's message."""


def raise_exception(message: Any) -> None:
    raise TemplateRefusal(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """`tojson` as chat templates were written for (transformers' and llama.cpp's): json.dumps, keys in their order,
    text unescaped. Jinja's own sorts the keys and escapes <, >, & and ' for HTML, so a tool's schema would reach
    the model unlike anything it was trained on."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


def chat_template_error(template: str) -> str | None:
    """Why `template` does not compile as the runtime compiles it, or None. Without jinja2 installed nothing can
    be checked (and nothing rendered): None."""
    try:
        import jinja2
    except ImportError:
        return None
    try:
        compile_chat_template(template)
    except jinja2.TemplateSyntaxError as e:
        return f"{e.message} (line {e.lineno})"
    except (RecursionError, MemoryError):
        return "nested too deeply"
    return None


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_id(added: dict[str, int], vocab: dict[str, int], token: Any, where: str) -> int | None:
    if isinstance(token, dict):  # {"content": ...} in older tokenizer_config files
        token = token.get("content")
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise UserError(f"{where} must be a token string, not {type(token).__name__}")
    return added.get(token, vocab.get(token))


def _read_tokens(tj: Path, tok: Any, vocab_size: int) -> tuple[dict[str, int], dict[str, int], set[str], list[str]]:
    """-> (vocab, added, special, merges) after checking every id is an integer in 0..vocab_size-1 and no id is
    given to two tokens (the GGUF token list has one entry per id)."""
    if not isinstance(tok, dict):
        raise UserError(f"{tj} must be a JSON object, not {type(tok).__name__}")
    model = tok.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise UserError(f"unsupported tokenizer model {kind!r} in {tj}: Clover uses byte-level BPE")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise UserError(f"{tj}: model.vocab must be a non-empty object of token -> id")
    added_list = tok.get("added_tokens") or []
    if not isinstance(added_list, list) or not all(
            isinstance(a, dict) and isinstance(a.get("content"), str) and "id" in a for a in added_list):
        raise UserError(f"{tj}: added_tokens must be a list of {{\"content\": text, \"id\": n}} objects")
    added = {a["content"]: a["id"] for a in added_list}
    special = {a["content"] for a in added_list if a.get("special")}
    owner: dict[int, str] = {}
    for where, table in (("model.vocab", vocab), ("added_tokens", added)):
        for text, i in table.items():
            if not _is_id(i) or not 0 <= i < vocab_size:
                raise UserError(f"{tj}: {where} gives token {text!r} id {i!r}; ids must be integers in "
                                f"0..{vocab_size - 1} (config.json vocab_size {vocab_size})")
            if where == "model.vocab" and i in owner:
                raise UserError(f"{tj}: model.vocab gives id {i} to both {owner[i]!r} and {text!r}")
            owner.setdefault(i, text)
    raw_merges = model.get("merges") or []
    if not isinstance(raw_merges, list):
        raise UserError(f"{tj}: model.merges must be a list")
    merges = []
    for m in raw_merges:
        if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m):
            m = " ".join(m)
        if not isinstance(m, str):
            raise UserError(f"{tj}: model.merges holds {m!r}: each merge is \"a b\" or [\"a\", \"b\"]")
        merges.append(m)
    return vocab, added, special, merges


def load_vocab(src: Path, cfg: CloverConfig) -> Vocab:
    src = Path(src)
    tj = src / "tokenizer.json"
    if not os.path.lexists(tj):
        raise UserError(f"missing tokenizer.json in {src}")
    vocab, added, special, merges = _read_tokens(tj, read_json(tj, "tokenizer.json"), cfg.vocab_size)

    # Rows past the tokenizer (embedding padding) get placeholder tokens, as llama.cpp expects one per row.
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [int(TokenType.UNUSED)] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(TokenType.NORMAL)
    for text, i in added.items():
        tokens[i] = text
        types[i] = int(TokenType.CONTROL if text in special else TokenType.USER_DEFINED)

    tc_path = src / "tokenizer_config.json"
    tc = read_json(tc_path, "tokenizer_config.json", missing={})
    if not isinstance(tc, dict):
        raise UserError(f"{tc_path} must be a JSON object, not {type(tc).__name__}")
    ids: dict[str, int] = {}
    for role in ("eos", "pad", "bos"):
        if (i := _token_id(added, vocab, tc.get(f"{role}_token"), f"{tc_path.name}: {role}_token")) is not None:
            ids[role] = i
    if "eos" not in ids and cfg.eos_token_id is not None:
        eos = cfg.eos_token_id
        ids["eos"] = eos[0] if isinstance(eos, list) else eos
    if cfg.mask_token_id is not None:
        ids["mask"] = int(cfg.mask_token_id)
    elif (i := _token_id(added, vocab, tc.get("mask_token"), f"{tc_path.name}: mask_token")) is not None:
        ids["mask"] = i

    template, where = None, None
    if (src / "chat_template.jinja").is_file():
        where = src / "chat_template.jinja"
        try:
            template = where.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where} is not UTF-8 text") from None
    elif isinstance(tc.get("chat_template"), str):
        template, where = tc["chat_template"], tc_path
    if template is not None and (why := chat_template_error(template)):
        raise UserError(f"{where}: the chat template does not compile: {why}")
    add = {}
    for role in ("bos", "eos"):
        add[role] = tc.get(f"add_{role}_token", False)
        if add[role] is not None and not isinstance(add[role], bool):
            raise UserError(f"{tc_path.name}: add_{role}_token must be true or false, not {add[role]!r}")
    return Vocab(tokens=tokens, token_types=types, merges=merges, special_ids=ids, add_bos=bool(add["bos"]),
                 add_eos=bool(add["eos"]), chat_template=template)
