"""serve's Anthropic Messages and OpenAI Responses faces (issue 65) through the official SDKs (anthropic's Messages
client, openai's responses client), on the tool-trained tiny Clover, in ar, draft-self and auto: a forced first tool
call comes back as tool_use / function_call with the task's arguments, its result sent back (tool_result /
function_call_output) is answered from (the model cannot compute the result: it read it), streamed through the
SDKs' own stream parsers (messages.stream, responses.stream: they refuse an event out of place) and not. Also: the
event sequences themselves, count_tokens against the answer's usage, Claude Code's billing header (its second turn
reuses the first's state though the header changed), max_tokens past the context on all three APIs, the errors in
each API's shape, developer messages and the template's own refusal.
"""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from clover_gguf.serve import create_app  # noqa: E402
from clover_gguf.testing.agent import held_out_tasks, run_tool  # noqa: E402

from test_server import _Server  # noqa: E402

MODES = ("ar", "draft-self", "auto")
KEY = "test-key-65"
TIMEOUT = 600  # a request's seconds on a shared machine (a hang guard, not a timing assert)
# an add with thinking, one without, a multiply: held-out tasks the model answers right in AR (test_agent_loop)
TASKS = {t.id: t for t in held_out_tasks() if t.id in ("call-1", "call-2", "call-3")}


@pytest.fixture(scope="module")
def server(tool_gguf):
    s = _Server(create_app(tool_gguf, mode="auto", parallel=1, ctx=2048, api_key=KEY,
                           runtime_kwargs={"exact": True}))
    yield s
    s.stop()


def _claude(s) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=s.base, api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _oai(s) -> "openai.OpenAI":
    return openai.OpenAI(base_url=s.base + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _anthropic_tools(task) -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in task.tools]


def _responses_tools(task) -> list[dict]:
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": False} for t in task.tools]


def _validates(args: dict, task, name: str) -> None:
    """The call's arguments against its tool's schema (required keys present, integers where it says integer)."""
    schema = next(t["function"]["parameters"] for t in task.tools if t["function"]["name"] == name)
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    for k, v in args.items():
        assert schema["properties"][k]["type"] == "integer" and isinstance(v, int), (k, v)


# ---- Anthropic Messages ------------------------------------------------------------------------------------------
def _messages_turn(client, stream: bool, **kw):
    if stream:
        with client.messages.stream(**kw) as st:
            kinds = [ev.type for ev in st]
            msg = st.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        return msg
    return client.messages.create(**kw)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_messages_tool_loop(server, task_id, mode, stream):
    task = TASKS[task_id]
    client = _claude(server)
    (name, want), = task.calls
    kw = dict(model="clover", max_tokens=400, tools=_anthropic_tools(task),  # greedy: serve's default
              thinking={"type": "enabled", "budget_tokens": 256} if task.think else {"type": "disabled"},
              extra_body={"mode": mode})
    messages = [{"role": "user", "content": task.question[0]["content"]}]
    first = _messages_turn(client, stream, messages=messages, tool_choice={"type": "any"}, **kw)
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [(name, want)], first.content
    _validates(uses[0].input, task, name)
    if task.think:
        assert first.content[0].type == "thinking" and first.content[0].signature == ""
    # count_tokens: the prompt the answer reports (its uncached and cached tokens together)
    counted = client.messages.count_tokens(model="clover", messages=messages, tools=kw["tools"],
                                           thinking=kw["thinking"], tool_choice={"type": "any"})
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    result = run_tool(name, want)
    messages += [{"role": "assistant", "content": [b.to_dict() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]}]
    last = _messages_turn(client, stream, messages=messages, tool_choice={"type": "auto"}, **kw)
    assert last.stop_reason == "end_turn" and not [b for b in last.content if b.type == "tool_use"], last
    text = "".join(b.text for b in last.content if b.type == "text")
    assert result in text, (text, result)  # the model cannot compute it: it read the tool_result


