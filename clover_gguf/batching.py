"""One llama.cpp context for every slot of a server, and a scheduler that batches the slots' passes.

Each slot keeps its own runtime (CloverRuntime over a SlotContext) and runs `decoding.generate` unchanged on its own
thread; its passes go to the Scheduler instead of llama.cpp. A step of the scheduler waits until every slot that is
decoding a request (from its first pass on) has handed in its next pass (or `window` seconds went by), then runs
them:
- every causal pass whose only row is its last token's (an AR step, a prompt or a chunk of one) goes into ONE
  llama_decode, each slot on its own sequences, each row selected by its own sequence's sampler
  (LlamaContext.decode_parts); llama.cpp splits it into ubatches of equal tokens per sequence, so the slots' AR
  steps share one graph, and so do the first tokens of prompts that arrive together;
- every other pass (a block pass, a commit or verification with a row per token) is its own llama_decode: a block is
  a ubatch of its own anyway (patches/0006).
A prompt goes in chunks of at most `prefill_chunk` tokens, one per step, so it does not stall the others.
Memory operations (sequence copies and removals) run at once, under the same lock as the decodes.

Each pass is charged its share of the llama_decode it ran in (by tokens: an AR step decoded with seven others costs
an eighth of that decode, a block pass its own decode), and a slot's `cost_clock` adds up its charges: auto
(clover_gguf.auto) times a slot's passes on it, so with several busy slots AR steps cost what they add to the shared
step while a draft's block passes cost their whole decodes, and each slot's choice weighs that (docs/serve.md).

Sequences: slot i owns `seqs_per_slot` consecutive sequence ids from i * seqs_per_slot (runtime.SEQ_*); a SlotContext
translates them, so the runtime's code is the same as with a context of its own (docs/serve.md)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from clover_gguf.controls import Gather
from clover_gguf.errors import UserError
from clover_gguf.llama_context import LlamaContext
from clover_gguf.state_cache import State


class Cancelled(Exception):
    """The request a slot serves was cancelled (its client went away) between two chunks of its prompt."""


class _Pass:
    """One pass a slot handed in: a causal part (ids, first position, sequence, gather or None) whose only row, if
    any, is its last token's, which can share a decode with other slots' parts; or a call to run alone."""

    __slots__ = ("part", "fn", "result", "error", "done", "seconds")

    def __init__(self, part: tuple[list[int], int, int, Gather | None] | None = None,
                 fn: Callable[[], Any] | None = None):
        self.part, self.fn = part, fn
        self.result: Any = None
        self.error: BaseException | None = None
        # set when the pass ran: each slot waits on its own pass, so a step wakes the slots it served and a pass
        # handed in wakes the scheduler alone (one shared condition woke every waiting slot at each)
        self.done = threading.Event()
        self.seconds = 0.0  # its share of the llama_decode it ran in

    @property
    def tokens(self) -> int:
        return len(self.part[0]) if self.part is not None else 1

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Scheduler:
    """Runs the passes of every slot on one LlamaContext, a step at a time (module doc)."""

    def __init__(self, ctx: LlamaContext, n_seq_max: int, prefill_chunk: int | None = None, window: float = 0.03):
        self.ctx, self.n_seq_max = ctx, n_seq_max
        self._slots = self._open = 0  # slots given out (slot()), and not closed yet
        self.prefill_chunk = max(1, int(prefill_chunk or ctx.n_ubatch))
        self.window = window  # the longest a step waits for serving slots that have not handed in a pass yet
        self.lock = threading.Lock()  # held while llama.cpp runs (decodes, memory operations)
        self._cond = threading.Condition()  # the scheduler's: passes handed in, slots joining and leaving, close
        self._pending: list[_Pass] = []
        self._serving = 0  # slots inside a request (serving())
        self._closed = False
        # counters (tests, /metrics): steps, llama_decode calls, one-token parts merged, the most parts in one decode;
        # seconds the steps waited for slots' passes after the first came in, and seconds they ran in llama.cpp
        self.steps = self.decodes = self.merged_tokens = self.widest = 0
        self.wait_seconds = self.run_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="clover-batch", daemon=True)
        self._thread.start()

    # ---- what slots call ------------------------------------------------------------------------------------
    def join(self) -> None:
        """A slot decodes a request: steps wait for its passes (SlotContext.serving, from its first pass on)."""
        with self._cond:
            self._serving += 1

    def leave(self) -> None:
        with self._cond:
            self._serving -= 1
            self._cond.notify_all()

    def run(self, p: _Pass) -> Any:
        """Hand in a pass and wait for its step -> its result (or its exception, raised here)."""
        with self._cond:
            if self._closed:
                raise UserError("the model was closed")
            self._pending.append(p)
            self._cond.notify()
        p.done.wait()
        if p.error is not None:
            raise p.error
        return p.result

    def now(self, fn: Callable[[], Any]) -> Any:
        """Run a memory operation at once, between decodes."""
        with self.lock:
            return fn()

    def slot(self, seqs_per_slot: int, n_ctx: int) -> "SlotContext":
        """The next slot's view of the context (sequence ids from slot * seqs_per_slot); the context closes with the
        last slot (SlotContext.close)."""
        with self._cond:
            i = self._slots
            if (i + 1) * seqs_per_slot > self.n_seq_max:
                raise ValueError(f"slot {i} needs sequences up to {(i + 1) * seqs_per_slot}, the context has "
                                 f"{self.n_seq_max}")
            self._slots += 1
            self._open += 1
        return SlotContext(self, i, seqs_per_slot, n_ctx)

    def release(self) -> None:
        with self._cond:
            self._open -= 1
            last = self._open == 0
        if last:
            self.close()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self.lock:
            self.ctx.close()

    # ---- the steps ------------------------------------------------------------------------------------------
    def _take(self) -> list[_Pass] | None:
        """Wait for a step's passes: every serving slot's, or what came within `window` of the first."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            t0 = time.monotonic()
            deadline = t0 + self.window
            while not self._closed and len(self._pending) < self._serving:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._closed:
                for p in self._pending:
                    p.finish(error=UserError("the model was closed"))
                self._pending = []
                return None
            batch, self._pending = self._pending, []
            self.wait_seconds += time.monotonic() - t0
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            parts = [p for p in batch if p.part is not None]
            try:
                with self.lock:
                    t0 = time.monotonic()
                    self.steps += 1
                    if parts:
                        self._decode_parts(parts)
                    for p in batch:
                        if p.fn is not None:
                            self._finish([p], lambda p=p: [p.fn()])
                    self.run_seconds += time.monotonic() - t0
            except BaseException as e:  # a bug here must not leave the slots waiting forever
                for p in batch:
                    if not p.done.is_set():
                        p.finish(error=e)

    def _decode_parts(self, parts: list[_Pass]) -> None:
        """One llama_decode for all (more only when they pass its batch or row limits)."""
        ctx, call, n = self.ctx, [], 0
        for p in parts + [None]:
            k = len(p.part[0]) if p is not None else 0
            if call and (p is None or n + k > ctx.n_batch or len(call) >= ctx.n_outputs_max):
                self.widest = max(self.widest, len(call))
                self.merged_tokens += sum(len(q.part[0]) == 1 for q in call)
                self._finish(call, lambda call=call: ctx.decode_parts([q.part for q in call]))
                call, n = [], 0
            if p is not None:
                call.append(p)
                n += k

    def _finish(self, passes: list[_Pass], fn: Callable[[], list[Any]]) -> None:
        self.decodes += 1
        t0 = time.perf_counter()
        try:
            results = fn()
        except BaseException as e:  # every pass of the decode fails with it; the server answers 500 for each
            for p in passes:
                p.finish(error=e)
        else:
            took, tokens = time.perf_counter() - t0, sum(p.tokens for p in passes)
            for p, r in zip(passes, results):
                p.seconds = took * p.tokens / tokens
                p.finish(result=r)


