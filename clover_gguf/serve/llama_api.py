"""llama-server's own endpoints and extensions that clients written for it call, on `serve` (docs/serve.md, "Requests
written for llama-server"): /tokenize, /detokenize, /apply-template, /props; `n` choices; the `timings` object; and
the CORS answers a web UI on another origin needs (Cors).

Each answers in llama-server's shape (tools/server/README.md of the pinned llama.cpp); errors in OpenAI's shape, as
the rest of serve (clover_gguf.serve.schema).
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures
import json
from typing import Any, Awaitable, Callable

from clover_gguf.errors import UserError
import clover_gguf.serve.tools as tools
from clover_gguf.serve.schema import MAX_N, APIError, plan_from

try:
    from starlette.requests import Request
except ImportError:  # importing this module needs no extra
    Request = Any

CORS_METHODS = "GET, POST, DELETE, OPTIONS"  # llama-server's


# ---- CORS ----------------------------------------------------------------------------------------------------------
class Cors:
    """ASGI middleware, outermost (before the API key): a preflight OPTIONS that names an Origin is answered 200 with
    llama-server's headers (the Origin reflected, credentials allowed, its methods, any header), and every answer to
    a request with an Origin carries Access-Control-Allow-Origin, so a web UI served from another origin can call the
    API. The key still guards every request but the preflight (which carries no credentials by the CORS rules)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            # the names in llama-server's case: header names are case-insensitive, but some clients (its own
            # tests among them) copy the headers into a plain dict
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"Access-Control-Allow-Origin", origin), (b"Access-Control-Allow-Credentials", b"true"),
                (b"Access-Control-Allow-Methods", CORS_METHODS.encode()), (b"Access-Control-Allow-Headers", b"*"),
                (b"Access-Control-Max-Age", b"600"), (b"Vary", b"Origin"), (b"Content-Length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"Access-Control-Allow-Origin", origin),
                                                  (b"Access-Control-Allow-Credentials", b"true"), (b"Vary", b"Origin")]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


# ---- timings -------------------------------------------------------------------------------------------------------
def timings(stats: dict, usage: dict) -> dict:
    """llama-server's `timings` of an answer from its stats (RunStats.to_json) and usage: the prompt's pass and the
    generation, in ms and per second (the generation's time is the run's less the prompt's)."""
    prompt_n = int(usage.get("prompt_tokens", 0)) - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    predicted_n = int(usage.get("completion_tokens", 0))
    prompt_ms = 1000.0 * float(stats.get("prompt_seconds") or 0.0)
    predicted_ms = max(0.0, 1000.0 * float(stats.get("seconds") or 0.0) - prompt_ms)

    def rate(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)

    p_tok, p_s = rate(prompt_n, prompt_ms)
    g_tok, g_s = rate(predicted_n, predicted_ms)
    return {"cache_n": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
            "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3), "prompt_per_token_ms": round(p_tok, 3),
            "prompt_per_second": round(p_s, 2), "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(g_tok, 3), "predicted_per_second": round(g_s, 2)}


# ---- n choices -----------------------------------------------------------------------------------------------------
async def respond_n(respond: Callable[..., Awaitable[Any]], request: Request, req: Any, chat: bool) -> Any:
    """`n` choices: n answers to the same request, one after another (each takes a slot as any request does), each
    with its own seed (seed + i when the request or --seed gives one), joined into one body: choices indexed
    0..n-1, usage summed. n over MAX_N, or over 1 streamed, goes to `respond` whole, whose plan_from refuses it (a
    400, counted as refused)."""
    if req.n == 1 or req.n > MAX_N or req.stream:
        return await respond(request, req, chat=chat)
    from starlette.responses import JSONResponse

    seed = req.seed if req.seed is not None else request.app.state.clover.default_seed
    body, usage = None, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    choices = []
    for i in range(req.n):
        one = req.model_copy(update={"n": 1, "seed": None if seed is None else seed + i})
        resp = await respond(request, one, chat=chat)
        part = json.loads(resp.body)
        if resp.status_code != 200:
            return resp
        body = body or part
        for c in part["choices"]:
            choices.append({**c, "index": len(choices)})
        for k in usage:
            usage[k] += int(part["usage"].get(k, 0))
    body["choices"], body["usage"] = choices, usage
    body.pop("clover_stats", None)  # one run's stats; each choice's run differs
    body.pop("timings", None)
    return JSONResponse(body)


# ---- endpoints -------------------------------------------------------------------------------------------------------
def _body_dict(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _piece_text(piece: bytes) -> Any:
    """llama-server's `piece`: the text, or its bytes as a list of numbers when they are not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def add_routes(app: Any, chat_request: Any) -> None:
    """/tokenize, /detokenize, /apply-template, /props (FastAPI routes on `app`; chat_request: the chat body's model,
    which /apply-template takes)."""
    from fastapi import Body

    def state(request: Request) -> Any:
        return request.app.state.clover

    async def tokenize(request: Request, body: Any = Body(...)) -> dict:
        """{content, add_special, parse_special (default true), with_pieces} -> {tokens}. Clover's tokenizer adds no
        BOS, so add_special changes nothing."""
        body = _body_dict(body)
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, "content must be a string", param="content")
        rt = state(request).first
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "content is not valid UTF-8 text", param="content") from None
        ids = rt.ctx.tokenize(content, special=bool(body.get("parse_special", True)))
        if body.get("with_pieces"):
            return {"tokens": [{"id": t, "piece": _piece_text(rt.ctx.token_to_piece(t, special=True))} for t in ids]}
        return {"tokens": ids}

    async def detokenize(request: Request, body: Any = Body(...)) -> dict:
        body = _body_dict(body)
        ids = body.get("tokens", [])
        rt = state(request).first
        n_vocab = int(rt.ctx.n_vocab)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "tokens must be a list of token ids", param="tokens")
        if any(not 0 <= t < n_vocab for t in ids):
            raise APIError(400, f"token ids must be in 0..{n_vocab - 1}", param="tokens")
        return {"content": rt.detokenize(ids)}

    async def apply_template(req: chat_request, request: Request) -> dict:
        """The chat body -> {prompt}: the text the GGUF's template makes of its messages and tools (thinking as the
        request and the server's --reasoning say), as a completion would be prompted."""
        st = state(request)
        plan = plan_from(req, True, st.default_mode, think=st.default_think)
        rt = st.first
        try:
            messages, template_tools = tools.for_template(rt, plan.messages, plan.template_tools)
            return {"prompt": rt.render(messages, plan.think, tools=template_tools)}
        except UserError as e:
            raise APIError(400, str(e)) from None

    async def props(request: Request) -> dict:
        """The settings a llama-server client reads (its web UI, Open WebUI, llama-swap): the slots' context, the
        model's path and template, the slots."""
        st = state(request)
        rt = st.first
        n_ctx = min(getattr(rt, "context_length", 0) or 0, getattr(rt, "n_ctx", 0) or 0)
        return {"default_generation_settings": {"n_ctx": n_ctx, "params": {
                    "n_predict": -1, "temperature": 0.0, "seed": -1 if st.default_seed is None else st.default_seed,
                    "mode": st.default_mode,
                    "reasoning": "on" if st.default_think else "off"}},
                "total_slots": len(st.pool.runtimes), "model_alias": st.name,
                "model_path": str(getattr(rt, "path", st.name)), "chat_template": getattr(rt, "chat_template", None) or "",
                "modalities": {"vision": False, "audio": False}, "build_info": "clover-gguf",
                "is_sleeping": False}

    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/apply-template", apply_template, methods=["POST"])
    app.add_api_route("/props", props, methods=["GET"])
