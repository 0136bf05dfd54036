"""Shared fixtures: random tiny checkpoints, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover_gguf.testing.make_tiny import make_tiny


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
