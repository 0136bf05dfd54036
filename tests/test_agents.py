"""serve for agents, end to end on the bundled tiny Clover through the official openai client (issue 49's
acceptance). The model never saw a tool or a JSON schema: the grammar does the work, in every decoding mode.

- a named tool_choice gives a call whose arguments validate against the tool's schema in ar, draft-self and auto;
  the streamed call reassembles to the non-streamed one;
- json_schema answers at temperature 1 validate on every seed in every mode;
- constrained greedy draft-self writes constrained greedy ar's text;
- tool_choice none gives no call; a history with a tool call and its result is answered, the conversation's state
  reused (cached_tokens);
- logprobs with top_logprobs 3 are sane: sorted, at most 0, the chosen token's at least every alternative's (greedy).
These need the decoders to take a Constraint and logprobs (clover_gguf.decoding, CloverRuntime.stream_pieces).
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from clover_gguf.serve import create_app  # noqa: E402

from test_server import _Server  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place, for some days",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "minLength": 1, "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "days"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {
    "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}},
                                   "required": ["text"]}}}
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 999}, "sure": {"type": "boolean"},
    "unit": {"enum": ["none", "apples", "pears"]}, "why": {"type": "string", "maxLength": 16}},
    "required": ["answer", "sure", "unit", "why"], "additionalProperties": False}
MODES = ("ar", "draft-self", "auto")
ALL_MODES = ("ar", "diffusion", "draft-self", "auto")
QUESTION = "What is the weather in Paris for 3 days?"


def valid_weather(args: dict) -> bool:
    return (set(args) <= {"location", "days", "unit"} and isinstance(args.get("location"), str)
            and 1 <= len(args["location"]) <= 24 and type(args.get("days")) is int and 1 <= args["days"] <= 7
            and args.get("unit", "celsius") in ("celsius", "fahrenheit"))


def valid_answer(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"answer", "sure", "unit", "why"}
            and type(doc["answer"]) is int and 0 <= doc["answer"] <= 999 and type(doc["sure"]) is bool
            and doc["unit"] in ("none", "apples", "pears") and isinstance(doc["why"], str) and len(doc["why"]) <= 16)


TIMEOUT = 600  # a request's seconds: this test's machines are shared, and a constrained answer is many steps


@pytest.fixture(scope="module")
def server(bundled_gguf):
    """One slot (a conversation's next turn finds its state there), exact arithmetic (ar = draft-self)."""
    s = _Server(create_app(bundled_gguf, mode="auto", parallel=1, ctx=2048, runtime_kwargs={"exact": True}))
    s.client = lambda key=None: openai.OpenAI(base_url=s.base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    yield s
    s.stop()


def ask(client, messages, mode, **kw):
    extra = {"mode": mode, **kw.pop("extra", {})}
    return client.chat.completions.create(model="clover", messages=messages, max_tokens=kw.pop("max_tokens", 160),
                                          extra_body=extra, **kw)


def calls_of(r) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("mode", MODES)
def test_a_named_tool_choice_gives_a_valid_call(server, mode):
    client = server.client(None)
    msgs = [{"role": "user", "content": QUESTION}]
    r = ask(client, msgs, mode, tools=[WEATHER, NOTE], tool_choice=named("get_weather"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert valid_weather(args), args
    assert not valid_weather({**args, "days": 8})  # the check can fail

    chunks = list(ask(client, msgs, mode, tools=[WEATHER, NOTE], tool_choice=named("get_weather"), stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            acc = calls.setdefault(d.index, {"name": "", "arguments": ""})
            acc["name"] += (d.function.name or "") if d.function else ""
            acc["arguments"] += (d.function.arguments or "") if d.function else ""
    assert list(calls.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning == (choice.message.reasoning_content or "")


def test_tool_choice_required_gives_calls_of_the_tools(server):
    r = ask(server.client(None), [{"role": "user", "content": QUESTION}], "ar", tools=[WEATHER, NOTE],
            tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name == "get_weather" and valid_weather(args)) or (
        call.function.name == "note" and isinstance(args["text"], str) and len(args["text"]) <= 40)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_json_schema_answers_at_temperature_1_validate_on_every_seed(server, mode):
    client = server.client(None)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        r = ask(client, [{"role": "user", "content": "What is 34 + 58?"}], mode, response_format=fmt,
                temperature=1.0, seed=seed, extra={"think": False}, max_tokens=120)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (seed, text)
        assert valid_answer(json.loads(text)), (seed, text)


def test_json_object_is_an_object(server):
    r = ask(server.client(None), [{"role": "user", "content": "Count from 3 to 9."}], "ar",
            response_format={"type": "json_object"}, extra={"think": False}, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an object the model keeps writing: cut at max_tokens, but still JSON so far
        assert r.choices[0].message.content.startswith("{")


def test_constrained_greedy_draft_self_writes_ar_text(server):
    client = server.client(None)
    msgs = [{"role": "user", "content": QUESTION}]
    for kw in ({"tools": [WEATHER], "tool_choice": named("get_weather")},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}):
        ar, ds = (ask(client, msgs, mode, **kw) for mode in ("ar", "draft-self"))
        assert ar.choices[0].message.content == ds.choices[0].message.content
        assert ar.choices[0].message.reasoning_content == ds.choices[0].message.reasoning_content
        assert calls_of(ar) == calls_of(ds)
        assert ds.model_extra["clover_stats"]["mode"] == "draft-self"


def test_tool_choice_none_gives_no_call(server):
    r = ask(server.client(None), [{"role": "user", "content": QUESTION}], "ar", tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_history_with_a_call_and_its_result_is_answered_from_the_kept_state(server):
    client = server.client(None)
    first = [{"role": "user", "content": QUESTION}]
    r1 = ask(client, first, "ar", tools=[WEATHER])
    args = {"location": "Paris", "days": 3}
    history = first + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C, light wind."}]
    r2 = ask(client, history, "ar", tools=[WEATHER])
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls
    # the state after the question was kept: only the call and its result were decoded
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 8
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + 20
    # and the same with a call the model made (its arguments as the server wrote them)
    r3 = ask(client, first, "ar", tools=[WEATHER], tool_choice=named("get_weather"))
    call = r3.choices[0].message.tool_calls[0]
    history = first + [
        {"role": "assistant", "content": r3.choices[0].message.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Rain."}]
    r4 = ask(client, history, "ar", tools=[WEATHER])
    assert r4.usage.prompt_tokens_details.cached_tokens >= r3.usage.prompt_tokens - 8


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_sane(server, mode):
    client = server.client(None)
    r = ask(client, [{"role": "user", "content": "Count from 3 to 9."}], mode, logprobs=True, top_logprobs=3,
            max_tokens=40)
    entries = r.choices[0].logprobs.content
    assert entries and len(entries) <= r.usage.completion_tokens
    for e in entries:
        alts = [a.logprob for a in e.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert e.logprob <= 0 and all(a <= 0 for a in alts)
        assert e.logprob >= alts[0] - 1e-4  # greedy: the chosen token is the most likely one
        assert e.bytes == list(e.token.encode("utf-8")) or "\ufffd" in e.token
    text = "".join(e.token for e in entries)
    assert r.choices[0].message.content.replace(" ", "") in text.replace(" ", "")

    c = client.completions.create(model="clover", prompt="<|im_start|>user\nCount from 3 to 9.<|im_end|>\n"
                                                         "<|im_start|>assistant\n", max_tokens=20, logprobs=2,
                                  extra_body={"mode": mode})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)


def test_forced_tokens_false_decodes_them_by_passes(server):
    """The request's forced_tokens false (bench/agent.py's switch): the grammar's forced tokens take passes like any
    other; the text is the same, the passes are more by the tokens forced."""
    client = server.client(None)
    msgs = [{"role": "user", "content": QUESTION}]
    on, off = (ask(client, msgs, "ar", tools=[WEATHER], tool_choice=named("get_weather"), extra={"forced_tokens": f})
               for f in (True, False))
    assert calls_of(on) == calls_of(off) and on.choices[0].message.content == off.choices[0].message.content
    s_on, s_off = on.model_extra["clover_stats"], off.model_extra["clover_stats"]
    assert s_on["forced_tokens"] > 0 and s_off["forced_tokens"] == 0
    assert s_on["generated_tokens"] == s_off["generated_tokens"]
    assert s_off["decode_passes"] - s_on["decode_passes"] == s_on["forced_tokens"]
