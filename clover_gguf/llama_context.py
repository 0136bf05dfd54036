"""A llama.cpp context on a Clover GGUF through llama-cpp-python's low-level binding.

The binding loads libllama from $LLAMA_CPP_LIB_PATH; `load_binding()` points it at the patched build first
(`clover-gguf build-llama`). Block mode follows docs/llama-cpp-patch.md: copy the sequence, decode the block
non-causally on the copy with logits for every block token, drop the copy — the committed sequence never changes.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from clover_gguf.errors import UserError

GGML_TYPE_F32 = 0


def load_binding() -> Any:
    """Import llama_cpp bound to the patched library; one clear error when either is missing."""
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):
        from clover_gguf.build import find_library

        info = find_library()
        if info is None:
            raise UserError("no patched llama.cpp library found: run `clover-gguf build-llama` (or `make llama`)")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(info.lib_dir)
    try:
        import llama_cpp
    except ImportError:
        raise UserError("the llama-cpp-python binding is not installed: `clover-gguf build-llama` installs it") from None
    except (OSError, RuntimeError) as e:
        raise UserError(f"cannot load libllama from {os.environ['LLAMA_CPP_LIB_PATH']}: {e}") from None
    return llama_cpp


def _kv_overrides(L: Any, overrides: dict[str, bool | int | float]) -> Any:
    arr = (L.llama_model_kv_override * (len(overrides) + 1))()
    for i, (key, val) in enumerate(overrides.items()):
        arr[i].key = key.encode()
        if isinstance(val, bool):
            arr[i].tag, arr[i].value.val_bool = L.LLAMA_KV_OVERRIDE_TYPE_BOOL, val
        elif isinstance(val, int):
            arr[i].tag, arr[i].value.val_i64 = L.LLAMA_KV_OVERRIDE_TYPE_INT, val
        else:
            arr[i].tag, arr[i].value.val_f64 = L.LLAMA_KV_OVERRIDE_TYPE_FLOAT, float(val)
    arr[len(overrides)].key = b""  # terminator
    return arr


class LlamaContext:
    """One model and one context: causal decoding on sequence 0, block passes on scratch sequence 1.

    exact=True turns off flash attention and keeps K/V in F32, the settings parity with the reference needs
    (CPU flash attention and an F16 cache alone differ by about 3e-4)."""

    def __init__(self, gguf: str | Path, n_ctx: int = 4096, n_ubatch: int = 512, n_batch: int | None = None,
                 n_seq_max: int = 2,
                 overrides: dict[str, bool | int | float] | None = None, n_rs_seq: int = 0, exact: bool = False,
                 n_threads: int | None = None, n_gpu_layers: int = 0, n_threads_batch: int | None = None,
                 eval_callback: Any = None):
        """eval_callback: llama.cpp's graph eval callback (a GraphProbe's .callback, clover_gguf.graph_probe)."""
        L = self.L = load_binding()
        path = Path(gguf)
        if not path.is_file():
            raise UserError(f"no such model file: {path}")
        L.llama_backend_init()
        L.llama_log_set(_quiet_log(L), ctypes.c_void_p())
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self._overrides = _kv_overrides(L, overrides) if overrides else None
        if self._overrides is not None:
            mp.kv_overrides = ctypes.cast(self._overrides, ctypes.POINTER(L.llama_model_kv_override))
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise UserError(f"llama.cpp could not load {path} (not a Clover GGUF, or the library is not patched)")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = max(n_batch or n_ctx, n_ubatch)  # tokens one decode call may take
        cp.n_ubatch = max(n_ubatch, 1)  # a block must fit in one ubatch
        cp.n_seq_max = n_seq_max
        cp.n_rs_seq = n_rs_seq
        cp.kv_unified = True  # seq_cp of the KV cache is then metadata only
        # llama.cpp's split: n_threads for one-token calls, n_threads_batch for calls of several tokens
        threads = n_threads or max(1, min(8, os.cpu_count() or 1))
        cp.n_threads, cp.n_threads_batch = threads, n_threads_batch or threads
        if eval_callback is not None:
            self._eval_callback = eval_callback  # kept alive for as long as the context may call it
            cp.cb_eval = eval_callback
        if exact:
            cp.flash_attn_type = 0
            cp.type_k = cp.type_v = GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise UserError("llama.cpp could not create a context (too little memory for n_ctx?)")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.mem = L.llama_get_memory(self.ctx)
        self._causal = True  # the context's attention mode; switched only when it changes (see _set_causal)
        self._batch: _Batch | None = None  # reused by every decode call, grown when a call needs more room

    # ---- metadata ---------------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    # ---- decoding ---------------------------------------------------------------------------------------
    def _set_causal(self, causal: bool) -> None:
        """The attention mode is part of llama.cpp's graph-reuse key: leaving it as it is between consecutive
        block passes lets them reuse one graph instead of rebuilding it every pass."""
        if causal != self._causal:
            self.L.llama_set_causal_attn(self.ctx, causal)
            self._causal = causal

    def decode(self, ids: Sequence[int], pos0: int, seq: int = 0, logits: bool | Sequence[bool] = True,
               extra: Sequence[tuple[Sequence[int], int, int]] = (), causal: bool = True) -> np.ndarray:
        """Decode `ids` at positions pos0.. on `seq` (plus (ids, pos0, seq) parts in the same batch) ->
        logits [n_out, V] for the tokens that asked for them (all by default). causal=False is block mode."""
        self._set_causal(causal)
        parts = [(ids, pos0, seq), *extra]
        n = sum(len(p[0]) for p in parts)
        batch = self._batch_for(n)
        i = 0
        for p_ids, p_pos0, p_seq in parts:  # vector writes into the arrays the llama_batch points at
            k = len(p_ids)
            batch.token[i:i + k] = p_ids
            batch.pos[i:i + k] = np.arange(p_pos0, p_pos0 + k)
            batch.seq[i:i + k] = p_seq
            i += k
        want = batch.logits[:n]
        if isinstance(logits, bool):
            want[:len(ids)] = logits
        else:
            flags = np.asarray(list(logits), dtype=bool)
            if flags.shape != (len(ids),):
                raise ValueError(f"{flags.size} logits flags for {len(ids)} tokens")
            want[:len(ids)] = flags
        want[len(ids):] = 1
        batch.struct.n_tokens = n
        rc = self.L.llama_decode(self.ctx, batch.struct)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = int(np.count_nonzero(want))
        if not n_out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        # llama.cpp stores the requested rows contiguously, in batch order
        return np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)).copy()

    def _batch_for(self, n: int) -> "_Batch":
        if self._batch is None or self._batch.capacity < n:
            self._batch = _Batch(self.L, max(n, 64, 2 * (self._batch.capacity if self._batch else 0)))
        return self._batch

    def block(self, block_ids: Sequence[int], n_past: int, seq: int = 0, scratch: int = 1) -> np.ndarray:
        """Block-mode logits [B, V] for `block_ids` after the n_past tokens of `seq`, which is left untouched."""
        L = self.L
        L.llama_memory_seq_cp(self.mem, seq, scratch, -1, -1)
        try:
            return self.decode(block_ids, n_past, seq=scratch, causal=False)
        finally:
            L.llama_memory_seq_rm(self.mem, scratch, -1, -1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self.L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    # ---- tokenizer --------------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self.L.llama_token * cap)()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, False, special)
        if n < 0:
            cap = -n
            buf = (self.L.llama_token * cap)()
            n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, False, special)
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n] if n >= 0 else b""

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "LlamaContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Batch:
    """A llama_batch over numpy arrays we own, so a decode call fills it with a few vector writes instead of one
    ctypes store per field per token (and allocates nothing). Each token belongs to one sequence: seq_id[i] points
    at seq[i]."""

    def __init__(self, L: Any, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        c_int_p = ctypes.POINTER(ctypes.c_int)
        base, size = self.seq.ctypes.data, self.seq.itemsize
        self._seq_ptrs = (c_int_p * capacity)(*(ctypes.cast(base + i * size, c_int_p) for i in range(capacity)))
        b = self.struct = L.llama_batch()
        b.n_tokens = 0
        b.token = self.token.ctypes.data_as(c_int_p)
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(c_int_p)
        b.n_seq_id = self.n_seq_id.ctypes.data_as(c_int_p)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(c_int_p))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_byte))


def _silent(level, text, user_data):
    """llama.cpp's log goes nowhere unless CLOVER_GGUF_LLAMA_LOG is set."""
    if os.environ.get("CLOVER_GGUF_LLAMA_LOG"):
        os.write(2, text)


_LOG_CALLBACK = None  # kept alive for as long as the library may call it


def _quiet_log(L: Any) -> Any:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = L.llama_log_callback(_silent)
    return _LOG_CALLBACK
