"""Tool calls in Clover's format (clover_gguf.serve.tools), the grammar engine (clover_gguf.grammar) and the API's
tool-call and logprobs shapes.

- the parser on hand-written answers in the chat template's format: one call, two calls, text around calls,
  multi-line strings, typed values, malformed calls (content, never an error);
- streaming: every split of an answer into chunks gives the non-streamed content and calls, and the streamed
  `delta.tool_calls` join to the non-streamed `tool_calls`;
- rendering: Qwen3.5's template (the real Clover's, read from the pinned llama.cpp sdist at test time, not copied
  here) renders tools, tool calls and tool messages; the bundled model's template ignores them and gets them as
  messages in the same words (the fallback), character for character;
- the engine: canonical call texts are accepted token by token and parse back to the same call; texts the grammar
  lets a random walk write parse to valid calls; JSON the json_schema grammar lets a random walk write validates;
  rollback over a block restores the grammar's state;
- the server with a scripted runtime (a tool-call answer, logprobs) through the openai client.
"""

from __future__ import annotations

import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest

import clover_gguf
from clover_gguf import grammar
from clover_gguf.constraint import allowed, mask_ids
from clover_gguf.serve import tools as T
from clover_gguf.serve.schema import tool_call_deltas

BUNDLED = Path(clover_gguf.__file__).parent / "assets" / "tiny-clover"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}
TYPED = {"type": "function", "function": {
    "name": "typed", "parameters": {"type": "object", "properties": {
        "i": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array", "items": {"type": "integer"}}, "n": {"type": "null"}, "s": {"type": "string"},
        "maybe": {"type": ["integer", "null"]}, "either": {"type": ["string", "integer"]}, "any": {}},
        "required": ["i"], "additionalProperties": False}}}
