"""Build the patched llama.cpp that Clover runs on, cache it, and point llama-cpp-python at it.

The pinned source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist (commit 0c1e57098), verified
before anything reads it (llama_sdist.py). Every patches/*.patch is applied in name order (none for
`patched=False`), then cmake builds the shared libraries and the tools into

    <cache>/clover-gguf/llama-<hash>/bin/      (libllama, libggml*, llama-server, ggml-rpc-server, ...; rpath $ORIGIN)
    <cache>/clover-gguf/llama-<hash>/clover-build.json

where <hash> covers everything that changes the binary: the source, the bytes of every patch, the sources of our
selection sampler (clover_gguf/csrc: libclover_sampler, built beside libllama against its public headers), the
backend, the cmake options (CUDA architectures included) and the host (CPU features, since the build is native; the
compilers and their versions). A change of the sampler alone reuses the llama.cpp binaries of a cached build with the
same llama.cpp hash and rebuilds only the sampler (seconds). The stamp is written last and the folder renamed into place, so a folder with a matching stamp is always
complete. docs/build.md explains the choices. Everything here is a plain function; the CLI wires them up.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import errno
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from clover_gguf.errors import UserError
from clover_gguf.llama_sdist import (
    LLAMA_CPP_PYTHON_VERSION,
    PINNED,
    Source,
    _sha256_of,
    extract_binding_source,
    extract_llama_headers,
    extract_llama_source,
    fetch_sdist,
)
from clover_gguf.llama_sdist import source as llama_source

BACKENDS = ("cpu", "cuda", "metal", "vulkan")
LIB_TARGETS = ("llama", "ggml")
# Only the tools something here runs (tests, bench, the runtime, the docs): each one adds compile time on 2 cores.
# ggml-rpc-server is the pinned tree's name for upstream's rpc-server; test-llama-archs is llama.cpp's own test of
# every architecture (run by tests/test_llama_archs.py).
TOOL_TARGETS = (
    "llama-cli",
    "llama-server",
    "llama-quantize",
    "llama-imatrix",
    "llama-fit-params",
    "ggml-rpc-server",
    "test-llama-archs",
    "llama-bench",  # bench/host.py: llama.cpp's own token rate beside the runtime's
)
# CUDA architectures of a build when no NVIDIA GPU is visible (a build for another machine): machine code for the
# RTX 30 (86) and RTX 40 (89) cards, PTX that the driver compiles on first run for Turing (75), Ampere (80), Hopper
# and later (90, Blackwell included). `--cuda-arch` overrides it; with a GPU present its own architecture is used.
DEFAULT_CUDA_ARCHS = "75-virtual;80-virtual;86-real;89-real;90-virtual"
STAMP_NAME = "clover-build.json"
# Bump when the way a build is made changes in a way the cmake options do not show (file layout, stamp format).
RECIPE_VERSION = 4  # 3: llama-bench among the tools; 4: the selection sampler library beside libllama
# Rough size of a CPU build tree (sources + objects + install); checked before starting.
BUILD_DISK_BYTES = 2 * 2**30

# our selection sampler (clover_gguf/csrc/clover_sampler.h): its sources and the library it builds
SAMPLER_DIR = Path(__file__).resolve().parent / "csrc"
SAMPLER_LIB = "clover_sampler"
SAMPLER_TEST = "clover-sampler-test"  # its contract with llama.cpp's sampler interface (tests/test_sampler_lib.py)

ENV_CACHE = "CLOVER_GGUF_CACHE_DIR"
ENV_PATCHES = "CLOVER_GGUF_PATCHES"
ENV_BACKEND = "CLOVER_GGUF_BACKEND"
ENV_LIB_PATH = "LLAMA_CPP_LIB_PATH"
ENV_SOURCE = "CLOVER_GGUF_SOURCE"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """One installed llama.cpp build."""

    prefix: Path  # install folder (holds bin/ and the stamp)
    bin_dir: Path  # tools and shared libraries
    backend: str  # cpu | cuda | metal | vulkan | unknown
    build_hash: str | None  # None for a library not built by us (LLAMA_CPP_LIB_PATH without a stamp)
    patch_hash: str | None
    source: str | None  # "sdist:<sha256>"
    cpu: str | None = None  # cpu_key() of the machine it was built for
    sampler_hash: str | None = None  # sampler_hash() of the sampler sources it was built with
    created: float = 0.0
    cached: bool = False  # True when build_llama found it already built
    seconds: float = 0.0  # wall time of build_llama
    chosen: str = ""  # why find_library picked it

    @property
    def lib_dir(self) -> Path:
        """The folder to put in LLAMA_CPP_LIB_PATH (it holds libllama)."""
        return self.bin_dir

    @property
    def libllama(self) -> Path:
        return self.bin_dir / _shared_lib_name("llama")

    @property
    def sampler_lib(self) -> Path:
        """libclover_sampler, beside libllama."""
        return self.bin_dir / _shared_lib_name(SAMPLER_LIB)

    def tool(self, name: str) -> Path:
        return self.bin_dir / _exe(name)


# --------------------------------------------------------------------------------------------------------------------
# locations


def cache_root() -> Path:
    """<user cache>/clover-gguf; CLOVER_GGUF_CACHE_DIR overrides the whole path."""
    override = os.environ.get(ENV_CACHE)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "clover-gguf"


def writable_cache_root() -> Path:
    """cache_root(), made when missing, for a command that writes into it; one line when it cannot be (a file there,
    a read-only home)."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e
        raise UserError(f"cannot use {root} for clover-gguf's cache ({why}): set {ENV_CACHE} to a writable "
                        "folder") from None
    return root


