"""The scripts under bench/ as modules, for the tests that check them (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(relpath: str):
    """bench/<relpath> loaded as the module bench_<its path, '/' as '_', no .py>, registered in sys.modules
    (dataclasses look their module up there)."""
    name = "bench_" + relpath.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, BENCH / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
