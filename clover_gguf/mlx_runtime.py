"""A model folder run on MLX as `generate`, `chat` and `serve` run a GGUF: runtime.CloverRuntime's session API
(chat template, control-token-safe prompts, controls, checks, streaming, stats) over mlx_backend.MlxBackend and the
folder's own tokenizer.json. Only the loading differs, so MlxRuntime subclasses CloverRuntime and replaces its
constructor; everything a request does is CloverRuntime's code.

`model_backend(path, backend)` says which engine a command's MODEL goes to (a folder: MLX; a file: llama.cpp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from clover_gguf.config import MAX_BLOCK, generation_defaults, read_json
from clover_gguf.errors import UserError
from clover_gguf.metadata import READING, READING_FIELD, Controls, GenerationDefaults
from clover_gguf.runtime import DEFAULT_CTX, SELECTIONS, CloverRuntime

BACKENDS = ("auto", "llama", "mlx")


def model_backend(path: Path, backend: str = "auto") -> str:
    """"llama" or "mlx" for this MODEL and --backend: auto is MLX for a folder (a checkpoint or an MLX folder),
    llama.cpp for a file."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: choose {', '.join(BACKENDS)}")
    path = Path(path)
    if backend == "auto":
        return "mlx" if path.is_dir() else "llama"
    if backend == "mlx" and not path.is_dir():
        raise UserError(f"--backend mlx takes a model folder (an MLX folder or a checkpoint), not {path}")
    if backend == "llama" and path.is_dir():
        raise UserError(f"{path} is a folder: llama.cpp takes a GGUF file (convert it: clover-gguf convert)")
    return backend


class _Tokens:
    """The few tokenizer calls CloverRuntime makes of a LlamaContext, on the folder's tokenizer.json (HF
    tokenizers), with the vocabulary as clover_gguf.vocab reads it for a GGUF."""

    def __init__(self, folder: Path, vocab, n_ctx: int):
        from tokenizers import Tokenizer

        from clover_gguf.testing.tokenizer import bytes_to_unicode

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab = vocab
        self.n_vocab = vocab.size
        self.n_ctx, self.n_ubatch = n_ctx, MAX_BLOCK  # MLX runs a block of any size in one pass
        self._bytes = {c: b for b, c in bytes_to_unicode().items()}
        self._added = set(self.tok.get_added_tokens_decoder())

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        self.tok.encode_special_tokens = not special  # control-token text in user messages stays text
        try:
            return self.tok.encode(text, add_special_tokens=False).ids
        finally:
            self.tok.encode_special_tokens = False

    def token_to_piece(self, t: int, special: bool = True) -> bytes:
        text = self.vocab.tokens[t] if 0 <= t < self.n_vocab else ""
        if t in self._added:
            return text.encode("utf-8") if special else b""
        if text.startswith("[PAD"):
            return b""
        return bytes(self._bytes[c] for c in text if c in self._bytes)

    def close(self) -> None:
        pass