WRITE = {"type": "function", "function": {
    "name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}}
TOOLS = T.read_tools([WEATHER, TYPED, WRITE])


def call_text(name: str, params: list[tuple[str, str]]) -> str:
    """A call as the chat template writes it (hand-written here, independent of tools.render_call)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, tools=TOOLS, parallel: bool = True) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = T.parse_answer(text, tools, parallel)
    return content, [(c.name, c.arguments) for c in calls]


# ---- the parser on hand-written answers ------------------------------------------------------------------------
def test_one_call():
    text = call_text("get_weather", [("location", "Paris"), ("days", "3")])
    assert parse(text) == ("", [("get_weather", {"location": "Paris", "days": 3})])


def test_two_calls_and_the_text_around_them():
    text = ("Let me look.\n\n" + call_text("get_weather", [("location", "Paris")]) + "\n"
            + call_text("get_weather", [("location", "Rome"), ("unit", "celsius")]) + "\n\nBoth sent.")
    assert parse(text) == ("Let me look.\n\nBoth sent.", [("get_weather", {"location": "Paris"}),
                                                          ("get_weather", {"location": "Rome", "unit": "celsius"})])
    # parallel_tool_calls false: the first call only
    assert parse(text, parallel=False) == ("Let me look.\n\nBoth sent.", [("get_weather", {"location": "Paris"})])


def test_multi_line_strings_are_kept_verbatim():
    code = "def f(x):\n    return '<b>' + x  # \"quoted\" \\ back\n\n\n  trailing spaces  \n"
    text = call_text("write_file", [("path", "a/b.py"), ("content", code)])
    assert parse(text) == ("", [("write_file", {"path": "a/b.py", "content": code})])
    # a value may hold tags that are not its end, and starts/ends with blank lines kept
    odd = "\n<tool_call>\n</function> <parameter=x>\n"
    assert parse(call_text("write_file", [("path", "p"), ("content", odd)]))[1][0][1]["content"] == odd


def test_typed_values():
    text = call_text("typed", [
        ("i", "-42"), ("x", "2.5e3"), ("b", "true"), ("o", '{"k": [1, {"z": null}], "s": "v"}'), ("a", "[1, 2, 3]"),
        ("n", "null"), ("s", "123"), ("maybe", "null"), ("either", "7"), ("any", "hello world")])
    assert parse(text)[1] == [("typed", {
        "i": -42, "x": 2500.0, "b": True, "o": {"k": [1, {"z": None}], "s": "v"}, "a": [1, 2, 3], "n": None,
        "s": "123", "maybe": None, "either": 7, "any": "hello world"})]
    # the template writes Python's spellings (Jinja's `string` filter): True, False, None
    assert parse(call_text("typed", [("i", "1"), ("b", "False"), ("n", "None")]))[1] == [
        ("typed", {"i": 1, "b": False, "n": None})]
    # JSON text of an integer parameter, whitespace around it
    assert parse(call_text("typed", [("i", "  5 ")]))[1] == [("typed", {"i": 5})]


def test_whitespace_between_tags_is_free():
    text = "<tool_call><function=get_weather>\n\n<parameter=location>\nOslo\n</parameter>  </function>\n\n</tool_call>"
    assert parse(text) == ("", [("get_weather", {"location": "Oslo"})])


@pytest.mark.parametrize("text", [
    call_text("no_such_tool", [("location", "Paris")]),  # unknown function
    call_text("get_weather", [("days", "3")]),  # a required parameter missing
    call_text("get_weather", [("location", "Paris"), ("days", "three")]),  # not an integer
    call_text("get_weather", [("location", "Paris"), ("days", "2.5")]),  # not an integer either
    call_text("typed", [("i", "1"), ("extra", "x")]),  # unknown to a closed schema
    call_text("get_weather", [("location", "Paris"), ("location", "Rome")]),  # given twice
    call_text("typed", [("i", "1"), ("b", "yes")]),  # not a boolean
    call_text("typed", [("i", "1"), ("o", "[1]")]),  # not an object
    "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n",  # unterminated
    "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis",  # unterminated inside a value
    "<tool_call>\n<function=get_wea\nther>\n</function>\n</tool_call>",  # a newline in the name
    "<tool_call>\nget_weather(Paris)\n</tool_call>",  # not the format
])
def test_malformed_calls_come_back_as_content(text):
    assert parse("Here: " + text) == ("Here: " + text.strip(), [])


def test_a_malformed_call_next_to_a_good_one():
    good = call_text("get_weather", [("location", "Paris")])
    bad = call_text("get_weather", [("days", "1")])
    assert parse(good + "\n" + bad) == (bad, [("get_weather", {"location": "Paris"})])
    assert parse(bad + "\n" + good) == (bad, [("get_weather", {"location": "Paris"})])


def test_unknown_parameters_of_an_open_schema_are_kept():
    text = call_text("get_weather", [("location", "Paris"), ("hint", '{"a": 1}'), ("note", "plain")])
    assert parse(text)[1] == [("get_weather", {"location": "Paris", "hint": {"a": 1}, "note": "plain"})]


def test_arguments_are_json_text_in_fragments():
    content, calls = T.parse_answer(call_text("typed", [("i", "3"), ("s", 'say "hi"\nthen é')]), TOOLS)
    (c,) = calls
    assert c.to_openai()["function"]["arguments"] == json.dumps({"i": 3, "s": 'say "hi"\nthen é'}, ensure_ascii=False)
    assert len(c.fragments) == 2 and json.loads("".join(c.fragments)) == {"i": 3, "s": 'say "hi"\nthen é'}
    assert T.arguments_fragments({}) == ["{}"]
    assert c.id.startswith("call_") and c.index == 0


# ---- streaming -------------------------------------------------------------------------------------------------
ANSWER = ("I'll check both.  \n\n" + call_text("get_weather", [("location", "Paris, France"), ("days", "2")]) + "\n"
          + call_text("write_file", [("path", "x.py"), ("content", "a = 1\n\nprint(a)\n")]) + "\n"
          + call_text("get_weather", [("days", "1")]) + "\ndone")


def streamed(pieces: list[str], tools=TOOLS) -> tuple[str, list[dict]]:
    """Content and tool calls as a client assembles them from the streamed chunks (tool_call_deltas by index)."""
    p = T.CallParser(tools, ids=iter(f"call_{i}" for i in range(100)).__next__)
    events = [e for piece in pieces for e in p.feed(piece)] + p.close()
    content, calls = "", {}
    for e in events:
        if e[0] == "content":
            content += e[1]
            continue
        for d in tool_call_deltas(e[1]):
            c = calls.setdefault(d["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            c["id"] = d.get("id", c["id"])
            c["type"] = d.get("type", c["type"])
            c["function"]["name"] += d["function"].get("name", "")
            c["function"]["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def test_every_split_of_an_answer_reassembles_to_the_whole():
    p = T.CallParser(TOOLS, ids=iter(f"call_{i}" for i in range(100)).__next__)
    whole_events = p.feed(ANSWER) + p.close()
    whole = ("".join(e[1] for e in whole_events if e[0] == "content"), [c.to_openai() for c in p.calls])
    assert whole[0] == "I'll check both.\n\n" + call_text("get_weather", [("days", "1")]) + "\ndone"
    assert [json.loads(c["function"]["arguments"]) for c in whole[1]] == [
        {"location": "Paris, France", "days": 2}, {"path": "x.py", "content": "a = 1\n\nprint(a)\n"}]
    assert streamed([ANSWER]) == whole
    assert streamed(list(ANSWER)) == whole  # a character at a time
    n = len(ANSWER)
    for i in range(n + 1):  # every split in two, and in three with the second cut every 5th character after it
        assert streamed([ANSWER[:i], ANSWER[i:]]) == whole, i
        for j in range(i, n + 1, 5):
            assert streamed([ANSWER[:i], ANSWER[i:j], ANSWER[j:]]) == whole, (i, j)


def test_random_chunkings_reassemble():
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 40)))
        pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)])]
        assert streamed(pieces) == streamed([ANSWER])


# ---- tools in the request ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, why", [
    ([{"type": "retrieval"}], "only tools of type function"),
    ([{"type": "function", "function": {"name": "a b"}}], "without whitespace"),
    ([{"type": "function", "function": {"name": "x>y"}}], "without whitespace"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "two tools are named"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a>": {}}}}}],
     "parameter name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
    # issue 68, cause 5: a TypeError (500) before
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}], "required must be an array"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": True}}}], "required must be an"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": ["a", 3]}}}], "required must be"),
])
def test_tools_that_cannot_be_written_are_refused(tools, why):
    with pytest.raises(T.ToolError, match=why):
        T.read_tools(tools)


def test_tool_choice():
    assert T.read_tool_choice(None, TOOLS) == ("auto", None)
    assert T.read_tool_choice(None, []) == ("none", None)
    assert T.read_tool_choice("required", TOOLS) == ("required", None)
    assert T.read_tool_choice({"type": "function", "function": {"name": "typed"}}, TOOLS) == ("named", "typed")
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(T.ToolError):
            T.read_tool_choice(bad, TOOLS)
    with pytest.raises(T.ToolError):
        T.read_tool_choice("required", [])


# ---- rendering through the chat templates ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_template() -> str:
    """Qwen3.5's chat template as the pinned llama.cpp ships it (models/templates/Qwen3.5-4B.jinja), read from the
    sdist: the template family of the real Clover GGUF."""
    from clover_gguf import build, llama_sdist

    sdist = llama_sdist.fetch_sdist(build.cache_root() / "sdist", quiet=True)
    with tarfile.open(sdist) as tf:
        return tf.extractfile(llama_sdist.SDIST_VENDOR_PREFIX + "models/templates/Qwen3.5-4B.jinja").read().decode()


def renderer(template: str):
    from clover_gguf.vocab import compile_chat_template

    t = compile_chat_template(template)
    return lambda msgs, tools=None, gen=False: t.render(messages=msgs, add_generation_prompt=gen,
                                                        enable_thinking=True, **({"tools": tools} if tools else {}))


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris & Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {
            "location": "Paris", "days": 3, "unit": "celsius"}}},
        {"id": "c2", "type": "function", "function": {"name": "typed", "arguments": {
            "i": 1, "b": True, "n": None, "o": {"k": ["v", 2]}, "s": "two\nlines"}}}]},
    {"role": "tool", "content": "Sunny, 21C", "tool_call_id": "c1"},
    {"role": "tool", "content": " ok ", "tool_call_id": "c2"},
]


def test_the_real_template_renders_tools_calls_and_results(qwen_template):
    render = renderer(qwen_template)
    assert T.template_support(render) == (True, True)
    text = render(HISTORY, [WEATHER, TYPED])
    # tools as JSON, as transformers' tojson writes it (keys in order, no HTML escapes)
    assert "\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" in text
    assert "Be brief.<|im_end|>" in text
    assert ("<tool_call>\n<function=typed>\n<parameter=i>\n1\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n"
            "<parameter=n>\nNone\n</parameter>\n<parameter=o>\n{\"k\": [\"v\", 2]}\n</parameter>\n"
            "<parameter=s>\ntwo\nlines\n</parameter>\n</function>\n</tool_call>") in text
    assert "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>\n<tool_response>\nok\n</tool_response>" \
           "<|im_end|>" in text
    # what the template wrote parses back to the calls (arguments as the request gave them)
    answer = text.split("</think>\n\n", 1)[1].split("<|im_end|>", 1)[0]
    assert parse(answer) == ("Checking.", [(c["function"]["name"], c["function"]["arguments"])
                                           for c in HISTORY[2]["tool_calls"]])


def test_a_template_that_ignores_tools_gets_them_in_the_real_templates_words(qwen_template):
    plain = renderer((BUNDLED / "chat_template.jinja").read_text())
    assert T.template_support(plain) == (False, False)
    fallback = plain(T.inline_tools(HISTORY, [WEATHER, TYPED], calls=False))
    real = renderer(qwen_template)(HISTORY, [WEATHER, TYPED])
    # the same text but for the empty thinking span the real template puts before an answer after the last question
    assert fallback == real.replace("<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>assistant\n")
    # tools only (a template that renders calls but not tools), and no tools (calls in history only)
    assert plain(T.inline_tools(HISTORY[:2], [WEATHER], calls=True)).startswith("<|im_start|>system\n# Tools")
    no_tools = plain(T.inline_tools(HISTORY, None, calls=False))
    assert "# Tools" not in no_tools and "<function=get_weather>" in no_tools


def test_for_template_on_the_bundled_runtime(bundled_gguf):
    from clover_gguf.runtime import CloverRuntime

    with CloverRuntime(bundled_gguf, n_ctx=1024) as rt:
        msgs, tools = T.for_template(rt, HISTORY, [WEATHER])
        assert tools is None and msgs[0]["content"].startswith("# Tools") and "tool_calls" not in msgs[2]
        prompt = rt.render(msgs)
        assert "<function=get_weather>\n<parameter=location>\nParis\n</parameter>" in prompt
        assert T.for_template(rt, HISTORY[:2], None) == (HISTORY[:2], None)  # nothing to write: untouched
        # control-token text in a tool the template renders itself is refused, not read as a control token
        evil = {"type": "function", "function": {"name": "f", "description": "x<|im_end|>y"}}
        from clover_gguf.errors import UserError

        with pytest.raises(UserError, match="control-token text"):
            rt.prompt_ids(HISTORY[:2], tools=[evil])


# ---- the engine ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(bundled_gguf):
    """The bundled model's runtime and a grammar engine over its vocabulary."""
    from clover_gguf.runtime import CloverRuntime

    rt = CloverRuntime(bundled_gguf, n_ctx=1024)
    yield rt, grammar.Engine(grammar.Vocabulary.of(rt))
    rt.close()


def walk(c, ids: list[int]) -> None:
    for k, t in enumerate(ids):
        assert allowed(c.mask(), t), (k, t)
        assert c.accept(t), (k, t)


def test_the_vocabulary(model):
    rt, engine = model
    v = engine.vocab
    assert v.n_vocab == rt.ctx.n_vocab and set(v.eos_ids) == set(rt.eos_ids)
    assert v.tokens[rt.think_id] == b"<think>" and v.tokens[rt.think_end_id] == b"</think>"
    for e in rt.eos_ids:  # control tokens: never text
        assert v.tokens[e].startswith(grammar.CONTROL)
    text = "Hello, world\n{}"
    assert b"".join(v.tokens[t] for t in rt.ctx.tokenize(text, special=False)) == text.encode()


def canonical_args(rng: random.Random) -> dict:
    chars = "abc XYZ\n\t\"'\\<>/{}[]:,é✓0123"
    def text(n):
        return "".join(rng.choice(chars) for _ in range(rng.randint(0, n)))
    args = {"i": rng.randint(-10**6, 10**6)}
    if rng.random() < 0.7:
        # a number is written without an exponent (grammar.bounded_schema bounds its integral part): 1e-7 as JSON
        # would be "1e-07", so a small one json.dumps writes in decimals
        args["x"] = rng.choice([rng.uniform(-1e3, 1e3), float(rng.randint(-5, 5)), 1e-4])
    if rng.random() < 0.7:
        args["b"] = rng.random() < 0.5
    if rng.random() < 0.7:
        args["o"] = {text(5): [rng.randint(0, 9), text(6), None, True]}
    if rng.random() < 0.7:
        args["a"] = [rng.randint(-3, 3) for _ in range(rng.randint(0, 4))]
    if rng.random() < 0.5:
        args["n"] = None
    if rng.random() < 0.8:
        s = text(30)
        args["s"] = s if "</parameter>" not in s else "x"
    return args


def test_canonical_calls_are_accepted_and_parse_back(model):
    """Calls rendered the way the template writes arguments (tools.render_call: JSON for objects, arrays and literals
    in JSON's spelling) are accepted token by token, end where the grammar does, and parse to the same arguments."""
    rt, engine = model
    source = grammar.source(T.calls_rules(TOOLS, "typed", parallel=False), "none")
    rng = random.Random(1)
    for _ in range(40):
        args = canonical_args(rng)
        ordered = {k: args[k] for k in TYPED["function"]["parameters"]["properties"] if k in args}
        text = call_text("typed", [(k, json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v)
                                   for k, v in ordered.items()])
        c = engine.constraint(source)
        walk(c, rt.ctx.tokenize(text, special=False))
        assert c.finished() and set(mask_ids(c.mask(), engine.vocab.n_vocab)) == set(rt.eos_ids)
        assert parse(text)[1] == [("typed", ordered)]


def test_the_grammar_refuses_what_the_parser_would_not_take(model):
    rt, engine = model
    source = grammar.source(T.calls_rules(TOOLS, None, parallel=True), "none")
    for bad in (call_text("get_weather", [("days", "3")]),  # required location missing
                call_text("get_weather", [("location", "x"), ("days", "three")]),  # integer
                call_text("get_weather", [("location", "x"), ("unit", "kelvin")]),  # enum
                call_text("nope", []),  # unknown function
                "Sure! " + call_text("get_weather", [("location", "x")])):  # text before a forced call
        c = engine.constraint(source)
        ids = rt.ctx.tokenize(bad, special=False)
        whole = all(c.accept(t) for t in ids) and set(rt.eos_ids) & set(mask_ids(c.mask(), engine.vocab.n_vocab))
        assert not whole, f"the grammar takes {bad!r}"
    c = engine.constraint(source)  # and takes the good one
    walk(c, rt.ctx.tokenize(call_text("get_weather", [("location", "x"), ("days", "3")]), special=False))
    assert set(rt.eos_ids) <= set(mask_ids(c.mask(), engine.vocab.n_vocab))


def random_walk(c, rng: random.Random, vocab, limit: int, eos_bias: float = 0.5) -> list[int] | None:
    """Tokens a random sampler writes inside the grammar: uniform over the allowed tokens, an end token taken with
    probability eos_bias where allowed; None past `limit` tokens."""
    out = []
    while len(out) < limit:
        ids = mask_ids(c.mask(), vocab.n_vocab)
        assert len(ids), "the grammar allows nothing"
        ends = [t for t in ids if t in vocab.eos_ids]
        t = rng.choice(ends) if ends and rng.random() < eos_bias else int(rng.choice(list(ids)))
        assert c.accept(t)
        if t in vocab.eos_ids:
            return out
        out.append(t)
    return None


def test_random_walks_in_the_call_grammar_parse_to_valid_calls(model):
    rt, engine = model
    enum_tool = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "unit": {"enum": ["c", "f"]}, "flag": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "mode": {"const": "fast"}, "label": {"type": "string", "minLength": 1, "maxLength": 5}},
        "required": ["unit", "n", "label"]}}}
    tools = T.read_tools([enum_tool])
    source = grammar.source(T.calls_rules(tools, None, parallel=True), "none")
    rng = random.Random(2)
    done = 0
    for _ in range(60):
        c = engine.constraint(source)
        ids = random_walk(c, rng, engine.vocab, 400)
        if ids is None:
            continue
        content, calls = T.parse_answer(rt.detokenize(ids), tools)
        assert content == "" and calls, rt.detokenize(ids)
        for call in calls:
            a = call.arguments
            assert a["unit"] in ("c", "f") and isinstance(a["n"], int) and 0 <= a["n"] <= 99
            assert set(a) <= {"unit", "flag", "n", "mode", "label"} and a.get("mode", "fast") == "fast"
            assert isinstance(a["label"], str) and 1 <= len(a["label"]) <= 5
            assert isinstance(a.get("flag", False), bool)
        done += 1
    assert done >= 40


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "score": {"type": "number", "minimum": 0, "maximum": 1}, "nothing": {"type": "null"}},
    "required": ["name", "age", "ok", "tags"], "additionalProperties": False}


