"""The server's Prometheus counters (/metrics): finished requests by mode and finish reason, the decoders' counts,
auto's predicted and measured seconds, slots, the batch scheduler, the state cache and llama.cpp's memory."""

from __future__ import annotations

import collections
import threading
from typing import Any


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
        "thread_drops": ("clover_thread_drops_total",
                         "Times the stall guard dropped the threads to one while passes stalled (a busy machine)."),
        "forced_tokens": ("clover_forced_tokens_total",
                          "Tokens a grammar forced, placed without a pass of their own (in the generated tokens)."),
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

    def text(self, pool: Any) -> str:
        """The Prometheus text exposition format (version 0.0.4); pool: the serve.slots.Pool whose slots and queue
        are reported too."""
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
        guard = getattr(ctx, "guard", None)
        if guard is not None:  # threads.StallGuard: the counts passes run with now (one while they stall)
            one, batch = guard.threads()
            out += ["# HELP clover_threads CPU threads passes run with now, by pass (the stall guard drops them to "
                    "one on a busy machine).", "# TYPE clover_threads gauge",
                    f'clover_threads{{pass="one_token"}} {one}', f'clover_threads{{pass="batch"}} {batch}']
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