class MlxRuntime(CloverRuntime):
    """A Clover checkpoint folder or an MLX folder on MLX, with CloverRuntime's session API.

    No prefix reuse (each prompt is decoded whole), one sequence; `keep_prefix` and llama.cpp's other settings are
    accepted and ignored where they have no meaning here."""

    def __init__(self, folder: str | Path, n_ctx: int | None = None, block_size: int | None = None,
                 coreset: bool | None = None, dtype: str | None = None, selection: str = "graph", **_ignored):
        """selection: "graph" (greedy answers select in MLX: only a few numbers per row leave it) or "numpy"
        (every row's logits are copied out), as runtime.SELECTIONS."""
        from gguf import TokenType

        from clover_gguf.vocab import compile_chat_template, load_vocab

        path = Path(folder)
        mlx_backend = import_mlx_backend()
        loaded = mlx_backend.load(path, dtype=dtype)
        cfg = loaded.cfg
        self.loaded, self.path = loaded, path
        self.meta = {"general.architecture": "clover_moe" if cfg.is_clover else "qwen35moe", "backend": "mlx"}
        self.backend = mlx_backend.MlxBackend(loaded, coreset=coreset)
        if selection not in SELECTIONS:
            raise UserError(f"unknown selection {selection!r}: choose {' or '.join(SELECTIONS)}")
        self.selection = selection
        self.block_mode = self.backend.block_mode
        self.reading = cfg.extra.get(READING_FIELD) or READING  # our checkpoints say the reading they were made under
        self.reading_verified = READING_FIELD in cfg.extra
        self.context_length = cfg.max_position_embeddings
        gen_path = path / "generation_config.json"
        gen_raw = read_json(gen_path, "generation_config.json", missing=None)
        gen = GenerationDefaults() if gen_raw is None else generation_defaults(gen_raw, where=str(gen_path))
        self.block_size = int(cfg.block_size)
        self.backend.block_size = self.block_size
        self.threshold = gen.threshold
        self.mask_token_id = cfg.mask_token_id
        self.controls = Controls(**{k: getattr(gen, k) for k in Controls.control_names()})
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK:
            raise UserError(f"block size {block_size}: it must be 1..{MAX_BLOCK}")
        self.max_block_size = max(int(block_size or 0), self.block_size)
        vocab = load_vocab(path, cfg)
        self.chat_template = vocab.chat_template
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None
        self.n_ctx = min(n_ctx or DEFAULT_CTX, self.context_length)
        self.ctx = _Tokens(path, vocab, self.n_ctx)
        eos = (gen_raw or {}).get("eos_token_id", cfg.eos_token_id)
        eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)})
        if not eos_ids and "eos" in vocab.special_ids:
            eos_ids = [vocab.special_ids["eos"]]
        self.eos_ids = eos_ids
        self.backend.eos_ids = frozenset(eos_ids)
        import re

        controls = sorted((t for t, k in zip(vocab.tokens, vocab.token_types) if k == int(TokenType.CONTROL) and t),
                          key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, controls))) if controls else None
        self.max_token_bytes = max(1, max(len(t.encode("utf-8")) for t in vocab.tokens))
        self.think_id = self._special("<think>")
        self.think_end_id = self._special("</think>")
        self._start_auto()

    def reading_note(self, mode: str) -> str | None:
        note = super().reading_note(mode)
        return None if note is None else note.replace(f"`clover-gguf check-block {self.path.name}`",
                                                      "`clover-gguf check-block` on its GGUF")

    def stream_pieces(self, ids: Sequence[int], temp: float = 0.0, **kw):
        self.backend.select_in_graph = self.selection == "graph" and temp == 0.0  # MLX's rows are greedy's
        return super().stream_pieces(ids, temp=temp, **kw)

    def prompt_and_keep(self, messages: Sequence[dict], think: bool = True,
                        tools: Sequence[dict] | None = None) -> tuple[list[int], int | None]:
        return self.prompt_ids(messages, think=think, tools=tools), None  # no prefix reuse here

    def close(self) -> None:
        pass



def open_runtime(model: Path, backend: str = "auto", **llama_kw) -> CloverRuntime:
    """The runtime for a command's MODEL: MlxRuntime for a folder (or --backend mlx), else CloverRuntime with the
    llama.cpp settings given. llama.cpp's offload settings mean nothing on MLX and are left unused; --rpc is
    refused."""
    if model_backend(model, backend) == "mlx":
        if llama_kw.get("rpc"):
            raise UserError("--rpc is llama.cpp's: MLX runs the model on this machine")
        return MlxRuntime(model, n_ctx=llama_kw.get("n_ctx"), block_size=llama_kw.get("block_size"),
                          coreset=llama_kw.get("coreset"))
    return CloverRuntime(model, **llama_kw)


def import_mlx_backend():
    """clover_gguf.mlx_backend, imported now (it imports MLX; UserError with the install line when MLX is missing)."""
    from clover_gguf import mlx_backend

    return mlx_backend


def mlx_status() -> dict:
    """Whether MLX is installed here and whether it has Metal (doctor)."""
    try:
        info = import_mlx_backend().availability()
    except UserError as e:
        return {"installed": False, "metal": False, "summary": str(e)}
    where = "Metal GPU" if info["metal"] else f"no Metal: MLX runs on the CPU ({info['device']})"
    return {"installed": True, **info, "summary": f"mlx {info['mlx']}, mlx-lm {info['mlx_lm']}: {where}"}