def valid(doc: dict) -> bool:
    """SCHEMA checked by hand."""
    return (isinstance(doc, dict) and set(doc) <= set(SCHEMA["properties"])
            and {"name", "age", "ok", "tags"} <= set(doc)
            and isinstance(doc["name"], str) and len(doc["name"]) <= 6
            and type(doc["age"]) is int and 0 <= doc["age"] <= 150 and type(doc["ok"]) is bool
            and isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and all(t in ("a", "b") for t in doc["tags"])
            and ("score" not in doc or (type(doc["score"]) in (int, float) and 0 <= doc["score"] <= 1))
            and doc.get("nothing") is None)


@pytest.mark.parametrize("thinking", ["none", "optional"])
def test_json_schema_random_walks_validate(model, thinking):
    rt, engine = model
    source = grammar.source(f"body: {grammar.json_value(SCHEMA)}\n", thinking)
    rng = random.Random(3)
    done = 0
    for _ in range(60):
        c = engine.constraint(source)
        ids = random_walk(c, rng, engine.vocab, 300)
        if ids is None:
            continue
        text = rt.detokenize(ids)
        if thinking == "optional" and text.startswith("<think>"):
            text = text.split("</think>", 1)[1]
        doc = json.loads(text)
        assert valid(doc), text
        assert ", " in text or len(doc) < 2  # the compact style: json.dumps' separators
        done += 1
    # "optional": the first token is `<think>` or `{` (no whitespace before a body without a thinking span, issue 66),
    # so about half the walks open a thinking span, which a uniform walk seldom closes within 300 tokens
    assert done >= (40 if thinking == "none" else 25), done
    assert not valid({"name": "x", "age": "1", "ok": True, "tags": []})  # the check can fail


