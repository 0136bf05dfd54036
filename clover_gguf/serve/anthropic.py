"""The Anthropic Messages face of `serve` (POST /v1/messages, /v1/messages/count_tokens): Claude Code's API.

A request becomes the chat request the OpenAI face takes (schema's ChatRequest, then plan_from: one Plan for all
three APIs, clover_gguf.serve.core): `system` (text or blocks) is the first system message, without any block that
starts with `x-anthropic-billing-header:` (Claude Code's, different in every request: kept, it would change the
prompt's first tokens and no turn could reuse the last one's state); text, tool_use, tool_result and thinking blocks
become messages, tool calls and tool messages; tools with `input_schema` become function tools; tool_choice auto /
any / tool / none becomes auto / required / named / none; `thinking` switches the template's thinking (off unless
enabled, as Anthropic's API). The answer comes back as a Message (thinking, text and tool_use blocks) or as
Anthropic's event stream. Fields it does not use (cache_control, metadata, context_management, output_config,
service_tier, ...) and the anthropic-version / anthropic-beta headers are accepted and ignored.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any, AsyncIterator, Union

import clover_gguf.serve.core as core
from clover_gguf.serve.schema import APIError

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
BILLING_HEADER = "x-anthropic-billing-header:"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def owns(path: str) -> bool:
    return path in PATHS


def error_body(status: int, message: str, extra: dict | None = None) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}} (its type from the status)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message,
                                       **(extra or {})}}


@functools.cache
def _models_anthropic():
    from pydantic import BaseModel, ConfigDict, Field

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: str
        content: Union[str, list[dict[str, Any]]]

    class MessagesRequest(BaseModel):
        """Anthropic's fields; unknown ones are ignored, Clover's (CLOVER_FIELDS) kept for the chat request."""
        model_config = ConfigDict(extra="allow", allow_inf_nan=False)
        model: str | None = None
        messages: list[Message] = Field(..., min_length=1)
        system: Union[str, list[dict[str, Any]], None] = None
        max_tokens: int | None = Field(None, ge=1)
        stop_sequences: list[str] | None = None
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = None
        top_k: int | None = Field(None, ge=0)
        stream: bool = False
        tools: list[dict[str, Any]] | None = None
        tool_choice: dict[str, Any] | None = None
        thinking: dict[str, Any] | None = None

    return MessagesRequest


def _text(blocks: Any, where: str) -> str:
    """Text blocks (or a string) -> their text; another kind of block is a 400 naming where."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks or []):
        if b.get("type") != "text":
            raise APIError(400, f"only text blocks are supported here, not {b.get('type')!r}", param=f"{where}.{i}")
        parts.append(str(b.get("text") or ""))
    return "".join(parts)


