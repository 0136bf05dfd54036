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

import contextlib
import json
import logging
import math
import re
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from clover_gguf import decoding
from clover_gguf.auto import AutoPolicy, PassCosts
from clover_gguf import metadata as md
from clover_gguf.batching import Scheduler
from clover_gguf.config import MAX_BLOCK
from clover_gguf.constraint import Constraint
from clover_gguf.controls import Controls, Gather, GraphRows, make_processors, make_sampler
from clover_gguf.errors import ContextOverflow, SettingError, UserError
from clover_gguf.llama_context import ContextError, LlamaContext, load_binding
from clover_gguf.offload import Offload
from clover_gguf.state_cache import StateCache
from clover_gguf.thinking import prompt_opens_thinking, split_thinking
from clover_gguf.vocab import TemplateRefusal, compile_chat_template

log = logging.getLogger(__name__)

SEQ_MAIN, SEQ_BLOCK, SEQ_BACKUP, SEQ_PREFIX, SEQ_PROMPT = 0, 1, 2, 3, 4
N_SEQ = 3  # and SEQ_PREFIX for a runtime that keeps a prefix (chat), SEQ_PROMPT for one that keeps prompts (serve)
_KEPT = {SEQ_PREFIX: "prefix", SEQ_PROMPT: "prompt_kept"}  # LlamaBackend's record of the tokens each kept state holds
DEFAULT_CTX = 8192  # context when none is asked for (capped by the model's)
ROLLBACKS = ("redecode", "snapshot")
# where a pass's rows are turned into tokens (docs/runtime.md, "Selection"): in llama.cpp's graph, only token ids and
# a few numbers per row leaving it (the default); or from the rows' logits copied out, in numpy (the path before
# the selection sampler, libclover_sampler: every row's whole vocabulary through Python)
SELECTIONS = ("graph", "numpy")