def patches_dir() -> Path:
    """The folder holding the llama.cpp patches shipped with clover-gguf.

    Order of search: $CLOVER_GGUF_PATCHES, the package's own copy (clover_gguf/patches: package data in an install, a
    link to the repository's patches/ in a checkout), the repository's patches/. A missing folder is a UserError.
    """
    override = os.environ.get(ENV_PATCHES)
    if override:
        p = Path(override).expanduser()
        if not p.is_dir():
            raise UserError(f"{ENV_PATCHES} is not a folder: {p}")
        return p
    here = Path(__file__).resolve().parent
    for candidate in (here / "patches", here.parent / "patches"):
        if candidate.is_dir():
            return candidate
    raise UserError(f"cannot find the llama.cpp patches folder (looked in {here / 'patches'})")


def chosen_source() -> Source:
    """The llama.cpp source a run uses: $CLOVER_GGUF_SOURCE (a llama_sdist.SOURCES name), else the pinned one."""
    return llama_source(os.environ.get(ENV_SOURCE) or None)


def no_library_reason() -> str:
    """Why find_library found nothing, in one line that says what to run: $CLOVER_GGUF_SOURCE naming no known source,
    or a source that was never built (the hint names it: build-llama without --source builds the pinned one)."""
    named = os.environ.get(ENV_SOURCE)
    if named:
        try:
            src = llama_source(named)
        except UserError as e:
            return f"{ENV_SOURCE}={named}: {e} (or unset {ENV_SOURCE} for the pinned one)"
        if src.name != llama_source(None).name:
            return (f"no patched llama.cpp library of the source {src.name} ({ENV_SOURCE}) found: run `clover-gguf "
                    f"build-llama --source {src.name}`, or unset {ENV_SOURCE} for the pinned one")
    return "no patched llama.cpp library found: run `clover-gguf build-llama` (or `make llama`)"


def patch_files(folder: Path | None = None, source: str | None = None) -> list[Path]:
    """Every *.patch in the folder, in the order they are applied (by file name), for the llama.cpp source `source`
    (a llama_sdist.SOURCES name; None: chosen_source()): a patch the folder's <source>/ subfolder holds under the
    same name replaces the series' own (the ones whose lines differ between trees, docs/llama-cpp-patch.md)."""
    folder = patches_dir() if folder is None else Path(folder)
    src = chosen_source() if source is None else llama_source(source)
    series = sorted((p for p in folder.glob("*.patch") if p.is_file()), key=lambda p: p.name)
    own = folder / src.name
    return [own / p.name if (own / p.name).is_file() else p for p in series]


# --------------------------------------------------------------------------------------------------------------------
# hashing


def _feed(h: "hashlib._Hash", tag: str, data: bytes) -> None:
    # length-prefixed so that no two different input lists can produce the same byte stream
    h.update(tag.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)


def _patch_bytes(p: Path | bytes) -> bytes:
    return p if isinstance(p, bytes) else Path(p).read_bytes()


def patch_hash(patches: Sequence[Path | bytes] | None = None) -> str:
    """sha256 over the bytes of every patch, in order. Identifies "the current patches" in stamps and doctor().
    Items are patch files or their contents; an empty list identifies an unpatched build."""
    patches = patch_files() if patches is None else patches
    h = hashlib.sha256()
    for p in patches:
        _feed(h, "patch", _patch_bytes(p))
    return h.hexdigest()


def sampler_files(folder: Path | None = None) -> list[Path]:
    """The selection sampler's sources (CMakeLists.txt, *.h, *.cpp), by name."""
    folder = SAMPLER_DIR if folder is None else Path(folder)
    return sorted((p for p in folder.iterdir() if p.is_file() and (p.name == "CMakeLists.txt" or
                                                                    p.suffix in (".h", ".cpp"))),
                  key=lambda p: p.name)  # fmt: skip


def sampler_hash(folder: Path | None = None) -> str:
    """sha256 over the sampler's sources (names and bytes): part of the build hash and of the stamp."""
    files = sampler_files(folder)
    if not files:
        raise UserError(f"cannot find the selection sampler's sources (looked in {folder or SAMPLER_DIR})")
    h = hashlib.sha256()
    for p in files:
        _feed(h, "name", p.name.encode())
        _feed(h, "file", p.read_bytes())
    return h.hexdigest()


