"""Grammars at the edges of llguidance's lexer (issue 68): forced tool calls with long string bounds, patterns too
complex for the lexer, schemas that admit no value, rule names that must not collide. On an engine over a made-up
vocabulary of byte tokens and 20,000 multi-byte pieces (no model needed: the lexer's costs come from the grammar and
the token trie's depth, which the pieces give)."""

from __future__ import annotations

import json
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


# ---- what the engine cannot run: refused before a slot is taken (Engine.check) --------------------------------------
TOO_COMPLEX = {"type": "string", "pattern": "^(x{1000}){1000}$"}
NO_VALUE = [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}]


def json_body(schema) -> str:
    return f"body: {grammar.json_value(schema)}\n"


@pytest.mark.parametrize("schema", [TOO_COMPLEX, {"type": "object", "properties": {"a": TOO_COMPLEX},
                                                  "required": ["a"]}])
def test_a_pattern_too_complex_for_the_lexer_is_refused_by_check(engine, schema):
    """Cause 3: it compiled, its first masks allowed the opening quote, and taking it ran the lexer out ("too many
    expressions constructed"): a 500 in AR (the mask had allowed the token), an empty 200 in the block modes."""
    for _ in range(2):  # the second time from what check remembers (the refusal took the engine seconds)
        with pytest.raises(grammar.GrammarError, match="too complex for the grammar engine's lexer"):
            engine.check(json_body(schema))


def test_in_the_middle_of_an_answer_the_engine_giving_up_is_a_grammar_error(engine):
    """Where a limit is met past what check foresees, the decode stops with the request's GrammarError (a 400 from
    the worker), never a RuntimeError (a 500) or an empty mask read as the answer's end."""
    # as if Engine.check had not run; the value after up to four spaces, as after a thinking span
    compiled = engine._matcher(f"%llguidance {{}}\nstart: gap body\n{grammar.GAP}{json_body(TOO_COMPLEX)}")
    with pytest.raises(grammar.GrammarError, match="gave up after [0-9] tokens"):
        for start in (b'"', b' "', b'    "'):  # requests on copies of one compiled grammar, as the slots use it
            c = grammar.GrammarConstraint(engine, compiled.deep_copy())
            for t in start:
                c.mask()
                assert c.accept(t)
            c.mask()


@pytest.mark.parametrize("schema", NO_VALUE, ids=["ref_to_root", "ref_cycle"])
def test_a_schema_that_admits_no_value_is_refused_by_check(engine, schema):
    """Cause 4: $refs that only refer to each other compiled and answered 200 with ''."""
    with pytest.raises(grammar.GrammarError, match="admits no value"):
        engine.check(json_body(schema))


def test_check_passes_what_the_engine_runs(engine):
    tools = lookup(maxLength=1000)
    for body in (json_body({"type": "object", "properties": {"n": {"type": "integer"}, "s": {
                     "type": "string", "pattern": "^[a-z]{1,8}$", "maxLength": 8}}}),
                 json_body({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
                            "$ref": "#/$defs/node"}),  # recursive, but an object without `next` ends it
                 json_body({"type": "object", "properties": {"pattern": {"type": "string"}, "format": {
                     "type": "integer"}}}),  # properties named like the keywords
                 T.calls_rules(tools, None, parallel=True)):
        engine.check(body)
        engine.check(body)  # the second time from what it remembers


@pytest.fixture()
def scripted_on(engine, monkeypatch):
    """The scripted server of tests/test_tool_calls.py with this module's engine as the model's grammar engine."""
    from clover_gguf.serve.slots import Pool
    from test_server import _Server
    from test_tool_calls import ScriptedRuntime
    from clover_gguf.serve import create_app

    monkeypatch.setattr(Pool, "grammar_engine", lambda self: engine)
    s = _Server(create_app(ScriptedRuntime, mode="ar", parallel=1))
    yield s
    s.stop()


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TOO_COMPLEX}}},
     "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"o": {"type": "object", "properties": {"a": TOO_COMPLEX}}},
        "required": ["o"]}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NO_VALUE[0]}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NO_VALUE[1]}}},
     "response_format"),
])
@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_the_server_answers_them_with_a_400_up_front(scripted_on, extra, param, mode):
    import httpx

    r = httpx.post(scripted_on.base + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], "mode": mode, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "too complex" in err["message"] or "admits no value" in err["message"], err


def test_one_walk_finds_the_subschemas_and_only_them():
    """bounded_schema and Engine.check's string schemas walk a schema the same way (grammar.subschemas_mapped): a
    pattern under a keyword of each kind (one schema, a list, a map) is found and bounded alike; a value that is data
    (const, enum, default, examples) is neither, even when it looks like a schema."""
    looks_like = {"type": "string", "pattern": "^d$", "maxLength": 3}
    schema = {"type": "object",
              "properties": {"a": {"type": "string", "pattern": "^a+$"},
                             "b": {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 7},
                                                                        {"type": "integer"}]}}},
              "additionalProperties": {"type": "string", "format": "date"},
              "default": looks_like, "examples": [looks_like], "const": None}
    found = grammar._string_schemas(grammar.json_value(schema))
    assert sorted(found, key=json.dumps) == sorted([{"type": "string", "pattern": "^a+$"},
                                                    {"type": "string", "maxLength": 7},
                                                    {"type": "string", "format": "date"}], key=json.dumps)
    bounded = grammar.bounded_schema(schema)
    assert bounded["properties"]["b"]["items"]["anyOf"][1]["maximum"] == grammar.MAX_INT
    assert bounded["default"] == looks_like and bounded["examples"] == [looks_like]