class LlamaBackend:
    """decoding.Backend on sequence 0 of a LlamaContext; block passes on sequence 1 (see LlamaContext.block).

    Prefix reuse (keep_prefix): a prompt pass asked to keep its first `keep_at` tokens copies the state there into
    sequence 3 (SEQ_PREFIX) before decoding the rest; a later prompt that starts with those tokens continues from
    that copy and decodes only what follows (`reused`: the tokens it did not decode). The GDN layers' state cannot be
    rewound, so only that exact position is kept: a prompt that does not start with all of it is decoded whole.
    keep_prompt (with keep_prefix; serve): a prompt pass also keeps the state before its last token in sequence 4
    (SEQ_PROMPT) when its messages were seen before (it starts from their kept state: a regenerated answer, a retried
    or repeated request, from its second time on) or it keeps no turn (a raw prompt), so the same prompt again
    decodes one token; such a pass decodes the rest of the prompt in two parts, the last of one token."""

    # the readings of the block softmax the patched llama.cpp computes (metadata.READINGS; patches/0008, chosen at load
    # by clover_moe.diffusion.softmax_form)
    READINGS = tuple(md.READINGS)

    def __init__(self, ctx: LlamaContext, mask_token_id: int, eos_ids: Sequence[int], block_size: int,
                 rollback: str = "redecode", selection: str = "graph", keep_prefix: bool = False,
                 keep_prompt: bool = False):
        if rollback not in ROLLBACKS:
            raise UserError(f"unknown rollback strategy {rollback!r}: choose {' or '.join(ROLLBACKS)}")
        if selection not in SELECTIONS:
            raise UserError(f"unknown selection {selection!r}: choose {' or '.join(SELECTIONS)}")
        self.ctx = ctx
        self.select_in_graph = selection == "graph"  # decoding._Passes reads it
        self.mask_token_id = int(mask_token_id)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.block_size = int(block_size)
        self.rollback_strategy = rollback
        self.keep_backup = True  # set by the decoders before each commit: only draft verifications roll back
        self.extra_passes = 0  # re-decodes done for rollbacks (backend work the decoder does not count)
        self.prefill_seconds = 0.0  # time spent in prompt passes, so stats can report the decode rate alone
        if keep_prompt and not keep_prefix:
            raise ValueError("keep_prompt needs keep_prefix (SEQ_PROMPT comes after SEQ_PREFIX)")
        self.keep_prefix = keep_prefix
        self.keep_prompt = keep_prompt
        self.keep_at: int | None = None  # the next prompt pass keeps its first keep_at tokens (keep_prefix)
        self.state_cache: StateCache | None = None  # kept prefixes of other conversations (a server's, shared)
        self.reused = 0  # prompt tokens the last prompt pass continued from instead of decoding
        self.forget_prefix()

    def reset(self) -> None:
        """Before an answer: every sequence but the kept states emptied."""
        if self.keep_prefix:  # the kept states stay (SEQ_PREFIX, SEQ_PROMPT)
            for seq in (SEQ_MAIN, SEQ_BLOCK, SEQ_BACKUP):
                self.ctx.seq_rm(seq)
        else:
            self.ctx.clear()
        self._ids: list[int] = []
        self._last_commit = 0
        self._pending_rollback = 0

    def forget_prefix(self) -> None:
        """Drop the kept states too (a new conversation)."""
        self.ctx.clear()
        self.prefix: list[int] = []  # the tokens whose state SEQ_PREFIX holds
        self.prompt_kept: list[int] = []  # the tokens whose state SEQ_PROMPT holds (keep_prompt)
        self.reset()

    def settle(self) -> None:
        """Apply a rollback that was asked for, before anything reads or extends the state. Deferred because an
        answer ends with one (its end token is rolled back), and a reset that follows makes it unnecessary; auto
        settles at once, to time the rollback with its draft (decoding.Backend)."""
        n, self._pending_rollback = self._pending_rollback, 0
        if n:
            self._apply_rollback(n)

    def commit(self, ids: Sequence[int]) -> np.ndarray:
        return self._commit(ids, True, None)

    def commit_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None:
        """commit, with the selection in the graph (decoding.GraphBackend); gather None: no rows."""
        return self._commit(ids, gather is not None, gather)

    def _commit(self, ids, want, gather):
        self.settle()
        if self.keep_backup:  # both strategies keep the backup for rollbacks no snapshot covers
            self.ctx.seq_rm(SEQ_BACKUP)
            self.ctx.seq_cp(SEQ_MAIN, SEQ_BACKUP)
        out = self.ctx.decode(ids, self.n_past, SEQ_MAIN, logits=want, gather=gather)  # [len(ids), V] / rows
        self._ids += [int(t) for t in ids]
        self._last_commit = len(ids)
        return out

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        return self._prefill(ids, True, None)[-1]

    def prefill_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None:
        """prefill, with the selection in the graph (decoding.GraphBackend); gather None: no row."""
        return self._prefill(ids, gather is not None, gather)

    def _prefill(self, ids, last, gather):
        self.settle()
        t0 = time.perf_counter()
        ids = [int(t) for t in ids]
        self.reused = start = self._continue_prefix(ids)
        cuts = []  # (position, sequence): decode up to each position to keep, keep the state there, go on
        keep = self.keep_at if self.keep_prefix else None
        if keep is not None and start < keep < len(ids):
            cuts.append((keep, SEQ_PREFIX))
        # the prompt is kept when its messages were seen before (it continues from their kept state, or further: a
        # repeated request, the second time), or when there is no turn to keep (a raw prompt): a chat request seen
        # the first time would wait one pass more for a state that only the same request again would use
        if self.keep_prompt and start < len(ids) - 1 and (keep is None or start >= keep):
            cuts.append((len(ids) - 1, SEQ_PROMPT))
        for at, seq in cuts:
            if at > start:  # with the gather: its sampler is attached before the prompt's first pass (LlamaContext)
                self.ctx.decode(ids[start:at], start, SEQ_MAIN, logits=False, gather=gather)
            self.ctx.seq_rm(seq)
            self.ctx.seq_cp(SEQ_MAIN, seq)
            setattr(self, _KEPT[seq], ids[:at])
            start = at
        rest = ids[start:]
        want = [False] * (len(rest) - 1) + [last]
        out = self.ctx.decode(rest, start, SEQ_MAIN, logits=want, gather=gather)
        self.prefill_seconds += time.perf_counter() - t0
        self._ids = ids
        self._last_commit = len(ids)
        return out

    def _continue_prefix(self, ids: list[int]) -> int:
        """Start sequence 0 from the longest kept state that `ids` begins with and goes on past -> the tokens it
        holds (0: none, decode from the start). A kept state of no use here is dropped (its KV cells would only crowd
        the context). When the slot moves on to another conversation (its kept prefix is of no use either), what it
        kept goes to the state cache first (when the runtime has one), and the cache's longest prefix of ids, if any,
        comes back; the kept prompt of a conversation that goes on is dropped alone (only that prompt again, an
        earlier turn's, would use it)."""
        if not self.keep_prefix or self._ids:
            return 0

        def goes_past(kept: list[int]) -> bool:
            return len(kept) < len(ids) and ids[:len(kept)] == kept

        goes_on = bool(self.prefix) and goes_past(self.prefix)
        if self.prompt_kept and not goes_past(self.prompt_kept):
            self._drop(SEQ_PROMPT, stash=not goes_on)
        if self.prefix and not goes_on:
            self._drop(SEQ_PREFIX, stash=True)
        if not self.prefix and not self.prompt_kept and self.state_cache is not None:
            hit = self.state_cache.get(ids)
            if hit is not None:
                # all of the prompt but its last token: a kept prompt (this prompt again); else a kept prefix
                seq = SEQ_PROMPT if self.keep_prompt and len(hit[0]) == len(ids) - 1 else SEQ_PREFIX
                try:
                    self.ctx.state_seq_set(seq, hit[1])
                except RuntimeError:  # no room for its cells: decode the prompt instead
                    log.warning("a cached prompt state did not fit the context; prefilling instead")
                else:
                    setattr(self, _KEPT[seq], hit[0])
        seq = SEQ_PROMPT if len(self.prompt_kept) > len(self.prefix) else SEQ_PREFIX  # the longer (both go past)
        kept = getattr(self, _KEPT[seq])
        if not kept:
            return 0
        self.ctx.seq_cp(seq, SEQ_MAIN)
        return len(kept)

    def _drop(self, seq: int, stash: bool) -> None:
        """Remove a kept state from the context (and forget its tokens); stash: save it in the state cache first
        (when there is one)."""
        tokens, cache = getattr(self, _KEPT[seq]), self.state_cache
        if stash and cache is not None and not cache.refresh(tokens):
            cache.put(tokens, self.ctx.state_seq_get(seq))
        self.ctx.seq_rm(seq)
        setattr(self, _KEPT[seq], [])

    def block_logits(self, block: Sequence[int]) -> np.ndarray:
        self.settle()
        return self.ctx.block(block, self.n_past, seq=SEQ_MAIN, scratch=SEQ_BLOCK)

    def block_rows(self, block: Sequence[int], positions: Sequence[int], gather: Gather) -> GraphRows:
        """block_logits for these positions, with the selection in the graph (decoding.GraphBackend)."""
        self.settle()
        return self.ctx.block(block, self.n_past, seq=SEQ_MAIN, scratch=SEQ_BLOCK, positions=positions,
                              gather=gather)

    @property
    def n_past(self) -> int:
        return len(self._ids) - self._pending_rollback

    @property
    def n_vocab(self) -> int:
        return self.ctx.n_vocab

    def gather_limit(self, sampled: bool, top_n: int = 0) -> int:
        """The most ids a pass's selection may gather (decoding._Passes selects a pass with more on dense logits)."""
        return self.ctx.gather_limit(sampled, top_n)

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


def slot_sequences(keep_prefix: bool = False, keep_prompt: bool = False) -> int:
    """Sequences one runtime (a slot) uses: main, block scratch, draft-self's backup, and its kept states."""
    return N_SEQ + bool(keep_prefix) + bool(keep_prefix and keep_prompt)


