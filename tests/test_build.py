"""Fast tests of the llama.cpp build pipeline: no network, no real cmake build."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from clover_gguf import build, llama_sdist
from clover_gguf.errors import UserError

needs_git = pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0,
                               reason="git not installed")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated cache and patches folders; no LLAMA_CPP_LIB_PATH from the caller's shell."""
    cache = tmp_path / "cache"
    patches = tmp_path / "patches"
    patches.mkdir()
    monkeypatch.setenv(build.ENV_CACHE, str(cache))
    monkeypatch.setenv(build.ENV_PATCHES, str(patches))
    monkeypatch.delenv(build.ENV_LIB_PATH, raising=False)
    monkeypatch.delenv(build.ENV_BACKEND, raising=False)
    monkeypatch.delenv(llama_sdist.ENV_SDIST, raising=False)
    monkeypatch.delenv(build.ENV_SOURCE, raising=False)
    return {"cache": cache, "patches": patches, "tmp": tmp_path}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_fake_sdist(path: Path, stray_git: bool = True, top: str | None = None, vendor: str = "vendor/llama.cpp"
                    ) -> str:
    """A tiny sdist-shaped tarball; returns its sha256."""
    top = top or f"llama_cpp_python-{llama_sdist.LLAMA_CPP_PYTHON_VERSION}"
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, f"{top}/pyproject.toml", b"[project]\nname='x'\n")
        _add(tar, f"{top}/{vendor}/CMakeLists.txt", b"project(llama)\n")
        _add(tar, f"{top}/{vendor}/include/llama.h", b"int llama(void);\n")
        _add(tar, f"{top}/{vendor}/src/a.cpp", b"line 1\nline 2\nline 3\n")
        if stray_git:
            _add(tar, f"{top}/{vendor}/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_patch(old: str, new: str, name: str = "src/a.cpp") -> bytes:
    d = Path(build.tempfile.mkdtemp())
    try:
        (d / Path(name).parent).mkdir(parents=True, exist_ok=True)
        (d / name).write_text(old)
        subprocess.run(["git", "init", "-q"], cwd=d, check=True)
        subprocess.run(["git", "add", "."], cwd=d, check=True)
        (d / name).write_text(new)
        return subprocess.run(["git", "diff"], cwd=d, check=True, capture_output=True).stdout
    finally:
        build.shutil.rmtree(d)


def fake_cmake(calls: list, seen: dict | None = None):
    """Replacement for configure_and_build that makes the expected binaries instantly."""

    def run(src, build_dir, backend, options, jobs, log_path, quiet=False):
        calls.append(backend)
        if seen is not None:
            seen["stray_git"] = (Path(src) / ".git").exists()
            seen["a.cpp"] = (Path(src) / "src" / "a.cpp").read_text()
        bin_dir = Path(build_dir) / "bin"
        bin_dir.mkdir(parents=True)
        for name in ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", *build.TOOL_TARGETS]:
            (bin_dir / name).write_bytes(b"fake")
            (bin_dir / name).chmod(0o755)
        return bin_dir

    return run


@pytest.fixture
def machine(monkeypatch):
    """A fake host: what build_llama puts in the cache key and find_library compares (edit it to change machine)."""
    host = {"cpu": "linux-x86_64-cpu-a", "cc": "/usr/bin/gcc-12 gcc 12.2", "cxx": "/usr/bin/g++-12 g++ 12.2"}
    monkeypatch.setattr(build, "cpu_key", lambda: host["cpu"])
    monkeypatch.setattr(build, "host_key", lambda backend: dict(host))
    monkeypatch.setattr(build, "nvidia_compute_caps", lambda: [])
    return host


@pytest.fixture
def fake_source(env, machine, monkeypatch):
    sdist = env["tmp"] / llama_sdist.SDIST_NAME
    digest = make_fake_sdist(sdist)
    monkeypatch.setenv(llama_sdist.ENV_SDIST, str(sdist))
    monkeypatch.setattr(llama_sdist, "SDIST_SHA256", digest)
    monkeypatch.setattr(build, "_check_tools", lambda backend, host: None)
    monkeypatch.setattr(build, "_shared_lib_name", lambda base: f"lib{base}.so")
    env["sampler_calls"] = []
    monkeypatch.setattr(build, "build_sampler", fake_sampler(env["sampler_calls"]))
    return sdist


def fake_sampler(calls: list):
    """Replacement for build_sampler: records the tree it was given and writes the library."""

    def run(llama_src, lib_dir, build_dir, log_path, backend="cpu", quiet=False, sources=None):
        calls.append({"headers": (Path(llama_src) / "include" / "llama.h").is_file(),
                      "whole_tree": (Path(llama_src) / "src" / "a.cpp").exists(),
                      "lib_dir_has_llama": (Path(lib_dir) / "libllama.so").is_file()})
        lib = Path(lib_dir) / "libclover_sampler.so"
        lib.write_bytes(b"fake sampler " + build.sampler_hash().encode())
        (Path(lib_dir) / build._exe(build.SAMPLER_TEST)).write_bytes(b"fake sampler test")
        return lib

    return run


# ------------------------------------------------------------------------------------------------------------ hashes

HOST = {"cpu": "linux-x86_64-aaaa", "cc": "/usr/bin/gcc-12 gcc 12.2", "cxx": "/usr/bin/g++-12 g++ 12.2"}


def test_build_hash_stable_and_sensitive(tmp_path, machine):
    p1, p2 = tmp_path / "0001-a.patch", tmp_path / "0002-b.patch"
    p1.write_bytes(b"patch one\n")
    p2.write_bytes(b"patch two\n")
    opts = build.cmake_options("cpu")
    h = build.build_hash("sdist:x", [p1, p2], "cpu", opts, HOST)

    assert h == build.build_hash("sdist:x", [p1, p2], "cpu", list(opts), dict(HOST))  # stable
    assert len(h) == 64
    assert build.build_hash("sdist:x", [p1, p2], "cuda", build.cmake_options("cuda"), HOST) != h
    assert build.build_hash("sdist:x", [p1, p2], "cuda", opts, HOST) != h  # the backend itself is hashed
    assert build.build_hash("sdist:y", [p1, p2], "cpu", opts, HOST) != h
    assert build.build_hash("sdist:x", [p2, p1], "cpu", opts, HOST) != h  # order matters
    assert build.build_hash("sdist:x", [p1], "cpu", opts, HOST) != h
    assert build.build_hash("sdist:x", [], "cpu", opts, HOST) != h  # unpatched
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts + ["-DX=1"], HOST) != h
    for key, other in (("cpu", "linux-x86_64-bbbb"), ("cc", "/usr/bin/gcc-13 gcc 13.1"), ("cxx", "clang 17")):
        assert build.build_hash("sdist:x", [p1, p2], "cpu", opts, {**HOST, key: other}) != h
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts, {**HOST, "nvcc": "cuda_12.4"}) != h

    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts, HOST, sampler="abc") != h  # the sampler's sources
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts, HOST, sampler="abd") != \
        build.build_hash("sdist:x", [p1, p2], "cpu", opts, HOST, sampler="abc")
    ph = build.patch_hash([p1, p2])
    p2.write_bytes(b"patch twO\n")  # one byte changed
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts, HOST) != h
    assert build.patch_hash([p1, p2]) != ph


