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
8. /metrics counts refused requests (400s, before a slot) under finish="refused";
9. the serve extra installs the client docs/serve.md's first example imports.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from enum import Enum
from pathlib import Path

import pytest

from bench_scripts import load_bench
from clover_gguf.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"
SHAPE_35B = ROOT / "clover_gguf" / "data" / "clover-35b-a3b-shape.json"


def _cli(*args, cwd: Path | None = None, timeout: int = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, input=stdin)


# =================================================================================================================
# 1. the docs against the CLI
# =================================================================================================================
def _commands() -> dict:
    """name -> typer's click command, as `clover-gguf` builds them."""
    import typer

    from clover_gguf.cli import app

    return dict(typer.main.get_command(app).commands)


def _param(cmd, opt: str):
    return next((p for p in cmd.params if opt in getattr(p, "opts", ()) or opt in getattr(p, "secondary_opts", ())),
                None)


def _help_default(help_text: str | None) -> str | None:
    """What the help says the default is: the text after 'default:' up to a ';' or the ')' that closes it."""
    if not help_text or not (m := re.search(r"\bdefault:\s*", help_text)):
        return None
    out, depth = [], 0
    for ch in help_text[m.end():]:
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                break
            depth -= 1
        elif ch == ";" and depth == 0:
            break
        out.append(ch)
    return "".join(out).strip()


def cli_default(param) -> str:
    """The default a person should read for this parameter: its value; for a flag pair the flag that is on; for a
    plain flag on/off; where the value is None (decided at run time), what the help says, else 'none'."""
    d = param.default
    if callable(d):
        d = d()
    if isinstance(d, Enum):
        d = d.value
    if getattr(param, "is_flag", False) and getattr(param, "secondary_opts", None):
        return param.opts[0] if d else param.secondary_opts[0]
    if getattr(param, "is_flag", False):
        return "on" if d else "off"
    if d is None:
        return _help_default(getattr(param, "help", None)) or "none"
    return str(d)


def _norm(s: str) -> str:
    s = s.replace("`", "").replace("\\|", "|").lower()
    s = re.sub(r"\bthe\s+", "", s)
    return re.sub(r"\s+", "", s)


def _choices(param) -> list[str] | None:
    """The values of an option typed by an Enum (typer's choices), else None."""
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return [e.value for e in ann] if isinstance(ann, type) and issubclass(ann, Enum) else None


