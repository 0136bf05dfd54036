"""`clover-gguf fit`: the 35B plans for 24 and 16 GiB GPUs, weights from the same code as `quantize --plan`, the
prediction against what llama.cpp allocates (bundled model and a random `small` one, AR and a block mode), and bad
input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clover_gguf import fit
from clover_gguf.config import SHAPE_35B
from clover_gguf.convert import convert
from clover_gguf.errors import UserError
from clover_gguf.llama_memory import DryRun
from clover_gguf.quantize import _pad, plan

GiB = 2**30


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def q4_35b(tmp_path_factory):
    """The 35B shape as Q4_K_M: its weights (quantize --plan) and a skeleton llama.cpp can dry-run."""
    model = fit.model_from_config(SHAPE_35B, "Q4_K_M", tmp_path_factory.mktemp("fit35"))
    with DryRun(model.gguf) as dry:
        yield model, dry


def _plan(model, dry, vram, ctx=None, ram="64GiB"):
    budget = fit.make_budget(vram, ram, None, [])
    return fit.plan(model, budget, fit.Setup(), ctx, dry, gpu_here=False)


def test_35b_q4_k_m_on_24_gib_fits_without_expert_offload_at_a_stated_context():
    r = _cli("fit", "--config", SHAPE_35B, "--type", "Q4_K_M", "--vram", "24GiB", "--ram", "64GiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"] and out["n_cpu_moe"] == 0 and out["gpu_layers"] == 41
    assert out["ctx"] == 131072  # the model's whole context
    assert f"--ctx {out['ctx']}" in out["command"] and "--n-cpu-moe" not in out["command"]
    assert set(out["parts"]) == set(fit.PARTS)
    assert out["device_bytes"] <= 23 * GiB
    # the KV cache and the states by the numbers in docs/hardware.md: 20 KiB per token, 3 x 62.8 MiB
    assert out["parts"]["kv"] == 131072 * 20 * 1024
    assert out["parts"]["recurrent"] == 3 * 30 * (3 * 8192 + 32 * 128 * 128) * 4
    # weights: exactly what `quantize --plan` says for this type (its tensors, as llama.cpp pads them in the file)
    qp = plan("Q4_K_M", config=SHAPE_35B)
    assert out["parts"]["weights_device"] + out["parts"]["weights_host"] == \
        sum(_pad(t.bytes, qp.alignment) for t in qp.tensors)
    assert out["parts"]["weights_host"] == _pad(next(t.bytes for t in qp.tensors if t.name == "token_embd.weight"),
                                                qp.alignment)


def test_35b_q4_k_m_on_16_gib_fits_only_with_experts_in_host_memory(q4_35b):
    model, dry = q4_35b
    r = _plan(model, dry, "16GiB")
    assert r.fits and r.n_cpu_moe > 0 and r.gpu_layers == 41 and r.ctx >= 8192
    assert r.device_bytes <= 15 * GiB
    assert f"--n-cpu-moe {r.n_cpu_moe}" in r.command
    # one layer fewer of experts in host memory does not hold the default context
    pred = fit.Predictor(model, fit.Setup(), None)
    pred.compute_at = fit.ComputeCurve(dry, pred.settings, 4096, 8192, False)
    assert pred(8192, -1, r.n_cpu_moe - 1).device_bytes > 15 * GiB
    assert pred(8192, -1, r.n_cpu_moe).device_bytes <= 15 * GiB


def test_35b_q3_k_s_on_16_gib_says_what_context_fits(tmp_path):
    model = fit.model_from_config(SHAPE_35B, "Q3_K_S", tmp_path)
    with DryRun(model.gguf) as dry:
        r = _plan(model, dry, "16GiB")
        asked = _plan(model, dry, "16GiB", ctx=65536)
    assert r.fits and r.n_cpu_moe == 0 and 8192 <= r.ctx < 131072
    text = r.format()
    assert f"context {r.ctx}" in text and "no expert offload" in text
    # more context than fits as it is: experts go to host memory to make room
    assert asked.fits and asked.ctx == 65536 and asked.n_cpu_moe > 0


@pytest.fixture(scope="module")
def ggufs(make_checkpoint, bundled_gguf, tmp_path_factory) -> dict[str, Path]:
    out = {"tiny-clover": bundled_gguf, "small": tmp_path_factory.mktemp("fit") / "small.gguf"}
    convert(make_checkpoint(seed=4, preset="small"), out["small"], outtype="f32", quiet=True)
    return out


@pytest.mark.parametrize("mode,parallel", [("ar", 1), ("diffusion", 1), ("ar", 4)])
@pytest.mark.parametrize("name", ["tiny-clover", "small"])
def test_prediction_is_within_5_percent_of_what_llama_cpp_allocates(ggufs, name, mode, parallel):
    """parallel 4: serve's one context for four slots (clover_gguf.batching)."""
    r = fit.fit(ggufs[name], mode=mode, do_measure=True, parallel=parallel)
    assert r.fits and r.measured is not None
    for part in fit.PARTS:
        pred, meas = r.parts[part], r.measured[part]
        if meas == 0:
            assert pred == 0, part
        else:
            assert abs(pred - meas) <= 0.05 * meas, (part, pred, meas)
    assert r.measured["kv"] > 0 and r.measured["recurrent"] > 0 and r.measured["compute"] > 0
    # the pass times: medians, each with the range of the timings it rests on; the threads the run chose
    assert r.pass_costs and {k: set(v) for k, v in r.pass_costs.items()} == \
        {k: set(v) for k, v in r.pass_spread.items()}
    for kind, rows in r.pass_costs.items():
        for n, ms in rows.items():
            lo, hi, count = r.pass_spread[kind][n]
            assert lo <= ms <= hi and count >= 1, (kind, n)
    assert r.pass_spread["causal"]["1"][2] >= fit.MEASURE_ROUNDS  # every timed answer's AR steps
    assert r.threading["n_threads"] == 1 and "per layer" in r.threading["why_threads"]  # small layers: one
    text = r.format()
    assert f"threads  {r.threading['describe']}" in text and "(medians)" in text
    assert r.to_json()["threads"]["poll"] == 50  # llama.cpp's
    assert "stall guard" in r.threading["guard"] and r.threading["describe"].endswith(r.threading["guard"])


