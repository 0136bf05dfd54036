"""What a newcomer reads from the commands (issue 64, items 4 and 5), each against what the program does:

1. `--version`; `convert --dry-run`'s columns have headers; the README's Layout table names each module once;
2. `quantize --plan`: the summary, not ~860 tensor lines (those with --verbose, and in --json);
3. `imatrix`: a progress bar over its chunks, llama-imatrix's log only with --verbose; the matrix is the one
   llama-imatrix writes with --no-ppl;
4. `fit` on a machine without a GPU speaks of host memory only;
5. Ctrl-C on `serve` is a clean stop: exit 0, no error line;
6. auto's stats line says why it stayed on AR (its measured costs) and how to see blocks.
(check-block's ties: tests/test_readings.py; the chat page's line for auto: tests/test_chat_page.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clover_gguf.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"
SHAPE_35B = ROOT / "clover_gguf" / "data" / "clover-35b-a3b-shape.json"
CALIBRATION = ROOT / "clover_gguf" / "data" / "calibration.txt"


def _cli(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


# ---- 1. --version, dry-run headers, the Layout table ----------------------------------------------------------------
def test_version_names_the_package_and_the_llama_cpp_it_builds():
    import tomllib

    from clover_gguf import __version__
    from clover_gguf.llama_sdist import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION

    p = _cli("--version")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout == (f"clover-gguf {__version__} (llama.cpp {LLAMA_CPP_COMMIT} from the llama-cpp-python "
                        f"{LLAMA_CPP_PYTHON_VERSION} sdist, with patches/)\n"), p.stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "clover_gguf.__version__"}


def test_convert_dry_run_columns_have_headers(tmp_path):
    p = _cli("convert", BUNDLED, "-o", tmp_path / "x.gguf", "--dry-run")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["tensor", "type", "shape", "bytes"], lines[0]
    first = lines[1]  # each header sits over its column: the row's fields start where the headers start
    for head in ("type", "shape"):
        col = lines[0].index(head)
        assert first[col - 1] == " " and first[col] != " ", (lines[0], first)
    assert lines[0].rstrip().endswith("bytes") and len(lines[0].rstrip()) == len(first.rstrip())
    assert lines[-1].startswith("dry run: ") and not (tmp_path / "x.gguf").exists()


def test_the_layout_table_names_each_path_once():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    paths = [p for row in re.findall(r"^\| (`[^|]+`) \|", table, re.M) for p in re.findall(r"`([^`]+)`", row)]
    assert paths and len(paths) == len(set(paths)), sorted(p for p in paths if paths.count(p) > 1)
    for p in paths:  # every one exists (a bare name: beside the row's first path)
        assert (ROOT / p).exists() or any((ROOT / q).parent.joinpath(p).exists() for q in paths if "/" in q), p


def test_the_readme_opens_for_a_person():
    """issue 64: the opening was one ~45-line paragraph of ratios and of references to this repository's issues. Now:
    short paragraphs, the two commands, what the demo prints, the figures in one table with the machine and the
    document each comes from; no issue numbers anywhere in the README."""
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\bissues? \d+", readme, re.I), re.search(r".*\bissues? \d+.*", readme, re.I)[0]
    opening = readme[:readme.index("## Set up")]
    prose = re.sub(r"```.*?```", "", opening, flags=re.S)
    paragraphs = [p for p in prose.split("\n\n") if p.strip() and not p.lstrip().startswith("|")]
    assert max(len(p.strip().splitlines()) for p in paragraphs) <= 8, max(paragraphs, key=len)
    code = re.findall(r"```sh\n(.*?)```", opening, re.S)[0]
    assert [ln.split("#")[0].strip() for ln in code.splitlines()] == ["make demo", "make test"], code
    assert "== one agent turn" in opening and "model calls: add(" in opening  # what the demo prints
    head = "| what | figure | measured on | where |"
    rows = opening[opening.index(head):].split("\n\n")[0].splitlines()[2:]
    assert 3 <= len(rows) <= 8, rows
    for row in rows:
        where = row.strip("|").split("|")[3]
        docs = re.findall(r"docs/[\w-]+\.md", where)
        assert docs and all((ROOT / d).is_file() for d in docs), row


def test_the_use_section_points_agents_at_the_tool_trained_model():
    """issue 64: the Use section pointed agents (tools, tool_choice, response_format) at the bundled model, never
    trained on tools (`tool_choice: "required"` got an 84-digit argument). Now it says what the bundled model can show
    and serves the tool-trained one, converted by its own line, for agents."""
    from test_first_use import use_lines

    readme = (ROOT / "README.md").read_text()
    commands = [c for c, _ in use_lines(readme)]
    convert = next(c for c in commands if c.startswith("clover-gguf convert clover_gguf/assets/tiny-clover-tools "))
    gguf = re.search(r"-o (\S+)", convert)[1]
    assert f"clover-gguf serve {gguf}" in commands[commands.index(convert) + 1:], commands
    block = readme[readme.index("## Use"):]
    step5 = block[block.index("# 5."):block.index("clover-gguf serve clover-q4_k_m.gguf")]
    assert not re.search(r"tool_choice|response_format|OpenCode|agents", step5, re.I), step5
    between = block[block.index("clover-gguf serve clover-q4_k_m.gguf"):block.index(convert)]
    assert "never trained on tools" in between and re.search(r"For agents .*tool_choice", between, re.S), between


# ---- 2. quantize --plan ------------------------------------------------------------------------------------------
def test_plan_prints_its_summary_and_the_tensors_only_when_asked():
    """The 35B's plan: its summary in a screenful (it printed ~860 tensor lines first); --verbose adds one line per
    tensor after the summary, --json has every tensor."""
    p = _cli("quantize", "--plan", "--type", "Q4_K_M", "--config", SHAPE_35B)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    n = len(json.loads(_cli("quantize", "--plan", "--type", "Q4_K_M", "--config", SHAPE_35B, "--json").stdout)
            ["tensors"])
    assert n > 800 and len(lines) < 30, len(lines)
    assert re.match(r"\s+Q4_K\s+\d+ tensors\s+[\d.]+ GiB", lines[0]), lines[0]
    assert any(re.match(r"Q4_K_M \(q4_k_m\): \d+ bytes = [\d.]+ GiB predicted", ln) for ln in lines), lines
    assert lines[-1] == f"({n} tensors: --verbose lists each, --json too)", lines[-1]
    v = _cli("quantize", "--plan", "--type", "Q4_K_M", "--config", SHAPE_35B, "--verbose").stdout.splitlines()
    assert v[:len(lines) - 1] == lines[:-1]  # the same summary first
    table = v[v.index("") + 1:]
    assert table[0].split() == ["tensor", "src", "type", "shape", "MiB"] and len(table) == n + 1
    bad = _cli("quantize", BUNDLED / "x.gguf", "y.gguf", "--type", "Q8_0", "--verbose")
    assert bad.returncode == 2 and bad.stderr.startswith("clover-gguf: error: --verbose goes with --plan"), bad.stderr


# ---- 3. imatrix ----------------------------------------------------------------------------------------------------
def _imatrix_sums(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


def test_imatrix_shows_progress_not_llama_cpps_log(bundled_gguf, tmp_path):
    """issue 64: imatrix printed llama.cpp's raw lines ("0.00.044.443 I compute_imatrix: ..."). Now a progress bar
    over the chunks (the bar's last state: every chunk), the log only with --verbose; and the file is the one
    llama-imatrix itself writes with --no-ppl (the per-chunk perplexity the bar counts changes nothing in it)."""
    from clover_gguf.build import llama_tool

    out = tmp_path / "im.gguf"
    p = _cli("imatrix", bundled_gguf, "--text", CALIBRATION, "-o", out, "--ctx", "128", "--chunks", "3",
             "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"wrote {out}\n"
    assert "compute_imatrix" not in p.stderr and "llama_" not in p.stderr, p.stderr[-2000:]
    assert re.search(r"imatrix: 100%.*\b3/3\b", p.stderr), p.stderr[-2000:]
    v = _cli("imatrix", bundled_gguf, "--text", CALIBRATION, "-o", tmp_path / "v.gguf", "--ctx", "128",
             "--chunks", "3", "--threads", "1", "--verbose")
    assert v.returncode == 0 and "compute_imatrix" in v.stderr and "imatrix: 100%" not in v.stderr, v.stderr[-2000:]
    tool = llama_tool("llama-imatrix")
    ref = tmp_path / "ref.gguf"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tool.parent)}
    r = subprocess.run([str(tool), "-m", str(bundled_gguf), "-f", str(CALIBRATION), "-o", str(ref), "--output-format",
                        "gguf", "-c", "128", "--chunks", "3", "--no-ppl", "-t", "1"], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ours, theirs = _imatrix_sums(out), _imatrix_sums(ref)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


# ---- 4. fit without a GPU ------------------------------------------------------------------------------------------
def test_fit_without_a_gpu_speaks_of_host_memory_only(bundled_gguf):
    p = _cli("fit", bundled_gguf)
    assert p.returncode == 0, p.stderr
    if json.loads(_cli("fit", bundled_gguf, "--json").stdout)["vram_bytes"] is not None:
        pytest.fail("this test is for a machine without a GPU (the suite's machines): this one has one")
    target = next(ln for ln in p.stdout.splitlines() if ln.startswith("target"))
    assert re.fullmatch(r"target   [\d.]+ GiB of host memory, 1 GiB of it kept free", target), target
    assert "GPU" not in p.stdout and "each" not in target, p.stdout
    g = _cli("fit", bundled_gguf, "--vram", "16GiB").stdout
    assert re.search(r"^target   16\.00 GiB on the GPU \(--vram\) \+ [\d.]+ GiB of host memory, 1 GiB kept free on "
                     r"each$", g, re.M), g


# ---- 5. serve's Ctrl-C ---------------------------------------------------------------------------------------------
def test_ctrl_c_stops_serve_cleanly(bundled_gguf):
    """The README's way to stop serve ended with "clover-gguf: error: interrupted" and exit 130: now exit 0 and no
    error line, once uvicorn has shut down."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf", "serve", str(bundled_gguf), "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            lines.append(line)
            if "listening on http://" in line or time.monotonic() > deadline:
                break
        assert "listening on http://" in lines[-1], "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, (proc.returncode, out[-2000:])
    assert "Finished server process" in out and "error" not in out.lower(), out[-2000:]


# ---- 6. auto's stats line ------------------------------------------------------------------------------------------
def test_autos_stats_line_says_why_it_stayed_on_ar():
    from clover_gguf.runtime import RunStats

    base = dict(mode="auto", prompt_tokens=25, generated_tokens=28, forward_passes=29, ar_steps=28, seconds=4.16,
                prompt_seconds=1.67, tokens_per_s=6.7, decode_tokens_per_s=11.3, finish_reason="stop")
    line = RunStats(**base, block_pass_ar_steps=9.34).summary()
    assert "28 AR steps and 0 drafts; a block pass costs 9.3 AR steps here (--mode draft-self or diffusion shows " \
           "blocks)" in line, line
    assert "block pass costs" not in RunStats(**base).summary()  # not timed: nothing said
    drafted = RunStats(**{**base, "drafts": 1, "block_passes": 1, "drafted_tokens": 31, "accepted_tokens": 30},
                       block_pass_ar_steps=1.5).summary()
    assert "block pass costs" not in drafted, drafted
    assert RunStats(**base, block_pass_ar_steps=9.3449).to_json()["block_pass_ar_steps"] == 9.34
