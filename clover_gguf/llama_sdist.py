"""The pinned source: the llama-cpp-python 0.3.36 sdist, which vendors llama.cpp at commit 0c1e57098 (and the other
registry sdists that carry a llama.cpp tree `build-llama --source` can build: SOURCES).

It is fetched as a plain file from the package index pip uses (a PEP 503 simple page), written to a temporary name
and renamed only once its sha256 matches: nothing in it is run or unpacked before (`pip download` would run the
sdist's build backend to prepare its metadata). Out of the verified file come the llama.cpp tree that build.py
patches and builds, and the pure-Python binding.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import http.client
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from clover_gguf.errors import UserError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_TOP = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
SDIST_VENDOR_PREFIX = SDIST_TOP + "vendor/llama.cpp/"
LLAMA_CPP_COMMIT = "0c1e57098"
DEFAULT_INDEX_URL = "https://pypi.org/simple/"
ENV_SDIST = "CLOVER_GGUF_SDIST"


@dataclass(frozen=True)
class Source:
    """A registry sdist that carries a llama.cpp tree: `clover-gguf build-llama --source NAME`."""

    name: str  # what --source takes
    package: str  # its project on the index
    dist: str  # the sdist's file name stem ("llama_cpp_python" for llama-cpp-python)
    version: str
    sha256: str
    vendor: str  # the llama.cpp tree's folder inside the sdist's top folder
    commit: str  # llama.cpp's commit when the sdist names it, else the package (LLAMA_BUILD_COMMIT of the build)
    # where the tree's llama.h differs from the one llama-cpp-python 0.3.36's binding declares (the binding every
    # source runs with): (struct, the field after which, the new field, its ctypes type name); the runtime fits
    # the binding's structs to the library it loads (llama_context.load_binding)
    binding_fields: tuple[tuple[str, str, str, str], ...] = ()

    @property
    def sdist_name(self) -> str:
        return f"{self.dist}-{self.version}.tar.gz"

    @property
    def top(self) -> str:
        return f"{self.dist}-{self.version}/"

    @property
    def vendor_prefix(self) -> str:
        return self.top + self.vendor


# the pinned tree: CI's, and every build's unless --source names another
PINNED = Source("llama-cpp-python-0.3.36", "llama-cpp-python", "llama_cpp_python", LLAMA_CPP_PYTHON_VERSION,
                SDIST_SHA256, "vendor/llama.cpp/", LLAMA_CPP_COMMIT)
# the newest llama.cpp tree on the registry when the series was last carried forward (docs/llama-cpp-patch.md,
# "A newer tree"): xllamacpp's sdist vendors the tree (dated 2026-10-10, newer than the pinned one; no b12060 yet)
XLLAMACPP = Source("xllamacpp-2026.10.11549", "xllamacpp", "xllamacpp", "2026.10.11549",
                   "c17ee1163006f70726abb9f72137830818f3d8cb60bfc34cb232d08428eaa22b", "thirdparty/llama.cpp/",
                   "xllamacpp-2026.10.11549",
                   binding_fields=(("llama_context_params", "type_v", "moe_cache_size", "c_size_t"),))
SOURCES = {s.name: s for s in (PINNED, XLLAMACPP)}


def source(name: str | None) -> Source:
    """The source called `name` (None: the pinned one); one line naming the known ones otherwise."""
    if name is None or name == PINNED.name:
        return PINNED
    if name not in SOURCES:
        raise UserError(f"unknown llama.cpp source {name!r}: choose one of {', '.join(SOURCES)}")
    return SOURCES[name]


def source_of_sha256(digest: str | None) -> Source | None:
    """The source whose sdist has this sha256 (a build stamp's), None for none."""
    return next((s for s in SOURCES.values() if _sha256_of(s) == digest), None)


def _sha256_of(src: Source) -> str:
    # the pinned sdist's digest is the module's SDIST_SHA256 (read at call time: tests replace it)
    return SDIST_SHA256 if src.name == PINNED.name else src.sha256


def _name_of(src: Source) -> str:
    return SDIST_NAME if src.name == PINNED.name else src.sdist_name


def fetch_sdist(folder: Path, quiet: bool = False, src: Source = PINNED) -> Path:
    """Path of the verified sdist of `src`: $CLOVER_GGUF_SDIST (the pinned one only), else the copy in `folder`, else
    a download into `folder`."""
    override = os.environ.get(ENV_SDIST) if src.name == PINNED.name else None
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UserError(f"{ENV_SDIST} does not name a file: {path}")
        verify_sdist(path)
        return path
    name = _name_of(src)
    target = Path(folder) / name
    if target.is_file():
        verify_sdist(target, hint=f"delete {target} to download it again", src=src)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    url = sdist_url(index_url(), src)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=target.parent)
    try:
        from tqdm import tqdm

        with os.fdopen(fd, "wb") as out, _open_url(url) as resp:
            size = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=size, unit="B", unit_scale=True, desc=name, disable=quiet, file=sys.stderr) as bar:
                for chunk in iter(lambda: resp.read(1 << 20), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
        verify_sdist(Path(tmp), hint=f"downloaded from {url}", src=src)
        os.replace(tmp, target)
    except (OSError, http.client.HTTPException) as e:
        raise UserError(f"could not download {url}: {e} (or set {ENV_SDIST}=path/to/{SDIST_NAME})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def index_url() -> str:
    """The package index pip would use: $PIP_INDEX_URL, else the index-url of pip's configuration, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        found = re.search(r"^(?:download|global|install)\.index-url='([^']+)'", config.stdout, re.M)
        url = found.group(1) if found else DEFAULT_INDEX_URL
    return url.rstrip("/") + "/"


def _open_url(url: str):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "clover-gguf"}), timeout=60)
    except (OSError, ValueError) as e:
        raise UserError(f"could not download {url}: {e} (or set {ENV_SDIST}=path/to/{SDIST_NAME})") from None


def sdist_url(index: str, src: Source = PINNED) -> str:
    """The sdist's address, read from the project's page on a PEP 503 simple index."""
    page = index + src.package + "/"
    name = _name_of(src)
    with _open_url(page) as resp:
        text = resp.read().decode("utf-8", errors="replace")
    for href in re.findall(r"""href\s*=\s*["']([^"']+)["']""", text):
        url = urllib.parse.urldefrag(urllib.parse.urljoin(page, html.unescape(href)))[0]
        if urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] == name:
            return url
    raise UserError(f"{page} does not list {name} (or set {ENV_SDIST}=path/to/{SDIST_NAME})")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sdist(path: Path, hint: str = "", src: Source = PINNED) -> None:
    digest, want = sha256_file(path), _sha256_of(src)
    if digest != want:
        extra = f"; {hint}" if hint else ""
        raise UserError(f"sha256 mismatch for {path}: got {digest}, expected {want}{extra}")


def extract_llama_source(sdist: Path, dest: Path, src: Source = PINNED) -> Path:
    """Extract the sdist's llama.cpp tree (vendor/llama.cpp of the pinned one) into dest (created; must not exist).
    Returns dest. Its `.git` (a file pointing at a submodule folder the sdist does not have) is left out: it makes
    git and cmake's build-info treat the tree as a broken repository."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = _vendor_members(tar, lambda rel: rel != ".git" and not rel.startswith(".git/"), src)
        if not members:
            raise UserError(f"{sdist} has no {src.vendor_prefix} folder")
        _safe_extract(tar, members, dest)
    return dest


def extract_llama_headers(sdist: Path, dest: Path, src: Source = PINNED) -> Path:
    """Extract only the public headers of the sdist's llama.cpp tree (include/, ggml/include/) into dest (created;
    must not exist): what libclover_sampler compiles against. Returns dest."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = _vendor_members(tar, lambda rel: rel.startswith(("include/", "ggml/include/")), src)
        if not members:
            raise UserError(f"{sdist} has no {src.vendor_prefix}include folder")
        _safe_extract(tar, members, dest)
    return dest


def _vendor_members(tar: tarfile.TarFile, keep: Callable[[str], bool], src: Source = PINNED
                    ) -> list[tarfile.TarInfo]:
    """The members under the llama.cpp tree's folder whose path relative to it `keep` accepts, renamed to it."""
    prefix = SDIST_VENDOR_PREFIX if src.name == PINNED.name else src.vendor_prefix
    members = []
    for m in tar.getmembers():
        rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
        if rel and keep(rel):
            m.name = rel
            members.append(m)
    return members


def extract_binding_source(sdist: Path, dest: Path) -> Path:
    """Extract the sdist without vendor/ (the binding is pure Python when LLAMA_BUILD=OFF). Returns its root."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(SDIST_TOP)
                   and not m.name.startswith(SDIST_TOP + "vendor/")]  # fmt: skip
        _safe_extract(tar, members, Path(dest))
    return Path(dest) / SDIST_TOP.rstrip("/")


def _safe_extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:  # pragma: no cover - only on old Pythons without extraction filters
        target = (dest / m.name).resolve()
        link = (target.parent / m.linkname).resolve() if m.issym() or m.islnk() else target
        if root not in target.parents or (link != target and root not in link.parents):
            raise UserError(f"refusing to extract {m.name!r}: it leaves the target folder")
    tar.extractall(dest, members=members)


CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def extract_converter_source(sdist: Path, dest: Path) -> Path:
    """Extract the pinned tree's own converter (convert_hf_to_gguf.py, conversion/, gguf-py/) into dest (created;
    must not exist). Returns dest."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = _vendor_members(tar, lambda rel: rel == CONVERTER_PARTS[0] or rel.startswith(CONVERTER_PARTS[1:]))
        _safe_extract(tar, members, dest)
    if not (dest / CONVERTER_PARTS[0]).is_file():
        raise UserError(f"{sdist} has no {SDIST_VENDOR_PREFIX}{CONVERTER_PARTS[0]}")
    return dest
