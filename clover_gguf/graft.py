"""`clover-gguf graft`: the block-mode tensors and keys added to an AR-only clover_moe GGUF.

The official GGUFs (and every file upstream's converter writes) hold Clover's causal model only: upstream drops the
four block tensors. Graft reads just those tensors (a few MB in the 35B: 30 GDN layers x (conv_dim x Kr + 3 x 32)
floats) plus the headers from the checkpoint, a local folder or a Hugging Face repo (ranged reads: never the 69 GB),
converts them as `convert` does (tensor_map's transforms), and writes a new GGUF whose every other tensor is copied
byte for byte from the input, so a quantized file stays exactly as quantized. The keys are the ones `convert`
writes for block mode (convert.block_mode_keys). The output appears whole or not at all.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from clover_gguf.checkpoint import SAFETENSORS_DTYPES, normalise_name, parse_shard_header
from clover_gguf.config import CloverConfig, generation_defaults
from clover_gguf.errors import UserError
from clover_gguf.metadata import ARCH, GenerationDefaults, MASK_TOKEN_ID, hparam
from clover_gguf.tensor_map import TENSOR_RULES, TRANSFORMS, match_rule

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BLOCK_RULES = [r for r in TENSOR_RULES if r.clover_extra]


class LocalSource:
    """A checkpoint folder."""

    def __init__(self, folder: Path):
        self.folder, self.bytes_read = Path(folder), 0
        self.label = str(folder)

    def size(self, name: str) -> int | None:
        p = self.folder / name
        return p.stat().st_size if p.is_file() else None

    def read(self, name: str, offset: int = 0, n: int | None = None) -> bytes:
        try:
            with open(self.folder / name, "rb") as f:
                f.seek(offset)
                data = f.read() if n is None else f.read(n)
        except OSError as e:
            raise UserError(f"cannot read {self.folder / name}: {e.strerror or e}") from None
        self.bytes_read += len(data)
        return data


class HubSource:
    """A Hugging Face repo, read by HTTP range requests (huggingface_hub gives the URLs, $HF_ENDPOINT, the token)."""

    def __init__(self, repo_id: str, revision: str | None = None):
        try:
            from huggingface_hub import hf_hub_url
            from huggingface_hub.utils import build_hf_headers
        except ImportError:
            raise UserError("reading a checkpoint from the Hub needs huggingface_hub: `pip install huggingface_hub` (in a "
                            "checkout of clover-gguf: `pip install '.[hub]'`)") from None
        self.repo_id, self.revision, self.bytes_read = repo_id, revision, 0
        self.label = repo_id
        self._url = lambda name: hf_hub_url(repo_id, name, revision=revision)
        self._headers = build_hf_headers()
        self._sizes: dict[str, int | None] = {}

    def _get(self, name: str, start: int, end: int | None) -> tuple[bytes, int | None]:
        import urllib.error
        import urllib.request

        rng = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
        req = urllib.request.Request(self._url(name), headers={**self._headers, "Range": rng})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                data = r.read()
                total = r.headers.get("Content-Range", "").rpartition("/")[2]
                if r.status == 200 and (start or end is not None):  # the server ignored the range
                    data = data[start:end]
        except urllib.error.HTTPError as e:
            if e.code in (404, 416):
                return b"", None
            raise UserError(f"{self.repo_id}/{name}: the Hub answered {e.code} {e.reason}"
                            + (" (a gated or private repo needs `huggingface-cli login`)" if e.code in (401, 403)
                               else "")) from None
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"cannot reach the Hub for {self.repo_id}: {getattr(e, 'reason', e)}") from None
        self.bytes_read += len(data)
        return data, int(total) if total.isdigit() else None

    def size(self, name: str) -> int | None:
        if name not in self._sizes:
            data, total = self._get(name, 0, 1)
            self._sizes[name] = total if total is not None else (len(data) or None)
        return self._sizes[name]

    def read(self, name: str, offset: int = 0, n: int | None = None) -> bytes:
        data, _ = self._get(name, offset, None if n is None else offset + n)
        return data


def open_source(spec: str, revision: str | None = None) -> LocalSource | HubSource:
    p = Path(spec).expanduser()
    if p.is_dir():
        return LocalSource(p)
    if p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UserError(f"--from {spec}: not a checkpoint folder, nor a Hugging Face repo id (owner/name)")
    return HubSource(spec, revision)


def _json(src, name: str, required: bool = True) -> Any:
    if src.size(name) is None:
        if required:
            raise UserError(f"{src.label} has no {name}")
        return None
    try:
        return json.loads(src.read(name).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{src.label}/{name} is not valid JSON") from None


def block_tensor_refs(src) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
    """normalised HF name -> (shard, dtype, shape, begin, end) for every block-mode tensor of the checkpoint: only
    the index (or the one shard's header) is read."""
    index = _json(src, INDEX, required=False)
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise UserError(f"{src.label}/{INDEX} has no weight_map")
        shards = sorted({f for n, f in weight_map.items() if isinstance(n, str) and _is_block(n)})
    elif src.size(SINGLE) is not None:
        shards = [SINGLE]
    else:
        raise UserError(f"{src.label} has neither {INDEX} nor {SINGLE}")
    refs = {}
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
            raise UserError(f"{src.label}/{INDEX} names a shard {shard!r}: shard names are file names")
        size = src.size(shard)
        if size is None:
            raise UserError(f"{src.label} has no shard {shard}")
        for name, dtype, shape, b, e in parse_shard_header(Path(shard), lambda o, n, s=shard: src.read(s, o, n), size):
            norm = normalise_name(name)
            if norm is not None and _is_block(norm):
                refs[norm] = (shard, dtype, shape, b, e)
    return refs


def _is_block(name: str) -> bool:
    hit = match_rule(normalise_name(name) or "")
    return hit is not None and hit[0].clover_extra


@dataclass
class GraftResult:
    out: Path
    source: str
    added_tensors: int
    bytes_read: int
    seconds: float
    peak_rss_mib: float
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "source": self.source, "added_tensors": self.added_tensors,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
                "peak_rss_mib": round(self.peak_rss_mib, 1), "size_bytes": self.size_bytes}

    def summary(self) -> str:
        return (f"wrote {self.out}: {self.added_tensors} block-mode tensors added from {self.source} "
                f"({self.bytes_read / 2**20:.2f} MiB read, {self.seconds:.1f} s, peak RSS {self.peak_rss_mib:.0f} MiB), "
                f"{self.size_bytes / 2**30:.3f} GiB")


