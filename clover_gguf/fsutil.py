"""Output files appear whole or not at all: write to a temporary name beside the target, then rename.

An output never replaces one of the command's inputs (also through a link or a hard link), a folder or a special
file (a device, a FIFO, a socket), nor an existing file unless the user said --force. While the temporary file
exists, SIGTERM and SIGHUP stop the work as Ctrl-C does (KeyboardInterrupt: exit 130), so no signal leaves it.
The temporary name stays within NAME_MAX (255 bytes) whatever the output's name. `temp_dir` gives a scratch folder
with the same promise.

A folder output (mlx-convert, graft into an MLX folder: `check_output_folder`, `atomic_folder`) is never an input, a
folder holding one, the working folder or one holding it, nor a link; it replaces an existing folder only with
--force, and then whole: the old one is renamed aside, the new one in, and only then is the old one removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Iterator

from clover_gguf.errors import UserError

# signals that stop a write cleanly, besides SIGINT (which Python already raises as KeyboardInterrupt)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
NAME_MAX = 255  # bytes in one file name (Linux, macOS; the most file systems allow)


def temp_name(target: Path, pid: int | None = None, kind: str = "partial") -> Path:
    """The temporary file beside `target`: `.NAME.partial-PID`, or, when that would pass NAME_MAX, the name cut
    short and marked with a hash of the whole name (`.NAM~1a2b3c4d.partial-PID`), so any legal output name works.
    kind: "partial" (the output being written) or "old" (a folder being replaced, moved aside)."""
    target = Path(target)
    suffix = f".{kind}-{os.getpid() if pid is None else pid}"
    name = os.fsencode(target.name)
    if len(name) + 1 + len(suffix) <= NAME_MAX:
        return target.with_name(f".{target.name}{suffix}")
    mark = "~" + hashlib.sha256(name).hexdigest()[:8]
    keep = NAME_MAX - 1 - len(mark) - len(suffix)
    short = os.fsdecode(name[:keep])  # a character cut in two stays bytes (surrogateescape): still a legal name
    return target.with_name(f".{short}{mark}{suffix}")


def check_writable_dir(target: Path) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise UserError(f"output folder is not writable: {folder}")


def check_output(target: Path, inputs: Iterable[Path] = (), force: bool = False) -> None:
    """Refuse an output path whose replacement would destroy something (see the module's docstring)."""
    target = Path(target)
    try:
        st = os.stat(target)  # follows links: a link to a device or to an input is judged by what it points at
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UserError(f"cannot use {target} as the output: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UserError(f"output is a folder: {target}")
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"output {target} is not a regular file (a device, FIFO or socket is never replaced)")
        for p in inputs:
            with contextlib.suppress(OSError):
                other = os.stat(p)
                if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                    raise UserError(f"the output {target} is one of the inputs ({p}): choose another output path")
        if not force:
            raise UserError(f"{target} exists (--force overwrites it)")
    check_writable_dir(target)


def check_output_folder(target: Path, inputs: Iterable[Path] = (), force: bool = False) -> None:
    """Refuse a folder output whose replacement would destroy something, or that cannot be made (see the module's
    docstring); inputs: the folders and files the command reads. Compared by device and inode, so also through
    links and `..`."""
    target = Path(target)
    if target.is_symlink():
        raise UserError(f"the output {target} is a link (to {os.readlink(target)}): name the folder itself, or remove "
                        "the link")
    full = Path(os.path.abspath(target))
    if full == full.parent:
        raise UserError(f"the output {target} is the root folder: name a new folder")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:  # ENOTDIR: a file where a parent folder should be; EACCES
        raise UserError(f"cannot use {target} as the output folder: {e.strerror or e}") from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"the output {target} exists and is not a folder")
        if (st.st_dev, st.st_ino) in _self_and_parents(Path.cwd()):
            raise UserError(f"the output {target} is the working folder or holds it: name a new folder")
        for p in inputs:
            if (st.st_dev, st.st_ino) in _self_and_parents(p):
                raise UserError(f"the output {target} is one of the inputs or holds it ({p}): choose another "
                                "output folder")
        if not force:
            raise UserError(f"{target} exists (--force replaces it)")
    folder = existing_folder(full.parent)
    if folder is None:
        raise UserError(f"cannot make the output folder {target}: a file stands where a folder of its path should be")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot make the output folder {target}: {folder} is not writable")


