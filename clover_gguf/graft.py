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
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from clover_gguf.checkpoint import INDEX, SAFETENSORS_DTYPES, normalise_name, parse_index, parse_shard_header
from clover_gguf.config import MAX_JSON_BYTES, CloverConfig, generation_defaults, parse_json, read_json_bytes
from clover_gguf.errors import UserError
from clover_gguf.metadata import ARCH, GenerationDefaults, MASK_TOKEN_ID, hparam
from clover_gguf.tensor_map import TENSOR_RULES, match_rule

SINGLE = "model.safetensors"
BLOCK_RULES = [r for r in TENSOR_RULES if r.clover_extra]
MLX_BLOCK_FILE = "clover-block.safetensors"  # an MLX folder's block tensors (mlx-lm's loader reads model*.safetensors)


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

    def json_bytes(self, name: str) -> bytes | None:
        blob = read_json_bytes(self.folder / name, name, missing=True)  # the one reader of side files
        self.bytes_read += len(blob or b"")
        return blob


# a Hub repo id: owner/name, each of letters, digits, '-', '_', '.', no '..' or '--', at most 96 characters
REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?", re.ASCII)


def check_repo_id(spec: str) -> None:
    parts = spec.split("/")
    if len(parts) != 2 or not all(REPO_PART.fullmatch(x) and ".." not in x and "--" not in x for x in parts):
        raise UserError(f"--from {spec!r}: not a checkpoint folder, nor a Hugging Face repo id (owner/name of "
                        "letters, digits, '-', '_' and '.')")


class HubSource:
    """A Hugging Face repo, read by HTTP range requests through http_range.RangeReader (huggingface_hub gives the
    URLs, $HF_ENDPOINT and the token): every answer is checked, the token stays on the endpoint's host."""

    def __init__(self, repo_id: str, revision: str | None = None):
        check_repo_id(repo_id)
        from clover_gguf.http_range import RangeReader, check_url

        if "HF_ENDPOINT" in os.environ:  # huggingface_hub parses it on import: a bad one would be its traceback
            check_url(os.environ["HF_ENDPOINT"], "the Hub endpoint ($HF_ENDPOINT)")
        try:
            from huggingface_hub import constants, hf_hub_url
            from huggingface_hub.utils import build_hf_headers
        except ImportError:
            raise UserError("reading a checkpoint from the Hub needs huggingface_hub: `pip install huggingface_hub` (in a "
                            "checkout of clover-gguf: `pip install '.[hub]'`)") from None
        except ValueError as e:
            raise UserError(f"huggingface_hub refuses its settings: {str(e).splitlines()[0]}") from None

        self.repo_id, self.revision = repo_id, revision
        self.label = repo_id

        def url(name: str) -> str:
            try:
                return hf_hub_url(repo_id, name, revision=revision)
            except ValueError as e:  # huggingface_hub's HFValidationError
                raise UserError(f"{repo_id}/{name}: {str(e).splitlines()[0] if str(e) else 'not a valid Hub file'}"
                                ) from None

        self._url = url
        try:
            headers = build_hf_headers()
        except ValueError as e:
            raise UserError(f"the Hugging Face token is not usable: {str(e).splitlines()[0]}") from None
        self.http = RangeReader(constants.ENDPOINT, headers, repo_id)
        self._sizes: dict[str, int | None] = {}

    @property
    def bytes_read(self) -> int:
        return self.http.bytes_read

    def size(self, name: str) -> int | None:
        if name not in self._sizes:
            got = self.http.range(self._url(name), name, 0, 1)
            self._sizes[name] = None if got is None else got[1]
        return self._sizes[name]

    def read(self, name: str, offset: int = 0, n: int | None = None) -> bytes:
        size = self.size(name)
        if size is None:
            raise UserError(f"{self.label} has no {name}")
        n = size - offset if n is None else n
        if n <= 0:
            return b""
        got = self.http.range(self._url(name), name, offset, n, total=size)
        if got is None:
            raise UserError(f"{self.label}/{name} disappeared while it was read (404)")
        return got[0]

    def json_bytes(self, name: str) -> bytes | None:
        return self.http.whole(self._url(name), name, MAX_JSON_BYTES)


