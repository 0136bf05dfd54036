"""bench/device: the GPU check's own arithmetic (pass timing, the tok/s projection, the kit's trimming), checked here
so that the device's few minutes go to measuring."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"device_{name}", ROOT / "bench" / "device" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


steps = _load("steps")
kit = _load("kit")


class FakeBackend:
    """Sleeps a known time per call; commit settles a pending rollback first, as LlamaBackend does."""

    def __init__(self):
        self.pending = False

    def prefill(self, ids):
        time.sleep(0.01)

    def commit(self, ids):
        if self.pending:
            self.pending = False
            self._apply_rollback(1)
        time.sleep(0.03)

    def block_logits(self, block):
        time.sleep(0.02)

    def _apply_rollback(self, n):
        time.sleep(0.05)


def _fake_runtime():
    synced = []
    L = SimpleNamespace(llama_synchronize=lambda ctx: synced.append(ctx))
    return SimpleNamespace(backend=FakeBackend(), ctx=SimpleNamespace(L=L, ctx="ctx")), synced


def test_pass_timer_names_kinds_by_mode_and_keeps_a_nested_rollback_out_of_the_commit():
    rt, synced = _fake_runtime()
    timer = steps.PassTimer(rt)
    b = rt.backend
    timer.mode = "ar"
    b.prefill([1])
    b.commit([2])
    timer.mode = "draft-self"
    b.block_logits([3])
    b.pending = True
    b.commit([4])  # settles the rollback inside: 0.05 s of rollback, 0.03 s of verification
    t = timer.times
    assert set(t["ar"]) == {"prompt", "AR step"} and set(t["draft-self"]) == {"block", "verify", "rollback"}
    assert t["draft-self"]["verify"][0] == pytest.approx(0.03, abs=0.015)
    assert t["draft-self"]["rollback"][0] == pytest.approx(0.05, abs=0.015)
    assert len(synced) == 5  # every timed call ends with a synchronize (the nested one too)


def test_projection_prices_the_pass_mix_at_this_models_costs():
    def section(per_kind):  # {mode: {kind: (per_token, median_ms)}}
        return {"modes": {m: {"passes": {k: {"per_token": pt, "median_ms": ms} for k, (pt, ms) in kinds.items()}}
                          for m, kinds in per_kind.items()}}

    bundled = section({"ar": {"prompt": (0.02, 1.0), "AR step": (1.0, 1.0)},
                       "diffusion": {"prompt": (0.02, 1.0), "block": (0.25, 1.0), "commit": (0.125, 1.0)},
                       "draft-self": {"prompt": (0.02, 1.0), "block": (0.2, 1.0), "verify": (0.25, 1.0),
                                      "rollback": (0.1, 1.0)}})
    slice_ = section({"ar": {"AR step": (1.0, 4.0)}, "diffusion": {"block": (1.0, 12.0), "commit": (0.03, 10.0)},
                      "draft-self": {"block": (1.0, 12.0), "verify": (0.5, 8.0), "rollback": (0.1, 6.0)}})
    got = steps.project(slice_, bundled)
    # by hand: ms per token = sum over kinds (prompt left out) of passes per token x this model's ms per pass
    assert got["ar"]["ms_per_token"] == pytest.approx(4.0)
    assert got["diffusion"]["ms_per_token"] == pytest.approx(0.25 * 12 + 0.125 * 10)
    assert got["draft-self"]["ms_per_token"] == pytest.approx(0.2 * 12 + 0.25 * 8 + 0.1 * 6)
    assert got["diffusion"]["tok_s"] == pytest.approx(1000 / 4.25)
    assert got["diffusion"]["x_ar"] == pytest.approx(4.0 / 4.25)


def test_trim_keeps_the_cuda_and_cpu_build_and_drops_the_rest(tmp_path):
    tree = tmp_path / "llama.cpp"
    for rel in ("CMakeLists.txt", "src/llama.cpp", "ggml/src/ggml-cpu/a.c", "ggml/src/ggml-cuda/b.cu",
                "ggml/src/ggml-rpc/c.cpp", "ggml/src/ggml-vulkan/d.cpp", "ggml/src/ggml-sycl/e.cpp",
                "ggml/src/ggml.c", "models/ggml-vocab.gguf", "docs/x.md", "convert_hf_to_gguf.py",
                "scripts/ui-assets.cmake", "scripts/sync.py", "tools/ui/CMakeLists.txt", "tests/test-x.cpp"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    kit.trim_llama_tree(tree)
    left = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert left == ["CMakeLists.txt", "ggml/src/ggml-cpu/a.c", "ggml/src/ggml-cuda/b.cu", "ggml/src/ggml-rpc/c.cpp",
                    "ggml/src/ggml.c", "scripts/ui-assets.cmake", "src/llama.cpp", "tests/test-x.cpp",
                    "tools/ui/CMakeLists.txt"]