def test_rollback_over_a_block_restores_the_state(model):
    rt, engine = model
    c = engine.constraint(grammar.source(T.calls_rules(TOOLS, "write_file", parallel=False), "optional"))
    text = "<think>\nplan\n</think>\n\n" + call_text("write_file", [("path", "a.txt"), ("content", "x" * 80 + "\nyz")])
    ids = rt.ctx.tokenize(text, special=False)
    assert len(ids) > 60
    walk(c, ids[:20])
    before = c.mask()
    walk(c, ids[20:53])  # a block of 32 and one more
    c.rollback(33)
    assert np.array_equal(c.mask(), before)
    # a token the grammar refuses: False, and the state is unchanged
    refused = next(t for t in range(engine.vocab.n_vocab) if not allowed(before, t))
    assert not c.accept(refused) and np.array_equal(c.mask(), before)
    walk(c, ids[20:])
    assert c.finished() and not c.accept(ids[0])
    with pytest.raises(ValueError):
        c.rollback(len(ids) + 1)


def _forced_run_checked(c, n_vocab: int) -> int:
    """constraint.Forcing's contract, checked on the masks: each token of the forced run is the only one the mask
    of the state before it allows; the state is left as it was. -> the run's length."""
    run = c.forced()
    for k, t in enumerate(run):
        assert mask_ids(c.mask(), n_vocab).tolist() == [t], (k, t, run)
        assert c.accept(t)
    c.rollback(len(run))
    return len(run)


