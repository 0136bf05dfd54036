"""A llama.cpp context on a Clover GGUF through llama-cpp-python's low-level binding.

The binding loads libllama from $LLAMA_CPP_LIB_PATH; `load_binding()` points it at the patched build first
(`clover-gguf build-llama`). Block passes follow docs/llama-cpp-patch.md: a block pass copies the committed sequence
to the scratch sequence, switches that to block attention (`llama_set_block_attn`, the patch's API; the flag is the
sequence's state, so emptying the copy drops it), decodes the block there with logits for every block token and drops
the copy, so the committed sequence never changes.

A decode returns the logits of its rows, or, given a `controls.Gather`, what our selection sampler computed in the
graph (`controls.GraphRows`): libclover_sampler (clover_gguf/csrc, built beside libllama by `build-llama`), a backend
sampler on llama.cpp's public sampler interface. A sequence decoded that way carries the sampler (llama.cpp's backend
sampling), and llama.cpp then copies no logits for it. Switching a sequence between the two rebuilds llama.cpp's
graph.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from clover_gguf.controls import Gather, GraphRows
from clover_gguf.errors import UserError
from clover_gguf.offload import FLASH_ATTN, Offload, no_offload_notice
from clover_gguf.threads import StallGuard, pass_kind, attach_threadpools, choose, has_openmp, prepare_wait

GGML_TYPE_F32 = 0
# enum ggml_backend_dev_type
GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU = 0, 1, 2
LOAD_MODE_NONE, LOAD_MODE_AUTO = 0, -1  # enum llama_load_mode

# llama.cpp rounds the context up to a multiple of this (llama-context.cpp, "GGML_PAD(cparams.n_ctx, 256)") but
# caps the batch at the size asked for: we round first, so the batch limit and the context limit are the same number
N_CTX_PAD = 256


# A held selection sampler wider than a gather needs is reused (instead of a new sampler and a rebuilt graph) while it
# is at most one width step wider, or its padding is small (width x rows at most this): a grammar's string and
# structure positions alternate between a wide and a narrow gather every few AR steps, and an answer's first passes
# (no history yet) need less than the previous answer's last ones.
REUSE_PADDING = 65536

# llama_decode's code for a graph a backend sampler refused (the series' patch 0010, llama.h): nothing was computed
DECODE_SAMPLER_REFUSED = -4


def padded_n_ctx(n_ctx: int) -> int:
    """The context size llama.cpp makes of a request for n_ctx tokens."""
    return -(-max(1, int(n_ctx)) // N_CTX_PAD) * N_CTX_PAD


def load_binding(poll: int | None = None) -> Any:
    """Import llama_cpp bound to the patched library; one clear error when either is missing. The first call of a
    process also sets how libgomp's threads wait (`poll`, clover_gguf.threads.prepare_wait) before it loads."""
    prepare_wait(poll)
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):
        from clover_gguf.build import find_library, no_library_reason

        info = find_library()
        if info is None:
            raise UserError(no_library_reason())
        os.environ["LLAMA_CPP_LIB_PATH"] = str(info.lib_dir)
    try:
        import llama_cpp
    except ImportError:
        raise UserError("the llama-cpp-python binding is not installed: `clover-gguf build-llama` installs it") from None
    except (OSError, RuntimeError) as e:
        raise UserError(f"cannot load libllama from {os.environ['LLAMA_CPP_LIB_PATH']}: {e}") from None
    _fit_binding(llama_cpp, Path(os.environ["LLAMA_CPP_LIB_PATH"]))
    return llama_cpp


def _fit_binding(L: Any, lib_dir: Path) -> None:
    """Fit the binding's structs to the llama.h of the tree the library was built from (its build stamp's source,
    llama_sdist.Source.binding_fields): a struct the tree grew gets the new field where the tree has it, and every
    function the binding declares with the struct takes the fitted one. Nothing for the pinned tree or a library
    without a stamp."""
    from clover_gguf.build import _info_for_lib_dir
    from clover_gguf.llama_sdist import source_of_sha256

    info = _info_for_lib_dir(lib_dir)
    src = source_of_sha256((info.source or "").removeprefix("sdist:"))
    for struct, after, name, ctype in src.binding_fields if src is not None else ():
        old = getattr(L, struct)
        if any(f[0] == name for f in old._fields_):
            continue  # fitted already
        fields = list(old._fields_)
        fields.insert([f[0] for f in fields].index(after) + 1, (name, getattr(ctypes, ctype)))
        new = type(struct, (ctypes.Structure,), {"_fields_": fields})
        for mod in (L, L.llama_cpp):
            setattr(mod, struct, new)
        for fn in vars(L.llama_cpp).values():
            if isinstance(fn, ctypes._CFuncPtr):
                if getattr(fn, "restype", None) is old:
                    fn.restype = new
                if fn.argtypes and old in fn.argtypes:
                    fn.argtypes = [new if t is old else t for t in fn.argtypes]


class _MemoryBreakdownEntry(ctypes.Structure):
    """struct llama_memory_breakdown_entry (patches/0002)."""

    _fields_ = [("buft_name", ctypes.c_char_p), ("model", ctypes.c_size_t), ("context", ctypes.c_size_t),
                ("compute", ctypes.c_size_t)]


