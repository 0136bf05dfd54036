"""Constrained output: the grammars serve forces (response_format's JSON, tool_choice's calls) compiled by llguidance,
and the Constraint the decoders follow (clover_gguf.constraint).

The engine is llguidance (bench/grammar.py measured it against xgrammar at V = 248,320: docs/serve.md, "Constrained
output"). A grammar is written in llguidance's Lark dialect (its `%json` inlines a JSON schema):
- first a thinking span when thinking is on (THINKING): "open" (the prompt opened `<think>`: any text up to the
  first `</think>`), "optional" (a `<think>...</think>` span may come first) or "none"; after a thinking span at most
  4 whitespace characters (the "\n\n" a template writes there), and none where there is no span: a model that
  does not know the format would spend its tokens on them (the bundled model wrote 4 before a 5-token answer);
- then the rule `body`: JSON matching a schema (json_value: written compactly, with json.dumps' separators ", " and
  ": " and no other whitespace, so a model cannot wander off into whitespace; its numbers bounded and its objects closed, bounded_schema),
  tool calls (clover_gguf.serve.tools.calls_rules, which uses json_value for the parameters a schema types as JSON),
  or a GBNF grammar (gbnf_body: llama-server's `grammar`).
After the body only the model's end tokens are allowed; they are allowed exactly where the grammar is complete.

The model's vocabulary (Vocabulary.of): every token's bytes as the runtime spells them; control tokens are marked
as llguidance expects (a 0xFF byte before their text: never text, so no grammar allows them) and the rows past the
tokenizer are empty (never allowed); the think tokens are text (`</think>` closes a thinking span however the model
spells it). An Engine compiles each grammar once (the same tools and schema come back on every turn of an agent's
conversation) and gives each request a fresh Constraint on it.
"""

from __future__ import annotations

import collections
import ctypes
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from clover_gguf.constraint import allowed, mask_of

THINKING = ("open", "optional", "none")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# JSON as json.dumps writes it (and as the chat template renders arguments): ", " and ": ", no other whitespace
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE = 64  # compiled grammars kept per engine
CONTROL = b"\xff"  # llguidance's mark of a special token
# llguidance's fuel for building a grammar's lexer (its default 1,000,000, about 20 ms): a tool's string with
# maxLength of some thousands (a forced call's TEXT rule) needs more; a mask step keeps the default fuel
COMPILE_FUEL = 10_000_000
# the whitespace a body may follow (after a thinking span; source()), and the paths Engine.check enters a string by
GAP = "gap: /[ \\t\\r\\n]{0,4}/\n"
# an integer of at most 16 digits, a number whose integral part has at most 16 (llama.cpp's JSON-schema grammar caps
# them the same way): a model that does not know the format otherwise writes digits until max_tokens. llguidance
# reads a bound as a float64, where 10**16 - 1 rounds to 10**16 (which would let 17 digits through): 10**16 - 2 is
# exact, so integers keep to 16 digits (all but 9999999999999999 itself); a number's exclusive bound 10**16 is exact
MAX_INT = 10**16 - 2
NUMERIC = ("integer", "number")
# the keywords whose values are subschemas: one (a schema), a list of them, or a map of names to them
_SUB_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile; the message is the engine's reason."""


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise GrammarError("constrained output needs llguidance: `pip install llguidance==1.9.1` (in a checkout of "
                           "clover-gguf: `pip install '.[serve]'`)") from None
    return llguidance


# ---- grammars: Lark text -----------------------------------------------------------------------------------------
def literal(text: str) -> str:
    """A Lark string literal for `text` (the dialect reads JSON's escapes)."""
    return json.dumps(text, ensure_ascii=True)