def test_hash_has_no_concatenation_ambiguity(tmp_path):
    a, b = tmp_path / "a.patch", tmp_path / "b.patch"
    a.write_bytes(b"ab")
    b.write_bytes(b"c")
    c, d = tmp_path / "c.patch", tmp_path / "d.patch"
    c.write_bytes(b"a")
    d.write_bytes(b"bc")
    assert build.patch_hash([a, b]) != build.patch_hash([c, d])


def test_host_key_reads_the_compilers_it_would_use(tmp_path, monkeypatch):
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fake c++ 1.0'\necho 'second line'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    one = build.host_key("cpu")
    assert one["cxx"] == f"{os.path.realpath(fake)} fake c++ 1.0"
    assert one["cpu"] == build.cpu_key() and one["cpu"].startswith(f"{sys.platform}-")
    fake.write_text("#!/bin/sh\necho 'fake c++ 2.0'\n")  # the compiler was upgraded
    assert build.host_key("cpu")["cxx"].endswith("fake c++ 2.0")
    assert "nvcc" in build.host_key("cuda") and "nvcc" not in one and "glslc" in build.host_key("vulkan")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert build.host_key("cpu")["cxx"] == ""  # missing: _check_tools names it
    with pytest.raises(UserError, match="C\\+\\+ compiler"):
        build._check_tools("cpu", build.host_key("cpu"))


def test_cmake_options_per_backend_and_platform(machine):
    assert "-DGGML_CUDA=ON" in build.cmake_options("cuda")
    assert "-DGGML_METAL=ON" in build.cmake_options("metal", system="darwin")
    assert "-DGGML_VULKAN=ON" in build.cmake_options("vulkan")
    cpu = build.cmake_options("cpu", system="linux", machine="x86_64")
    for opt in ("-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=ON",
                "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DLLAMA_BUILD_SERVER=ON"):
        assert opt in cpu
    assert not any("CUDA" in o or "METAL" in o or "VULKAN" in o for o in cpu)
    # the AMX matmul of the pinned tree segfaults: no AMX on x86, nothing of it elsewhere
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in cpu
    assert not any("amx" in o for o in build.cmake_options("cpu", system="linux", machine="aarch64"))
    # macOS turns Metal on by default: a CPU (or Vulkan) build turns it off
    mac_cpu = build.cmake_options("cpu", system="darwin", machine="arm64")
    assert "-DGGML_METAL=OFF" in mac_cpu and "-DCMAKE_INSTALL_RPATH=@loader_path" in mac_cpu
    assert "-DGGML_METAL=OFF" in build.cmake_options("vulkan", system="darwin", machine="arm64")
    assert "-DGGML_METAL=OFF" not in build.cmake_options("metal", system="darwin", machine="arm64")
    with pytest.raises(UserError, match="unknown backend"):
        build.cmake_options("rocm")


