"""Build the patched llama.cpp that Clover runs on, cache it, and point llama-cpp-python at it.

The pinned source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist (commit 0c1e57098), or an
upstream checkout of that commit given by the user. Every patches/*.patch is applied in name order, then cmake
builds the shared libraries and the command-line tools. The result is installed into

    <cache>/clover-gguf/llama-<hash>/bin/      (libllama.so, libggml*.so, llama-cli, llama-server, ...)
    <cache>/clover-gguf/llama-<hash>/clover-build.json

where <hash> covers the source, the bytes of every patch, the backend and the cmake options. The stamp file is
written last and the folder is renamed into place, so a folder that has a matching stamp is always complete.

Everything here is a plain function; the CLI wires them up.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from clover_gguf.errors import UserError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
LLAMA_CPP_COMMIT = "0c1e57098"

BACKENDS = ("cpu", "cuda", "metal", "vulkan")
LIB_TARGETS = ("llama", "ggml")
TOOL_TARGETS = (
    "llama-cli",
    "llama-server",
    "llama-quantize",
    "llama-imatrix",
    "llama-bench",
    "llama-perplexity",
)
STAMP_NAME = "clover-build.json"
# Bump when the way a build is made changes in a way the cmake options do not show (file layout, stamp format).
RECIPE_VERSION = 1
# Rough size of a CPU build tree (sources + objects + install); checked before starting.
BUILD_DISK_BYTES = 2 * 2**30

ENV_SDIST = "CLOVER_GGUF_SDIST"
ENV_CACHE = "CLOVER_GGUF_CACHE_DIR"
ENV_PATCHES = "CLOVER_GGUF_PATCHES"
ENV_LIB_PATH = "LLAMA_CPP_LIB_PATH"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """One installed llama.cpp build."""

    prefix: Path  # install folder (holds bin/ and the stamp)
    bin_dir: Path  # tools and shared libraries
    backend: str  # cpu | cuda | metal | vulkan | unknown
    build_hash: str | None  # None for a library not built by us (LLAMA_CPP_LIB_PATH without a stamp)
    patch_hash: str | None
    source: str | None  # "sdist:<sha256>" or "git:<commit>"
    cached: bool = False  # True when build_llama found it already built
    seconds: float = 0.0  # wall time of build_llama

    @property
    def lib_dir(self) -> Path:
        """The folder to put in LLAMA_CPP_LIB_PATH."""
        return self.bin_dir

    @property
    def libllama(self) -> Path:
        return self.bin_dir / _shared_lib_name("llama")

    def tool(self, name: str) -> Path:
        exe = name + (".exe" if sys.platform == "win32" else "")
        return self.bin_dir / exe


# --------------------------------------------------------------------------------------------------------------------
# locations


def cache_root() -> Path:
    """<user cache>/clover-gguf; CLOVER_GGUF_CACHE_DIR overrides the whole path."""
    override = os.environ.get(ENV_CACHE)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "clover-gguf"


def patches_dir() -> Path:
    """The folder holding the llama.cpp patches shipped with clover-gguf.

    Order of search: $CLOVER_GGUF_PATCHES, the repository's patches/ (clover_gguf/../patches), a copy installed as
    package data (clover_gguf/patches). A missing folder is a packaging bug, reported as a UserError.
    """
    override = os.environ.get(ENV_PATCHES)
    if override:
        p = Path(override).expanduser()
        if not p.is_dir():
            raise UserError(f"{ENV_PATCHES} is not a folder: {p}")
        return p
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "patches", here / "patches"):
        if candidate.is_dir():
            return candidate
    raise UserError(f"cannot find the llama.cpp patches folder (looked in {here.parent / 'patches'})")


def patch_files(folder: Path | None = None) -> list[Path]:
    """Every *.patch in the folder, in the order they are applied (by file name)."""
    folder = patches_dir() if folder is None else Path(folder)
    return sorted((p for p in folder.glob("*.patch") if p.is_file()), key=lambda p: p.name)


# --------------------------------------------------------------------------------------------------------------------
# hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _feed(h: "hashlib._Hash", tag: str, data: bytes) -> None:
    # length-prefixed so that no two different input lists can produce the same byte stream
    h.update(tag.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)


def _patch_bytes(p: Path | bytes) -> bytes:
    return p if isinstance(p, bytes) else Path(p).read_bytes()


def patch_hash(patches: Sequence[Path | bytes] | None = None) -> str:
    """sha256 over the bytes of every patch, in order. Identifies "the current patches" in stamps and doctor().
    Items are patch files or their contents."""
    patches = patch_files() if patches is None else patches
    h = hashlib.sha256()
    for p in patches:
        _feed(h, "patch", _patch_bytes(p))
    return h.hexdigest()


def build_hash(source_id: str, patches: Sequence[Path | bytes], backend: str, options: Sequence[str]) -> str:
    """sha256 over everything that decides what a build contains (patches: files or their contents, in order)."""
    h = hashlib.sha256()
    _feed(h, "recipe", str(RECIPE_VERSION).encode())
    _feed(h, "source", source_id.encode())
    for p in patches:
        _feed(h, "patch", _patch_bytes(p))
    _feed(h, "backend", backend.encode())
    for opt in options:
        _feed(h, "option", opt.encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------------
# cmake options


def cmake_options(backend: str) -> list[str]:
    """The -D options of a build. Part of the build hash, so any change here makes a new cache entry."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    rpath = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        # executables and libraries all land in bin/ and find each other there, wherever bin/ is moved
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        f"-DCMAKE_INSTALL_RPATH={rpath}",
        "-DGGML_NATIVE=ON",
        "-DGGML_BACKEND_DL=OFF",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",  # llama-cli and llama-server live behind this switch in the pinned tree
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download at build time; the server runs without its web UI
        "-DLLAMA_OPENSSL=OFF",  # no network code (LLAMA_CURL is gone from this tree: it is ignored with a warning)
        f"-DLLAMA_BUILD_COMMIT={LLAMA_CPP_COMMIT}",
        "-DLLAMA_BUILD_NUMBER=0",
    ]
    if _is_x86():
        # GGML_NATIVE enables AMX on CPUs that have it (Sapphire Rapids and later), and the pinned tree's AMX matmul
        # segfaults on every quantized type there (seen on a Xeon with amx_tile/amx_int8: Q8_0, Q4_0, Q4_K_M, Q6_K);
        # without AMX the same CPU runs the AVX-512 kernels and the weight repacking as usual
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        opts += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    opts += {
        "cpu": [],
        "cuda": ["-DGGML_CUDA=ON"],
        "metal": ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"],
        "vulkan": ["-DGGML_VULKAN=ON"],
    }[backend]
    return opts