def _tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """Markdown tables -> (line index of the header, header cells, rows of cells)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            head = _cells(lines[i])
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((i, head, rows))
            i = j
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _option_tables():
    """Every table of options with a default column in the README and docs/, with the commands its marker names."""
    found = []
    for path in DOCS:
        text = path.read_text()
        lines = text.splitlines()
        for at, head, rows in _tables(text):
            if not head or head[0].lower() != "option" or not any(h.lower() == "default" for h in head):
                continue
            above = [ln for ln in lines[max(0, at - 3):at] if ln.strip()]
            m = re.match(r"<!-- cli: ([\w\- ]+) -->", above[-1]) if above else None
            found.append((path, at + 1, m[1].split() if m else None, head, rows))
    return found


def test_every_option_table_says_which_commands_it_lists():
    tables = _option_tables()
    assert len(tables) >= 2, "docs/serve.md's and docs/hardware.md's options tables"
    for path, line, names, _, _ in tables:
        assert names, f"{path.name}:{line}: an options table needs a <!-- cli: COMMAND ... --> line above it"
        assert set(names) <= set(_commands()), (path.name, line, names)


@pytest.mark.parametrize("path,line,names,head,rows", _option_tables(),
                         ids=lambda v: v.name if isinstance(v, Path) else None)
def test_options_tables_match_the_cli(path, line, names, head, rows):
    """Each row's options exist on every command the table lists, its default is the CLI's, and where the CLI has a
    fixed set of choices the row names every one (issue 55: serve's --mode said draft-self and three modes)."""
    commands = _commands()
    dcol = [h.lower() for h in head].index("default")
    for cells in rows:
        opts = re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", cells[0])
        opts = [o for o in opts if o.startswith("-")]
        if not opts:
            continue  # MODEL: an argument
        shown = cells[dcol]
        first = shown[:-len(", ...")] if shown.endswith(", ...") else shown  # several options: the first one's
        for name in names:
            cmd = commands[name]
            for opt in opts:
                assert _param(cmd, opt) is not None, f"{path.name}:{line}: {name} has no {opt}"
            param = _param(cmd, opts[0])
            want = cli_default(param)
            assert _norm(first) == _norm(want), \
                f"{path.name}:{line}: {name} {opts[0]} defaults to {want!r}, the table says {shown!r}"
            if choices := _choices(param):
                named = set(re.findall(r"`([^`]+)`", " ".join(cells)))
                assert set(choices) <= named, \
                    f"{path.name}:{line}: {name} {opts[0]} takes {choices}, the row names {sorted(named)}"


def _code_lines():
    """(file, line number, text, command) for the lines of ```sh and bare ``` blocks: a `clover-gguf CMD` line sets
    the command, and the comment lines right after it keep it."""
    for path in DOCS:
        in_fence, in_code, cmd = False, False, None
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_fence, cmd = not in_fence, None
                in_code = in_fence and line.strip()[3:] in ("", "sh", "bash")
                continue
            if not in_code:
                continue
            stripped = line.strip()
            if m := re.match(r"clover-gguf ([a-z][\w-]*)", stripped):
                cmd = m[1]
            elif not stripped.startswith("#"):
                cmd = None
            if cmd is not None:
                yield path, n, line, cmd


def test_defaults_and_choices_said_in_code_comments_match_the_cli():
    """`--opt ... (default X)`, `defaults: --opt X, ...` and `--opt a|b|c` in the README's and docs' command lines and
    their comments (mac.md's --q-bits / --q-group-size, the README's serve and build-llama lines) are the CLI's."""
    commands, checked = _commands(), 0
    for path, n, line, name in _code_lines():
        cmd = commands.get(name)
        if cmd is None:
            continue
        where = f"{path.name}:{n}"
        for opt, value in re.findall(r"(--[a-z][a-z0-9-]*)(?: [^\s,(]+)? \(default:? ([^)]*)\)", line):
            if (p := _param(cmd, opt)) is not None:
                assert _norm(value) == _norm(cli_default(p)), f"{where}: {name} {opt}: {value!r}"
                checked += 1
        if m := re.search(r"defaults: (.*?)(?:;|$)", line):
            for opt, value in re.findall(r"(--[a-z][a-z0-9-]*) ([^\s,;]+)", m[1]):
                p = _param(cmd, opt)
                assert p is not None, f"{where}: {name} has no {opt}"
                assert _norm(value) == _norm(cli_default(p)), f"{where}: {name} {opt} defaults to {cli_default(p)}"
                checked += 1
        for opt, values in re.findall(r"(--[a-z][a-z0-9-]*)[ =]([\w.-]+(?:\|[\w.-]+)+)", line):
            p = _param(cmd, opt)
            if p is not None and (choices := _choices(p)):
                assert set(values.split("|")) == set(choices), f"{where}: {name} {opt} takes {choices}: {values}"
                checked += 1
    assert checked >= 8, checked


def test_the_default_mode_the_docs_name_is_the_runtimes(bundled_gguf):
    """'X by default', 'default: X' and '`X`, the default' about a decoding mode, anywhere in the README and docs,
    name the mode a block-capable file runs when none is asked for (issue 55: mac.md said draft-self)."""
    from clover_gguf.decoding import MODES
    from clover_gguf.runtime import CloverRuntime

    with CloverRuntime(bundled_gguf, n_ctx=256) as rt:
        default = rt.default_mode
    assert default == "auto"
    modes = "|".join(re.escape(m) for m in MODES)
    pattern = re.compile(rf"`?\b({modes})\b`? by default|default(?: mode)?: `?({modes})\b|`({modes})`, the default")
    seen = 0
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                said = next(g for g in m.groups() if g)
                assert said == default, f"{path.name}:{n}: {line.strip()}"
                seen += 1
    assert seen >= 2


def test_serve_docs_say_what_tools_do_today():
    """docs/serve.md's fields table says, in its own row, what `tools` do today (issue 55 item 1, then issue 49:
    once ignored, now acted on), and the section it points at exists."""
    doc = (ROOT / "docs" / "serve.md").read_text()
    row = next((ln for ln in doc.splitlines() if ln.startswith("| `tools`")), None)
    assert row is not None and "ignored" not in row and "tool_choice" in row and "(Tool calls)" in row, row
    assert re.search(r"^#+ Tool calls", doc, re.M), "docs/serve.md has no Tool calls section"


# =================================================================================================================
# 2. the README's times
# =================================================================================================================
def _first_use():
    return load_bench("first_use.py")


def test_readme_times_are_the_scripts_record():
    """The README's table of times is what bench/first_use.py renders from bench/first_use.json (no figure typed by
    hand), every row has its date, machine and load, and no other sentence in the README states a time for
    `make demo` or `make test` (issue 55: "16-17 CPU-minutes" and "1 min 19 s" against 11.9 and 9 s)."""
    fu = _first_use()
    readme = (ROOT / "README.md").read_text()
    rows = fu.load_record()
    assert fu.readme_table(readme) == fu.render(rows), "run `python bench/first_use.py --readme`"
    assert {r["run"] for r in rows} >= {"demo-fresh-home", "demo-again", "test"}
    for r in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["machine"] and r["wall_s"] > 0, r
        assert "load" in r and r["source"], r
    outside = readme.replace(fu.readme_table(readme), "")
    assert not re.search(r"\d+\s*(?:min|CPU-minutes|CPU-seconds)\b", outside), \
        re.search(r".*\d+\s*(?:min|CPU-minutes|CPU-seconds)\b.*", outside)[0]


def test_first_use_times_a_command_and_its_children(tmp_path):
    """bench/first_use.py's timer counts the CPU of the processes a command starts and waits for (make's children):
    a shell that runs a busy Python child for a fixed amount of work shows at least that child's own CPU time."""
    fu = _first_use()
    child = tmp_path / "child.py"
    child.write_text("import resource, time\nx = 0\nfor i in range(3_000_000):\n    x += i * i\n"
                     "r = resource.getrusage(resource.RUSAGE_SELF)\nprint('own', r.ru_utime + r.ru_stime)\n")
    log = tmp_path / "log"
    res = fu.timed(["sh", "-c", f"{sys.executable} {child}; echo 'llama.cpp (cpu) built in 12 s'"], tmp_path,
                   dict(os.environ), log)
    own = float(re.search(r"own ([\d.]+)", log.read_text())[1])
    assert res["exit_code"] == 0 and res["build_s"] == 12
    assert res["cpu_s"] >= round(own, 1) - 0.1, (res, own)
    assert res["load"] is None or res["load"]["max"] >= res["load"]["start"] >= 0


# =================================================================================================================
# 3. the README's Use section, as typed
# =================================================================================================================
def use_lines(readme: str) -> list[tuple[str, str]]:
    """The README's Use block -> (command, its comment) for each command line (continuations joined)."""
    start = readme.index("## Use")
    block = readme[readme.index("```sh\n", start) + 6:]
    block = block[:block.index("```\n")]
    out, pending = [], ""
    for raw in block.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command, comment = _split_comment(line)
        out.append((command.strip(), comment))
    return out


def _split_comment(line: str) -> tuple[str, str]:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def _run_use_line(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """One Use line in bash, `clover-gguf` being this tree's CLI in this interpreter. chat gets a question and then
    the end of input (Ctrl-D); serve runs until it says where it listens, answers /health, and gets a Ctrl-C."""
    prelude = f'clover-gguf() {{ {shlex.quote(sys.executable)} -m clover_gguf "$@"; }}\n'
    if " serve " in f" {command} ":
        import httpx

        port = free_port()  # 8080 may be another program's on a shared machine: the one thing changed
        p = subprocess.Popen(["bash", "-c", prelude + command + f" --port {port}"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines, deadline = [], time.monotonic() + 300
        try:
            for line in p.stdout:
                lines.append(line)
                if "listening on http://" in line or time.monotonic() > deadline:
                    break
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
            assert health["status"] == "ok", health
            os.killpg(p.pid, signal.SIGINT)
            rest, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        out = "".join(lines) + rest
        # Ctrl-C is how a server stops (the README says so): a clean stop, exit 0 without an error line (issue 64)
        assert "Finished server process" in out and "error" not in out.split("Finished server process")[-1], out
        return subprocess.CompletedProcess(command, p.returncode, out, "")
    stdin = "What is 34 + 58?\n" if command.startswith("clover-gguf chat ") else None
    return subprocess.run(["bash", "-c", prelude + command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, input=stdin)


def check_use_section(readme: str, workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """Run every Use line of `readme` that does not say `# needs ...`, in order, in `workdir` (the checkout's
    clover_gguf folder linked in, as after `make demo`), with only what `make demo`'s venv holds importable (the
    serve extra: test_demo_extras.demo_site); each must exit 0 (serve: stop cleanly on Ctrl-C)."""
    from test_demo_extras import demo_site

    (workdir / "clover_gguf").symlink_to(ROOT / "clover_gguf")
    env = {**os.environ, "PYTHONPATH": f"{demo_site(workdir)}{os.pathsep}{ROOT}"}
    lines = use_lines(readme)
    skipped = [command for command, comment in lines if comment.startswith("needs ")]
    for command, comment in lines:
        if comment.startswith("needs "):
            assert re.match(r"needs [\w' -]+: \S", comment), f"say what it needs and what to put: {command}"
    assert 1 <= len(skipped) <= 4, skipped  # the 35B's chat line and the RPC pair: the rest runs here
    results = {}
    for command, comment in lines:
        if command in skipped:
            continue
        p = _run_use_line(command, workdir, env)
        assert p.returncode == 0, f"{command}\nexit code {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        assert "Traceback" not in p.stdout + p.stderr, command
        results[command] = p
    return results


@pytest.mark.slow
def test_the_readme_use_section_runs_as_typed_on_the_bundled_model(tmp_path):
    """After `make demo` (llama.cpp built, the checkout's folder), every Use line runs as typed, in order; the lines
    that cannot run here say what they need. Also what the lines print that issue 55 asked for: quantize's
    fallbacks, fit's plain word that --ctx 32768 became the tiny model's 4096, one speed in --stats."""
    runs = check_use_section((ROOT / "README.md").read_text(), tmp_path)
    by_start = lambda prefix: next(p for c, p in runs.items() if c.startswith(prefix))  # noqa: E731
    assert "fallback: " in by_start("clover-gguf quantize clover-bf16.gguf clover-q4_k_m.gguf").stdout
    fit = by_start("clover-gguf fit clover-q4_k_m.gguf").stdout
    assert re.search(r"^plan .*context 4096 \(the model's most: --ctx 32768 is above it\)", fit, re.M), fit
    stats = by_start("clover-gguf generate clover-q4_k_m.gguf -p \"What is 34 + 58?\" --stats").stderr
    assert stats.count("tok/s") == 1, stats
    json.loads(by_start("clover-gguf generate clover-q4_k_m.gguf -p \"Count from").stdout)
    assert "listening on http://127.0.0.1:" in by_start("clover-gguf serve").stdout
    assert (tmp_path / "clover-iq4_xs.gguf").is_file() and (tmp_path / "clover-grafted.gguf").is_file()


def test_fit_says_plainly_that_the_context_was_capped(bundled_gguf):
    """fit --ctx above the model's context says so on its plan line, not only in --json's notes (issue 55)."""
    p = _cli("fit", bundled_gguf, "--ctx", "32768")
    assert p.returncode == 0, p.stderr
    plan = next(ln for ln in p.stdout.splitlines() if ln.startswith("plan "))
    assert "context 4096 (the model's most: --ctx 32768 is above it)" in plan, p.stdout
    assert p.stdout.count("32768") == 1  # said once
    j = json.loads(_cli("fit", bundled_gguf, "--ctx", "32768", "--json").stdout)
    assert j["ctx"] == 4096 and any("32768" in n for n in j["notes"])


def test_the_calibration_text_the_readme_names_is_enough_for_imatrix(bundled_gguf):
    """clover_gguf/data/calibration.txt (the Use section's imatrix text) holds at least the 2 x 512 tokens llama-imatrix
    needs, in the bundled model's tokenizer and, by its word count, in the 35B's 248k-token one; and it is packaged."""
    from clover_gguf.quantize import count_tokens

    text = (ROOT / "clover_gguf" / "data" / "calibration.txt").read_bytes()
    assert count_tokens(bundled_gguf, text) >= 2 * 512
    assert len(text.decode().split()) >= 1200  # a large vocabulary's 1.3 tokens or more a word: past 2 x 512
    pkg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["clover_gguf"]
    assert "data/*.txt" in pkg


# =================================================================================================================
# 4. MLX: one install line; what "4-bit" costs
# =================================================================================================================
def test_one_mlx_install_line_everywhere():
    """The install line doctor and the errors give is `make mlx` (pip install -e from the checkout without make);
    docs/mac.md and the README say the same; nothing names the package as if it were on PyPI; `make mlx` keeps the
    editable install."""
    src = (ROOT / "clover_gguf" / "mlx_backend.py").read_text()
    hint = re.search(r'^INSTALL_HINT = "(.*)"$', src, re.M)[1]
    assert "make mlx" in hint and "pip install -e '.[mlx]'" in hint
    for path in [*DOCS, *sorted((ROOT / "clover_gguf").rglob("*.py")), ROOT / "Makefile"]:
        assert "clover-gguf[mlx]" not in path.read_text(), path
    assert "make mlx" in (ROOT / "docs" / "mac.md").read_text() and "make mlx" in (ROOT / "README.md").read_text()
    assert "pip install -e '.[mlx]'" in (ROOT / "docs" / "mac.md").read_text()
    make = subprocess.run(["make", "-n", "-B", "mlx"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stderr
    installs = [ln for ln in make.stdout.splitlines() if "pip install" in ln and "mlx" in ln]
    assert installs and all(" -e " in ln for ln in installs), make.stdout


def test_mlx_convert_says_the_bits_per_weight_it_wrote(tmp_path):
    """mlx-convert's "4-bit" comes with what it costs: bits per quantized weight (4 + a scale and a bias per group)
    and bits per weight over the model, both recomputed here from the safetensors it wrote (every stored byte over
    every parameter, a packed uint32 holding 32 / bits weights), and said in the summary line."""
    pytest.importorskip("mlx.core")
    from safetensors.numpy import load_file

    out = tmp_path / "mlx4"
    p = _cli("mlx-convert", BUNDLED, "-o", out, "--q-bits", "4", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    arrays = {}
    for f in sorted(out.glob("model*.safetensors")):
        arrays.update(load_file(f))
    bits = json.loads((out / "config.json").read_text())["quantization"]
    stored = sum(a.nbytes for a in arrays.values()) * 8
    params = 0
    for name, a in arrays.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in arrays:
            continue  # a quantized weight's group data: counted in its bytes, not as parameters
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and base + ".scales" in arrays:
            layer_bits = (bits.get(base) or {}).get("bits", bits["bits"]) if isinstance(bits.get(base), dict) \
                else bits["bits"]
            params += a.size * 32 // layer_bits
        else:
            params += a.size
    assert res["bits_per_weight"] == pytest.approx(stored / params, abs=1e-3)
    scales = next(a for n, a in arrays.items() if n.endswith(".scales"))
    assert res["bits_per_quantized_weight"] == 4 + 2 * scales.dtype.itemsize * 8 / 64
    line = _cli("mlx-convert", BUNDLED, "-o", tmp_path / "again", "--q-bits", "4").stdout
    assert f"{res['bits_per_weight']:.3f} bits per weight" in line and "bits per quantized weight" in line, line


# =================================================================================================================
# 5. the stats a person reads
# =================================================================================================================
def _stats(**kw):
    from clover_gguf.runtime import RunStats

    base = dict(mode="ar", prompt_tokens=25, generated_tokens=28, forward_passes=29, ar_steps=28, seconds=4.16,
                prompt_seconds=1.67, tokens_per_s=6.7, decode_tokens_per_s=11.3, finish_reason="stop")
    return RunStats(**{**base, **kw})


def test_the_stats_line_has_one_speed_and_counts_passes_after_the_prompt():
    """One tok/s figure per line (issue 55: '136.0 tok/s ... predicted 672.2 against measured 175.9'); tokens per
    pass over the passes after the prompt's, computed here from the counts (AR: 28 tokens in 28 decode passes is 1.00,
    where the old line said 0.97 counting the prompt's); auto's prediction as a ratio; singular and plural right."""
    ar = _stats().summary()
    assert ar.count("tok/s") == 1 and "11.3 tok/s after the prompt" in ar, ar
    assert f"{28 / (29 - 1):.2f} tokens/pass over 28 passes after the prompt's" in ar, ar
    auto = _stats(mode="auto", generated_tokens=93, forward_passes=12, ar_steps=7, drafts=1, block_passes=1,
                  drafted_tokens=31, accepted_tokens=30, predicted_tokens_per_s=672.2, measured_tokens_per_s=175.9,
                  tokens_per_s=136.0, decode_tokens_per_s=170.0).summary()
    assert auto.count("tok/s") == 1, auto
    assert "7 AR steps and 1 draft in 1 block pass" in auto and "1 drafts" not in auto, auto
    assert f"{175.9 / 672.2:.2f}x the speed it predicted" in auto, auto
    assert f"{93 / 11:.2f} tokens/pass over 11 passes after the prompt's" in auto, auto
    two = _stats(mode="auto", ar_steps=1, drafts=2, block_passes=3, accepted_tokens=20, drafted_tokens=22).summary()
    assert "1 AR step and 2 drafts in 3 block passes" in two, two
    one = _stats(mode="diffusion", generated_tokens=1, forward_passes=2, ar_steps=0).summary()
    assert "1 token in" in one and "over 1 pass after" in one, one


def test_stats_json_only_grows():
    """The JSON stats (--json, clover_stats) keep every field they had (other code and clients read them) and add
    the per-decode-pass figures; docs/serve.md lists every field, and says when the auto fields are null."""
    d = _stats().to_json()
    before = {"mode", "prompt_tokens", "generated_tokens", "forward_passes", "block_passes", "drafted_tokens",
              "accepted_tokens", "drafts", "ar_steps", "predicted_tokens_per_s", "measured_tokens_per_s",
              "finish_reason", "time_to_first_token_s", "tokens_per_s", "decode_tokens_per_s", "prompt_seconds",
              "seconds", "peak_memory_mib", "rollback_passes", "reused_tokens", "tokens_per_pass", "acceptance_rate",
              "accepted_per_draft"}
    assert before <= set(d)
    assert d["decode_passes"] == 28 and d["tokens_per_decode_pass"] == 1.0 and d["tokens_per_pass"] == round(28 / 29, 4)
    doc = (ROOT / "docs" / "serve.md").read_text()
    para = doc[doc.index("The decoding stats are in the extra field `clover_stats`"):]
    para = para[:para.index("\n\n")]
    missing = [k for k in d if f"`{k}`" not in para]
    assert not missing, missing
    assert re.search(r"`predicted_tokens_per_s`.*null", para, re.S)


# =================================================================================================================
# 6. chat
# =================================================================================================================
@pytest.mark.slow
def test_chat_names_an_unknown_mode_and_pipes_thinking_apart(bundled_gguf):
    """`/mode bogus` says the mode is unknown (and what the modes are); on a pipe the thinking comes between
    <think> and </think> lines, so splitting the output as generate's is split gives the runtime's own thinking and
    answer for the same question."""
    from clover_gguf.chat import ChatSession
    from clover_gguf.runtime import CloverRuntime
    from clover_gguf.thinking import split_thinking

    out = io.StringIO()
    s = ChatSession(bundled_gguf, mode="ar", max_new_tokens=64, out=out,
                    inp=io.StringIO("/mode bogus\nWhat is 34 + 58?\n"))
    s.loop()
    text = out.getvalue()
    assert "(unknown mode 'bogus'" in text and "still ar" in text, text
    turn = text[text.index("> ", text.index("still ar")) + 2:]
    turn = turn[:turn.index("\n(ar: ")]
    with CloverRuntime(bundled_gguf) as rt:
        ans = rt.generate([{"role": "user", "content": "What is 34 + 58?"}], mode="ar", max_new_tokens=64)
    assert ans.thinking and ans.text
    assert turn.startswith("<think>\n") and "\n</think>\n\n" in turn, turn
    thinking, answer = split_thinking(turn)
    assert (thinking, answer) == (ans.thinking, ans.text), turn


def test_thinking_renderer_tags_piped_thinking_and_closes_it():
    from clover_gguf.chat import ThinkingRenderer
    from clover_gguf.thinking import ThinkSplitter

    for pieces, want in ((["<think>\nplan", "ning</think>\n\nThe", " answer"], "<think>\nplanning\n</think>\n\nThe answer"),
                         (["<think>\nonly thinking"], "<think>\nonly thinking\n</think>")):
        out = io.StringIO()
        r, split = ThinkingRenderer(out, True, False), ThinkSplitter(False)
        for piece in pieces:
            r.write(*split.feed(piece))
        r.write(*split.close())
        r.finish()
        assert out.getvalue() == want


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


# =================================================================================================================
# 8. /metrics counts refusals
# =================================================================================================================
def test_metrics_count_refused_requests(bundled_gguf):
    """400s on the completion endpoints, refused before a slot (a body that is not JSON, a field of the
    wrong type, n > 16, a prompt over the context, a block mode the file lacks is not it here), count under
    clover_requests_total{finish="refused"}; an answered request under its finish; nothing twice."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from clover_gguf.serve import create_app

    app = create_app(bundled_gguf, ctx=256)
    msgs = [{"role": "user", "content": "What is 34 + 58?"}]
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                      ).status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": msgs, "temperature": "hot"}).status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": msgs, "n": 17, "mode": "ar"}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x " * 2000, "max_tokens": 8}).status_code == 400
        long = [{"role": "user", "content": "What is 34 + 58? " * 80}]  # max_tokens past the context is taken
        assert c.post("/v1/chat/completions", json={"messages": long, "max_tokens": 8}).status_code == 400
        ok = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16, "mode": "ar"})
        assert ok.status_code == 200, ok.text
        assert c.get("/v1/nothing").status_code == 404  # not a completion request: not counted
        text = c.get("/metrics").text
    counts = {(m, f): int(n) for m, f, n in re.findall(r'clover_requests_total\{mode="([^"]+)",finish="([^"]+)"\} (\d+)',
                                                       text)}
    assert sum(n for (m, f), n in counts.items() if f == "refused") == 5, counts
    assert counts.get(("ar", "refused")) == 1 and counts.get(("auto", "refused")) == 4, counts
    assert sum(n for (m, f), n in counts.items() if f != "refused") == 1, counts


# =================================================================================================================
# 9. the client of docs/serve.md's first example
# =================================================================================================================
def test_the_serve_extra_installs_the_client_of_the_docs_example():
    """docs/serve.md's first Python example imports `openai`: the serve extra (what `make demo` installs) holds it,
    pinned as the test extra pins it."""
    doc = (ROOT / "docs" / "serve.md").read_text()
    example = doc[doc.index("```python\n") + 10:]
    example = example[:example.index("```")]
    imported = set(re.findall(r"^(?:from|import) (\w+)", example, re.M))
    assert imported == {"openai"}, imported
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pin = lambda reqs, name: next((r for r in reqs if re.match(rf"{name}\b", r)), None)  # noqa: E731
    assert pin(extras["serve"], "openai") is not None and pin(extras["serve"], "openai") == pin(extras["test"], "openai")
    assert "make demo" in doc[:doc.index("```python")] and "openai" in doc[:doc.index("```python")]