def test_cuda_architectures(machine, monkeypatch):
    arch = [o for o in build.cmake_options("cuda") if o.startswith("-DCMAKE_CUDA_ARCHITECTURES=")]
    assert arch == [f"-DCMAKE_CUDA_ARCHITECTURES={build.DEFAULT_CUDA_ARCHS}"]  # no GPU here: the documented list
    monkeypatch.setattr(build, "nvidia_compute_caps", lambda: ["86", "89"])
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;89" in build.cmake_options("cuda")  # the GPUs present
    assert "-DCMAKE_CUDA_ARCHITECTURES=75-virtual;90" in build.cmake_options("cuda", cuda_arch="75-virtual, 90")
    assert build.cuda_architectures("86;120a-real") == "86;120a-real"
    for bad in ("sm_86", "native", ";", "8.6"):
        with pytest.raises(UserError, match="--cuda-arch"):
            build.cuda_architectures(bad)
    with pytest.raises(UserError, match="--cuda-arch is for --backend cuda"):
        build.cmake_options("cpu", cuda_arch="86")


def test_nvidia_compute_caps_parses_nvidia_smi(monkeypatch):
    monkeypatch.setattr(build, "_output", lambda cmd: "8.9\n8.6\n8.9\n" if cmd[0] == "nvidia-smi" else "")
    assert build.nvidia_compute_caps() == ["86", "89"]
    assert build.gpu_present("cuda") is True
    monkeypatch.setattr(build, "_output", lambda cmd: "")  # no nvidia-smi, or no GPU
    assert build.nvidia_compute_caps() == [] and build.gpu_present("cuda") is False


def test_patch_files_sorted(env):
    for name in ("0002-b.patch", "0001-a.patch", "notes.txt", "0010-c.patch"):
        (env["patches"] / name).write_text("x")
    assert [p.name for p in build.patch_files()] == ["0001-a.patch", "0002-b.patch", "0010-c.patch"]


def test_a_source_takes_the_patches_its_subfolder_holds_in_place_of_the_series_own(env, monkeypatch):
    """patches/<source>/NAME replaces patches/NAME for that source only (the patch whose lines differ between
    trees); $CLOVER_GGUF_SOURCE chooses the source of patch_files() and patch_hash(); an unknown name is one line."""
    for name in ("0001-a.patch", "0002-b.patch"):
        (env["patches"] / name).write_text(name)
    own = env["patches"] / llama_sdist.XLLAMACPP.name
    own.mkdir()
    (own / "0002-b.patch").write_text("the newer tree's 0002")
    pinned = build.patch_files()
    assert [p.parent.name for p in pinned] == ["patches", "patches"]
    newer = build.patch_files(source=llama_sdist.XLLAMACPP.name)
    assert [p.name for p in newer] == ["0001-a.patch", "0002-b.patch"] and newer[1].read_text().startswith("the newer")
    h = build.patch_hash()
    monkeypatch.setenv(build.ENV_SOURCE, llama_sdist.XLLAMACPP.name)
    assert build.patch_files() == newer and build.patch_hash() != h
    monkeypatch.setenv(build.ENV_SOURCE, "llama.cpp-master")
    with pytest.raises(UserError, match="unknown llama.cpp source 'llama.cpp-master': choose one of "):
        build.patch_files()


def test_installed_package_ships_the_patches(tmp_path):
    """A non-editable install carries clover_gguf/patches (package data) and build.py finds them there."""
    repo = Path(build.__file__).resolve().parents[1]
    tree = tmp_path / "tree"
    shutil.copytree(repo / "clover_gguf", tree / "clover_gguf", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))  # fmt: skip
    for name in ("patches", "quant_recipes"):
        shutil.copytree(repo / name, tree / name)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(repo / name, tree / name)
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(tree)], capture_output=True, text=True)  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-2000:]
    installed = sorted((target / "clover_gguf" / "patches").glob("*.patch"))
    assert [p.name for p in installed] == [p.name for p in sorted((repo / "patches").glob("*.patch"))] != []
    assert not (target / "clover_gguf" / "patches").is_symlink()
    (target / "patches").mkdir()  # another distribution's top-level "patches" folder beside the package
    (target / "patches" / "0001-other.patch").write_text("not ours\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOVER_GGUF")}
    code = "from clover_gguf import build; print(build.patches_dir()); print(build.patch_hash())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "PYTHONPATH": str(target)},
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    folder, digest = out.stdout.split()
    assert Path(folder) == target / "clover_gguf" / "patches"
    assert digest == build.patch_hash(sorted((repo / "patches").glob("*.patch")))


# ------------------------------------------------------------------------------------------------------------- sdist


def test_sdist_sha256_mismatch_is_user_error(env, monkeypatch):
    bogus = env["tmp"] / llama_sdist.SDIST_NAME
    bogus.write_bytes(b"not the real sdist")
    monkeypatch.setenv(llama_sdist.ENV_SDIST, str(bogus))
    with pytest.raises(UserError, match="sha256 mismatch"):
        llama_sdist.fetch_sdist(env["cache"] / "sdist")


def test_cached_sdist_is_verified_too(env):
    cached = env["cache"] / "sdist" / llama_sdist.SDIST_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupt")
    with pytest.raises(UserError, match="sha256 mismatch") as e:
        llama_sdist.fetch_sdist(cached.parent)
    assert "\n" not in str(e.value)


