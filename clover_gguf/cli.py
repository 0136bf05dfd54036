"""The `clover-gguf` command: parses arguments and calls the modules; nothing else lives here."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from clover_gguf.decoding import ACCEPT_MODES, DEFAULT_END_RULE, DRAFT_THRESHOLD, END_RULES, MODES
from clover_gguf.errors import UserError
from clover_gguf.offload import FLASH_ATTN
from clover_gguf.offload import OPTIONS as _OFFLOAD_OPTIONS
from clover_gguf.runtime import ROLLBACKS
from clover_gguf.state_cache import DEFAULT_CACHE_RAM_MIB

# rich_markup_mode=None: plain help (no boxes, no `<bool>` after every flag); errors are ours (main)
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Clover block-diffusion MoE on your own machine: convert, quantize, build llama.cpp, decode.")


def _version(value: bool) -> None:
    """--version: this package's version and the llama.cpp it builds (what a bug report needs first)."""
    if value:
        from clover_gguf import __version__
        from clover_gguf.llama_sdist import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION

        typer.echo(f"clover-gguf {__version__} (llama.cpp {LLAMA_CPP_COMMIT} from the llama-cpp-python "
                   f"{LLAMA_CPP_PYTHON_VERSION} sdist, with patches/)")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                          help="print the version and exit")) -> None:
    """Clover block-diffusion MoE on your own machine: convert, quantize, build llama.cpp, decode."""


class OutType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"


class Arch(str, Enum):
    clover_moe = "clover_moe"
    qwen35moe = "qwen35moe"


