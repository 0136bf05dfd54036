"""llama.cpp's own architecture test, `test-llama-archs -a clover`, run from the cached patched build.

It builds a clover model with random weights in memory and checks, on every device of the build, its logits against
the CPU's, the causal-attention toggle and a save/load round trip. Runs in CI on the build `make llama` made: a
missing tool is a failure, never a skip.
"""

from __future__ import annotations

import re
import subprocess

from clover_gguf.build import llama_tool


def test_llama_archs_clover_passes():
    p = subprocess.run([str(llama_tool("test-llama-archs")), "-a", "clover_moe"], capture_output=True, text=True,
                       timeout=900, stdin=subprocess.DEVNULL)  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert re.search(r"^\|\s*clover_moe\|", out, re.M), out[-4000:]  # clover's rows ran
    assert re.search(r"Summary: all [1-9]\d* test\(s\) passed", out), out[-4000:]