def test_sdist_good_hash_accepted(env, fake_source):
    assert llama_sdist.fetch_sdist(env["cache"] / "sdist") == fake_source


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A PEP 503 simple index on 127.0.0.1 (PIP_INDEX_URL points at it); write files under index["root"]."""
    root = tmp_path / "index"
    (root / "simple" / "llama-cpp-python").mkdir(parents=True)
    (root / "files").mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.delenv(llama_sdist.ENV_SDIST, raising=False)
    yield {"root": root, "url": f"http://127.0.0.1:{server.server_port}"}
    server.shutdown()
    server.server_close()


def _publish(index: dict, data: bytes) -> None:
    name = llama_sdist.SDIST_NAME
    (index["root"] / "files" / name).write_bytes(data)
    (index["root"] / "files" / "llama_cpp_python-0.3.35.tar.gz").write_bytes(b"another version")
    (index["root"] / "simple" / "llama-cpp-python" / "index.html").write_text(
        '<html><body>\n<a href="../../files/llama_cpp_python-0.3.35.tar.gz">llama_cpp_python-0.3.35.tar.gz</a>\n'
        f'<a href="../../files/{name}#sha256={hashlib.sha256(data).hexdigest()}" data-requires-python="&gt;=3.8">'
        f"{name}</a><br />\n</body></html>\n"
    )


def test_download_is_verified_before_it_is_kept_and_runs_nothing(env, index, monkeypatch):
    sdist = env["tmp"] / "made.tar.gz"
    monkeypatch.setattr(llama_sdist, "SDIST_SHA256", make_fake_sdist(sdist))
    _publish(index, sdist.read_bytes())
    folder = env["cache"] / "sdist"

    def no_process(*a, **k):
        raise AssertionError("the download started a process")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    got = llama_sdist.fetch_sdist(folder, quiet=True)
    assert got == folder / llama_sdist.SDIST_NAME and got.read_bytes() == sdist.read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == [llama_sdist.SDIST_NAME]  # no temporary file left


def test_download_with_a_wrong_hash_keeps_nothing(env, index, monkeypatch):
    _publish(index, b"tampered bytes")
    folder = env["cache"] / "sdist"
    with pytest.raises(UserError, match="sha256 mismatch.*downloaded from http://127.0.0.1"):
        llama_sdist.fetch_sdist(folder, quiet=True)
    assert list(folder.iterdir()) == []


def test_index_without_the_file_is_one_line(env, index):
    (index["root"] / "simple" / "llama-cpp-python" / "index.html").write_text("<a href='x.tar.gz'>x.tar.gz</a>")
    with pytest.raises(UserError, match=f"does not list {llama_sdist.SDIST_NAME}.*{llama_sdist.ENV_SDIST}"):
        llama_sdist.fetch_sdist(env["cache"] / "sdist", quiet=True)
    shutil.rmtree(index["root"] / "simple" / "llama-cpp-python")  # no such project on the index
    with pytest.raises(UserError, match="could not download .*404"):
        llama_sdist.fetch_sdist(env["cache"] / "sdist", quiet=True)


def test_index_url_follows_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/pypi/simple")
    assert llama_sdist.index_url() == "https://mirror.example/pypi/simple/"
    monkeypatch.delenv("PIP_INDEX_URL")
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = https://extra.example/simple\nindex-url = https://conf.example/s\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert llama_sdist.index_url() == "https://conf.example/s/"


def test_install_binding_uses_only_the_verified_sdist(env, fake_source, monkeypatch):
    installed: list = []
    versions = [None, llama_sdist.LLAMA_CPP_PYTHON_VERSION]

    def fake_run(cmd, **kw):
        assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
        installed.append((Path(cmd[-1]) / "pyproject.toml").read_text())  # what pip would build: the sdist's tree
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build, "binding_version", lambda: versions.pop(0))
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert build.install_binding(None, quiet=True) == llama_sdist.LLAMA_CPP_PYTHON_VERSION
    assert installed == ["[project]\nname='x'\n"]

    fake_source.write_bytes(fake_source.read_bytes() + b"tampered")
    versions[:] = [None]
    with pytest.raises(UserError, match="sha256 mismatch"):
        build.install_binding(None, quiet=True)
    assert len(installed) == 1  # pip never saw the tampered file


def test_extract_leaves_out_the_stray_git_file(env, fake_source):
    dest = env["tmp"] / "src"
    llama_sdist.extract_llama_source(fake_source, dest)
    assert (dest / "CMakeLists.txt").is_file()
    assert (dest / "src" / "a.cpp").read_text().startswith("line 1")
    assert not (dest / ".git").exists()
    assert not (dest / "pyproject.toml").exists()  # only vendor/llama.cpp is extracted


# ----------------------------------------------------------------------------------------------------------- patches


@needs_git
def test_good_patch_applies_even_inside_another_repository(tmp_path):
    outer = tmp_path / "outer"
    tree = outer / "work" / "src"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.cpp").write_text("line 1\nline 2\nline 3\n")
    subprocess.run(["git", "init", "-q"], cwd=outer, check=True)  # git must not pick this repository up
    patch = tmp_path / "0001-ok.patch"
    patch.write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nline two\nline 3\n"))
    build.apply_patches(tree, [patch])
    assert (tree / "src" / "a.cpp").read_text() == "line 1\nline two\nline 3\n"


@needs_git
def test_failing_patch_is_named(tmp_path):
    tree = tmp_path / "src"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.cpp").write_text("line 1\nline 2\nline 3\n")
    good = tmp_path / "0001-good.patch"
    good.write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nline 2\nline 3\nline 4\n"))
    bad = tmp_path / "0002-bad.patch"
    bad.write_bytes(git_patch("other 1\nother 2\nother 3\n", "other 1\nchanged\nother 3\n"))
    with pytest.raises(UserError) as e:
        build.apply_patches(tree, [good, bad])
    msg = str(e.value)
    assert "0002-bad.patch" in msg and "src/a.cpp" in msg
    assert "0001-good.patch" not in msg
    assert "\n" not in msg
    # the good patch was applied before the bad one was refused; the bad one changed nothing
    assert (tree / "src" / "a.cpp").read_text() == "line 1\nline 2\nline 3\nline 4\n"


@needs_git
def test_patch_for_missing_file_is_named(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    bad = tmp_path / "0001-missing.patch"
    bad.write_bytes(git_patch("x\n", "y\n", name="src/gone.cpp"))
    with pytest.raises(UserError, match=r"0001-missing\.patch.*src/gone\.cpp"):
        build.apply_patches(tree, [bad])


# ------------------------------------------------------------------------------------------------------ build, cache


@needs_git
def test_cache_hit_skips_work(env, fake_source, monkeypatch):
    calls: list = []
    seen: dict = {}
    monkeypatch.setattr(build, "configure_and_build", fake_cmake(calls, seen))
    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nPATCHED\nline 3\n"))

    first = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu"] and first.cached is False
    assert seen == {"stray_git": False, "a.cpp": "line 1\nPATCHED\nline 3\n"}
    assert first.prefix.parent == env["cache"] and first.prefix.name.startswith("llama-")
    assert (first.bin_dir / "libllama.so").is_file() and (first.bin_dir / "llama-quantize").is_file()
    stamp = json.loads((first.prefix / build.STAMP_NAME).read_text())
    assert stamp["backend"] == "cpu" and stamp["patch_hash"] == build.patch_hash() and stamp["complete"] is True
    assert not list(env["cache"].glob(".work-*"))  # the temporary tree is gone

    monkeypatch.setenv(llama_sdist.ENV_SDIST, str(env["tmp"] / "gone.tar.gz"))  # a cache hit needs no source at all
    second = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu"]  # nothing rebuilt
    assert second.cached is True and second.prefix == first.prefix and second.build_hash == first.build_hash

    monkeypatch.setenv(llama_sdist.ENV_SDIST, str(fake_source))
    other = build.build_llama("vulkan", jobs=1, quiet=True)
    assert calls == ["cpu", "vulkan"] and other.prefix != first.prefix

    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nAGAIN\nline 3\n"))
    third = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu", "vulkan", "cpu"] and third.prefix != first.prefix


@needs_git
def test_a_sampler_change_rebuilds_only_the_sampler(env, fake_source, monkeypatch):
    """The sampler's sources are part of the build hash and the stamp: a change makes a new build, which takes the
    llama.cpp binaries of the cached build with the same llama.cpp hash and builds only the sampler, against the
    headers (not the whole tree); find_library and doctor then point at it."""
    src = env["tmp"] / "csrc"
    shutil.copytree(build.SAMPLER_DIR, src)
    monkeypatch.setattr(build, "SAMPLER_DIR", src)
    calls: list = []
    monkeypatch.setattr(build, "configure_and_build", fake_cmake(calls))
    first = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu"] and env["sampler_calls"] == [{"headers": True, "whole_tree": True,
                                                         "lib_dir_has_llama": True}]
    stamp = json.loads((first.prefix / build.STAMP_NAME).read_text())
    assert stamp["sampler_hash"] == build.sampler_hash() and first.sampler_lib.is_file()
    assert build.find_library().prefix == first.prefix

    (src / "clover_sampler.cpp").write_text((src / "clover_sampler.cpp").read_text() + "\n// changed\n")
    assert build.find_library() is None  # the cached build holds another sampler
    assert any("other sampler" in m or "no llama.cpp build" in m for m in build.doctor()["missing"])
    second = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu"]  # llama.cpp was not built again
    assert env["sampler_calls"][1] == {"headers": True, "whole_tree": False, "lib_dir_has_llama": True}
    assert second.prefix != first.prefix and second.build_hash != first.build_hash
    stamp2 = json.loads((second.prefix / build.STAMP_NAME).read_text())
    assert stamp2["sampler_hash"] == build.sampler_hash() != stamp["sampler_hash"]
    assert stamp2["llama_hash"] == stamp["llama_hash"] and stamp2["llama_binaries_from"] == first.build_hash
    assert (second.bin_dir / "libllama.so").read_bytes() == b"fake"
    assert second.sampler_lib.read_bytes().endswith(build.sampler_hash().encode())
    assert build.find_library().prefix == second.prefix
    report = build.doctor()
    assert report["sampler_library"] == str(second.sampler_lib)
    assert report["sampler_hash"] == report["current_sampler_hash"] == build.sampler_hash()
    assert not any("sampler" in m and ("missing" in m or "other sources" in m) for m in report["missing"])
    second.sampler_lib.unlink()
    assert any("selection sampler" in m and "missing" in m for m in build.doctor()["missing"])


def test_interrupted_build_never_looks_complete(env, fake_source, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "configure_and_build", boom)
    with pytest.raises(KeyboardInterrupt):
        build.build_llama("cpu", quiet=True)
    assert not list(env["cache"].glob("llama-*"))
    assert not list(env["cache"].glob(".work-*"))
    assert build.find_library() is None

    calls: list = []
    monkeypatch.setattr(build, "configure_and_build", fake_cmake(calls))
    assert build.build_llama("cpu", quiet=True).cached is False and calls == ["cpu"]


def test_prefix_override_and_refusal(env, fake_source, monkeypatch):
    calls: list = []
    monkeypatch.setattr(build, "configure_and_build", fake_cmake(calls))
    target = env["tmp"] / "mybuild"
    info = build.build_llama("cpu", prefix=target, quiet=True)
    assert info.prefix == target.resolve() and (target / "bin" / "libllama.so").is_file()
    assert build.build_llama("cpu", prefix=target, quiet=True).cached is True and len(calls) == 1

    foreign = env["tmp"] / "foreign"
    foreign.mkdir()
    (foreign / "important.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a clover-gguf llama.cpp build"):
        build.build_llama("cpu", prefix=foreign, quiet=True)
    assert (foreign / "important.txt").read_text() == "keep me"


@needs_git
def test_cache_is_not_reused_on_another_cpu_or_compiler(env, fake_source, machine, monkeypatch):
    calls: list = []
    monkeypatch.setattr(build, "configure_and_build", fake_cmake(calls))
    first = build.build_llama("cpu", quiet=True)
    assert build.build_llama("cpu", quiet=True).cached is True and len(calls) == 1

    machine["cxx"] = "/usr/bin/g++-13 g++ 13.1"  # another compiler
    other_compiler = build.build_llama("cpu", quiet=True)
    assert len(calls) == 2 and other_compiler.cached is False and other_compiler.prefix != first.prefix

    machine["cpu"] = "linux-x86_64-cpu-b"  # another CPU (a cache folder shared by two machines)
    assert build.find_library() is None  # neither build was made for this CPU: neither is run here
    assert any("cached: builds for another CPU" in m for m in build.doctor()["missing"])
    other_cpu = build.build_llama("cpu", quiet=True)
    assert len(calls) == 3 and other_cpu.prefix not in (first.prefix, other_compiler.prefix)
    assert build.find_library().prefix == other_cpu.prefix
    stamp = json.loads((other_cpu.prefix / build.STAMP_NAME).read_text())
    assert stamp["host"] == machine

    machine["cpu"], machine["cxx"] = "linux-x86_64-cpu-a", "/usr/bin/g++-12 g++ 12.2"  # back on the first machine
    again = build.build_llama("cpu", quiet=True)
    assert again.cached is True and again.prefix == first.prefix and len(calls) == 3


@needs_git
def test_no_patches_build_is_its_own_entry_and_never_picked(env, fake_source, monkeypatch):
    seen: dict = {}
    monkeypatch.setattr(build, "configure_and_build", fake_cmake([], seen))
    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nPATCHED\nline 3\n"))
    plain = build.build_llama("cpu", quiet=True, patched=False)
    assert seen["a.cpp"] == "line 1\nline 2\nline 3\n"  # the pinned tree as it is
    assert json.loads((plain.prefix / build.STAMP_NAME).read_text())["patches"] == []
    assert build.find_library() is None  # the runtime never takes an unpatched build by accident
    assert any("cached: builds unpatched" in m for m in build.doctor()["missing"])
    assert build.find_library(patched=False).prefix == plain.prefix

    patched = build.build_llama("cpu", quiet=True)
    assert seen["a.cpp"] == "line 1\nPATCHED\nline 3\n" and patched.prefix != plain.prefix
    assert build.find_library().prefix == patched.prefix
    assert build.build_llama("cpu", quiet=True, patched=False).cached is True


@needs_git
def test_a_build_of_another_source_is_used_only_when_chosen(env, fake_source, monkeypatch):
    """build-llama --source builds another registry sdist's tree (fetched from the cache folder and verified, its
    own subfolder's patches in place of the series' same-named ones) into an entry of its own; the runtime takes it
    only with $CLOVER_GGUF_SOURCE naming it, so a second tree in a shared cache changes nobody's build."""
    seen: dict = {}
    monkeypatch.setattr(build, "configure_and_build", fake_cmake([], seen))
    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nPATCHED\nline 3\n"))
    own = env["patches"] / "newer-tree-1"
    own.mkdir()
    (own / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nNEWER\nline 3\n"))
    sdist = env["cache"] / "sdist" / "newer_tree-1.tar.gz"
    sdist.parent.mkdir(parents=True)
    src = llama_sdist.Source("newer-tree-1", "newer-tree", "newer_tree", "1", make_fake_sdist(sdist, top="newer_tree-1",
                             vendor="third/llama.cpp"), "third/llama.cpp/", "newer-tree-1")
    monkeypatch.setitem(llama_sdist.SOURCES, src.name, src)
    pinned = build.build_llama("cpu", jobs=1, quiet=True)
    assert seen["a.cpp"] == "line 1\nPATCHED\nline 3\n"
    newer = build.build_llama("cpu", jobs=1, quiet=True, source=src.name)
    assert seen["a.cpp"] == "line 1\nNEWER\nline 3\n" and newer.prefix != pinned.prefix
    stamp = json.loads((newer.prefix / build.STAMP_NAME).read_text())
    assert stamp["source_name"] == src.name and stamp["llama_cpp_commit"] == "newer-tree-1"
    assert "-DLLAMA_BUILD_COMMIT=newer-tree-1" in stamp["cmake_options"]
    assert build.find_library().prefix == pinned.prefix  # newest, but not chosen
    monkeypatch.setenv(build.ENV_SOURCE, src.name)
    assert build.find_library().prefix == newer.prefix
    assert build.doctor()["source_name"] == src.name


def test_cli_build_llama_no_patches_prints_the_library_folder(env, fake_source, monkeypatch):
    from typer.testing import CliRunner

    from clover_gguf.cli import app

    monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
    result = CliRunner().invoke(app, ["build-llama", "--no-patches", "--no-binding", "--quiet"])
    assert result.exit_code == 0, result.output
    info = build.find_library(patched=False)
    assert "llama.cpp (cpu, unpatched) built in" in result.output
    assert f"library: {info.lib_dir} (the runtime never picks it;" in result.output
    assert "export " not in result.output  # nothing that reads as a command the user must run


def test_stale_work_folders_are_removed_live_ones_kept(env, fake_source, monkeypatch):
    cache, locks = env["cache"], env["cache"] / "locks"
    locks.mkdir(parents=True)
    killed = cache / ".work-llama-aaaaaaaaaaaaaaaa-k1"  # its build was killed: the lock file stayed, unheld
    (killed / "src").mkdir(parents=True)
    (locks / "llama-aaaaaaaaaaaaaaaa.lock").touch()
    orphan = cache / ".work-llama-bbbbbbbbbbbbbbbb-k2"  # no lock file at all
    orphan.mkdir()
    live = cache / ".work-llama-cccccccccccccccc-l1"  # another process is building it right now
    live.mkdir()
    older = cache / ".work-llama-dddddddddddd-l2"  # an older version's name (12 hex digits; its lock has 16)
    older.mkdir()
    holders = [open(locks / name, "a") for name in ("llama-cccccccccccccccc.lock", "llama-dddddddddddd0123.lock")]
    for f in holders:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a second open file: flock treats it as another process
    try:
        monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
        build.build_llama("cpu", quiet=True)
        assert not killed.exists() and not orphan.exists()
        assert live.is_dir() and older.is_dir()
    finally:
        for f in holders:
            f.close()
    assert build.build_llama("cpu", quiet=True).cached is True  # a cached call cleans up too
    assert not live.exists() and not older.exists()


def test_progress_shows_without_a_terminal(tmp_path, capsys):
    log = tmp_path / "build.log"
    log.write_text("")
    script = 'i=1; while [ $i -le 50 ]; do echo "[$i/50] Building CXX object x$i.o"; i=$((i+1)); done'
    build.run_logged(["sh", "-c", script], log, "build")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("llama.cpp build: ")]
    assert lines[0] == "llama.cpp build: 1/50" and lines[-1] == "llama.cpp build: 50/50"
    assert len(lines) == 11  # one line per tenth (and the first), not one per step
    build.run_logged(["sh", "-c", script], log, "build", quiet=True)
    assert capsys.readouterr().err == ""


