"""`clover-gguf serve`: an OpenAI-compatible HTTP server on a Clover GGUF, decoding with auto (the default), draft-self, diffusion or AR.

Endpoints (docs/serve.md has the fields): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health. Built on FastAPI (Starlette) and served by uvicorn.

Concurrency: the app holds `parallel` independent CloverRuntimes ("slots"), each its own llama.cpp model and context.
A request waits in a FIFO queue for a free slot, and its whole decode runs on one worker thread with that slot to
itself, so requests never share decoding state. The worker hands the slot back only when it has stopped touching
the runtime, also when the client went away: a disconnect sets a cancel flag that the worker checks between
chunks. Text processing (reasoning split, stop strings) happens on the worker too, so the decode stops right where a
stop string appears and the stats describe exactly the work done.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are local to create_app
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal, Union

from clover_gguf.batching import Cancelled
from clover_gguf.decoding import ACCEPT_MODES, MODES
from clover_gguf.errors import UserError
from clover_gguf.thinking import ThinkSplitter

try:  # the serve extra; FastAPI injects the request into parameters annotated with this type
    from starlette.requests import Request
except ImportError:  # importing this module needs no extra; create_app and serve say what is missing
    Request = Any

log = logging.getLogger("clover_gguf.server")

MAX_STOP = 16
POLL_S = 0.25  # how often a waiting request checks whether its client is still there


# ---------------------------------------------------------------------------------------------------------------
# Slots and jobs: the model work, on worker threads
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One request, as the worker runs it."""

    prompt: str | None = None  # raw prompt (completions) ...
    messages: list[dict[str, str]] | None = None  # ... or chat messages, rendered with the GGUF's template
    mode: str = "auto"
    max_tokens: int | None = None  # None: as many as the context allows
    block_size: int | None = None
    threshold: float | None = None
    accept: str = "exact"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    think: bool = True
    stop: list[str] = field(default_factory=list)
    controls: dict[str, float] = field(default_factory=dict)  # overrides of the GGUF's generation controls
    stream: bool = True  # False: the answer is read whole at its end (the worker then posts its text once)


class ClientGone(Exception):
    """The client disconnected while its request waited."""


class Job:
    """One request on one slot. The worker thread emits events into an asyncio queue:
    ("started", prompt_tokens), ("delta", reasoning, content), ("done", finish_reason, stats, usage),
    ("error", http_status, message). `cancel()` (any thread) makes the worker stop at the next chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool = True):
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.stream = stream
        self._held: tuple[str, str] | None = None  # not streamed: the text so far, posted with the next other event
        self._last: list[tuple] = []  # the answer's last events, posted once its slot is free again (finish())

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, *event: Any) -> None:
        if event[0] == "delta" and not self.stream:  # one event loop wake-up per answer, not one per token
            r, c = self._held or ("", "")
            self._held = (r + event[1], c + event[2])
            return
        held = [("delta", *self._held)] if self._held is not None else []
        self._held = None
        if event[0] in ("done", "error"):
            # the end reaches the client after the slot is free (Pool.start): a client's next request, sent the moment
            # it reads this answer, then finds the slot that holds its conversation free
            self._last += [*held, event]
            return
        for e in (*held, event):
            self._post(e)

    def finish(self) -> None:
        """On the event loop, once the slot is free: post the answer's last events."""
        last, self._last = self._last, []
        for e in last:
            self.events.put_nowait(e)

    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass


