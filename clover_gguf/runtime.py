"""Clover on the patched llama.cpp: the decoding Backend over a LlamaContext, and a small session API that turns
text into answers with the GGUF's chat template, Clover's controls and per-run stats.

Rollback strategies for draft-self (rejected draft tokens must leave no trace in the KV cache or recurrent state):
- "redecode": before each commit the sequence is copied to a backup sequence (KV metadata only with a unified cache;
  the recurrent state is copied on write, one state per sequence: about 63 MiB on the 35B shape); a rejection
  restores the backup and re-decodes the kept tokens (one extra causal pass over them).
- "snapshot": llama.cpp also keeps n_rs_seq = block_size + 1 recurrent-state snapshots (about 63 MiB each on the
  35B shape, so about 2 GiB) and rolls back by removing the tail positions. Measured here: a pending snapshot
  rollback does not survive a sequence copy (a block pass right after it sees the un-rolled-back state), and no
  snapshot holds the state from before a ubatch's first token. So the cut is made one token deeper and that token is
  re-decoded (one 1-token pass); when that would reach the commit's first token, the backup path above is used.
bench/decode.py measures both.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from clover_gguf import decoding
from clover_gguf.controls import Controls, make_processors, make_sampler, thinking_span
from clover_gguf.errors import UserError
from clover_gguf.llama_context import LlamaContext
from clover_gguf.offload import Offload

SEQ_MAIN, SEQ_BLOCK, SEQ_BACKUP = 0, 1, 2
N_SEQ = 3
DEFAULT_CTX = 8192  # context when none is asked for (capped by the model's)
ROLLBACKS = ("redecode", "snapshot")


class LlamaBackend:
    """decoding.Backend on sequence 0 of a LlamaContext; block passes on sequence 1 (see LlamaContext.block)."""

    def __init__(self, ctx: LlamaContext, mask_token_id: int, eos_ids: Sequence[int], block_size: int,
                 rollback: str = "redecode"):
        if rollback not in ROLLBACKS:
            raise UserError(f"unknown rollback strategy {rollback!r}: choose {' or '.join(ROLLBACKS)}")
        self.ctx = ctx
        self.mask_token_id = int(mask_token_id)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.block_size = int(block_size)
        self.rollback_strategy = rollback
        self.keep_backup = True  # only draft-self rolls back; the runtime turns the backup copy off otherwise
        self.extra_passes = 0  # re-decodes done for rollbacks (backend work the decoder does not count)
        self.prefill_seconds = 0.0  # time spent in prompt passes, so stats can report the decode rate alone
        self.reset()

    def reset(self) -> None:
        self.ctx.clear()
        self._ids: list[int] = []
        self._last_commit = 0
        self._pending_rollback = 0

    def _settle(self) -> None:
        """Apply a rollback that was asked for, before anything reads or extends the state. Deferred because an
        answer ends with one (its end token is rolled back), and a reset that follows makes it unnecessary."""
        n, self._pending_rollback = self._pending_rollback, 0
        if n:
            self._apply_rollback(n)

    def commit(self, ids: Sequence[int]) -> np.ndarray:
        self._settle()
        if self.keep_backup:  # both strategies keep the backup for rollbacks no snapshot covers
            self.ctx.seq_rm(SEQ_BACKUP)
            self.ctx.seq_cp(SEQ_MAIN, SEQ_BACKUP)
        logits = self.ctx.decode(ids, self.n_past, SEQ_MAIN)  # [len(ids), V]
        self._ids += [int(t) for t in ids]
        self._last_commit = len(ids)
        return logits

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self._settle()
        t0 = time.perf_counter()
        want = [False] * (len(ids) - 1) + [True]
        logits = self.ctx.decode(ids, self.n_past, SEQ_MAIN, logits=want)
        self.prefill_seconds += time.perf_counter() - t0
        self._ids += [int(t) for t in ids]
        self._last_commit = len(ids)
        return logits[-1]

    def block_logits(self, block: Sequence[int]) -> np.ndarray:
        self._settle()
        return self.ctx.block(block, self.n_past, seq=SEQ_MAIN, scratch=SEQ_BLOCK)

    @property
    def n_past(self) -> int:
        return len(self._ids) - self._pending_rollback

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._pending_rollback or n > self._last_commit:
            raise ValueError("rollback reaches past the latest commit")
        self._pending_rollback = n

    def _apply_rollback(self, n: int) -> None:
        keep_total = len(self._ids) - n
        if self.rollback_strategy == "snapshot" and n <= self._last_commit - 2:
            # cut one token deeper and re-decode it, so the snapshot is applied before any sequence copy
            cut = keep_total - 1
            if not self.ctx.seq_rm(SEQ_MAIN, cut, -1):
                raise RuntimeError("llama.cpp refused the snapshot rollback (n_rs_seq too small?)")
            self.ctx.decode([self._ids[cut]], cut, SEQ_MAIN, logits=False)
            self._ids = self._ids[:keep_total]
        else:  # back to the copy taken before the commit, then re-decode what is kept of it
            if not self.keep_backup:
                raise RuntimeError("rollback without a backup: set keep_backup before committing a draft")
            start = len(self._ids) - self._last_commit
            kept = self._ids[start:keep_total]
            self.ctx.seq_rm(SEQ_MAIN)
            self.ctx.seq_cp(SEQ_BACKUP, SEQ_MAIN)
            self._ids = self._ids[:start]
            if kept:
                self.ctx.decode(kept, start, SEQ_MAIN, logits=False)
                self._ids += kept
        self.extra_passes += 1
        self._last_commit = 0


def context_settings(max_block_size: int, n_ctx: int | None, context_length: int, rollback: str = "redecode",
                     exact: bool = False) -> dict:
    """The LlamaContext settings of a runtime; `clover-gguf fit` predicts memory from these same settings.

    Three sequences (main, block scratch, draft-self's rollback backup), one unified KV cache; a ubatch holds a
    whole block; logits rows for one block (a prompt needs 1, a block pass or a committed block block_size);
    snapshot rollback keeps block_size + 1 recurrent-state snapshots per sequence."""
    return dict(n_ctx=min(n_ctx or DEFAULT_CTX, context_length), n_ubatch=max(512, max_block_size),
                n_seq_max=N_SEQ, n_rs_seq=max_block_size + 1 if rollback == "snapshot" else 0,
                n_outputs_max=max_block_size, exact=exact)


# ---------------------------------------------------------------------------------------------------------------
# The model as a user sees it
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class RunStats:
    mode: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0
    tokens_per_pass: float = 0.0
    acceptance_rate: float | None = None
    time_to_first_token_s: float | None = None
    tokens_per_s: float = 0.0  # generated tokens over the whole run, the prompt's pass included
    decode_tokens_per_s: float = 0.0  # generated tokens over the time after the prompt's pass (llama.cpp "eval")
    prompt_seconds: float = 0.0
    seconds: float = 0.0
    peak_memory_mib: float = 0.0
    finish_reason: str | None = None
    rollback_passes: int = 0


@dataclass
class Answer:
    text: str  # the answer, thinking removed
    thinking: str
    stats: RunStats
    raw: str = field(repr=False, default="")

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "thinking": self.thinking, "stats": asdict(self.stats)}


def split_thinking(raw: str) -> tuple[str, str]:
    """-> (thinking, answer). A <think> span may be opened by the prompt, so a lone </think> also splits."""
    if "</think>" in raw:
        head, _, tail = raw.partition("</think>")
        return head.replace("<think>", "").strip(), tail.strip()
    if raw.lstrip().startswith("<think>"):
        return raw.replace("<think>", "", 1).strip(), ""
    return "", raw.strip()


class CloverRuntime:
    """A Clover GGUF loaded once; `generate` / `stream` answer chat messages in any mode."""

    def __init__(self, gguf: str | Path, n_ctx: int | None = None, rollback: str = "redecode",
                 coreset: bool | None = None, coreset_top_p: float | None = None, exact: bool = False,
                 n_threads: int | None = None, n_threads_batch: int | None = None, offload: Offload | None = None,
                 block_size: int | None = None):
        """block_size: the largest block a request may use (default: the GGUF's); the context keeps logits rows
        for that many tokens and no more (see context_settings)."""
        from clover_gguf.gguf_header import read_header

        path = Path(gguf)
        if not path.is_file():
            raise UserError(f"no such model file: {path}")
        try:
            meta = read_header(path).kv
        except UserError as e:
            raise UserError(f"{path} is not a readable GGUF file ({e})") from None
        if meta.get("general.architecture") != "clover":
            raise UserError(f"{path} is not a Clover GGUF (architecture {meta.get('general.architecture')!r})")
        self.meta = meta
        self.path = path
        self.block_mode = bool(meta.get("clover.block_mode", False))
        self.context_length = int(meta.get("clover.context_length", 4096))
        self.block_size = int(meta.get("clover.diffusion.block_size", 32))
        self.threshold = float(meta.get("clover.diffusion.threshold", 0.95))
        self.mask_token_id = meta.get("tokenizer.ggml.mask_token_id")
        self.chat_template = meta.get("tokenizer.chat_template")
        self._template = None
        self.controls = Controls.from_meta(lambda k: None if meta.get(k) is None else str(meta[k]))
        overrides: dict[str, bool | float] = {}
        if coreset is not None:
            overrides["clover.moe_block_coreset.enabled"] = coreset
        if coreset_top_p is not None:
            overrides["clover.moe_block_coreset.top_p"] = coreset_top_p
        self.max_block_size = max(int(block_size or 0), self.block_size)
        settings = context_settings(self.max_block_size, n_ctx, self.context_length, rollback, exact)
        self.ctx = LlamaContext(path, overrides=overrides or None, n_threads=n_threads,
                                n_threads_batch=n_threads_batch, offload=offload, **settings)
        self.n_ctx = self.ctx.n_ctx
        self.eos_ids = self._end_tokens()
        self.think_id = self._special("<think>")
        self.think_end_id = self._special("</think>")
        self.backend = LlamaBackend(self.ctx, self.mask_token_id if self.mask_token_id is not None else -1,
                                    self.eos_ids, self.block_size, rollback=rollback)

    def _end_tokens(self) -> list[int]:
        L, vocab = self.ctx.L, self.ctx.vocab
        return [t for t in range(self.ctx.n_vocab) if L.llama_vocab_is_eog(vocab, t)]

    def _special(self, text: str) -> int | None:
        ids = self.ctx.tokenize(text, special=True)
        return ids[0] if len(ids) == 1 else None

    # ---- prompts ----------------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, str]], think: bool = True) -> str:
        if not self.chat_template:
            return "".join(m["content"] for m in messages)
        if self._template is None:  # compiled once: compiling costs more than a forward pass of a small model
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=list(messages), add_generation_prompt=True, enable_thinking=think)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.ctx.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")

    # ---- checks -----------------------------------------------------------------------------------------
    def check_request(self, n_prompt: int, max_new_tokens: int, mode: str, block_size: int) -> None:
        if mode in ("diffusion", "draft-self"):
            if not self.block_mode:
                raise UserError(f"{self.path.name} has no Clover block-mode tensors (a plain Qwen3.5-MoE conversion): "
                                f"use --mode ar")
            if self.mask_token_id is None:
                raise UserError(f"{self.path.name} has no tokenizer.ggml.mask_token_id: block mode is unavailable")
        if mode != "ar" and block_size > self.max_block_size:
            raise UserError(f"block size {block_size} is above the {self.max_block_size} this model was loaded for "
                            f"(its context keeps logits for that many tokens; load it with a larger block size)")
        room = block_size - 1 if mode != "ar" else 0  # a final block may run block_size - 1 past the limit
        need = n_prompt + max_new_tokens + room
        limit = min(self.context_length, self.n_ctx)
        if need > limit:
            what = "the model's context" if limit == self.context_length else "the context (--ctx)"
            raise UserError(f"request needs {need} tokens (prompt {n_prompt} + max_new_tokens {max_new_tokens}"
                            + (f" + {room} to resolve a final block" if room else "")
                            + f"), {need - limit} more than {what} of {limit}")

    # ---- generation -------------------------------------------------------------------------------------
    def stream(self, messages: Sequence[dict[str, str]] | str, mode: str = "draft-self", max_new_tokens: int = 512,
               block_size: int | None = None, threshold: float | None = None, accept: str = "exact",
               temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, think: bool = True,
               controls: Controls | None = None, raw_prompt: bool = False) -> Iterator[tuple[str, RunStats]]:
        """Yield (new text, running stats) as tokens are accepted; the last item carries the final stats."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        prompt = messages[0]["content"] if raw_prompt else self.render(messages, think=think)
        ids = self.ctx.tokenize(prompt, special=True)
        block_size = int(block_size or self.block_size)
        self.check_request(len(ids), max_new_tokens, mode, block_size)
        c = controls or self.controls
        # the prompt itself may open a <think> span (a template that starts the thinking for the model)
        thinking_at_start = self.think_end_id is not None and \
            thinking_span(ids, self.think_id, self.think_end_id, False) is not None
        procs = make_processors(c, self.eos_ids, self.think_id, self.think_end_id, thinking_at_start)
        if temp <= 0:
            sampler = decoding.greedy  # argmax, lowest index on ties: all rows at once
        else:
            sampler1 = make_sampler(temp, top_p, top_k, seed)

            def sampler(logits: np.ndarray) -> np.ndarray:  # decoding wants [T, V] -> [T]
                return np.array([sampler1(row) for row in np.atleast_2d(logits)], dtype=np.int64)

        self.backend.extra_passes = 0
        self.backend.prefill_seconds = 0.0
        self.backend.keep_backup = mode == "draft-self"
        stats = RunStats(mode=mode, prompt_tokens=len(ids))
        t0 = time.perf_counter()
        pending = b""
        for chunk in decoding.generate(self.backend, ids, mode=mode, max_new_tokens=max_new_tokens,
                                       block_size=block_size, threshold=self.threshold if threshold is None else threshold,
                                       accept=accept, sampler=sampler, logits_processors=procs):
            now = time.perf_counter()
            if chunk.tokens and stats.time_to_first_token_s is None:
                stats.time_to_first_token_s = now - t0
            _fill_stats(stats, chunk.stats, now - t0, self.backend.extra_passes, self.backend.prefill_seconds)
            pending += b"".join(self.ctx.token_to_piece(t, special=True) for t in chunk.tokens)
            text, pending = _utf8_prefix(pending)
            yield text, stats
        if pending:
            yield pending.decode("utf-8", "replace"), stats

    def generate(self, messages: Sequence[dict[str, str]] | str, **kw) -> Answer:
        raw, stats = "", None
        for text, stats in self.stream(messages, **kw):
            raw += text
        thinking, text = split_thinking(raw)
        return Answer(text=text, thinking=thinking, stats=stats, raw=raw)

    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> "CloverRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fill_stats(stats: RunStats, g: decoding.GenerationStats, seconds: float, extra: int, prompt_s: float) -> None:
    stats.generated_tokens = g.generated_tokens
    stats.forward_passes = g.forward_passes
    stats.tokens_per_pass = round(g.tokens_per_pass, 4)
    stats.acceptance_rate = None if g.acceptance_rate is None else round(g.acceptance_rate, 4)
    stats.finish_reason = g.finish_reason
    stats.seconds = round(seconds, 4)
    stats.tokens_per_s = round(g.generated_tokens / seconds, 2) if seconds > 0 else 0.0
    stats.prompt_seconds = round(prompt_s, 4)
    decode_s = seconds - prompt_s
    stats.decode_tokens_per_s = round(g.generated_tokens / decode_s, 2) if decode_s > 0 else 0.0
    stats.peak_memory_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    stats.rollback_passes = extra


def _utf8_prefix(buf: bytes) -> tuple[str, bytes]:
    """Split off the longest prefix that is whole UTF-8; keep a trailing partial character for later."""
    for cut in range(len(buf), max(len(buf) - 4, -1), -1):
        try:
            return buf[:cut].decode("utf-8"), buf[cut:]
        except UnicodeDecodeError:
            continue
    return buf.decode("utf-8", "replace"), b""
