r"""Named tensors of llama.cpp's graph, read while it computes: the scheduler's eval callback
(llama_context_params.cb_eval), for measurements that only the graph knows.

    probe = GraphProbe(r"ffn_moe_topk-\d+")
    ctx = LlamaContext(gguf, eval_callback=probe.callback)
    ctx.block(ids, n_past)
    probe.experts_per_layer()   # {layer: distinct expert ids the pass routed to}

With a callback set, llama.cpp computes the graph in pieces that end at each wanted tensor and asks Python about
every node, which slows a pass down: use a probed context for what the graph holds, never for timings.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clover_gguf.llama_context import load_binding

GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
# ggml type ids (ggml.h) of the tensors read here
GGML_DTYPES = {0: np.float32, 1: np.float16, 26: np.int32}


class _GGMLTensor(ctypes.Structure):
    """struct ggml_tensor of the pinned tree's ggml.h (only read here, up to `name`)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _ggml_base() -> ctypes.CDLL:
    """libggml-base, the library libllama itself uses (already loaded: dlopen returns the same handle)."""
    lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    name = {"darwin": "libggml-base.dylib", "win32": "ggml-base.dll"}.get(sys.platform, "libggml-base.so")
    lib = ctypes.CDLL(str(lib_dir / name))
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


@dataclass
class Record:
    name: str
    seconds: float  # time.perf_counter() when the tensor was computed
    cpu_seconds: float  # time.process_time() then
    data: np.ndarray | None  # numpy order: [ne3, ne2, ne1, ne0]


class GraphProbe:
    """Records each computed tensor whose name fully matches `pattern` (with its data when read_data)."""

    def __init__(self, pattern: str, read_data: bool = True):
        L = load_binding()
        self._ggml = _ggml_base() if read_data else None
        self.pattern = re.compile(pattern)
        self.records: list[Record] = []
        self.asked = 0  # nodes llama.cpp asked about: each is one call into Python (its cost lands in the pass)
        self.error: str | None = None  # an exception inside the callback (it must not cross into C)
        self.callback = L.ggml_backend_sched_eval_callback(self._on_tensor)

    def clear(self) -> None:
        self.records.clear()
        self.asked = 0

    def _on_tensor(self, ptr, ask: bool, user_data) -> bool:
        try:
            t = ctypes.cast(ptr, ctypes.POINTER(_GGMLTensor)).contents
            name = t.name.decode("utf-8", "replace")
            if ask:
                self.asked += 1
                return self.pattern.fullmatch(name) is not None
            now, cpu = time.perf_counter(), time.process_time()
            self.records.append(Record(name, now, cpu, self._read(ptr, t) if self._ggml else None))
        except Exception as e:  # noqa: BLE001 - report after the decode, never raise into C
            self.error = f"{type(e).__name__}: {e}"
        return True

    def _read(self, ptr, t: _GGMLTensor) -> np.ndarray:
        dtype = GGML_DTYPES.get(t.type)
        if dtype is None:
            raise ValueError(f"{t.name!r}: ggml type {t.type} is not read here")
        nbytes = self._ggml.ggml_nbytes(ptr)
        buf = np.empty(nbytes, dtype=np.uint8)
        self._ggml.ggml_backend_tensor_get(ptr, buf.ctypes.data, 0, nbytes)
        # views (e.g. the top-k of an argsort) are strided: walk their strides
        shape = tuple(int(n) for n in reversed(t.ne))
        strides = tuple(int(b) for b in reversed(t.nb))
        return np.lib.stride_tricks.as_strided(buf.view(dtype), shape=shape, strides=strides).copy()

    def check(self) -> None:
        if self.error:
            raise RuntimeError(f"graph probe failed: {self.error}")

    # ---- what the records say ---------------------------------------------------------------------------
    def experts_per_layer(self) -> dict[int, np.ndarray]:
        """{layer: the sorted distinct expert ids} over the recorded `ffn_moe_topk-{layer}` tensors."""
        self.check()
        out: dict[int, set[int]] = {}
        for r in self.records:
            if r.name.startswith("ffn_moe_topk-") and r.data is not None:
                out.setdefault(int(r.name.rsplit("-", 1)[1]), set()).update(int(e) for e in r.data.ravel())
        return {layer: np.array(sorted(ids)) for layer, ids in sorted(out.items())}

    def routes(self, layer: int) -> np.ndarray:
        """[tokens, k] expert ids of `ffn_moe_topk-{layer}` (the last record of it)."""
        self.check()
        hits = [r for r in self.records if r.name == f"ffn_moe_topk-{layer}"]
        if not hits:
            raise KeyError(f"no ffn_moe_topk-{layer} recorded")
        return hits[-1].data.reshape(-1, hits[-1].data.shape[-1])