class Metrics:
    """Counters over the finished requests (updated by the workers, read by /metrics): Prometheus counters."""

    COUNTERS = {  # RunStats field -> (metric, help)
        "prompt_tokens": ("clover_prompt_tokens_total", "Prompt tokens of finished requests."),
        "reused_tokens": ("clover_prompt_tokens_reused_total", "Prompt tokens continued from a slot's kept state."),
        "generated_tokens": ("clover_generated_tokens_total", "Tokens generated."),
        "forward_passes": ("clover_forward_passes_total", "Model passes (prompt, AR, block, commit, verification)."),
        "drafted_tokens": ("clover_block_tokens_drafted_total", "Block tokens a causal pass checked."),
        "accepted_tokens": ("clover_block_tokens_accepted_total", "Block tokens the causal path accepted."),
        "block_passes": ("clover_block_passes_total", "Block-mode passes (drafts and diffusion blocks)."),
        "drafts": ("clover_drafts_total", "Draft-self blocks verified (draft-self and auto)."),
        "ar_steps": ("clover_ar_steps_total", "One-token causal steps (ar and auto)."),
    }
    # auto's choices: the seconds its moves were predicted to take and took (tokens over its rates): their ratio is how
    # far the cost model held on this machine
    SECONDS = {"predicted_tokens_per_s": ("clover_auto_predicted_seconds_total",
                                          "Seconds auto's moves were predicted to take."),
               "measured_tokens_per_s": ("clover_auto_measured_seconds_total", "Seconds auto's moves took.")}

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (mode, finish) -> requests
        self.totals: collections.Counter = collections.Counter()  # (field, mode) -> sum

    def record(self, mode: str, finish: str, stats: dict | None = None) -> None:
        with self.lock:
            self.requests[(mode, finish)] += 1
            for field in self.COUNTERS:
                self.totals[(field, mode)] += int((stats or {}).get(field) or 0)
            for field in self.SECONDS:
                rate = (stats or {}).get(field)
                if rate:
                    self.totals[(field, mode)] += (stats or {}).get("generated_tokens", 0) / rate

    def text(self, pool: "Pool") -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        with self.lock:
            requests, totals = dict(self.requests), dict(self.totals)
        out = ["# HELP clover_requests_total Finished requests, by mode and finish reason.",
               "# TYPE clover_requests_total counter"]
        out += [f'clover_requests_total{{mode="{m}",finish="{f}"}} {n}' for (m, f), n in sorted(requests.items())]
        for field, (name, text) in {**self.COUNTERS, **self.SECONDS}.items():
            out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
            out += [f'{name}{{mode="{m}"}} {round(n, 6)}' for (f, m), n in sorted(totals.items()) if f == field]
        busy = len(pool.runtimes) - pool.idle
        out += ["# HELP clover_slots Slots, by state.", "# TYPE clover_slots gauge",
                f'clover_slots{{state="idle"}} {pool.idle}', f'clover_slots{{state="busy"}} {busy}',
                "# HELP clover_requests_waiting Requests waiting for a slot.", "# TYPE clover_requests_waiting gauge",
                f"clover_requests_waiting {pool.waiting}"]
        first = pool.runtimes[0] if pool.runtimes else None
        ctx = getattr(first, "ctx", None)
        sched = getattr(ctx, "scheduler", None)
        if sched is not None:  # clover_gguf.batching: the slots' passes on one context
            for name, value, text in (("clover_batch_steps_total", sched.steps, "Scheduler steps."),
                                      ("clover_llama_decodes_total", sched.decodes, "llama_decode calls."),
                                      ("clover_batched_steps_total", sched.merged_tokens,
                                       "One-token passes (AR steps) decoded together with other slots'."),
                                      ("clover_batch_wait_seconds_total", round(sched.wait_seconds, 6),
                                       "Seconds steps waited for the busy slots' passes after the first came in."),
                                      ("clover_batch_run_seconds_total", round(sched.run_seconds, 6),
                                       "Seconds steps spent running their passes (llama_decode).")):
                out += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {value}"]
        cache = getattr(getattr(first, "backend", None), "state_cache", None)
        if cache is not None:  # clover_gguf.state_cache: kept states of conversations a slot moved on from
            out += ["# HELP clover_state_cache_bytes Host memory held by kept conversation states (--cache-ram).",
                    "# TYPE clover_state_cache_bytes gauge", f"clover_state_cache_bytes {cache.bytes}",
                    "# HELP clover_state_cache_hits_total Prompts continued from a state in the cache.",
                    "# TYPE clover_state_cache_hits_total counter", f"clover_state_cache_hits_total {cache.hits}"]
        if hasattr(ctx, "memory_breakdown"):
            out += ["# HELP clover_llama_memory_bytes What llama.cpp holds, by buffer and part (model: the weights).",
                    "# TYPE clover_llama_memory_bytes gauge"]
            for buf, parts in sorted(ctx.memory_breakdown().items()):
                out += [f'clover_llama_memory_bytes{{buffer="{buf}",part="{k}"}} {v}' for k, v in parts.items()]
        return "\n".join(out) + "\n"