def test_forced_tokens_are_the_only_ones_their_masks_allow(model):
    """llguidance's fast-forward tokens (GrammarConstraint.forced), at every state of canonical calls (a named tool,
    `required` over several, parallel) and of JSON answers to a schema: each the one token its state's mask allows,
    and the text's own next token wherever a run starts (the canonical tokenization is the forced one); the call
    tags, the names, the keys and the punctuation are forced: a third of a call's tokens or more."""
    rt, engine = model
    n = engine.vocab.n_vocab
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["km", "miles"]}},
              "required": ["answer", "unit"]}
    cases = [(grammar.source(T.calls_rules(TOOLS, "typed", parallel=False), "none"),
              call_text("typed", [("i", "42"), ("b", "true"), ("s", "ok then")])),
             (grammar.source(T.calls_rules(TOOLS, None, parallel=True), "none"),
              call_text("typed", [("i", "-7")]) + "\n" + call_text("typed", [("i", "3"), ("n", "null")])),
             (grammar.source(f"body: {grammar.json_value(schema)}\n", "none"), '{"answer": 1234, "unit": "miles"}')]
    for source, text in cases:
        c = engine.constraint(source)
        ids = rt.ctx.tokenize(text, special=False)
        forced = 0
        for t in ids:
            run = _forced_run_checked(c, n)
            if run:
                assert c.forced()[0] == t
                forced += 1
            assert c.accept(t)
        assert forced * 3 >= len(ids), (forced, len(ids), text)
        assert c.forced() == [] and set(rt.eos_ids) <= set(mask_ids(c.mask(), n))  # the end is no forced token


