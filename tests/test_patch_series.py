"""The llama.cpp patch series as an upstream reviewer receives it (docs/llama-cpp-patch.md): `git format-patch` files
that `git am` applies, one after the other, to the pinned tree and to the newer tree of llama_sdist.XLLAMACPP,
each with an author address, a date and a "module : description" subject; split as the review asked; no line of it
naming this project."""

from __future__ import annotations

import email
import re
import subprocess
from pathlib import Path

import pytest

from clover_gguf.build import cache_root, patch_files
from clover_gguf.llama_sdist import PINNED, XLLAMACPP, extract_llama_source, fetch_sdist

SUBJECT = re.compile(r"^\[PATCH \d+/\d+\] [a-z0-9_.-]+(?: [a-z0-9_.-]+)? : \S")
# the project's own names: a line the series adds must name llama.cpp's things, never ours
OURS = re.compile(r"clover[-_]gguf|our (?:driver|project|runtime|converter)", re.IGNORECASE)


def _message(p: Path) -> str:
    return p.read_text().split("\n---\n", 1)[0]


def _added(p: Path) -> list[str]:
    return [line for line in p.read_text().split("\n") if line.startswith("+") and not line.startswith("+++")]


def _files(p: Path) -> set[str]:
    return set(re.findall(r"^diff --git a/(\S+) b/", p.read_text(), re.M))


def _patch(name: str, source: str | None = None) -> Path:
    return next(p for p in patch_files(source=source) if name in p.name)


@pytest.mark.parametrize("source", [PINNED.name, XLLAMACPP.name])
def test_every_patch_is_a_mail_with_author_date_and_module_subject(source):
    patches = patch_files(source=source)
    assert len(patches) >= 8
    for p in patches:
        msg = email.message_from_string(_message(p).split("\n", 1)[1])  # after the "From <sha> <date>" line
        assert re.search(r"<[^@>\s]+@[^>\s]+>", msg["From"] or ""), (p.name, msg["From"])
        assert msg["Date"], p.name
        subject = " ".join((msg["Subject"] or "").split())
        assert SUBJECT.match(subject), (p.name, subject)


@pytest.mark.parametrize("source", [PINNED.name, XLLAMACPP.name])
def test_no_line_of_the_series_names_this_project(source):
    """Messages, code and comments speak of llama.cpp's things; the readings are named for their math."""
    for p in patch_files(source=source):
        hits = [line for line in _added(p) + _message(p).split("\n") if OURS.search(line)]
        assert not hits, (p.name, hits)


def test_the_series_is_split_as_the_review_asked():
    """The converter and GGUF keys, the core's per-sequence ubatch, the state versions and the model graph are each a
    patch of their own; the backport says it is a reimplementation."""
    keys, core = _files(_patch("gguf-diffusion-keys")), _files(_patch("llama-block-attention"))
    versions, model = _files(_patch("llama-state-file-magic")), _files(_patch("clover-moe-block-attention"))
    assert keys <= {"conversion/clover.py", "gguf-py/gguf/constants.py", "gguf-py/gguf/gguf_writer.py",
                    "src/llama-arch.h", "src/llama-arch.cpp"}, keys
    assert not any(f.startswith(("src/models/", "conversion/", "gguf-py/")) for f in core), core
    assert "src/llama-memory-hybrid.cpp" in core and "src/llama-batch.cpp" in core
    assert versions == {"include/llama.h", "src/llama-context.cpp", "src/llama-context.h", "tests/test-llama-archs.cpp"}
    assert model <= {"src/models/clover-moe.cpp", "src/models/models.h", "src/llama-model.h",
                     "tests/test-llama-archs.cpp"}, model
    # the block graph's float64 reference check is a test of its own, on the graph patch (review round 4, item 3)
    assert _files(_patch("tests-clover-moe-block-reference")) == {"tests/test-llama-archs.cpp"}
    # no architecture test in generic code: the saver and the core never name the model
    core_added = "\n".join(_added(_patch("llama-block-attention")))
    assert "CLOVER" not in core_added and "clover" not in core_added.lower().replace("clover_moe.", "")
    assert "reimplementation of the b12060 graph" in " ".join(_message(_patch("model-clover-moe")).split())


@pytest.mark.parametrize("source", [PINNED.name, XLLAMACPP.name])
def test_the_state_files_have_a_magic_of_their_own(source):
    """Review round 4: bumping the tree's state versions collided with upstream's next numbers (another layout) and
    invalidated every model's files. The hybrid memory's state with block attention flags gets its own magics and a
    version field of its own around the tree's version instead; the tree's versions are untouched, so one patch serves
    every tree (no per-tree copy)."""
    patches = patch_files(source=source)
    diff = _patch("llama-state-file-magic", source).read_text()
    assert not re.search(r"^[-+]#define LLAMA_(SESSION|STATE_SEQ)_VERSION ", diff, re.M)
    magics = dict(re.findall(r"^\+#define (LLAMA_FILE_MAGIC_\w+) (0x[0-9a-f]+)u", diff, re.M))
    assert set(magics) == {"LLAMA_FILE_MAGIC_GGSB", "LLAMA_FILE_MAGIC_GGQB"}
    # not a magic the tree already has ('ggsn', 'ggsq', 'ggla'): a build without the patch refuses these files
    assert not {int(v, 16) for v in magics.values()} & {0x6767736E, 0x67677371, 0x67676C61}
    assert re.search(r"^\+#define LLAMA_SESSION_VERSION_BLOCK .*LLAMA_SESSION_VERSION\)$", diff, re.M)
    assert all(p.parent == patch_files(source=PINNED.name)[0].parent for p in patches)


def _git(tree, *args):
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args], cwd=tree,
                          capture_output=True, text=True)  # fmt: skip


def _git_am(tree: Path, source: str) -> None:
    assert _git(tree, "init", "-q").returncode == 0
    assert _git(tree, "add", "-A").returncode == 0
    assert _git(tree, "commit", "-q", "-m", "base").returncode == 0
    patches = patch_files(source=source)
    am = _git(tree, "am", "-q", *map(str, patches))
    assert am.returncode == 0, am.stdout + am.stderr
    log = _git(tree, "log", "--format=%s", "-n", str(len(patches))).stdout.split("\n")[:-1]
    assert len(log) == len(patches)
    assert (tree / "src" / "models" / "clover-moe.cpp").is_file()


def test_git_am_applies_the_series_to_the_pinned_tree(tmp_path):
    tree = extract_llama_source(fetch_sdist(cache_root() / "sdist", quiet=True), tmp_path / "llama.cpp")
    _git_am(tree, PINNED.name)


@pytest.mark.slow
def test_git_am_applies_the_series_to_the_newer_tree(tmp_path):
    """The newer tree: xllamacpp's sdist (37 MB, fetched once into the cache and verified), the same series.
    Extracting and applying takes well under a minute; building it is not part of `make test`
    (docs/llama-cpp-patch.md, "A newer tree")."""
    sdist = fetch_sdist(cache_root() / "sdist", quiet=True, src=XLLAMACPP)
    _git_am(extract_llama_source(sdist, tmp_path / "llama.cpp", XLLAMACPP), XLLAMACPP.name)
