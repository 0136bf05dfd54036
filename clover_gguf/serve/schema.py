"""The OpenAI side of `serve`: the request bodies it takes (pydantic models), its errors in OpenAI's shape, and a
validated request turned into the Plan a worker runs."""

from __future__ import annotations

import functools
import json
from typing import Any, Literal, Union

from clover_gguf import grammar
from clover_gguf.decoding import ACCEPT_MODES, MODES
import clover_gguf.serve.tools as tools
from clover_gguf.serve.slots import Plan

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


@functools.cache
def _models():
    """Pydantic request models (built lazily so importing this module does not need the serve extra)."""
    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="ignore")
        type: str
        text: str | None = None

    class FunctionCall(BaseModel):
        model_config = ConfigDict(extra="ignore")
        name: str
        arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI's JSON text; an object is taken too

    class ToolCall(BaseModel):
        model_config = ConfigDict(extra="ignore")
        id: str | None = None
        type: str = "function"
        function: FunctionCall

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[TextPart], None] = None
        tool_calls: list[ToolCall] | None = None  # assistant
        tool_call_id: str | None = None  # tool

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="ignore")
        include_usage: bool = False

    class Common(BaseModel):
        """Fields both endpoints take; unknown fields are ignored. `mode` ... `threshold` are Clover extras.
        NaN and infinities are refused (Python's JSON reader accepts them)."""

        model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
        model: str | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        max_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        top_k: int | None = Field(None, ge=0)
        seed: int | None = None
        stop: Union[str, list[str], None] = None
        n: int = Field(1, ge=1)
        presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        repetition_penalty: float | None = Field(None, gt=0.0)
        mode: Literal[MODES] | None = None
        block_size: int | None = Field(None, ge=1, le=256)
        threshold: float | None = Field(None, ge=0.0, le=1.0)
        accept: Literal[ACCEPT_MODES] | None = None
        clover_blocks: bool = False  # the block view: each pass's state in the stream (docs/serve.md)
        ignore_eos: bool = False  # llama-server's: the end tokens never chosen, the answer runs to max_tokens
        forced_tokens: bool = True  # false: tokens a grammar forces take passes like any other (bench/agent.py)

    class ChatRequest(Common):
        messages: list[Message] = Field(..., min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        think: bool | None = None
        chat_template_kwargs: dict[str, Any] | None = None
        reasoning_effort: str | None = None
        tools: list[dict[str, Any]] | None = None
        tool_choice: Union[str, dict[str, Any], None] = None
        parallel_tool_calls: bool | None = None
        response_format: dict[str, Any] | None = None
        logprobs: bool | None = None
        top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    class CompletionRequest(Common):
        prompt: Union[str, list[str]]
        echo: bool = False
        suffix: str | None = None
        logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI: 0..5; up to 20 taken

    return ChatRequest, CompletionRequest


class APIError(Exception):
    """A refusal: the HTTP status, the message, OpenAI's type, param and code; `extra`: more fields of the error
    object (a prompt past the context: n_prompt_tokens and n_ctx, as llama-server's)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.extra = extra


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None,
               extra: dict | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **(extra or {})}}


# ---- OpenAI's response shapes --------------------------------------------------------------------------------------
def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's `logprobs` (and a chunk's): the tokens' entries (serve.slots.logprob_entries)."""
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """A completions choice's `logprobs` (the legacy shape): tokens, their logprobs, each token's alternatives as
    {token: logprob}, and where each token's text starts in the answer, from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def tool_call_deltas(call: Any) -> list[dict]:
    """A call (serve.tools.Call) as streamed `delta.tool_calls` items: its index, id, type and name with empty
    arguments, then its arguments in fragments (one per parameter) that join to the non-streamed `arguments`."""
    out = [{"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}]
    out += [{"index": call.index, "function": {"arguments": f}} for f in call.fragments]
    return out


def plan_from(req: Any, chat: bool, default_mode: str) -> Plan:
    """A validated request model -> the Plan a worker runs; APIError for what the server does not support."""
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop strings", param="stop")
    for i, text in enumerate(stop):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): no output can ever contain it
            raise APIError(400, f"stop string {i} is not valid UTF-8 text (character {e.start} cannot be encoded)",
                           param="stop") from None
    controls = {k: v for k, v in (("presence_penalty", req.presence_penalty),
                                  ("frequency_penalty", req.frequency_penalty),
                                  ("repetition_penalty", req.repetition_penalty)) if v is not None}
    p = Plan(mode=req.mode or default_mode, block_size=req.block_size, threshold=req.threshold,
             accept=req.accept or "exact", temp=req.temperature or 0.0,
             top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed, stop=stop,
             controls=controls, max_tokens=req.max_tokens, stream=bool(req.stream), blocks=req.clover_blocks,
             ignore_eos=req.ignore_eos, forced=req.forced_tokens)
    if p.blocks and not p.stream:
        raise APIError(400, "clover_blocks needs stream: true (the passes come as events of the stream)",
                       param="clover_blocks")
    _check_sampling(p)
    if chat:
        p.messages = [_message(i, m) for i, m in enumerate(req.messages)]
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        p.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            p.tools = tools.read_tools(req.tools)
            p.tool_mode, p.tool_name = tools.read_tool_choice(req.tool_choice, p.tools)
        except tools.ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        p.parallel = req.parallel_tool_calls is not False
        p.template_tools = [t.raw for t in p.tools] if p.tool_mode != "none" else None
        p.grammar_body = _grammar_body(req.response_format, p)
        if p.ignore_eos and p.grammar_body is not None:  # a finished grammar allows only the end tokens
            raise APIError(400, "ignore_eos cannot be combined with constrained output (response_format json, "
                           "tool_choice required or a named function): the answer must end where its grammar does",
                           param="ignore_eos")
        if req.max_completion_tokens is not None:
            p.max_tokens = req.max_completion_tokens
        think = True
        if req.reasoning_effort is not None and req.reasoning_effort.lower() == "none":
            think = False
        kw = req.chat_template_kwargs or {}
        if "enable_thinking" in kw:
            think = bool(kw["enable_thinking"])
        if req.think is not None:
            think = req.think
        p.think = think
    else:
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "give exactly one prompt", param="prompt")
        p.prompt = prompts[0]
        p.logprobs = req.logprobs
    return p


def _message(i: int, m: Any) -> dict[str, Any]:
    """A request message -> the dict the chat template renders: text content; an assistant's tool calls with their
    arguments as objects (the template writes each argument); a tool message's tool_call_id."""
    if isinstance(m.content, list):
        if any(part.type != "text" for part in m.content):
            raise APIError(400, "only text content parts are supported", param=f"messages.{i}.content")
        text = "".join(part.text or "" for part in m.content)
    else:
        text = m.content or ""
    out: dict[str, Any] = {"role": m.role, "content": text}
    if m.role == "assistant" and m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            where = f"messages.{i}.tool_calls.{j}.function.arguments"
            args = c.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as e:
                    raise APIError(400, f"tool call arguments are not JSON: {e}", param=where) from None
            if not isinstance(args, dict):
                raise APIError(400, "tool call arguments must be a JSON object", param=where)
            try:
                json.dumps(args, ensure_ascii=False).encode("utf-8")
                c.function.name.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "tool call text is not valid UTF-8", param=where) from None
            calls.append({"id": c.id or f"call_{i}_{j}", "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    return out


def _grammar_body(response_format: dict | None, p: Plan) -> str | None:
    """The Lark rules of the answer's `body` the request forces (clover_gguf.grammar), or None: tool_choice required
    or named: calls; response_format json_object / json_schema: JSON (or, with tools on auto, JSON or calls)."""
    if p.tool_mode in ("required", "named"):
        return tools.calls_rules(p.tools, p.tool_name, p.parallel)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        json_rule = grammar.json_value(None)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        json_rule = grammar.json_value(schema)
    else:
        raise APIError(400, f"response_format type {kind!r}: text, json_object or json_schema",
                       param="response_format")
    if p.tool_mode == "auto" and p.tools:
        calls = tools.calls_rules(p.tools, None, p.parallel, rule="calls")
        return f"body: json_body | calls\njson_body: {json_rule}\n{calls}"
    return f"body: {json_rule}\n"


def _check_sampling(p: Plan) -> None:
    """The one check of sampling values (runtime.check_sampling, as the CLI's): what the samplers cannot take (a
    temperature of 1e-320, a top_k past int32) is a 422 on its field, before the request takes a slot."""
    from dataclasses import replace

    from clover_gguf.errors import SettingError
    from clover_gguf.metadata import Controls
    from clover_gguf.runtime import check_sampling

    try:
        check_sampling(p.temp, p.top_p, p.top_k, p.threshold, replace(Controls(), **p.controls))
    except SettingError as e:
        raise APIError(422, str(e), param=e.name) from None
