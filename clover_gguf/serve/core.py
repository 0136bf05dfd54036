"""The one core behind serve's three APIs (OpenAI chat/completions, Anthropic Messages, OpenAI Responses).

Each API (a "face": clover_gguf.serve.app for OpenAI's chat and completions, serve.anthropic, serve.responses) turns
its request into one Plan (clover_gguf.serve.slots: messages, tools, constraint, sampling, stop) and its answer from
one event stream (Job.events: delta / call / blocks / done / error). What they share lives here: the roles every
template can render (normalize_roles), the checks before a slot is taken (precheck), waiting for a slot and the
request's start (begin), the whole answer (collect) or its events as they come (events), the client's disconnect
and the server's shutdown. Refusals are APIError; each face writes them in its own error shape (app.py picks the
shape by the request's path).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from clover_gguf import grammar
from clover_gguf.errors import UserError
import clover_gguf.serve.tools as tools
from clover_gguf.serve.schema import APIError, _models, plan_from
from clover_gguf.serve.slots import ClientGone, Job, Plan, Pool, served_key

log = logging.getLogger("clover_gguf.serve")

POLL_S = 0.25  # how often a waiting request checks whether its client is still there
# on SIGINT or SIGTERM uvicorn gives open requests GRACE_S to finish, then cancels them (a plain-text 500 after a
# CancelledError traceback each): waiting requests are refused at once, running ones stopped STOP_S into it, each
# answered in the API's own error form (ServerState.close)
GRACE_S, STOP_S = 5.0, 4.0
# a prompt whose least possible token count is past the context is tokenized for its real count (the refusal names
# it) when its text is at most this long; a longer one (100,000 messages) is refused with the bound, not tokenized
COUNT_BYTES = 1 << 20


@dataclass
class ServerState:
    """What the routes share: the slot pool and the settings the server was started with."""

    pool: Pool
    name: str  # the model id the API reports
    default_mode: str
    created: int
    first: Any  # one runtime, for /v1/models' metadata
    default_think: bool = True  # --reasoning: chat requests that do not say think (on, auto) or not (off)
    default_seed: int | None = None  # --seed: the seed of requests that give none (None: a random one each)
    refusing: bool = False  # shutting down: no request starts or waits for a slot any more
    stopping: bool = False  # the grace is up: running requests stop too

    def close(self) -> None:
        """The server is shutting down (uvicorn's shutdown, on the event loop): refuse what waits now, stop what runs
        STOP_S later (Watch and events() look every POLL_S), so that every request is answered before uvicorn's
        grace."""
        self.refusing = True
        asyncio.get_running_loop().call_later(STOP_S, setattr, self, "stopping", True)


class ServerClosing(Exception):
    """The server is shutting down and this request is not (or no longer) served."""


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="server_shutting_down")


def client_gone() -> APIError:
    return APIError(499, "client disconnected", "client_gone")


def state_of(request: Any) -> ServerState:
    return request.app.state.clover


class Watch:
    """Awaits things for one request, giving up (ClientGone) once its client has disconnected; checks at least
    every POLL_S, also while events keep arriving. A result that arrives after giving up goes to `orphan`
    (so an acquired slot is handed back, never lost)."""

    def __init__(self, request: Any):
        self.request = request
        self.checked = time.monotonic()
        self.running = False  # it has a slot: only the end of the shutdown's grace stops it (ServerState.close)

    async def gone(self) -> bool:
        self.checked = time.monotonic()
        return await self.request.is_disconnected()

    async def __call__(self, aw, orphan: Callable[[Any], None] | None = None) -> Any:
        task = asyncio.ensure_future(aw)
        try:
            while True:
                left = max(0.0, POLL_S - (time.monotonic() - self.checked))
                done, _ = await asyncio.wait({task}, timeout=left)
                if time.monotonic() - self.checked >= POLL_S and await self.gone():
                    raise ClientGone()
                if done:
                    return task.result()
                state = state_of(self.request)
                if state.stopping or (state.refusing and not self.running):
                    raise ServerClosing()
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if orphan is not None and task.done() and not task.cancelled() and task.exception() is None:
                orphan(task.result())
            raise


# Clover's own fields (docs/serve.md) that a request of another API may carry too: passed to the chat request as they
# are
CLOVER_FIELDS = ("mode", "block_size", "threshold", "accept", "clover_blocks", "ignore_eos", "forced_tokens", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty")


def chat_plan(body: dict, extra: dict | None, default_mode: str, seed: int | None = None) -> Plan:
    """The chat request (schema's ChatRequest) another API's request was turned into, with its Clover fields from
    `extra` -> the Plan, as the chat face makes it (plan_from; seed: serve's --seed, for a request that gives none).
    Its validation errors are a 400."""
    from pydantic import ValidationError

    ChatRequest, _ = _models()
    fields = {k: v for k, v in body.items() if v is not None}
    fields.update({k: v for k, v in (extra or {}).items() if k in CLOVER_FIELDS})
    try:
        req = ChatRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"invalid request: {loc}: {err.get('msg')}", param=loc or None) from None
    return plan_from(req, True, default_mode, seed=seed)


# ---- the request, before it takes a slot -----------------------------------------------------------------------
def normalize_roles(messages: list[dict]) -> list[dict]:
    """Messages as every chat template renders them (the clients' habits, on all three APIs): `developer` (OpenAI's
    newer name) is `system`; the system messages before the first other message are one system message (their texts
    joined by a blank line); a system message later in the conversation (Claude Code's and Codex's reminders) becomes
    a user message with the same text, since Clover's template (Qwen3.5's) refuses a system message that is not
    first, and a user turn is where the model reads instructions mid-conversation. The messages before it render
    unchanged, so the state kept for them is reused."""
    out: list[dict] = []
    leading = True
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "system" and leading:
            if out:
                joined = "\n\n".join(t for t in (out[0]["content"], m.get("content") or "") if t)
                out[0] = {**out[0], "content": joined}
            else:
                out.append({**m, "role": "system"})
            continue
        leading = False
        out.append({**m, "role": "user"} if role == "system" else ({**m, "role": role} if role != m["role"] else m))
    return out


def precheck(rt: Any, plan: Plan, pool: Pool | None = None) -> None:
    """What is settled before the request takes a slot, beside the slots' work (it reads only what every slot shares:
    the template, the sizes, the grammar engine):
    - roles every template renders (normalize_roles), then tools, tool calls and tool messages as the chat template
      is to get them (clover_gguf.serve.tools.for_template);
    - a grammar the engine cannot compile, and constrained output or logprobs from a runtime without them: 400;
    - a prompt that leaves no room for one token in the context (refused with its real count when it is not huge:
      COUNT_BYTES), and the request's mode and block size (check_request). max_tokens past what the context has left
      is not refused: the worker stops the answer at the context (finish `length`) and checks the real count."""
    if plan.messages is not None:
        plan.messages = normalize_roles(plan.messages)
        plan.messages, plan.template_tools = tools.for_template(rt, plan.messages, plan.template_tools)
    grammar_param = "tools" if plan.tool_mode in ("required", "named") else "response_format"
    if plan.grammar_body is not None and pool is not None:
        try:  # the body's errors (a schema the engine cannot read) before a slot is taken; the worker's is cached
            pool.grammar_engine().check(plan.grammar_body)
        except grammar.GrammarError as e:
            raise APIError(400, str(e), param=grammar_param) from None
    for kw, param, wanted in (("constraint", grammar_param, plan.grammar_body is not None),
                              ("logprobs", "logprobs", plan.logprobs is not None),
                              ("ignore_eos", "ignore_eos", plan.ignore_eos),
                              ("forced", "forced_tokens", not plan.forced)):
        if wanted and not _takes(rt, kw):
            raise APIError(400, f"this runtime's decoders do not take {kw} yet", param=param)
    if not hasattr(rt, "least_prompt_tokens"):  # a test's stand-in runtime
        return
    kw = {"tools": plan.template_tools} if plan.template_tools else {}
    least = rt.least_prompt_tokens(plan.messages, plan.prompt, plan.think, **kw)
    block_size = int(plan.block_size or rt.block_size)
    try:
        rt.check_request(least, 1, plan.mode, block_size, at_least=True)
    except UserError as e:
        if getattr(e, "n_prompt_tokens", None) is None or least * rt.max_token_bytes > COUNT_BYTES:
            raise
        rt.check_request(count_prompt(rt, plan), 1, plan.mode, block_size)  # the real count, in the refusal


def count_prompt(rt: Any, plan: Plan) -> int:
    """The prompt's tokens, as the worker will count them (a precheck'ed plan): /v1/messages/count_tokens."""
    kw = {"tools": plan.template_tools} if plan.template_tools else {}
    if plan.messages is not None:
        return len(rt.prompt_ids(plan.messages, think=plan.think, **kw))
    return len(rt.raw_prompt_ids(plan.prompt or ""))


def _takes(rt: Any, keyword: str) -> bool:
    """Whether the runtime's stream_pieces takes `keyword` (constraint, logprobs: clover_gguf.decoding's)."""
    try:
        params = inspect.signature(rt.stream_pieces).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def refusal(status: int, message: str, extra: dict | None = None) -> APIError:
    """A refused request as an APIError. A prompt past the context (`extra`: its n_prompt_tokens and the context's
    n_ctx) has llama-server's error type, which its clients and its own tests read, with OpenAI's code beside it."""
    if extra:
        return APIError(status, message, "exceed_context_size_error", code="context_length_exceeded", extra=extra)
    return APIError(status, message, "invalid_request_error" if status < 500 else "server_error")


def user_error(e: UserError) -> APIError:
    """A UserError (the runtime's refusal) as a 400; a prompt past the context carries its token count and the
    context's size, as llama-server's refusal does."""
    extra = {k: getattr(e, k) for k in ("n_prompt_tokens", "n_ctx") if getattr(e, k, None) is not None}
    return refusal(400, str(e), extra)


async def prepared(request: Any, plan: Plan, on_refused: Callable[[], None] | None = None) -> None:
    """precheck off the event loop (a template over 100,000 messages takes a moment), before any slot is taken.
    Raises APIError (a refusal, the client gone, the server closing); on_refused: called for the runtime's refusal
    (/metrics counts it)."""
    state = state_of(request)
    if state.refusing:
        raise shutting_down()
    try:
        await Watch(request)(asyncio.to_thread(precheck, state.first, plan, state.pool))
    except UserError as e:
        if on_refused is not None:
            on_refused()
        raise user_error(e) from None
    except ClientGone:
        raise client_gone() from None
    except ServerClosing:
        raise shutting_down() from None


async def begin(request: Any, plan: Plan) -> tuple[Job, int, Watch]:
    """Wait for a slot, start the decode, wait until the request passed its checks -> (job, prompt tokens, the
    request's watch). Raises APIError for a refused request, the client gone while waiting, the server closing."""
    state = state_of(request)
    watch = Watch(request)
    try:
        rt = await watch(state.pool.acquire(served_key(plan) if plan.messages is not None else None),
                         orphan=state.pool.release)
        job = state.pool.start(rt, plan)
        watch.running = True
        try:
            ev = await watch(job.events.get())
        except BaseException:
            job.cancel()
            raise
    except ClientGone:
        raise client_gone() from None
    except ServerClosing:
        raise shutting_down() from None
    if ev[0] == "error":
        raise refusal(ev[1], ev[2], ev[3] if len(ev) > 3 else None)
    return job, ev[1], watch


@dataclass
class Answer:
    """A whole answer: its thinking, its text, its tool calls (serve.tools.Call), logprob entries, the finish reason
    (stop, length, tool_calls), the stats and the usage (OpenAI's chat usage)."""

    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str = "stop"
    stats: dict = field(default_factory=dict)
    usage: dict = field(default_factory=dict)


async def collect(job: Job, watch: Watch) -> Answer:
    """Read a non-streamed job to its end. Raises APIError (the job's error, the client gone, the server closing)."""
    reasoning, content, calls, logprobs = [], [], [], []
    try:
        while True:
            ev = await watch(job.events.get())
            if ev[0] == "delta":
                reasoning.append(ev[1])
                content.append(ev[2])
                logprobs += ev[3] or []
            elif ev[0] == "call":
                calls.append(ev[1])
            elif ev[0] == "done":
                break
            elif ev[0] == "error":
                raise APIError(ev[1], ev[2], "server_error")
    except ClientGone:
        job.cancel()
        raise client_gone() from None
    except ServerClosing:
        job.cancel()
        raise shutting_down() from None
    except BaseException:
        job.cancel()
        raise
    _, finish, stats, usage = ev
    return Answer("".join(reasoning), "".join(content), calls, logprobs, finish, stats, usage)


async def events(job: Job, state: ServerState) -> AsyncIterator[tuple]:
    """A streamed job's events (delta, call, blocks) up to its last, ("done", ...) or ("error", status, message); the
    end of the shutdown's grace is an error event. The job is cancelled when the stream ends early (a disconnect)."""
    try:
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if state.stopping and (ev is None or ev[0] == "delta"):  # the shutdown's grace is up: the API's error
                ev = ("error", 503, "the server is shutting down")
            elif ev is None:
                continue
            yield ev
            if ev[0] in ("done", "error"):
                return
    finally:
        job.cancel()  # a no-op after "done"; on a disconnect the worker stops at its next chunk


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (Anthropic's and Responses' streams name theirs) and its JSON."""
    import json

    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def streaming_response(agen: AsyncIterator[str], job: Job) -> Any:
    from starlette.background import BackgroundTask
    from starlette.responses import StreamingResponse

    return StreamingResponse(agen, media_type="text/event-stream", background=BackgroundTask(job.cancel),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
