"""The OpenAI side of `serve`: the request bodies it takes (pydantic models), its errors in OpenAI's shape, and a
validated request turned into the Plan a worker runs."""

from __future__ import annotations

import functools
from typing import Any, Literal, Union

from clover_gguf.decoding import ACCEPT_MODES, MODES
from clover_gguf.serve.slots import Plan

MAX_STOP = 16


@functools.cache
def _models():
    """Pydantic request models (built lazily so importing this module does not need the serve extra)."""
    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="ignore")
        type: str
        text: str | None = None

    class Message(BaseModel):
        model_config = ConfigDict(extra="ignore")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: Union[str, list[TextPart], None] = None

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
        logprobs: Any = None
        presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        repetition_penalty: float | None = Field(None, gt=0.0)
        mode: Literal[MODES] | None = None
        block_size: int | None = Field(None, ge=1, le=256)
        threshold: float | None = Field(None, ge=0.0, le=1.0)
        accept: Literal[ACCEPT_MODES] | None = None
        clover_blocks: bool = False  # the block view: each pass's state in the stream (docs/serve.md)

    class ChatRequest(Common):
        messages: list[Message] = Field(..., min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        think: bool | None = None
        chat_template_kwargs: dict[str, Any] | None = None
        reasoning_effort: str | None = None

    class CompletionRequest(Common):
        prompt: Union[str, list[str]]
        echo: bool = False
        suffix: str | None = None

    return ChatRequest, CompletionRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def plan_from(req: Any, chat: bool, default_mode: str) -> Plan:
    """A validated request model -> the Plan a worker runs; APIError for what the server does not support."""
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
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
             controls=controls, max_tokens=req.max_tokens, stream=bool(req.stream), blocks=req.clover_blocks)
    if p.blocks and not p.stream:
        raise APIError(400, "clover_blocks needs stream: true (the passes come as events of the stream)",
                       param="clover_blocks")
    if chat:
        msgs = []
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                if any(part.type != "text" for part in m.content):
                    raise APIError(400, "only text content parts are supported", param=f"messages.{i}.content")
                text = "".join(part.text or "" for part in m.content)
            else:
                text = m.content or ""
            msgs.append({"role": m.role, "content": text})
        p.messages = msgs
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
    return p