# ---- OpenAI Responses ----------------------------------------------------------------------------------------------
def _responses_turn(client, stream: bool, **kw):
    if stream:
        with client.responses.stream(**kw) as st:
            kinds = [ev.type for ev in st]
            r = st.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        return r
    return client.responses.create(**kw)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_responses_tool_loop(server, task_id, mode, stream):
    task = TASKS[task_id]
    client = _oai(server)
    (name, want), = task.calls
    kw = dict(model="clover", max_output_tokens=400, temperature=0, tools=_responses_tools(task), store=False,
              reasoning={"effort": "medium" if task.think else "none"}, include=["reasoning.encrypted_content"],
              extra_body={"mode": mode})
    items: list = [{"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": task.question[0]["content"]}]}]
    first = _responses_turn(client, stream, input=items, tool_choice="required", **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, want)], first.output
    _validates(json.loads(calls[0].arguments), task, name)
    assert first.status == "completed" and first.usage.input_tokens > 0
    result = run_tool(name, want)
    items += [o.to_dict() for o in first.output]  # as Codex sends them back: reasoning, the call
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": result})
    last = _responses_turn(client, stream, input=items, tool_choice="auto", **kw)
    assert not [o for o in last.output if o.type == "function_call"], last.output
    assert result in last.output_text, (last.output_text, result)  # it read the function_call_output


def test_responses_text_format_json_schema_goes_through_the_grammar(server):
    """text.format json_schema (after a lookup, its call and output as Responses items): the answer is JSON of that
    schema, forced by the grammar, streamed and not."""
    task = next(t for t in held_out_tasks() if t.id == "json-1")
    user, call, result = task.messages
    c = call["tool_calls"][0]
    items = [  # a lookup's call and its output, as Responses items{"type": "message", "role": "user", "content": user["content"]},
             {"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
              "arguments": json.dumps(c["function"]["arguments"])},
             {"type": "function_call_output", "call_id": c["id"], "output": result["content"]}]
    # not the keys the question asks for (name, email, since), which the model writes unconstrained
    schema = {"type": "object", "properties": {"since": {"type": "integer"}, "city": {"type": "string"}},
              "required": ["since", "city"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "record", "schema": schema, "strict": True}}
    kw = dict(model="clover", input=items, text=fmt, max_output_tokens=200, reasoning={"effort": "none"},
              tools=_responses_tools(task), extra_body={"mode": "ar"})
    whole = _oai(server).responses.create(**kw)
    with _oai(server).responses.stream(**kw) as st:
        streamed = st.get_final_response()
    for r in (whole, streamed):
        doc = json.loads(r.output_text)
        assert list(doc) == ["since", "city"] and isinstance(doc["since"], int) and isinstance(doc["city"], str), doc
    assert whole.output_text == streamed.output_text