def context_settings(max_block_size: int, n_ctx: int | None, context_length: int, rollback: str = "redecode",
                     exact: bool = False, keep_prefix: bool = False, slots: int = 1, keep_prompt: bool = False) -> dict:
    """The LlamaContext settings of a runtime; `clover-gguf fit` predicts memory from these same settings.

    Three sequences (main, block scratch, draft-self's rollback backup), a fourth for a kept prefix and a fifth for a
    kept prompt (slot_sequences), one unified KV cache; a ubatch holds a whole block; logits rows for one block (a
    prompt needs 1, a block pass or a committed block block_size) and at least one per sequence (llama.cpp's output
    buffer holds that many, and the slots' batched AR steps take a row each); snapshot rollback keeps block_size + 1
    recurrent-state snapshots per sequence. `slots` (serve --parallel): one context for all, with n_ctx cells and the
    sequences of each slot (clover_gguf.batching)."""
    per_slot = min(n_ctx or DEFAULT_CTX, context_length)
    n_seq_max = slot_sequences(keep_prefix, keep_prompt) * slots
    return dict(n_ctx=per_slot * slots, n_ubatch=max(512, max_block_size), n_seq_max=n_seq_max,
                n_rs_seq=max_block_size + 1 if rollback == "snapshot" else 0,
                n_outputs_max=max(max_block_size, n_seq_max), exact=exact)


# ---------------------------------------------------------------------------------------------------------------
# The model as a user sees it
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class RunStats(decoding.GenerationStats):
    """The decoder's counts (GenerationStats) plus what the runtime measures around them."""

    time_to_first_token_s: float | None = None
    tokens_per_s: float = 0.0  # generated tokens over the whole run, the prompt's pass included
    decode_tokens_per_s: float = 0.0  # generated tokens over the time after the prompt's pass (llama.cpp "eval")
    prompt_seconds: float = 0.0
    seconds: float = 0.0
    peak_memory_mib: float = 0.0
    rollback_passes: int = 0
    reused_tokens: int = 0  # prompt tokens continued from a kept prefix instead of decoded (chat)
    # the stall guard (threads.StallGuard) during this answer: times it dropped the threads to one, and what it did
    thread_drops: int = 0
    thread_guard: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field and the rates, as the JSON outputs (--json, the server's clover_stats) carry them. Fields are
        only ever added (other code and clients read them): predicted_tokens_per_s and measured_tokens_per_s are
        auto's and null in the other modes (docs/serve.md lists every field)."""
        d = asdict(self)
        d["tokens_per_pass"] = round(self.tokens_per_pass, 4)
        d["decode_passes"] = self.decode_passes
        d["tokens_per_decode_pass"] = round(self.tokens_per_decode_pass, 4)
        d["acceptance_rate"] = None if self.acceptance_rate is None else round(self.acceptance_rate, 4)
        d["accepted_per_draft"] = None if self.accepted_per_draft is None else round(self.accepted_per_draft, 4)
        for k in ("predicted_tokens_per_s", "measured_tokens_per_s", "block_pass_ar_steps"):
            d[k] = None if d[k] is None else round(d[k], 2)
        return d

    def summary(self) -> str:
        """One line for a person (generate --stats, chat): one speed (tokens a second after the prompt's pass, as
        llama.cpp's "eval" rate), tokens per pass after the prompt's, what auto chose, the block tokens accepted."""
        parts = [f"{_count(self.generated_tokens, 'token')} in {self.seconds:.2f} s, "
                 f"{self.decode_tokens_per_s:.1f} tok/s after the prompt ({self.prompt_seconds:.2f} s)",
                 f"{self.tokens_per_decode_pass:.2f} tokens/pass over "
                 f"{_count(self.decode_passes, 'pass', 'passes')} after the prompt's"]
        if self.mode == "auto":  # what it chose, and how its prediction held (a ratio: one speed per line)
            chose = f"{_count(self.ar_steps, 'AR step')} and {_count(self.drafts, 'draft')}"
            if self.drafts:
                chose += f" in {_count(self.block_passes, 'block pass', 'block passes')}"
                if self.accepted_per_draft is not None:
                    chose += f", {self.accepted_per_draft:.1f} tokens accepted per draft"
            parts.append(chose)
            if not self.drafts and self.block_pass_ar_steps is not None:  # why it stayed on AR: its measured costs
                parts.append(f"a block pass costs {self.block_pass_ar_steps:.1f} AR steps here (--mode draft-self or "
                             "diffusion shows blocks)")
            if self.predicted_tokens_per_s and self.measured_tokens_per_s:
                parts.append(f"its moves ran at {self.measured_tokens_per_s / self.predicted_tokens_per_s:.2f}x "
                             "the speed it predicted")
        elif self.acceptance_rate is not None:  # every block-mode run: the check of the block reading
            parts.append(f"{self.acceptance_rate:.0%} of block tokens accepted by the causal path")
        elif self.mode != "ar":  # the answer ended inside its first block: no causal pass checked one
            parts.append("ended inside its first block (no block for the causal path to check)")
        if self.forced_tokens:  # in the tokens per pass: placed by the grammar, no pass of their own
            parts.append(f"{_count(self.forced_tokens, 'token')} forced by the grammar")
        if self.reused_tokens:
            parts.append(f"{self.reused_tokens} of {self.prompt_tokens} prompt tokens reused")
        if self.thread_guard:  # passes stalled on a busy machine
            parts.append(self.thread_guard)
        if self.finish_reason == "length":
            parts.append("cut at the token limit")
        return f"{self.mode}: " + "; ".join(parts)


def _count(n: int, one: str, many: str | None = None) -> str:
    """'1 draft', '2 drafts', '0 drafts' (many: the plural where it is not one + 's')."""
    return f"{n} {one if n == 1 else many or one + 's'}"


@dataclass
class Piece:
    """What stream_pieces yields as an answer resolves: the new text (whole UTF-8 characters: a character split
    across tokens comes with the piece that completes it), the tokens resolved since the previous piece, the running
    stats (the same object every time; final with the last piece), and with logprobs one decoding.TokenLogprob per
    token (None when not asked for)."""

    text: str
    stats: RunStats
    tokens: list[int] = field(default_factory=list)
    logprobs: list[decoding.TokenLogprob] | None = None


@dataclass
class Answer:
    text: str  # the answer, thinking removed
    thinking: str
    stats: RunStats
    raw: str = field(repr=False, default="")

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "thinking": self.thinking, "stats": self.stats.to_json()}