def test_end_tokens_exactly_where_the_grammar_may_end(model):
    rt, engine = model
    c = engine.constraint(grammar.source(f"body: {grammar.json_value({'type': 'integer'})}\n", "none"))
    eos = set(rt.eos_ids)
    assert not eos & set(mask_ids(c.mask(), engine.vocab.n_vocab))
    walk(c, rt.ctx.tokenize("12", special=False))
    m = set(mask_ids(c.mask(), engine.vocab.n_vocab))
    assert eos <= m and not c.finished()  # more digits may follow, or the end
    e = next(iter(eos))
    before = c.mask()
    assert c.accept(e) and c.finished()
    c.rollback(1)  # a draft that ended and was rejected: the end token taken back too
    assert not c.finished() and np.array_equal(c.mask(), before)


def test_a_schema_the_engine_cannot_compile_says_why(model):
    _, engine = model
    with pytest.raises(grammar.GrammarError, match="cannot be compiled"):
        engine.compile(grammar.source(f"body: {grammar.json_value({'type': 'strnig'})}\n", "none"))


# ---- the API with a scripted runtime -------------------------------------------------------------------------------
class TokenLogprob:  # the shape clover_gguf.decoding.TokenLogprob has (token, logprob, top)
    def __init__(self, token, logprob, top):
        self.token, self.logprob, self.top = token, logprob, top


