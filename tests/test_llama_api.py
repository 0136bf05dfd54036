"""Requests written for llama-server, on `serve` (issue 66; docs/serve.md, "Requests written for llama-server"): the
paths without /v1, validation errors as 400s, `n` choices, CORS, llama.cpp's request extensions (`grammar`,
top-level `json_schema`, a `schema` inside json_object, `timings`), its endpoints (/tokenize, /detokenize,
/apply-template, /props), --reasoning; and numbers under a grammar bounded, so a constrained answer of a model that
does not know the format still ends (item 2's figures).

On the bundled trained model through FastAPI's TestClient; the independent references are the model's own
tokenizer.json read by the `tokenizers` library, its chat template rendered by jinja2, `jsonschema` for the answers,
and the official openai client.
"""

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import clover_gguf  # noqa: E402
from clover_gguf import grammar  # noqa: E402
from clover_gguf.serve import create_app  # noqa: E402

BUNDLED = Path(clover_gguf.__file__).parent / "assets" / "tiny-clover"

KEY = "test-key-66"
ASK = [{"role": "user", "content": "What is 34 + 58?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def http(bundled_gguf):
    from fastapi.testclient import TestClient

    app = create_app(bundled_gguf, api_key=KEY, runtime_kwargs={"n_threads": 1})
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def _chat(http, path="/v1/chat/completions", **body):
    return http.post(path, json={"messages": ASK, "max_tokens": 8, **body})


# ---- paths, errors, n ----------------------------------------------------------------------------------------------
def test_the_openai_client_with_a_base_url_without_v1(http):
    """llama-server's own paths: /chat/completions, /completions and /models (an OpenAI client whose base_url lacks
    /v1 calls them; before: 404)."""
    client = openai.OpenAI(base_url="http://testserver", api_key=KEY, http_client=http, max_retries=0)
    r = client.chat.completions.create(model="any", messages=ASK, max_tokens=4)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == ["tiny-clover"]
    assert http.post("/completions", json={"prompt": "Count from 3 to 9.", "max_tokens": 3}).json()["choices"]


@pytest.mark.parametrize("body,param", [
    (None, "body"), ("string", "body"), ({"messages": None}, "messages"), ({"messages": "string"}, "messages"),
    ({"messages": [123]}, "messages.0"), ({"messages": [{}]}, "messages.0.role"),
    ({"messages": [{"role": 123}]}, "messages.0.role"),
    ({"messages": [{"role": "system", "content": 123}]}, "messages.0.content"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
])
def test_validation_errors_are_400s_in_openais_shape(http, body, param):
    """As OpenAI and llama-server answer them (before: 422)."""
    r = http.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert (err["param"] or "body").startswith(param), err


def test_n_choices(http):
    """n = 3: three choices indexed 0..2, each a whole answer with its own seed, usage summed (before: a 400)."""
    one = _chat(http, temperature=1.0, seed=5).json()
    r = _chat(http, n=3, temperature=1.0, seed=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][0]["message"] == one["choices"][0]["message"]  # the first choice is seed 5's answer
    assert body["usage"]["completion_tokens"] == sum(
        _chat(http, temperature=1.0, seed=s).json()["usage"]["completion_tokens"] for s in (5, 6, 7))
    assert body["usage"]["prompt_tokens"] == 3 * one["usage"]["prompt_tokens"]


# ---- CORS ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completions", "/v1/models"])
def test_cors_preflight_needs_no_key_and_answers_llama_servers_headers(http, path):
    """A preflight carries no credentials: 200 with the Origin reflected (before: 401 with --api-key, 405 without)."""
    r = http.options(path, headers={"Authorization": "", "Origin": "http://ui.example:3000",
                                    "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "Authorization"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://ui.example:3000"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    # in llama-server's case: its own tests (and other clients) copy the headers into a plain dict
    assert b"Access-Control-Allow-Origin" in [k for k, _ in r.headers.raw]


def test_cors_on_answers_and_the_key_still_asked(http):
    origin = {"Origin": "http://ui.example"}
    r = http.post("/v1/chat/completions", headers=origin, json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = http.post("/v1/chat/completions", headers={**origin, "Authorization": "Bearer wrong"},
                  json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
    assert "access-control-allow-origin" not in http.get("/v1/models").headers  # no Origin, no CORS headers


# ---- llama.cpp's request extensions --------------------------------------------------------------------------------
def test_gbnf_grammar(http):
    """llama-server's `grammar` (GBNF) constrains the answer (before: ignored), in chat and completions."""
    r = _chat(http, grammar='root ::= "a"{5,5}', reasoning_format="none",
              chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "aaaaa"
    r = http.post("/completions", json={"prompt": "Count from 3 to 9.", "max_tokens": 8,
                                        "grammar": 'root ::= ("x" | "y") [0-9]'})
    assert re.fullmatch(r"[xy][0-9]", r.json()["choices"][0]["text"]), r.json()


def test_invalid_gbnf_is_a_400(http):
    r = _chat(http, grammar="root ::= this is (not valid GBNF")
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text


@pytest.mark.parametrize("body", [
    {"json_schema": {"const": "42"}},
    {"response_format": {"type": "json_object", "schema": {"const": "42"}}},
])
def test_json_schema_at_the_top_level_and_inside_json_object(http, body):
    """llama-server's top-level `json_schema` and a `schema` inside json_object (before: ignored, 200)."""
    r = _chat(http, max_tokens=6, chat_template_kwargs={"enable_thinking": False}, **body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '"42"'


def test_timings_in_the_answer_and_in_the_stream(http):
    body = _chat(http).json()
    t = body["timings"]
    assert t["predicted_n"] == body["usage"]["completion_tokens"]
    assert t["prompt_n"] + t["cache_n"] == body["usage"]["prompt_tokens"]
    assert t["predicted_per_second"] > 0 and t["prompt_ms"] > 0
    with http.stream("POST", "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    last = events[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]
    # the first chunk's content is null, as llama-server's (its clients take every content delta they see as text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}


# ---- llama-server's endpoints --------------------------------------------------------------------------------------
def test_tokenize_and_detokenize_match_the_models_tokenizer(http):
    """/tokenize against the model's tokenizer.json read by the `tokenizers` library; /detokenize back."""
    tokenizers = pytest.importorskip("tokenizers")
    ref = tokenizers.Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    text = "What is the capital of France? 34 + 58 = 92"
    r = http.post("/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == ref.encode(text, add_special_tokens=False).ids
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert http.post("/tokenize", json={"text": text}).status_code == 400


def test_apply_template_is_the_templates_text(http):
    """/apply-template: the GGUF's template over the messages, as jinja2 renders the model's chat_template.jinja."""
    import jinja2

    msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    tpl = jinja2.Environment().from_string((BUNDLED / "chat_template.jinja").read_text())
    for think in (True, False):
        r = http.post("/apply-template", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": think}})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == tpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=think)


def test_props(http):
    p = http.get("/props").json()
    assert p["total_slots"] == 1 and p["model_path"].endswith(".gguf")
    assert p["default_generation_settings"]["n_ctx"] == http.app.state.clover.first.n_ctx
    assert "{%" in p["chat_template"]


def test_seed_at_start(bundled_gguf, monkeypatch):
    """serve --seed (llama-server's option): requests that give no seed take it (the same answer at temperature 1
    twice), /props reports it, and `n` choices take seed + i; on all three faces (the Plan each runs, as begun)."""
    from fastapi.testclient import TestClient

    from clover_gguf.serve import core

    seeds, begin = [], core.begin

    async def seen(request, plan, *args, **kwargs):
        seeds.append(plan.seed)
        return await begin(request, plan, *args, **kwargs)

    monkeypatch.setattr(core, "begin", seen)
    with TestClient(create_app(bundled_gguf, seed=11, runtime_kwargs={"n_threads": 1})) as http:
        assert http.get("/props").json()["default_generation_settings"]["params"]["seed"] == 11
        answers = [_chat(http, temperature=1.0, max_tokens=12).json()["choices"][0]["message"] for _ in range(2)]
        given = _chat(http, temperature=1.0, max_tokens=12, seed=11).json()["choices"][0]["message"]
        assert answers[0] == answers[1] == given
        two = _chat(http, temperature=1.0, max_tokens=12, n=2).json()["choices"]
        assert two[0]["message"] == given
        assert two[1]["message"] == _chat(http, temperature=1.0, max_tokens=12, seed=12).json()["choices"][0]["message"]
        seeds.clear()
        asked = {"model": "m", "temperature": 1.0, "messages": ASK}
        assert http.post("/v1/messages", json={**asked, "max_tokens": 4}).status_code == 200
        assert http.post("/v1/messages", json={**asked, "max_tokens": 4, "seed": 3}).status_code == 200
        asked = {"model": "m", "temperature": 1.0, "input": ASK, "max_output_tokens": 4}
        assert http.post("/v1/responses", json=asked).status_code == 200
        assert http.post("/v1/responses", json={**asked, "seed": 3}).status_code == 200
        assert seeds == [11, 3, 11, 3]


def test_reasoning_off_at_start(bundled_gguf):
    """serve --reasoning off (llama-server's option): a request that does not say does not think; one that asks
    does."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(bundled_gguf, reasoning="off", runtime_kwargs={"n_threads": 1})) as http:
        prompt = http.post("/apply-template", json={"messages": ASK}).json()["prompt"]
        asked = http.post("/apply-template", json={"messages": ASK,
                                                   "chat_template_kwargs": {"enable_thinking": True}}).json()["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n") and not asked.endswith("</think>\n\n")  # thinking left empty
    with pytest.raises(Exception, match="--reasoning"):
        create_app(bundled_gguf, reasoning="maybe")


# ---- bounded numbers (item 2) --------------------------------------------------------------------------------------
class _Bytes:
    """A byte-level vocabulary: grammar questions asked of the engine one character at a time."""

    eos_ids = (256,)
    tokens = [bytes([i]) for i in range(256)] + [grammar.CONTROL + b"<eos>"]

    @staticmethod
    def tokenize(text):
        return list(text.encode())


def _accepts(engine, schema, text: str) -> bool:
    c = engine.constraint(grammar.source(f"body: {grammar.json_value(schema)}\n", "none"))
    return all(c.accept(b) for b in text.encode()) and c.accept(256)


@pytest.fixture(scope="module")
def byte_engine():
    v = _Bytes()
    return grammar.Engine(grammar.Vocabulary(v.tokens, v.eos_ids, v.tokenize))


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "integer"}, "9999999999999998", True),
    ({"type": "integer"}, "-9999999999999998", True),
    ({"type": "integer"}, "10000000000000000", False),
    ({"type": "integer", "minimum": 0, "maximum": 10**18}, "123456789012345678", True),  # its own bound allows it
    ({"type": "integer", "minimum": 0}, "10000000000000000", False),
    ({"type": "number"}, "9999999999999999.25", True),
    ({"type": "number"}, "12345678901234567.5", False),
    ({"type": ["integer", "null"]}, "12345678901234567", False),
    ({"type": "array", "items": {"type": "integer"}}, "[1, 22, 12345678901234567]", False),
    ({"type": "array", "items": {"type": "integer"}}, "[1, 22, 1234567890123456]", True),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "number"}, {"type": "string"}]}}},
     '{"a": 99999999999999999}', False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":  1}', False),  # compact whitespace
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"const": "42"}, '"42"', True),
    (None, '{"a": [1, {"b": 12345678901234567}]}', False),  # json_object: any object, bounded at every depth
    (None, '{"a": [1, {"b": 1234567890123456.5}], "c": null}', True),
    ({}, "[12345678901234567]", False),
])
def test_numbers_under_a_grammar_are_bounded(byte_engine, schema, text, ok):
    """Integers at most 16 digits, a number's integral part too, unless the schema's own bounds allow more; the
    whitespace compact (llama.cpp's schema grammar caps integers at 16 digits)."""
    assert _accepts(byte_engine, schema, text) is ok


def test_gbnf_rule_names_do_not_clash_with_ours(byte_engine):
    body = grammar.gbnf_body('root ::= body gap\nbody ::= "x"+\ngap ::= "!"')
    c = byte_engine.constraint(grammar.source(body, "none"))
    assert all(c.accept(b) for b in b"xxx!") and c.accept(256)


@pytest.mark.parametrize("mode", ["ar", "draft-self", "auto"])
def test_constrained_answers_of_a_model_that_does_not_know_json_end(http, mode):
    """Issue 66 item 2, on the bundled model (never trained on JSON): json_schema answers at temperature 1 validate
    on 6 of 6 seeds within max_tokens 64 (40 tokens each, thinking included), and a forced `add` call ends (118 tokens
    here, greedy: its fixed text alone is 101, the bundled vocabulary spells it a character a token, so the issue's 96
    cannot be met by any grammar; at most 16 digits a value bound it by 101 + 2 * 17 and the thinking). Before: digits
    until max_tokens."""
    for seed in range(6):
        r = _chat(http, max_tokens=64, temperature=1.0, seed=seed, mode=mode,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (mode, seed, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER_SCHEMA)
    r = _chat(http, max_tokens=160, mode=mode, tools=[ADD], tool_choice="required")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", (mode, choice)
    assert r.json()["usage"]["completion_tokens"] <= 101 + 2 * 17 + 16, r.json()["usage"]
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def test_a_mask_after_a_rollback_is_of_the_new_state(byte_engine):
    """A draft token accepted (its mask kept), rolled back, and the causal token accepted in its place: the mask is
    the new state's, not the kept one of the same token count (issue 66: auto wrote "\\n" where AR writes " " after
    a rejected draft under a tool call's maxLength; tests/test_runtime_constrained's forced-token test found it)."""
    source = grammar.source(f"body: {grammar.json_value({'enum': ['ab', 'cd']})}\n", "none")
    c = byte_engine.constraint(source)
    assert c.accept(ord('"')) and c.accept(ord("a"))
    assert grammar.allowed(c.mask(), ord("b")) and not grammar.allowed(c.mask(), ord("d"))  # kept for 2 tokens
    c.rollback(1)
    assert c.accept(ord("c"))
    assert grammar.allowed(c.mask(), ord("d")) and not grammar.allowed(c.mask(), ord("b"))
    assert not c.accept(ord("b")) and c.accept(ord("d"))