def json_value(schema: Any) -> str:
    """A Lark expression for one JSON value matching `schema` (None: any JSON object, response_format's
    json_object), in the compact style; a schema's own x-guidance is replaced. Schema errors show when compiled."""
    if schema is None:  # any object: its values any JSON, their numbers bounded at every depth
        schema = {"type": "object", "additionalProperties": {"$ref": f"#/$defs/{ANY}"}, "$defs": {ANY: _any_value()}}
    if schema is True or schema == {}:
        schema = {"$ref": f"#/$defs/{ANY}", "$defs": {ANY: _any_value()}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return "%json " + json.dumps({**{k: v for k, v in bounded_schema(schema).items() if k != "x-guidance"},
                                  "x-guidance": JSON_STYLE}, ensure_ascii=True)


ANY = "clover_any_value"  # the $defs name of any JSON value (its numbers bounded)


def _any_value() -> dict:
    ref = {"$ref": f"#/$defs/{ANY}"}
    return {"type": ["object", "array", "string", "number", "integer", "boolean", "null"],
            "exclusiveMinimum": -10**16, "exclusiveMaximum": 10**16, "items": ref, "additionalProperties": ref}


def subschemas_mapped(schema: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of `schema` with `fn` applied to each of its direct subschemas: the values of the keywords _SUB_ONE,
    _SUB_LIST and _SUB_MAP name (the one walk of a schema here: bounded_schema and Engine.check's strings)."""
    out = dict(schema)
    for key in dict.fromkeys(_SUB_ONE + _SUB_LIST):  # `items` is in both: a schema or (older drafts) a list
        v = out.get(key)
        if isinstance(v, list) and key in _SUB_LIST:
            out[key] = [fn(x) for x in v]
        elif isinstance(v, dict) and key in _SUB_ONE:
            out[key] = fn(v)
    for key in _SUB_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    return out


def bounded_schema(schema: Any) -> Any:
    """A copy of `schema` whose answers end, as llama.cpp's schema grammar reads a schema:
    - every integer or number it allows without a bound on a side gets one: an integer within +-MAX_INT, a number's
      integral part of at most 16 digits (exclusive +-10**16). A bound the schema gives is kept (its own
      minimum/maximum may allow more digits). A subschema that names no type but could be a number (no const, enum or
      $ref) counts as numeric too: the bounds apply to numbers only;
    - an object schema with `properties` and no `additionalProperties` takes only its properties (a model that does
      not know the format otherwise adds keys of its own until max_tokens); every answer still validates.
    """
    if not isinstance(schema, dict):
        return schema
    out = subschemas_mapped(schema, bounded_schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    kind = out.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else None
    if kinds is None:
        numeric = not any(k in out for k in ("const", "enum", "$ref"))
    else:
        numeric = any(k in NUMERIC for k in kinds)
    if not numeric:
        return out
    integral = kinds is not None and "number" not in kinds
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out.update({"minimum": -MAX_INT} if integral else {"exclusiveMinimum": -10**16})
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out.update({"maximum": MAX_INT} if integral else {"exclusiveMaximum": 10**16})
    return out


def gbnf_body(text: str) -> str:
    """llama-server's `grammar` (GBNF, llama.cpp's grammar format; Lark text is taken as is) as the rule `body`: the
    grammar converted by llguidance's own converter and nested as a grammar of its own (its rule names cannot clash
    with ours). GrammarError for text the converter cannot read; the engine's errors show when compiled."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar is empty")
    _llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter's own error type, or one from its parser
        raise GrammarError(f"the grammar is not valid GBNF: {e}") from None
    lines = [line for line in lark.splitlines() if not line.startswith("%llguidance")]
    return "body: %lark {\n" + "\n".join(lines) + "\n}\n"


def source(body_rules: str, thinking: str) -> str:
    """The whole grammar: the thinking span `thinking` says (THINKING) with at most 4 whitespace characters after it,
    then the rule `body` of `body_rules`."""
    if thinking not in THINKING:
        raise ValueError(f"thinking: one of {THINKING}")
    start = {"open": "start: think_text gap body",
             "optional": f"start: ({literal(THINK_OPEN)} think_text gap)? body",
             "none": "start: body"}[thinking]
    think = f"think_text[lazy]: /(?s:.*){_regex_literal(THINK_CLOSE)}/\n" if thinking != "none" else ""
    gap = GAP if thinking != "none" else ""
    return f"%llguidance {{}}\n{start}\n{gap}{think}{body_rules}"


def regex_without(text: str) -> str:
    """A regex (for a Lark /.../) of the strings that do not contain `text`, written positively: llguidance's lexer
    intersects it with a counted repetition cheaply, where a negation (~/.*text.*/) beside a count of about 90 or
    more ran out of lexer fuel at the first mask. `text`'s first character must not occur again in it (then a
    failed match restarts only at that character): true of the closing tags this is for."""
    head, rest = text[0], text[1:]
    if not rest or head in rest:
        raise ValueError(f"regex_without: {text!r} must be 2+ characters whose first does not repeat")
    h = _regex_literal(head)
    # after `head` and a proper prefix of `rest`, a character that neither continues it nor starts again
    breaks = "|".join(_regex_literal(rest[:i]) + f"[^{_class_literal(rest[i])}{_class_literal(head)}]"
                      for i in range(len(rest)))
    partial = f"{h}(?:{'|'.join(_regex_literal(rest[:i]) for i in range(len(rest)))})"  # head, a proper prefix
    return f"(?:[^{_class_literal(head)}]|(?:{partial})*{h}(?:{breaks}))*(?:{partial})*"


def _class_literal(c: str) -> str:
    """One character inside a regex [class]."""
    return "\\" + c if c in "\\]^-[/" else c


def _string_schemas(body_rules: str) -> list[dict]:
    """The string schemas with a pattern, format or length bound in the %json schemas of `body_rules` (as json_value
    wrote them), each reduced to those keys; each once."""
    found: dict[str, dict] = {}
    decoder = json.JSONDecoder()

    def walk(node: Any, depth: int) -> Any:
        if depth > 64 or not isinstance(node, dict):
            return node
        keys = {k: node[k] for k, kind in (("pattern", str), ("format", str), ("minLength", int),
                                              ("maxLength", int)) if isinstance(node.get(k), kind)}
        if keys and node.get("type", "string") in ("string", ["string"]):
            found.setdefault(json.dumps(keys, sort_keys=True), {"type": "string", **keys})
        subschemas_mapped(node, lambda sub: walk(sub, depth + 1))
        return node

    at = body_rules.find("%json ")
    while at >= 0:
        try:
            schema, end = decoder.raw_decode(body_rules, at + len("%json "))
        except ValueError:
            end = at + 1
        else:
            walk(schema, 0)
        at = body_rules.find("%json ", end)
    return list(found.values())


def _regex_literal(text: str) -> str:
    """`text` inside a Lark /regex/ (its metacharacters and the slash escaped)."""
    return "".join("\\" + c if c in "\\/.^$|?*+()[]{}" else c for c in text)


# ---- the model's vocabulary ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vocabulary:
    """Every token's bytes as llguidance reads them (CONTROL + text for control tokens, b"" for rows that are no
    token), the model's end tokens, and the model's tokenizer (text -> ids, no special tokens read)."""

    tokens: list[bytes]
    eos_ids: tuple[int, ...]
    tokenize: Callable[[str], list[int]]

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @classmethod
    def of(cls, rt: Any) -> "Vocabulary":
        """From a runtime (CloverRuntime, MlxRuntime): its context's pieces over ctx.n_vocab rows. A token that is
        empty when rendered as text but not as a special token is a control token, unless it is a think token."""
        ctx = rt.ctx
        text_specials = {t for t in (getattr(rt, "think_id", None), getattr(rt, "think_end_id", None))
                         if t is not None}
        piece = _piece_reader(ctx)
        tokens = []
        for t in range(int(ctx.n_vocab)):
            b = piece(t, False)
            if not b:
                special = piece(t, True)
                b = special if t in text_specials else CONTROL + special if special else b""
            tokens.append(b)
        return cls(tokens, tuple(int(e) for e in rt.eos_ids), lambda text: list(ctx.tokenize(text, special=False)))


def _piece_reader(ctx: Any):
    """(token, special) -> bytes, straight from llama.cpp where the context is one (its token_to_piece keeps every
    piece it reads: 248,320 entries a decode never needs), else the context's own token_to_piece."""
    L, vocab = getattr(ctx, "L", None), getattr(ctx, "vocab", None)
    if L is None or vocab is None or not hasattr(L, "llama_token_to_piece"):
        return lambda t, special: ctx.token_to_piece(t, special=special)
    buf = ctypes.create_string_buffer(256)

    def piece(t: int, special: bool) -> bytes:
        nonlocal buf
        n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, special)
        return buf.raw[:n]

    return piece


# ---- the engine and its constraints ----------------------------------------------------------------------------
class Engine:
    """llguidance over one model's vocabulary: compiles grammars (the most recent CACHE kept), makes Constraints.
    Thread-safe: the slots' workers share it."""

    def __init__(self, vocab: Vocabulary):
        llg = _llguidance()
        self.llg = llg
        self.vocab = vocab
        self.words = -(-vocab.n_vocab // 32)
        tokenize = vocab.tokenize

        class Tokenizer:  # what llguidance's TokenizerWrapper reads
            eos_token_id = vocab.eos_ids[0] if vocab.eos_ids else 0
            bos_token_id = None
            tokens = vocab.tokens
            special_token_ids = [t for t, b in enumerate(vocab.tokens) if b.startswith(CONTROL)]

            def __call__(self, text: bytes) -> list[int]:
                return tokenize(text.decode("utf-8", "replace"))

        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Tokenizer()), n_vocab=vocab.n_vocab,
                                         eos_token=list(vocab.eos_ids) or None)
        self.eos = frozenset(vocab.eos_ids)
        self.eos_mask = mask_of(vocab.eos_ids, vocab.n_vocab)
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        # bodies check saw: None (passed) or the refusal
        self._checked: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Any:
        """A matcher at the start of `grammar` (kept: copies of it serve the requests); GrammarError with the
        engine's reason when it cannot be compiled."""
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
                return hit
        m = self._matcher(grammar)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {m.get_error()}")
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > CACHE:
                self._compiled.popitem(last=False)
        return m

    def check(self, body_rules: str) -> None:
        """What a request's grammar (the rule `body` of `body_rules`) must pass before the request takes a slot,
        beside compiling (GrammarError with the reason; each body checked once):
        - it admits a value: its first mask allows a token (a schema whose $refs only refer to each other, or
          {"$ref": "#"}, compiles but admits nothing: the answer was an empty 200);
        - each string pattern and length bound of its JSON schemas is one llguidance's lexer can enter: the lexer
          builds a pattern's states as a value starts, and one too complex for it (^(x{1000}){1000}$) stopped the
          decode there (a 500, or an empty 200)."""
        with self._lock:
            if body_rules in self._checked:
                self._checked.move_to_end(body_rules)
                if self._checked[body_rules] is not None:
                    raise GrammarError(self._checked[body_rules])
                return
        try:
            self._check(body_rules)
        except GrammarError as e:  # kept too: a refusal can take seconds of the engine's work (a pattern's)
            self._remember(body_rules, str(e))
            raise
        self._remember(body_rules, None)

    def _remember(self, body_rules: str, refusal: str | None) -> None:
        with self._lock:
            self._checked[body_rules] = refusal
            while len(self._checked) > CACHE:
                self._checked.popitem(last=False)

    def _check(self, body_rules: str) -> None:
        self.compile(source(body_rules, "none"))
        alone = self.compile(f"%llguidance {{}}\nstart: body\n{body_rules}").deep_copy()
        if not (np.any(self._first_mask(alone)) or alone.is_accepting()) or alone.is_error():
            raise GrammarError("the schema admits no value (its $refs refer only to each other, or to the whole "
                               "schema, before any value is written)")
        # each string value entered on a fresh matcher by three paths (the quote at once, after one space, after four):
        # where llguidance's lexer builds a pattern's states; its expressions are shared by the copies of a compiled
        # grammar and counted together, so one path alone, or a cached grammar, may pass a pattern that fails later
        space, quote = self.vocab.tokenize(" "), self.vocab.tokenize('"')
        for string in _string_schemas(body_rules):
            fresh = self._matcher(f"%llguidance {{}}\nstart: gap body\n{GAP}body: {json_value(string)}\n")
            for path in (quote, space + quote, space * 4 + quote):
                m = fresh.deep_copy()
                for t in path:
                    self._first_mask(m)
                    if not m.consume_token(t):
                        break
                else:
                    self._first_mask(m)
                if m.is_error():
                    break
            if m.is_error():
                raise GrammarError(f"the string schema {json.dumps(string)[:200]} is too complex for the grammar "
                                   f"engine's lexer: {m.get_error().splitlines()[0]}")

    def _matcher(self, grammar: str) -> Any:
        return self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_lark(grammar), log_level=0,
                                  limits=self.llg.LLParserLimits(initial_lexer_fuel=COMPILE_FUEL))

    def _first_mask(self, matcher: Any) -> np.ndarray:
        bitmask = np.zeros((1, self.words), dtype=np.int32)
        self.llg.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask[0]

    def constraint(self, grammar: str) -> "GrammarConstraint":
        return GrammarConstraint(self, self.compile(grammar).deep_copy())


