"""llama.cpp's own architecture test, `test-llama-archs -a clover_moe`, run from the cached patched build.

It builds a clover_moe model with random weights in memory and checks, on every device of the build, its logits
against the CPU's, the causal-attention toggle, block attention (check_block_attn, with the coreset on: a block on a
copy of the prefix, blocks alternating with causal passes, a block and a causal sequence in one decode against the two
apart, the prefix untouched, the flag through seq_cp / seq_rm / clear / state, the API's refusals) and a save/load
round trip. Runs in CI on the build `make llama` made: a
missing tool is a failure, never a skip.
"""

from __future__ import annotations

import re
import subprocess

from clover_gguf.build import llama_tool


def test_llama_archs_clover_passes():
    # its exit status is the verdict (1 when a test fails). Its report is printed by common_log's worker thread,
    # which may lose the last lines at exit: the report that says clover_moe's rows ran is read from a run that
    # printed it whole
    for _ in range(5):
        p = subprocess.run([str(llama_tool("test-llama-archs")), "-a", "clover_moe"], capture_output=True, text=True,
                           timeout=900, stdin=subprocess.DEVNULL)  # fmt: skip
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        if re.search(r"Summary: all [1-9]\d* test\(s\) passed", out):
            break
    assert re.search(r"^\|\s*clover_moe\|.*OK", out, re.M), out[-4000:]  # clover's rows ran
    assert re.search(r"Summary: all [1-9]\d* test\(s\) passed", out), out[-4000:]
