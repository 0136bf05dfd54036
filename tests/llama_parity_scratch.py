"""Compare the patched llama.cpp (through the llama-cpp-python binding) with clover_gguf.reference.

    LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin python tests/llama_parity_scratch.py CHECKPOINT_DIR MODEL.gguf

Causal logits over a prompt, then block-mode logits (seq_cp 0 -> 1, non-causal decode of the block on seq 1,
seq_rm 1) with coreset routing as the GGUF says and overridden off, and a check that seq 0 is untouched.
Parity needs flash attention off and an F32 KV cache (CPU flash attention and F16 K/V set a ~3e-4 floor).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class LlamaRunner:
    """A bare llama.cpp context on one model: causal decode on seq 0, block decode on a scratch seq 1."""

    def __init__(self, gguf_path: str, n_ctx: int = 512, overrides: dict | None = None, n_seq_max: int = 2,
                 n_rs_seq: int = 0):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self._ovr = None
        if overrides:
            arr = (L.llama_model_kv_override * (len(overrides) + 1))()
            for i, (key, val) in enumerate(overrides.items()):
                arr[i].key = key.encode()
                if isinstance(val, bool):
                    arr[i].tag = L.LLAMA_KV_OVERRIDE_TYPE_BOOL
                    arr[i].value.val_bool = val
                elif isinstance(val, int):
                    arr[i].tag = L.LLAMA_KV_OVERRIDE_TYPE_INT
                    arr[i].value.val_i64 = val
                else:
                    arr[i].tag = L.LLAMA_KV_OVERRIDE_TYPE_FLOAT
                    arr[i].value.val_f64 = float(val)
            arr[len(overrides)].key = b""
            self._ovr = arr
            mp.kv_overrides = ctypes.cast(arr, ctypes.POINTER(L.llama_model_kv_override))
        self.model = L.llama_model_load_from_file(gguf_path.encode(), mp)
        assert self.model, "failed to load " + gguf_path
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx  # a block must fit in one ubatch
        cp.n_seq_max = n_seq_max
        cp.n_rs_seq = n_rs_seq  # recurrent-state rollback snapshots (speculative decoding)
        cp.kv_unified = True
        cp.flash_attn_type = 0  # disabled
        cp.type_k = 0  # GGML_TYPE_F32
        cp.type_v = 0
        cp.n_threads = 2
        cp.n_threads_batch = 2
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx, "failed to create context"
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.mem = L.llama_get_memory(self.ctx)

    def decode(self, ids, pos0: int, seq: int, extra: list[tuple[list, int, int]] = ()) -> np.ndarray:
        """Decode `ids` at positions pos0.. on `seq` (plus optional (ids, pos0, seq) parts in the same batch)."""
        L = self.L
        parts = [(ids, pos0, seq), *extra]
        n = sum(len(p[0]) for p in parts)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            i = 0
            for p_ids, p_pos0, p_seq in parts:
                for j, t in enumerate(p_ids):
                    batch.token[i] = int(t)
                    batch.pos[i] = p_pos0 + j
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = p_seq
                    batch.logits[i] = 1
                    i += 1
            batch.n_tokens = n
            rc = L.llama_decode(self.ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            out = np.empty((n, self.n_vocab), dtype=np.float32)
            for i in range(n):
                p = L.llama_get_logits_ith(self.ctx, i)
                out[i] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
            return out
        finally:
            L.llama_batch_free(batch)

    def block(self, block_ids, n_past: int) -> np.ndarray:
        """Block-mode logits for `block_ids` after the n_past tokens held by seq 0; seq 0 is left untouched."""
        L = self.L
        L.llama_memory_seq_cp(self.mem, 0, 1, -1, -1)
        L.llama_set_causal_attn(self.ctx, False)
        try:
            return self.decode(block_ids, n_past, seq=1)
        finally:
            L.llama_set_causal_attn(self.ctx, True)
            L.llama_memory_seq_rm(self.mem, 1, -1, -1)

    def close(self):
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def main(ckpt: str, gguf: str) -> int:
    import torch

    from clover_gguf.reference import CloverModel

    torch.manual_seed(0)
    ref = CloverModel.from_pretrained(ckpt, dtype=torch.float64)
    V = ref.cfg.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, V, size=23).tolist()
    block = rng.integers(0, V, size=ref.cfg.block_size if ref.cfg.is_clover else 8).tolist()
    nxt = rng.integers(0, V, size=5).tolist()

    ok = True

    def report(name, a, b, tol=1e-4):
        nonlocal ok
        e = rel_err(a, b)
        ok &= e <= tol
        print(f"{name:40s} rel err {e:.3e} {'ok' if e <= tol else 'FAIL'}")

    with torch.no_grad():
        ref_causal = ref(torch.tensor(prefix + nxt)).numpy()
    r = LlamaRunner(gguf)
    try:
        lc = r.decode(prefix, 0, 0)
        report("causal prefix", lc, ref_causal[: len(prefix)])
        if ref.cfg.is_clover:
            for cs in (None, False, True):
                with torch.no_grad():
                    rb = ref.block_logits(prefix, block, coreset=cs).numpy()
                if cs is None:
                    lb = r.block(block, len(prefix))
                    report("block (coreset as GGUF)", lb, rb)
            with torch.no_grad():
                rb_off = ref.block_logits(prefix, block, coreset=False).numpy()
                rb_on = ref.block_logits(prefix, block, coreset=True).numpy()
            print(f"{'(ref coreset on vs off differ by)':40s} rel {rel_err(rb_on, rb_off):.3e}")
            # block of one token and a short block
            for b in (block[:1], block[:5]):
                with torch.no_grad():
                    rb = ref.block_logits(prefix, b).numpy()
                report(f"block len {len(b)}", r.block(b, len(prefix)), rb)
        ln = r.decode(nxt, len(prefix), 0)
        report("causal continuation after block", ln, ref_causal[len(prefix):])
    finally:
        r.close()

    if ref.cfg.is_clover:
        r = LlamaRunner(gguf, overrides={"clover.moe_block_coreset.enabled": False})
        try:
            r.decode(prefix, 0, 0)
            report("block (coreset overridden off)", r.block(block, len(prefix)), rb_off)
        finally:
            r.close()
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