class GrammarConstraint:
    """clover_gguf.constraint.Constraint on an llguidance matcher: one answer's state in one grammar. Rolls back any
    number of tokens it took (a rejected draft of any block size)."""

    def __init__(self, engine: Engine, matcher: Any):
        self.engine = engine
        self.matcher = matcher
        self._bitmask = np.zeros((1, engine.words), dtype=np.int32)
        self._taken = 0  # tokens accepted: the mask below belongs to this state when _mask_at equals it
        self._mask_at: int | None = None
        self._mask = np.zeros(engine.words, dtype=np.int32)

    def _state_mask(self) -> np.ndarray:
        if self._mask_at != self._taken:
            m = self._mask
            if self.matcher.is_error():
                raise self._gave_up()
            else:
                self.engine.llg.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
                if self.matcher.is_error():  # a limit of the engine's, met in this state (Engine.check missed it)
                    raise self._gave_up()
                m[:] = self._bitmask[0] & ~self.engine.eos_mask
                if self.matcher.is_accepting():  # the end tokens exactly where the grammar may end
                    m |= self.engine.eos_mask
            self._mask_at = self._taken
        return self._mask

    def mask(self) -> np.ndarray:
        return self._state_mask().copy()

    def accept(self, token: int) -> bool:
        t = int(token)
        if not 0 <= t < self.engine.vocab.n_vocab or self.matcher.is_error():
            return False
        # refused tokens never reach the matcher (one would leave it in its error state for good)
        if self._mask_at == self._taken:
            ok = allowed(self._mask, t)
        elif t in self.engine.eos:
            ok = bool(self.matcher.is_accepting())
        else:
            ok = self.matcher.validate_tokens([t]) == 1
        if not ok:
            return False
        if not self.matcher.consume_token(t):
            raise self._gave_up()
        self._taken += 1
        return True

    def _gave_up(self) -> GrammarError:
        """The engine stopped in the middle of the answer (a lexer or parser limit of llguidance's, in a state its
        checks could not foresee): the request's error, a 400, not an empty answer or a 500."""
        why = (self.matcher.get_error() or "unknown").splitlines()[0]
        return GrammarError(f"the grammar engine gave up after {self._taken} tokens of the answer: {why}")

    def rollback(self, n: int) -> None:
        if n < 0 or n > self._taken:
            raise ValueError(f"cannot roll back {n} of the {self._taken} tokens accepted")
        if n:
            if not self.matcher.rollback(n):
                raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.matcher.get_error()}")
            self._taken -= n
            # the kept mask is of a state with _mask_at tokens, not of this one: after a rollback of 1 and another
            # token, the count matches again while the state differs (a rejected draft token, then the causal one)
            self._mask_at = None

    def finished(self) -> bool:
        return bool(self.matcher.is_stopped()) or not np.any(self._state_mask() & ~self.engine.eos_mask)

    def forced(self) -> list[int]:
        """constraint.Forcing: llguidance's fast-forward tokens. Where the grammar forces bytes, llguidance tokenizes
        them canonically and forces those tokens (its masks there allow the next of them alone; its option
        no_forcing, which we leave off, would let the model choose a tokenization); the last token of the bytes is
        held back where it could merge with what follows. Nothing where the answer may end here."""
        if self.matcher.is_error() or self.matcher.is_accepting():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()]
