"""`clover-gguf serve`'s HTTP app: an OpenAI-compatible server on a Clover GGUF (or MLX folder), decoding with auto (the
default), draft-self, diffusion or AR.

Endpoints (docs/serve.md has the fields): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health, GET /metrics, GET /slots, and the chat page at GET / (clover_gguf.serve.page). Built on FastAPI
(Starlette) and served by uvicorn. The model work runs on the slots' worker threads (clover_gguf.serve.slots); the
request bodies and errors are OpenAI's (clover_gguf.serve.schema); the API key is checked first
(clover_gguf.serve.auth).
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are local to create_app
import asyncio
import contextlib
import errno
import inspect
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from clover_gguf import grammar
from clover_gguf.decoding import MODES
from clover_gguf.errors import UserError
import clover_gguf.serve.tools as tools
from clover_gguf.serve.auth import RequireKey, check_api_key, is_loopback
from clover_gguf.serve.page import add_page_routes
from clover_gguf.serve.schema import (APIError, _models, chat_logprobs, completion_logprobs, error_body, plan_from,
                                      tool_call_deltas)
from clover_gguf.serve.slots import ClientGone, Job, Plan, Pool, served_key

try:  # the serve extra; FastAPI injects the request into parameters annotated with this type
    from starlette.requests import Request
except ImportError:  # importing this module needs no extra; create_app and serve say what is missing
    Request = Any

log = logging.getLogger("clover_gguf.serve")

POLL_S = 0.25  # how often a waiting request checks whether its client is still there
# on SIGINT or SIGTERM uvicorn gives open requests GRACE_S to finish, then cancels them (a plain-text 500 after a
# CancelledError traceback each): waiting requests are refused at once, running ones stopped STOP_S into it, each
# answered in the API's own error form (ServerState.close)
GRACE_S, STOP_S = 5.0, 4.0


@dataclass
class ServerState:
    """What the routes share: the slot pool and the settings the server was started with."""

    pool: Pool
    name: str  # the model id the API reports
    default_mode: str
    created: int
    first: Any  # one runtime, for /v1/models' metadata
    refusing: bool = False  # shutting down: no request starts or waits for a slot any more
    stopping: bool = False  # the grace is up: running requests stop too

    def close(self) -> None:
        """The server is shutting down (uvicorn's shutdown, on the event loop): refuse what waits now, stop what runs
        STOP_S later (Watch and _sse look every POLL_S), so that every request is answered before uvicorn's grace."""
        self.refusing = True
        asyncio.get_running_loop().call_later(STOP_S, setattr, self, "stopping", True)


class ServerClosing(Exception):
    """The server is shutting down and this request is not (or no longer) served."""


def _shutting_down() -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(error_body("the server is shutting down", "server_error", code="server_shutting_down"),
                        status_code=503)


def _state(request: Request) -> ServerState:
    return request.app.state.clover


# ---- errors in OpenAI's shape --------------------------------------------------------------------------------
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


def _count_refused(request: Request, mode: Any = None) -> None:
    """/metrics' clover_requests_total{finish="refused"} for a completion request refused before it reached a slot
    (a body that fails validation, a field the server refuses, a prompt over the context); the worker counts the ones
    refused on a slot. Under the request's mode, or the server's default where it named none the server knows."""
    state = getattr(request.app.state, "clover", None)
    if state is not None and request.url.path in COMPLETION_PATHS:
        state.pool.metrics.record(mode if mode in MODES else state.default_mode, "refused")


async def _on_api_error(request: Request, exc: APIError) -> Any:
    from starlette.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


async def _on_invalid_request(request: Request, exc: Any) -> Any:
    """pydantic's validation errors: a body that is not a JSON object is a 400, fields that fail are a 422."""
    from starlette.responses import JSONResponse

    errors = exc.errors()
    body = getattr(exc, "body", None)
    _count_refused(request, body.get("mode") if isinstance(body, dict) else None)
    bad_json = [e for e in errors if e.get("type") == "json_invalid"
                or (tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "missing"))]
    if bad_json:
        e = bad_json[0]
        why = (e.get("ctx") or {}).get("error") or e.get("msg", "")
        return JSONResponse(error_body(f"the body must be a JSON object: {why}", "invalid_request_error"),
                            status_code=400)
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    first_param = ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") if errors else None
    body = error_body("invalid request: " + "; ".join(parts), "invalid_request_error", first_param or None)
    body["detail"] = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]
    return JSONResponse(body, status_code=422)


