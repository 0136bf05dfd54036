"""The `clover-gguf` command: parses arguments and calls the modules; nothing else lives here."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from clover_gguf.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Clover block-diffusion MoE on your own machine: convert, quantize, build llama.cpp, decode.")


class OutType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"


class Backend(str, Enum):
    cpu = "cpu"
    cuda = "cuda"
    metal = "metal"
    vulkan = "vulkan"


def _err(msg: str) -> None:
    typer.echo(f"clover-gguf: error: {msg}", err=True)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="checkpoint folder (config.json, safetensors, tokenizer)"),
    out: Path = typer.Option(..., "-o", "--out", help="output GGUF file"),
    outtype: OutType = typer.Option(OutType.bf16, "--outtype", help="storage type of the weight matrices"),
    skip_unknown: bool = typer.Option(False, "--skip-unknown", help="drop tensors the map does not know (warns)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the plan; write nothing"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
) -> None:
    """Clover safetensors -> GGUF (streaming)."""
    from clover_gguf.convert import convert as run

    res = run(src, out, outtype.value, skip_unknown=skip_unknown, dry_run=dry_run, quiet=quiet or as_json)
    summary = {"out": str(res.out) if res.out else None, "tensors": res.n_tensors, "bytes": res.nbytes,
               "dry_run": dry_run, "notices": res.notices, "skipped_unknown": res.skipped_unknown}
    if as_json:
        if dry_run:
            summary["plan"] = [{"name": t.name, "shape": list(t.shape), "type": t.qtype.name, "bytes": t.nbytes}
                               for t in res.plan.tensors]
        typer.echo(json.dumps(summary))
    elif dry_run:
        for t in res.plan.tensors:
            typer.echo(f"{t.name:<44} {t.qtype.name:<5} {str(list(t.shape)):<22} {t.nbytes:>12}")
        typer.echo(f"dry run: {res.n_tensors} tensors, {res.nbytes / 2**30:.3f} GiB; nothing written")
    else:
        typer.echo(f"wrote {res.out}: {res.n_tensors} tensors, {res.nbytes / 2**30:.3f} GiB")


@app.command()
def info(
    path: Path = typer.Argument(..., help="a GGUF file"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Architecture, hparams, tensors by type, size, and which Clover features the file supports."""
    from clover_gguf.info import format_info, read_info

    data = read_info(path)
    typer.echo(json.dumps(data) if as_json else format_info(data))


def main() -> None:
    import click

    try:
        rv = app(standalone_mode=False)
    except UserError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except click.exceptions.Abort:  # Ctrl-C inside click
        _err("interrupted")
        sys.exit(130)
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except click.ClickException as e:  # usage errors: click's own one-line message, exit 2
        e.show()
        sys.exit(e.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