def build_hash(source_id: str, patches: Sequence[Path | bytes], backend: str, options: Sequence[str],
               host: dict[str, str], sampler: str = "") -> str:  # fmt: skip
    """sha256 over everything that decides what a build contains (patches: files or their contents, in order;
    sampler: sampler_hash(), "" for the llama.cpp part alone)."""
    h = hashlib.sha256()
    _feed(h, "recipe", str(RECIPE_VERSION).encode())
    _feed(h, "source", source_id.encode())
    for p in patches:
        _feed(h, "patch", _patch_bytes(p))
    _feed(h, "backend", backend.encode())
    for opt in options:
        _feed(h, "option", opt.encode())
    _feed(h, "host", json.dumps(host, sort_keys=True).encode())
    if sampler:
        _feed(h, "sampler", sampler.encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------------
# the host: what besides the options changes the binary


def _output(cmd: Sequence[str]) -> str:
    """stdout of a short probe command; "" when it is missing or fails."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def cpu_key() -> str:
    """The CPU a native build (GGML_NATIVE, i.e. -march=native) is compiled for: OS, architecture and a digest of the
    instruction-set features (the flags of /proc/cpuinfo on Linux, sysctl on macOS)."""
    features = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                features = " ".join(sorted(value.split()))
                break
    if not features and sys.platform == "darwin":
        features = _output(["sysctl", "hw.optional", "machdep.cpu"])
    digest = hashlib.sha256((features or platform.processor()).encode()).hexdigest()[:16]
    return f"{sys.platform}-{platform.machine().lower()}-{digest}"


def _tool_version(env: str, name: str, last_line: bool = False) -> str:
    """"<real path> <version line>" of the program cmake would use ($env names it, else `name` on PATH), or ""."""
    path = shutil.which(os.environ.get(env) or name) or shutil.which(name, path="/usr/local/cuda/bin")
    if path is None:
        return ""
    lines = _output([path, "--version"]).splitlines() or [""]
    return f"{os.path.realpath(path)} {lines[-1] if last_line else lines[0]}".strip()


def host_key(backend: str) -> dict[str, str]:
    """The machine's part of the build hash: the CPU (the build is native), the C and C++ compilers with their
    versions, and the backend's own compiler (nvcc, glslc). An empty compiler entry means it is missing."""
    key = {"cpu": cpu_key(), "cc": _tool_version("CC", "cc"), "cxx": _tool_version("CXX", "c++")}
    if backend == "cuda":
        key["nvcc"] = _tool_version("CUDACXX", "nvcc", last_line=True)
    if backend == "vulkan":
        key["glslc"] = _tool_version("GLSLC", "glslc")
    return key


def nvidia_compute_caps() -> list[str]:
    """CUDA architectures of the GPUs nvidia-smi sees ("8.6" -> "86"), unique and sorted; [] without one."""
    out = _output(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    caps = {ln.strip().replace(".", "") for ln in out.splitlines() if re.fullmatch(r"\d+\.\d+", ln.strip())}
    return sorted(caps, key=int)


def cuda_architectures(requested: str | None = None) -> str:
    """CMAKE_CUDA_ARCHITECTURES of a CUDA build: `requested` ("86;89" or "86,89"), else the GPUs present, else
    DEFAULT_CUDA_ARCHS, so that a machine without a GPU still configures."""
    if not requested:
        return ";".join(nvidia_compute_caps()) or DEFAULT_CUDA_ARCHS
    archs = [a for a in re.split(r"[;,\s]+", requested) if a]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?(-real|-virtual)?", a)]
    if bad or not archs:
        raise UserError(f"--cuda-arch {requested!r}: give CUDA architectures such as 86 or 75-virtual;86;89")
    return ";".join(archs)


def gpu_present(backend: str) -> bool:
    """Whether the device a GPU backend runs on is here: a GPU nvidia-smi sees (cuda), macOS (metal), a DRI render
    node or Windows (vulkan)."""
    if backend == "cuda":
        return bool(nvidia_compute_caps())
    if backend == "metal":
        return sys.platform == "darwin"
    if backend == "vulkan":
        return sys.platform == "win32" or any(Path("/dev/dri").glob("renderD*"))
    return False


# --------------------------------------------------------------------------------------------------------------------
# cmake options


def cmake_options(backend: str, cuda_arch: str | None = None, system: str = sys.platform,
                  machine: str = platform.machine(), commit: str = PINNED.commit) -> list[str]:  # fmt: skip
    """The -D options of a build (commit: the source's, LLAMA_BUILD_COMMIT). Part of the build hash, so any change
    here makes a new cache entry."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if cuda_arch and backend != "cuda":
        raise UserError(f"--cuda-arch is for --backend cuda, not {backend}")
    rpath = "@loader_path" if system == "darwin" else "$ORIGIN"
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        # executables and libraries all land in bin/ and find each other there, wherever bin/ is moved
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        f"-DCMAKE_INSTALL_RPATH={rpath}",
        "-DGGML_NATIVE=ON",
        "-DGGML_BACKEND_DL=OFF",
        "-DGGML_RPC=ON",  # the RPC backend (in libggml) and ggml-rpc-server: layers on other machines
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",  # llama-cli and llama-server live behind this switch in the pinned tree
        "-DLLAMA_BUILD_TESTS=ON",  # for test-llama-archs; only the targets below are compiled
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download at build time; the server runs without its web UI
        "-DLLAMA_OPENSSL=OFF",  # no network code (LLAMA_CURL is gone from this tree: it is ignored with a warning)
        f"-DLLAMA_BUILD_COMMIT={commit}",
        "-DLLAMA_BUILD_NUMBER=0",
    ]
    if machine.lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        # GGML_NATIVE enables AMX on CPUs that have it (Sapphire Rapids and later), and the pinned tree's AMX matmul
        # segfaults on every quantized type there (seen on a Xeon with amx_tile/amx_int8: Q8_0, Q4_0, Q4_K_M, Q6_K);
        # without AMX the same CPU runs the AVX-512 kernels and the weight repacking as usual
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        opts += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    opts += {
        "cpu": [],
        "cuda": ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures(cuda_arch)}"],
        "metal": ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"],
        "vulkan": ["-DGGML_VULKAN=ON"],
    }[backend]
    if system == "darwin" and backend != "metal":
        opts.append("-DGGML_METAL=OFF")  # on by default on macOS: the backend asked for is the only one built
    return opts


def build_targets() -> list[str]:
    return list(LIB_TARGETS) + list(TOOL_TARGETS)


# --------------------------------------------------------------------------------------------------------------------
# patches


def apply_patches(tree: Path, patches: Sequence[Path], include: Sequence[str] = (), src: Source = PINNED) -> None:
    """Apply each patch in order with `git apply`; a patch that does not apply is named in a one-line UserError.
    include: only the files matching these globs (git apply --include), for a part of the tree."""
    if patches and shutil.which("git") is None:
        raise UserError("git is needed to apply the llama.cpp patches: install git")
    env = dict(os.environ)
    # never let git find a repository above the tree (paths in the patch must be relative to the tree itself)
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).resolve().parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    for patch in patches:
        patch = Path(patch).resolve()
        for args in (["--check"], []):
            proc = subprocess.run(
                ["git", "apply", *args, *(f"--include={g}" for g in include), "--whitespace=nowarn", str(patch)],
                cwd=tree, env=env, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                reason = _git_apply_reason(proc.stderr)
                raise UserError(f"patch {patch.name} does not apply to llama.cpp {src.commit}: {reason}")


def _git_apply_reason(stderr: str) -> str:
    """The most useful line of `git apply` errors: the failing file and hunk position."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    failed_at = next((ln for ln in lines if ln.startswith("error: patch failed:")), None)
    if failed_at:
        return f"hunk at {failed_at[len('error: patch failed:') :].strip()} does not match"  # file:line of the hunk
    detail = next((ln for ln in lines if ln.startswith("error:")), None)
    if detail:
        return detail[len("error:") :].strip()
    return lines[-1] if lines else "git apply failed"


# --------------------------------------------------------------------------------------------------------------------
# running cmake


# a compiler's `file:line:col: error:`, a linker's, cmake's; the first one in a log is the cause, later ones often
# follow from it (or from the other jobs of a parallel build stopping)
_ERROR_LINE = re.compile(r":\d+(?::\d+)?: (?:fatal )?error: |undefined reference to|ld(?:\.\w+)?: error|^CMake Error|"
                         r"(?:^|\s)(?:fatal )?error:", re.IGNORECASE)  # fmt: skip


def last_error_line(log_text: str) -> str:
    """The line of a build log that best explains a failure: its first error line, else its last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    return next((ln for ln in lines if _ERROR_LINE.search(ln)), lines[-1] if lines else "no output")


_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def run_logged(cmd: Sequence[str], log_path: Path, what: str, cwd: Path | None = None,
               env: dict[str, str] | None = None, quiet: bool = False) -> None:  # fmt: skip
    """Run a command, append all of its output to log_path, show its progress; on failure raise UserError with the
    most useful error line and the log path."""
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
                if not quiet:
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
        text = text[text.rfind(f"$ {' '.join(cmd)}") :]  # only the part of the log that belongs to this command
        raise UserError(f"llama.cpp {what} failed: {last_error_line(text)} (full log: {log_path})")


def _progress(bar, line: str, what: str):
    """Progress of a build from ninja's [n/total] (or make's [ p%]) lines: a tqdm bar on a terminal, else one plain
    `what: n/total` line per tenth, so that logs and `make test` show it too. Returns the new state."""
    m = _NINJA_PROGRESS.match(line) or _MAKE_PROGRESS.match(line)
    if m is None:
        return bar
    done, total = int(m.group(1)), int(m.group(2)) if m.re is _NINJA_PROGRESS else 100
    if not sys.stderr.isatty():
        tenth = done * 10 // max(total, 1)
        if bar is None or tenth > bar:
            print(f"llama.cpp {what}: {done}/{total}", file=sys.stderr, flush=True)
            return tenth
        return bar
    if bar is None:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"llama.cpp {what}", unit="step", file=sys.stderr, dynamic_ncols=True)
    bar.total, bar.n = total, done
    bar.refresh()
    return bar


def configure_and_build(src: Path, build_dir: Path, backend: str, options: Sequence[str], jobs: int,
                        log_path: Path, quiet: bool = False, targets: Sequence[str] | None = None) -> Path:  # fmt: skip
    """cmake configure + build of `targets` (default: build_targets()); returns the folder holding the built
    binaries. The GPU check (bench/device) builds fewer targets with the same options."""
    env = dict(os.environ)
    env.pop("CMAKE_ARGS", None)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not quiet:
        print(f"configuring llama.cpp ({backend}) ...", file=sys.stderr)
    run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *options],
               log_path, "configure", env=env, quiet=quiet)  # fmt: skip
    targets = list(targets or build_targets())
    run_logged(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *targets],
               log_path, "build", env=env, quiet=quiet)  # fmt: skip
    return build_dir / "bin"


def build_sampler(llama_src: Path, lib_dir: Path, build_dir: Path, log_path: Path, backend: str = "cpu",
                  quiet: bool = False, sources: Path | None = None) -> Path:  # fmt: skip
    """Build libclover_sampler (clover_gguf/csrc) against a llama.cpp tree's public headers (llama_src: include/ and
    ggml/include/ are enough) and the libllama / libggml-base in lib_dir, into lib_dir. Returns the library."""
    env = dict(os.environ)
    env.pop("CMAKE_ARGS", None)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not quiet:
        print(f"building the selection sampler ({backend}) ...", file=sys.stderr)
    run_logged(["cmake", "-S", str(sources or SAMPLER_DIR), "-B", str(build_dir), *generator,
                "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_SOURCE_DIR={Path(llama_src).resolve()}",
                f"-DLLAMA_LIB_DIR={Path(lib_dir).resolve()}", f"-DCLOVER_SAMPLER_OUT_DIR={Path(lib_dir).resolve()}"],
               log_path, "sampler configure", env=env, quiet=quiet)  # fmt: skip
    run_logged(["cmake", "--build", str(build_dir), "--config", "Release"], log_path, "sampler build", env=env,
               quiet=quiet)  # fmt: skip
    lib = Path(lib_dir) / _shared_lib_name(SAMPLER_LIB)
    if not lib.is_file():
        raise UserError(f"the selection sampler build finished but did not produce {lib} (full log: {log_path})")
    return lib


def _exe(name: str) -> str:
    return name + (".exe" if sys.platform == "win32" else "")


def _shared_lib_name(base: str) -> str:
    if sys.platform == "win32":
        return f"{base}.dll"
    if sys.platform == "darwin":
        return f"lib{base}.dylib"
    return f"lib{base}.so"


def stage_install(built_bin: Path, stage: Path) -> Path:
    """Move the build tree's bin/ (only the targets built: the libraries and the tools) to stage/bin.

    Not `cmake --install`: it installs every target that has an install rule (all ~20 tools; the tests too with
    LLAMA_TESTS_INSTALL) and stops at the first one not built, and building them all would not fit CI's budget."""
    bin_dir = Path(stage) / "bin"
    bin_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(built_bin, bin_dir)
    names = [_shared_lib_name("llama"), _shared_lib_name("ggml"), _shared_lib_name(SAMPLER_LIB), _exe(SAMPLER_TEST),
             *map(_exe, TOOL_TARGETS)]
    missing = [n for n in names if not (bin_dir / n).exists()]
    if missing:
        raise UserError(f"llama.cpp build finished but did not produce: {', '.join(missing)} (in {bin_dir})")
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
        cpu=(stamp.get("host") or {}).get("cpu"),
        sampler_hash=stamp.get("sampler_hash"),
        created=float(stamp.get("created", 0.0)),
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
def _lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive advisory lock, held while the block runs. Yields True when held; with wait=False, False at once
    when another process holds it (also where locks are unsupported: nothing can then be shown to be unused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield wait
            return
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True  # closing the file releases the lock


def remove_stale_work(folder: Path, root: Path) -> list[Path]:
    """Remove the work folders (.work-llama-<key>-*) of builds that were killed. A build holds locks/llama-<key>.lock
    while its work folder exists, so a folder whose lock nobody holds is stale. Returns the removed folders."""
    removed = []
    for work in sorted(Path(folder).glob(".work-llama-*")):
        key = work.name[len(".work-llama-") :].split("-")[0]
        locks = (root / "locks").glob(f"llama-{key}*.lock")  # also the longer names of older versions
        with contextlib.ExitStack() as held:
            if key and all(held.enter_context(_lock(p, wait=False)) for p in locks):
                shutil.rmtree(work, ignore_errors=True)
                removed.append(work)
    return removed


def _move_into_place(stage: Path, final: Path) -> None:
    """Rename stage to final, replacing an older or broken build of ours there."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(stage, final)


_TOOL_NAMES = {"cxx": "a C++ compiler (g++ or clang++)", "nvcc": "nvcc (the CUDA toolkit)",
               "glslc": "glslc (the Vulkan SDK shader compiler)"}  # fmt: skip


def _check_tools(backend: str, host: dict[str, str]) -> None:
    missing = [] if shutil.which("cmake") else ["cmake"]
    missing += [what for key, what in _TOOL_NAMES.items() if key in host and not host[key]]
    if missing:
        raise UserError(f"building llama.cpp ({backend}) needs {', '.join(missing)}: install it and retry")


def build_llama(backend: str = "cpu", jobs: int | None = None, prefix: Path | str | None = None, quiet: bool = False,
                cuda_arch: str | None = None, patched: bool = True, source: str | None = None) -> BuildInfo:  # fmt: skip
    """Build (or find in the cache) llama.cpp for `backend` and return where it is installed. patched=False builds
    the tree without our patches (its own cache entry; find_library never picks it unless asked). source: the
    llama.cpp tree (a llama_sdist.SOURCES name; None: chosen_source(), the pinned one unless $CLOVER_GGUF_SOURCE
    names another)."""
    t0 = time.monotonic()
    src = chosen_source() if source is None else llama_source(source)
    options = cmake_options(backend, cuda_arch, commit=src.commit)
    host = host_key(backend)
    # read the patches once: the hash, the stamp and the applied content must agree even if a file changes meanwhile
    patches = patch_files(source=src.name) if patched else []
    patch_data = [p.read_bytes() for p in patches]
    sampler = sampler_hash()
    if jobs is not None and jobs < 1:
        raise UserError(f"jobs must be at least 1, got {jobs}")
    jobs = jobs or os.cpu_count() or 1
    root = writable_cache_root()
    source_id = source_id_of(src)  # the sdist itself is fetched (and verified) only if a build is needed
    llama_digest = build_hash(source_id, patch_data, backend, options, host)  # the llama.cpp part alone
    digest = build_hash(source_id, patch_data, backend, options, host, sampler=sampler)
    key = digest[:16]
    final = Path(prefix).expanduser().resolve() if prefix is not None else root / f"llama-{key}"
    remove_stale_work(final.parent, root)
    if is_complete(final, digest):
        return _info_from_stamp(final, read_stamp(final) or {}, cached=True, seconds=time.monotonic() - t0)

    if final.exists() and not final.is_dir():
        raise UserError(f"{final} exists and is not a folder")
    if final.exists() and any(final.iterdir()) and read_stamp(final) is None:
        raise UserError(f"{final} exists and is not a clover-gguf llama.cpp build; choose an empty or new folder")

    with _lock(root / "locks" / f"llama-{key}.lock"):
        if is_complete(final, digest):  # another process finished it while we waited
            return _info_from_stamp(final, read_stamp(final) or {}, cached=True, seconds=time.monotonic() - t0)
        _check_tools(backend, host)
        sdist = fetch_sdist(root / "sdist", quiet=quiet, src=src)
        final.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(final.parent).free
        if free < BUILD_DISK_BYTES:
            raise UserError(
                f"not enough disk space in {final.parent} to build llama.cpp: need about "
                f"{BUILD_DISK_BYTES / 2**30:.0f} GiB, {free / 2**30:.2f} GiB free"
            )
        log_path = root / "logs" / f"llama-{key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(
            f"clover-gguf llama.cpp build {digest}\nsource: {source_id}\nbackend: {backend}\n"
            f"patches: {', '.join(p.name for p in patches) or '(none)'}\nsampler: {sampler}\n"
            f"host: {json.dumps(host)}\n"
        )
        # a cached build of the same llama.cpp (only the sampler differs): its binaries, and the sampler again
        donor = next((b for b in cached_builds(root) if b.prefix != final and
                      (read_stamp(b.prefix) or {}).get("llama_hash") == llama_digest), None)  # fmt: skip
        # the work folder sits beside the final one so the last step is a same-file-system rename
        work = Path(tempfile.mkdtemp(prefix=f".work-llama-{key}-", dir=final.parent))
        try:
            tree = work / "src"
            snapshot = work / "patches"
            snapshot.mkdir()
            for p, data in zip(patches, patch_data):
                (snapshot / p.name).write_bytes(data)
            if donor is not None:
                if not quiet:
                    print(f"reusing the llama.cpp binaries of {donor.prefix} (only the sampler changed) ...",
                          file=sys.stderr)
                extract_llama_headers(sdist, tree, src)
                apply_patches(tree, [snapshot / p.name for p in patches], include=HEADER_GLOBS, src=src)
                built_bin = work / "build" / "bin"
                shutil.copytree(donor.bin_dir, built_bin, symlinks=True,
                                ignore=shutil.ignore_patterns(_shared_lib_name(SAMPLER_LIB), _exe(SAMPLER_TEST)))
            else:
                if not quiet:
                    print(f"preparing llama.cpp {src.commit} with {len(patches)} patch(es) ...", file=sys.stderr)
                extract_llama_source(sdist, tree, src)
                apply_patches(tree, [snapshot / p.name for p in patches], src=src)
                built_bin = configure_and_build(tree, work / "build", backend, options, jobs, log_path, quiet=quiet)
            build_sampler(tree, built_bin, work / "sampler-build", log_path, backend, quiet=quiet)
            stage = work / "install"
            stage_install(built_bin, stage)
            shutil.copy2(log_path, stage / "build.log")
            stamp = {
                "complete": True,
                "build_hash": digest,
                "llama_hash": llama_digest,
                "patch_hash": patch_hash(patch_data),
                "patches": [p.name for p in patches],
                "sampler_hash": sampler,
                "sampler_library": _shared_lib_name(SAMPLER_LIB),
                "backend": backend,
                "source": source_id,
                "source_name": src.name,
                "llama_cpp_commit": src.commit,
                "cmake_options": options,
                "host": host,
                "targets": build_targets(),
                "recipe": RECIPE_VERSION,
                "created": time.time(),
                "build_seconds": round(time.monotonic() - t0, 1),
            }
            if donor is not None:
                stamp["llama_binaries_from"] = donor.build_hash
            (stage / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")  # written last
            _move_into_place(stage, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - t0
    if not quiet:
        print(f"llama.cpp installed in {final / 'bin'} ({seconds / 60:.1f} min)", file=sys.stderr)
    return _info_from_stamp(final, read_stamp(final) or {}, cached=False, seconds=seconds)


# the public headers of the tree (what the sampler compiles against)
HEADER_GLOBS = ("include/*", "ggml/include/*")


def source_id_of(src: Source) -> str:
    """How stamps name a build's llama.cpp source: its sdist's sha256."""
    return f"sdist:{_sha256_of(src)}"


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
    found = [_info_from_stamp(p, read_stamp(p) or {}) for p in root.glob("llama-*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda info: info.created, reverse=True)


def _requested_backend(backend: str | None) -> tuple[str | None, str]:
    """The backend asked for (the argument, else $CLOVER_GGUF_BACKEND) and how it was asked."""
    asked = backend or os.environ.get(ENV_BACKEND) or None
    how = f"asked for {asked}" if backend else f"{ENV_BACKEND}={asked}"
    if asked is not None and asked not in BACKENDS:
        raise UserError(f"unknown backend {asked!r} ({how}): choose one of {', '.join(BACKENDS)}")
    return asked, how


def find_library(backend: str | None = None, patched: bool = True) -> BuildInfo | None:
    """The llama.cpp build to run: the folder in $LLAMA_CPP_LIB_PATH if set (None when it holds no libllama), else
    the newest complete cached build of chosen_source()'s tree (the pinned one unless $CLOVER_GGUF_SOURCE names
    another) with the current patches (none with patched=False) and sampler sources, made for this CPU, of
    `backend` (else $CLOVER_GGUF_BACKEND; else a GPU build whose GPU is present, else the CPU build, else any).
    BuildInfo.chosen says why."""
    override = os.environ.get(ENV_LIB_PATH)
    if override:
        lib_dir = Path(override).expanduser()
        if not (lib_dir / _shared_lib_name("llama")).exists():
            return None
        return dataclasses.replace(_info_for_lib_dir(lib_dir), chosen=f"{ENV_LIB_PATH} is set")
    try:
        want = patch_hash() if patched else patch_hash([])
        sampler = sampler_hash()
        source = source_id_of(chosen_source())
    except UserError:
        return None
    asked, how = _requested_backend(backend)
    cpu = cpu_key()
    builds = [b for b in cached_builds() if b.patch_hash == want and b.sampler_hash == sampler and b.cpu == cpu
              and b.source == source]  # fmt: skip
    if asked is not None:
        pick = next((b for b in builds if b.backend == asked), None)
        return dataclasses.replace(pick, chosen=how) if pick else None
    present = {name: gpu_present(name) for name in {b.backend for b in builds}}
    # a stable sort: newest first within each rank
    ranked = sorted(builds, key=lambda b: 0 if present[b.backend] else 1 if b.backend == "cpu" else 2)
    if not ranked:
        return None
    pick = ranked[0]
    if present[pick.backend]:
        why = "its GPU is present"
    elif pick.backend == "cpu":
        why = "no cached GPU build whose GPU is present"
    else:
        why = "the only build; its GPU was not detected"
    return dataclasses.replace(pick, chosen=why)


def llama_tool(name: str) -> Path:
    """A tool (llama-server, llama-imatrix, ...) of the build find_library() picks; a UserError saying how to get it
    when there is none."""
    info = find_library()
    path = info.tool(name) if info is not None else None
    if path is None or not path.is_file() or not os.access(path, os.X_OK):
        raise UserError(f"{name} not found ({path or 'no patched llama.cpp build'}): run `clover-gguf build-llama`")
    return path


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


def install_binding(info: BuildInfo | None = None, quiet: bool = False, force: bool = False) -> str:
    """Install llama-cpp-python 0.3.36 into this interpreter from the verified sdist, without compiling llama.cpp,
    and check that it imports against `info`'s library. Returns the installed version. A no-op when it is there."""
    install = binding_version() != LLAMA_CPP_PYTHON_VERSION or force
    if install:
        sdist = fetch_sdist(writable_cache_root() / "sdist", quiet=quiet)
        if not quiet:
            print(f"installing llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (no llama.cpp compile) ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="clover-binding-") as tmp:
            root = extract_binding_source(sdist, Path(tmp))
            env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF")
            cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir",
                   *(["--force-reinstall", "--no-deps"] if force else []), str(root)]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                reason = last_error_line(proc.stderr + proc.stdout)
                raise UserError(f"pip could not install llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}: {reason}")
        importlib.invalidate_caches()
        if binding_version() != LLAMA_CPP_PYTHON_VERSION:
            raise UserError(f"llama-cpp-python install finished but reports version {binding_version()}")
    if info is not None:
        check_binding(info, full=install or not info.cached)
    return LLAMA_CPP_PYTHON_VERSION


