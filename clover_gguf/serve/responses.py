"""The OpenAI Responses face of `serve` (POST /v1/responses): Codex CLI's API, and the Agents SDK's default model.

A request becomes the chat request the chat face takes (schema's ChatRequest, then plan_from: one Plan for all three
APIs, clover_gguf.serve.core): `instructions` is the first system message; `input` as text is one user message, as
items: messages (input_text / output_text parts; `developer` is `system`), function_call items (the assistant's
tool calls, consecutive ones one message), function_call_output items (tool messages); reasoning items are dropped
(the template renders no earlier thinking). Function tools become chat tools; tools of other types (namespace,
web_search, local_shell, ...) are skipped and named in the log; tool_choice, parallel_tool_calls,
max_output_tokens, `reasoning` (effort none: thinking off) and `text.format` (json_schema / json_object, through
the grammar) map to their chat fields. The server keeps no responses: `store` is accepted and nothing is stored,
`previous_response_id` and `conversation` are a 400 (send the whole conversation in `input`, as Codex does with
store false). `include`, `prompt_cache_key` (the slots' prefix reuse needs no key), metadata, user, truncation and
service_tier are accepted and ignored.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any, AsyncIterator, Union

import clover_gguf.serve.core as core
from clover_gguf.serve.schema import APIError

PATH = "/v1/responses"


@functools.cache
def _models_responses():
    from pydantic import BaseModel, ConfigDict, Field

    class ResponsesRequest(BaseModel):
        """Responses' fields; unknown ones are ignored, Clover's (CLOVER_FIELDS) kept for the chat request."""
        model_config = ConfigDict(extra="allow", allow_inf_nan=False)
        model: str | None = None
        input: Union[str, list[dict[str, Any]]]
        instructions: str | None = None
        tools: list[dict[str, Any]] | None = None
        tool_choice: Union[str, dict[str, Any], None] = None
        parallel_tool_calls: bool | None = None
        max_output_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = None
        reasoning: dict[str, Any] | None = None
        text: dict[str, Any] | None = None
        stream: bool = False
        store: bool | None = None
        previous_response_id: str | None = None
        conversation: Union[str, dict[str, Any], None] = None

    return ResponsesRequest


def _part_text(content: Any, where: str) -> str:
    """A message's content (text, or input_text / output_text / text parts) -> its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be text or a list of parts", param=where)
    out = []
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise APIError(400, f"only text parts are supported, not {kind!r}", param=f"{where}.{i}")
        out.append(str(p.get("text") or ""))
    return "".join(out)


def chat_messages(req: Any) -> list[dict]:
    """instructions and input -> OpenAI chat messages (tool calls with their arguments as objects)."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
            out.append({"role": role, "content": _part_text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            raw = item.get("arguments") or "{}"
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError as e:
                raise APIError(400, f"function_call arguments are not JSON: {e}", param=f"{where}.arguments") from None
            if not isinstance(args, dict) or not isinstance(item.get("name"), str):
                raise APIError(400, "a function_call needs a name and arguments that are a JSON object", param=where)
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": item["name"], "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # its text and its calls are one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": _part_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier turns' thinking: the template renders none (Qwen3.5's drops it)
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported", param=f"{where}.type")
    return out


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """Responses' function tools -> chat tools, and the names of the others (skipped)."""
    out, skipped = [], []
    for t in tools or []:
        if t.get("type") != "function":
            skipped.append(str(t.get("name") or t.get("type")))
            continue
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                     "parameters": t.get("parameters") or {}}})
    return (out or None), skipped


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    raise APIError(400, "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format -> the chat request's response_format."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


def to_plan(req: Any, default_mode: str, seed: int | None = None) -> Any:
    """A ResponsesRequest -> the Plan (through the chat request every face builds); seed: serve's --seed."""
    if req.previous_response_id is not None or req.conversation is not None:
        which = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise APIError(400, f"{which} is not supported: this server keeps no responses (store is ignored); send the "
                       "whole conversation in input", param=which)
    tools, skipped = chat_tools(req.tools)
    if skipped:
        core.log.info("/v1/responses: tools this server does not run skipped: %s", ", ".join(skipped))
    choice = chat_tool_choice(req.tool_choice)
    effort = (req.reasoning or {}).get("effort")
    body = {"messages": chat_messages(req), "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "stream": req.stream, "tools": tools, "tool_choice": choice if tools else None,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text),
            "think": effort != "none"}
    if not body["messages"]:
        raise APIError(400, "input holds no message", param="input")
    return core.chat_plan(body, req.model_extra, default_mode, seed=seed)


# ---- the answer ------------------------------------------------------------------------------------------------
def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {})
                                     .get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _ids() -> str:
    return uuid.uuid4().hex[:24]


