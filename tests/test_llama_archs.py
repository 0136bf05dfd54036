"""llama.cpp's own architecture test, `test-llama-archs -a clover_moe` (and `-a qwen35moe`), run from the cached
patched build.

It builds a clover_moe model with random weights in memory and checks, on every device of the build, its logits
against the CPU's, the causal-attention toggle, block attention (check_block_attn, with the coreset on: a block on a
copy of the prefix, blocks alternating with causal passes, a block and a causal sequence in one decode against the two
apart, the prefix untouched, the flag through seq_cp / seq_rm / clear / state, the API's refusals) and a save/load
round trip; the protocol the hybrid memory keeps (check_block_attn_protocol) and the block attention flags in the
state (check_block_attn_state); and, at weights of stdev 1, the block pass's first Gated DeltaNet layer against a
float64 reference of it under each softmax form (check_block_attn_reference, patches/0009). Runs in CI on the build
`make llama` made: a missing tool is a failure, never a skip.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from clover_gguf.build import llama_tool


@pytest.mark.parametrize("arch", ["clover_moe", "qwen35moe"])
def test_llama_archs_passes(arch):
    """clover_moe with block attention, and qwen35moe, whose hybrid memory the series changed too (its state holds
    the block attention flags)."""
    # its exit status is the verdict (1 when a test fails). Its report is printed by common_log's worker thread,
    # which may lose lines at exit (the summary, and the end of the architecture's row, in more than half of the runs
    # of a quick architecture here): a run whose report shows the row with its checks done is looked for
    for _ in range(12):
        p = subprocess.run([str(llama_tool("test-llama-archs")), "-a", arch], capture_output=True, text=True,
                           timeout=900, stdin=subprocess.DEVNULL)  # fmt: skip
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        if re.search(rf"^\|\s*{arch}\|[^|]*\|[^|]*\|[^|]*OK[^|]*\|[^|]*OK", out, re.M):
            break
    # the architecture's row ran, logits and save/load round trip OK
    assert re.search(rf"^\|\s*{arch}\|[^|]*\|[^|]*\|[^|]*OK[^|]*\|[^|]*OK", out, re.M), out[-4000:]
