"""Where the weights live: the offload options every command shares, and the placement rule `fit` predicts with.

    --gpu-layers N|all|auto (-ngl)   layers on the GPU; auto = all when the library can offload, else 0
    --cpu-moe / --n-cpu-moe N        routed-expert tensors of every layer / of the first N layers in host memory
    --threads N                      CPU threads, 1..MAX_THREADS (512, ggml's GGML_MAX_N_THREADS); default
                                     clover_gguf.threads' rule (math cores, one for a tiny model)
    --poll N                         how long a waiting CPU thread spins before it sleeps, 0..100 (llama.cpp's
                                     --poll; default 0, sleep at once: clover_gguf.threads)
    --mmap / --no-mmap               map the file (llama.cpp's load mode auto) or read it into memory (none)
    --flash-attn on|off|auto (-fa)   llama.cpp's flash attention setting (its -fa); auto = on wherever the backend
                                     has it, a CPU included (docs/runtime.md: on a CPU off is faster over a long
                                     cache and for block passes, and needs an attention buffer of n_ctx x n_ubatch
                                     x heads floats)

The expert options match llama.cpp's options of the same names (common/arg.cpp): tensors matching
EXPERT_PATTERN, restricted to `blk.i.` for the first N layers, get the CPU buffer type through
llama_model_params.tensor_buft_overrides. `on_device` restates llama.cpp's layer assignment (llama-model.cpp,
load_tensors): the input embedding always stays on the CPU, the last `gpu_layers` of the n_layer + 1 layers (the
output layer counts as one) go to the GPU, and an override wins over the layer's device.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from clover_gguf.errors import UserError

# the routed experts of a layer: gate/up/down (fused gate_up, chunked "ch" variants included), never the shared expert
EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
ALL = -1  # n_gpu_layers for "every layer" (llama.cpp: a negative value means all layers)
# ggml's GGML_MAX_N_THREADS (ggml.h): its CPU backend keeps per-thread state in arrays of this size, so a larger
# count overflows them (a segfault) or asks libgomp for threads it cannot create (an abort on the first decode).
# More threads than cores never helps ggml, so the cap costs nothing; it is fixed (not a multiple of this machine's
# cores) so a command line means the same everywhere.
MAX_THREADS = 512


def check_threads(n: int | None, flag: str = "--threads") -> None:
    """The one bound on a CPU thread count (every command's --threads, quantize's too): None or 1..MAX_THREADS."""
    if n is None:
        return
    if not 1 <= n <= MAX_THREADS:
        raise UserError(f"{flag} must be 1..{MAX_THREADS} (ggml's thread limit), not {n}")


MAX_POLL = 100  # llama.cpp's --poll range (0: no polling, 100: aggressive); its meaning: clover_gguf.threads


def check_poll(n: int | None, flag: str = "--poll") -> None:
    """The one bound on a poll level: None or 0..MAX_POLL."""
    if n is not None and not 0 <= n <= MAX_POLL:
        raise UserError(f"{flag} must be 0..{MAX_POLL} (0: a waiting thread sleeps at once), not {n}")


# --flash-attn's values and llama.h's llama_flash_attn_type for each (tests/test_offload.py reads llama.cpp's own name
# for each back from its log)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def check_flash_attn(value: str) -> str:
    """The one check of a flash attention setting: on, off or auto (any case; the CLI's choice type too) -> its
    lower-case name."""
    v = str(getattr(value, "value", value)).strip().lower()
    if v not in FLASH_ATTN:
        raise UserError(f"--flash-attn must be on, off or auto, not {value!r}")
    return v


def parse_gpu_layers(value: str | int) -> str | int:
    """'auto', 'all' or a layer count >= 0; anything else is a usage error."""
    if isinstance(value, int):
        n = value
    else:
        v = str(value).strip().lower()
        if v in ("auto", "all"):
            return v
        try:
            n = int(v)
        except ValueError:
            raise UserError(f"--gpu-layers must be a number, 'all' or 'auto', not {value!r}") from None
    if n < 0:
        raise UserError(f"--gpu-layers must be at least 0, not {n}")
    return n


@dataclass(frozen=True)
class Offload:
    """The offload options of one command line (see the module docstring)."""

    gpu_layers: str | int = "auto"
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    threads: int | None = None
    mmap: bool = True
    poll: int | None = None
    flash_attn: str = "auto"
    # drop the CPU threads to one while passes stall on a busy machine (threads.StallGuard); off: the counts stay put
    stall_guard: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_layers", parse_gpu_layers(self.gpu_layers))
        object.__setattr__(self, "flash_attn", check_flash_attn(self.flash_attn))
        if self.n_cpu_moe < 0:
            raise UserError(f"--n-cpu-moe must be at least 0, not {self.n_cpu_moe}")
        check_threads(self.threads)
        check_poll(self.poll)
        if self.cpu_moe and self.n_cpu_moe:
            raise UserError("give --cpu-moe (every layer's experts in host memory) or --n-cpu-moe N (the first N "
                            "layers'), not both")

    @property
    def asks_for_gpu(self) -> bool:
        """True when an option only a GPU build can act on was given."""
        return self.gpu_layers not in ("auto", 0) or self.cpu_moe or self.n_cpu_moe > 0

    def n_gpu_layers(self, gpu_offload_supported: bool) -> int:
        """llama_model_params.n_gpu_layers: ALL, or a count."""
        if self.gpu_layers == "auto":
            return ALL if gpu_offload_supported else 0
        if self.gpu_layers == "all":
            return ALL
        return int(self.gpu_layers)

    def cpu_moe_layers(self, n_layer: int) -> int:
        """How many leading layers keep their experts in host memory (checked against the model's layer count)."""
        if self.n_cpu_moe > n_layer:
            raise UserError(f"--n-cpu-moe {self.n_cpu_moe} is above the model's {n_layer} layers")
        return n_layer if self.cpu_moe else self.n_cpu_moe

    def expert_patterns(self, n_layer: int) -> list[str]:
        """The tensor-name regexes that go to the CPU buffer type, as llama.cpp's --cpu-moe / --n-cpu-moe make them."""
        if self.cpu_moe:
            return [EXPERT_PATTERN]
        return [rf"blk\.{i}{EXPERT_PATTERN}" for i in range(self.cpu_moe_layers(n_layer))]

    def llama_args(self, gpu_offload_supported: bool) -> list[str]:
        """The same options for llama.cpp's own tools (llama-imatrix, llama-fit-params)."""
        ngl = self.n_gpu_layers(gpu_offload_supported)
        args = ["-ngl", "all" if ngl == ALL else str(ngl)]
        if self.cpu_moe:
            args.append("--cpu-moe")
        elif self.n_cpu_moe:
            args += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.threads:
            args += ["-t", str(self.threads)]
        if self.poll is not None:
            args += ["--poll", str(self.poll)]
        if self.flash_attn != "auto":
            args += ["-fa", self.flash_attn]
        args += ["--load-mode", "auto" if self.mmap else "none"]
        return args

    def cli_args(self) -> list[str]:
        """These options as a clover-gguf command line would spell them (defaults left out)."""
        out = [] if self.gpu_layers == "auto" else ["--gpu-layers", str(self.gpu_layers)]
        if self.cpu_moe:
            out.append("--cpu-moe")
        elif self.n_cpu_moe:
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.threads:
            out += ["--threads", str(self.threads)]
        if self.poll is not None:
            out += ["--poll", str(self.poll)]
        if not self.mmap:
            out.append("--no-mmap")
        if not self.stall_guard:
            out.append("--no-stall-guard")
        if self.flash_attn != "auto":
            out += ["--flash-attn", self.flash_attn]
        return out


def on_device(name: str, n_layer: int, n_gpu_layers: int, patterns: list[str]) -> bool:
    """Whether llama.cpp puts the weight `name` on the GPU (see the module docstring)."""
    if any(re.search(p, name) for p in patterns):
        return False
    ngl = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    first_gpu = n_layer + 1 - ngl
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return int(m[1]) >= first_gpu
    if name.startswith("token_embd."):
        return False  # the input layer always stays on the CPU
    return ngl > 0  # output_norm, output: the output layer, the last of the n_layer + 1


_NOTICE_GIVEN = False


def no_offload_notice(offload: Offload) -> None:
    """Said once per process: without a GPU the offload options are accepted and do nothing."""
    global _NOTICE_GIVEN
    if offload.asks_for_gpu and not _NOTICE_GIVEN:
        _NOTICE_GIVEN = True
        print("clover-gguf: note: llama.cpp has no GPU to offload to here; --gpu-layers, --cpu-moe and "
              "--n-cpu-moe change nothing", file=sys.stderr)


# ---- the one definition of the options, for typer (cli.py) and argparse (bench/) ---------------------------------
# (name, flags, default, help); --mmap and --stall-guard are boolean pairs
OPTIONS: list[tuple[str, tuple[str, ...], Any, str]] = [
    ("gpu_layers", ("--gpu-layers", "-ngl"), "auto",
     "layers on the GPU: a number, 'all', or 'auto' (all when the llama.cpp build can offload, else 0)"),
    ("cpu_moe", ("--cpu-moe",), False, "keep every layer's routed experts in host memory"),
    ("n_cpu_moe", ("--n-cpu-moe",), 0, "keep the routed experts of the first N layers in host memory"),
    ("threads", ("--threads",), None, f"CPU threads, 1..{MAX_THREADS} (default: the math cores, up to 8; one "
     "for a model of small layers, under 8 MiB of weights each)"),
    ("mmap", ("--mmap/--no-mmap",), True, "map the model file (default) or read it into memory"),
    ("poll", ("--poll",), None, "how long a waiting CPU thread spins before it sleeps, 0..100 (llama.cpp's --poll; "
     "default: 50; llama.cpp's, with the stall guard for a busy machine; 0 sleeps at once)"),
    ("stall_guard", ("--stall-guard/--no-stall-guard",), True, "drop the CPU threads to one while passes stall "
     "(another program holds a core), trying the full count again now and then (default: on)"),
    ("flash_attn", ("--flash-attn", "-fa"), "auto", "flash attention: on, off or auto (llama.cpp's -fa; auto: on "
     "wherever the backend has it, a CPU included; on a CPU off is faster over a long context)"),
]


def add_argparse(ap: Any) -> None:
    """The offload options on an argparse parser (the benches)."""
    import argparse

    for name, flags, default, help_ in OPTIONS:
        if name in ("mmap", "stall_guard"):  # on/off pairs
            ap.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default,
                            help=help_)
        elif isinstance(default, bool):
            ap.add_argument(*flags, dest=name, action="store_true", help=help_)
        else:
            ap.add_argument(*flags, dest=name, default=default, type=str if isinstance(default, str) else int,
                            help=help_)


def from_namespace(ns: Any) -> Offload:
    return Offload(**{name: getattr(ns, name) for name, *_ in OPTIONS})