class SlotContext:
    """What a runtime needs of a LlamaContext, for one slot of a shared one: sequence ids translated into the slot's
    range, decodes through the Scheduler, everything else (tokenizer, metadata, sizes) from the shared context."""

    def __init__(self, sched: Scheduler, slot: int, seqs_per_slot: int, n_ctx: int):
        self.scheduler, self._shared = sched, sched.ctx
        self._base, self._n_seqs = slot * seqs_per_slot, seqs_per_slot
        self.n_ctx = n_ctx  # this slot's share of the context's cells
        self._closed = False
        self._cancelled: Callable[[], bool] | None = None
        self._serving = self._joined = False  # inside serving(); counted by the scheduler's steps
        self.charged = 0.0  # seconds of llama_decode charged to this slot's passes (cost_clock)

    def cost_clock(self) -> float:
        """The seconds of llama.cpp work this slot's passes were charged so far (module doc): auto's clock."""
        return self.charged

    def __getattr__(self, name: str) -> Any:  # the tokenizer, metadata and sizes of the shared context
        return getattr(self._shared, name)

    def _seq(self, seq: int) -> int:
        if not 0 <= seq < self._n_seqs:
            raise ValueError(f"sequence {seq} is not one of this slot's {self._n_seqs}")
        return self._base + seq

    def _check_open(self) -> None:
        if self._closed:
            raise UserError("the model was closed")

    @contextlib.contextmanager
    def serving(self, cancelled: Callable[[], bool] | None = None) -> Iterator[None]:
        """The slot serves a request (the scheduler's steps wait for its passes); `cancelled` is asked between the
        chunks of a long prompt, so a request whose client went away frees the slot within one chunk (Cancelled)."""
        self._cancelled, self._serving = cancelled, True
        try:
            yield
        finally:
            self._cancelled, self._serving = None, False
            if self._joined:
                self._joined = False
                self.scheduler.leave()

    def _run(self, p: _Pass) -> Any:
        # the steps wait for this slot from its first pass on, not while it renders and tokenizes its prompt (other
        # slots would wait for that)
        if self._serving and not self._joined:
            self._joined = True
            self.scheduler.join()
        try:
            return self.scheduler.run(p)
        finally:
            self.charged += p.seconds

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """The shared context's (all slots')."""
        return self.scheduler.now(self._shared.memory_breakdown)

    def decode(self, ids: Sequence[int], pos0: int, seq: int = 0, logits: bool | Sequence[bool] = True,
               extra: Sequence[tuple[Sequence[int], int, int]] = (), gather: Gather | None = None) -> Any:
        self._check_open()
        if extra:
            raise ValueError("a slot decodes its own sequences one at a time")
        s, ctx, sched = self._seq(seq), self._shared, self.scheduler
        ids = [int(t) for t in ids]
        flags = [bool(logits)] * len(ids) if isinstance(logits, bool) else [bool(f) for f in logits]
        if not ids or any(flags[:-1]) or (flags[-1] and gather is None):  # rows before the last: a pass alone
            return self._run(_Pass(fn=lambda: ctx.decode(ids, pos0, s, logits=flags, gather=gather)))
        # an AR step or a prompt (its only row the last token's): parts that share the steps' decodes, a chunk of
        # a long prompt per step
        if gather is not None and not flags[-1]:  # the first part of a prompt kept in parts (LlamaContext.attach)
            self._run(_Pass(fn=lambda: ctx.attach(s, gather)))
        c = sched.prefill_chunk
        for k in range(0, len(ids), c):
            if k and self._cancelled is not None and self._cancelled():
                raise Cancelled("the request was cancelled")
            last = k + c >= len(ids)
            out = self._run(_Pass(part=(ids[k:k + c], int(pos0) + k, s, gather if last and flags[-1] else None)))
        return out

    def block(self, block_ids: Sequence[int], n_past: int, seq: int = 0, scratch: int = 1,
              positions: Sequence[int] | None = None, gather: Gather | None = None) -> Any:
        self._check_open()
        s, sc, ctx = self._seq(seq), self._seq(scratch), self._shared
        return self._run(_Pass(fn=lambda: ctx.block(block_ids, n_past, seq=s, scratch=sc, positions=positions,
                                                    gather=gather)))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        self._check_open()
        s = self._seq(seq)
        return self.scheduler.now(lambda: self._shared.seq_rm(s, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        self._check_open()
        a, b = self._seq(src), self._seq(dst)
        self.scheduler.now(lambda: self._shared.seq_cp(a, b))

    def state_seq_get(self, seq: int) -> State:
        s = self._seq(seq)
        return self.scheduler.now(lambda: self._shared.state_seq_get(s))

    def state_seq_set(self, seq: int, state: State) -> None:
        s = self._seq(seq)
        self.scheduler.now(lambda: self._shared.state_seq_set(s, state))

    def clear(self) -> None:
        """This slot's sequences emptied (the others' are not this slot's to clear)."""
        for seq in range(self._n_seqs):
            self.seq_rm(seq)

    def set_block_attn(self, seq: int, enabled: bool = True) -> None:
        s = self._seq(seq)
        self.scheduler.now(lambda: self._shared.set_block_attn(s, enabled))

    def close(self) -> None:
        """The slot is done; the shared context closes with the last slot."""
        if not self._closed:
            self._closed = True
            self.scheduler.release()