def system_text(system: Any) -> str:
    """The system prompt's text, without Claude Code's billing-header block (a new value every request)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return "" if system.lstrip().startswith(BILLING_HEADER) else system
    kept = [b for b in system if not (b.get("type") == "text" and str(b.get("text") or "").lstrip()
                                      .startswith(BILLING_HEADER))]
    return "\n\n".join(t for t in (_text([b], "system") for b in kept) if t)


def chat_messages(req: Any) -> list[dict]:
    """Anthropic's system and messages -> OpenAI chat messages (tool calls with their arguments as objects)."""
    out: list[dict] = []
    system = system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "system":  # not Anthropic's, but sent by some clients: as on the other APIs (normalize_roles)
            out.append({"role": "system", "content": _text(m.content, where)})
            continue
        if m.role not in ("user", "assistant"):
            raise APIError(400, f"messages.{i}.role must be user or assistant", param=f"messages.{i}.role")
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        text, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type")
            if kind == "text":
                text.append(str(b.get("text") or ""))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier turns' thinking: the template renders none (Qwen3.5's drops it)
            elif kind == "tool_use" and m.role == "assistant":
                args = b.get("input")
                if not isinstance(args, dict) or not isinstance(b.get("name"), str):
                    raise APIError(400, "a tool_use block needs a name and an input object", param=f"{where}.{j}")
                calls.append({"id": str(b.get("id") or f"toolu_{i}_{j}"), "type": "function",
                              "function": {"name": b["name"], "arguments": args}})
            elif kind == "tool_result" and m.role == "user":
                result = _text(b.get("content") or "", f"{where}.{j}.content")
                if b.get("is_error") and not result:
                    result = "error"
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""), "content": result})
            else:
                raise APIError(400, f"a {m.role} message cannot hold a {kind!r} block here", param=f"{where}.{j}")
        if m.role == "user":
            if text or not any(b.get("type") == "tool_result" for b in blocks):
                out.append({"role": "user", "content": "".join(text)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """Anthropic's tools -> OpenAI's function tools, and the names of those skipped (server tools such as
    web_search or bash, which this server does not run)."""
    out, skipped = [], []
    for i, t in enumerate(tools or []):
        if "input_schema" not in t or t.get("type") not in (None, "custom"):
            skipped.append(str(t.get("name") or t.get("type")))
            continue
        out.append({"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                     "parameters": t.get("input_schema") or {}}})
    return (out or None), skipped


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice -> (OpenAI's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise APIError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")


def to_plan(req: Any, default_mode: str, log: Any = None, seed: int | None = None) -> Any:
    """A MessagesRequest -> the Plan (through the chat request every face builds); seed: serve's --seed."""
    tools, skipped = chat_tools(req.tools)
    if skipped and log is not None:
        log.info("/v1/messages: tools this server does not run skipped: %s", ", ".join(skipped))
    choice, parallel = chat_tool_choice(req.tool_choice)
    if tools is None and choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice names a tool, but the request has no tools", param="tool_choice")
    think = bool(req.thinking) and req.thinking.get("type") in ("enabled", "adaptive")
    body = {"messages": chat_messages(req), "max_tokens": req.max_tokens, "stop": req.stop_sequences,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream,
            "tools": tools, "tool_choice": choice if tools else None, "parallel_tool_calls": parallel,
            "think": think}
    return core.chat_plan(body, req.model_extra, default_mode, seed=seed)


# ---- the answer ------------------------------------------------------------------------------------------------
def _usage(usage: dict, output_tokens: int | None = None) -> dict:
    """OpenAI's usage -> Anthropic's: input_tokens are the prompt's tokens not read from the cache (the slot's kept
    state), cache_read_input_tokens those that were; together the prompt's count (count_tokens)."""
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": usage["completion_tokens"] if output_tokens is None else output_tokens}


def stop_of(finish: str, stats: dict) -> tuple[str, str | None]:
    if stats.get("stop_string") is not None:
        return "stop_sequence", stats["stop_string"]
    return STOP_REASONS.get(finish, "end_turn"), None


def tool_use(call: Any) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message_body(rid: str, model: str, a: core.Answer) -> dict:
    content: list[dict] = []
    if a.reasoning:
        content.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
    if a.content or not a.calls:
        content.append({"type": "text", "text": a.content})
    content += [tool_use(c) for c in a.calls]
    reason, seq = stop_of(a.finish, a.stats)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(a.usage), "clover_stats": a.stats}


async def stream(job: Any, state: Any, rid: str, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    """Anthropic's event stream: message_start (with the prompt's usage), ping, then each content block (thinking
    with its signature_delta, text, tool_use with its input in input_json_delta fragments) as
    content_block_start / _delta / _stop, message_delta (stop_reason, usage), message_stop; an error is an `error`
    event."""
    start = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield core.sse({"type": "message_start", "message": start}, "message_start")
    yield core.sse({"type": "ping"}, "ping")
    index, open_kind = -1, None

    def close() -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":  # the signature this server gives (none), as the SDKs and Claude Code expect
            out.append(core.sse({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta"))
        if open_kind is not None:
            out.append(core.sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        open_kind = None
        return out

    def open_block(kind: str, block: dict) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        return out + [core.sse({"type": "content_block_start", "index": index, "content_block": block},
                               "content_block_start")]

    def delta(d: dict) -> str:
        return core.sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    async for ev in core.events(job, state):
        if ev[0] == "delta":
            if ev[1]:
                if open_kind != "thinking":
                    for s in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield s
                yield delta({"type": "thinking_delta", "thinking": ev[1]})
            if ev[2]:
                if open_kind != "text":
                    for s in open_block("text", {"type": "text", "text": ""}):
                        yield s
                yield delta({"type": "text_delta", "text": ev[2]})
        elif ev[0] == "call":
            call = ev[1]
            for s in open_block("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}):
                yield s
            for fragment in call.fragments:
                yield delta({"type": "input_json_delta", "partial_json": fragment})
        elif ev[0] == "done":
            _, finish, stats, usage = ev
            for s in close():
                yield s
            reason, seq = stop_of(finish, stats)
            yield core.sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": _usage(usage), "clover_stats": stats}, "message_delta")
            yield core.sse({"type": "message_stop"}, "message_stop")
        elif ev[0] == "blocks":  # the block view (clover_blocks, asked for): an event of Clover's own
            yield core.sse({"type": "clover_blocks", "events": ev[1]}, "clover_blocks")
        elif ev[0] == "error":
            yield core.sse(error_body(ev[1], ev[2]), "error")


async def messages(request: Any, req: Any) -> Any:
    from starlette.responses import JSONResponse

    state = core.state_of(request)
    plan = to_plan(req, state.default_mode, core.log, seed=state.default_seed)
    await core.prepared(request, plan)
    job, n_prompt, watch = await core.begin(request, plan)
    rid = "msg_" + uuid.uuid4().hex[:24]
    if req.stream:
        return core.streaming_response(stream(job, state, rid, state.name, n_prompt), job)
    a = await core.collect(job, watch)
    return JSONResponse(message_body(rid, state.name, a),
                        headers={"X-Clover-Stats": json.dumps(a.stats, separators=(",", ":"))})


async def count_tokens(request: Any, req: Any) -> dict:
    """{"input_tokens": N}: the prompt's tokens, as an answer to the same request reports them (input_tokens +
    cache_read_input_tokens)."""
    import asyncio

    state = core.state_of(request)
    plan = to_plan(req, state.default_mode, seed=state.default_seed)
    await core.prepared(request, plan)
    return {"input_tokens": await asyncio.to_thread(core.count_prompt, state.first, plan)}


def add_routes(app: Any) -> None:
    from starlette.requests import Request

    MessagesRequest = _models_anthropic()

    async def create(req, request):
        return await messages(request, req)

    async def count(req, request):
        return await count_tokens(request, req)

    for route in (create, count):  # FastAPI reads the body's model from the annotations
        route.__annotations__ = {"req": MessagesRequest, "request": Request}
    app.add_api_route("/v1/messages", create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count, methods=["POST"])
