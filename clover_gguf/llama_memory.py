"""What llama.cpp allocates for a model and context: its buffer sizes as it logs them and its own plan made without
allocating (a dry run); the GPUs it sees are llama_context.gpu_devices. `clover-gguf fit` predicts and measures
memory with these."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from clover_gguf.errors import UserError
from clover_gguf.llama_context import (LOG_ERROR, LlamaLog, _context_params, _load_model, capture_llama_log,
                                       load_binding)
from clover_gguf.offload import Offload

BUFFER_RE = re.compile(r"(\S+)\s+(model|output|KV|RS|compute) buffer size (?:=|is|of)\s+([\d.]+) MiB")


def buffer_sizes(log: LlamaLog) -> dict[str, dict[str, int]]:
    """{kind: {buffer type: bytes}} from llama.cpp's buffer-size lines (kind: model, output, KV, RS, compute; MiB
    with 2 decimals, 4 for the compute size llama_free reports). A kind logged twice for one buffer type keeps the
    last line: llama_free's compute line is the size after every pass the context ran."""
    out: dict[str, dict[str, int]] = {}
    for m in log.grep(BUFFER_RE.pattern):
        out.setdefault(m[2], {})[m[1]] = round(float(m[3]) * 2**20)
    return out


def is_host_buffer(name: str) -> bool:
    """CPU, CPU_Mapped, CPU_REPACK, ... and a GPU backend's pinned host buffers (CUDA_Host, Vulkan_Host)."""
    return name.startswith("CPU") or name.endswith("_Host")


class DryRun:
    """llama.cpp's own plan for this model: the buffers it would allocate for a context (LlamaContext's keyword
    arguments), from its graph allocator run without allocating anything (llama_model_params.no_alloc, as
    llama-fit-params does). The model is read once; each `buffers()` plans one context. Only the compute and output
    sizes are meaningful: a dry run reports weights and KV cache as 0."""

    def __init__(self, gguf: str | Path, offload: Offload | None = None, overrides: dict | None = None):
        self.L = load_binding()
        self.path = Path(gguf)
        self._keep: list[Any] = []
        offload = offload or Offload()
        self.flash_attn = offload.flash_attn  # every context it plans (exact turns it off)
        with capture_llama_log() as log:
            self.model = _load_model(self.L, self.path, offload, overrides, self._keep, no_alloc=True)
        if not self.model:
            why = next((t for lv, t in reversed(log.lines) if lv >= LOG_ERROR), "unknown error")
            raise UserError(f"llama.cpp could not read {self.path}: {why.strip()}")

    def buffers(self, **context: Any) -> dict[str, dict[str, int]]:
        kw = dict(n_ctx=4096, n_ubatch=512, n_batch=None, n_seq_max=2, n_rs_seq=0, exact=False, n_threads=None,
                  n_threads_batch=None, n_outputs_max=0)
        unknown = set(context) - set(kw)
        if unknown:
            raise TypeError(f"DryRun.buffers: unknown context settings {sorted(unknown)}")
        kw.update(context)
        with capture_llama_log() as log:
            ctx = self.L.llama_init_from_model(self.model, _context_params(self.L, **kw, flash_attn=self.flash_attn))
            if not ctx:
                raise UserError(f"llama.cpp could not plan a context of {kw['n_ctx']} tokens for {self.path}")
            self.L.llama_free(ctx)
        return buffer_sizes(log)

    def close(self) -> None:
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "DryRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