def open_source(spec: str, revision: str | None = None) -> LocalSource | HubSource:
    p = Path(spec).expanduser()
    if p.is_dir():
        return LocalSource(p)
    if p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UserError(f"--from {spec}: not a checkpoint folder, nor a Hugging Face repo id (owner/name)")
    return HubSource(spec, revision)


def _json(src, name: str, required: bool = True) -> Any:
    blob = src.json_bytes(name)
    if blob is None:
        if required:
            raise UserError(f"{src.label} has no {name}")
        return None
    return parse_json(blob, f"{src.label}/{name}", name)


def block_tensor_refs(src) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
    """normalised HF name -> (shard, dtype, shape, begin, end) for every block-mode tensor of the checkpoint: only
    the index (or the one shard's header) is read."""
    index = src.json_bytes(INDEX)
    if index is not None:
        weight_map = parse_index(index, f"{src.label}/{INDEX}")  # the reader convert uses
        shards = sorted({f for n, f in weight_map.items() if _is_block(n)})
    elif src.size(SINGLE) is not None:
        shards = [SINGLE]
    else:
        raise UserError(f"{src.label} has neither {INDEX} nor {SINGLE}")
    refs = {}
    for shard in shards:
        size = src.size(shard)
        if size is None:
            raise UserError(f"{src.label} has no shard {shard}")
        for name, dtype, shape, b, e in parse_shard_header(Path(shard), lambda o, n, s=shard: src.read(s, o, n), size):
            norm = normalise_name(name)
            if norm is not None and _is_block(norm):
                if norm in refs:
                    raise UserError(f"tensor {name} appears twice in the checkpoint")
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
    ranking: Any = None  # check_block.Ranking of the readings on the written file (--pick-reading)

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "source": self.source, "added_tensors": self.added_tensors,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
                "peak_rss_mib": round(self.peak_rss_mib, 1), "size_bytes": self.size_bytes,
                "ranking": None if self.ranking is None else self.ranking.to_json()}

    def summary(self) -> str:
        text = (f"wrote {self.out}: {self.added_tensors} block-mode tensors added from {self.source} "
                f"({self.bytes_read / 2**20:.2f} MiB read, {self.seconds:.1f} s, peak RSS {self.peak_rss_mib:.0f} MiB), "
                f"{self.size_bytes / 2**30:.3f} GiB")
        return text if self.ranking is None else text + "\n" + self.ranking.format()


def _check_same_model(h, cfg: CloverConfig) -> None:
    """The checkpoint must be the GGUF's model: the widths the block tensors depend on agree, and the layers are the
    file's, one for one, with the GDN layers (the ones holding ssm_conv1d, which the block tensors join) where
    config.json's layer_types puts them."""
    want = {"embedding_length": cfg.hidden_size, "ssm.inner_size": cfg.value_dim,
            "ssm.time_step_rank": cfg.linear_num_value_heads, "ssm.group_count": cfg.linear_num_key_heads,
            "ssm.state_size": cfg.linear_key_head_dim}
    for key, value in want.items():
        if h.kv.get(hparam(key)) != value:
            raise UserError(f"the checkpoint is not this GGUF's model: {hparam(key)} is {h.kv.get(hparam(key))}, "
                            f"config.json implies {value}")
    n_blocks, n_mtp = h.kv.get(hparam("block_count")), h.kv.get(hparam("nextn_predict_layers"), 0)
    if not isinstance(n_blocks, int) or not isinstance(n_mtp, int) or n_blocks - n_mtp != cfg.num_hidden_layers:
        raise UserError(f"the checkpoint is not this GGUF's model: the file has {n_blocks} blocks ({n_mtp} of them "
                        f"MTP), config.json has {cfg.num_hidden_layers} layers")
    in_file = ["linear_attention" if f"blk.{i}.ssm_conv1d.weight" in h.tensors else "full_attention"
               for i in range(cfg.num_hidden_layers)]
    if in_file != list(cfg.layer_types):
        i = next(i for i, (a, b) in enumerate(zip(in_file, cfg.layer_types)) if a != b)
        raise UserError(f"the checkpoint is not this GGUF's model: layer {i} is {in_file[i]} in the file, "
                        f"{cfg.layer_types[i]} in config.json's layer_types")