def _run_job(rt: Any, job: Job, plan: Plan, metrics: Metrics | None = None) -> None:
    """The worker: everything that touches the runtime happens here, on one thread, with the slot held."""
    try:
        finish, stats = _decode(rt, job, plan)
        if metrics is not None:
            metrics.record(plan.mode, finish, stats)
    except UserError as e:
        if metrics is not None:
            metrics.record(plan.mode, "refused")
        job.emit("error", 400, str(e))
    except Cancelled as e:  # the client went away during a long prompt (nobody reads this answer)
        if metrics is not None:
            metrics.record(plan.mode, "cancelled")
        job.emit("error", 400, str(e))
    except Exception as e:  # a bug or a llama.cpp failure: the request fails, the server keeps serving
        log.exception("request failed")
        if metrics is not None:
            metrics.record(plan.mode, "error")
        job.emit("error", 500, f"internal error: {type(e).__name__}: {e}")


def _decode(rt: Any, job: Job, plan: Plan) -> tuple[str, dict]:
    """-> (finish reason, the stats as JSON)."""
    keep = None  # a chat request keeps the state after its messages for the conversation's next request (this slot)
    if plan.messages is not None and getattr(rt, "keeps_prefix", False):
        ids, keep = rt.prompt_and_keep(plan.messages, think=plan.think)
    elif plan.messages is not None:
        ids = rt.prompt_ids(plan.messages, think=plan.think)
    else:
        ids = rt.raw_prompt_ids(plan.prompt or "")
    if not ids:
        raise UserError("the prompt is empty")
    block_size = int(plan.block_size or rt.block_size)
    limit = min(rt.context_length, rt.n_ctx)
    room = block_size - 1 if plan.mode != "ar" else 0
    max_new = plan.max_tokens if plan.max_tokens is not None else max(1, limit - len(ids) - room)
    rt.check_request(len(ids), max_new, plan.mode, block_size)
    job.emit("started", len(ids))

    # chat: thinking and answer split by the one rule (clover_gguf.thinking); completions: the raw text
    parser = ThinkSplitter(rt.thinking_at_start(ids), stop=plan.stop, tags=plan.messages is not None)
    controls = dataclasses.replace(rt.controls, **plan.controls) if plan.controls else None
    gen = rt.stream_ids(ids, mode=plan.mode, max_new_tokens=max_new, block_size=block_size, threshold=plan.threshold,
                        accept=plan.accept, temp=plan.temp, top_p=plan.top_p, top_k=plan.top_k, seed=plan.seed,
                        controls=controls, **({"keep": keep} if keep is not None else {}))
    stats = None
    finish = "cancelled"
    try:
        for text, stats in gen:
            if job.cancelled:
                break
            r, c = parser.feed(text)
            if r or c:
                job.emit("delta", r, c)
            if parser.stopped:
                finish = "stop"
                break
        else:
            finish = "length" if stats is not None and stats.finish_reason == "length" else "stop"
            r, c = parser.close()
            if r or c:
                job.emit("delta", r, c)
    finally:
        gen.close()
    st = stats.to_json() if stats is not None else {"mode": plan.mode, "prompt_tokens": len(ids),
                                                   "generated_tokens": 0}
    if parser.matched is not None:
        st["stop_string"] = parser.matched
    n_gen = int(st.get("generated_tokens", 0))
    usage = {"prompt_tokens": len(ids), "completion_tokens": n_gen, "total_tokens": len(ids) + n_gen,
             # OpenAI's field for prompt tokens served from a cache: here, continued from the slot's kept state
             "prompt_tokens_details": {"cached_tokens": int(st.get("reused_tokens", 0) or 0)}}
    if keep is not None:  # this slot now holds the state after these messages (_FreeSlots steers their sequel here)
        rt.served = list(plan.messages)
    job.emit("done", finish, st, usage)
    return finish, st


