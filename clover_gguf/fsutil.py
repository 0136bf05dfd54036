"""Output files appear whole or not at all: write to a temporary name beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from clover_gguf.errors import UserError


def check_writable_dir(target: Path) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise UserError(f"output folder is not writable: {folder}")


def check_free_disk(target: Path, needed_bytes: int) -> None:
    """Refuse before writing when the target's file system cannot hold the output (10% margin)."""
    folder = target.parent if str(target.parent) else Path(".")
    free = shutil.disk_usage(folder).free
    if needed_bytes * 1.1 > free:
        raise UserError(
            f"not enough disk space in {folder}: need about {needed_bytes / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free"
        )


def check_output(out: Path, force: bool, src: Path | None = None) -> None:
    """An output file may replace an existing file only with --force, and never a folder or the input itself."""
    if out.exists() and out.is_dir():
        raise UserError(f"output is a folder: {out}")
    if out.exists() and not force:
        raise UserError(f"{out} exists (--force overwrites it)")
    with contextlib.suppress(OSError):
        if src is not None and out.exists() and out.samefile(src):
            raise UserError("the output would overwrite the input")


@contextlib.contextmanager
def atomic_output(target: Path) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it to `target` only if the block completes.

    Any exception, KeyboardInterrupt included, removes the temporary file, so no half-written output is left.
    """
    target = Path(target)
    check_writable_dir(target)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