def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def build_targets() -> list[str]:
    return list(LIB_TARGETS) + list(TOOL_TARGETS)


# --------------------------------------------------------------------------------------------------------------------
# source


def fetch_sdist(cache: Path | None = None, quiet: bool = False) -> Path:
    """Path of the verified llama-cpp-python sdist: $CLOVER_GGUF_SDIST, else the cached copy, else pip download."""
    override = os.environ.get(ENV_SDIST)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UserError(f"{ENV_SDIST} does not name a file: {path}")
        verify_sdist(path)
        return path
    folder = (cache or cache_root()) / "sdist"
    target = folder / SDIST_NAME
    if target.is_file():
        verify_sdist(target, hint=f"delete {target} to download it again")
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source from PyPI ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if proc.returncode != 0 or not got.is_file():
            last = _last_nonempty(proc.stderr) or _last_nonempty(proc.stdout) or f"exit code {proc.returncode}"
            raise UserError(
                f"could not download llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with pip: {last} "
                f"(or set {ENV_SDIST}=path/to/{SDIST_NAME})"
            )
        verify_sdist(got)
        os.replace(got, target)
    return target


def verify_sdist(path: Path, hint: str = "") -> None:
    digest = sha256_file(path)
    if digest != SDIST_SHA256:
        extra = f"; {hint}" if hint else ""
        raise UserError(f"sha256 mismatch for {path}: got {digest}, expected {SDIST_SHA256}{extra}")