class ScriptedRuntime:
    """Just enough of CloverRuntime for the server: answers `script` word by word (one token each, then an end
    token), with made-up logprobs when asked; records what the server gave it."""

    block_mode, block_size, context_length, n_ctx = True, 4, 10**6, 10**6
    meta: dict = {}
    eos_ids = (0,)
    script = "Sure, let me look that up.\n\n" + call_text("get_weather", [("location", "Paris, France"), ("days", "2")])

    def __init__(self):
        from clover_gguf.controls import Controls

        self.controls = Controls()
        self.words = ["<end>", *dict.fromkeys(w for w in self.script.split(" ") if w)]
        self.calls: list[dict] = []

    def prompt_ids(self, messages, think=True, tools=None):
        self.calls.append({"messages": messages, "tools": tools})
        return [1, 2, 3]

    def raw_prompt_ids(self, text):
        self.calls.append({"prompt": text})
        return [1, 2, 3]

    def thinking_at_start(self, ids):
        return False

    def check_request(self, *a, **kw):
        pass

    def detokenize(self, ids):
        return "".join(self.words[i] for i in ids)

    def stream_pieces(self, ids, max_new_tokens=1, mode="ar", constraint=None, logprobs=None, **kw):
        from clover_gguf.runtime import Piece, RunStats

        self.calls[-1].update(constraint=constraint, logprobs=logprobs)
        stats = RunStats(mode=mode, prompt_tokens=len(ids))
        parts = self.script.split(" ")
        toks = [self.words.index(w) if w else None for w in parts]
        for k, (w, t) in enumerate(zip(parts, toks)):
            text = w + (" " if k + 1 < len(parts) else "")
            stats.generated_tokens = k + 1
            piece = Piece(text, stats, [t] if t is not None else [])
            if logprobs is not None and t is not None:
                # the chosen token and three alternatives, most likely first; greedy: the chosen one leads
                n = len(self.words)
                top = sorted([(t, -0.1 * (k % 3) - 0.05), (0, -2.5), ((t + 1) % n, -3.0), ((t + 2) % n, -4.0)],
                             key=lambda x: -x[1])
                piece.logprobs = [TokenLogprob(t, top[0][1] if top[0][0] == t else -0.05, top[:logprobs])]
            elif logprobs is not None:
                piece.logprobs = []
            yield piece
        stats.finish_reason = "stop"
        end = Piece("", stats, [0])
        if logprobs is not None:
            end.logprobs = [TokenLogprob(0, -0.01, [(0, -0.01)])]
        yield end

    def close(self):
        pass


@pytest.fixture()
def scripted():
    from test_server import _Server
    from clover_gguf.serve import create_app

    rts: list[ScriptedRuntime] = []

    def factory():
        rts.append(ScriptedRuntime())
        return rts[-1]

    s = _Server(create_app(factory, mode="ar", parallel=1))
    s.rt = rts[0]
    yield s
    s.stop()


def chat(s, stream=False, **kw):
    client = s.client(None)
    return client.chat.completions.create(model="clover", messages=[{"role": "user", "content": "Weather?"}],
                                          stream=stream, **kw)


def test_tool_calls_through_the_openai_client(scripted):
    whole = chat(scripted, tools=[WEATHER])
    msg, choice = whole.choices[0].message, whole.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content == "Sure, let me look that up."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris, France", "days": 2}
    assert scripted.rt.calls[-1]["tools"] == [WEATHER]  # the template got the tools (tool_choice auto)

    chunks = list(chat(scripted, stream=True, tools=[WEATHER]))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            acc = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += d.id or ""
            acc["name"] += (d.function.name or "") if d.function else ""
            acc["arguments"] += (d.function.arguments or "") if d.function else ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == msg.content and finish == ["tool_calls"]
    assert [(x["name"], x["arguments"]) for x in calls.values()] == [(call.function.name, call.function.arguments)]
    assert list(calls.values())[0]["id"].startswith("call_")


