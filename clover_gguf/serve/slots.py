"""The model work of `serve`, on worker threads: a request's Plan, the Job that carries its events to the event loop,
the slots (runtimes) and the FIFO of requests waiting for one.

The app holds `parallel` CloverRuntimes ("slots") on one llama.cpp context. A request waits in a FIFO queue for a free
slot, and its whole decode runs on one worker thread with that slot to itself, so requests never share decoding
state. The worker hands the slot back only when it has stopped touching the runtime, also when the client went away:
a disconnect sets a cancel flag that the worker checks between chunks. Text processing (reasoning split, stop
strings) happens on the worker too, so the decode stops right where a stop string appears and the stats describe
exactly the work done.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from clover_gguf import grammar
from clover_gguf.batching import Cancelled
from clover_gguf.errors import UserError
import clover_gguf.serve.tools as tools
from clover_gguf.serve.metrics import Metrics
from clover_gguf.thinking import ThinkSplitter

log = logging.getLogger("clover_gguf.serve")


@dataclass
class Plan:
    """One request, as the worker runs it."""

    prompt: str | None = None  # raw prompt (completions) ...
    messages: list[dict[str, Any]] | None = None  # ... or chat messages, rendered with the GGUF's template
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
    blocks: bool = False  # clover_blocks: the decoder's pass events go to the stream (BlockEvents)
    # tool calls (clover_gguf.serve.tools): the request's tools, tool_choice (auto, none, required, named) and its
    # function, parallel_tool_calls, and the tools the chat template is given (None: none, or written as messages)
    tools: list[Any] = field(default_factory=list)
    tool_mode: str = "none"
    tool_name: str | None = None
    parallel: bool = True
    template_tools: list[dict] | None = None
    grammar_body: str | None = None  # the Lark rules of the body the answer must be (clover_gguf.grammar)
    logprobs: int | None = None  # None: off; N: each token's logprob and its N most likely alternatives
    ignore_eos: bool = False  # the end tokens never chosen: the answer runs to max_tokens (or the context's end)
    forced: bool = True  # tokens a grammar forces placed without a pass (decoding.generate's `forced`)


class ClientGone(Exception):
    """The client disconnected while its request waited."""


AR_RUN = 32  # AR steps summed into one block-view event at most (a block's worth: the strip grows as AR answers go)
FRAME_S = 0.02  # block-view events go out at once when the last went out this long ago (a browser draws every 16 ms)


class BlockEvents:
    """The block view of one job (clover_blocks): decoding.generate's pass events for the stream, as ("blocks",
    [events]). A pass goes out as it happens when the previous post is FRAME_S old (the 35B's passes take longer:
    each is seen live), else with the next text the worker sends (flush), so that a small model's millisecond passes
    cost one chunk per piece of text, not one per pass. AR steps are summed into one {"type": "ar", "steps",
    "tokens", "texts"} event per run of them (closed by the next other event, by AR_RUN steps, or by the end); the
    tokens a grammar forced after a step's token follow it in `tokens`, and `forced` counts them."""

    def __init__(self, job: "Job", clock: Callable[[], float] = time.monotonic):
        self.job, self.clock, self.ar, self.pending = job, clock, [], []
        self.posted = clock()

    def __call__(self, ev: dict) -> None:
        if ev["type"] == "ar":
            self.ar.append(ev)
            if len(self.ar) >= AR_RUN:
                self._close_run()
        else:
            self._close_run()
            self.pending.append(ev)
        if self.pending and self.clock() - self.posted >= FRAME_S:
            self.flush()

    def _close_run(self) -> None:
        if self.ar:
            run = {"type": "ar", "steps": len(self.ar), "tokens": [t for e in self.ar for t in
                                                                    [e["token"], *e.get("forced", ())]]}
            if all("text" in e for e in self.ar):
                run["texts"] = [t for e in self.ar for t in [e["text"], *e.get("forced_texts", ())]]
            forced = sum(len(e.get("forced", ())) for e in self.ar)
            if forced:  # tokens a grammar forced, carried by the steps' passes (in `tokens`)
                run["forced"] = forced
            self.pending.append(run)
            self.ar = []

    def flush(self, end: bool = False) -> None:
        """Post what is pending (end: the answer is over, its last AR run too)."""
        if end:
            self._close_run()
        if self.pending:
            self.job.emit("blocks", self.pending)
            self.pending = []
        self.posted = self.clock()