class _FreeSlots:
    """The free runtimes, and the requests waiting for one in FIFO order. A request takes the free slot that holds
    the state of its conversation (the longest `served` conversation its messages extend); else a free slot whose
    state is spare (none, or a conversation another slot holds too), so that no conversation loses its only kept
    state while a spare one can go; else the one free the longest."""

    def __init__(self, runtimes: list[Any]):
        self.all = list(runtimes)
        self.items: collections.deque = collections.deque(runtimes)
        self.waiters: collections.deque = collections.deque()  # futures of waiting requests

    def qsize(self) -> int:
        return len(self.items)

    def put_nowait(self, rt: Any) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():  # a waiter that gave up (client gone) was cancelled
                fut.set_result(rt)
                return
        self.items.append(rt)

    async def get(self, messages: list | None = None) -> Any:
        self.waiters = collections.deque(f for f in self.waiters if not f.done())  # those that gave up
        if self.items and not self.waiters:
            best = max(self.items, key=lambda rt: (_continues(getattr(rt, "served", None), messages), self._spare(rt)))
            self.items.remove(best)
            return best
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return await fut

    def _spare(self, rt: Any) -> bool:
        """Taking `rt` for another conversation loses no kept state."""
        served = getattr(rt, "served", None)
        return not served or any(o is not rt and getattr(o, "served", None) == served for o in self.all)


def _continues(served: list | None, messages: list | None) -> int:
    """How many messages of `messages` a slot that last served `served` holds the state of (0: none). The same
    messages again count too (a regenerated answer, a repeated question): the state kept is the one before the
    generation prompt, which every request renders after its messages."""
    if not served or not messages or len(served) > len(messages) or messages[:len(served)] != served:
        return 0
    return len(served)


class Pool:
    """`parallel` runtimes, each used by one request at a time; requests queue FIFO for a free one (the one holding
    their conversation when it is free)."""

    def __init__(self, runtimes: list[Any]):
        self.runtimes = runtimes
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=len(runtimes),
                                                              thread_name_prefix="clover-slot")
        self._free: _FreeSlots | None = None
        self.waiting = 0
        self.jobs: set[Job] = set()
        self.metrics = Metrics()
        self.busy: dict[int, str] = {}  # slot index -> the mode of the request it serves

    def _queue(self) -> _FreeSlots:
        if self._free is None:
            self._free = _FreeSlots(self.runtimes)
        return self._free

    @property
    def idle(self) -> int:
        return self._queue().qsize()

    def release(self, rt: Any) -> None:
        self._queue().put_nowait(rt)

    async def acquire(self, messages: list | None = None) -> Any:
        self.waiting += 1
        try:
            return await self._queue().get(messages)
        finally:
            self.waiting -= 1

    def start(self, rt: Any, plan: Plan) -> Job:
        """Run `plan` on `rt` (acquired) on a worker; the slot comes back when the worker is done with it."""
        loop = asyncio.get_running_loop()
        job = Job(loop, stream=plan.stream)
        free = self._queue()
        self.jobs.add(job)

        slot = next(i for i, r in enumerate(self.runtimes) if r is rt)
        self.busy[slot] = plan.mode

        # a slot of the shared context: the scheduler's steps wait for this slot's passes while it serves, and a long
        # prompt stops between chunks when the client goes away
        serving = getattr(getattr(rt, "ctx", None), "serving", None)

        def work() -> None:
            try:
                with serving(lambda: job.cancelled) if serving else contextlib.nullcontext():
                    _run_job(rt, job, plan, self.metrics)
            finally:
                def give_back() -> None:
                    self.jobs.discard(job)
                    self.busy.pop(slot, None)
                    free.put_nowait(rt)
                    job.finish()

                try:
                    loop.call_soon_threadsafe(give_back)
                except RuntimeError:
                    pass

        try:
            self.executor.submit(work)
        except BaseException:
            self.jobs.discard(job)
            free.put_nowait(rt)
            raise
        return job

    def close(self) -> None:
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=True)
        for rt in self.runtimes:
            with contextlib.suppress(Exception):
                rt.close()


