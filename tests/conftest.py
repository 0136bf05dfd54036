"""Shared fixtures: random tiny checkpoints, made once per test session."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import clover_gguf
from clover_gguf.testing.make_tiny import make_tiny

BUNDLED = Path(clover_gguf.__file__).parent / "assets" / "tiny-clover"


def pytest_configure(config) -> None:
    """Ctrl-C as in a user's terminal, whatever started the suite: a non-interactive shell's background job (`cmd &`)
    starts with SIGINT ignored, which Python, the chat (it keeps an ignored SIGINT ignored) and every command the tests
    run would keep, and the tests that send a Ctrl-C would see nothing happen."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(**make_tiny options) -> folder; identical options share one folder."""
    cache: dict[tuple, Path] = {}

    def make(**opts) -> Path:
        key = tuple(sorted(opts.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt")
            make_tiny(out, **opts)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny(make_checkpoint) -> Path:
    return make_checkpoint(seed=1)


@pytest.fixture(scope="session")
def bundled_gguf(tmp_path_factory) -> Path:
    """The bundled trained tiny Clover (clover_gguf/assets/tiny-clover) as an F32 GGUF, converted once."""
    from clover_gguf.convert import convert

    out = tmp_path_factory.mktemp("bundled") / "tiny-clover.gguf"
    convert(BUNDLED, out, outtype="f32", quiet=True)
    return out


@pytest.fixture(scope="session")
def bundled_eval() -> list[dict]:
    """The bundled model's eval rows: {"prompt", "answer"}."""
    import json

    return [json.loads(x) for x in (BUNDLED / "eval.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="session")
def tool_gguf(tmp_path_factory) -> Path:
    """The tool-trained tiny Clover (clover_gguf.testing.agent.TOOL_MODEL) as an F32 GGUF, converted once."""
    from clover_gguf.convert import convert
    from clover_gguf.testing.agent import TOOL_MODEL

    out = tmp_path_factory.mktemp("tools") / "tiny-clover-tools.gguf"
    convert(TOOL_MODEL, out, outtype="f32", quiet=True)
    return out
