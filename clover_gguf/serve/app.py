"""`clover-gguf serve`'s HTTP app: an OpenAI-compatible (and Anthropic-compatible) server on a Clover GGUF (or MLX
folder), decoding with auto (the default), draft-self, diffusion or AR.

Endpoints (docs/serve.md has the fields): POST /v1/chat/completions, POST /v1/completions (here; each also without
/v1, as llama-server and clients whose base URL lacks it call them), POST /v1/messages and /v1/messages/count_tokens
(clover_gguf.serve.anthropic), POST /v1/responses (clover_gguf.serve.responses), GET /v1/models (and /models),
GET /health, GET /metrics, GET /slots, llama-server's /tokenize, /detokenize, /apply-template and /props
(clover_gguf.serve.llama_api), and the chat page at GET / (clover_gguf.serve.page). Built on FastAPI (Starlette) and
served by uvicorn. The three APIs share one core (clover_gguf.serve.core: a request's Plan to its answer); the model
work runs on the slots' worker threads (clover_gguf.serve.slots); the chat request bodies and errors are OpenAI's
(clover_gguf.serve.schema), errors on Anthropic's paths in its shape; the Host and the API key are checked first
(clover_gguf.serve.auth).
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are local to create_app
import contextlib
import errno
import json
import logging
import socket
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from clover_gguf.decoding import MODES
from clover_gguf.errors import UserError
import clover_gguf.serve.anthropic as anthropic
import clover_gguf.serve.core as core
import clover_gguf.serve.responses as responses
from clover_gguf.serve.auth import CheckHost, RequireKey, allowed_hosts, check_api_key, is_loopback
import clover_gguf.serve.llama_api as llama_api
from clover_gguf.serve.page import add_page_routes
from clover_gguf.serve.schema import (APIError, _models, chat_logprobs, completion_logprobs, error_body, plan_from,
                                      tool_call_deltas)
from clover_gguf.serve.core import GRACE_S, ServerState
from clover_gguf.serve.slots import Job, Pool

try:  # the serve extra; FastAPI injects the request into parameters annotated with this type
    from starlette.requests import Request
except ImportError:  # importing this module needs no extra; create_app and serve say what is missing
    Request = Any

log = logging.getLogger("clover_gguf.serve")

REASONING = ("on", "off", "auto")  # --reasoning, llama-server's values


def _state(request: Request) -> ServerState:
    return request.app.state.clover


# ---- errors in OpenAI's shape --------------------------------------------------------------------------------
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions")


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
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code, exc.extra), status_code=exc.status,
                        headers=headers)


async def _on_invalid_request(request: Request, exc: Any) -> Any:
    """pydantic's validation errors: a 400 in OpenAI's shape (as OpenAI and llama-server answer them), naming the
    first field that fails; a body that is not a JSON object says so."""
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
    return JSONResponse(body, status_code=400)


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


def _in_the_api_shape(handler: Callable) -> Callable:
    """An error handler whose OpenAI-shaped answer goes out in Anthropic's shape on Anthropic's paths (the same
    message and status, and the error's extra fields)."""
    async def shaped(request: Request, exc: Any) -> Any:
        from starlette.responses import JSONResponse

        response = await handler(request, exc)
        if not anthropic.owns(request.url.path):
            return response
        err = json.loads(response.body)["error"]
        extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
        headers = {k: v for k, v in response.headers.items() if k.lower() == "www-authenticate"}
        return JSONResponse(anthropic.error_body(response.status_code, err["message"], extra),
                            status_code=response.status_code, headers=headers or None)
    return shaped


# ---- one request, from its fields to its response ------------------------------------------------------------
async def _respond(request: Request, req: Any, chat: bool) -> Any:
    """Run one completion request: wait for a slot, decode, answer as one JSON body or as server-sent events."""
    from starlette.responses import JSONResponse

    state = _state(request)
    try:
        plan = plan_from(req, chat, state.default_mode, think=state.default_think, seed=state.default_seed)
    except APIError:
        _count_refused(request, getattr(req, "mode", None))
        raise
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    await core.prepared(request, plan, on_refused=lambda: _count_refused(request, plan.mode))
    job, _, watch = await core.begin(request, plan)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    now = int(time.time())
    if req.stream:
        return core.streaming_response(_sse(job, rid, now, state, chat, include_usage, plan.logprobs is not None),
                                       job)
    a = await core.collect(job, watch)
    if chat:
        msg = {"role": "assistant", "content": a.content if a.content or not a.calls else None,
               "reasoning_content": a.reasoning}
        if a.calls:
            msg["tool_calls"] = [c.to_openai() for c in a.calls]
        lp = chat_logprobs(a.logprobs) if plan.logprobs is not None else None
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": a.finish}
        obj = "chat.completion"
    else:
        lp = completion_logprobs(a.logprobs, 0) if plan.logprobs is not None else None
        choice = {"index": 0, "text": a.content, "logprobs": lp, "finish_reason": a.finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": now, "model": state.name, "choices": [choice], "usage": a.usage,
            "timings": llama_api.timings(a.stats, a.usage), "clover_stats": a.stats}
    return JSONResponse(body, headers={"X-Clover-Stats": json.dumps(a.stats, separators=(",", ":"))})


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
        return core.sse({"id": rid, "object": obj, "created": now, "model": name, "choices": choices, **extra})

    if chat:
        # content null, not "": llama-server's first chunk (clients written for it take every content delta they see
        # as text; OpenAI's SDK reads both)
        yield chunk({"role": "assistant", "content": None})
    async for ev in core.events(job, state):
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
            timings = llama_api.timings(stats, usage)  # llama-server's, beside the usage
            if include_usage:
                yield chunk({}, finish, clover_stats=stats)
                yield chunk(None, usage=usage, timings=timings)
            else:
                yield chunk({}, finish, usage=usage, timings=timings, clover_stats=stats)
        else:
            err = error_body(ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error")
            yield f"data: {json.dumps(err)}\n\n"
    yield "data: [DONE]\n\n"


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
    context = min(getattr(first, "context_length", 0) or 0, getattr(first, "n_ctx", 0) or 0)
    # the context's length where the clients look for it: vLLM's max_model_len, LM Studio's and OpenRouter's
    # context_length, and meta (llama-server's place for the model's facts)
    return {"object": "list", "data": [{
        "id": state.name, "object": "model", "created": state.created, "owned_by": "clover-gguf",
        "max_model_len": context, "context_length": context,
        "meta": {"context_length": context,
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
               runtime_kwargs: dict[str, Any] | None = None, hosts: frozenset[str] | None = None,
               reasoning: str = "auto", seed: int | None = None):
    """-> a FastAPI (ASGI) app serving `model`: a GGUF path, or a factory returning a CloverRuntime-like object
    (called `parallel` times). The runtimes are loaded here, so a bad model fails before any socket is opened.
    runtime_kwargs go to CloverRuntime (rollback, exact, n_threads, offload, ...). hosts: the Host names answered
    besides loopback ones (auth.allowed_hosts; None: any). reasoning (llama-server's --reasoning): whether a chat
    request that does not say thinks: on or auto (Clover thinks), off. seed (llama-server's --seed): the seed of
    requests that give none; None or below 0: a random one each."""
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
    if reasoning not in REASONING:
        raise UserError(f"--reasoning must be one of {', '.join(REASONING)}")
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
                                   first=runtimes[0], default_think=reasoning != "off",
                                   default_seed=seed if seed is not None and seed >= 0 else None)
    app.state.pool = pool
    app.add_exception_handler(APIError, _in_the_api_shape(_on_api_error))
    app.add_exception_handler(RequestValidationError, _in_the_api_shape(_on_invalid_request))
    app.add_exception_handler(HTTPException, _in_the_api_shape(_on_http_error))
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)
    app.add_middleware(llama_api.Cors)  # a preflight is answered before the key is asked
    if hosts is not None:  # added last: it runs first, before CORS and the key
        app.add_middleware(CheckHost, allowed=hosts)
    app.add_api_route("/health", _health, methods=["GET"])
    for prefix in ("/v1", ""):  # llama-server answers both; an OpenAI client's base URL may lack /v1
        app.add_api_route(f"{prefix}/models", _list_models, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])  # behind the API key, like everything but /health
    app.add_api_route("/slots", _slots, methods=["GET"])
    add_page_routes(app)  # the chat page at /

    # FastAPI reads the body's type from the signature, so these two stay here, where the request models are
    async def chat_completions(req: ChatRequest, request: Request):
        return await llama_api.respond_n(_respond, request, req, chat=True)

    async def completions(req: CompletionRequest, request: Request):
        return await llama_api.respond_n(_respond, request, req, chat=False)

    for prefix in ("/v1", ""):  # llama-server answers both; an OpenAI client's base URL may lack /v1
        app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
    anthropic.add_routes(app)  # /v1/messages, /v1/messages/count_tokens
    responses.add_routes(app)  # /v1/responses
    llama_api.add_routes(app, ChatRequest)  # /tokenize, /detokenize, /apply-template, /props
    return app


def serve(model: str | Path, host: str = "127.0.0.1", port: int = 8080, mode: str | None = None,
          ctx: int | None = None, parallel: int = 1, api_key: str | None = None, model_id: str | None = None,
          log_level: str = "info", allowed: str | None = None, reasoning: str = "auto", seed: int | None = None,
          **runtime_kwargs) -> None:
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
    hosts = allowed_hosts(host, allowed)
    if not is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    sock = bind(host, port)  # before the model loads: a port in use is one line, not a minute later
    try:
        app = create_app(model, mode=mode, api_key=api_key, parallel=parallel, ctx=ctx, model_id=model_id,
                         runtime_kwargs=runtime_kwargs, hosts=hosts, reasoning=reasoning, seed=seed)
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