def test_flash_attention_off_is_predicted_with_the_buffer_it_needs(ggufs):
    """--flash-attn reaches fit's dry runs: off plans attention scores of n_ctx x n_ubatch per head, and the
    prediction is what llama.cpp then allocates; the command printed keeps the setting."""
    r = {fa: fit.fit(ggufs["small"], mode="ar", ctx=4096, do_measure=True, flash_attn=fa) for fa in ("on", "off")}
    for fa, res in r.items():
        pred, meas = res.parts["compute"], res.measured["compute"]
        assert abs(pred - meas) <= 0.05 * meas, (fa, pred, meas)
        assert res.command.endswith(f"--flash-attn {fa}"), res.command
    assert r["off"].parts["compute"] > 2 * r["on"].parts["compute"]


def test_the_measured_passes_never_ask_a_draft_for_more_than_a_block_holds():
    ms = {"causal": {"1": 1.0, "32": 6.0}, "block": {"32": 9.0}}
    spread = {"causal": {"1": [0.9, 40.0, 9], "32": [5.0, 7.0, 5]}, "block": {"32": [8.0, 300.0, 5]}}
    line = fit.passes_line(ms, spread)
    assert "AR step 1.00 ms (0.90-40.00 over 9)" in line and "32-token block pass 9.00 ms (8.00-300.00 over 5)" in line
    assert "a draft pays here from 15.0 tokens per block pass" in line
    ms["block"]["32"] = 30.0  # a block pass and its verification: 36 AR steps, for at most 32 tokens
    line = fit.passes_line(ms, spread)
    assert "pays here from" not in line
    assert "no draft can pay here: a block pass and its verification cost 36.0 AR steps, more than the 32 tokens" \
        in line


