"""Fast tests of the llama.cpp build pipeline: no network, no real cmake build."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from clover_gguf import build
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
    monkeypatch.delenv(build.ENV_SDIST, raising=False)
    return {"cache": cache, "patches": patches, "tmp": tmp_path}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_fake_sdist(path: Path, stray_git: bool = True) -> str:
    """A tiny sdist-shaped tarball; returns its sha256."""
    top = f"llama_cpp_python-{build.LLAMA_CPP_PYTHON_VERSION}"
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, f"{top}/pyproject.toml", b"[project]\nname='x'\n")
        _add(tar, f"{top}/vendor/llama.cpp/CMakeLists.txt", b"project(llama)\n")
        _add(tar, f"{top}/vendor/llama.cpp/include/llama.h", b"int llama(void);\n")
        _add(tar, f"{top}/vendor/llama.cpp/src/a.cpp", b"line 1\nline 2\nline 3\n")
        if stray_git:
            _add(tar, f"{top}/vendor/llama.cpp/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n")
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
        return bin_dir

    return run


@pytest.fixture
def fake_source(env, monkeypatch):
    sdist = env["tmp"] / build.SDIST_NAME
    digest = make_fake_sdist(sdist)
    monkeypatch.setenv(build.ENV_SDIST, str(sdist))
    monkeypatch.setattr(build, "SDIST_SHA256", digest)
    monkeypatch.setattr(build, "_check_tools", lambda backend: None)
    monkeypatch.setattr(build, "_shared_lib_name", lambda base: f"lib{base}.so")
    return sdist


# ------------------------------------------------------------------------------------------------------------ hashes


def test_build_hash_stable_and_sensitive(tmp_path):
    p1, p2 = tmp_path / "0001-a.patch", tmp_path / "0002-b.patch"
    p1.write_bytes(b"patch one\n")
    p2.write_bytes(b"patch two\n")
    opts = build.cmake_options("cpu")
    h = build.build_hash("sdist:x", [p1, p2], "cpu", opts)

    assert h == build.build_hash("sdist:x", [p1, p2], "cpu", list(opts))  # stable
    assert len(h) == 64
    assert build.build_hash("sdist:x", [p1, p2], "cuda", build.cmake_options("cuda")) != h
    assert build.build_hash("sdist:x", [p1, p2], "cuda", opts) != h  # the backend itself is hashed
    assert build.build_hash("git:abc", [p1, p2], "cpu", opts) != h
    assert build.build_hash("sdist:x", [p2, p1], "cpu", opts) != h  # order matters
    assert build.build_hash("sdist:x", [p1], "cpu", opts) != h
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts + ["-DX=1"]) != h

    ph = build.patch_hash([p1, p2])
    p2.write_bytes(b"patch twO\n")  # one byte changed
    assert build.build_hash("sdist:x", [p1, p2], "cpu", opts) != h
    assert build.patch_hash([p1, p2]) != ph


def test_hash_has_no_concatenation_ambiguity(tmp_path):
    a, b = tmp_path / "a.patch", tmp_path / "b.patch"
    a.write_bytes(b"ab")
    b.write_bytes(b"c")
    c, d = tmp_path / "c.patch", tmp_path / "d.patch"
    c.write_bytes(b"a")
    d.write_bytes(b"bc")
    assert build.patch_hash([a, b]) != build.patch_hash([c, d])


def test_cmake_options_per_backend():
    assert "-DGGML_CUDA=ON" in build.cmake_options("cuda")
    assert "-DGGML_METAL=ON" in build.cmake_options("metal")
    assert "-DGGML_VULKAN=ON" in build.cmake_options("vulkan")
    cpu = build.cmake_options("cpu")
    assert "-DBUILD_SHARED_LIBS=ON" in cpu and "-DGGML_NATIVE=ON" in cpu
    assert not any("CUDA" in o or "METAL" in o or "VULKAN" in o for o in cpu)
    with pytest.raises(UserError, match="unknown backend"):
        build.cmake_options("rocm")


def test_patch_files_sorted(env):
    for name in ("0002-b.patch", "0001-a.patch", "notes.txt", "0010-c.patch"):
        (env["patches"] / name).write_text("x")
    assert [p.name for p in build.patch_files()] == ["0001-a.patch", "0002-b.patch", "0010-c.patch"]


# ------------------------------------------------------------------------------------------------------------- sdist


def test_sdist_sha256_mismatch_is_user_error(env, monkeypatch):
    bogus = env["tmp"] / build.SDIST_NAME
    bogus.write_bytes(b"not the real sdist")
    monkeypatch.setenv(build.ENV_SDIST, str(bogus))
    with pytest.raises(UserError, match="sha256 mismatch"):
        build.fetch_sdist()


def test_cached_sdist_is_verified_too(env):
    cached = env["cache"] / "sdist" / build.SDIST_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupt")
    with pytest.raises(UserError, match="sha256 mismatch") as e:
        build.fetch_sdist()
    assert "\n" not in str(e.value)


def test_sdist_good_hash_accepted(env, fake_source):
    assert build.fetch_sdist() == fake_source


# ------------------------------------------------------------------------------------------------------ stray .git


def test_extract_removes_stray_git_file(env, fake_source):
    dest = env["tmp"] / "src"
    build.extract_llama_source(fake_source, dest)
    assert (dest / "CMakeLists.txt").is_file()
    assert (dest / "src" / "a.cpp").read_text().startswith("line 1")
    assert not (dest / ".git").exists()
    assert not (dest / "pyproject.toml").exists()  # only vendor/llama.cpp is extracted


def test_remove_stray_git_keeps_real_repositories(tmp_path):
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    assert build.remove_stray_git(stray) is True
    assert not (stray / ".git").exists()

    pointing = tmp_path / "pointing"
    (tmp_path / "real-gitdir").mkdir()
    pointing.mkdir()
    (pointing / ".git").write_text("gitdir: ../real-gitdir\n")
    assert build.remove_stray_git(pointing) is False
    assert (pointing / ".git").is_file()

    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    assert build.remove_stray_git(repo) is False
    assert (repo / ".git").is_dir()


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

    monkeypatch.setenv(build.ENV_SDIST, str(env["tmp"] / "gone.tar.gz"))  # a cache hit needs no source at all
    second = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu"]  # nothing rebuilt
    assert second.cached is True and second.prefix == first.prefix and second.build_hash == first.build_hash

    monkeypatch.setenv(build.ENV_SDIST, str(fake_source))
    other = build.build_llama("vulkan", jobs=1, quiet=True)
    assert calls == ["cpu", "vulkan"] and other.prefix != first.prefix

    (env["patches"] / "0001-x.patch").write_bytes(git_patch("line 1\nline 2\nline 3\n", "line 1\nAGAIN\nline 3\n"))
    third = build.build_llama("cpu", jobs=1, quiet=True)
    assert calls == ["cpu", "vulkan", "cpu"] and third.prefix != first.prefix


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


def test_find_library_and_doctor(env, fake_source, monkeypatch):
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
    (env["patches"] / "0001-new.patch").write_text("diff")
    assert build.find_library() is None
    assert any("other patches" in m for m in build.doctor()["missing"])


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


@needs_git
def test_source_checkout_must_be_pinned_commit(tmp_path):
    repo = tmp_path / "llama.cpp"
    (repo / "include").mkdir(parents=True)
    (repo / "CMakeLists.txt").write_text("project(x)\n")
    (repo / "include" / "llama.h").write_text("\n")
    with pytest.raises(UserError, match="not a git checkout"):
        build.source_commit(repo)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], cwd=repo, check=True)
    with pytest.raises(UserError, match=build.LLAMA_CPP_COMMIT):
        build.source_commit(repo)
