"""Grammars at the edges of llguidance's lexer (issue 68): forced tool calls with long string bounds, patterns too
complex for the lexer, schemas that admit no value, rule names that must not collide. On an engine over a made-up
vocabulary of byte tokens and 20,000 multi-byte pieces (no model needed: the lexer's costs come from the grammar and
the token trie's depth, which the pieces give)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from clover_gguf import grammar
from clover_gguf.constraint import allowed
import clover_gguf.serve.tools as T

pytest.importorskip("llguidance")

ALPHABET = "abcdefghijklmnopqrstuvwxyz <>/=\n_ETAOIN0123456789.,\"{}:"
TAGS = ["</parameter>", "</parameter>\n", "parameter", "</", "<param", "\n</", "</function>", "<tool_call>", "\n\n"]


@pytest.fixture(scope="module")
def engine() -> grammar.Engine:
    rng = random.Random(0)
    pieces = {t.encode() for t in TAGS}
    while len(pieces) < 20000:
        pieces.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 12))).encode())
    tokens = [bytes([i]) if i < 255 else b"" for i in range(256)] + sorted(pieces) + [grammar.CONTROL + b"<|end|>"]
    eos = len(tokens) - 1
    # text -> ids: one token per byte (a valid tokenization; llguidance re-tokenizes forced bytes canonically itself)
    return grammar.Engine(grammar.Vocabulary(tokens, (eos,), lambda text: list(text.encode())))


def byte_walk(c, text: str) -> int | None:
    """Feed `text` byte by byte (each mask must allow the byte) -> None, or the index of the first byte refused."""
    for i, b in enumerate(text.encode()):
        if not (allowed(c.mask(), b) and c.accept(b)):
            return i
    return None


def lookup(**key_schema) -> list[T.Tool]:
    return T.read_tools([{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"type": "string", **key_schema}}, "required": ["key"]}}}])


def call(value: str) -> str:
    return f"<tool_call>\n<function=lookup>\n<parameter=key>\n{value}\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("max_length", [64, 100, 1000, 8000])
def test_a_forced_call_with_a_long_max_length_finishes(engine, max_length):
    """Cause 2: maxLength of about 90 or more ran llguidance's lexer out of fuel at the value ("too many expressions
    constructed"): the mask emptied and decoding stopped mid-call."""
    for name in ("lookup", None):  # tool_choice named, required
        c = engine.constraint(grammar.source(T.calls_rules(lookup(maxLength=max_length), name, parallel=False),
                                             "none"))
        assert byte_walk(c, call("door7")) is None, c.matcher.get_error()
        assert c.finished() and allowed(c.mask(), engine.vocab.eos_ids[0])


@pytest.mark.parametrize("lo,hi", [(0, 100), (3, 120)])
def test_long_bounds_still_bound_and_the_tag_stays_out(engine, lo, hi):
    """What the rule was for holds at the new bounds: lo..hi characters (multi-byte ones counted once), and no
    </parameter> inside the value (a value may still hold '<', '</' and a cut tag)."""
    tools = lookup(minLength=lo, maxLength=hi)
    source = grammar.source(T.calls_rules(tools, "lookup", parallel=False), "none")
    for value in ("a" * hi, "é" * hi, "x<y</par</ b" + "</parameter"[:5], "✓" * max(lo, 1)):
        c = engine.constraint(source)
        assert byte_walk(c, call(value)) is None, value
        assert c.finished()
        assert T.parse_answer(call(value), tools)[1][0].arguments == {"key": value}
    for value in ("a" * (hi + 1), "é" * (hi + 1), "a</parameter>b"):
        assert byte_walk(engine.constraint(source), call(value)) is not None, value
    if lo:
        assert byte_walk(engine.constraint(source), call("a" * (lo - 1))) is not None


def test_random_walks_in_a_long_bound_parse_within_it(engine):
    tools = lookup(minLength=2, maxLength=150)
    source = grammar.source(T.calls_rules(tools, None, parallel=False), "none")
    rng = random.Random(5)
    n = engine.vocab.n_vocab
    done = 0
    for _ in range(30):
        c, out = engine.constraint(source), []
        while len(out) < 600:
            ids = np.nonzero(np.unpackbits(c.mask().view(np.uint8), bitorder="little")[:n])[0]
            assert len(ids), "the grammar allows nothing"
            t = int(rng.choice(ids)) if len(ids) > 1 or ids[0] != n - 1 else n - 1
            if t == n - 1:
                break
            assert c.accept(t)
            out.append(t)
        else:
            continue
        text = b"".join(engine.vocab.tokens[t] for t in out).decode()
        content, calls = T.parse_answer(text, tools)
        assert content == "" and len(calls) == 1, text
        assert 2 <= len(calls[0].arguments["key"]) <= 150
        done += 1
    assert done >= 10


@pytest.mark.parametrize("text", ["</parameter>", "</function>", "</tool_call>"])
def test_regex_without_matches_what_does_not_hold_the_text(text):
    """grammar.regex_without against `text not in s` (Python's re on the same regex), over random strings of the
    text's own characters."""
    import re

    rx = re.compile(grammar.regex_without(text).replace("\\/", "/"), re.S)
    rng = random.Random(1)
    chars = sorted(set(text)) + ["x", "\n"]
    for _ in range(20000):
        s = "".join(rng.choice(chars) for _ in range(rng.randint(0, 24)))
        if rng.random() < 0.3:
            k = rng.randint(0, len(s))
            s = s[:k] + text[:rng.randint(0, len(text))] + s[k:]
        assert bool(rx.fullmatch(s)) == (text not in s), s


def test_a_max_length_of_0_beside_an_unbounded_string_stays_0(engine):
    """Cause 6: rules were named TEXT_{lo}_{hi or 'N'}, so maxLength 0 and no maxLength were both TEXT_0_N and the
    later one's rule stood for both: beside a parameter with minLength 0, the maxLength 0 one took any text."""
    tools = T.read_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "empty": {"type": "string", "maxLength": 0}, "free": {"type": "string", "minLength": 0}},
        "required": ["empty", "free"]}}}])
    source = grammar.source(T.calls_rules(tools, "f", parallel=False), "none")

    def text(empty: str) -> str:
        return (f"<tool_call>\n<function=f>\n<parameter=empty>\n{empty}\n</parameter>\n"
                f"<parameter=free>\nanything at all\n</parameter>\n</function>\n</tool_call>")

    c = engine.constraint(source)
    assert byte_walk(c, text("")) is None and c.finished()
    assert byte_walk(engine.constraint(source), text("x")) is not None
