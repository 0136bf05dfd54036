"""bench/ scripts given bad arguments (issue 68, cause 10): argparse's one error line and exit 2 before any work, never a
traceback (grammar.py's --engines came after a minute of BPE training); and bench/blocks.py, which could not start
a server at all (wait_ready without its `what`)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from bench_scripts import BENCH, load_bench


@pytest.mark.parametrize("script,args,words", [
    ("flash_attn.py", ["--depths", "bogus"], "argument --depths: 'bogus' is not an integer"),
    ("flash_attn.py", ["--depths", "512,-5"], "argument --depths: must be at least 0, not -5"),
    ("flash_attn.py", ["--depths", ","], "argument --depths: give one or more"),
    ("flash_attn.py", ["--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
    ("flash_attn.py", ["--threads", "0"], "argument --threads: must be at least 1, not 0"),
    ("host.py", ["--gguf", "/nonexistent/model.gguf"], "--gguf: no such file: /nonexistent/model.gguf"),
    ("host.py", ["--forced-rounds", "-1"], "argument --forced-rounds: must be at least 0, not -1"),
    ("host.py", ["--threads", "0"], "argument --threads: must be at least 1"),
    ("grammar.py", ["--vocab-size", "0"], "argument --vocab-size: must be at least"),
    ("grammar.py", ["--rounds", "-1"], "argument --rounds: must be at least 1, not -1"),
    ("grammar.py", ["--workdir", __file__], "is not a folder"),
    ("grammar.py", ["--engines", "bogus"], "--engines: bogus: choose from llguidance, xgrammar"),
])
def test_a_bad_argument_is_one_error_line_and_exit_2(script, args, words, tmp_path):
    if script == "grammar.py" and "--workdir" not in args:
        args = [*args, "--workdir", str(tmp_path)]  # nothing is trained: the check comes first
    p = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and words in errors[0], p.stderr
    assert not list(tmp_path.iterdir())  # no work done


def test_blocks_starts_its_servers_with_what_wait_ready_takes(tmp_path, monkeypatch):
    """bench/blocks.py called wait_ready(base, proc, seconds=900): a TypeError before the first request, every run.
    Its start() with the server stubbed: the call binds to bench/serve.py's wait_ready."""
    blocks = load_bench("blocks.py")
    real = inspect.signature(blocks.wait_ready)
    seen = []
    monkeypatch.setattr(blocks, "start_logged", lambda *a, **kw: "proc")
    monkeypatch.setattr(blocks, "wait_ready", lambda *a, **kw: seen.append(real.bind(*a, **kw)))

    class Args:
        ctx, threads, workdir = 256, 1, tmp_path

    proc, base = blocks.start(tmp_path, tmp_path / "m.gguf", Args, "this")
    assert proc == "proc" and base.startswith("http://127.0.0.1:") and len(seen) == 1
    assert "this" in seen[0].arguments["what"]