def test_named_tool_choice_and_stop_sequences(server):
    """tool_choice naming a tool forces that tool on both APIs (call-3 asks to multiply, and offers add too);
    Anthropic's stop_sequences cut the answer before the match, stop_reason stop_sequence."""
    task = TASKS["call-3"]
    q = task.question[0]["content"]
    msg = _claude(server).messages.create(model="clover", max_tokens=200, tools=_anthropic_tools(task),
                                          tool_choice={"type": "tool", "name": "add"},
                                          messages=[{"role": "user", "content": q}], extra_body={"mode": "ar"})
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["add"], msg.content
    r = _oai(server).responses.create(model="clover", input=q, max_output_tokens=200, tools=_responses_tools(task),
                                      tool_choice={"type": "function", "name": "add"},
                                      extra_body={"mode": "ar"})
    assert [o.name for o in r.output if o.type == "function_call"] == ["add"], r.output
    kw = dict(model="clover", max_tokens=64, messages=[{"role": "user", "content": "What is 805 + 1?"}],
              extra_body={"mode": "ar"})
    text = _claude(server).messages.create(**kw).content[0].text
    assert len(text) > 6, text
    stop = text[3:6]
    cut = _claude(server).messages.create(stop_sequences=[stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
    assert cut.content[0].text == text[:text.index(stop)].strip()


# ---- the event sequences -------------------------------------------------------------------------------------------
def _events(s, path: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed answer's events as (name, data), checking each data's type is its event's name."""
    out = []
    with httpx.stream("POST", s.base + path, json=body, headers={"x-api-key": KEY}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


def _collapsed(names: list[str]) -> list[str]:
    """Event names with runs of one name as one (the deltas' count depends on the answer)."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def test_messages_event_sequence(server):
    task = TASKS["call-2"]
    (name, want), = task.calls
    body = {"model": "clover", "max_tokens": 200, "stream": True, "tools": _anthropic_tools(task), "mode": "ar",
            "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": task.question[0]["content"]}]}
    evs = _events(server, "/v1/messages?beta=true", body)  # Claude Code's URL
    names = [n for n, _ in evs]
    assert _collapsed(names) == ["message_start", "ping", "content_block_start", "content_block_delta",
                                 "content_block_stop", "message_delta", "message_stop"], names
    start = evs[2][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == name and start["input"] == {}
    deltas = [d["delta"] for n, d in evs if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in deltas)) == want
    assert evs[0][1]["message"]["usage"]["input_tokens"] > 0
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use" and evs[-2][1]["usage"]["output_tokens"] > 0
    # with thinking: a thinking block first, closed by its signature_delta, then the call
    task = TASKS["call-1"]
    evs = _events(server, "/v1/messages", {
        **body, "tools": _anthropic_tools(task), "thinking": {"type": "enabled", "budget_tokens": 256},
        "messages": [{"role": "user", "content": task.question[0]["content"]}]})
    blocks = [(d["content_block"]["type"]) for n, d in evs if n == "content_block_start"]
    assert blocks == ["thinking", "tool_use"], blocks
    kinds = _collapsed([d["delta"]["type"] for n, d in evs if n == "content_block_delta"])
    assert kinds == ["thinking_delta", "signature_delta", "input_json_delta"], kinds


def test_responses_event_sequence(server):
    task = TASKS["call-2"]
    (name, want), = task.calls
    body = {"model": "clover", "max_output_tokens": 200, "stream": True, "tools": _responses_tools(task),
            "mode": "ar", "tool_choice": "required", "reasoning": {"effort": "none"}, "store": False,
            "input": task.question[0]["content"]}
    evs = _events(server, "/v1/responses", body)
    names = [n for n, _ in evs]
    assert _collapsed(names) == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                 "response.output_item.done", "response.completed"], names
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    args = "".join(d["delta"] for n, d in evs if n == "response.function_call_arguments.delta")
    assert json.loads(args) == want and evs[-3][1]["arguments"] == args
    done = evs[-1][1]["response"]
    assert done["status"] == "completed" and done["output"][0]["arguments"] == args
    assert done["usage"]["input_tokens"] == evs[-1][1]["response"]["usage"]["input_tokens"] > 0
    # its answer from the result: a message item with one output_text part
    call = done["output"][0]
    evs = _events(server, "/v1/responses", {**body, "tool_choice": "auto", "input": [
        {"type": "message", "role": "user", "content": task.question[0]["content"]}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": run_tool(name, want)}]})
    assert _collapsed([n for n, _ in evs]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"], [n for n, _ in evs]
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    assert run_tool(name, want) in text and evs[-1][1]["response"]["output"][0]["content"][0]["text"] == text


def test_the_block_view_streams_behind_both_apis(server):
    """clover_blocks (asked for) streams the block passes on /v1/messages and /v1/responses as events of Clover's own,
    between the API's, and the SDKs' stream parsers pass them by: the answer is the same as without them."""
    task = TASKS["call-2"]
    q = task.question[0]["content"]
    evs = _events(server, "/v1/messages", {"model": "clover", "max_tokens": 64, "stream": True, "mode": "draft-self",
                                           "clover_blocks": True, "messages": [{"role": "user", "content": q}]})
    blocks = [d["events"] for n, d in evs if n == "clover_blocks"]
    assert blocks and all(isinstance(e, list) and e for e in blocks)
    assert {"message_start", "content_block_delta", "message_stop"} <= {n for n, _ in evs}
    evs = _events(server, "/v1/responses", {"model": "clover", "max_output_tokens": 64, "stream": True,
                                            "mode": "draft-self", "clover_blocks": True, "input": q})
    assert [d for n, d in evs if n == "clover.blocks"] and evs[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    kw = dict(model="clover", max_tokens=64, messages=[{"role": "user", "content": q}])
    with _claude(server).messages.stream(**kw, extra_body={"mode": "draft-self", "clover_blocks": True}) as st:
        viewed = st.get_final_message()
    plain = _claude(server).messages.create(**kw, extra_body={"mode": "draft-self"})
    assert viewed.content[0].text == plain.content[0].text
    with _oai(server).responses.stream(model="clover", input=q, max_output_tokens=64, reasoning={"effort": "none"},
                                       extra_body={"mode": "draft-self", "clover_blocks": True}) as st:
        assert st.get_final_response().output_text == plain.content[0].text


# ---- Claude Code's habits ------------------------------------------------------------------------------------------
def test_billing_header_changes_nothing_the_second_turn_reuses(server):
    """Claude Code's first system block (x-anthropic-billing-header: ..., new in every request) never reaches the
    prompt: its second turn continues from the state its first turn left (cached tokens at least 90% of turn 1's
    prompt), and two first turns with different headers are the same prompt."""
    task = TASKS["call-2"]
    (name, want), = task.calls
    client = _claude(server)

    def system(n: int) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{n}; cc_entrypoint=cli; "
                                         f"cch={n:05x};"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]

    kw = dict(model="clover", max_tokens=200, tools=_anthropic_tools(task), thinking={"type": "disabled"},
              metadata={"user_id": "u"}, extra_body={"mode": "ar"},
              extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    messages = [{"role": "user", "content": task.question[0]["content"]}]
    first = client.messages.create(system=system(1), messages=messages, tool_choice={"type": "any"}, **kw)
    use = next(b for b in first.content if b.type == "tool_use")
    n1 = first.usage.input_tokens + first.usage.cache_read_input_tokens
    messages += [{"role": "assistant", "content": [use.to_dict()]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": run_tool(name, want)}]}]}]
    second = client.messages.create(system=system(2), messages=messages, **kw)
    assert second.usage.cache_read_input_tokens >= 0.9 * n1, (second.usage, n1)
    counts = {client.messages.count_tokens(model="clover", system=system(n), messages=messages[:1],
                                           tools=kw["tools"], thinking=kw["thinking"]).input_tokens for n in (3, 4)}
    assert counts == {n1}, (counts, n1)


@pytest.fixture(scope="module")
def small(tool_gguf):
    """A 256-token context: max_tokens past it, prompts past it."""
    s = _Server(create_app(tool_gguf, mode="ar", parallel=1, ctx=256, api_key=KEY, runtime_kwargs={"exact": True}))
    yield s
    s.stop()


def test_max_tokens_past_the_context_stops_at_the_context(small):
    """Agents send max_tokens 32000 whatever the context: taken on all three APIs, the answer runs to the context's
    end (ignore_eos keeps it going) and says so: finish_reason length, stop_reason max_tokens, status incomplete."""
    q = "What is 805 + 1?"
    chat = _oai(small).chat.completions.create(model="clover", messages=[{"role": "user", "content": q}],
                                               max_tokens=32000, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 256
    msg = _claude(small).messages.create(model="clover", max_tokens=32000, messages=[{"role": "user", "content": q}],
                                         extra_body={"ignore_eos": True})
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.output_tokens == 256
    r = _oai(small).responses.create(model="clover", input=q, max_output_tokens=32000,
                                     extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens + r.usage.output_tokens == 256
    with _claude(small).messages.stream(model="clover", max_tokens=32000, messages=[{"role": "user", "content": q}],
                                        extra_body={"ignore_eos": True}) as st:
        assert st.get_final_message().stop_reason == "max_tokens"


def test_a_prompt_past_the_context_is_refused_with_its_count(small):
    """Only a prompt that leaves no room is refused: a 400 in each API's shape, with the prompt's real token count
    and the context's size (llama-server's n_prompt_tokens, n_ctx)."""
    long = "Compute 21 + 2870. " * 40
    headers = {"x-api-key": KEY}
    r = httpx.post(small.base + "/v1/chat/completions", headers=headers, timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": long}], "max_tokens": 32000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["n_ctx"] == 256 and err["n_prompt_tokens"] > 256, r.text
    thinking = {"type": "enabled", "budget_tokens": 1024}  # as the chat request's default
    count = _claude(small).messages.count_tokens(model="clover", messages=[{"role": "user", "content": long}],
                                                 thinking=thinking)
    assert count.input_tokens == err["n_prompt_tokens"]  # the real count, not a bound
    assert f"prompt {count.input_tokens} " in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        _claude(small).messages.create(model="clover", max_tokens=32000, thinking=thinking,
                                       messages=[{"role": "user", "content": long}])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["n_prompt_tokens"] == count.input_tokens and body["error"]["n_ctx"] == 256
    with pytest.raises(openai.BadRequestError) as e:
        _oai(small).responses.create(model="clover", input=long, max_output_tokens=32000)
    assert e.value.body["n_prompt_tokens"] == count.input_tokens


def test_errors_in_each_apis_shape(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="clover", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.base + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT,
                   json={"model": "clover", "max_tokens": 8, "messages": [{"role": "user", "content": [
                       {"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(server.base + "/v1/messages", headers={"x-api-key": KEY}, json={"max_tokens": 8}, timeout=TIMEOUT)
    assert r.status_code in (400, 422) and r.json()["type"] == "error" and "messages" in r.text, r.text
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        _oai(server).responses.create(model="clover", input="hi", previous_response_id="resp_1")
    r = httpx.post(server.base + "/v1/responses", headers={"x-api-key": KEY}, timeout=TIMEOUT,
                   json={"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.0", r.text


def test_developer_and_later_system_messages_render(server):
    """developer is system; a system message after the first turn is a user turn (the template refuses it
    elsewhere): on chat completions and Responses (Codex's developer items)."""
    c = _oai(server)
    r = c.chat.completions.create(model="clover", max_tokens=8, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "system", "content": "Now answer in one word."},
        {"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    r = c.responses.create(model="clover", max_output_tokens=8, instructions="Be brief.", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        tools=[{"type": "web_search"}, {"type": "namespace", "name": "mcp"}], parallel_tool_calls=False,
        prompt_cache_key="k")
    assert r.status in ("completed", "incomplete")
    # Claude Code 2.1.197's first request: the user's words, then a system message (the agent types it offers)
    m = _claude(server).messages.create(model="clover", max_tokens=8, system="Be brief.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "system", "content": [{"type": "text", "text": "Available agent types: none."}]}])
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_the_templates_own_refusal_is_its_message(tool_gguf):
    from clover_gguf.errors import UserError
    from clover_gguf.runtime import CloverRuntime
    from clover_gguf.vocab import compile_chat_template

    with CloverRuntime(tool_gguf, n_ctx=256, n_threads=2) as rt:
        rt._template = compile_chat_template("{{ raise_exception('only one system message, first') }}")
        with pytest.raises(UserError, match="refuses these messages: only one system message, first$"):
            rt.render([{"role": "user", "content": "hi"}])


def test_models_report_the_context_length(server):
    m = httpx.get(server.base + "/v1/models", headers={"x-api-key": KEY}, timeout=TIMEOUT).json()["data"][0]
    assert m["context_length"] == m["max_model_len"] == m["meta"]["context_length"] == 2048


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """The tool model with a 32,768-token context (its config's max_position_embeddings raised; trained on 4,096),
    served at --ctx 32768: room for an agent's 17K-token prompt."""
    import shutil

    from clover_gguf.convert import convert
    from clover_gguf.testing.agent import TOOL_MODEL

    folder = tmp_path_factory.mktemp("tools32k") / "model"
    shutil.copytree(TOOL_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (folder / "config.json").write_text(json.dumps(config))
    gguf = folder.parent / "tools32k.gguf"
    convert(folder, gguf, outtype="f32", quiet=True)
    s = _Server(create_app(gguf, mode="auto", parallel=1, ctx=32768, api_key=KEY))
    yield s
    s.stop()


@pytest.mark.slow
def test_a_17k_prompt_with_max_tokens_32000_is_answered_on_every_api(long_context):
    """OpenCode's and Claude Code's max_tokens 32000 with a 17K-token prompt at --ctx 32768 (it was refused: the
    prompt and max_tokens together pass the context): answered on all three APIs, the later two continuing from the
    state the first left (the same messages)."""
    text = "The quick brown fox jumps over the lazy dog. " * 630 + "What is 805 + 1?"
    chat = _oai(long_context).chat.completions.create(model="clover", max_tokens=32000,
                                                      messages=[{"role": "user", "content": text}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > 17000
    msg = _claude(long_context).messages.create(model="clover", max_tokens=32000,
                                                thinking={"type": "enabled", "budget_tokens": 1024},
                                                messages=[{"role": "user", "content": text}])
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    r = _oai(long_context).responses.create(model="clover", input=text, max_output_tokens=32000)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens == chat.usage.prompt_tokens