def _check_fits_file(h, name: str, a: np.ndarray) -> None:
    """A block tensor joins its GDN layer's own tensors: the right conv has ssm_conv1d's channels, the per-head
    vectors ssm_a's heads."""
    layer = name.split(".")[1]
    like = f"blk.{layer}.ssm_conv1d.weight" if "conv1d_right" in name else f"blk.{layer}.ssm_a"
    want = h.tensors.get(like, ((None,), None))[0]
    if a.shape[0] != want[0] or (a.ndim == 1) != (len(want) == 1):
        raise UserError(f"the checkpoint is not this GGUF's model: {name} would be {list(a.shape)}, the file's "
                        f"{like} is {list(want)}")


def read_block_tensors(source, cfg: CloverConfig, refs: dict
                       ) -> list[tuple[int, Any, str, np.ndarray, np.ndarray]]:
    """[(layer, rule, HF name, the tensor as stored in float32, its GGUF values)] for every block tensor of every GDN
    layer, each checked (present, shape, dtype, whole, and its values as convert checks them: convert.block_tensor)."""
    from clover_gguf.convert import block_tensor

    out = []
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
            data = source.read(shard, b, e - b)
            if len(data) != e - b:
                raise UserError(f"{source.label}/{shard}: {name} is cut short ({len(data)} of {e - b} bytes)")
            raw = np.frombuffer(data, dtype=SAFETENSORS_DTYPES[dtype]).reshape(shape)
            a = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
            out.append((layer, rule, name, a, block_tensor(rule, name, layer, a, cfg)))
    return out