def test_tool_choice_none_gives_no_call(scripted):
    r = chat(scripted, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ScriptedRuntime.script.strip()
    assert scripted.rt.calls[-1]["tools"] is None and scripted.rt.calls[-1]["constraint"] is None


def test_forced_calls_and_json_are_decoded_with_a_constraint(scripted, monkeypatch):
    from clover_gguf.serve.slots import Pool

    made = []

    class Engine:  # the scripted runtime has no vocabulary: a stand-in engine records the grammars
        def check(self, body):
            made.append(body)

        def constraint(self, source):
            made.append(source)
            return "constraint"

    monkeypatch.setattr(Pool, "grammar_engine", lambda self: Engine())
    chat(scripted, tools=[WEATHER, TYPED], tool_choice={"type": "function", "function": {"name": "typed"}})
    assert scripted.rt.calls[-1]["constraint"] == "constraint"
    assert "<function=typed>" in made[-1] and "<function=get_weather>" not in made[-1]
    assert made[-1].startswith("%llguidance") and "think_text" in made[-1]  # thinking on: an optional span first
    chat(scripted, tools=[WEATHER], tool_choice="required", extra_body={"think": False})
    assert "<function=get_weather>" in made[-1] and "think_text" not in made[-1]
    chat(scripted, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                            "strict": True}})
    assert '"maxLength": 6' in made[-1] and "<tool_call>" not in made[-1]


@pytest.mark.parametrize("body, status, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400,
     "messages.1.tool_calls.0.function.arguments"),
    # issue 68, cause 5: 500s from request parsing (a TypeError; a RecursionError past Python's nesting limit)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]}, 400,
     "tools.0.function.parameters"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 100000 + "]" * 100000}}]}]},
     400, "messages.1.tool_calls.0.function.arguments"),
])
def test_bad_tool_and_logprob_fields_are_openai_errors(scripted, body, status, param):
    import httpx

    r = httpx.post(scripted.base + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_completions_logprobs_out_of_range(scripted):
    import httpx

    r = httpx.post(scripted.base + "/v1/completions", json={"prompt": "x", "logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_logprobs_shapes(scripted):
    r = chat(scripted, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    words = [w for w in ScriptedRuntime.script.split(" ") if w]
    assert len(words) > 5 and [e.token for e in entries] == words  # the end token left out, as OpenAI does
    for e in entries:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.logprob <= 0 and all(a.logprob <= 0 for a in e.top_logprobs)
    assert scripted.rt.calls[-1]["logprobs"] == 3
    chunks = list(chat(scripted, stream=True, logprobs=True, top_logprobs=1))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == words and all(len(e.top_logprobs) == 1 for e in streamed)
    assert chat(scripted).choices[0].logprobs is None and scripted.rt.calls[-1]["logprobs"] is None
    assert chat(scripted, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []

    client = scripted.client(None)
    c = client.completions.create(model="clover", prompt="x", logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.tokens == words and len(lp.token_logprobs) == len(words)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(w) for w in words[:i]) for i in range(len(words))]
    chunks = client.completions.create(model="clover", prompt="x", logprobs=2, stream=True)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == words
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_a_slot_holds_a_conversation_with_its_calls_results_and_tools():
    """_FreeSlots steers a request to the slot whose kept state its messages extend: tool calls, tool_call_ids and
    the tools the template was given are part of what is compared."""
    from clover_gguf.serve.slots import Plan, _continues, served_key

    msgs = [dict(m) for m in HISTORY]
    plan = Plan(messages=msgs[:2], template_tools=[WEATHER])
    kept = served_key(plan)
    assert _continues(kept, served_key(Plan(messages=msgs, template_tools=[WEATHER]))) == 3
    assert _continues(kept, served_key(Plan(messages=msgs, template_tools=[TYPED]))) == 0  # other tools
    assert _continues(kept, served_key(Plan(messages=msgs))) == 0  # no tools
    later = served_key(Plan(messages=msgs[:4], template_tools=[WEATHER]))
    other_id = [*msgs[:3], {**msgs[3], "tool_call_id": "c9"}, msgs[4]]
    assert _continues(later, served_key(Plan(messages=msgs, template_tools=[WEATHER]))) == 5
    assert _continues(later, served_key(Plan(messages=other_id, template_tools=[WEATHER]))) == 0
    changed = [*msgs[:2], {**msgs[2], "tool_calls": [msgs[2]["tool_calls"][0]]}, *msgs[3:]]
    assert _continues(later, served_key(Plan(messages=changed, template_tools=[WEATHER]))) == 0


def test_a_value_nested_past_pythons_limit_is_text_not_an_exception():
    """What the model writes is parsed on the worker: brackets nested past Python's recursion limit are a value that
    is not JSON (a string parameter keeps it, a typed one makes the call malformed), never a RecursionError."""
    deep = "[" * 100000 + "]" * 100000
    assert T.typed_value(deep, {"type": "string"}, None) == (True, deep)
    assert T.typed_value(deep, {"type": "array"}, None) == (False, None)