def extract_llama_source(sdist: Path, dest: Path) -> Path:
    """Extract vendor/llama.cpp of the sdist into dest (created; must not exist). Returns dest."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(SDIST_VENDOR_PREFIX):
                continue
            rel = m.name[len(SDIST_VENDOR_PREFIX) :]
            if not rel:
                continue
            m.name = rel
            members.append(m)
        n = len(members)
        if n == 0:
            raise UserError(f"{sdist} has no {SDIST_VENDOR_PREFIX} folder")
        _safe_extract(tar, members, dest)
    remove_stray_git(dest)
    return dest


def _safe_extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:  # pragma: no cover - only on old Pythons without extraction filters
        target = (dest / m.name).resolve()
        if root not in target.parents and target != root:
            raise UserError(f"refusing to extract {m.name!r}: it leaves the target folder")
        if m.issym() or m.islnk():
            link = (target.parent / m.linkname).resolve()
            if root not in link.parents:
                raise UserError(f"refusing to extract link {m.name!r} -> {m.linkname!r}")
    tar.extractall(dest, members=members)


def remove_stray_git(tree: Path) -> bool:
    """Remove a `.git` *file* (a submodule pointer such as `gitdir: ../../.git/modules/vendor/llama.cpp`) whose
    target does not exist. Left in place it makes git and cmake's build-info treat the tree as a broken repository.
    Returns True when a file was removed. A real .git folder is left alone."""
    marker = Path(tree) / ".git"
    if not marker.is_file() or marker.is_symlink():
        return False
    text = marker.read_text(errors="replace").strip()
    if text.startswith("gitdir:"):
        gitdir = Path(text[len("gitdir:") :].strip())
        if not gitdir.is_absolute():
            gitdir = marker.parent / gitdir
        if gitdir.is_dir():
            return False
    marker.unlink()
    return True


def source_commit(source: Path) -> str:
    """Full commit hash of a user-supplied llama.cpp checkout; it must be the pinned commit."""
    source = Path(source)
    if not (source / "CMakeLists.txt").is_file() or not (source / "include" / "llama.h").is_file():
        raise UserError(f"{source} does not look like a llama.cpp source tree (no CMakeLists.txt / include/llama.h)")
    proc = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise UserError(
            f"{source} is not a git checkout, so its commit cannot be checked; clone llama.cpp and "
            f"`git checkout {LLAMA_CPP_COMMIT}`, or build from the pinned sdist (no --source)"
        )
    commit = proc.stdout.strip()
    if not commit.startswith(LLAMA_CPP_COMMIT):
        raise UserError(f"{source} is at commit {commit[:12]}, the patches need llama.cpp {LLAMA_CPP_COMMIT}")
    dirty = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    if dirty.returncode == 0 and dirty.stdout.strip():
        raise UserError(f"{source} has uncommitted changes; the build must start from a clean {LLAMA_CPP_COMMIT}")
    return commit


def copy_source_tree(source: Path, dest: Path) -> Path:
    """Copy a checkout without its .git and top-level build folders (the user's tree is never modified)."""
    source = Path(source).resolve()

    def ignore(folder: str, names: list[str]) -> list[str]:
        skip = [n for n in names if n == ".git"]
        if Path(folder).resolve() == source:
            skip += [n for n in names if n == "build" or n.startswith("build-")]
        return skip

    shutil.copytree(source, dest, symlinks=True, ignore=ignore)
    return Path(dest)


# --------------------------------------------------------------------------------------------------------------------
# patches


def _git_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # never let git find a repository above the tree (paths in the patch must be relative to the tree itself)
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).resolve().parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def apply_patches(tree: Path, patches: Sequence[Path]) -> None:
    """Apply each patch in order with `git apply`; a patch that does not apply is named in a one-line UserError."""
    if patches and shutil.which("git") is None:
        raise UserError("git is needed to apply the llama.cpp patches: install git")
    env = _git_env(tree)
    for patch in patches:
        patch = Path(patch).resolve()
        for args in (["--check"], []):
            proc = subprocess.run(
                ["git", "apply", *args, "--whitespace=nowarn", str(patch)],
                cwd=tree, env=env, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                raise UserError(
                    f"patch {patch.name} does not apply to llama.cpp {LLAMA_CPP_COMMIT}: {_git_apply_reason(proc.stderr)}"
                )


def _git_apply_reason(stderr: str) -> str:
    """The most useful line of `git apply` errors: the failing file and hunk position."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    failed_at = next((ln for ln in lines if ln.startswith("error: patch failed:")), None)
    detail = next(
        (ln for ln in lines if ln.startswith("error:") and not ln.startswith("error: patch failed:")), None
    )
    if failed_at:
        where = failed_at[len("error: patch failed:") :].strip()  # file:line of the hunk
        return f"hunk at {where} does not match"
    if detail:
        return detail[len("error:") :].strip()
    return lines[-1] if lines else "git apply failed"


# --------------------------------------------------------------------------------------------------------------------
# running cmake


_COMPILER_ERROR = re.compile(r"(?:^|[\s:])(?:fatal )?error[:\s]", re.IGNORECASE)
_PRIORITY = (
    re.compile(r":\d+(?::\d+)?: (?:fatal )?error: "),  # gcc / clang / nvcc  file:line:col: error: ...
    re.compile(r"undefined reference to|ld(?:\.\w+)?: error|collect2: error"),
    re.compile(r"^CMake Error"),
    re.compile(r"^-- Could NOT find|not found", re.IGNORECASE),
)


def last_error_line(log_text: str) -> str:
    """The line of a build log that best explains a failure (the last compiler error, else the last error)."""
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    for pattern in _PRIORITY:
        hits = [ln for ln in lines if pattern.search(ln)]
        if hits:
            return hits[-1].strip() if pattern is not _PRIORITY[0] else _first_of_last_group(lines, pattern)
    hits = [ln for ln in lines if _COMPILER_ERROR.search(ln) and not ln.startswith("ninja: build stopped")]
    if hits:
        return hits[-1].strip()
    return lines[-1].strip() if lines else "no output"


def _first_of_last_group(lines: list[str], pattern: re.Pattern[str]) -> str:
    # the first compiler error of the last failing file is usually the cause; later ones are often follow-ups
    hits = [ln for ln in lines if pattern.search(ln)]
    last_file = hits[-1].split(":", 1)[0]
    for ln in hits:
        if ln.split(":", 1)[0] == last_file:
            return ln.strip()
    return hits[-1].strip()  # pragma: no cover


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def run_logged(cmd: Sequence[str], log_path: Path, what: str, cwd: Path | None = None,
               env: dict[str, str] | None = None, quiet: bool = False) -> None:  # fmt: skip
    """Run a command, append all of its output to log_path, show a progress bar; on failure raise UserError with
    the most useful error line and the log path."""
    bar = None
    with open(log_path, "a", encoding="utf-8", errors="replace", buffering=1) as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", bufsize=1,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if quiet:
                    continue
                bar = _progress(bar, line, what)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if hasattr(bar, "close"):
                bar.close()
    if rc != 0:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
        # only the part of the log that belongs to this command
        text = text[text.rfind(f"$ {' '.join(cmd)}") :]
        raise UserError(f"llama.cpp {what} failed: {last_error_line(text)} (full log: {log_path})")


def _progress(bar, line: str, what: str):
    m = _NINJA_PROGRESS.match(line)
    total, done = None, None
    if m:
        done, total = int(m.group(1)), int(m.group(2))
    else:
        m = _MAKE_PROGRESS.match(line)
        if m:
            done, total = int(m.group(1)), 100
    if total is None:
        return bar
    if not sys.stderr.isatty():
        # logs and pipes: one plain line per 10 %, not a redrawn bar
        decile = done * 10 // max(total, 1)
        if bar is None or decile > bar:
            print(f"{what}: {done}/{total}", file=sys.stderr, flush=True)
            return decile
        return bar
    if bar is None:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=what, unit="step", file=sys.stderr, dynamic_ncols=True)
    if bar.total != total:
        bar.total = total
    bar.n = done
    bar.refresh()
    return bar


def configure_and_build(src: Path, build_dir: Path, backend: str, options: Sequence[str], jobs: int,
                        log_path: Path, quiet: bool = False) -> Path:  # fmt: skip
    """cmake configure + build of the needed targets; returns the folder holding the built binaries."""
    env = dict(os.environ)
    env.pop("CMAKE_ARGS", None)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not quiet:
        print(f"configuring llama.cpp ({backend}) ...", file=sys.stderr)
    run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *options],
               log_path, "configure", env=env, quiet=quiet)  # fmt: skip
    run_logged(
        ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *build_targets()],
        log_path, "build", env=env, quiet=quiet,
    )  # fmt: skip
    return build_dir / "bin"


def _shared_lib_name(base: str) -> str:
    if sys.platform == "win32":
        return f"{base}.dll"
    if sys.platform == "darwin":
        return f"lib{base}.dylib"
    return f"lib{base}.so"


def stage_install(built_bin: Path, stage: Path) -> Path:
    """Copy the shared libraries and tools out of the build tree into stage/bin."""
    bin_dir = stage / "bin"
    bin_dir.mkdir(parents=True)
    wanted_tools = {t + (".exe" if sys.platform == "win32" else "") for t in TOOL_TARGETS}
    lib_re = re.compile(r"^(lib)?[\w.+-]+\.(so(\.\d+)*|dylib|dll)$")
    for item in sorted(Path(built_bin).iterdir()):
        if item.name in wanted_tools or lib_re.match(item.name):
            if item.is_symlink():
                os.symlink(os.readlink(item), bin_dir / item.name)
            elif item.is_file():
                shutil.copy2(item, bin_dir / item.name)
    missing = [n for n in [_shared_lib_name("llama"), _shared_lib_name("ggml"), *sorted(wanted_tools)]
               if not (bin_dir / n).exists()]  # fmt: skip
    if missing:
        raise UserError(f"llama.cpp build finished but did not produce: {', '.join(missing)} (in {built_bin})")
    return bin_dir


# --------------------------------------------------------------------------------------------------------------------
# stamps and the cache


def read_stamp(prefix: Path) -> dict | None:
    try:
        data = json.loads((Path(prefix) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _info_from_stamp(prefix: Path, stamp: dict, cached: bool = False, seconds: float = 0.0) -> BuildInfo:
    return BuildInfo(
        prefix=Path(prefix),
        bin_dir=Path(prefix) / "bin",
        backend=str(stamp.get("backend", "unknown")),
        build_hash=stamp.get("build_hash"),
        patch_hash=stamp.get("patch_hash"),
        source=stamp.get("source"),
        cached=cached,
        seconds=seconds,
    )


def is_complete(prefix: Path, want_hash: str | None = None) -> bool:
    stamp = read_stamp(prefix)
    if stamp is None or stamp.get("complete") is not True:
        return False
    if want_hash is not None and stamp.get("build_hash") != want_hash:
        return False
    return (Path(prefix) / "bin" / _shared_lib_name("llama")).exists()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock so two processes never build the same thing at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _move_into_place(stage: Path, final: Path) -> None:
    """Rename stage to final. An existing final (an older or broken build of ours) is swapped out first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(stage, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_tools(backend: str) -> None:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++", os.environ.get("CXX", "") or "c++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if backend == "cuda" and shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        missing.append("nvcc (the CUDA toolkit)")
    if backend == "vulkan" and shutil.which("glslc") is None:
        missing.append("glslc (the Vulkan SDK shader compiler)")
    if missing:
        raise UserError(f"building llama.cpp needs {', '.join(missing)}: install it and retry")


def build_llama(backend: str = "cpu", jobs: int | None = None, source: Path | str | None = None,
                prefix: Path | str | None = None, quiet: bool = False) -> BuildInfo:  # fmt: skip
    """Build (or find in the cache) the patched llama.cpp for `backend` and return where it is installed."""
    t0 = time.monotonic()
    options = cmake_options(backend)
    # read the patches once: the hash, the stamp and the applied content must agree even if a file changes meanwhile
    patches = patch_files()
    patch_data = [p.read_bytes() for p in patches]
    if jobs is not None and jobs < 1:
        raise UserError(f"jobs must be at least 1, got {jobs}")
    jobs = jobs or os.cpu_count() or 1
    root = cache_root()

    sdist: Path | None = None
    if source is not None:
        source = Path(source).expanduser()
        if not source.is_dir():
            raise UserError(f"--source is not a folder: {source}")
        source_id = f"git:{source_commit(source)}"
    else:
        source_id = f"sdist:{SDIST_SHA256}"  # the sdist itself is fetched (and verified) only if a build is needed

    digest = build_hash(source_id, patch_data, backend, options)
    final = Path(prefix).expanduser().resolve() if prefix is not None else root / f"llama-{digest[:16]}"

    if is_complete(final, digest):
        return _info_from_stamp(final, read_stamp(final) or {}, cached=True, seconds=time.monotonic() - t0)

    if final.exists() and not final.is_dir():
        raise UserError(f"{final} exists and is not a folder")
    if final.exists() and any(final.iterdir()) and read_stamp(final) is None:
        raise UserError(f"{final} exists and is not a clover-gguf llama.cpp build; choose an empty or new folder")

    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / "locks" / f"llama-{digest[:16]}.lock"):
        if is_complete(final, digest):  # another process finished it while we waited
            return _info_from_stamp(final, read_stamp(final) or {}, cached=True, seconds=time.monotonic() - t0)
        _check_tools(backend)
        if source is None:
            sdist = fetch_sdist(root, quiet=quiet)
        final.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(final.parent).free
        if free < BUILD_DISK_BYTES:
            raise UserError(
                f"not enough disk space in {final.parent} to build llama.cpp: need about "
                f"{BUILD_DISK_BYTES / 2**30:.0f} GiB, {free / 2**30:.2f} GiB free"
            )
        logs = root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"llama-{digest[:16]}.log"
        log_path.write_text(
            f"clover-gguf llama.cpp build {digest}\nsource: {source_id}\nbackend: {backend}\n"
            f"patches: {', '.join(p.name for p in patches) or '(none)'}\n"
        )
        # the work folder sits beside the final one so the last step is a same-file-system rename
        work = Path(tempfile.mkdtemp(prefix=f".work-llama-{digest[:12]}-", dir=final.parent))
        try:
            src = work / "src"
            if not quiet:
                print(f"preparing llama.cpp {LLAMA_CPP_COMMIT} with {len(patches)} patch(es) ...", file=sys.stderr)
            if sdist is not None:
                extract_llama_source(sdist, src)
            else:
                copy_source_tree(Path(source), src)  # type: ignore[arg-type]
            snapshot = work / "patches"
            snapshot.mkdir()
            for p, data in zip(patches, patch_data):
                (snapshot / p.name).write_bytes(data)
            apply_patches(src, [snapshot / p.name for p in patches])
            built_bin = configure_and_build(src, work / "build", backend, options, jobs, log_path, quiet=quiet)
            stage = work / "install"
            stage_install(built_bin, stage)
            shutil.copy2(log_path, stage / "build.log")
            stamp = {
                "complete": True,
                "build_hash": digest,
                "patch_hash": patch_hash(patch_data),
                "patches": [p.name for p in patches],
                "backend": backend,
                "source": source_id,
                "llama_cpp_commit": LLAMA_CPP_COMMIT,
                "cmake_options": options,
                "targets": build_targets(),
                "recipe": RECIPE_VERSION,
                "created": time.time(),
                "build_seconds": round(time.monotonic() - t0, 1),
            }
            (stage / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")  # written last
            _move_into_place(stage, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - t0
    if not quiet:
        print(f"llama.cpp installed in {final / 'bin'} ({seconds / 60:.1f} min)", file=sys.stderr)
    return _info_from_stamp(final, read_stamp(final) or {}, cached=False, seconds=seconds)


# --------------------------------------------------------------------------------------------------------------------
# finding a build


def _info_for_lib_dir(lib_dir: Path) -> BuildInfo:
    lib_dir = Path(lib_dir)
    for prefix in (lib_dir.parent, lib_dir):
        stamp = read_stamp(prefix)
        if stamp is not None and (prefix / "bin").resolve() == lib_dir.resolve():
            return _info_from_stamp(prefix, stamp)
    return BuildInfo(prefix=lib_dir, bin_dir=lib_dir, backend="unknown", build_hash=None, patch_hash=None, source=None)


def cached_builds(root: Path | None = None) -> list[BuildInfo]:
    """Every complete build in the cache, newest first."""
    root = cache_root() if root is None else root
    found = []
    for prefix in root.glob("llama-*"):
        if prefix.is_dir() and is_complete(prefix):
            stamp = read_stamp(prefix) or {}
            found.append((float(stamp.get("created", 0.0)), _info_from_stamp(prefix, stamp)))
    found.sort(key=lambda x: x[0], reverse=True)
    return [info for _, info in found]


def find_library(backend: str | None = None) -> BuildInfo | None:
    """The llama.cpp build to run: the folder in $LLAMA_CPP_LIB_PATH if set (None when it holds no libllama), else
    the newest complete cached build made from the current patches (of `backend`, when given)."""
    override = os.environ.get(ENV_LIB_PATH)
    if override:
        lib_dir = Path(override).expanduser()
        if not (lib_dir / _shared_lib_name("llama")).exists():
            return None
        return _info_for_lib_dir(lib_dir)
    try:
        current = patch_hash()
    except UserError:
        return None
    for info in cached_builds():
        if info.patch_hash == current and (backend is None or info.backend == backend):
            return info
    return None


# --------------------------------------------------------------------------------------------------------------------
# the Python binding


def binding_version() -> str | None:
    """Installed llama-cpp-python version (from package metadata: importing llama_cpp would load a library)."""
    for name in ("llama_cpp_python", "llama-cpp-python"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def binding_env(info: BuildInfo) -> dict[str, str]:
    """Environment that makes `import llama_cpp` load this build's libllama."""
    return {ENV_LIB_PATH: str(info.lib_dir)}


def extract_binding_source(sdist: Path, dest: Path) -> Path:
    """Extract the sdist without vendor/ (the binding is pure Python when LLAMA_BUILD=OFF). Returns the root."""
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(top) and not m.name.startswith(top + "vendor/")]
        _safe_extract(tar, members, Path(dest))
    return Path(dest) / top.rstrip("/")


def install_binding(info: BuildInfo | None = None, python: str | None = None, quiet: bool = False,
                    force: bool = False) -> str:  # fmt: skip
    """Install llama-cpp-python 0.3.36 into `python` (default: this interpreter) without compiling llama.cpp, and
    check that it imports against `info`'s library. Returns the installed version. A no-op when 0.3.36 is there."""
    here = python is None
    python = python or sys.executable
    installed = _binding_version_of(None if here else python)
    if installed != LLAMA_CPP_PYTHON_VERSION or force:
        sdist = fetch_sdist(quiet=quiet)
        if not quiet:
            print(f"installing llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (no llama.cpp compile) ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="clover-binding-") as tmp:
            root = extract_binding_source(sdist, Path(tmp))
            env = dict(os.environ)
            env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF"
            cmd = [python, "-m", "pip", "install", "--no-cache-dir", *(["--force-reinstall", "--no-deps"] if force else []),
                   str(root)]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                reason = last_error_line(proc.stderr + proc.stdout)
                raise UserError(f"pip could not install llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}: {reason}")
        installed = _binding_version_of(None if here else python)
        if installed != LLAMA_CPP_PYTHON_VERSION:
            raise UserError(f"llama-cpp-python install finished but reports version {installed}")
    if info is not None:
        check_binding(info, python)
    return installed  # type: ignore[return-value]


def _binding_version_of(python: str | None) -> str | None:
    """Version of llama-cpp-python in `python` (None: this interpreter)."""
    if python is None:
        importlib.invalidate_caches()
        return binding_version()
    code = "import importlib.metadata as m\ntry: print(m.version('llama_cpp_python'))\nexcept Exception: print('')"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or None


def check_binding(info: BuildInfo, python: str | None = None) -> None:
    """Import llama_cpp in a fresh interpreter against the build's library; UserError when it fails."""
    env = dict(os.environ)
    env.update(binding_env(info))
    code = "import llama_cpp; llama_cpp.llama_backend_init(); print(llama_cpp.__version__)"
    proc = subprocess.run([python or sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"llama_cpp does not load {info.libllama}: {_last_nonempty(proc.stderr)}")


# --------------------------------------------------------------------------------------------------------------------
# doctor


def doctor() -> dict:
    """What the runtime would use, and what is missing. Never raises for a missing piece: it lists it."""
    missing: list[str] = []
    warnings: list[str] = []
    try:
        current = patch_hash()
    except UserError as e:
        current = None
        missing.append(str(e))

    info = find_library()
    override = os.environ.get(ENV_LIB_PATH)
    if info is None:
        if override:
            missing.append(f"{ENV_LIB_PATH}={override} holds no {_shared_lib_name('llama')}")
        else:
            stale = cached_builds()
            if stale:
                missing.append(
                    f"the cached llama.cpp build(s) were made from other patches (newest: {stale[0].prefix}); "
                    "run `clover-gguf build-llama`"
                )
            else:
                missing.append("no llama.cpp build found: run `clover-gguf build-llama`")
    else:
        if info.patch_hash is None:
            warnings.append(f"{info.lib_dir} was not built by clover-gguf: its patches cannot be checked")
        elif current is not None and info.patch_hash != current:
            missing.append(f"the library in {info.lib_dir} was built from other patches: run `clover-gguf build-llama`")
        for tool in TOOL_TARGETS:
            if not info.tool(tool).exists():
                (missing if tool in ("llama-quantize", "llama-cli") else warnings).append(
                    f"{tool} not found in {info.bin_dir}"
                )
        try:
            ctypes.CDLL(str(info.libllama))
        except OSError as e:
            missing.append(f"{info.libllama} does not load: {e}")

    version = binding_version()
    if version is None:
        missing.append(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} is not installed: run `clover-gguf build-llama`")
    elif version != LLAMA_CPP_PYTHON_VERSION:
        missing.append(f"llama-cpp-python is {version}, clover-gguf needs {LLAMA_CPP_PYTHON_VERSION}")

    return {
        "ok": not missing,
        "library_path": str(info.lib_dir) if info else None,
        "bin_dir": str(info.bin_dir) if info else None,
        "backend": info.backend if info else None,
        "patch_hash": info.patch_hash if info else None,
        "current_patch_hash": current,
        "build_hash": info.build_hash if info else None,
        "source": info.source if info else None,
        "binding_version": version,
        "cache_dir": str(cache_root()),
        "missing": missing,
        "warnings": warnings,
    }


# --------------------------------------------------------------------------------------------------------------------


def _last_nonempty(text: str | None) -> str:
    for line in reversed((text or "").splitlines()):
        if line.strip():
            return line.strip()
    return ""