def _check_same_model(h, cfg: CloverConfig) -> None:
    """The checkpoint must be the GGUF's model: the widths the block tensors depend on agree."""
    want = {"embedding_length": cfg.hidden_size, "ssm.inner_size": cfg.value_dim,
            "ssm.time_step_rank": cfg.linear_num_value_heads, "ssm.group_count": cfg.linear_num_key_heads,
            "ssm.state_size": cfg.linear_key_head_dim}
    for key, value in want.items():
        if h.kv.get(hparam(key)) != value:
            raise UserError(f"the checkpoint is not this GGUF's model: {hparam(key)} is {h.kv.get(hparam(key))}, "
                            f"config.json implies {value}")
    n_blocks = h.kv.get(hparam("block_count"))
    if not isinstance(n_blocks, int) or n_blocks < cfg.num_hidden_layers:
        raise UserError(f"the checkpoint is not this GGUF's model: {hparam('block_count')} is {n_blocks}, "
                        f"config.json has {cfg.num_hidden_layers} layers")


def graft(src: Path, from_: str, out: Path, revision: str | None = None, force: bool = False, quiet: bool = False,
          log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> GraftResult:
    from clover_gguf.convert import block_mode_keys, right_kernel_from_shapes
    from clover_gguf.export import copy_gguf
    from clover_gguf.gguf_header import check_model, read_header
    from clover_gguf.tensor_map import CLOVER_EXTRA_RE

    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    try:
        h = read_header(src, full=True)
    except UserError as e:
        raise UserError(f"{src} is not a readable GGUF file ({e})") from None
    check_model(h)  # an old `clover` file: convert again
    if h.arch != ARCH:
        raise UserError(f"{src} is a {h.arch!r} GGUF: graft takes a {ARCH} file (the official GGUFs, export-ar)")
    if any(CLOVER_EXTRA_RE.match(n) for n in h.tensors):
        raise UserError(f"{src} already has the block-mode tensors")

    source = open_source(from_, revision)
    cfg = CloverConfig.from_dict(_json(source, "config.json"))
    if not cfg.is_clover:
        raise UserError(f"{source.label} is not a Clover checkpoint (model_type {cfg.model_type!r})")
    gen_raw = _json(source, "generation_config.json", required=False)
    gen = GenerationDefaults() if gen_raw is None else \
        generation_defaults(gen_raw, where=f"{source.label}: generation_config.json")
    refs = block_tensor_refs(source)
    cfg = right_kernel_from_shapes({n: r[2] for n, r in refs.items()}, cfg)
    _check_same_model(h, cfg)

    added: dict[str, np.ndarray] = {}
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_full_attention(layer):
            continue
        for rule in BLOCK_RULES:
            name = rule.hf.format(i=layer)
            if name not in refs:
                raise UserError(f"{source.label} lacks tensor {name} (layer {layer} is a GDN layer)")
            shard, dtype, shape, b, e = refs[name]
            if not rule.accepts(shape, cfg):
                raise UserError(f"tensor {name} has shape {list(shape)}, config.json implies "
                                f"{list(rule.hf_shape(cfg))}")
            if dtype not in ("F32", "F16", "BF16"):
                raise UserError(f"tensor {name} has unsupported dtype {dtype} (supported: F32, F16, BF16)")
            raw = np.frombuffer(source.read(shard, b, e - b), dtype=SAFETENSORS_DTYPES[dtype]).reshape(shape)
            a = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
            added[rule.gguf.format(i=layer)] = np.ascontiguousarray(TRANSFORMS[rule.transform](a, cfg),
                                                                    dtype=np.float32)

    keys = block_mode_keys(cfg, gen)
    if MASK_TOKEN_ID not in h.kv:
        if cfg.mask_token_id is None:
            raise UserError(f"neither {src.name} nor the checkpoint's config.json has a mask token id: block mode "
                            "needs one")
        from clover_gguf.gguf_header import U32

        keys[MASK_TOKEN_ID] = (U32, cfg.mask_token_id)
    if not quiet:
        log(f"graft: {len(added)} block-mode tensors read from {source.label} ({source.bytes_read / 2**20:.2f} MiB)")
    copy_gguf(h, src, out, keep=list(h.tensors), drop_keys=set(keys), add_keys=keys, add_tensors=added,
              force=force, quiet=quiet, desc="graft")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return GraftResult(out, source.label, len(added), source.bytes_read, time.perf_counter() - t0, rss,
                       out.stat().st_size)
