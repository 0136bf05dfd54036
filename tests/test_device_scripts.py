"""bench/device: the GPU check's own arithmetic (pass timing, the tok/s projection, the kit's trimming), checked here
so that the device's few minutes go to measuring."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]


steps = load_bench("device/steps.py")
kit = load_bench("device/kit.py")


class FakeBackend:
    """Sleeps a known time per call; commit settles a pending rollback first, as LlamaBackend does; every call decodes
    through the context's binding (L.llama_decode), a rollback once."""

    def __init__(self, ctx):
        self.pending, self.ctx = False, ctx

    def _decode(self, n, seconds):
        self.ctx.L.llama_decode(self.ctx.ctx, SimpleNamespace(n_tokens=n, seconds=seconds))

    def prefill(self, ids):
        self._decode(len(ids), 0.01)

    def commit(self, ids):
        if self.pending:
            self.pending = False
            self._apply_rollback(1)
        self._decode(len(ids), 0.02)
        time.sleep(0.01)  # outside llama_decode: a sequence copy

    def block_logits(self, block):
        self._decode(len(block), 0.02)

    def _apply_rollback(self, n):
        self._decode(3, 0.05)


def _fake_runtime():
    synced = []
    L = SimpleNamespace(llama_synchronize=lambda ctx: synced.append(ctx),
                        llama_decode=lambda ctx, batch: time.sleep(batch.seconds) or 0)
    ctx = SimpleNamespace(L=L, ctx="ctx")
    return SimpleNamespace(backend=FakeBackend(ctx), ctx=ctx), synced


def test_pass_log_names_kinds_by_mode_and_keeps_a_nested_rollback_out_of_the_commit():
    """bench/measure.PassLog, as bench/device/steps.py uses it."""
    rt, synced = _fake_runtime()
    log = steps.PassLog(rt)
    b = rt.backend
    log.mode = "ar"
    b.prefill([1])
    b.commit([2])
    log.mode = "draft-self"
    b.block_logits([3] * 4)
    b.pending = True
    b.commit([4, 5])  # settles the rollback inside: 0.05 s of rollback, 0.03 s of verification
    kinds = {m: {p.kind for p in log.of(m)} for m in ("ar", "draft-self")}
    assert kinds == {"ar": {"prompt", "AR step"}, "draft-self": {"block", "verify", "rollback"}}
    verify, = log.of("draft-self", "verify")
    rollback, = log.of("draft-self", "rollback")
    assert verify.seconds == pytest.approx(0.03, abs=0.015) and verify.decode_seconds == pytest.approx(0.02, abs=0.01)
    assert (verify.tokens, verify.decodes) == (2, 1) and (rollback.tokens, rollback.decodes) == (3, 1)
    assert rollback.seconds == pytest.approx(0.05, abs=0.015)
    assert len(synced) == 5 + 5  # every pass ends with a synchronize (the nested one too), every decode too
    log.close()
    assert "commit" not in vars(b) and rt.ctx.L.llama_decode(None, SimpleNamespace(seconds=0)) == 0


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


@pytest.mark.slow  # 70 s of `make test-fast`'s 6 min 25 s in issue 38: the whole device run, not a fast check
def test_pack_then_run_on_the_cpu(tmp_path):
    """The scripts end to end on the CPU: pack a kit, then every step of run.sh's CPU profile from the kit's own copy
    of the project, with the cached build (`--reuse-build`): each step ends ok or skipped with a reason, and each
    section holds its figures. About 2 minutes on 2 quiet cores. `--budget 0`: no step is skipped for time or stopped
    at a cap (the GPU run's limits; on a busy machine a step took 270 s against its 90, issue 50): the profile fixes
    the work, and the subprocess timeout is a hang guard far above it (30x)."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHON=sys.executable)
    kit_dir, work, out = tmp_path / "kit", tmp_path / "work", tmp_path / "out"
    p = subprocess.run(["bash", str(ROOT / "bench/device/pack.sh"), str(kit_dir), "--quiet"], env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    manifest = json.loads((kit_dir / "kit.json").read_text())
    assert manifest["total_bytes"] <= kit.MAX_KIT_BYTES
    assert {"llama.cpp.tar.xz", "binding.tar.xz", "project.tar.xz"} <= set(manifest["bytes"])
    p = subprocess.run(["bash", str(ROOT / "bench/device/run.sh"), str(kit_dir), "--backend", "cpu", "--reuse-build",
                        "--budget", "0", "--work", str(work), "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=3600)
    assert p.returncode == 0, p.stdout[-3000:]
    res = json.loads((out / "results.json").read_text())
    status = {s["step"]: s for s in res["steps"]}
    assert res["run"]["finished"] and not res["not_reached"]
    for name, s in status.items():
        assert s["status"] == "ok" or (s["status"] == "skipped" and s["reason"]), s
    assert status["parity_real_shape"]["status"] == "skipped"  # the CPU profile leaves it to CI's own run
    sec = res["sections"]
    # the kit's copy of the project, its binding and its wheels are what ran, not this checkout or this venv
    assert sec["env"]["kit"]["patch_hash"] == manifest["patch_hash"]
    for name, origin in sec["env"]["imports"].items():
        assert origin.startswith(str(work / "kit")), (name, origin)
    for name in ("parity_exact", "parity_defaults", "parity_runtime"):
        assert sec[name]["passed"] > 0 and sec[name]["failed"] == 0, sec[name]
    assert sec["parity_exact"]["max_rel_err"] <= 1e-4 < sec["parity_defaults"]["max_rel_err"]  # F16 K/V shows
    for name in ("decode_bundled", "decode_slice", "decode_slice_cpu_moe"):
        for mode in ("ar", "diffusion", "draft-self"):
            m = sec[name]["modes"][mode]
            assert m["tokens"] > 0 and m["tok_s"] > 0 and m["passes"], (name, mode, m)
    d = sec["decode_bundled"]
    n_ar, tokens = d["modes"]["ar"]["passes"]["AR step"]["count"], d["modes"]["ar"]["tokens"]
    assert tokens - d["prompts"] <= n_ar <= tokens  # one AR step per token but the last of an answer cut by length
    assert set(sec["decode_slice"]["projected"]) == {"ar", "diffusion", "draft-self"}
    assert sec["decode_slice_cpu_moe"]["n_cpu_moe"] == 4
    bc = sec["block_checks"]
    assert set(bc["graph_reuse"]) == {"causal", "block", "alternating"}
    assert bc["graph_reuse"]["alternating"]["causal_ms"] > 0 and bc["graph_reuse"]["alternating"]["block_ms"] > 0
    assert bc["experts"]["layer_tokens"] > 0 and bc["experts"]["equal_share"] == 1.0  # the CPU against itself
    mem = sec["memory"]
    assert mem["llama_fit_print"]["rc"] == 0 and mem["llama_fit_params"]["rc"] == 0
    assert "parts" in mem["clover_fit"] and "measured" in mem["clover_fit"]
    assert mem["runtime"]["breakdown_mib_at_creation"] == mem["runtime"]["breakdown_mib_after_decoding"]
    assert (out / "results.md").read_text().startswith("# GPU check results (cpu)")