async def _on_http_error(request: Request, exc: Any) -> Any:
    """Starlette's own errors (404 unknown path, 405 wrong method, 400 a body that is not UTF-8 JSON), in OpenAI's
    shape."""
    from starlette.responses import JSONResponse

    if exc.status_code == 404:
        message, code = f"no such endpoint: {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    elif exc.status_code == 400:
        message, code = "the body must be a JSON object in UTF-8", None
        _count_refused(request)
    else:
        message, code = str(exc.detail), None
    return JSONResponse(error_body(message, "invalid_request_error", code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


# ---- one request, from its fields to its response ------------------------------------------------------------
class Watch:
    """Awaits things for one request, giving up (ClientGone) once its client has disconnected; checks at least
    every POLL_S, also while events keep arriving. A result that arrives after giving up goes to `orphan`
    (so an acquired slot is handed back, never lost)."""

    def __init__(self, request: Request):
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
                state = _state(self.request)
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

def precheck(rt: Any, plan: Plan, pool: Pool | None = None) -> None:
    """What is settled before the request takes a slot, beside the slots' work (it reads only what every slot shares:
    the template, the sizes, the grammar engine):
    - tools, tool calls and tool messages as the chat template is to get them (clover_gguf.serve.tools.for_template);
    - a grammar the engine cannot compile, and constrained output or logprobs from a runtime without them: 400;
    - a prompt whose least possible token count (CloverRuntime.least_prompt_tokens) with the tokens asked for (1 when
      unsaid) is past the context, and the request's mode and block size (check_request). The worker then checks
      the real count."""
    if plan.messages is not None:
        plan.messages, plan.template_tools = tools.for_template(rt, plan.messages, plan.template_tools)
    grammar_param = "tools" if plan.tool_mode in ("required", "named") else "response_format"
    if plan.grammar_body is not None and pool is not None:
        try:  # the body's errors (a schema the engine cannot read) before a slot is taken; the worker's is cached
            pool.grammar_engine().compile(grammar.source(plan.grammar_body, "none"))
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
    least = rt.least_prompt_tokens(plan.messages, plan.prompt, plan.think,
                                   **({"tools": plan.template_tools} if plan.template_tools else {}))
    block_size = int(plan.block_size or rt.block_size)
    rt.check_request(least, plan.max_tokens or 1, plan.mode, block_size, at_least=True)


def _takes(rt: Any, keyword: str) -> bool:
    """Whether the runtime's stream_pieces takes `keyword` (constraint, logprobs: clover_gguf.decoding's)."""
    try:
        params = inspect.signature(rt.stream_pieces).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


async def _start(pool: Pool, watch: Watch, plan: Plan) -> tuple[Job, int]:
    """Wait for a slot, start the decode, wait until the request passed its checks -> (job, prompt tokens).
    Raises APIError for a refused request, ClientGone if the client left while waiting."""
    rt = await watch(pool.acquire(served_key(plan) if plan.messages is not None else None), orphan=pool.release)
    job = pool.start(rt, plan)
    watch.running = True
    try:
        ev = await watch(job.events.get())
    except BaseException:
        job.cancel()
        raise
    if ev[0] == "error":
        raise APIError(ev[1], ev[2], "invalid_request_error" if ev[1] < 500 else "server_error")
    return job, ev[1]


def _client_gone() -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(error_body("client disconnected", "client_gone"), status_code=499)


async def _respond(request: Request, req: Any, chat: bool) -> Any:
    """Run one completion request: wait for a slot, decode, answer as one JSON body or as server-sent events."""
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, StreamingResponse

    state = _state(request)
    try:
        plan = plan_from(req, chat, state.default_mode)
    except APIError:
        _count_refused(request, getattr(req, "mode", None))
        raise
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    watch = Watch(request)
    if state.refusing:
        return _shutting_down()
    try:
        # off the event loop (a template over 100,000 messages takes a moment), and before any slot is taken
        await watch(asyncio.to_thread(precheck, state.first, plan, state.pool))
    except UserError as e:
        _count_refused(request, plan.mode)
        raise APIError(400, str(e)) from None
    except ClientGone:
        return _client_gone()
    except ServerClosing:
        return _shutting_down()
    try:
        job, _ = await _start(state.pool, watch, plan)
    except ClientGone:
        return _client_gone()
    except ServerClosing:
        return _shutting_down()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    now = int(time.time())
    if req.stream:
        agen = _sse(job, rid, now, state, chat, include_usage, plan.logprobs is not None)
        return StreamingResponse(agen, media_type="text/event-stream", background=BackgroundTask(job.cancel),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
            else:
                raise APIError(ev[1], ev[2], "server_error")
    except ClientGone:
        job.cancel()
        return _client_gone()
    except ServerClosing:
        job.cancel()
        return _shutting_down()
    except BaseException:
        job.cancel()
        raise
    _, finish, stats, usage = ev
    if chat:
        text = "".join(content)
        msg = {"role": "assistant", "content": text if text or not calls else None,
               "reasoning_content": "".join(reasoning)}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        lp = chat_logprobs(logprobs) if plan.logprobs is not None else None
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}
        obj = "chat.completion"
    else:
        lp = completion_logprobs(logprobs, 0) if plan.logprobs is not None else None
        choice = {"index": 0, "text": "".join(content), "logprobs": lp, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": now, "model": state.name, "choices": [choice], "usage": usage,
            "clover_stats": stats}
    return JSONResponse(body, headers={"X-Clover-Stats": json.dumps(stats, separators=(",", ":"))})


async def _sse(job: Job, rid: str, now: int, state: ServerState, chat: bool, include_usage: bool,
               logprobs: bool = False) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    name = state.name
    offset = 0  # completions: where the next token's text starts in the answer (logprobs' text_offset)

    def chunk(delta: dict | None, finish: str | None = None, lp: list | None = None, **extra) -> str:
        nonlocal offset
        if delta is None:
            choices = []
        elif chat:
            choices = [{"index": 0, "delta": delta, "logprobs": chat_logprobs(lp) if lp is not None else None,
                        "finish_reason": finish}]
        else:
            shaped = completion_logprobs(lp, offset) if lp is not None else None
            offset += sum(len(e["token"]) for e in lp or [])
            choices = [{"index": 0, "text": delta.get("content", ""), "logprobs": shaped, "finish_reason": finish}]
        body = {"id": rid, "object": obj, "created": now, "model": name, "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if state.stopping and (ev is None or ev[0] == "delta"):  # the shutdown's grace is up: the API's error
                ev = ("error", 503, "the server is shutting down")
            elif ev is None:
                continue
            if ev[0] == "delta":
                lp = ev[3] if logprobs else None
                if ev[1] and chat:
                    yield chunk({"reasoning_content": ev[1]}, lp=None if ev[2] else lp)
                    if not ev[2]:
                        lp = None
                if ev[2] or lp:
                    yield chunk({"content": ev[2]}, lp=lp)
            elif ev[0] == "call":
                for delta in tool_call_deltas(ev[1]):
                    yield chunk({"tool_calls": [delta]})
            elif ev[0] == "blocks":  # the block view (clover_blocks): its events in a chunk with an empty delta
                yield chunk({}, clover_blocks=ev[1])
            elif ev[0] == "done":
                _, finish, stats, usage = ev
                if include_usage:
                    yield chunk({}, finish, clover_stats=stats)
                    yield chunk(None, usage=usage)
                else:
                    yield chunk({}, finish, usage=usage, clover_stats=stats)
                break
            else:
                err = error_body(ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error")
                yield f"data: {json.dumps(err)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op after "done"; on a disconnect the worker stops at its next chunk


# ---- routes ----------------------------------------------------------------------------------------------------
async def _health(request: Request) -> dict:
    state = _state(request)
    return {"status": "ok", "model": state.name, "slots_total": len(state.pool.runtimes),
            "slots_idle": state.pool.idle, "requests_waiting": state.pool.waiting}


async def _metrics(request: Request):
    from starlette.responses import PlainTextResponse

    pool = _state(request).pool
    return PlainTextResponse(pool.metrics.text(pool), media_type="text/plain; version=0.0.4")


async def _slots(request: Request) -> list[dict]:
    """Each slot: idle or busy (with its request's mode), and the conversation it holds the state of."""
    pool = _state(request).pool
    out = []
    for i, rt in enumerate(pool.runtimes):
        backend = getattr(rt, "backend", None)
        prefix, prompt = getattr(backend, "prefix", None) or [], getattr(backend, "prompt_kept", None) or []
        out.append({"id": i, "state": "busy" if i in pool.busy else "idle", "mode": pool.busy.get(i),
                    "kept_prefix_tokens": len(prefix), "kept_prompt_tokens": len(prompt),
                    "kept_messages": sum(1 for m in getattr(rt, "served", None) or [] if "role" in m)})
    return out


async def _list_models(request: Request) -> dict:
    state = _state(request)
    first = state.first
    meta = getattr(first, "meta", {}) or {}
    return {"object": "list", "data": [{
        "id": state.name, "object": "model", "created": state.created, "owned_by": "clover-gguf",
        "meta": {"context_length": min(getattr(first, "context_length", 0) or 0, getattr(first, "n_ctx", 0) or 0),
                 "block_mode": bool(getattr(first, "block_mode", False)), "default_mode": state.default_mode,
                 "block_size": getattr(first, "block_size", None), "parallel": len(state.pool.runtimes),
                 "architecture": meta.get("general.architecture")}}]}


def load_runtimes(model: str | Path | Callable[[], Any], parallel: int, ctx: int | None, model_id: str | None,
                  runtime_kwargs: dict[str, Any] | None) -> tuple[list[Any], str]:
    """-> (`parallel` runtimes, the model id): from a GGUF path, or from a factory returning a CloverRuntime-like
    object. All or nothing: a failure closes the ones already loaded."""
    if callable(model) and not isinstance(model, (str, Path)):
        factory = model
        name = model_id or "clover"
    else:
        from clover_gguf.runtime import CloverRuntime

        from clover_gguf.state_cache import DEFAULT_CACHE_RAM_MIB

        path = Path(model)
        kw = {"cache_ram": DEFAULT_CACHE_RAM_MIB * 2**20, **(runtime_kwargs or {})}

        def factory(first: Any = None) -> Any:
            # one llama.cpp context for all slots, each on its own sequences, their passes batched step by step
            # (clover_gguf.batching); each keeps its last conversation's state (docs/runtime.md, "Prefix reuse")
            if first is None:
                return CloverRuntime(path, n_ctx=ctx, keep_prefix=True, keep_prompt=True, slots=parallel, **kw)
            return CloverRuntime(path, n_ctx=ctx, keep_prefix=True, keep_prompt=True, slot_of=first, **kw)

        name = model_id or path.stem
    runtimes: list[Any] = []
    try:
        for _ in range(parallel):
            runtimes.append(factory(runtimes[0]) if runtimes and factory is not model else factory())
            if len(runtimes) == 1 and parallel > 1 and hasattr(getattr(runtimes[0], "ctx", None),
                                                               "memory_breakdown"):
                from clover_gguf.fit import check_slots
                from clover_gguf.llama_context import gpu_devices

                # the one context holds every slot: refused before anything is written into it
                check_slots(parallel, runtimes[0].ctx.memory_breakdown(), devices=gpu_devices())
    except BaseException:
        for rt in runtimes:
            rt.close()
        raise
    return runtimes, name


def create_app(model: str | Path | Callable[[], Any], mode: str | None = None, api_key: str | None = None,
               parallel: int = 1, ctx: int | None = None, model_id: str | None = None,
               runtime_kwargs: dict[str, Any] | None = None):
    """-> a FastAPI (ASGI) app serving `model`: a GGUF path, or a factory returning a CloverRuntime-like object
    (called `parallel` times). The runtimes are loaded here, so a bad model fails before any socket is opened.
    runtime_kwargs go to CloverRuntime (rollback, exact, n_threads, offload, ...)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    ChatRequest, CompletionRequest = _models()
    if mode is not None and mode not in MODES:
        raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if parallel < 1:
        raise UserError("--parallel must be at least 1")
    if ctx is not None and ctx < 16:
        raise UserError("--ctx must be at least 16")
    if api_key is not None:
        check_api_key(api_key)
    runtimes, name = load_runtimes(model, parallel, ctx, model_id, runtime_kwargs)
    first = runtimes[0]
    mode = mode or getattr(first, "default_mode", "auto")  # ar for an AR-only file
    if mode != "ar" and not getattr(first, "block_mode", True):
        for rt in runtimes:
            rt.close()
        from clover_gguf.runtime import no_block_tensors

        raise UserError(no_block_tensors(first.path, mode))
    if hasattr(first, "reading_note") and (note := first.reading_note(mode)):
        log.warning("%s", note)
    pool = Pool(runtimes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        pool.close()

    app = FastAPI(title="clover-gguf", lifespan=lifespan, docs_url=None, redoc_url=None)  # /openapi.json: keyed
    app.state.clover = ServerState(pool=pool, name=name, default_mode=mode, created=int(time.time()),
                                   first=runtimes[0])
    app.state.pool = pool
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_invalid_request)
    app.add_exception_handler(HTTPException, _on_http_error)
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/v1/models", _list_models, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])  # behind the API key, like everything but /health
    app.add_api_route("/slots", _slots, methods=["GET"])
    add_page_routes(app)  # the chat page at /

    # FastAPI reads the body's type from the signature, so these two stay here, where the request models are
    async def chat_completions(req: ChatRequest, request: Request):
        return await _respond(request, req, chat=True)

    async def completions(req: CompletionRequest, request: Request):
        return await _respond(request, req, chat=False)

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def serve(model: str | Path, host: str = "127.0.0.1", port: int = 8080, mode: str | None = None,
          ctx: int | None = None, parallel: int = 1, api_key: str | None = None, model_id: str | None = None,
          log_level: str = "info", **runtime_kwargs) -> None:
    """Load the model and serve it with uvicorn until interrupted."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("serving needs FastAPI and uvicorn: `pip install fastapi uvicorn` (in a checkout of clover-gguf: "
                        "`pip install '.[serve]'`; `make demo` installs them)") from None
    if not 0 <= port <= 65535:
        raise UserError(f"port {port} is out of range")
    if api_key is not None:
        check_api_key(api_key)  # before anything loads or binds
    if not is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    sock = bind(host, port)  # before the model loads: a port in use is one line, not a minute later
    try:
        app = create_app(model, mode=mode, api_key=api_key, parallel=parallel, ctx=ctx, model_id=model_id,
                         runtime_kwargs=runtime_kwargs)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
        url = listen_url(host, sock)

        class Server(uvicorn.Server):  # uvicorn names no address for sockets it is given: say it once it serves
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started:
                    logging.getLogger("uvicorn.error").info(
                        "listening on %s (OpenAI base URL %s/v1; Ctrl-C to stop)", url, url)
                    logging.getLogger("uvicorn.error").info("chat page: %s/ (open it in a browser)", url)

            async def shutdown(self, sockets=None):  # SIGINT, SIGTERM: every open request answered in the grace
                app.state.clover.close()
                await super().shutdown(sockets=sockets)

        server = Server(config)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it caught again once it has shut down
            if not server.started:  # while starting: an interrupted command (exit 130)
                raise
            # after serving: the way to stop a server, a clean stop (exit 0, no error line)
    finally:
        sock.close()


def listen_url(host: str, sock: socket.socket) -> str:
    """http://HOST:PORT for a listening socket bound for `host` (its real port: --port 0 picks one)."""
    name = host.strip("[]") or "0.0.0.0"
    return f"http://{f'[{name}]' if ':' in name else name}:{sock.getsockname()[1]}"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (UserError, one line, when the address is taken or not ours)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]") or None, port,
                                                             type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot serve on host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not SO_REUSEPORT: a taken port stays taken
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be opened ({e.strerror})"
        raise UserError(f"{host}:{port} {why}") from None
    sock.set_inheritable(True)
    return sock
