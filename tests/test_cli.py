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
