"""First use (issue 55): what a new user reads and types, checked against the program.

1. every options table and every "default" the docs state, against the CLI's own parameters (typer's click
   commands): a default or a choice changed in clover_gguf/cli.py without the docs fails here;
2. the README's table of times is the one bench/first_use.py makes from its record, each row dated and placed;
3. the README's Use section, run line by line as typed on the bundled tiny Clover (slow), and fit's plain word when
   --ctx is above the model's context;
4. the one MLX install line wherever MLX is named, and mlx-convert's bits per weight against the files it wrote;
5. the stats line a person reads: one speed, tokens per pass after the prompt's, plurals; the JSON only grows;
6. chat: an unknown /mode is named as such; piped output keeps the thinking apart from the answer;
7. quantize: what fell back and why, against the written file's own tensor types;
8. /metrics counts refused requests (400 and 422, before a slot) under finish="refused";
9. the serve extra installs the client docs/serve.md's first example imports.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from enum import Enum
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"
SHAPE_35B = ROOT / "clover_gguf" / "data" / "clover-35b-a3b-shape.json"


def _cli(*args, cwd: Path | None = None, timeout: int = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, input=stdin)


# =================================================================================================================
# 7. quantize: what fell back, and why
# =================================================================================================================
def test_quantize_says_what_fell_back_and_the_plan_matches_the_file(tmp_path, bundled_gguf):
    """A Q4_K_M of the bundled model (rows of 64 and 128 values) holds no Q4_K tensor: the summary says, per pair, how
    many tensors took which fallback type instead of which and why; the counts are recomputed here from the written
    file's tensor types and llama.cpp's fallback table. From a BF16 input the tensors the recipe makes F32
    (ssm_alpha / ssm_beta) are F32 in the file, and the plan says F32 too (it used to report them BF16: QT.F32 is 0)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader

    src = tmp_path / "bf16.gguf"
    assert _cli("convert", BUNDLED, "-o", src, "--outtype", "bf16", "--quiet").returncode == 0
    out = tmp_path / "q4.gguf"
    p = _cli("quantize", src, out, "--type", "Q4_K_M", "--quiet")
    assert p.returncode == 0, p.stderr
    fallback = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}  # llama-quant.cpp's tensor_type_fallback
    written = {t.name: (QT(t.tensor_type), int(t.shape[0])) for t in GGUFReader(out).tensors}
    assert QT.Q4_K not in {t for t, _ in written.values()}
    for wanted, got in fallback.items():
        n = sum(1 for t, row in written.values() if t == got and row % 256)
        if not n:
            continue
        if got == QT.Q8_0:  # Q8_0 is also a type the mixture picks itself: the summary's count is at most these
            m = re.search(rf"fallback: (\d+) tensors? at Q8_0 instead of Q6_K", p.stdout)
            assert m and 1 <= int(m[1]) <= n, p.stdout
            continue
        assert re.search(rf"fallback: {n} tensors? at {got.name} instead of {wanted.name}: rows of [\d ,or]+ values "
                         rf"are not a multiple of 256", p.stdout), p.stdout
    plan = json.loads(_cli("quantize", "--plan", src, "--type", "Q4_K_M", "--json").stdout)
    planned = {t["name"]: t["type"] for t in plan["tensors"]}
    assert planned == {n: t.name for n, (t, _) in written.items()}
    assert {planned[n] for n in planned if ".ssm_alpha." in n or ".ssm_beta." in n} == {"F32"}


def test_plan_of_the_35b_has_one_line_per_rule_outcome():
    """quantize --plan for the 35B shape: no rule note per tensor (issue 55: about 60 'stays BF16' notes, which were
    wrong besides: llama.cpp makes them F32); at most one note line per recipe rule."""
    p = _cli("quantize", "--plan", "--type", "Q4_K_M", "--config", SHAPE_35B)
    assert p.returncode == 0, p.stderr
    notes = [ln for ln in p.stdout.splitlines() if ln.startswith("note: rule")]
    assert len(notes) <= 4 and not any("BF16" in ln for ln in notes), notes
    plan = json.loads(_cli("quantize", "--plan", "--type", "Q4_K_M", "--config", SHAPE_35B, "--json").stdout)
    assert not [t for t in plan["tensors"] if t["type"] == "BF16"]


