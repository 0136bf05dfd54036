"""The offload options on a CPU build: the expert overrides that reach llama.cpp, answers unchanged with the options,
one notice, bad values refused; --flash-attn as llama.cpp reads it; the llama.cpp log capture; the logits-rows cap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clover_gguf.convert import convert
from clover_gguf.errors import UserError
from clover_gguf.gguf_header import read_header
from clover_gguf.llama_context import LOG_DEBUG, LlamaContext, capture_llama_log
from clover_gguf.offload import ALL, FLASH_ATTN, Offload, on_device
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.train_tiny import ASSET_DIR, chat_prompt, load_tiny

OVERRIDE_RE = r"tensor (\S+) \(.*\) buffer type overridden to (\S+)"


@pytest.fixture(scope="module")
def small_gguf(make_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("offload") / "small.gguf"
    convert(make_checkpoint(seed=3, preset="small"), out, outtype="f32", quiet=True)
    return out


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True)


def _expert_tensors(path: Path, layers: range) -> set[str]:
    """Written from the file's tensor list: the routed-expert matrices of `layers` (not the shared expert)."""
    out = set()
    for name in read_header(path).names:
        parts = name.split(".")
        if parts[0] == "blk" and int(parts[1]) in layers and parts[2].endswith("_exps") and "shexp" not in parts[2]:
            out.add(name)
    return out


@pytest.mark.parametrize("opts, layers", [(dict(n_cpu_moe=3), range(3)), (dict(cpu_moe=True), range(8)),
                                          (dict(n_cpu_moe=0), range(0))])
def test_expert_tensors_of_exactly_the_chosen_layers_go_to_the_cpu_buffer(small_gguf, opts, layers):
    with capture_llama_log() as log:
        with LlamaContext(small_gguf, n_ctx=256, n_threads=2, offload=Offload(**opts)):
            pass
    overridden = {m[1]: m[2] for m in log.grep(OVERRIDE_RE)}
    expected = _expert_tensors(small_gguf, layers)
    assert set(overridden) == expected
    assert set(overridden.values()) <= {"CPU"}
    if layers:
        assert len(expected) == 3 * len(layers)  # gate, up, down of each chosen layer
    # the placement rule fit predicts with agrees: on a GPU, exactly these would stay in host memory
    n_layer = read_header(small_gguf).kv["clover_moe.block_count"]
    patterns = Offload(**opts).expert_patterns(n_layer)
    host = {n for n in read_header(small_gguf).names if not on_device(n, n_layer, ALL, patterns)}
    assert host == expected | {"token_embd.weight"}


def test_answers_are_unchanged_with_the_options_in_every_mode(bundled_gguf):
    _, tok, rows = load_tiny(ASSET_DIR)
    prompts = [chat_prompt(r["prompt"]) for r in rows[::40]]
    options = Offload(gpu_layers="all", n_cpu_moe=2, mmap=False, stall_guard=False)
    answers = {}
    for name, off in (("plain", None), ("options", options)):
        with CloverRuntime(bundled_gguf, n_ctx=512, n_threads=2, offload=off) as rt:
            answers[name] = ["".join(t for t, _ in rt.stream_ids(rt.raw_prompt_ids(p), mode=mode, max_new_tokens=48))
                             for mode in ("ar", "diffusion", "draft-self") for p in prompts]
    assert answers["options"] == answers["plain"]
    assert all(answers["plain"])


def test_cli_accepts_the_options_and_says_once_that_without_a_gpu_they_do_nothing(bundled_gguf):
    base = ["generate", bundled_gguf, "-p", "Count from 3 to 6.", "-n", "12", "--mode", "ar", "--threads", "2"]
    plain = _cli(*base)
    with_opts = _cli(*base, "-ngl", "all", "--n-cpu-moe", "2", "--no-mmap", "--no-stall-guard")
    assert plain.returncode == 0 and with_opts.returncode == 0, with_opts.stderr
    assert with_opts.stdout == plain.stdout
    assert with_opts.stderr.count("no GPU to offload to") == 1
    assert "no GPU" not in plain.stderr


@pytest.mark.parametrize("args, message", [(("--n-cpu-moe", "9"), "above the model's 4 layers"),
                                           (("-ngl", "most"), "--gpu-layers must be"),
                                           (("--n-cpu-moe", "-1"), "at least 0"),
                                           (("--flash-attn", "yes"), "'yes' is not one of 'auto', 'off', 'on'")])
