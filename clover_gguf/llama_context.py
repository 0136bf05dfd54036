"""A llama.cpp context on a Clover GGUF through llama-cpp-python's low-level binding.

The binding loads libllama from $LLAMA_CPP_LIB_PATH; `load_binding()` points it at the patched build first
(`clover-gguf build-llama`). Block passes follow docs/llama-cpp-patch.md: the scratch sequence is switched to block
attention once (`llama_set_block_attn`, the patch's API); a block pass copies the committed sequence to it, decodes the
block there with logits for every block token and drops the copy, so the committed sequence never changes.
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


class _MemoryBreakdownEntry(ctypes.Structure):
    """struct llama_memory_breakdown_entry (patches/0003)."""

    _fields_ = [("buft_name", ctypes.c_char_p), ("model", ctypes.c_size_t), ("context", ctypes.c_size_t),
                ("compute", ctypes.c_size_t)]


def _clover_api(L: Any) -> Any:
    """The patches' own functions (include/llama.h of the patched tree), which llama-cpp-python does not declare."""
    lib = L.llama_cpp._lib
    try:
        lib.llama_set_block_attn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]
        lib.llama_set_block_attn.restype = ctypes.c_int32
        lib.llama_model_has_block_attn.argtypes = [ctypes.c_void_p]
        lib.llama_model_has_block_attn.restype = ctypes.c_bool
        lib.llama_get_memory_breakdown_entries.argtypes = [ctypes.c_void_p, ctypes.POINTER(_MemoryBreakdownEntry),
                                                           ctypes.c_int32]
        lib.llama_get_memory_breakdown_entries.restype = ctypes.c_int32
    except AttributeError:
        raise UserError(f"{lib._name} is not the patched llama.cpp (no llama_set_block_attn): "
                        "run `clover-gguf build-llama`") from None
    return lib


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
        self._api = _clover_api(L)
        self.has_block_attn = bool(self._api.llama_model_has_block_attn(self.model))
        self._block_seqs: set[int] = set()  # sequences switched to block attention
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)  # the largest block one pass can take
        self.mem = L.llama_get_memory(self.ctx)
        self._batch: _Batch | None = None  # reused by every decode call, grown when a call needs more room

    # ---- metadata ---------------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes llama.cpp holds per buffer type ("CPU", "CUDA0", "CPU_Mapped", ...): {"model", "context", "compute"}
        (weights; KV cache and recurrent states; compute buffers)."""
        api = self._api
        n = api.llama_get_memory_breakdown_entries(self.ctx, None, 0)
        entries = (_MemoryBreakdownEntry * n)()
        api.llama_get_memory_breakdown_entries(self.ctx, entries, n)
        return {e.buft_name.decode(): {"model": e.model, "context": e.context, "compute": e.compute} for e in entries}

    # ---- decoding ---------------------------------------------------------------------------------------
    def set_block_attn(self, seq: int, enabled: bool = True) -> None:
        """Decode the tokens of `seq` as blocks (True) or causally (False) from now on."""
        if enabled and not self.has_block_attn:
            raise UserError("this GGUF has no Clover block-mode tensors (a plain Qwen3.5-MoE conversion?): "
                            "block decoding is unavailable, use AR decoding")
        if self._api.llama_set_block_attn(self.ctx, seq, enabled) != 0:
            raise UserError(f"llama.cpp refused block attention on sequence {seq}")
        (self._block_seqs.add if enabled else self._block_seqs.discard)(seq)

    def decode(self, ids: Sequence[int], pos0: int, seq: int = 0, logits: bool | Sequence[bool] = True,
               extra: Sequence[tuple[Sequence[int], int, int]] = ()) -> np.ndarray:
        """Decode `ids` at positions pos0.. on `seq` (plus (ids, pos0, seq) parts in the same batch) ->
        logits [n_out, V] for the tokens that asked for them (all by default). A sequence switched to block
        attention (set_block_attn) is decoded as one block."""
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
        if scratch not in self._block_seqs:
            self.set_block_attn(scratch)
        L = self.L
        L.llama_memory_seq_cp(self.mem, seq, scratch, -1, -1)
        try:
            return self.decode(block_ids, n_past, seq=scratch)
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