def _self_and_parents(path: Path) -> set[tuple[int, int]]:
    """(device, inode) of `path` (links followed) and of every folder above it."""
    out = set()
    p = Path(os.path.realpath(path))
    for q in (p, *p.parents):
        with contextlib.suppress(OSError):
            st = os.stat(q)
            out.add((st.st_dev, st.st_ino))
    return out


def existing_folder(path: Path) -> Path | None:
    """The nearest of `path` and its parents that exists, if it is a folder (None: a file stands in the way)."""
    path = Path(os.path.abspath(path))
    for q in (path, *path.parents):
        if os.path.lexists(q):
            return q if q.is_dir() else None
    return None


def check_free_disk(target: Path, needed_bytes: int) -> None:
    """Refuse before writing when the target's file system cannot hold the output (10% margin)."""
    folder = existing_folder(Path(target).parent) or Path(".")
    free = shutil.disk_usage(folder).free
    if needed_bytes * 1.1 > free:
        raise UserError(
            f"not enough disk space in {folder}: need about {needed_bytes / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free"
        )


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt inside the block, unless they are ignored (main thread only:
    elsewhere Python cannot install handlers, and the main thread's own block does it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # a signal the user chose to ignore (`nohup` ignores SIGHUP) stays ignored
    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def atomic_output(target: Path) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it to `target` only if the block completes.

    Any exception, KeyboardInterrupt and the stop signals included, removes the temporary file, so no half-written
    output is left. An OSError while writing (a full disk: ENOSPC, a file-size limit: EFBIG) becomes one line."""
    target = Path(target)
    check_writable_dir(target)
    tmp = temp_name(target)
    with stop_signals_interrupt():
        try:
            yield tmp
            os.replace(tmp, target)
        except BaseException as e:
            with _signals_ignored():
                with contextlib.suppress(OSError):  # gone already, or never made
                    tmp.unlink()
            if isinstance(e, OSError):  # ENOSPC, EFBIG, or a short write reported without an errno
                raise UserError(f"could not write {target}: {e.strerror or e}") from None
            raise


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """atomic_output for a folder (check_output_folder first): yield an empty temporary folder beside `target` (its
    parents made); when the block completes, it replaces `target` (replace_folder); any exception, Ctrl-C and the
    stop signals included, removes it instead. An OSError while writing (a full disk) becomes one line."""
    target = Path(target)
    tmp = temp_name(target)
    with stop_signals_interrupt():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            yield tmp
            replace_folder(tmp, target)
        except BaseException as e:
            with _signals_ignored():
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise UserError(f"could not write {target}: {e.strerror or e}") from None
            raise


def replace_folder(new: Path, target: Path) -> None:
    """Rename the folder `new` to `target`. An old folder there is renamed aside first and removed last, with Ctrl-C
    and the stop signals deferred until that is done, so at every moment the old folder or the new one is at
    `target` and no `.old` folder is left."""
    old = temp_name(target, kind="old") if os.path.lexists(target) else None
    with _signals_deferred():
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # a killed run's leftover of the same PID
            os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    """A scratch folder in the system's temporary directory, removed however the block ends: an error, Ctrl-C, and
    SIGTERM or SIGHUP (which stop the work as Ctrl-C does inside the block; exit 130)."""
    with stop_signals_interrupt():
        # the name is chosen before the folder exists, so a signal right after mkdir returns still finds it to
        # remove (tempfile.mkdtemp returns the name only after making the folder: a gap a signal can fall into)
        path = Path(tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(8)}"
        try:
            os.mkdir(path, 0o700)
            yield path
        finally:
            with _signals_ignored():
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C or TERM while the temporary file is being removed must not stop the removal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C and the stop signals that come while the block runs take effect when it ends (they are raised again
    then), so a few steps that must run together are never cut between them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = [s for s in (signal.SIGINT, *STOP_SIGNALS) if signal.getsignal(s) not in (signal.SIG_IGN, None)]
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)
