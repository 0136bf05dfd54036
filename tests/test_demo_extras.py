"""`make demo` on a fresh machine (issue 64): its venv holds the package with the serve extra only (and the
llama-cpp-python binding that build-llama installs), never the test extra. The suite's interpreter has everything, so
here `make demo` runs with every module of a distribution outside that closure made unimportable (a sitecustomize on
PYTHONPATH, which the demo's subprocesses, `serve` among them, inherit): an import the demo needs from the test extra
(httpx in the agent turn was one) fails here as it fails for a new user.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _closure(roots: list[str]) -> set[str]:
    """The normalized names of the installed distributions that `roots` (requirement strings) pull in, recursively,
    with their extras and this interpreter's markers."""
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = norm(req.name)
        key_extras = [name + "[" + e + "]" for e in sorted(req.extras)]
        if name in seen and all(k in seen for k in key_extras):
            continue
        seen.add(name)
        seen.update(key_extras)
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue  # an optional platform package this machine does not have
        for r in requires:
            sub = Requirement(r)
            if sub.marker is None:
                todo.append((sub, ""))
                continue
            for e in ("", *req.extras):
                if sub.marker.evaluate({"extra": e}):
                    todo.append((sub, e))
                    break
    return {n for n in seen if "[" not in n}


def demo_roots() -> list[str]:
    """What `make demo`'s venv is made from: the package's dependencies, its serve extra (the Makefile's
    `pip install -e '.[serve]'`), and the binding `clover-gguf build-llama` installs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    make = (ROOT / "Makefile").read_text()
    extras = re.search(r"^\$\(VENV\)/\.core:.*?pip install -q -e '\.\[(\w+)\]'", make, re.M | re.S)[1]
    assert extras == "serve", extras
    return [*project["dependencies"], *project["optional-dependencies"][extras], "llama-cpp-python"]


def blocked_modules(roots: list[str]) -> set[str]:
    """Top-level modules installed here that only distributions outside the closure of `roots` provide."""
    allowed = _closure(roots) | {"clover-gguf"}  # the package itself (here an editable install of some checkout)
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    return {mod for mod, dists in metadata.packages_distributions().items()
            if mod.isidentifier() and not any(norm(d) in allowed for d in dists)}


SITECUSTOMIZE = '''"""Written by tests/test_demo_extras.py: these modules are not in `make demo`'s venv."""
import importlib.abc
import sys

BLOCKED = frozenset({blocked!r})


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in make demo's venv)", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def test_the_blocker_takes_what_the_test_extra_alone_brings():
    """The closure is the serve extra's: httpx (test extra only; openai 3.57 brings httpx2), torch and pytest are
    out, openai, fastapi, llguidance and numpy in."""
    blocked = blocked_modules(demo_roots())
    assert {"httpx", "torch", "pytest", "transformers", "selenium"} <= blocked, blocked
    assert not blocked & {"clover_gguf", "openai", "fastapi", "uvicorn", "starlette", "llguidance", "numpy", "gguf", "httpx2",
                          "llama_cpp", "typer", "jinja2"}


def demo_site(folder: Path) -> Path:
    """A folder holding a sitecustomize.py that makes every module outside `make demo`'s venv unimportable: put it
    first on PYTHONPATH (the README's Use lines run under it too: tests/test_first_use.py)."""
    site = folder / "demo-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=sorted(blocked_modules(demo_roots()))))
    return site


@pytest.mark.slow
def test_make_demo_runs_in_the_venv_it_makes(tmp_path):
    """`make demo` (every step: convert, quantize, info, the generate runs, the agent turn through serve) with only
    what its venv holds importable: exit 0 and its closing hint; the agent turn's call and answer printed."""
    env = {**os.environ, "PYTHONPATH": f"{demo_site(tmp_path)}{os.pathsep}{ROOT}"}
    probe = subprocess.run([sys.executable, "-c", "import httpx"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "not in make demo's venv" in probe.stderr, probe.stderr
    p = subprocess.run(["make", "-s", "demo", f"PY={sys.executable}", f"DEMO_DIR={tmp_path / 'demo'}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out[-3000:]
    assert "model calls: " in p.stdout and "tool result: " in p.stdout and "model answers: " in p.stdout, p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith("== done. Run the commands of the README"), p.stdout[-500:]