# ---------------------------------------------------------------------------------------------------------------
# The HTTP API: request models, errors, the request flow, the routes; create_app only puts them together
# ---------------------------------------------------------------------------------------------------------------
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


@dataclass
class ServerState:
    """What the routes share: the slot pool and the settings the server was started with."""

    pool: Pool
    name: str  # the model id the API reports
    default_mode: str
    created: int
    first: Any  # one runtime, for /v1/models' metadata


def _state(request: Request) -> ServerState:
    return request.app.state.clover


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---- errors in OpenAI's shape --------------------------------------------------------------------------------
async def _on_api_error(request: Request, exc: APIError) -> Any:
    from starlette.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(_error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


async def _on_invalid_request(request: Request, exc: Any) -> Any:
    """pydantic's validation errors: a body that is not a JSON object is a 400, fields that fail are a 422."""
    from starlette.responses import JSONResponse

    errors = exc.errors()
    bad_json = [e for e in errors if e.get("type") == "json_invalid"
                or (tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "missing"))]
    if bad_json:
        e = bad_json[0]
        why = (e.get("ctx") or {}).get("error") or e.get("msg", "")
        return JSONResponse(_error_body(f"the body must be a JSON object: {why}", "invalid_request_error"),
                            status_code=400)
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    first_param = ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") if errors else None
    body = _error_body("invalid request: " + "; ".join(parts), "invalid_request_error", first_param or None)
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
    else:
        message, code = str(exc.detail), None
    return JSONResponse(_error_body(message, "invalid_request_error", code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def check_api_key(key: str) -> str:
    """An API key is 1..4096 printable ASCII characters without spaces (what a Bearer token can carry in an HTTP
    header on every client). An empty key would turn authentication off (`--api-key "$KEY"` with KEY unset); a
    non-ASCII one reaches the server as whatever bytes each client encodes it to."""
    if not key:
        raise UserError("the API key is empty (--api-key '' or an empty $CLOVER_GGUF_API_KEY): an empty key would "
                        "turn authentication off; give a key, or leave the option out")
    if len(key) > 4096 or not all("!" <= c <= "~" for c in key):
        raise UserError("the API key must be at most 4096 printable ASCII characters without spaces (a Bearer "
                        "token in an HTTP header)")
    return key


class RequireKey:
    """ASGI middleware: with an API key set, every path but /health (the API, /openapi.json) needs it. It runs
    before routing and before the body is read, so a request without the key learns nothing else (401 first)."""

    OPEN = frozenset({"/health"})

    def __init__(self, app: Any, api_key: str):
        self.app, self.key = app, check_api_key(api_key).encode("ascii")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            headers = Headers(scope=scope)
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
            # header values are bytes, which Starlette decodes as latin-1: encoded back, they are what was sent
            if not hmac.compare_digest(token.encode("latin-1", "replace"), self.key):
                body = _error_body("missing or wrong API key (send Authorization: Bearer KEY)",
                                   "authentication_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- one request, from its fields to its response ------------------------------------------------------------
class Watch:
    """Awaits things for one request, giving up (ClientGone) once its client has disconnected; checks at least
    every POLL_S, also while events keep arriving. A result that arrives after giving up goes to `orphan`
    (so an acquired slot is handed back, never lost)."""

    def __init__(self, request: Request):
        self.request = request
        self.checked = time.monotonic()

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
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if orphan is not None and task.done() and not task.cancelled() and task.exception() is None:
                orphan(task.result())
            raise


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
             controls=controls, max_tokens=req.max_tokens, stream=bool(req.stream))
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


def precheck(rt: Any, plan: Plan) -> None:
    """What can be refused without tokenizing, before the request takes a slot: a prompt whose least possible
    token count (CloverRuntime.least_prompt_tokens) with the tokens asked for (1 when unsaid) is past the context,
    and the request's mode and block size (check_request). The worker then checks the real count. Reads only what
    every slot shares (the template, the sizes), so it runs beside the slots' work."""
    if not hasattr(rt, "least_prompt_tokens"):  # a test's stand-in runtime
        return
    least = rt.least_prompt_tokens(plan.messages, plan.prompt, plan.think)
    block_size = int(plan.block_size or rt.block_size)
    rt.check_request(least, plan.max_tokens or 1, plan.mode, block_size, at_least=True)


async def _start(pool: Pool, watch: Watch, plan: Plan) -> tuple[Job, int]:
    """Wait for a slot, start the decode, wait until the request passed its checks -> (job, prompt tokens).
    Raises APIError for a refused request, ClientGone if the client left while waiting."""
    rt = await watch(pool.acquire(plan.messages), orphan=pool.release)
    job = pool.start(rt, plan)
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

    return JSONResponse(_error_body("client disconnected", "client_gone"), status_code=499)


async def _respond(request: Request, req: Any, chat: bool) -> Any:
    """Run one completion request: wait for a slot, decode, answer as one JSON body or as server-sent events."""
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, StreamingResponse

    state = _state(request)
    plan = plan_from(req, chat, state.default_mode)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    watch = Watch(request)
    try:
        # off the event loop (a template over 100,000 messages takes a moment), and before any slot is taken
        await watch(asyncio.to_thread(precheck, state.first, plan))
    except UserError as e:
        raise APIError(400, str(e)) from None
    except ClientGone:
        return _client_gone()
    try:
        job, _ = await _start(state.pool, watch, plan)
    except ClientGone:
        return _client_gone()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    now = int(time.time())
    if req.stream:
        agen = _sse(job, rid, now, state.name, chat, include_usage)
        return StreamingResponse(agen, media_type="text/event-stream", background=BackgroundTask(job.cancel),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    reasoning, content = [], []
    try:
        while True:
            ev = await watch(job.events.get())
            if ev[0] == "delta":
                reasoning.append(ev[1])
                content.append(ev[2])
            elif ev[0] == "done":
                break
            else:
                raise APIError(ev[1], ev[2], "server_error")
    except ClientGone:
        job.cancel()
        return _client_gone()
    except BaseException:
        job.cancel()
        raise
    _, finish, stats, usage = ev
    if chat:
        msg = {"role": "assistant", "content": "".join(content), "reasoning_content": "".join(reasoning)}
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": "".join(content), "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": now, "model": state.name, "choices": [choice], "usage": usage,
            "clover_stats": stats}
    return JSONResponse(body, headers={"X-Clover-Stats": json.dumps(stats, separators=(",", ":"))})


async def _sse(job: Job, rid: str, now: int, name: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        if chat:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]
        else:
            choices = [] if delta is None else [{"index": 0, "text": delta.get("content", ""), "logprobs": None,
                                                 "finish_reason": finish}]
        body = {"id": rid, "object": obj, "created": now, "model": name, "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await job.events.get()
            if ev[0] == "delta":
                if ev[1] and chat:
                    yield chunk({"reasoning_content": ev[1]})
                if ev[2]:
                    yield chunk({"content": ev[2]})
            elif ev[0] == "done":
                _, finish, stats, usage = ev
                if include_usage:
                    yield chunk({}, finish, clover_stats=stats)
                    yield chunk(None, usage=usage)
                else:
                    yield chunk({}, finish, usage=usage, clover_stats=stats)
                break
            else:
                err = _error_body(ev[2], "server_error" if ev[1] >= 500 else "invalid_request_error")
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
                    "kept_messages": len(getattr(rt, "served", None) or [])})
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
    if not _is_loopback(host) and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    sock = bind(host, port)  # before the model loads: a port in use is one line, not a minute later
    try:
        app = create_app(model, mode=mode, api_key=api_key, parallel=parallel, ctx=ctx, model_id=model_id,
                         runtime_kwargs=runtime_kwargs)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        url = listen_url(host, sock)

        class Server(uvicorn.Server):  # uvicorn names no address for sockets it is given: say it once it serves
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started:
                    logging.getLogger("uvicorn.error").info(
                        "listening on %s (OpenAI base URL %s/v1; Ctrl-C to stop)", url, url)

        Server(config).run(sockets=[sock])
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
