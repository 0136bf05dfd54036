"""The command line as a new user meets it: usage errors are one line and exit 2, help is readable, a plain install
(the declared dependencies alone) runs `--help`, and the Python we claim is the one our pins allow."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from clover_gguf import cli

ROOT = Path(__file__).resolve().parents[1]


def _main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("args,words", [
    (["generate", "x.gguf", "--mode", "fast"], "'fast' is not one of 'auto', 'ar', 'diffusion', 'draft-self'"),
    (["generate", "x.gguf"], "Missing option '-p'"),
    (["--bogus"], "No such option: --bogus"),
    (["generate", "x.gguf", "-p", "hi", "-n", "0"], "--max-new-tokens"),
    (["generate", "x.gguf", "-p", "hi", "--temp", "warm"], "--temp"),
    (["generate"], "Missing argument 'model'"),
    (["info"], "Missing argument 'path'"),
    (["quantize", "a.gguf", "b.gguf"], "Missing option '--type'"),
    (["serve", "x.gguf", "--port", "70000"], "--port"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, args, words):
    code, out, err = _main(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("clover-gguf: error: ") and words in err, err
    assert "Traceback" not in err and "Value error," not in err


def test_bare_command_prints_the_help_and_exits_2(capsys):
    code, out, err = _main(capsys)
    assert code == 2 and "Usage: clover-gguf" in out and "generate" in out and err == ""


def test_a_user_error_inside_a_command_is_one_line(capsys, tmp_path):
    code, out, err = _main(capsys, "generate", str(tmp_path / "missing.gguf"), "-p", "hi")
    assert code == 2 and err == f"clover-gguf: error: no such model file: {tmp_path / 'missing.gguf'}\n"


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["serve"], ["convert"], ["quantize"]])
def test_help_has_no_type_noise(capsys, command):
    code, out, _ = _main(capsys, *command, "--help")
    assert code == 0 and "Usage: clover-gguf" in out
    assert "<bool>" not in out and "╭" not in out


def test_the_installed_entry_point_is_one_line_too():
    """The real process (python -m clover_gguf): what a shell sees."""
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "generate", "x.gguf", "--mode", "fast"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr


def _declared() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_help_needs_only_the_declared_dependencies():
    """A plain `pip install clover-gguf` must run `--help` (CI also checks it in a fresh venv, .ci/run): every
    third-party module the CLI loads for it belongs to a declared dependency or to one of theirs."""
    from importlib.metadata import packages_distributions, requires

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    def canon(name: str) -> str:
        return name.lower().replace("_", "-")

    env = {**default_environment(), "extra": ""}
    allowed, todo = set(), [Requirement(r).name for r in _declared()["dependencies"]]
    while todo:  # the closure of the declared dependencies, extras left out
        name = canon(todo.pop())
        if name in allowed:
            continue
        allowed.add(name)
        for r in requires(name) or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    dists = packages_distributions()
    # what a plain install lacks cannot be imported in the child: a dependency's optional import of a package an
    # extra installed here (gguf tries sentencepiece, which mlx-lm brings) then finds it absent, as it would there
    blocked = sorted(m for m, ds in dists.items() if m.isidentifier() and m not in sys.stdlib_module_names
                     and m != "clover_gguf" and not {canon(d) for d in ds} & allowed)
    code = (f"import sys, json\nsys.modules.update(dict.fromkeys({blocked!r}))\nbefore = set(sys.modules)\n"
            "from clover_gguf import cli\n"
            "try:\n    cli.main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout.splitlines()[-1])
    third_party = {m: {canon(d) for d in dists[m]} for m in loaded
                   if m in dists and m not in sys.stdlib_module_names and m != "clover_gguf"}
    undeclared = {m: d for m, d in third_party.items() if not d & allowed}
    assert not undeclared, f"--help loads modules of undeclared distributions: {undeclared}"


def test_the_python_we_claim_is_the_one_our_pins_allow():
    """requires-python's floor is the highest floor of the pinned dependencies (and has tomllib, 3.11+), and this
    interpreter meets it."""
    from importlib.metadata import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    project = _declared()
    claim = SpecifierSet(project["requires-python"])
    floor = Version(str(claim).removeprefix(">="))
    assert floor >= Version("3.11")  # recipes.py reads TOML with tomllib
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") in claim
    pinned = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]]
    pinned = [r for r in pinned if any(s.operator == "==" for s in r.specifier)]
    assert pinned
    for r in pinned:
        theirs = SpecifierSet(metadata(r.name).get("Requires-Python") or "")
        assert floor in theirs, f"{r.name} {r.specifier} needs Python {theirs}, we claim {claim}"


# ---- first use (issue 38) ---------------------------------------------------------------------------------------
def test_help_names_what_the_commands_take_and_serve(capsys):
    """serve --help lists every endpoint it serves; check-block --help says it reads JSONL and what its default
    prompts are."""
    _, out, _ = _main(capsys, "serve", "--help")
    flat = " ".join(out.split())
    assert all(e in flat for e in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
                                   "/slots")), out
    _, out, _ = _main(capsys, "check-block", "--help")
    flat = " ".join(out.split())
    assert ".jsonl" in flat and "one prompt per line" in flat and "fit the model" in flat, out


def _make_dry(*args: str) -> list[str]:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make here")
    p = subprocess.run(["make", "-n", "-B", "--no-print-directory", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_make_demo_ends_by_naming_the_command_line():
    """After `make demo` nothing is on PATH: its last line says what to type (the venv's clover-gguf, or activate)."""
    last = _make_dry("demo")[-1]
    assert ".venv/bin/clover-gguf" in last and ". .venv/bin/activate" in last, last
    assert "`" not in last  # the shell would run it as a command substitution


def test_make_installs_without_setuptools_editable_note():
    """Every editable install in the Makefile carries the filter for setuptools' "Editable installation" note, and the
    filter matches the note setuptools emits."""
    import setuptools.command.editable_wheel as ew

    installs = [l for l in _make_dry("venv") if "pip install" in l and " -e " in l]
    assert len(installs) == 2, installs
    assert all(l.startswith('PYTHONWARNINGS="ignore:Editable installation" ') for l in installs), installs
    assert 'InformationOnly.emit("Editable installation."' in Path(ew.__file__).read_text()