def graft(src: Path, from_: str, out: Path, revision: str | None = None, force: bool = False, quiet: bool = False,
          log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr), pick_reading: bool = False,
          prompts: Path | None = None) -> GraftResult:
    """pick_reading: rank every reading of the block tensors on the written file (check_block.rank_readings, on
    `prompts` or check-block's built-in ones) and stamp the best into it when it holds."""
    from clover_gguf.convert import block_mode_keys, check_layer_kind, right_kernel_from_shapes
    from clover_gguf.export import copy_gguf
    from clover_gguf.gguf_header import check_model, read_header
    from clover_gguf.tensor_map import CLOVER_EXTRA_RE

    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if pick_reading and prompts is not None:  # a bad prompts file is refused before any work
        from clover_gguf.check_block import read_prompts

        read_prompts(prompts)
    if src.is_dir():  # an MLX folder
        if pick_reading:
            raise UserError("--pick-reading ranks the readings on a GGUF: graft into a GGUF, or run `clover-gguf "
                            "check-block --reading all` on the GGUF of this model")
        return graft_folder(src, from_, out, revision=revision, force=force, quiet=quiet, log=log)
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

    for name in sorted(refs):  # block tensors where config.json has no GDN layer: refused as convert does
        rule, layer = match_rule(name)
        check_layer_kind(rule, name, layer, cfg)
    added: dict[str, np.ndarray] = {}
    for layer, rule, _, _, values in read_block_tensors(source, cfg, refs):
        gguf_name = rule.gguf.format(i=layer)
        added[gguf_name] = values
        _check_fits_file(h, gguf_name, values)

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
    ranking = None
    if pick_reading:
        from clover_gguf.check_block import rank_readings
        from clover_gguf.metadata import READINGS

        ranking = rank_readings(out, tuple(READINGS), prompts=prompts, write=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return GraftResult(out, source.label, len(added), source.bytes_read, time.perf_counter() - t0, rss,
                       out.stat().st_size, ranking)


# the config.json keys of block mode an MLX folder carries (CloverConfig's names)
FOLDER_BLOCK_KEYS = ("mask_token_id", "block_size", "linear_conv_right_kernel_dim", "moe_block_coreset_enabled",
                     "moe_block_coreset_top_p")
SAME_MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size")


def graft_folder(src: Path, from_: str, out: Path, revision: str | None = None, force: bool = False,
                 quiet: bool = False, log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
                 ) -> GraftResult:
    """The block tensors added to an MLX folder (a community conversion, mlx-lm's layout): OUT is the folder's files
    (hard links where the file system allows, else copies) with the block tensors as they are stored in the
    checkpoint, float32, in clover-block.safetensors (mlx_backend.BLOCK_FILE, which mlx-lm's own loader never
    reads), config.json given block mode's keys and generation_config.json the checkpoint's decoding defaults. OUT
    appears whole or not at all."""
    import shutil

    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    from clover_gguf.config import read_json
    from clover_gguf.fsutil import atomic_folder, check_free_disk, check_output_folder
    from clover_gguf.convert import right_kernel_from_shapes
    from clover_gguf.metadata import READING_FIELD

    block_file = MLX_BLOCK_FILE
    t0 = time.perf_counter()
    if not os.path.lexists(src / "config.json"):
        raise UserError(f"{src} is not a model folder (no config.json)")
    if (src / block_file).exists():
        raise UserError(f"{src} already has the block-mode tensors ({block_file})")
    local = Path(from_).expanduser()
    ck = [local, *local.iterdir()] if local.is_dir() else []  # a checkpoint folder is an input too
    check_output_folder(out, [src, *src.iterdir(), *ck], force=force)
    folder = read_json(src / "config.json", "config.json")
    if not isinstance(folder, dict):
        raise UserError(f"{src}/config.json must be a JSON object")
    mine = CloverConfig.from_dict(folder)

    source = open_source(from_, revision)
    raw_cfg = _json(source, "config.json")
    cfg = CloverConfig.from_dict(raw_cfg)
    if not cfg.is_clover:
        raise UserError(f"{source.label} is not a Clover checkpoint (model_type {cfg.model_type!r})")
    for key in SAME_MODEL_FIELDS:
        if getattr(mine, key) != getattr(cfg, key):
            raise UserError(f"the checkpoint is not this folder's model: {key} is {getattr(mine, key)} here, "
                            f"{getattr(cfg, key)} in the checkpoint")
    refs = block_tensor_refs(source)
    cfg = right_kernel_from_shapes({n: r[2] for n, r in refs.items()}, cfg)
    tensors = {name: np.ascontiguousarray(a) for _, _, name, a, _ in read_block_tensors(source, cfg, refs)}
    gen_raw = _json(source, "generation_config.json", required=False)
    if not quiet:
        log(f"graft: {len(tensors)} block-mode tensors read from {source.label} ({source.bytes_read / 2**20:.2f} MiB)")

    files = [p for p in src.iterdir() if p.is_file() and p.name not in ("config.json", "generation_config.json")]
    linked = _same_device(src, out)  # hard links where the file system allows: no room for the folder's files
    check_free_disk(out, sum(a.nbytes for a in tensors.values()) + 2**20 +
                    (0 if linked else sum(p.stat().st_size for p in files)))
    with atomic_folder(out) as tmp:
        for p in files:
            try:
                os.link(p, tmp / p.name)
            except OSError:
                shutil.copy2(p, tmp / p.name)
        for key in FOLDER_BLOCK_KEYS:
            folder[key] = getattr(cfg, key) if key != "linear_conv_right_kernel_dim" else cfg.right_kernel
        if READING_FIELD in raw_cfg:
            folder[READING_FIELD] = raw_cfg[READING_FIELD]
        (tmp / "config.json").write_text(json.dumps(folder, indent=4, sort_keys=True))
        gen = read_json(src / "generation_config.json", "generation_config.json", missing={})
        if isinstance(gen_raw, dict):
            gen = {**gen_raw, **(gen if isinstance(gen, dict) else {})}  # the folder's own values win
            generation_defaults(gen, where=f"{source.label}: generation_config.json")
        if gen:
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        try:  # a failed write (a full disk) is safetensors' own error: an OSError for atomic_folder's one line
            save_file(tensors, str(tmp / block_file), metadata={"format": "mlx", "clover": "block-mode tensors, HF "
                                                                                          "names"})
        except SafetensorError as e:
            raise OSError(str(e)) from None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return GraftResult(out, source.label, len(tensors), source.bytes_read, time.perf_counter() - t0, rss, size)


def _same_device(src: Path, out: Path) -> bool:
    """Whether `out` (its nearest existing folder) is on src's file system, where graft hard-links src's files."""
    from clover_gguf.fsutil import existing_folder

    folder = existing_folder(out.parent)
    return folder is not None and os.stat(folder).st_dev == os.stat(src).st_dev