class Backend(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    metal = "metal"
    vulkan = "vulkan"


class Reasoning(str, Enum):
    """serve --reasoning (llama-server's values): whether a chat request that does not say thinks."""
    on = "on"
    off = "off"
    auto = "auto"


class Engine(str, Enum):
    """Which engine runs MODEL (generate, chat, serve): auto is MLX for a folder, llama.cpp for a GGUF file."""
    auto = "auto"
    llama = "llama"
    mlx = "mlx"


ENGINE_HELP = "auto (a folder runs on MLX, a GGUF file on llama.cpp), llama or mlx (docs/mac.md)"
RPC_HELP = ("HOST:PORT[,HOST:PORT...]: put the model's layers on these ggml-rpc-servers, as llama.cpp's --rpc does "
            "(unauthenticated: trusted networks only)")


def _rpc(spec: Optional[str]) -> dict:
    """--rpc -> CloverRuntime keywords (the layers --gpu-layers offloads, all by default, go to the servers)."""
    from clover_gguf import rpc

    return {"rpc": rpc.parse_endpoints(spec)}


def _err(msg: str) -> None:
    """The one error line: a newline inside the message (a path, a --rpc value) is shown escaped, never as a
    second line."""
    msg = str(msg).replace("\r", "\\r").replace("\n", "\\n")
    typer.echo(f"clover-gguf: error: {msg}", err=True)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader left (`| head`)


class StdoutError(Exception):
    """Writing the command's output to stdout failed (the reader left: EPIPE; a full disk: ENOSPC; ...)."""

    def __init__(self, error: OSError):
        super().__init__(error)
        self.error = error


class _GuardedStdout:
    """sys.stdout as the commands see it while main runs: a failed write or flush raises StdoutError, so main tells
    a broken stdout from every other OSError, in one place for every command."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise StdoutError(e) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            raise StdoutError(e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _stdout_failed(stream, error: OSError) -> int:
    """-> the exit code for a stdout that cannot take the output: EPIPE silently (the reader chose to stop),
    anything else one line. What is still buffered is dropped (stdout now goes to /dev/null), so the interpreter's
    own flush at exit cannot fail again."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture): nothing is flushed later
        pass
    if error.errno == errno.EPIPE:
        return EXIT_BROKEN_PIPE
    _err(f"cannot write the output to stdout: {error.strerror or error}")
    return 2


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A typer choice type over one of the tuples the modules define (the lists live there, once)."""
    return Enum(name, {v.replace("-", "_"): v for v in values}, type=str)


FlashAttn = _choices("FlashAttn", tuple(FLASH_ATTN))
_OFFLOAD_HELP = {name: help_ for name, _, _, help_ in _OFFLOAD_OPTIONS}  # fit names three of them itself


def offload_options(command):
    """Adds the offload options every model-running command shares (clover_gguf.offload.OPTIONS, their one
    definition); the command receives them as one `offload` argument."""
    import functools
    import inspect

    from clover_gguf.offload import OPTIONS, Offload

    types = {"gpu_layers": str, "cpu_moe": bool, "n_cpu_moe": int, "threads": Optional[int], "mmap": bool,
             "poll": Optional[int], "stall_guard": bool, "flash_attn": FlashAttn}
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=types[name],
                               default=typer.Option(default, *flags, help=help_, show_default=default is not None,
                                                    **({"case_sensitive": False} if name == "flash_attn" else {})))
             for name, flags, default, help_ in OPTIONS]
    sig = inspect.signature(command)
    own = [p for p in sig.parameters.values() if p.name != "offload"]

    @functools.wraps(command)
    def wrapper(**kw):
        offload = Offload(**{name: kw.pop(name) for name, *_ in OPTIONS})
        return command(**kw, offload=offload)

    wrapper.__signature__ = sig.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


# generate, chat and serve run a GGUF or a folder (runtime.open_runtime picks the backend); one text for all three
RUNNABLE_MODEL_HELP = ("a Clover GGUF file, or a model folder (an MLX folder or the checkpoint's safetensors folder, "
                       "run with MLX)")


@app.command()
def convert(
    src: Path = typer.Argument(..., help="checkpoint folder (config.json, safetensors, tokenizer)"),
    out: Path = typer.Option(..., "-o", "--out", help="output GGUF file"),
    outtype: OutType = typer.Option(OutType.bf16, "--outtype", help="storage type of the weight matrices"),
    arch: Arch = typer.Option(Arch.clover_moe, "--arch", help="clover_moe (with the block-mode tensors), or "
                              "qwen35moe: AR only, for llama.cpp builds older than b12060"),
    skip_unknown: bool = typer.Option(False, "--skip-unknown", help="drop tensors the map does not know (warns)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the plan; write nothing"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    reading: Optional[str] = typer.Option(None, "--reading", help="the block reading to stamp (hist-sink-add, "
                                          "hist-read-add or hist-read-mix, docs/architecture.md 3b; default: the "
                                          "one the checkpoint was made under, else hist-sink-add)"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Clover safetensors -> GGUF (streaming)."""
    from clover_gguf.convert import convert as run

    res = run(src, out, outtype.value, skip_unknown=skip_unknown, dry_run=dry_run, quiet=quiet or as_json,
              force=force, arch=arch.value, reading=reading)
    summary = {"out": str(res.out) if res.out else None, "tensors": res.n_tensors, "bytes": res.nbytes,
               "dry_run": dry_run, "notices": res.notices, "skipped_unknown": res.skipped_unknown}
    if as_json:
        if dry_run:
            summary["plan"] = [{"name": t.name, "shape": list(t.shape), "type": t.qtype.name, "bytes": t.nbytes}
                               for t in res.plan.tensors]
        typer.echo(json.dumps(summary))
    elif dry_run:
        typer.echo(f"{'tensor':<44} {'type':<5} {'shape':<22} {'bytes':>12}")
        for t in res.plan.tensors:
            typer.echo(f"{t.name:<44} {t.qtype.name:<5} {str(list(t.shape)):<22} {t.nbytes:>12}")
        typer.echo(f"dry run: {res.n_tensors} tensors, {res.nbytes / 2**30:.3f} GiB; nothing written")
    else:
        typer.echo(f"wrote {res.out}: {res.n_tensors} tensors, {res.nbytes / 2**30:.3f} GiB")


@app.command("export-ar")
def export_ar(
    src: Path = typer.Argument(..., help="a Clover GGUF (any type, quantized too)"),
    out: Path = typer.Argument(..., help="output GGUF"),
    arch: Arch = typer.Option(Arch.clover_moe, "--arch", help="clover_moe: what upstream's converter writes (llama.cpp "
                              "b12060 and later); qwen35moe: for older builds and apps"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Clover GGUF -> the AR-only GGUF stock llama.cpp runs (tensors copied as they are)."""
    from clover_gguf.export import export_ar as run

    res = run(src, out, force=force, quiet=quiet or as_json, arch=arch.value)
    if as_json:
        typer.echo(json.dumps({"out": str(res.out), "tensors": res.n_tensors, "size_bytes": res.size_bytes,
                               "dropped_tensors": res.dropped_tensors, "dropped_keys": res.dropped_keys}))
    else:
        typer.echo(f"wrote {res.out}: {arch.value}, {res.n_tensors} tensors, {res.size_bytes / 2**30:.3f} GiB")


@app.command()
def graft(
    src: Path = typer.Argument(..., help="a clover_moe GGUF without the block-mode tensors (an official file), or an "
                               "MLX folder without them (a community conversion; OUT is then a folder)"),
    from_: str = typer.Option(..., "--from", help="the checkpoint: a local folder, or a Hugging Face repo id "
                              "(ranged reads: only the block tensors and the headers are downloaded)"),
    out: Path = typer.Option(..., "-o", "--out", help="output GGUF (a folder for an MLX folder)"),
    revision: Optional[str] = typer.Option(None, "--revision", help="with a repo id: branch, tag or commit"),
    pick_reading: bool = typer.Option(False, "--pick-reading", help="then rank every reading of the block tensors "
                                      "on OUT (check-block --reading all) and stamp the best into it when it holds"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="with --pick-reading: check-block's --prompts"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Add the block-mode tensors and keys to an AR-only GGUF (its tensors copied byte for byte)."""
    from clover_gguf.graft import graft as run

    if prompts is not None and not pick_reading:
        raise UserError("--prompts goes with --pick-reading")
    res = run(src, from_, out, revision=revision, force=force, quiet=quiet or as_json, pick_reading=pick_reading,
              prompts=prompts)
    typer.echo(json.dumps(res.to_json()) if as_json else res.summary())


@app.command("mlx-convert")
def mlx_convert(
    src: Path = typer.Argument(..., help="a Clover checkpoint folder (config.json, safetensors, tokenizer)"),
    out: Path = typer.Option(..., "-o", "--out", help="output MLX folder"),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="quantize to 2, 3, 4, 5, 6 or 8 bits (mlx-lm's affine "
                                         "quantization; default: not quantized)"),
    q_group_size: int = typer.Option(64, "--q-group-size", help="weights per quantization group: 32, 64 or 128"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 for what is not "
                                        "quantized (default: as stored)"),
    force: bool = typer.Option(False, "--force", help="replace OUT"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Clover checkpoint -> MLX folder (mlx-lm's layout; the block-mode tensors kept unquantized beside it)."""
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16, not {dtype!r}")
    from clover_gguf.mlx_runtime import import_mlx_backend

    res = import_mlx_backend().convert(src, out, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype, force=force)
    typer.echo(json.dumps(res.to_json()) if as_json else res.summary())


@app.command("check-block")
@offload_options
def check_block(
    model: Path = typer.Argument(..., help="a Clover GGUF with the block-mode tensors"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="a text file, one prompt per line, or a .jsonl "
                                           "file, each row's \"prompt\" (or its \"messages\"' last user message) "
                                           "(default: built-in prompts that fit the model: general questions, or the "
                                           "bundled tiny Clover's own held-out prompts for that model)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16),
    reading: Optional[str] = typer.Option(None, "--reading", help="all: decode under every reading of the block "
                                          "tensors and rank them; or one reading's name (default: the file's own)"),
    write: bool = typer.Option(False, "--write", help="stamp the best reading into the file's header (in place) "
                               "when it holds"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    offload=None,
) -> None:
    """Check the file's reading of the block tensors: the share of drafted tokens its own causal path accepts."""
    from clover_gguf.check_block import parse_readings, rank_readings

    res = rank_readings(model, parse_readings(reading), prompts=prompts, max_new_tokens=max_new_tokens, n_ctx=ctx,
                        offload=offload, write=write)
    if reading is None and not write:  # the file's own reading: its one result, as before
        res = res.leader
    typer.echo(json.dumps(res.to_json()) if as_json else res.format())


@app.command()
def info(
    path: Path = typer.Argument(..., help="a GGUF file"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Architecture, hparams, tensors by type, size, and which Clover features the file supports."""
    from clover_gguf.info import format_info, read_info

    data = read_info(path)
    typer.echo(json.dumps(data) if as_json else format_info(data))


@app.command()
def quantize(
    src: Optional[Path] = typer.Argument(None, help="input Clover GGUF (F32, F16 or BF16)"),
    out: Optional[Path] = typer.Argument(None, help="output GGUF"),
    qtype: str = typer.Option(..., "--type", "-t", help="Q4_0, Q4_K_M, Q8_0, Q3_K_S, Q3_K_M, IQ4_XS, Q6_K or any "
                              "llama.cpp ftype"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="recipe TOML (default: quant_recipes/<type>.toml)"),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="importance matrix GGUF (clover-gguf imatrix)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="quantizer threads (default: all cores)"),
    plan_only: bool = typer.Option(False, "--plan", help="print the predicted size by tensor type; write nothing"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="with --plan: also one line per tensor"),
    config: Optional[Path] = typer.Option(None, "--config", help="with --plan: plan from a config.json alone"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Quantize a Clover GGUF with llama.cpp's quantizer and a recipe from quant_recipes/."""
    from clover_gguf import quantize as q

    if plan_only:
        if out is not None:
            raise UserError("--plan writes nothing: give IN.gguf or --config, not OUT")
        p = q.plan(qtype, src=src, config=config, recipe_file=recipe, imatrix=imatrix)
        typer.echo(json.dumps(p.to_json()) if as_json else p.format(verbose=verbose))
        return
    if config is not None:
        raise UserError("--config only goes with --plan")
    if verbose:
        raise UserError("--verbose goes with --plan (the per-tensor table); quantize's own log: CLOVER_GGUF_LLAMA_LOG=1")
    if src is None or out is None:
        raise UserError("quantize needs IN.gguf and OUT.gguf (or --plan)")
    res = q.quantize(src, out, qtype, recipe_file=recipe, imatrix=imatrix, threads=threads, force=force,
                     quiet=quiet or as_json)
    if as_json:
        typer.echo(json.dumps({"out": str(res.out), "size_bytes": res.size_bytes, "seconds": round(res.seconds, 3),
                               "type": res.plan.ftype, "recipe": res.plan.recipe.name,
                               "tensors_by_type": {k: v[0] for k, v in res.plan.by_type().items()},
                               "fallbacks": res.plan.fallbacks()}))
    else:
        typer.echo(res.summary())


@app.command()
@offload_options
def imatrix(
    model: Path = typer.Argument(..., help="a Clover GGUF (F32/F16/BF16 preferred)"),
    text: Path = typer.Option(..., "--text", help="calibration text file (at least 2 x --ctx tokens)"),
    out: Path = typer.Option(..., "-o", "--out", help="output imatrix GGUF"),
    ctx: int = typer.Option(512, "--ctx", help="tokens per chunk"),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="at most this many chunks"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="llama-imatrix's own log instead of the progress bar"),
    offload=None,
) -> None:
    """Importance matrix through the patched llama-imatrix, for IQ types and importance-weighted K-quants."""
    from clover_gguf.quantize import imatrix as run

    path = run(model, text, out, ctx=ctx, chunks=chunks, force=force, quiet=quiet, offload=offload, verbose=verbose)
    typer.echo(f"wrote {path}")


@app.command("build-llama")
def build_llama(
    backend: Backend = typer.Option(Backend.cpu, "--backend", help="ggml backend to build"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="parallel compile jobs (default: all cores)"),
    cuda_arch: Optional[str] = typer.Option(None, "--cuda-arch", help="CUDA architectures, e.g. 86 or '75;86;89' "
                                            "(default: the GPUs present, else the list in docs/build.md)"),
    patches: bool = typer.Option(True, "--patches/--no-patches", help="--no-patches: the pinned llama.cpp unpatched "
                                 "(its own cache entry; the runtime never picks it)"),
    prefix: Optional[Path] = typer.Option(None, "--prefix", help="install here instead of the user cache"),
    binding: bool = typer.Option(True, "--binding/--no-binding", help="install llama-cpp-python's binding too"),
    source: Optional[str] = typer.Option(None, "--source", help="the llama.cpp tree: llama-cpp-python-0.3.36 (the "
                                         "pinned one, default) or xllamacpp-2026.10.11549 (newer; the runtime uses "
                                         "it with CLOVER_GGUF_SOURCE set to that name; docs/build.md)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
) -> None:
    """Download, verify, patch and build llama.cpp with the clover architecture (cached)."""
    from clover_gguf import build

    info = build.build_llama(backend.value, jobs=jobs, prefix=prefix, quiet=quiet, cuda_arch=cuda_arch,
                             patched=patches, source=source)
    if binding:
        build.install_binding(info, quiet=quiet)
    state = "cached" if info.cached else f"built in {info.seconds:.0f} s"
    typer.echo(f"llama.cpp ({info.backend}{'' if patches else ', unpatched'}) {state}: {info.bin_dir}")
    # what the folder is for, not a command to run: clover-gguf finds its patched build by itself
    chosen = source in (None, build.chosen_source().name)
    use = ("the runtime never picks it; a program is pointed at it by $LLAMA_CPP_LIB_PATH" if not patches else
           "clover-gguf finds it by itself: nothing to set" if chosen else
           f"the runtime uses it with {build.ENV_SOURCE}={source}")
    typer.echo(f"library: {info.lib_dir} ({use})")


@app.command()
def doctor(
    backend: Optional[Backend] = typer.Option(None, "--backend", help="the build of this backend (default: "
                                              "$CLOVER_GGUF_BACKEND, else a GPU build whose GPU is present, else cpu)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """The llama.cpp library clover-gguf would use, its backend and why, its patch hash, and what is missing.
    Exit code 2 when not ready."""
    from clover_gguf import build

    d = build.doctor(backend.value if backend else None)
    from clover_gguf.mlx_runtime import mlx_status

    d["mlx"] = mlx_status()  # reported; llama.cpp's readiness alone decides "ok"
    d["threads"] = _threads_summary(d["ok"])
    if as_json:
        typer.echo(json.dumps(d))
    else:
        for key in ("library_path", "bin_dir", "backend", "backend_choice", "cached_backends", "patch_hash",
                    "sampler_library", "binding_version", "cache_dir"):
            typer.echo(f"{key:<16} {d.get(key)}")
        typer.echo(f"{'mlx':<16} {d['mlx']['summary']}")
        typer.echo(f"{'threads':<16} {d['threads']['threads']}")
        typer.echo(f"{'poll':<16} {d['threads']['poll']}")
        for w in d.get("warnings", []):
            typer.echo(f"warning: {w}")
        for m in d.get("missing", []):
            typer.echo(f"missing: {m}")
        typer.echo("ok" if d["ok"] else "not ready")
    if not d["ok"]:
        raise typer.Exit(2)


def _threads_summary(ready: bool) -> dict:
    """doctor's threads and poll defaults (clover_gguf.threads), the library loaded to see how it waits when ready."""
    from clover_gguf.threads import has_openmp, summary

    openmp = None
    if ready:
        from clover_gguf.llama_context import load_binding

        try:
            openmp = has_openmp(load_binding())
        except UserError:
            pass
    return summary(openmp)


Mode = _choices("Mode", MODES)
Accept = _choices("Accept", ACCEPT_MODES)
Rollback = _choices("Rollback", ROLLBACKS)


EndRule = _choices("EndRule", END_RULES)


@app.command()
@offload_options
def generate(
    model: Path = typer.Argument(..., help=RUNNABLE_MODEL_HELP),
    prompt: str = typer.Option(..., "-p", "--prompt", help="the user message"),
    mode: Optional[Mode] = typer.Option(None, "--mode", help="auto (the default: AR steps or draft-self "
                                        "blocks, whichever is faster here; ar for a file without the block-mode "
                                        "tensors), ar, diffusion (block decoding) or draft-self"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", min=1),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1, help="default: the GGUF's (32)"),
    threshold: Optional[float] = typer.Option(None, "--threshold", min=0.0, max=1.0,
                                             help="block fill confidence; default: the GGUF's (diffusion), "
                                                  f"{DRAFT_THRESHOLD} for drafts verified exactly (docs/runtime.md)"),
    accept: Accept = typer.Option(Accept.exact, "--accept", help="draft-self acceptance rule"),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: Optional[int] = typer.Option(None, "--seed"),
    think: bool = typer.Option(True, "--think/--no-think", help="let the model think first"),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="context size (default: min(8192, the model's); "
                                      "llama.cpp rounds it up to a multiple of 256)"),
    rollback: Rollback = typer.Option(Rollback.redecode, "--rollback", help="draft-self rollback strategy"),
    end_rule: EndRule = typer.Option(DEFAULT_END_RULE, "--end-rule",
                                     help="end tokens in block passes: prefix (once every position before is "
                                          "resolved) or plain (the card's rule); see docs/tiny-model.md"),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="default: the GGUF's (0.9)"),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="default: the GGUF's (0.0)"),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", min=0.01,
                                                       help="default: the GGUF's (1.05)"),
    no_controls: bool = typer.Option(False, "--no-controls", help="turn every generation control off"),
    rpc: Optional[str] = typer.Option(None, "--rpc", help=RPC_HELP),
    stats: bool = typer.Option(False, "--stats", help="print a one-line stats summary to stderr (all of them: --json)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: text, thinking, stats"),
    engine: Engine = typer.Option(Engine.auto, "--backend", help=ENGINE_HELP),
    offload=None,
) -> None:
    """Answer one prompt, streaming the answer as tokens are accepted."""
    from dataclasses import replace

    from clover_gguf.metadata import Controls
    from clover_gguf.mlx_runtime import open_runtime
    from clover_gguf.runtime import check_sampling

    overrides = {k: v for k, v in {"presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                                   "repetition_penalty": repetition_penalty}.items() if v is not None}
    check_sampling(temp, top_p, top_k, threshold, replace(Controls(), **overrides))  # before the model loads
    with open_runtime(model, engine.value, n_ctx=ctx, rollback=rollback.value, offload=offload,
                      block_size=block_size, **_rpc(rpc)) as rt:
        controls = replace(rt.controls.off() if no_controls else rt.controls, **overrides)
        mode_ = mode.value if mode else rt.default_mode
        if note := rt.reading_note(mode_):
            typer.echo(note, err=True)
        kw = dict(mode=mode_, max_new_tokens=max_new_tokens, block_size=block_size, threshold=threshold,
                  accept=accept.value, temp=temp, top_p=top_p, top_k=top_k, seed=seed, think=think,
                  controls=controls, end_rule=end_rule.value)
        if as_json:
            ans = rt.generate(prompt, **kw)
            typer.echo(json.dumps(ans.to_json()))
            return
        run = None
        for text, run in rt.stream(prompt, **kw):
            typer.echo(text, nl=False)
        typer.echo("")
        if stats and run is not None:
            typer.echo(run.summary(), err=True)


@app.command()
@offload_options
def chat(
    model: Path = typer.Argument(..., help=RUNNABLE_MODEL_HELP),
    mode: Optional[Mode] = typer.Option(None, "--mode", help="default: auto; ar for an AR-only file"),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", "-n", min=1),
    think: bool = typer.Option(True, "--think/--no-think"),
    show_thinking: bool = typer.Option(True, "--show-thinking/--hide-thinking",
                                       help="thinking dimmed (between <think> lines when piped), or hidden"),
    temp: float = typer.Option(0.0, "--temp", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed"),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16),
    rollback: Rollback = typer.Option(Rollback.redecode, "--rollback", help="draft-self rollback strategy"),
    json_stats: bool = typer.Option(False, "--json-stats", help="each answer's stats as one JSON object, not a line"),
    rpc: Optional[str] = typer.Option(None, "--rpc", help=RPC_HELP),
    engine: Engine = typer.Option(Engine.auto, "--backend", help=ENGINE_HELP),
    offload=None,
) -> None:
    """Chat in the terminal: /reset, /mode auto|ar|diffusion|draft-self, /stats, /quit; Ctrl-C stops an answer."""
    from clover_gguf.chat import ChatSession
    from clover_gguf.mlx_runtime import model_backend, open_runtime
    from clover_gguf.runtime import check_sampling

    check_sampling(temp)
    runtime = open_runtime(model, engine.value, n_ctx=ctx, **_rpc(rpc)) \
        if model_backend(model, engine.value) == "mlx" else None
    ChatSession(model, runtime=runtime, mode=mode.value if mode else None, max_new_tokens=max_new_tokens, think=think,
                show_thinking=show_thinking, temp=temp, seed=seed, n_ctx=ctx, json_stats=json_stats,
                rollback=rollback.value, offload=offload, **_rpc(rpc)).loop()


@app.command()
@offload_options
def serve(
    model: Path = typer.Argument(..., help=RUNNABLE_MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default)"),
    port: int = typer.Option(8080, "--port", min=0, max=65535),
    mode: Optional[Mode] = typer.Option(None, "--mode", help="the mode of requests that name none (default: auto; "
                                        "ar for an AR-only file); a request may set its own `mode`"),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="context per slot (default: min(8192, model's))"),
    parallel: int = typer.Option(1, "--parallel", min=1, help="slots serving requests at once, on one context, their passes batched step by step"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CLOVER_GGUF_API_KEY",
                                          help="require Authorization: Bearer KEY (also from $CLOVER_GGUF_API_KEY)"),
    allowed_hosts: Optional[str] = typer.Option(None, "--allowed-hosts", envvar="CLOVER_GGUF_ALLOWED_HOSTS",
                                                help="Host names answered besides loopback ones, comma-separated "
                                                     "(`*`: any; default on loopback: loopback names only, elsewhere: "
                                                     "any)"),
    rollback: Rollback = typer.Option(Rollback.redecode, "--rollback", help="draft-self rollback strategy"),
    cache_ram: int = typer.Option(DEFAULT_CACHE_RAM_MIB, "--cache-ram", min=0,
                                  help="MiB of host memory for the kept states of conversations a slot moved on from "
                                       "(a later request of theirs continues on any slot; 0: off)"),
    rpc: Optional[str] = typer.Option(None, "--rpc", help=RPC_HELP),
    engine: Engine = typer.Option(Engine.auto, "--backend", help=ENGINE_HELP),
    reasoning: Reasoning = typer.Option(Reasoning.auto, "--reasoning", help="whether chat requests that do not say "
                                        "think (llama-server's option): on or auto (the model thinks), off; a request "
                                        "sets its own with chat_template_kwargs.enable_thinking"),
    seed: int = typer.Option(-1, "--seed", help="the seed of requests that give none (llama-server's option; -1: a "
                             "random one each)"),
    alias: Optional[str] = typer.Option(None, "--alias", help="the model id /v1/models reports and answers carry "
                                        "(llama-server's option; default: the file's name without .gguf)"),
    offload=None,
) -> None:
    """An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /slots,
    and a chat page at / (open the address in a browser). It prints the address it listens on once the model is
    loaded."""
    from clover_gguf.mlx_runtime import model_backend, open_runtime
    from clover_gguf.serve import serve as run

    if api_key is None and os.environ.get("CLOVER_GGUF_API_KEY") is not None:
        api_key = os.environ["CLOVER_GGUF_API_KEY"]  # click skips an empty variable: set but empty is refused
    if model_backend(model, engine.value) == "mlx":  # one model, one slot
        if parallel != 1:
            raise UserError("--parallel is llama.cpp's (one context, several slots): MLX serves one request at a time")
        run(lambda: open_runtime(model, "mlx", n_ctx=ctx, **_rpc(rpc)), host=host, port=port,
            mode=mode.value if mode else None, ctx=ctx, api_key=api_key, model_id=alias or model.name,
            allowed=allowed_hosts, reasoning=reasoning.value, seed=seed)
        return

    run(model, host=host, port=port, mode=mode.value if mode else None, ctx=ctx, parallel=parallel, api_key=api_key,
        model_id=alias, allowed=allowed_hosts, rollback=rollback.value, n_threads=offload.threads, offload=offload,
        cache_ram=cache_ram * 2**20, reasoning=reasoning.value, seed=seed, **_rpc(rpc))  # threads per slot


@app.command()
def fit(
    model: Optional[Path] = typer.Argument(None, help="a Clover GGUF (or use --config and --type)"),
    config: Optional[Path] = typer.Option(None, "--config", help="plan from a config.json alone (with --type)"),
    qtype: Optional[str] = typer.Option(None, "--type", "-t", help="with --config: the file type, e.g. Q4_K_M"),
    vram: Optional[str] = typer.Option(None, "--vram", help="GPU memory, e.g. 16GiB (default: the GPU llama.cpp "
                                       "reports, else none)"),
    ram: Optional[str] = typer.Option(None, "--ram", help="host memory, e.g. 32GiB (default: this machine's)"),
    unified: Optional[bool] = typer.Option(None, "--unified/--discrete", help="the GPU shares host memory "
                                           "(Apple silicon; default: as llama.cpp reports the GPU, else discrete)"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="the context you want (default: the largest that fits)"),
    mode: Optional[Mode] = typer.Option(None, "--mode", help="default: auto; ar for an AR-only file"),
    parallel: int = typer.Option(1, "--parallel", min=1, help="server slots (one context for all: their cells and sequences)"),
    rollback: Rollback = typer.Option(Rollback.redecode, "--rollback", help="draft-self rollback strategy"),
    mmap: bool = typer.Option(True, "--mmap/--no-mmap", help="as the run would load the file"),
    measure: bool = typer.Option(False, "--measure", help="also load MODEL.gguf here and show what llama.cpp "
                                 "allocates next to the prediction, the threads it runs on and its pass times"),
    threads: Optional[int] = typer.Option(None, "--threads", help=_OFFLOAD_HELP["threads"] + "; for --measure and "
                                          "the command printed"),
    poll: Optional[int] = typer.Option(None, "--poll", help=_OFFLOAD_HELP["poll"] + "; for --measure and the "
                                       "command printed"),
    flash_attn: FlashAttn = typer.Option("auto", "--flash-attn", "-fa", case_sensitive=False,
                                         help=_OFFLOAD_HELP["flash_attn"] + "; for the prediction (its compute "
                                         "buffers), --measure and the command printed"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Which offload and context fit a GPU or Mac, the predicted memory part by part, and the command to run."""
    from clover_gguf.fit import fit as run

    res = run(model, config=config, qtype=qtype, vram=vram, ram=ram, ctx=ctx, mode=mode.value if mode else None,
              parallel=parallel,
              rollback=rollback.value, mmap=mmap, unified=unified, do_measure=measure, threads=threads, poll=poll,
              flash_attn=flash_attn.value)
    typer.echo(json.dumps(res.to_json()) if as_json else res.format())


def main(argv: list[str] | None = None) -> None:
    """The entry point: every error is one line on stderr; usage and input errors exit 2, Ctrl-C 130, a closed
    stdout pipe 141 without a word (see _stdout_failed)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:  # bare `clover-gguf`: the help, as a usage error
        app(args=["--help"], prog_name="clover-gguf", standalone_mode=False)
        sys.exit(2)
    stdout = sys.stdout
    if stdout is not None:  # None: started with stdout closed (`>&-`); click then writes nothing
        sys.stdout = _GuardedStdout(stdout)
    try:
        if getattr(signal.getsignal(signal.SIGINT), "clover_early", False):  # __main__'s, for the imports before
            signal.signal(signal.SIGINT, signal.default_int_handler)  # now a KeyboardInterrupt, caught below
        rv = app(args=args, prog_name="clover-gguf", standalone_mode=False)
        if sys.stdout is not None:  # output still buffered fails here, not in the interpreter's flush at exit
            sys.stdout.flush()
    except StdoutError as e:
        sys.exit(_stdout_failed(stdout, e.error))
    except UserError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _err("interrupted")
        sys.exit(130)
    except typer.TyperException as e:  # usage errors (typer's own click): one line, exit 2
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _err(" ".join(e.format_message().replace("Value error, ", "").split()) + hint)
        sys.exit(2)
    finally:
        sys.stdout = stdout
        _forget_caught_interrupts()
    if rv == 130:  # typer turns a Ctrl-C inside a command into Exit(130)
        _err("interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)


def _forget_caught_interrupts() -> None:
    """CPython (3.11, 3.12) marks a KeyboardInterrupt that leaves code run by exec() of a string as unhandled, even
    when it is caught later, and at exit then kills the process with SIGINT (exit -2, not our 130). dataclasses
    build their methods that way, so a Ctrl-C or TERM during a lazy import did it. Any exec() of a string clears the
    mark (pythonrun.c, run_eval_code_obj); main lets no KeyboardInterrupt escape, so every mark here is stale."""
    exec("None")
