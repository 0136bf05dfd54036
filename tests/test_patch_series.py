"""The llama.cpp patch series as an upstream reviewer receives it (docs/llama-cpp-patch.md): `git format-patch` files
that `git am` applies, one after the other, to the pinned tree, each with an author address, a date and a
"module : description" subject."""

from __future__ import annotations

import email
import re
import subprocess

import pytest

from clover_gguf.build import cache_root, patch_files
from clover_gguf.llama_sdist import extract_llama_source, fetch_sdist

SUBJECT = re.compile(r"^\[PATCH \d+/\d+\] [a-z0-9_.-]+(?: [a-z0-9_.-]+)? : \S")


def test_every_patch_is_a_mail_with_author_date_and_module_subject():
    patches = patch_files()
    assert len(patches) >= 5
    for p in patches:
        head = p.read_text().split("\n---\n", 1)[0]
        msg = email.message_from_string(head.split("\n", 1)[1])  # after the "From <sha> <date>" line
        assert re.search(r"<[^@>\s]+@[^>\s]+>", msg["From"] or ""), (p.name, msg["From"])
        assert msg["Date"], p.name
        subject = " ".join((msg["Subject"] or "").split())
        assert SUBJECT.match(subject), (p.name, subject)


def _git(tree, *args):
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args], cwd=tree,
                          capture_output=True, text=True)  # fmt: skip


def test_git_am_applies_the_series_to_the_pinned_tree(tmp_path):
    tree = extract_llama_source(fetch_sdist(cache_root() / "sdist", quiet=True), tmp_path / "llama.cpp")
    assert _git(tree, "init", "-q").returncode == 0
    assert _git(tree, "add", "-A").returncode == 0
    assert _git(tree, "commit", "-q", "-m", "base").returncode == 0
    am = _git(tree, "am", "-q", *map(str, patch_files()))
    assert am.returncode == 0, am.stdout + am.stderr
    log = _git(tree, "log", "--format=%s", "-n", str(len(patch_files()))).stdout.split("\n")[:-1]
    assert len(log) == len(patch_files())
    assert (tree / "src" / "models" / "clover-moe.cpp").is_file()


@pytest.mark.parametrize("word", ["clover-gguf", "our driver", "our project"])
def test_the_block_attention_patch_names_no_project_of_ours_in_code(word):
    """Comments and code of the follow-up PR speak of llama.cpp's things, not of our project."""
    block = next(p for p in patch_files() if "block-attention" in p.name)
    added = [line for line in block.read_text().split("\n") if line.startswith("+") and not line.startswith("+++")]
    # the readings' names ("clover-gguf-1", ...) are the values of <arch>.block_reading, not a mention of us
    assert not [line for line in added if word in re.sub(r"clover-gguf-\d", "", line.lower())]
