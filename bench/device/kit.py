"""The GPU check's kit: everything bench/device/run.sh needs on a machine without network (docs/gpu.md).

    python bench/device/kit.py pack KIT [--update]     (bench/device/pack.sh KIT [--update])

KIT is a new folder that git ignores (the device tool carries ignored paths only when named; at most 60 MiB):

    kit.json             what is inside: llama.cpp commit, sdist sha256, patches and their hash, project commit, sizes
    llama.cpp.tar.xz     the pinned llama.cpp tree from the verified sdist, our patches applied, trimmed to what a CPU
                         or CUDA build configures and compiles (TRIM_TOP / TRIM_BACKENDS say what is left out)
    binding.tar.xz       llama_cpp/: llama-cpp-python's pure-Python binding from the same sdist (it loads libllama
                         from $LLAMA_CPP_LIB_PATH)
    project.tar.xz       clover_gguf/ (the bundled model included), bench/, tests/, patches/, pyproject.toml, as in
                         this working tree (tracked and untracked-not-ignored files)
    wheels/*.whl         what the project and the binding import that the device image lacks (WHEELS), at the
                         versions installed here

The sdist is the one clover_gguf.build uses (fetched once, sha256-checked), extracted and patched by the same functions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from clover_gguf import build, llama_sdist  # noqa: E402
from clover_gguf.errors import UserError  # noqa: E402

MAX_KIT_BYTES = 60 * 2**20
XZ_PRESET = 1  # 6x faster than xz's default here, and the llama.cpp tree is 7.4 MB instead of 6.4
# Top-level entries of the llama.cpp tree that no build of ours reads: models (test vocabularies), docs, examples and
# pocs (LLAMA_BUILD_EXAMPLES=OFF), app (LLAMA_BUILD_APP=OFF), the Python converters, CI and editor files. What is kept
# (CMakeLists.txt, cmake/, ggml/, src/, include/, common/, tools/, tests/, vendor/, licenses) is added by the top-level
# CMakeLists.txt and must exist at configure time; scripts/ keeps its *.cmake (tools/ui runs one).
TRIM_TOP = ("models", "docs", "examples", "pocs", "app", "benches", "conversion", "gguf-py", "media", "grammars",
            "requirements", "ci", "skills", ".github", ".devops")
# ggml backends we never build here: ggml/src/CMakeLists.txt adds a backend's folder only when its GGML_<NAME> option
# is on, so these are never read. Kept: ggml-cpu, ggml-cuda, ggml-rpc (GGML_RPC=ON in every build of ours).
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")
# the project's files the device runs (its own copy of this repository)
PROJECT_PATHS = ("clover_gguf", "bench", "tests", "patches", "quant_recipes", "pyproject.toml", "README.md",
                 "Makefile")
# imported by the project (gguf) or by llama-cpp-python's binding (diskcache) and missing from the device image
WHEELS = ("gguf", "diskcache")


def _tar_xz(src_dir: Path, arcname: str, out: Path) -> None:
    with tarfile.open(out, "w:xz", preset=XZ_PRESET) as tar:
        tar.add(src_dir, arcname=arcname, filter=_no_bytecode)


def _no_bytecode(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = info.name.rsplit("/", 1)[-1]
    if name == "__pycache__" or name.endswith(".pyc"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def trim_llama_tree(tree: Path) -> list[str]:
    """Remove what no CPU or CUDA build reads (TRIM_TOP, other backends, non-cmake scripts); returns what went."""
    removed = []
    for name in TRIM_TOP:
        p = tree / name
        if p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(name)
    for p in sorted(tree.glob("*.py")):  # convert_hf_to_gguf.py and friends
        p.unlink()
        removed.append(p.name)
    for p in sorted((tree / "ggml" / "src").iterdir()):
        if p.is_dir() and p.name.startswith("ggml-") and p.name not in KEEP_BACKENDS:
            shutil.rmtree(p)
            removed.append(f"ggml/src/{p.name}")
    scripts = tree / "scripts"
    if scripts.is_dir():
        for p in sorted(scripts.rglob("*")):
            if p.is_file() and p.suffix != ".cmake":
                p.unlink()
        removed.append("scripts/ (all but *.cmake)")
    return removed


def project_files(root: Path = ROOT) -> list[str]:
    """Tracked and untracked-not-ignored files of PROJECT_PATHS, the same set the device tool copies."""
    proc = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *PROJECT_PATHS], cwd=root,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"git ls-files failed in {root}: {proc.stderr.strip()}")
    return sorted(f for f in proc.stdout.split("\0") if f and ((root / f).exists() or (root / f).is_symlink()))


def project_commit(root: Path = ROOT) -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *PROJECT_PATHS], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def download_wheels(dest: Path) -> list[str]:
    """Pure-Python wheels of WHEELS at the versions installed in this interpreter (the versions our tests run)."""
    specs = []
    for name in WHEELS:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"{name} is not installed here: pack with the project's venv (make venv)") from None
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--dest", str(dest), *specs], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"pip download {' '.join(specs)} failed: {build.last_error_line(proc.stderr)}")
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    if len(wheels) != len(WHEELS) or not all(w.endswith("-py3-none-any.whl") for w in wheels):
        raise UserError(f"expected one pure-Python wheel per package of {WHEELS}, got {wheels}")
    return wheels


def _reusable_parts(kit: Path, patches: list[Path]) -> list[str]:
    """The parts of an existing kit that --update can keep: the llama.cpp tree, binding and wheels, when it was made
    from the same sdist and patches and with the same wheel versions as a pack now would."""
    try:
        old = json.loads((kit / "kit.json").read_text())
    except (OSError, ValueError):
        return []
    want_wheels = {f"{n}-{importlib.metadata.version(n)}" for n in WHEELS}
    same = (old.get("sdist_sha256") == llama_sdist.SDIST_SHA256 and old.get("patch_hash") == build.patch_hash(patches)
            and {w.split("-py3")[0] for w in old.get("wheels", [])} == want_wheels)
    parts = ["llama.cpp.tar.xz", "binding.tar.xz", "wheels"]
    return parts if same and all((kit / p).exists() for p in parts) else []


def pack(kit: Path, quiet: bool = False, update: bool = False) -> dict:
    """Make the kit; with update=True an existing kit is replaced, keeping the parts that did not change (a new
    project snapshot takes seconds, the llama.cpp tree a minute or two)."""
    kit = Path(kit)
    if kit.exists() and not update:
        raise UserError(f"{kit} exists: remove it, name a new folder, or --update it")
    if kit.resolve().is_relative_to(ROOT):  # the device tool copies this tree; the kit must travel only when carried
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(kit.resolve())], cwd=ROOT)
        if ignored.returncode != 0:
            raise UserError(f"{kit} is not ignored by git: use a folder under out/ (e.g. out/device-kit)")
    t0 = time.monotonic()
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    patches = build.patch_files()
    keep = _reusable_parts(kit, patches) if update and kit.exists() else []
    kit.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{kit.name}-", dir=kit.parent))  # renamed into place when complete
    try:
        with tempfile.TemporaryDirectory(prefix="clover-kit-") as tmp:
            tmp = Path(tmp)
            if keep:
                say(f"keeping {', '.join(keep)} of {kit} (same sdist, patches and wheel versions)")
                for part in keep:
                    (shutil.copytree if (kit / part).is_dir() else shutil.copy2)(kit / part, stage / part)
                removed = json.loads((kit / "kit.json").read_text())["trimmed"]
            else:
                sdist = llama_sdist.fetch_sdist(build.cache_root() / "sdist", quiet=quiet)
                say(f"llama.cpp {llama_sdist.LLAMA_CPP_COMMIT}: extracting, applying {len(patches)} patch(es), "
                    f"trimming")
                tree = llama_sdist.extract_llama_source(sdist, tmp / "llama.cpp")
                build.apply_patches(tree, patches)
                removed = trim_llama_tree(tree)
                _tar_xz(tree, "llama.cpp", stage / "llama.cpp.tar.xz")
                say("binding: llama_cpp/ from the same sdist")
                binding_root = llama_sdist.extract_binding_source(sdist, tmp / "binding")
                _tar_xz(binding_root / "llama_cpp", "llama_cpp", stage / "binding.tar.xz")
            say(f"project: {', '.join(PROJECT_PATHS)}")
            files = project_files()
            with tarfile.open(stage / "project.tar.xz", "w:xz", preset=XZ_PRESET) as tar:
                for f in files:
                    tar.add(ROOT / f, arcname=f"project/{f}", recursive=False, filter=_no_bytecode)
        if "wheels" in keep:
            wheels = sorted(p.name for p in (stage / "wheels").glob("*.whl"))
        else:
            say(f"wheels: {', '.join(WHEELS)}")
            (stage / "wheels").mkdir()
            wheels = download_wheels(stage / "wheels")
        sizes = {str(p.relative_to(stage)): p.stat().st_size for p in sorted(stage.rglob("*")) if p.is_file()}
        total = sum(sizes.values())
        manifest = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "llama_cpp_commit": llama_sdist.LLAMA_CPP_COMMIT,
            "sdist": llama_sdist.SDIST_NAME,
            "sdist_sha256": llama_sdist.SDIST_SHA256,
            "patches": [p.name for p in patches],
            "patch_hash": build.patch_hash(patches),
            "trimmed": removed,
            "project_commit": project_commit(),
            "project_files": len(files),
            "wheels": wheels,
            "bytes": sizes,
            "total_bytes": total,
        }
        (stage / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
        total += (stage / "kit.json").stat().st_size
        if total > MAX_KIT_BYTES:
            raise UserError(f"the kit is {total / 2**20:.1f} MiB, over the {MAX_KIT_BYTES / 2**20:.0f} MiB limit")
        if kit.exists():
            shutil.rmtree(kit)
        os.replace(stage, kit)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    manifest["total_bytes"] = total
    for name, size in sizes.items():
        say(f"  {size / 2**20:7.2f} MiB  {name}")
    print(f"kit {kit}: {total / 2**20:.1f} MiB ({total} bytes; limit {MAX_KIT_BYTES / 2**20:.0f} MiB), "
          f"made in {time.monotonic() - t0:.0f} s")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="make the kit folder")
    p.add_argument("kit", type=Path)
    p.add_argument("--update", action="store_true", help="replace an existing kit, keeping its unchanged parts")
    p.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            pack(a.kit, quiet=a.quiet, update=a.update)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