def test_rollback_snapshot_and_parallel_scale_the_states(ggufs):
    one = fit.fit(ggufs["small"], mode="draft-self")
    snap = fit.fit(ggufs["small"], mode="draft-self", rollback="snapshot")
    two = fit.fit(ggufs["small"], mode="draft-self", parallel=2)
    assert snap.parts["recurrent"] == one.parts["recurrent"] * (1 + 33)  # block_size + 1 snapshots per sequence
    assert two.parts["kv"] == 2 * one.parts["kv"] and two.parts["weights_host"] == one.parts["weights_host"]
    assert two.parts["weights_device"] == one.parts["weights_device"]  # the slots share one model
    assert "serve" in two.command and "--parallel 2" in two.command


def test_bad_input_gets_one_line_and_exit_2(ggufs, tmp_path):
    from gguf import GGUFWriter

    other = tmp_path / "llama.gguf"
    w = GGUFWriter(other, arch="llama")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    cases = [(("fit", ggufs["tiny-clover"], "--vram", "16XB"), "cannot read the size '16XB'"),
             (("fit", ggufs["tiny-clover"], "--ram", "lots"), "cannot read the size 'lots'"),
             (("fit", other), "not a Clover GGUF"),
             (("fit", "--config", SHAPE_35B), "--config needs --type"),
             (("generate", ggufs["tiny-clover"], "-p", "hi", "--n-cpu-moe", "5"), "above the model's 4 layers")]
    for args, message in cases:
        r = _cli(*args)
        errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(errors) == 1 and message in errors[0], (args, r.stderr)


@pytest.mark.parametrize("vram", ["0", "512MiB"])
def test_a_gpu_too_small_for_anything_gets_the_cpu_plan_and_it_fits(ggufs, vram):
    """Less than the 1 GiB margin: nothing goes on the GPU, and a plan that needs no GPU memory fits."""
    r = fit.fit(ggufs["tiny-clover"], vram=vram, mode="ar")
    assert r.fits and r.gpu_layers == 0 and r.device_bytes == 0
    assert "plan     fits: " in r.format() and "everything on the CPU" in r.format()


def test_sizes():
    assert fit.parse_size("24GiB") == 24 * GiB == fit.parse_size("24 g")
    assert fit.parse_size("16GB") == 16 * 10**9
    assert fit.parse_size("1.5MiB") == 3 * 2**19
    with pytest.raises(UserError, match="cannot read the size"):
        fit.parse_size("12 bananas")
    for huge in ("1e400", "9" * 400, "1e300TiB", "2e9GiB"):
        with pytest.raises(UserError, match="too large"):
            fit.parse_size(huge)


def test_serve_refuses_a_context_bigger_than_the_machine():
    """check_slots: serve's one context, as llama.cpp's memory breakdown reports it, against the machine's memory."""
    from clover_gguf.errors import UserError
    from clover_gguf.fit import check_slots

    held = {"CPU": {"model": 100, "context": 900, "compute": 100}}
    check_slots(8, held, host_bytes=1100)
    with pytest.raises(UserError, match="--parallel 8 cannot fit"):
        check_slots(8, held, host_bytes=1099)


@pytest.mark.slow
def test_the_docs_show_what_fit_prints():
    """docs/hardware.md's sample is fit's output for its arguments, and the README's 16 GB chat line uses the context
    and offload that output names (issue 38: they had drifted from the build). About 25 s: llama.cpp's dry run."""
    import re

    root = Path(__file__).resolve().parents[1]
    args = ["--config", str(SHAPE_35B), "--type", "Q4_K_M", "--vram", "16GiB", "--ram", "64GiB"]
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "fit", *args], capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert p.returncode == 0, p.stderr
    doc = (root / "docs" / "hardware.md").read_text()
    start = doc.index("```\nmodel    clover-35b-a3b-shape.json") + 4
    assert doc[start:doc.index("```", start)] == p.stdout
    ctx, n_cpu_moe = re.search(r"--ctx (\d+) --n-cpu-moe (\d+)\n", p.stdout).groups()
    readme = (root / "README.md").read_text()
    assert f"clover-gguf chat clover-q4_k_m.gguf --ctx {ctx} --n-cpu-moe {n_cpu_moe}" in readme