def _clover_api(L: Any) -> Any:
    """The patches' own functions (include/llama.h of the patched tree), which llama-cpp-python does not declare."""
    lib = L.llama_cpp._lib
    try:
        lib.llama_set_block_attn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]
        lib.llama_set_block_attn.restype = ctypes.c_bool
        lib.llama_get_block_attn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.llama_get_block_attn.restype = ctypes.c_bool
        lib.llama_model_has_block_attn.argtypes = [ctypes.c_void_p]
        lib.llama_model_has_block_attn.restype = ctypes.c_bool
        lib.llama_model_block_attn_max_tokens.argtypes = [ctypes.c_void_p]
        lib.llama_model_block_attn_max_tokens.restype = ctypes.c_uint32
        # the patched tree's seq_cp says whether the memory refused the copy (llama-cpp-python declares it void)
        lib.llama_memory_seq_cp.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                            ctypes.c_int32]
        lib.llama_memory_seq_cp.restype = ctypes.c_bool
        lib.llama_get_memory_breakdown_entries.argtypes = [ctypes.c_void_p, ctypes.POINTER(_MemoryBreakdownEntry),
                                                           ctypes.c_int32]
        lib.llama_get_memory_breakdown_entries.restype = ctypes.c_int32
        # the sampled rows, read after every selecting decode: plain addresses (the binding's wrappers cost more)
        for name, res in (("llama_get_sampled_logits_ith", ctypes.c_void_p),
                          ("llama_get_sampled_probs_ith", ctypes.c_void_p),
                          ("llama_get_sampled_candidates_ith", ctypes.c_void_p),
                          ("llama_get_sampled_logits_count_ith", ctypes.c_uint32),
                          ("llama_get_sampled_probs_count_ith", ctypes.c_uint32),
                          ("llama_get_sampled_token_ith", ctypes.c_int32)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int32], res
    except AttributeError:
        raise UserError(f"{lib._name} is not the patched llama.cpp (no llama_set_block_attn): "
                        "run `clover-gguf build-llama`") from None
    return lib


def sampler_library(L: Any) -> ctypes.CDLL:
    """ctypes handle of libclover_sampler, beside the libllama the binding loaded (clover_gguf/csrc/clover_sampler.h);
    one clear error when it is missing."""
    from clover_gguf.build import SAMPLER_LIB, _shared_lib_name

    path = Path(os.environ["LLAMA_CPP_LIB_PATH"]) / _shared_lib_name(SAMPLER_LIB)
    try:
        lib = ctypes.CDLL(str(path))
        smpl = L.llama_cpp.llama_sampler_p_ctypes
        lib.clover_sampler_init.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_bool, ctypes.c_float,
                                            ctypes.c_int32, ctypes.c_float]
        lib.clover_sampler_init.restype = smpl
        lib.clover_sampler_set_inputs.argtypes = [smpl, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                  ctypes.c_void_p, ctypes.c_void_p]
        lib.clover_sampler_set_inputs.restype = ctypes.c_int32
        lib.clover_sampler_chunk.argtypes = [ctypes.c_int32]
        lib.clover_sampler_chunk.restype = ctypes.c_int32
        lib.clover_sampler_init_ext.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_bool, ctypes.c_float,
                                                ctypes.c_int32, ctypes.c_float, ctypes.c_int32, ctypes.c_bool]
        lib.clover_sampler_init_ext.restype = smpl
        lib.clover_sampler_set_inputs_ext.argtypes = [smpl, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                      ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                                      ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                      ctypes.c_void_p]
        lib.clover_sampler_set_inputs_ext.restype = ctypes.c_int32
        lib.clover_sampler_saved_logit.argtypes = [smpl, ctypes.c_int32, ctypes.POINTER(ctypes.c_float)]
        lib.clover_sampler_saved_logit.restype = ctypes.c_int32
        lib.clover_sampler_error.argtypes = [smpl]
        lib.clover_sampler_error.restype = ctypes.c_char_p
    except (OSError, AttributeError) as e:
        raise UserError(f"the selection sampler {path} does not load ({e}): run `clover-gguf build-llama`") from None
    return lib


def ggml_library() -> ctypes.CDLL:
    """ctypes handle of the libggml next to the libllama the binding loaded (ggml's own calls: backends, devices)."""
    from clover_gguf.build import _shared_lib_name

    load_binding()
    return ctypes.CDLL(str(Path(os.environ["LLAMA_CPP_LIB_PATH"]) / _shared_lib_name("ggml")))


def _kv_overrides(L: Any, overrides: dict[str, bool | int | float | str]) -> Any:
    arr = (L.llama_model_kv_override * (len(overrides) + 1))()
    for i, (key, val) in enumerate(overrides.items()):
        arr[i].key = key.encode()
        if isinstance(val, str):  # e.g. clover_moe.diffusion.softmax_form
            if len(val.encode()) >= 128:
                raise UserError(f"the value of {key} is longer than llama.cpp's 127 bytes")
            arr[i].tag, arr[i].value.val_str = L.LLAMA_KV_OVERRIDE_TYPE_STR, val.encode()
        elif isinstance(val, bool):
            arr[i].tag, arr[i].value.val_bool = L.LLAMA_KV_OVERRIDE_TYPE_BOOL, val
        elif isinstance(val, int):
            arr[i].tag, arr[i].value.val_i64 = L.LLAMA_KV_OVERRIDE_TYPE_INT, val
        else:
            arr[i].tag, arr[i].value.val_f64 = L.LLAMA_KV_OVERRIDE_TYPE_FLOAT, float(val)
    arr[len(overrides)].key = b""  # terminator
    return arr


def _cpu_buffer_type(L: Any) -> int:
    """ggml's CPU buffer type (the pointer llama.cpp compares overrides with), through the loaded ggml library:
    the binding declares tensor_buft_overrides but not the ggml calls behind it."""
    lib = L.llama_cpp._lib
    by_type, buft = lib.ggml_backend_dev_by_type, lib.ggml_backend_dev_buffer_type
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    buft.restype, buft.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    dev = by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RuntimeError("llama.cpp has no CPU device")
    return buft(dev)