def test_build_failure_reports_compiler_error_and_log(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("")
    script = (
        "echo '[1/3] Building CXX object a.o'; "
        "echo \"/x/src/llama-model.cpp:12:5: error: 'foo' was not declared in this scope\"; "
        "echo '/x/src/llama-model.cpp:40:1: error: expected ; before }'; "
        "echo 'ninja: build stopped: subcommand failed.'; exit 1"
    )
    with pytest.raises(UserError) as e:
        build.run_logged(["sh", "-c", script], log, "build", quiet=True)
    msg = str(e.value)
    assert "llama-model.cpp:12:5: error: 'foo' was not declared" in msg
    assert str(log) in msg and "\n" not in msg
    assert "ninja: build stopped" in log.read_text()


def test_last_error_line_prefers_linker_over_noise():
    text = "warning: unused\n/usr/bin/ld: a.o: undefined reference to `llama_x'\ncollect2: error: ld returned 1\n"
    assert "collect2" in build.last_error_line(text) or "undefined reference" in build.last_error_line(text)
    assert build.last_error_line("CMake Error at CMakeLists.txt:3 (project):\n  No CMAKE_CXX_COMPILER\n").startswith(
        "CMake Error"
    )


# ------------------------------------------------------------------------------------------------ find, doctor, env


@needs_git
def test_find_library_and_doctor(env, fake_source, monkeypatch):
    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nPATCHED\nline 3\n"))
    assert build.find_library() is None
    report = build.doctor()
    assert report["ok"] is False and report["library_path"] is None
    assert any("build-llama" in m for m in report["missing"])

    monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
    info = build.build_llama("cpu", quiet=True)
    found = build.find_library()
    assert found is not None and found.prefix == info.prefix and found.backend == "cpu"
    assert build.binding_env(found) == {"LLAMA_CPP_LIB_PATH": str(info.bin_dir)}

    report = build.doctor()
    for key in ("library_path", "bin_dir", "backend", "patch_hash", "binding_version", "missing", "ok"):
        assert key in report
    assert report["library_path"] == str(info.bin_dir) and report["backend"] == "cpu"
    assert report["patch_hash"] == build.patch_hash()
    assert any("does not load" in m for m in report["missing"])  # the fake libllama.so is not a library

    # new patches: the old build no longer counts
    (env["patches"] / "0002-new.patch").write_text("diff")
    assert build.find_library() is None
    assert any("builds of other patches" in m for m in build.doctor()["missing"])


def test_find_library_honours_env(env, fake_source, monkeypatch):
    monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
    info = build.build_llama("metal", quiet=True, prefix=env["tmp"] / "m")
    monkeypatch.setenv(build.ENV_LIB_PATH, str(info.bin_dir))
    found = build.find_library()
    assert found is not None and found.backend == "metal" and found.bin_dir == info.bin_dir

    plain = env["tmp"] / "plain"
    plain.mkdir()
    (plain / "libllama.so").write_bytes(b"x")
    monkeypatch.setenv(build.ENV_LIB_PATH, str(plain))
    found = build.find_library()
    assert found is not None and found.backend == "unknown" and found.patch_hash is None

    monkeypatch.setenv(build.ENV_LIB_PATH, str(env["tmp"] / "nothing"))
    assert build.find_library() is None
    assert any("holds no" in m for m in build.doctor()["missing"])


def test_find_library_chooses_by_backend_and_says_why(env, fake_source, monkeypatch):
    monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
    for backend in ("cuda", "cpu", "vulkan"):  # vulkan is the newest
        build.build_llama(backend, quiet=True)
    gpus: set = set()
    monkeypatch.setattr(build, "gpu_present", lambda backend: backend in gpus)

    found = build.find_library()  # no GPU here: the CPU build, not the newest
    assert found.backend == "cpu" and "no cached GPU build" in found.chosen
    gpus.add("cuda")
    found = build.find_library()
    assert found.backend == "cuda" and found.chosen == "its GPU is present"
    assert build.find_library("vulkan").backend == "vulkan" and build.find_library("vulkan").chosen == "asked for vulkan"
    monkeypatch.setenv(build.ENV_BACKEND, "vulkan")
    assert build.find_library().backend == "vulkan" and build.find_library().chosen == f"{build.ENV_BACKEND}=vulkan"
    assert build.find_library("cpu").backend == "cpu"  # the argument wins over the variable
    report = build.doctor()
    assert report["backend"] == "vulkan" and report["backend_choice"] == f"{build.ENV_BACKEND}=vulkan"
    assert report["cached_backends"] == ["cpu", "cuda", "vulkan"]

    assert build.find_library("metal") is None
    assert any("no metal llama.cpp build" in m and "--backend metal" in m for m in build.doctor("metal")["missing"])
    monkeypatch.setenv(build.ENV_BACKEND, "rocm")
    with pytest.raises(UserError, match="unknown backend 'rocm'"):
        build.find_library()


def test_llama_tool_is_the_one_way_to_a_tool(env, fake_source, monkeypatch):
    from clover_gguf import quantize

    assert quantize.llama_tool is build.llama_tool
    with pytest.raises(UserError, match="llama-server not found.*build-llama"):
        build.llama_tool("llama-server")
    monkeypatch.setattr(build, "configure_and_build", fake_cmake([]))
    info = build.build_llama("cpu", quiet=True)
    for tool in build.TOOL_TARGETS:
        assert build.llama_tool(tool) == info.bin_dir / tool
    own = env["tmp"] / "own"  # a library folder of the user's own: its tools are next to libllama
    own.mkdir()
    (own / "libllama.so").write_bytes(b"x")
    (own / "llama-imatrix").write_text("#!/bin/sh\n")
    (own / "llama-imatrix").chmod(0o755)
    monkeypatch.setenv(build.ENV_LIB_PATH, str(own))
    assert build.llama_tool("llama-imatrix") == own / "llama-imatrix"
    with pytest.raises(UserError, match="llama-server not found"):
        build.llama_tool("llama-server")


@pytest.mark.parametrize("as_json", [False, True])
def test_doctor_exits_2_when_not_ready(env, as_json):
    cmd = [sys.executable, "-m", "clover_gguf", "doctor", *(["--json"] if as_json else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(build.__file__).resolve().parents[1])
    assert p.returncode == 2, p.stderr
    if as_json:
        report = json.loads(p.stdout)
        assert report["ok"] is False and report["missing"]
    else:
        assert p.stdout.splitlines()[-1] == "not ready"


@pytest.mark.parametrize("as_json", [False, True])
def test_doctor_exits_0_when_ready(monkeypatch, as_json):
    from typer.testing import CliRunner

    from clover_gguf.cli import app

    ready = {"ok": True, "library_path": "/x/bin", "backend": "cpu", "missing": [], "warnings": []}
    monkeypatch.setattr(build, "doctor", lambda backend=None: ready)
    result = CliRunner().invoke(app, ["doctor", *(["--json"] if as_json else [])])
    assert result.exit_code == 0 and (json.loads(result.output) == ready if as_json else "ok" in result.output)


def test_binding_check_is_full_unless_both_were_there(monkeypatch):
    """A cached build-llama must return in under a second: the import check in a fresh interpreter (0.4 s of CPU)
    runs when the binding or the build is new, a plain load of libllama otherwise."""
    checks: list = []
    monkeypatch.setattr(build, "check_binding", lambda info, full=True: checks.append(full))
    monkeypatch.setattr(build, "binding_version", lambda: llama_sdist.LLAMA_CPP_PYTHON_VERSION)
    info = build.BuildInfo(Path("/x"), Path("/x/bin"), "cpu", "h", "p", "s")
    build.install_binding(info, quiet=True)
    build.install_binding(build.dataclasses.replace(info, cached=True), quiet=True)
    assert checks == [True, False]