class CloverRuntime:
    """A Clover GGUF loaded once; `generate` / `stream` answer chat messages in any mode."""

    def __init__(self, gguf: str | Path, n_ctx: int | None = None, rollback: str = "redecode",
                 coreset: bool | None = None, coreset_top_p: float | None = None, exact: bool = False,
                 n_threads: int | None = None, n_threads_batch: int | None = None, offload: Offload | None = None,
                 block_size: int | None = None, rpc: Sequence[str] = (), selection: str = "graph",
                 keep_prefix: bool = False, slots: int = 1, slot_of: "CloverRuntime | None" = None,
                 cache_ram: int = 0, keep_prompt: bool = False, reading: str | None = None):
        """block_size: the largest block a request may use (default: the GGUF's); the context keeps logits rows
        for that many tokens and no more (see context_settings). selection: "graph" (default) or "numpy" (SELECTIONS).
        keep_prefix: a prompt can keep the state after its first tokens for the next one (stream_ids' `keep`, chat;
        one more sequence's recurrent state in memory). keep_prompt (with keep_prefix; serve): a prompt whose messages
        were seen before also keeps the state before its last token, so the same prompt again decodes one token (one
        more sequence; LlamaBackend). slots: serve's --parallel: this runtime makes one context for that many
        runtimes, which run their passes through a batching.Scheduler, and is the first of them; slot_of: such a
        runtime, whose context this one takes the next slot of (the same file, made with the same options). rpc:
        llama.cpp RPC servers (HOST:PORT) that hold the layers (clover_gguf.rpc). cache_ram: bytes of host memory
        for the kept states of conversations a slot moved on from (clover_gguf.state_cache, serve's --cache-ram; with
        keep_prefix; slot_of runtimes share the first one's). reading: decode the block tensors under this reading
        instead of the file's (metadata.READINGS; a KV override of clover_moe.diffusion.softmax_form: check-block)."""
        from clover_gguf.gguf_header import read_clover

        path = Path(gguf)
        meta = read_clover(path).kv  # checked as llama.cpp needs it, before it sees the file (fit does the same)
        self.meta = meta
        self.path = path
        card = md.GenerationDefaults()
        self.block_mode = bool(meta.get(md.BLOCK_MODE, False))
        # the file's (absent: the default reading), checked before llama.cpp, which refuses a name it does not know
        self.reading = md.check_reading(meta.get(md.BLOCK_READING) or md.READING, f"{path.name}'s {md.BLOCK_READING}")
        if reading is not None:
            self.reading = md.check_reading(reading, "--reading")
        self.reading_verified = bool(meta.get(md.BLOCK_READING_VERIFIED, False))
        self.context_length = int(meta.get(md.hparam("context_length"), 4096))
        self.block_size = int(meta.get(md.BLOCK_SIZE, card.block_size))
        self.threshold = float(meta.get(md.THRESHOLD, card.threshold))
        self.mask_token_id = meta.get(md.MASK_TOKEN_ID)
        self.chat_template = meta.get(md.CHAT_TEMPLATE)
        # compiled once (compiling costs more than a small model's forward pass); check_model refused a bad one
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None
        self.controls = Controls.from_meta(meta.get)
        overrides: dict[str, bool | float | str] = {}
        if coreset is not None:
            overrides[md.CORESET_ENABLED] = coreset
        if coreset_top_p is not None:
            overrides[md.CORESET_TOP_P] = coreset_top_p
        if reading is not None:
            overrides[md.BLOCK_READING] = self.reading
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK:
            raise UserError(f"block size {block_size}: it must be 1..{MAX_BLOCK} (one block pass is one llama.cpp "
                            "micro-batch)")
        self.max_block_size = max(int(block_size or 0), self.block_size)
        if self.max_block_size > self.block_size:  # llama.cpp decodes blocks up to the model's block size only
            overrides[md.BLOCK_SIZE] = self.max_block_size
        per_slot = slot_sequences(keep_prefix, keep_prompt)
        if slot_of is not None:
            if not hasattr(slot_of.ctx, "scheduler"):
                raise ValueError("slot_of: a runtime made with slots > 1")
            self.ctx = slot_of.ctx.scheduler.slot(per_slot, slot_of.n_ctx)
        else:
            settings = context_settings(self.max_block_size, n_ctx, self.context_length, rollback, exact, keep_prefix,
                                        slots, keep_prompt)
            if slots > 1:  # llama.cpp refuses more sequences than this in one context
                most = int(load_binding().llama_max_parallel_sequences())
                if settings["n_seq_max"] > most:
                    raise UserError(f"--parallel {slots} cannot fit: a slot uses {per_slot} sequences and "
                                    f"llama.cpp holds at most {most} in a context: at most "
                                    f"{most // per_slot} slots")
            try:
                ctx = LlamaContext(path, overrides=overrides or None, n_threads=n_threads,
                                   n_threads_batch=n_threads_batch, offload=offload, rpc=rpc, **settings)
            except ContextError as e:
                if slots > 1:
                    raise UserError(f"--parallel {slots} cannot fit: {e}") from None
                raise
            if slots > 1:
                sched = Scheduler(ctx, settings["n_seq_max"])
                self.ctx = sched.slot(per_slot, ctx.n_ctx // slots)
            else:
                self.ctx = ctx
        self.n_ctx = self.ctx.n_ctx
        self.eos_ids, self._control_text, self.max_token_bytes = self._scan_vocab()
        self.think_id = self._special("<think>")
        self.think_end_id = self._special("</think>")
        self.backend = LlamaBackend(self.ctx, self.mask_token_id if self.mask_token_id is not None else -1,
                                    self.eos_ids, self.block_size, rollback=rollback, selection=selection,
                                    keep_prefix=keep_prefix, keep_prompt=keep_prompt)
        self._start_auto()
        if keep_prefix:  # one state cache for every slot of the context (slot_of: the first runtime's)
            self.backend.state_cache = (slot_of.backend.state_cache if slot_of is not None
                                        else StateCache(cache_ram) if cache_ram > 0 else None)

    def _start_auto(self) -> None:
        """Pass costs measured on this device by every answer of this runtime, for auto's choices (clover_gguf.auto),
        and the last auto answer's view of the drafts, where the next one starts."""
        self.pass_costs = PassCosts()
        self._auto_last: AutoPolicy | None = None

    def _scan_vocab(self) -> tuple[list[int], re.Pattern | None, int]:
        """-> (the end tokens, a pattern matching the text of every control token, the most bytes of prompt text
        one token can stand for). The tokenizer reads control tokens (<|im_end|>, ...) in text only when told to
        parse them: user text must never be. The byte count is the longest token text as the vocabulary stores it
        (byte-level BPE spells a byte with one or two, SentencePiece a space with three, byte tokens as <0xNN>):
        never less than the bytes a token covers, so least_prompt_tokens stays a lower bound."""
        L, vocab = self.ctx.L, self.ctx.vocab
        control = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN
        ends, texts, longest = [], set(), 1
        for t in range(self.ctx.n_vocab):
            if L.llama_vocab_is_eog(vocab, t):
                ends.append(t)
            raw = L.llama_vocab_get_text(vocab, t) or b""
            longest = max(longest, len(raw))
            if L.llama_vocab_get_attr(vocab, t) & control:
                text = raw.decode("utf-8", "replace")
                if text:
                    texts.add(text)
        pattern = re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None
        return ends, pattern, longest

    def _special(self, text: str) -> int | None:
        ids = self.ctx.tokenize(text, special=True)
        return ids[0] if len(ids) == 1 else None

    @property
    def default_mode(self) -> str:
        """The mode when none is asked for: auto (AR's text, drafts only where they pay on this machine), or ar for
        an AR-only file."""
        return "auto" if self.block_mode and self.mask_token_id is not None else "ar"

    @contextlib.contextmanager
    def running_on(self, backend, reading: str) -> Iterator[None]:
        """Answers decoded on another decoding backend under another reading of the block tensors, with this
        runtime's prompts, controls and stats (check-block runs a reading llama.cpp lacks on the reference so)."""
        saved = self.backend, self.reading
        self.backend, self.reading = backend, reading
        try:
            yield
        finally:
            self.backend, self.reading = saved

    @property
    def runs_reading(self) -> bool:
        """Whether this runtime's backend computes the file's reading of the block tensors (its READINGS): block
        modes need it; AR does not (auto then decodes AR only, diffusion and draft-self are refused)."""
        return self.reading in self.backend.READINGS

    def reading_note(self, mode: str) -> str | None:
        """One line for a block-mode run on a file whose block tensors are read under our reading of their math,
        not trained under it (the real checkpoint, until check-block confirms the reading), or for auto on a file
        whose reading this backend does not run (it decodes AR only); None otherwise."""
        if mode == "ar" or not self.block_mode:
            return None
        if not self.runs_reading:
            return f"note: {unrun_reading(self, 'auto')}" if mode == "auto" else None
        if self.reading_verified:
            return None
        return (f"note: the block tensors of {self.path.name} are read as clover-gguf's reading "
                f"{self.reading or '(unknown)'} says, not yet verified for these weights: `clover-gguf check-block "
                f"{self.path.name}` measures how much of each block the causal path accepts")

    # ---- prompts ----------------------------------------------------------------------------------------
    def prompt_and_keep(self, messages: Sequence[dict[str, Any]], think: bool = True,
                        tools: Sequence[dict] | None = None) -> tuple[list[int], int | None]:
        """A chat turn's prompt and where to keep its state for the next turn: after the messages, before the
        generation prompt (the next turn's rendering starts with those tokens; its earlier answers are rendered
        without their thinking, so no later position would be). None when the rendering without the generation
        prompt is not a prefix of the prompt's text, or the generation prompt's own tokens are not the prompt's last
        (a template for which nothing can be kept)."""
        text, ids = self._prompt(messages, think, tools)
        if self._template is None:
            return ids, None
        # the prompt is tokenized once (llama.cpp's tokenizer: 25-45 ms at 38K tokens, on every agent turn): the turn
        # ends where the generation prompt's own tokens start, and that text is what the rendering without it lacks
        history = self.render(messages, think=think, add_generation_prompt=False, tools=tools)
        if not (0 < len(history) < len(text) and text.startswith(history)):
            return ids, None
        tail = self.ctx.tokenize(text[len(history):], special=True)
        keep = len(ids) - len(tail)
        return ids, keep if 0 < keep < len(ids) and ids[keep:] == tail else None

    def forget_prefix(self) -> None:
        """Drop the state a previous prompt kept (a new conversation)."""
        self.backend.forget_prefix()

    @property
    def keeps_prefix(self) -> bool:
        return self.backend.keep_prefix

    def render(self, messages: Sequence[dict[str, Any]], think: bool = True, add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        """The GGUF's chat template over these messages (UserError when the template refuses them). tools: OpenAI's
        tool objects, given to the template as `tools` (as transformers and llama.cpp give them; a template that
        ignores them gets them as messages instead: clover_gguf.serve.tools)."""
        if self._template is None:
            return "".join(m["content"] for m in messages)
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         enable_thinking=think, **({"tools": list(tools)} if tools else {}))
        except TemplateRefusal as e:  # the template's own words (raise_exception)
            raise UserError(f"the chat template refuses these messages: {e}") from None
        except Exception as e:  # unknown roles, a template bug: the request fails, not us
            raise UserError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.ctx.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")

    # ---- checks -----------------------------------------------------------------------------------------
    def check_request(self, n_prompt: int, max_new_tokens: int, mode: str, block_size: int,
                      at_least: bool = False) -> None:
        """Refuse, before any llama.cpp call, a request this context cannot run (UserError, one line).
        at_least: n_prompt is a lower bound (least_prompt_tokens), not the count."""
        if mode not in decoding.MODES:
            raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(decoding.MODES)}")
        if max_new_tokens < 1 or block_size < 1:
            raise UserError("max_new_tokens and the block size must be at least 1")
        if mode != "ar":
            if not self.block_mode:
                raise UserError(no_block_tensors(self.path, mode))
            if self.mask_token_id is None:
                raise UserError(f"{self.path.name} has no tokenizer.ggml.mask_token_id: block mode is unavailable")
            if not self.runs_reading and mode != "auto":
                raise UserError(unrun_reading(self, mode))
            if block_size > self.ctx.n_ubatch:  # one block is one llama.cpp micro-batch (it aborts otherwise)
                raise UserError(f"block size {block_size} is more than this context's micro-batch of "
                                f"{self.ctx.n_ubatch} tokens: choose at most {self.ctx.n_ubatch}")
            if block_size > self.max_block_size:
                raise UserError(f"block size {block_size} is above the {self.max_block_size} this model was loaded "
                                "for (its context keeps logits rows for that many tokens)")
        room = block_size - 1 if mode != "ar" else 0  # a final block may run block_size - 1 past the limit
        need = n_prompt + max_new_tokens + room
        limit = min(self.context_length, self.n_ctx)
        if need > limit:
            what = "the model's context" if limit == self.context_length else "the context (--ctx)"
            least = "at least " if at_least else ""
            raise ContextOverflow(f"request needs {least}{need} tokens (prompt {least}{n_prompt} + max_new_tokens "
                                  f"{max_new_tokens}"
                                  + (f" + {room} to resolve a final block" if room else "")
                                  + f"), {need - limit} more than {what} of {limit}", n_prompt, limit, at_least)

    def least_prompt_tokens(self, messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None,
                            think: bool = True, tools: Sequence[dict] | None = None) -> int:
        """A lower bound on the tokens of a prompt (chat messages through the template, or a raw prompt) without
        tokenizing it: its UTF-8 bytes over max_token_bytes. Rendering takes milliseconds where llama.cpp's
        tokenizer takes minutes on 100,000 messages, so the server refuses an over-context request with this before
        the request takes a slot."""
        text = self.render(messages, think=think, tools=tools) if messages is not None else (prompt or "")
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def prompt_ids(self, messages: Sequence[dict[str, Any]] | str, think: bool = True,
                   tools: Sequence[dict] | None = None) -> list[int]:
        """Chat messages (or one user message) -> the prompt's tokens, rendered with the GGUF's chat template
        (`tools`: the template's tools, see render).

        The template's own markers are control tokens; what the messages say never is: a `<|im_end|>` typed in
        a message stays text (it cannot end a turn or start a new one). The tokens are the whole rendering's,
        except around a message that holds control-token text, which is tokenized on its own as plain text.
        Tools and tool calls the template renders itself must hold no control-token text (UserError)."""
        return self._prompt(messages, think, tools)[1]

    def _prompt(self, messages: Sequence[dict[str, Any]] | str, think: bool, tools: Sequence[dict] | None
                ) -> tuple[str, list[int]]:
        """prompt_ids -> (the rendering, its tokens)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for i, m in enumerate(messages):
            _check_utf8(m["content"], f"message {i}" if len(messages) > 1 else "the prompt")
        structured = [tools] + [m.get("tool_calls") for m in messages if m.get("tool_calls")]
        if self._control_text is not None and any(x and self._control_text.search(json.dumps(x, ensure_ascii=False))
                                                  for x in structured):
            raise UserError("the tools or a message's tool calls hold control-token text (such as <|im_end|>), which "
                            "the chat template would write as a control token: remove it")
        text = self.render(messages, think=think, tools=tools)
        risky = {i for i, m in enumerate(messages)
                 if self._control_text is not None and self._control_text.search(m["content"])}
        if not risky:
            return text, self.ctx.tokenize(text, special=True)
        # render again with a placeholder where each such message's text goes, and tokenize piece by piece
        marks = {i: f"\ue000{i}\ue001" for i in risky}
        shadow = self.render([{**m, "content": marks[i]} if i in risky else m for i, m in enumerate(messages)],
                             think=think, tools=tools)
        ids: list[int] = []
        rebuilt = []
        for piece in re.split("(\ue000\\d+\ue001)", shadow):
            hit = re.fullmatch("\ue000(\\d+)\ue001", piece)
            if hit and int(hit.group(1)) in risky:
                piece = messages[int(hit.group(1))]["content"]
                ids += self.ctx.tokenize(piece, special=False)
            elif piece:
                ids += self.ctx.tokenize(piece, special=True)
            rebuilt.append(piece)
        if "".join(rebuilt) != text:  # the template changes the message's text: no safe split exists
            raise UserError("a message holds control-token text (such as <|im_end|>) that this chat template "
                            "rewrites, so it cannot be kept as plain text: remove it")
        return text, ids

    def raw_prompt_ids(self, text: str) -> list[int]:
        """A raw prompt (no template; the caller writes the special tokens, so they are read as such) -> tokens."""
        _check_utf8(text, "the prompt")
        return self.ctx.tokenize(text, special=True)

    def thinking_at_start(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the answer after this prompt starts inside a <think> span (thinking.prompt_opens_thinking)."""
        return prompt_opens_thinking(prompt_ids, self.think_id, self.think_end_id)

    # ---- generation -------------------------------------------------------------------------------------
    def stream(self, messages: Sequence[dict[str, str]] | str, think: bool = True, **kw
               ) -> Iterator[tuple[str, RunStats]]:
        """stream_ids on the prompt of these chat messages (or of one user message)."""
        return self.stream_ids(self.prompt_ids(messages, think=think), **kw)

    def stream_ids(self, ids: Sequence[int], **kw) -> Iterator[tuple[str, RunStats]]:
        """stream_pieces as (new raw text, running stats) pairs: what chat, generate and the benches read."""
        for piece in self.stream_pieces(ids, **kw):
            yield piece.text, piece.stats

    def stream_pieces(self, ids: Sequence[int], mode: str = "auto", max_new_tokens: int = 512,
                      block_size: int | None = None, threshold: float | None = None, accept: str = "exact",
                      temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                      controls: Controls | None = None, end_rule: str = decoding.DEFAULT_END_RULE,
                      keep: int | None = None, observe: Callable[[dict], None] | None = None,
                      constraint: Constraint | None = None, logprobs: int | None = None,
                      ignore_eos: bool = False, forced: bool = True) -> Iterator[Piece]:
        """Yield a Piece (new raw text, the tokens it came from, running stats) as tokens are accepted after the
        prompt `ids`; the last one carries the final stats. The text is what the model wrote, <think> tags included:
        thinking.ThinkSplitter with thinking_at_start(ids) splits it. end_rule: how block passes resolve end tokens
        (decoding.END_RULES; "plain" is the card's rule). keep: keep the state after the prompt's first `keep`
        tokens for a later prompt that starts with them (a runtime made with keep_prefix; prompt_and_keep gives the
        position for chat). observe: decoding.generate's observer of the passes, its events given the text of their
        tokens (`texts`, `next_text`, `text`) and the positions of end tokens (`ends`) (serve's block view).
        constraint: a grammar's state (clover_gguf.constraint) every kept token follows, in any mode (docs/runtime.md,
        "Constrained output and logprobs"). logprobs: None (off), 0 (each token's logprob), or 1..20 (and that many
        most likely alternatives): Piece.logprobs, from the causal pass that kept each token.
        ignore_eos: the end tokens are never chosen (decoding.generate's `never`), so the answer runs to
        max_new_tokens (llama-server's field of the name: a fixed amount of work, bench/serve.py).
        forced: tokens the constraint forces cost no pass of their own (decoding.generate's `forced`; False: the
        benches' comparison)."""
        if not len(ids):
            raise UserError("the prompt is empty")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or
                                     not 0 <= logprobs <= decoding.TOP_LOGPROBS_MAX):
            raise UserError(f"logprobs must be an integer in [0, {decoding.TOP_LOGPROBS_MAX}], not {logprobs!r}")
        block_size = int(block_size or self.block_size)
        if mode == "auto" and (self.default_mode == "ar" or not self.runs_reading):
            mode = "ar"  # no block tensors, or a reading this backend does not run: auto's only choice is AR
        self.check_request(len(ids), max_new_tokens, mode, block_size)
        c = controls or self.controls
        check_sampling(temp, top_p, top_k, threshold, c)
        procs = make_processors(c, self.eos_ids, self.think_id, self.think_end_id, self.thinking_at_start(ids))
        sampler = make_sampler(temp, top_p, top_k, seed)
        self.backend.extra_passes = 0
        self.backend.prefill_seconds = 0.0
        self.backend.keep_at = keep
        stats = RunStats(mode=mode, prompt_tokens=len(ids))
        policy = None
        if mode == "auto":  # its choices start from what the model's earlier answers measured
            policy = AutoPolicy(self.pass_costs, block_size, prior=self._auto_last)
            self._auto_last = policy
        guard = getattr(self.ctx, "guard", None)
        marks = (len(guard.events), guard.drops) if guard is not None else None
        t0 = time.perf_counter()
        pending = b""
        for chunk in decoding.generate(self.backend, ids, mode=mode, max_new_tokens=max_new_tokens,
                                       block_size=block_size, threshold=self.threshold if threshold is None else threshold,
                                       accept=accept, sampler=sampler, logits_processors=procs, stats=stats,
                                       end_rule=end_rule, costs=self.pass_costs, policy=policy,
                                       clock=getattr(self.ctx, "cost_clock", time.perf_counter),
                                       draft_threshold=decoding.DRAFT_THRESHOLD if threshold is None else None,
                                       observe=None if observe is None else self._with_text(observe),
                                       constraint=constraint, logprobs=logprobs,
                                       never=sorted(self.eos_ids) if ignore_eos else (), forced=forced):
            now = time.perf_counter()
            if chunk.tokens and stats.time_to_first_token_s is None:
                stats.time_to_first_token_s = now - t0
            _time_stats(stats, now - t0, self.backend.extra_passes, self.backend.prefill_seconds, chunk.finished)
            stats.reused_tokens = self.backend.reused
            if marks is not None:
                stats.thread_guard, stats.thread_drops = guard.since(marks[0]), guard.drops - marks[1]
            pending += b"".join(self.ctx.token_to_piece(t, special=True) for t in chunk.tokens)
            text, pending = _utf8_prefix(pending)
            yield Piece(text, stats, list(chunk.tokens), chunk.logprobs)
        if pending:
            yield Piece(pending.decode("utf-8", "replace"), stats, [], None if logprobs is None else [])

    def _with_text(self, observe: Callable[[dict], None]) -> Callable[[dict], None]:
        """An observer of decoding.generate's events that adds their tokens' text (the bytes of each token alone: a
        character split across tokens shows as U+FFFD) and the positions of end tokens, then calls `observe`."""
        def text(t: int) -> str:
            return self.ctx.token_to_piece(t, special=True).decode("utf-8", "replace")

        def with_text(ev: dict) -> None:
            if ev.get("tokens"):
                ev["texts"] = [text(t) for t in ev["tokens"]]
                ends = [i for i, t in zip(ev.get("filled", ev.get("known", ())), ev["tokens"]) if t in self.eos_ids]
                if ends:
                    ev["ends"] = ends
            if ev.get("next") is not None:
                ev["next_text"] = text(ev["next"])
            if "token" in ev:
                ev["text"] = text(ev["token"])
            if ev.get("forced"):  # an AR step's forced tokens
                ev["forced_texts"] = [text(t) for t in ev["forced"]]
            observe(ev)

        return with_text

    def generate(self, messages: Sequence[dict[str, str]] | str, think: bool = True, **kw) -> Answer:
        ids = self.prompt_ids(messages, think=think)
        raw, stats = "", None
        for text, stats in self.stream_ids(ids, **kw):
            raw += text
        thinking, text = split_thinking(raw, self.thinking_at_start(ids))
        return Answer(text=text, thinking=thinking, stats=stats, raw=raw)

    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> "CloverRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def no_block_tensors(path: Path, mode: str | None) -> str:
    """Why `mode` cannot run on a file without the block-mode tensors, and the fix (mode None: check-block, which
    has no other mode to offer). graft's --from names the 35B's repository only for a file of the 35B's shape."""
    name = Path(path).name
    what = f"--mode {mode} cannot run" if mode else "check-block has nothing to check"
    src = md.HF_REPO if has_35b_hparams(Path(path)) else "CHECKPOINT"
    folder = Path(path).is_dir()  # an MLX folder (docs/mac.md)
    fix = f"add them with `clover-gguf graft {name} --from {src} -o {'OUT_FOLDER' if folder else 'OUT.gguf'}`"
    if src != md.HF_REPO:
        fix += " (CHECKPOINT: the Clover checkpoint this file was made from, its folder or Hugging Face repository)"
    kind = "an MLX conversion made without them" if folder else "an AR-only file, as the official GGUFs are"
    return f"{name} has no block-mode tensors ({kind}), so {what}: {fix}" + (", or use --mode ar" if mode else "")