class _BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override {const char * pattern; ggml_backend_buffer_type_t buft;}"""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _buft_overrides(L: Any, patterns: list[str]) -> Any:
    arr = (_BuftOverride * (len(patterns) + 1))()  # zeroed: the last entry is the NULL terminator
    cpu = _cpu_buffer_type(L)
    for i, pattern in enumerate(patterns):
        arr[i].pattern, arr[i].buft = pattern.encode(), cpu
    return arr


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    free: int
    total: int
    integrated: bool  # shares host memory: an integrated GPU, or Metal (which reports itself as a plain GPU)


def gpu_devices() -> list[Device]:
    """The GPUs llama.cpp sees, with their free and total memory as the backend reports it (Metal: total is
    recommendedMaxWorkingSetSize, see docs/hardware.md)."""
    L = load_binding()
    L.llama_backend_init()
    lib = L.llama_cpp._lib
    sig = {"ggml_backend_dev_count": (ctypes.c_size_t, []), "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
           "ggml_backend_dev_type": (ctypes.c_int, [ctypes.c_void_p]),
           "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
           "ggml_backend_dev_description": (ctypes.c_char_p, [ctypes.c_void_p]),
           "ggml_backend_dev_memory": (None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                              ctypes.POINTER(ctypes.c_size_t)])}
    fn = {}
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
        fn[name] = f
    out = []
    for i in range(fn["ggml_backend_dev_count"]()):
        dev = fn["ggml_backend_dev_get"](i)
        kind = fn["ggml_backend_dev_type"](dev)
        if kind not in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU):
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        fn["ggml_backend_dev_memory"](dev, ctypes.byref(free), ctypes.byref(total))
        name = fn["ggml_backend_dev_name"](dev).decode()
        out.append(Device(name, fn["ggml_backend_dev_description"](dev).decode(), free.value, total.value,
                          kind == GGML_BACKEND_DEVICE_TYPE_IGPU or name.startswith("MTL")))
    return out


def block_count(path: Path) -> int:
    from clover_gguf.gguf_header import read_header

    kv = read_header(path).kv
    n = kv.get(f"{kv.get('general.architecture')}.block_count")
    if not isinstance(n, int):
        raise UserError(f"{path}: no block_count in the GGUF metadata")
    return n


def _load_model(L: Any, path: Path, offload: Offload, overrides: dict | None, keep: list, no_alloc: bool = False,
                rpc: Sequence[str] = ()):
    """llama_model_load_from_file with our offload options; `keep` holds every buffer llama.cpp points into.
    rpc: RPC servers (HOST:PORT) whose devices come first, then local GPUs, as llama.cpp's own --rpc places them."""
    L.llama_backend_init()
    L.llama_log_set(_quiet_log(L), ctypes.c_void_p())
    patterns = offload.expert_patterns(block_count(path)) if offload.cpu_moe or offload.n_cpu_moe else []
    supported = bool(L.llama_supports_gpu_offload())
    if not rpc and not gpu_devices():  # a CPU build, or one with GPU backends (RPC too) but no device to use
        no_offload_notice(offload)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = offload.n_gpu_layers(supported)
    if rpc:
        from clover_gguf import rpc as rpc_backend

        devices = rpc_backend.devices(ggml_library(), rpc)
        keep.append(devices)
        mp.devices = ctypes.cast(devices, ctypes.c_void_p)
    if patterns:
        arr = _buft_overrides(L, patterns)
        keep.append(arr)
        mp.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    # a file with block-mode keys of an earlier name (metadata.LEGACY_KEYS): llama.cpp reads them under the new ones
    from clover_gguf.gguf_header import read_header

    overrides = {**read_header(path).upgraded, **(overrides or {})}
    if overrides:
        kv = _kv_overrides(L, overrides)
        keep.append(kv)
        mp.kv_overrides = ctypes.cast(kv, ctypes.POINTER(L.llama_model_kv_override))
    # auto = mmap unless a device cannot map host memory; none = read into memory (a dry run must not map)
    mp.load_mode = LOAD_MODE_AUTO if offload.mmap and not no_alloc else LOAD_MODE_NONE
    mp.no_alloc = no_alloc
    return L.llama_model_load_from_file(str(path).encode(), mp)