def reasoning_item(iid: str, text: str, done: bool) -> dict:
    return {"type": "reasoning", "id": iid, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress"}


def message_item(iid: str, text: str | None, done: bool) -> dict:
    return {"type": "message", "id": iid, "role": "assistant", "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []}


def call_item(iid: str, call: Any, done: bool) -> dict:
    return {"type": "function_call", "id": iid, "call_id": call.id, "name": call.name,
            "arguments": "".join(call.fragments) if done else "", "status": "completed" if done else "in_progress"}


class Shell:
    """The response object around the output: what the request asked, the status, the usage."""

    def __init__(self, req: Any, model: str):
        self.id, self.created, self.req, self.model = "resp_" + _ids(), int(time.time()), req, model

    def body(self, output: list, status: str, usage: dict | None = None, stats: dict | None = None) -> dict:
        r = self.req
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "background": False, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
               "previous_response_id": None, "reasoning": r.reasoning or {"effort": None, "summary": None},
               "store": False, "temperature": r.temperature, "text": r.text or {"format": {"type": "text"}},
               "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": r.top_p,
               "truncation": "disabled", "usage": _usage(usage) if usage else None, "metadata": {}}
        if stats is not None:
            out["clover_stats"] = stats
        return out


def output_of(a: core.Answer) -> list[dict]:
    out = []
    if a.reasoning:
        out.append(reasoning_item("rs_" + _ids(), a.reasoning, True))
    if a.content or not a.calls:
        out.append(message_item("msg_" + _ids(), a.content, True))
    out += [call_item("fc_" + _ids(), c, True) for c in a.calls]
    return out


async def stream(job: Any, state: Any, shell: Shell) -> AsyncIterator[str]:
    """The Responses event stream: response.created, response.in_progress, then each output item (reasoning with
    reasoning_text deltas, the message with its output_text part, each function_call with its arguments in
    fragments) as output_item.added ... output_item.done, then response.completed (response.incomplete when the
    answer hit max_output_tokens or the context) with the usage; an error is response.failed."""
    seq = 0
    output: list[dict] = []
    item: dict | None = None  # the open item, and its text so far
    text = ""

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return core.sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    def close() -> list[str]:
        nonlocal item, text
        if item is None:
            return []
        i, out = len(output), []
        if item["type"] == "reasoning":
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text))
            done = reasoning_item(item["id"], text, True)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text, logprobs=[]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part))
            done = message_item(item["id"], text, True)
        out.append(event("response.output_item.done", output_index=i, item=done))
        output.append(done)
        item, text = None, ""
        return out

    def open_item(kind: str) -> list[str]:
        nonlocal item
        out = close()
        i = len(output)
        if kind == "reasoning":
            item = reasoning_item("rs_" + _ids(), "", False)
            out.append(event("response.output_item.added", output_index=i, item=item))
        else:
            item = message_item("msg_" + _ids(), "", False)
            out.append(event("response.output_item.added", output_index=i, item=item))
            out.append(event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return out

    yield event("response.created", response=shell.body([], "in_progress"))
    yield event("response.in_progress", response=shell.body([], "in_progress"))
    async for ev in core.events(job, state):
        if ev[0] == "delta":
            for kind, piece in (("reasoning", ev[1]), ("message", ev[2])):
                if not piece:
                    continue
                if item is None or item["type"] != kind:
                    for s in open_item(kind):
                        yield s
                text += piece
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                yield event(name, item_id=item["id"], output_index=len(output), content_index=0, delta=piece,
                            **extra)
        elif ev[0] == "call":
            for s in close():
                yield s
            call, i, iid = ev[1], len(output), "fc_" + _ids()
            yield event("response.output_item.added", output_index=i, item=call_item(iid, call, False))
            for fragment in call.fragments:
                yield event("response.function_call_arguments.delta", item_id=iid, output_index=i, delta=fragment)
            done = call_item(iid, call, True)
            yield event("response.function_call_arguments.done", item_id=iid, output_index=i, name=call.name,
                        arguments=done["arguments"])
            yield event("response.output_item.done", output_index=i, item=done)
            output.append(done)
        elif ev[0] == "done":
            _, finish, stats, usage = ev
            for s in close():
                yield s
            status = "incomplete" if finish == "length" else "completed"
            yield event(f"response.{status}", response=shell.body(output, status, usage, stats))
        elif ev[0] == "blocks":  # the block view (clover_blocks, asked for): an event of Clover's own
            yield event("clover.blocks", events=ev[1])
        elif ev[0] == "error":
            failed = shell.body(output, "failed")
            failed["error"] = {"code": "server_error" if ev[1] >= 500 else "invalid_request", "message": ev[2]}
            yield event("response.failed", response=failed)


async def responses(request: Any, req: Any) -> Any:
    from starlette.responses import JSONResponse

    state = core.state_of(request)
    plan = to_plan(req, state.default_mode, seed=state.default_seed)
    await core.prepared(request, plan)
    job, _, watch = await core.begin(request, plan)
    shell = Shell(req, state.name)
    if req.stream:
        return core.streaming_response(stream(job, state, shell), job)
    a = await core.collect(job, watch)
    body = shell.body(output_of(a), "incomplete" if a.finish == "length" else "completed", a.usage, a.stats)
    return JSONResponse(body, headers={"X-Clover-Stats": json.dumps(a.stats, separators=(",", ":"))})


def add_routes(app: Any) -> None:
    from starlette.requests import Request

    ResponsesRequest = _models_responses()

    async def create(req, request):
        return await responses(request, req)

    create.__annotations__ = {"req": ResponsesRequest, "request": Request}  # FastAPI reads the body's model here
    app.add_api_route(PATH, create, methods=["POST"])