def unrun_reading(rt: CloverRuntime, mode: str) -> str:
    """Why `mode` does not draft on a file whose reading of the block tensors rt's backend does not compute: auto
    decodes AR (the same text), diffusion and draft-self are refused."""
    known = md.READINGS.get(rt.reading) is not None
    what = (f"block reading {rt.reading}" if known else
            f"block reading {rt.reading!r}, which this version does not know")
    runs = ", ".join(rt.backend.READINGS)
    head = f"{rt.path.name} is stamped with {what}; this backend runs {runs} only"
    if mode == "auto":
        return f"{head}: auto decodes AR (the same text, no drafts)"
    return (f"{head}, so --mode {mode} cannot run: use --mode ar or auto, or rank the readings with `clover-gguf "
            f"check-block {rt.path.name} --reading all`")


def has_35b_hparams(path: Path) -> bool:
    """The file's layers, experts and width are the 35B's (config.SHAPE_35B): from its header's hparams, so an
    AR-only file too (quantize.has_35b_shape asks for every tensor of the 35B, the block tensors included)."""
    import json

    from clover_gguf.config import SHAPE_35B
    from clover_gguf.gguf_header import read_header

    try:
        kv = read_header(path).kv
    except (UserError, OSError):
        return False
    shape = json.loads(SHAPE_35B.read_text())
    return all(kv.get(md.hparam(k)) == shape[f] for k, f in (("block_count", "num_hidden_layers"),
                                                               ("expert_count", "num_experts"),
                                                               ("embedding_length", "hidden_size")))