def check_binding(info: BuildInfo, full: bool = True) -> None:
    """Import llama_cpp in a fresh interpreter against the build's library (its declarations look up every symbol);
    with full=False only load the library here, which keeps a cached `build-llama` under a second (the binding was
    checked against that build when either was new). UserError when it fails."""
    if not full:
        try:
            ctypes.CDLL(str(info.libllama))
            return
        except OSError as e:
            raise UserError(f"{info.libllama} does not load: {e}") from None
    code = "import llama_cpp; llama_cpp.llama_backend_init(); print(llama_cpp.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **binding_env(info)}, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        raise UserError(f"llama_cpp does not load {info.libllama}: {_last_nonempty(proc.stderr)}")


# --------------------------------------------------------------------------------------------------------------------
# doctor


def doctor(backend: str | None = None) -> dict:
    """What the runtime would use (of `backend`, as find_library chooses), and what is missing. Never raises for a
    missing piece: it lists it."""
    missing: list[str] = []
    warnings: list[str] = []
    try:
        current = patch_hash()
    except UserError as e:
        current = None
        missing.append(str(e))
    try:
        current_sampler = sampler_hash()
    except UserError as e:
        current_sampler = None
        missing.append(str(e))
    asked, _ = _requested_backend(backend)
    try:
        source = chosen_source()
    except UserError as e:
        source = PINNED
        missing.append(str(e))
    info = find_library(backend)
    override = os.environ.get(ENV_LIB_PATH)
    cpu = cpu_key()
    usable = [b for b in cached_builds() if b.patch_hash == current and b.sampler_hash == current_sampler
              and b.cpu == cpu and b.source == source_id_of(source)]  # fmt: skip
    if info is None and override:
        missing.append(f"{ENV_LIB_PATH}={override} holds no {_shared_lib_name('llama')}")
    elif info is None:
        others = [b for b in cached_builds() if b not in usable]
        why = sorted({"for another CPU" if b.cpu != cpu else "of another llama.cpp source"
                      if b.source != source_id_of(source) else "unpatched" if b.patch_hash == patch_hash([]) else
                      "of other patches" if b.patch_hash != current else "of another sampler"
                      for b in others})  # fmt: skip
        what = f"no {asked} llama.cpp build" if asked else "no llama.cpp build"
        more = f" (cached: builds {', '.join(why)})" if why else ""
        missing.append(f"{what} of the current patches for this CPU{more}: run `clover-gguf build-llama"
                       f"{' --backend ' + asked if asked else ''}"
                       f"{' --source ' + source.name if source is not PINNED else ''}`")  # fmt: skip
    else:
        if info.patch_hash is None:
            warnings.append(f"{info.lib_dir} was not built by clover-gguf: its patches cannot be checked")
        elif current is not None and info.patch_hash != current:
            missing.append(f"the library in {info.lib_dir} was built from other patches: run `clover-gguf build-llama`")
        elif current_sampler is not None and info.sampler_hash != current_sampler:
            missing.append(f"the selection sampler in {info.lib_dir} was built from other sources: run "
                           "`clover-gguf build-llama`")
        for tool in TOOL_TARGETS:
            if not info.tool(tool).exists():
                (missing if info.build_hash else warnings).append(f"{tool} not found in {info.bin_dir}")
        try:
            ctypes.CDLL(str(info.libllama))
        except OSError as e:
            missing.append(f"{info.libllama} does not load: {e}")
        if not info.sampler_lib.is_file():
            (missing if info.build_hash else warnings).append(f"the selection sampler {info.sampler_lib} is missing")
        else:
            try:
                ctypes.CDLL(str(info.sampler_lib)).clover_sampler_set_inputs  # noqa: B018 - the symbol must exist
            except (OSError, AttributeError) as e:
                missing.append(f"the selection sampler {info.sampler_lib} does not load: {e}")

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
        "backend_choice": info.chosen if info else None,
        "cached_backends": sorted({b.backend for b in usable}),
        "patch_hash": info.patch_hash if info else None,
        "current_patch_hash": current,
        "build_hash": info.build_hash if info else None,
        "sampler_library": str(info.sampler_lib) if info else None,
        "sampler_hash": info.sampler_hash if info else None,
        "current_sampler_hash": current_sampler,
        "source": info.source if info else None,
        "source_name": source.name,
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