def _context_params(L: Any, n_ctx: int, n_ubatch: int, n_batch: int | None, n_seq_max: int, n_rs_seq: int,
                    exact: bool, n_threads: int | None, n_threads_batch: int | None, n_outputs_max: int,
                    n_outputs_max_per_seq: int = 0, flash_attn: str = "auto") -> Any:
    """llama_context_params for these settings; flash_attn: --flash-attn (offload.FLASH_ATTN), which exact overrides
    (off: the reference's parity needs it)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx = padded_n_ctx(n_ctx)
    cp.n_batch = max(n_batch or n_ctx, n_ubatch)  # tokens one decode call may take: the whole context
    cp.n_ubatch = max(n_ubatch, 1)  # a block must fit in one ubatch
    cp.n_seq_max = n_seq_max
    cp.n_rs_seq = n_rs_seq
    # rows of logits one decode call may ask for; llama.cpp sizes the output buffer and the logits part of the
    # compute buffer by it (0 = n_batch: on a 248k vocabulary, 512 rows are about 0.5 GB of compute buffer)
    # llama.cpp's output buffer always holds a row per sequence, and it aborts when that is more than n_outputs_max
    cp.n_outputs_max = max(n_outputs_max, n_seq_max) if n_outputs_max else 0
    # 0 = n_outputs_max: a block pass's rows all belong to one sequence (backend sampling); llama.cpp's own default is
    # 1, which some of its samplers require (penalties)
    cp.n_outputs_max_per_seq = n_outputs_max_per_seq
    cp.kv_unified = True  # seq_cp of the KV cache is then metadata only
    # llama.cpp's split: n_threads for one-token calls, n_threads_batch for calls of several tokens
    threads = n_threads or max(1, min(8, os.cpu_count() or 1))
    cp.n_threads, cp.n_threads_batch = threads, n_threads_batch or threads
    cp.flash_attn_type = FLASH_ATTN["off" if exact else flash_attn]
    if exact:
        cp.type_k = cp.type_v = GGML_TYPE_F32
    return cp


class ContextError(UserError):
    """llama.cpp could not create a context for the model (too little memory for what was asked)."""


class LlamaContext:
    """One model and one context: causal decoding on sequence 0, block passes on scratch sequence 1.

    exact=True turns off flash attention and keeps K/V in F32, the settings parity with the reference needs
    (CPU flash attention and an F16 cache alone differ by about 3e-4). n_outputs_max caps the logits rows of one
    decode call (0: n_batch); a call asking for more raises instead of aborting inside llama.cpp.
    `offload` places the weights (clover_gguf.offload); n_threads / n_threads_batch, when given, win over its threads."""

    def __init__(self, gguf: str | Path, n_ctx: int = 4096, n_ubatch: int = 512, n_batch: int | None = None,
                 n_seq_max: int = 2,
                 overrides: dict[str, bool | int | float] | None = None, n_rs_seq: int = 0, exact: bool = False,
                 n_threads: int | None = None, n_threads_batch: int | None = None, n_outputs_max: int = 0,
                 offload: Offload | None = None, rpc: Sequence[str] = (), eval_callback: Any = None,
                 n_outputs_max_per_seq: int = 0):
        """eval_callback: llama.cpp's graph eval callback (a GraphProbe's .callback, clover_gguf.graph_probe).
        Several runtimes share one context through clover_gguf.batching (serve's slots)."""
        offload = offload or Offload()
        L = self.L = load_binding(offload.poll)
        path = Path(gguf)
        if not path.is_file():
            raise UserError(f"no such model file: {path}")
        keep: list[Any] = []  # buffers llama.cpp reads through pointers, alive as long as the model
        handle = _load_model(L, path, offload, overrides, keep, rpc=rpc)
        if not handle:
            raise UserError(f"llama.cpp could not load {path} (not a Clover GGUF, or the library is not patched)")
        self.model, self._model_keep = handle, keep
        # the threads and their waiting, from the model's size unless given (clover_gguf.threads)
        self.threading = choose(int(L.llama_model_size(handle)), int(L.llama_model_n_layer(handle)),
                                n_threads or offload.threads, n_threads_batch, offload.poll, openmp=has_openmp(L))
        cp = _context_params(L, n_ctx, n_ubatch, n_batch, n_seq_max, n_rs_seq, exact, self.threading.n_threads,
                             self.threading.n_threads_batch, n_outputs_max, n_outputs_max_per_seq, offload.flash_attn)
        if eval_callback is not None:
            self._eval_callback = eval_callback  # kept alive for as long as the context may call it
            cp.cb_eval = eval_callback
        self.n_outputs_max = cp.n_outputs_max or cp.n_batch
        self.max_outputs = 0  # the most logits rows one call asked for: llama.cpp's output buffer grew to that
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise ContextError("llama.cpp could not create a context (too little memory for n_ctx?)")
        self._api = _clover_api(L)
        self._pools = attach_threadpools(L, self.ctx, self.threading)  # freed after the context (close)
        # threads dropped to one while passes stall, probed back now and then (threads.StallGuard)
        self.guard = StallGuard(self.threading.n_threads, self.threading.n_threads_batch,
                                lambda a, b: L.llama_set_n_threads(self.ctx, a, b), on=offload.stall_guard)
        self._sampler = sampler_library(L)
        self.has_block_attn = bool(self._api.llama_model_has_block_attn(self.model))
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        # the chunks the selection sampler reads the vocabulary in (clover_sampler.h)
        self.n_chunks = self.n_vocab // max(1, self._sampler.clover_sampler_chunk(self.n_vocab))
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_batch = L.llama_n_batch(self.ctx)  # the most tokens one decode call may take (llama.cpp asserts it)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)  # the most tokens one block pass may take (likewise)
        self.mem = L.llama_get_memory(self.ctx)
        self._batch: _Batch | None = None  # reused by every decode call, grown when a call needs more room
        self._selectors: dict[int, tuple[tuple, Any]] = {}  # seq -> (settings, llama.cpp sampler chain)
        self._views: dict[tuple, np.ndarray] = {}  # numpy views of llama.cpp's sampled-output buffers
        self._pieces: dict[tuple[int, bool], bytes] = {}  # token_to_piece's, per (token, special)
        self._sizes_checked: set[tuple] = set()  # (width, probs, top_n) whose row sizes _graph_rows checked
        self._n_ids: dict[int, int] = {}  # seq -> the ids its sampler took for the next decode (masks' included)

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
        if not self._api.llama_set_block_attn(self.ctx, seq, enabled):
            raise UserError(f"llama.cpp refused block attention on sequence {seq}")

    def decode(self, ids: Sequence[int], pos0: int, seq: int = 0, logits: bool | Sequence[bool] = True,
               extra: Sequence[tuple[Sequence[int], int, int]] = (), gather: Gather | None = None
               ) -> np.ndarray | GraphRows | None:
        """Decode `ids` at positions pos0.. on `seq` (plus (ids, pos0, seq) parts in the same batch) ->
        logits [n_out, V] for the tokens that asked for them (all by default); with `gather`, the graph's selection
        rows for them instead (GraphRows; None when no token asked). A sequence switched to block attention
        (set_block_attn) is decoded as one block. A gather with no token asking (the first part of a prompt whose
        last token the gather is for) attaches its sampler now (attach), so that a prompt's passes all run on the
        compute buffers its sampler's graph keeps."""
        self._check_open()
        parts = [(ids, pos0, seq), *extra]
        n = sum(len(p[0]) for p in parts)
        # llama.cpp aborts the process on this (GGML_ASSERT): refuse it here, callers check requests earlier. (A block
        # larger than n_ubatch is the patch's error code -1, not an abort.)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one decode call, more than n_batch {self.n_batch}")
        batch = self._batch_for(n)
        batch.put(parts)
        want = batch.logits[:n]
        if isinstance(logits, bool):
            want[:len(ids)] = logits
        else:
            flags = np.asarray(list(logits), dtype=bool)
            if flags.shape != (len(ids),):
                raise ValueError(f"{flags.size} logits flags for {len(ids)} tokens")
            want[:len(ids)] = flags
        want[len(ids):] = 1
        n_out = int(np.count_nonzero(want))
        if n_out > self.n_outputs_max:  # llama.cpp would abort the process
            raise ValueError(f"{n_out} logits rows asked for, the context was made for at most {self.n_outputs_max}")
        if gather is not None and n_out:
            if extra:
                raise ValueError("a decode with a gather holds one sequence (decode_parts: several)")
            self._select_on(seq, gather, n_out, n)
            self._disarm((seq,))
        elif n_out:  # logits wanted: this decode's sequences carry no sampler (llama.cpp would copy no logits for
            # their rows); the others keep theirs (a row one kept, save_last, stays readable), told they have no rows
            seqs = {seq, *(int(p[2]) for p in extra)}
            for s in [s for s in self._selectors if s in seqs]:
                self._select_off(s)
            self._disarm(tuple(seqs))
        elif gather is not None:
            self.attach(seq, gather)
        self._run(batch, n, n_out)
        if gather is not None:  # llama.cpp finds a decode's rows by the batch index of the first
            if not n_out:
                return None
            self._check_selection(seq)
            return self._graph_rows(int(np.argmax(want)), n_out, gather, seq)
        if not n_out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        # llama.cpp stores the requested rows contiguously, in batch order
        return np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)).copy()

    def _run(self, batch: "_Batch", n: int, n_out: int) -> None:
        batch.struct.n_tokens = n
        t0 = time.perf_counter()
        rc = self.L.llama_decode(self.ctx, batch.struct)
        self.guard.record(pass_kind(n, n_out, batch.pos[n - 1]), time.perf_counter() - t0)
        if rc == DECODE_SAMPLER_REFUSED:
            raise RuntimeError(self._refusals())
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.max_outputs = max(self.max_outputs, n_out)

    def _refusals(self) -> str:
        """The one line of a decode that a selection sampler refused (llama_decode's -4, the series' patch 0010):
        each refusing sequence's reason (clover_sampler_error, also in llama.cpp's log)."""
        whys = [f"sequence {seq}: {why.decode(errors='replace')}" for seq, (_, chain) in sorted(self._selectors.items())
                if (why := self._sampler.clover_sampler_error(chain))]
        return (f"the selection sampler refused this decode's rows ({'; '.join(whys) or 'no reason kept'}); nothing "
                "was computed (this llama.cpp passes them in a way it does not know; selection='numpy' selects on the "
                "host)")

    def decode_parts(self, parts: Sequence[tuple[Sequence[int], int, int, Gather | None]]) -> list[GraphRows | None]:
        """Causal passes of several sequences in one llama_decode (a server's slots: their AR steps and prompt chunks):
        (ids, first position, sequence, gather) each -> per part, with a gather the row of its LAST token as
        GraphRows, selected in the graph by its own sequence's sampler (each sampler computes and reads its own
        rows), else None (no row). The sequences must differ. llama.cpp splits the batch into ubatches of
        equal tokens per sequence, so one-token steps share one graph and a prompt's other tokens follow."""
        self._check_open()
        seqs = [int(p[2]) for p in parts]
        if len(set(seqs)) != len(seqs):
            raise ValueError("decode_parts takes one part per sequence")
        n = sum(len(p[0]) for p in parts)
        n_out = sum(p[3] is not None for p in parts)
        if n > self.n_batch or n_out > self.n_outputs_max:  # llama.cpp would abort
            raise ValueError(f"{n} tokens and {n_out} rows in one decode, the context takes {self.n_batch} and "
                             f"{self.n_outputs_max}")
        batch = self._batch_for(n)
        lasts = batch.put([p[:3] for p in parts]) - 1
        batch.logits[:n] = 0
        for last, (_, _, seq, g) in zip(lasts, parts):
            if g is not None:
                batch.logits[last] = 1
                self._select_on(seq, g, 1, 1)
        self._disarm(seqs)
        self._run(batch, n, n_out)
        for _, _, seq, g in parts:
            if g is not None:
                self._check_selection(int(seq))
        # llama.cpp finds a row by its token's batch index
        return [self._graph_rows(int(last), 1, p[3], p[2]) if p[3] is not None else None
                for last, p in zip(lasts, parts)]

    # ---- selection in the graph (libclover_sampler) ------------------------------------------------------
    def _disarm(self, seqs: Sequence[int]) -> None:
        """The samplers of sequences outside this decode have no rows in it: each then spends one row of the graph
        (llama.cpp builds every attached sampler, and computes only the active ones), not as many as last time."""
        for seq, (_, chain) in self._selectors.items():
            if seq not in seqs:
                self._sampler.clover_sampler_set_inputs(chain, None, 0, 0, None, None)

    def gather_limit(self, sampled: bool, top_n: int = 0) -> int:
        """The most ids a gather may name (its width): what the sampler returns per row must fit llama.cpp's output
        row of n_vocab values (libclover_sampler refuses more)."""
        return self.n_vocab - (1 if sampled else self.n_chunks + 1) - top_n

    def _selector(self, seq: int, g: Gather, n_out: int) -> tuple[tuple, Any]:
        """`seq`'s selection sampler for a gather of n_out rows -> (its settings, its chain): the one it has when that
        fits, else a new one attached to llama.cpp (which then re-reserves its compute buffers at the next decode: new
        memory, whose pages each graph touches for the first time)."""
        key = (g.width, g.probs, g.temp, g.top_k, g.top_p, g.top_n, g.save_last)
        held = self._selectors.get(seq)
        if held is not None and held[0][1:] == key[1:] and g.width <= held[0][0] and \
                (held[0][0] <= 4 * g.width or held[0][0] * n_out <= REUSE_PADDING):
            g.width, key = held[0][0], held[0]  # wide enough and not much wider: the graph is not rebuilt
        if held is None or held[0] != key:
            L = self.L
            smpl = self._sampler.clover_sampler_init_ext(self.n_vocab, g.width, g.probs, g.temp, g.top_k, g.top_p,
                                                         g.top_n, g.save_last)
            if not smpl:
                raise ValueError(f"the selection sampler refused its settings {key}")
            chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            L.llama_sampler_chain_add(chain, smpl)
            if not L.llama_set_sampler(self.ctx, seq, chain):
                L.llama_sampler_free(chain)
                raise RuntimeError(f"llama.cpp refused the selection sampler on sequence {seq}")
            if held is not None:
                L.llama_sampler_free(held[1])
            self._selectors[seq] = held = (key, chain)
        return held

    def attach(self, seq: int, g: Gather) -> None:
        """Give `seq` the sampler of a gather whose rows a later decode asks for, with no rows in this one. A prompt
        kept in parts (runtime.LlamaBackend: its first tokens, then the rest) gets its sampler before its first part:
        attached only before the last, llama.cpp's re-reserve would throw away the compute buffers the long first
        part had touched, and the next turns' passes would fault in fresh pages of new ones (on the tool model at 37K
        tokens of context, a continuing turn's prefill took 2.4x llama-server's)."""
        held = self._selector(seq, g, g.n_rows)
        self._sampler.clover_sampler_set_inputs(held[1], None, 0, 0, None, None)  # no rows in this decode

    def _select_on(self, seq: int, g: Gather, n_out: int, n: int) -> None:
        """Give `seq` the selection sampler for this gather (a new one when its settings changed) and its inputs
        for this decode (the sampler copies them)."""
        if g.n_rows != n_out:
            raise ValueError(f"a gather for {g.n_rows} rows, the decode has {n_out}")
        if n_out > 1 and n > self.n_ubatch:  # the sampler reads one ubatch's rows
            raise ValueError(f"{n} tokens with {n_out} selected rows: more than one micro-batch ({self.n_ubatch})")
        ids = np.ascontiguousarray(g.ids, dtype=np.int32)
        coef = u = None
        if g.coef is not None:
            coef = np.ascontiguousarray(g.coef, dtype=np.float32)
            if coef.shape != (3, n_out, len(ids)):
                raise ValueError(f"a gather's coef must be [3, {n_out}, {len(ids)}], got {list(coef.shape)}")
        if g.temp > 0:
            u = None if g.uniform is None else np.ascontiguousarray(g.uniform, dtype=np.float32)
            if coef is None or u is None or u.shape != (n_out,):
                raise ValueError(f"a sampled gather needs coef [3, {n_out}, {len(ids)}] and uniform [{n_out}]")
        held = self._selector(seq, g, n_out)
        masks = row_mask = None
        n_words = n_masks = 0
        if g.masks:
            if g.row_mask is None or g.row_mask.shape != (n_out,):
                raise ValueError(f"a gather's row masks must be [{n_out}]")
            masks = np.ascontiguousarray(np.stack([m.words for m in g.masks]), dtype=np.int32)
            n_masks, n_words = masks.shape
            row_mask = np.ascontiguousarray(g.row_mask, dtype=np.int32)
        got = self._sampler.clover_sampler_set_inputs_ext(
            held[1], _address(ids), len(ids), n_out, _address(coef), 0 if coef is None else coef.shape[2],
            _address(u), _address(masks), n_words, n_masks, _address(row_mask))
        if got < 0:
            raise ValueError(f"the selection sampler refused its inputs: {len(ids)} ids and {n_masks} masks' (width "
                             f"{g.width}, each in [0, {self.n_vocab})), {n_out} rows, uniforms in [0, 1]")
        self._n_ids[seq] = got

    def _select_off(self, seq: int) -> None:
        held = self._selectors.pop(seq, None)
        if held is not None:
            self.L.llama_set_sampler(self.ctx, seq, None)
            self.L.llama_sampler_free(held[1])

    def _check_selection(self, seq: int) -> None:
        """The decode's rows of `seq` are its sampler's: a refused call already failed the decode (_run); what is left
        is a sampler that cannot select at all (backend_init failed, llama.cpp selected on the host:
        clover_sampler_error, also in llama.cpp's log), whose rows are not its outputs: the decode fails naming why."""
        why = self._sampler.clover_sampler_error(self._selectors[seq][1])
        if why:
            raise RuntimeError(f"the selection sampler refused sequence {seq}'s rows in this decode: "
                               f"{why.decode(errors='replace')} (this llama.cpp passes them in a way it does not "
                               "know; selection='numpy' selects on the host)")

    def _graph_rows(self, first: int, n_out: int, g: Gather, seq: int | None = None) -> GraphRows:
        """The sampler's outputs for the decode's n_out rows from batch index `first` on, each read through
        llama.cpp's _ith getters at its batch index (where a row lies is llama.cpp's business).
        Layout: clover_gguf/csrc/clover_sampler.h."""
        api, ctx = self._api, self.ctx
        w, k = g.width, g.top_n
        rows = np.flatnonzero(self._batch.logits[first:self._batch.struct.n_tokens])[:n_out] + first
        n_ids = self._n_ids.get(seq)
        saved = self._saved_logit(seq) if g.save_last and seq is not None else None
        if g.temp > 0:
            n_p = api.llama_get_sampled_probs_count_ith(ctx, first)
            if n_p != w + 1 + k:
                raise RuntimeError(f"the selection sampler returned {n_p} probabilities per row for a width of {w}")
            p = self._rows(api.llama_get_sampled_probs_ith, rows, n_p, np.float32)
            tokens = np.fromiter((api.llama_get_sampled_token_ith(ctx, int(i)) for i in rows), dtype=np.int64,
                                 count=n_out)
            out = GraphRows(at_ids=p[:, :w], tokens=tokens, token_probs=p[:, w], n_ids=n_ids, saved=saved)
            if k:  # [at the ids | the draw | the top k], probabilities, candidates and processed logits alike
                z = self._rows(api.llama_get_sampled_logits_ith, rows, n_p, np.float32)
                c = self._rows(api.llama_get_sampled_candidates_ith, rows, n_p, np.int32)
                out.top_ids, out.top_probs, out.top_logits = c[:, w + 1:], p[:, w + 1:], z[:, w + 1:]
                out.at_logits, out.token_z = z[:, :w], z[:, w]
            return out
        n = self.n_chunks
        n_f = w + n + 1 + k  # [at the ids | chunk maxima | the choice | the top k]
        key = (w, g.probs, k)
        if key not in self._sizes_checked:  # the library's row layout, checked once per setting (two calls a pass)
            got = api.llama_get_sampled_logits_count_ith(ctx, first)
            if got != n_f:
                raise RuntimeError(f"the selection sampler returned {got} logits per row for a width of {w}, not {n_f}")
            if g.probs and api.llama_get_sampled_probs_count_ith(ctx, first) != n:
                raise RuntimeError("the selection sampler returned no chunk probabilities")
            self._sizes_checked.add(key)
        f = self._rows(api.llama_get_sampled_logits_ith, rows, n_f, np.float32)
        ids = self._rows(api.llama_get_sampled_candidates_ith, rows, n_f, np.int32)[:, w:]
        probs = None
        if g.probs:
            probs = self._rows(api.llama_get_sampled_probs_ith, rows, n, np.float32)
        out = GraphRows(at_ids=f[:, :w], rest_ids=ids[:, :n], rest_logits=f[:, w:w + n], rest_probs=probs,
                        tokens=ids[:, n], token_logits=f[:, w + n], n_ids=n_ids, saved=saved)
        if k:
            out.top_ids, out.top_logits = ids[:, n + 1:], f[:, w + n + 1:]
        return out

    def _saved_logit(self, seq: int):
        """-> token -> the raw logit of the last row of `seq`'s latest saving decode (read when asked: before the
        sequence's next decode, which may save another row)."""
        chain = self._selectors[seq][1]
        out = ctypes.c_float()

        def read(token: int) -> float:
            held = self._selectors.get(seq)
            if held is None or held[1] is not chain:  # freed with its sampler (its settings changed)
                raise ValueError(f"the row kept on sequence {seq} is gone (its sampler was replaced)")
            if self._sampler.clover_sampler_saved_logit(chain, int(token), ctypes.byref(out)) != 0:
                raise ValueError(f"no saved row holds token {token}")
            return float(out.value)

        return read

    def _rows(self, getter, rows: np.ndarray, n: int, dtype) -> np.ndarray:
        """[len(rows), n]: the first n values of each row's sampled output, its address asked of llama.cpp's _ith
        getter (`getter`) at the row's batch index, one call per row."""
        out = np.empty((len(rows), n), dtype=dtype)
        for j, i in enumerate(rows.tolist()):
            out[j] = self._row_view(getter(self.ctx, i), n, dtype)
        return out

    def _row_view(self, addr: int | None, n: int, dtype) -> np.ndarray:
        """numpy view of n values at one of llama.cpp's sampled-output rows (kept per address: llama.cpp reuses its
        output buffers, and making a view through ctypes costs more than the rest of a row's reading)."""
        if not addr:
            raise RuntimeError("llama.cpp returned no sampled row (was the selection sampler attached?)")
        key = (addr, n, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 1024:
                self._views.clear()
            buf = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(addr)
            view = self._views[key] = np.frombuffer(buf, dtype=dtype)
        return view

    def _batch_for(self, n: int) -> "_Batch":
        if self._batch is None or self._batch.capacity < n:
            self._batch = _Batch(self.L, max(n, 64, 2 * (self._batch.capacity if self._batch else 0)))
        return self._batch

    def block(self, block_ids: Sequence[int], n_past: int, seq: int = 0, scratch: int = 1,
              positions: Sequence[int] | None = None, gather: Gather | None = None) -> np.ndarray | GraphRows:
        """Block-mode logits [B, V] for `block_ids` after the n_past tokens of `seq`, which is left untouched; only
        the rows of `positions` when given; the graph's selection rows with `gather` (decode)."""
        L = self.L
        want: bool | list[bool] = True
        if positions is not None:
            want = [False] * len(block_ids)
            for i in positions:
                want[i] = True
        # the flag is the scratch sequence's state: the copy takes the committed sequence's (off), emptying it drops it
        self.seq_cp(seq, scratch)
        try:
            self.set_block_attn(scratch)
            return self.decode(block_ids, n_past, seq=scratch, logits=want, gather=gather)
        finally:
            L.llama_memory_seq_rm(self.mem, scratch, -1, -1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self.L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        """Copy sequence src onto dst; llama.cpp's refusal (a copy between a block sequence and one holding tokens,
        which would merge a block into a causal prefix, or a bad id) is a RuntimeError, never a copy silently not
        made."""
        if not self._api.llama_memory_seq_cp(self.mem, src, dst, -1, -1):
            raise RuntimeError(f"llama.cpp refused to copy sequence {src} onto sequence {dst} (a copy between a block "
                               "sequence and one that holds tokens, or a bad sequence id: its log says which)")

    def state_seq_get(self, seq: int) -> np.ndarray:
        """The state of one sequence (its KV cells and its recurrent state), as llama.cpp serializes it: bytes in a
        uint8 array. One copy, into memory not zeroed first: the other slots wait for it (about 63 MiB on the 35B)."""
        self._check_open()
        L = self.L
        n = int(L.llama_state_seq_get_size(self.ctx, seq))
        buf = np.empty(n, dtype=np.uint8)
        got = int(L.llama_state_seq_get_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq))
        if got == 0 or got > n:
            raise RuntimeError(f"llama.cpp could not save the state of sequence {seq}")
        return buf[:got]

    def state_seq_set(self, seq: int, state: bytes | np.ndarray) -> None:
        """Load a state_seq_get result into `seq` (emptied first); read in place, not copied."""
        self._check_open()
        self.seq_rm(seq)
        src = np.frombuffer(state, dtype=np.uint8)
        if int(self.L.llama_state_seq_set_data(self.ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                               src.size, seq)) == 0:
            self.seq_rm(seq)
            raise RuntimeError(f"llama.cpp could not load a saved state into sequence {seq}")

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    # ---- tokenizer --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if not getattr(self, "ctx", None):  # llama.cpp would read freed memory
            raise UserError("the model was closed")

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        self._check_open()
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
        """The token's text (bytes: a piece may hold part of a UTF-8 character). Kept per token once read: the
        vocabulary does not change, and a ctypes call per token is a tenth of the host's time per AR step."""
        key = (int(token), bool(special))
        piece = self._pieces.get(key)
        if piece is None:
            self._check_open()
            size = 256
            while True:
                buf = ctypes.create_string_buffer(size)
                n = self.L.llama_token_to_piece(self.vocab, key[0], buf, size, 0, key[1])
                if n >= 0:
                    break
                size = -n  # llama.cpp: the piece needs -n bytes
            piece = self._pieces[key] = buf.raw[:n]
        return piece

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
            self.ctx = None
        for pool in getattr(self, "_pools", ()):  # after the context that computed with them
            self.L.llama_cpp._lib.ggml_threadpool_free(pool)
        self._pools = []
        for _, chain in getattr(self, "_selectors", {}).values():  # after the context that held them
            self.L.llama_sampler_free(chain)
        self._selectors = {}

        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
        self.model = None

    def __enter__(self) -> "LlamaContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _address(a: np.ndarray | None) -> int | None:
    """The data pointer of a numpy array (cheaper than .ctypes.data)."""
    return None if a is None else a.__array_interface__["data"][0]


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

    def put(self, parts: Sequence[tuple[Sequence[int], int, int]]) -> np.ndarray:
        """(ids, first position, sequence) parts one after the other (vector writes into the arrays the llama_batch
        points at; the logits flags are the caller's) -> each part's end index."""
        i = 0
        ends = np.empty(len(parts), dtype=np.int64)
        for j, (ids, pos0, seq) in enumerate(parts):
            k = len(ids)
            self.token[i:i + k] = ids
            self.pos[i:i + k] = np.arange(pos0, pos0 + k)
            self.seq[i:i + k] = seq
            i += k
            ends[j] = i
        return ends


# ---- llama.cpp's log -------------------------------------------------------------------------------------
LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CONT = 1, 2, 3, 4, 5  # ggml_log_level


class LlamaLog:
    """llama.cpp's log lines (level, text) collected while a `capture_llama_log()` block runs. llama.cpp writes a
    line in pieces; a piece of level CONT continues the line before it."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self._buf = ""
        self._level = LOG_INFO

    def _feed(self, level: int, text: str) -> None:
        if level != LOG_CONT and not self._buf:
            self._level = level
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.lines.append((self._level, line))

    def _flush(self) -> None:
        if self._buf:
            self.lines.append((self._level, self._buf))
            self._buf = ""

    def text(self, min_level: int = LOG_DEBUG) -> list[str]:
        return [t for lv, t in self.lines if lv >= min_level]

    def grep(self, pattern: str) -> list[re.Match]:
        rx = re.compile(pattern)
        return [m for _, t in self.lines if (m := rx.search(t))]


_LOG_CALLBACK = None  # the one callback given to the library, kept alive for as long as it may call it
_log_captures: list[LlamaLog] = []
_log_lock = threading.Lock()


def _on_log(level, text, user_data):
    """Silent unless CLOVER_GGUF_LLAMA_LOG is set; collected by every active capture_llama_log()."""
    try:
        if os.environ.get("CLOVER_GGUF_LLAMA_LOG"):
            os.write(2, text)
        if _log_captures:
            piece = text.decode("utf-8", "replace")
            with _log_lock:
                for cap in _log_captures:
                    cap._feed(int(level), piece)
    except Exception:  # noqa: BLE001 - an exception must never cross into C
        pass


def _quiet_log(L: Any) -> Any:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = L.llama_log_callback(_on_log)
    return _LOG_CALLBACK


@contextlib.contextmanager
def capture_llama_log() -> Iterator[LlamaLog]:
    """Collect llama.cpp's log (debug level included) while the block runs, e.g. around creating a LlamaContext,
    a decode or close(). Still silent on stderr unless CLOVER_GGUF_LLAMA_LOG is set."""
    L = load_binding()
    L.llama_log_set(_quiet_log(L), ctypes.c_void_p())
    cap = LlamaLog()
    with _log_lock:
        _log_captures.append(cap)
    try:
        yield cap
    finally:
        with _log_lock:
            _log_captures.remove(cap)
        cap._flush()