def _check_utf8(text: str, what: str) -> None:
    """Text that cannot be UTF-8 (a lone surrogate: undecodable bytes on the command line, a JSON \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not valid UTF-8 text (character {e.start} cannot be encoded)") from None


# What the samplers compute with (libclover_sampler and MLX in float32, numpy in float64): a temperature and a top_p
# as float32 (1e-320 is 0 there: a sampler init that failed, 1e39 is inf), logits scaled by 1 / temperature (1e-45:
# every probability NaN, token 0, a NUL byte, written), the controls as float32 coefficients, top_k as an int32.
# Within these bounds every one computes; a temperature below MIN_TEMP samples as greedy does anyway.
MIN_TEMP, MAX_TEMP = 1e-6, 1e6
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1
MAX_CONTROL = 1e6  # a penalty's size (the card's: 0.9, 10); its reciprocal and its product with a logit stay finite


def check_sampling(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, threshold: float | None = None,
                   controls: Controls | None = None) -> None:
    """Refuse sampling settings no decode can use: NaN, infinities, out-of-range values, values the float32 and
    int32 samplers cannot take (the bounds above), for the CLI, the server (a 422 on the field: SettingError.name)
    and every backend alike."""
    values = {"temperature": temp, "top_p": top_p, "top_k": top_k}
    if threshold is not None:
        values["threshold"] = threshold
    if controls is not None:
        values.update({k: getattr(controls, k) for k in Controls.control_names()})
    for name, v in values.items():
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SettingError(name, f"{name} must be a finite number, not {v!r}")
    if temp != 0 and not MIN_TEMP <= temp <= MAX_TEMP:
        raise SettingError("temperature", f"temperature must be 0 (greedy) or in [{MIN_TEMP:g}, {MAX_TEMP:g}] (the "
                           f"samplers compute in float32), not {temp:g}")
    if not MIN_TOP_P <= top_p <= 1:
        raise SettingError("top_p", f"top_p must be in [{MIN_TOP_P:g}, 1], not {top_p:g}")
    if not 0 <= top_k <= MAX_TOP_K:
        raise SettingError("top_k", f"top_k must be in 0..{MAX_TOP_K} (0: off), not {top_k}")
    if threshold is not None and not 0 <= threshold <= 1:
        raise SettingError("threshold", f"threshold must be in [0, 1], not {threshold}")
    if controls is not None:
        for name in Controls.control_names():  # the penalties and biases (the starts and ramps count tokens)
            v = getattr(controls, name)
            if isinstance(getattr(Controls, name), float) and abs(v) > MAX_CONTROL:
                raise SettingError(name, f"{name} must be within +-{MAX_CONTROL:g}, not {v:g}")
        if controls.repetition_penalty < MIN_TOP_P:
            raise SettingError("repetition_penalty", f"repetition_penalty must be at least {MIN_TOP_P:g} (it "
                               f"divides logits), not {controls.repetition_penalty:g}")


def _time_stats(stats: RunStats, seconds: float, extra: int, prompt_s: float, final: bool) -> None:
    """The runtime's own figures; the counts are the decoder's (it counts into the same object). The peak memory
    only with the final chunk: getrusage took 0.55 ms a call in a process running llama.cpp (1.7 us in a bare one),
    a third of an AR step on the bundled model when it ran for every token."""
    stats.seconds = round(seconds, 4)
    stats.tokens_per_s = round(stats.generated_tokens / seconds, 2) if seconds > 0 else 0.0
    stats.prompt_seconds = round(prompt_s, 4)
    decode_s = seconds - prompt_s
    stats.decode_tokens_per_s = round(stats.generated_tokens / decode_s, 2) if decode_s > 0 else 0.0
    if final:
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