def test_bad_offload_values_get_one_line_and_exit_2(bundled_gguf, args, message):
    r = _cli("generate", bundled_gguf, "-p", "hi", "-n", "2", *args)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("clover-gguf: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_offload_values():
    assert Offload().n_gpu_layers(True) == ALL and Offload().n_gpu_layers(False) == 0
    assert Offload(gpu_layers="all").n_gpu_layers(False) == ALL
    assert Offload(gpu_layers="12").n_gpu_layers(True) == 12
    assert Offload(n_cpu_moe=2).expert_patterns(40) == [r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                                         r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert Offload(n_cpu_moe=2).llama_args(True) == ["-ngl", "all", "--n-cpu-moe", "2", "--load-mode", "auto"]
    assert Offload(flash_attn="Off").llama_args(False) == ["-ngl", "0", "-fa", "off", "--load-mode", "auto"]
    assert Offload(flash_attn="on").cli_args() == ["--flash-attn", "on"] and Offload().cli_args() == []
    with pytest.raises(UserError, match="--flash-attn must be on, off or auto"):
        Offload(flash_attn="yes")
    with pytest.raises(UserError, match="above the model's 40 layers"):
        Offload(n_cpu_moe=41).expert_patterns(40)
    # llama.cpp's layer rule: the last n of the n_layer + 1 layers (the output layer counts), input always on CPU
    assert [on_device(f"blk.{i}.attn_norm.weight", 4, 2, []) for i in range(4)] == [False, False, False, True]
    assert on_device("output.weight", 4, 1, []) and not on_device("output.weight", 4, 0, [])
    assert not on_device("token_embd.weight", 4, ALL, [])


def test_flash_attn_reaches_llama_cpp_as_its_own_setting(bundled_gguf):
    """Each --flash-attn value is the llama_flash_attn_type llama.cpp logs by its own name (llama_flash_attn_type_name),
    and what it resolved `auto` to on this CPU; exact turns it off whatever the option says."""
    names = {"auto": "auto", "off": "disabled", "on": "enabled"}
    assert set(FLASH_ATTN) == set(names)
    for value, exact in [*((v, False) for v in FLASH_ATTN), ("on", True)]:
        with capture_llama_log() as log:
            ctx = LlamaContext(bundled_gguf, n_ctx=256, n_threads=1, exact=exact, offload=Offload(flash_attn=value))
            ctx.close()
        said = [m[1] for m in log.grep(r"flash_attn\s+= (\S+)")]
        assert said == ["disabled" if exact else names[value]], (value, exact, said)
        if value == "auto":  # a CPU has the op: llama.cpp turns it on
            assert log.grep(r"Flash Attention enabled"), log.text()[-20:]


def test_the_cli_takes_flash_attn_and_the_answer_stays(bundled_gguf):
    base = ["generate", bundled_gguf, "-p", "Count from 3 to 6.", "-n", "12", "--mode", "ar", "--threads", "1"]
    runs = {v: _cli(*base, "--flash-attn", v) for v in ("off", "on", "ON", "Off")}  # any case (issue 68, cause 9)
    assert all(r.returncode == 0 for r in runs.values()), {v: r.stderr for v, r in runs.items()}
    assert len({r.stdout for r in runs.values()}) == 1 and runs["off"].stdout.strip()


@pytest.mark.parametrize("source, words", [
    ("bogus-tree", ["CLOVER_GGUF_SOURCE=bogus-tree", "unknown llama.cpp source 'bogus-tree'",
                    "llama-cpp-python-0.3.36", "unset CLOVER_GGUF_SOURCE"]),
    ("xllamacpp-2026.10.11549", ["of the source xllamacpp-2026.10.11549 (CLOVER_GGUF_SOURCE)",
                                 "clover-gguf build-llama --source xllamacpp-2026.10.11549", "unset CLOVER_GGUF_SOURCE"]),
])
def test_a_source_with_no_build_names_the_source_and_the_command(bundled_gguf, tmp_path, source, words):
    """Issue 68, cause 9: CLOVER_GGUF_SOURCE naming no source, or one never built, said \"run clover-gguf
    build-llama\", which builds the pinned tree and changes nothing."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    r = subprocess.run([sys.executable, "-m", "clover_gguf", "generate", str(bundled_gguf), "-p", "hi", "-n", "2"],
                       capture_output=True, text=True,  # an empty cache: no source is built there
                       env={**env, "CLOVER_GGUF_SOURCE": source, "CLOVER_GGUF_CACHE_DIR": str(tmp_path)})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("clover-gguf: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in errors[0] for w in words), errors[0]


def test_log_capture_collects_debug_lines_and_stays_silent(bundled_gguf, capfd):
    with capture_llama_log() as outer:
        with capture_llama_log() as inner:
            ctx = LlamaContext(bundled_gguf, n_ctx=256, n_threads=2)
        ctx.close()
    assert inner.grep(r"KV buffer size") and inner.grep(r"compute buffer size =")
    assert any(level == LOG_DEBUG for level, _ in inner.lines)
    assert not inner.grep(r"compute buffer size (is|of)")  # llama_free ran after the inner block
    assert outer.grep(r"compute buffer size (is|of)")  # ... and inside the outer one
    assert len(outer.lines) > len(inner.lines)
    assert all("\n" not in text for _, text in outer.lines)
    assert capfd.readouterr().err == ""


def test_a_call_asking_for_more_logits_rows_than_the_context_holds_raises(bundled_gguf):
    with LlamaContext(bundled_gguf, n_ctx=256, n_threads=2, n_outputs_max=4) as ctx:
        assert ctx.decode([1, 2, 3, 4], 0).shape[0] == 4
        with pytest.raises(ValueError, match="at most 4"):
            ctx.decode([5, 6, 7, 8, 9], 4)
        assert ctx.decode([5, 6, 7, 8, 9], 4, logits=[False] * 4 + [True]).shape[0] == 1
        assert ctx.max_outputs == 4
    with CloverRuntime(bundled_gguf, n_ctx=256, n_threads=2) as rt:
        assert rt.ctx.n_outputs_max == rt.block_size
        with pytest.raises(UserError, match="block size 64 is above the 32"):
            rt.generate("hi", mode="diffusion", block_size=64, max_new_tokens=4)


def test_more_sequences_than_logits_rows_does_not_abort(bundled_gguf):
    """llama.cpp's output buffer holds a row per sequence and aborts when n_seq_max is more than n_outputs_max
    (serve --parallel 8 with five sequences a slot asked for 40 sequences and 32 rows): the context raises the rows to
    the sequences instead, and one decode on each sequence gives its row. In a child process, so that a regression
    (an abort) fails this test alone."""
    code = (f"from clover_gguf.llama_context import LlamaContext\n"
            f"with LlamaContext({str(bundled_gguf)!r}, n_ctx=256, n_threads=2, n_seq_max=6, n_outputs_max=2) as ctx:\n"
            f"    assert ctx.n_outputs_max == 6\n"
            f"    for s in range(6):\n"
            f"        assert ctx.decode([1 + s, 2], 0, s).shape[0] == 2\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