class Job:
    """One request on one slot. The worker thread emits events into an asyncio queue:
    ("started", prompt_tokens), ("delta", reasoning, content, logprobs), ("call", tools.Call), ("blocks", [pass
    events]) (clover_blocks), ("done", finish_reason, stats, usage), ("error", http_status, message). `logprobs`: None,
    or the entries (logprob_entries) of the tokens decoded since the last delta. `cancel()` (any thread) makes the
    worker stop at the next chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool = True):
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.stream = stream
        self._held: tuple | None = None  # not streamed: the delta so far, posted with the next other event
        self._last: list[tuple] = []  # the answer's last events, posted once its slot is free again (finish())

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, *event: Any) -> None:
        if event[0] == "delta" and not self.stream:  # one event loop wake-up per answer, not one per token
            r, c, lp = self._held or ("", "", None)
            if event[3] is not None:
                lp = (lp or []) + event[3]
            self._held = (r + event[1], c + event[2], lp)
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


def _run_job(rt: Any, job: Job, plan: Plan, metrics: Metrics | None = None,
             engine: Callable[[], Any] | None = None) -> None:
    """The worker: everything that touches the runtime happens here, on one thread, with the slot held. engine:
    the grammar engine of this model (made on first use), for a plan with a grammar."""
    try:
        finish, stats = _decode(rt, job, plan, engine)
        if metrics is not None:
            metrics.record(plan.mode, finish, stats)
    except (UserError, grammar.GrammarError) as e:
        if metrics is not None:
            metrics.record(plan.mode, "refused")
        # a prompt past the context: its token count and the context's size go with the refusal (serve.core)
        sizes = {k: getattr(e, k) for k in ("n_prompt_tokens", "n_ctx") if getattr(e, k, None) is not None}
        job.emit("error", 400, str(e), *([sizes] if sizes else []))
    except Cancelled as e:  # the client went away during a long prompt (nobody reads this answer)
        if metrics is not None:
            metrics.record(plan.mode, "cancelled")
        job.emit("error", 400, str(e))
    except Exception as e:  # a bug or a llama.cpp failure: the request fails, the server keeps serving
        log.exception("request failed")
        if metrics is not None:
            metrics.record(plan.mode, "error")
        job.emit("error", 500, f"internal error: {type(e).__name__}: {e}")


def _decode(rt: Any, job: Job, plan: Plan, engine: Callable[[], Any] | None = None) -> tuple[str, dict]:
    """-> (finish reason, the stats as JSON)."""
    keep = None  # a chat request keeps the state after its messages for the conversation's next request (this slot)
    tools_kw = {"tools": plan.template_tools} if plan.template_tools else {}
    if plan.messages is not None and getattr(rt, "keeps_prefix", False):
        ids, keep = rt.prompt_and_keep(plan.messages, think=plan.think, **tools_kw)
    elif plan.messages is not None:
        ids = rt.prompt_ids(plan.messages, think=plan.think, **tools_kw)
    else:
        ids = rt.raw_prompt_ids(plan.prompt or "")
    if not ids:
        raise UserError("the prompt is empty")
    block_size = int(plan.block_size or rt.block_size)
    limit = min(rt.context_length, rt.n_ctx)
    room = block_size - 1 if plan.mode != "ar" else 0
    # max_tokens past what the context has left (agents send 32000 whatever the context) is taken: the answer
    # stops at the context's end (finish `length`); only a prompt that leaves no room for one token is refused
    left = limit - len(ids) - room
    max_new = max(1, min(plan.max_tokens, left) if plan.max_tokens is not None else left)
    rt.check_request(len(ids), max_new, plan.mode, block_size)
    opens = rt.thinking_at_start(ids)
    extra: dict[str, Any] = {}
    if plan.grammar_body is not None:  # a fresh state of the answer's grammar (compiled once per engine)
        thinking = "open" if opens else "optional" if plan.think and plan.messages is not None else "none"
        extra["constraint"] = engine().constraint(grammar.source(plan.grammar_body, thinking))
    if plan.logprobs is not None:
        extra["logprobs"] = plan.logprobs
    if plan.ignore_eos:
        extra["ignore_eos"] = True
    if not plan.forced:
        extra["forced"] = False
    job.emit("started", len(ids))

    # chat: thinking and answer split by the one rule (clover_gguf.thinking), then the answer's tool calls
    # (clover_gguf.serve.tools); completions: the raw text
    # a constrained answer is the grammar's text whole: a tag inside it is text (a JSON string took `<think>`)
    parser = ThinkSplitter(opens, stop=plan.stop, tags=plan.messages is not None, reopen=plan.grammar_body is None)
    calls = (tools.CallParser(plan.tools, plan.parallel) if plan.messages is not None and plan.tool_mode != "none"
             else None)
    eos = frozenset(getattr(rt, "eos_ids", ()) or ())
    controls = dataclasses.replace(rt.controls, **plan.controls) if plan.controls else None
    if keep is not None:
        extra["keep"] = keep
    blocks = BlockEvents(job) if plan.blocks else None
    if blocks is not None:
        extra["observe"] = blocks
    gen = rt.stream_pieces(ids, mode=plan.mode, max_new_tokens=max_new, block_size=block_size, threshold=plan.threshold,
                           accept=plan.accept, temp=plan.temp, top_p=plan.top_p, top_k=plan.top_k, seed=plan.seed,
                           controls=controls, **extra)
    stats = None
    finish = "cancelled"

    def emit(r: str, c: str, lp: list | None, final: bool = False) -> None:
        events = [("content", c)] if calls is None else calls.feed(c) + (calls.close() if final else [])
        for e in events:
            if e[0] == "content":
                c, e = e[1], None
            else:
                c = ""
            if r or c or lp:
                job.emit("delta", r, c, lp)
                r, lp = "", None
            if e is not None:
                job.emit("call", e[1])
        if r or lp:
            job.emit("delta", r, "", lp)

    try:
        for piece in gen:
            stats = piece.stats
            if blocks is not None:  # this piece's passes before its text
                blocks.flush()
            if job.cancelled:
                break
            r, c = parser.feed(piece.text)
            lp = logprob_entries(rt, piece, eos, plan.logprobs) if plan.logprobs is not None else None
            emit(r, c, lp, final=parser.stopped)
            if parser.stopped:
                finish = "stop"
                break
        else:
            finish = "length" if stats is not None and stats.finish_reason == "length" else "stop"
            r, c = parser.close()
            emit(r, c, None, final=True)
    finally:
        gen.close()
    if blocks is not None:
        blocks.flush(end=True)
    if calls is not None and calls.calls and finish == "stop":
        finish = "tool_calls"
    st = stats.to_json() if stats is not None else {"mode": plan.mode, "prompt_tokens": len(ids),
                                                   "generated_tokens": 0}
    if parser.matched is not None:
        st["stop_string"] = parser.matched
    n_gen = int(st.get("generated_tokens", 0))
    usage = {"prompt_tokens": len(ids), "completion_tokens": n_gen, "total_tokens": len(ids) + n_gen,
             # OpenAI's field for prompt tokens served from a cache: here, continued from the slot's kept state
             "prompt_tokens_details": {"cached_tokens": int(st.get("reused_tokens", 0) or 0)}}
    if keep is not None:  # this slot now holds the state after these messages (_FreeSlots steers their sequel here)
        rt.served = served_key(plan)
    job.emit("done", finish, st, usage)
    return finish, st


def served_key(plan: Plan) -> list:
    """What a slot that served `plan` holds the state of, as _continues compares it: its messages (tool calls and
    tool results included), after the tools the template was given (a first item, so another tool list differs)."""
    head = [{"tools": plan.template_tools}] if plan.template_tools else []
    return head + list(plan.messages or [])


def logprob_entries(rt: Any, piece: Any, eos: frozenset, top: int) -> list[dict]:
    """A Piece's logprobs (runtime.Piece.logprobs: one TokenLogprob per token) as OpenAI's chat entries: token text,
    logprob, its UTF-8 bytes and the `top` most likely alternatives; end tokens are left out, as OpenAI does."""
    out = []
    for lp in getattr(piece, "logprobs", None) or []:
        if lp.token in eos:
            continue
        b = token_bytes(rt, lp.token)
        alts = []
        for t, v in list(lp.top)[:top]:
            tb = token_bytes(rt, t)
            alts.append({"token": tb.decode("utf-8", "replace"), "logprob": float(v), "bytes": list(tb)})
        out.append({"token": b.decode("utf-8", "replace"), "logprob": float(lp.logprob), "bytes": list(b),
                    "top_logprobs": alts})
    return out


def token_bytes(rt: Any, token: int) -> bytes:
    """A token's bytes as the runtime writes it (special tokens as their text)."""
    ctx = getattr(rt, "ctx", None)
    if ctx is not None and hasattr(ctx, "token_to_piece"):
        return ctx.token_to_piece(int(token), special=True)
    return rt.detokenize([int(token)]).encode("utf-8")


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
        try:
            return await fut
        except asyncio.CancelledError:
            # handed a slot (put_nowait) and cancelled (its client left) in the same loop turn: the task ends
            # cancelled with the slot in its future, so the slot goes on to the next waiter or back to the free ones
            if fut.done() and not fut.cancelled():
                self.put_nowait(fut.result())
            raise

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
        self._engine: Any = None
        self._engine_lock = threading.Lock()

    def grammar_engine(self) -> Any:
        """The grammar engine over this model's vocabulary (clover_gguf.grammar), made on first use (seconds at the
        35B's vocabulary) and shared by the slots."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = grammar.Engine(grammar.Vocabulary.of(self.runtimes[0]))
            return self._engine

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
                    _run_job(rt, job, plan, self.metrics, self.grammar_engine)
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
