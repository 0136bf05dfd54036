"""`clover-gguf fit`: which offload and context fit a GPU (or a Mac) and what is left, predicted part by part before
anything is downloaded; `--measure` loads the model and sets the prediction beside what llama.cpp allocates.

The parts (bytes), for the settings the runtime really uses (runtime.context_settings):
- weights on the device / in host memory: every tensor's bytes (the file's, or from `quantize --plan` for
  `--config --type`: the same code), placed by llama.cpp's rule (offload.on_device)
- kv: the full-attention layers' K and V for n_ctx cells (padded to 256; one unified cache for all sequences)
- recurrent: the GDN layers' conv and delta-rule states, one per sequence the runtime keeps (main, block scratch,
  rollback backup), times 1 + n_rs_seq with `--rollback snapshot`
- compute: llama.cpp's compute buffers for the largest graph, from llama.cpp's own graph allocator run on the model
  without allocating (llama_context.DryRun), plus the output buffer (rows x n_vocab x 4 floats: output_bytes).
  Hand arithmetic would be wrong here: on the 35B shape the tensors alive at the peak of a prompt pass hold 57 MiB,
  the buffer is 76 MiB (the allocator's free blocks do not fit the next tensor). The buffer grows with the context through the
  attention mask (n_ctx x n_ubatch halves), so two dry runs give it at any context.

`--parallel N` is serve's one context for N slots (clover_gguf.batching): the weights once, N times the cells (KV
cache) and the sequences (recurrent states, each slot keeping a prefix too), one compute buffer for that context.
The plan keeps a 1 GiB margin on the device and in host memory; see docs/hardware.md.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_gguf import metadata as md
from clover_gguf.errors import UserError
from clover_gguf.fsutil import temp_dir
from clover_gguf.offload import ALL, Offload, check_flash_attn, on_device
from clover_gguf.quantize import _pad

GiB, MiB = 2**30, 2**20
MARGIN = GiB
CTX_PAD = 256  # llama.cpp rounds n_ctx up to this (llama-context.cpp)
F16, F32 = 2, 4
PARTS = ("weights_device", "weights_host", "kv", "recurrent", "compute")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


MAX_SIZE = 2**60  # 1 EiB: far above any machine, small enough for exact arithmetic on the plan's sums


def parse_size(text: str) -> int:
    """'24GiB', '16 GB', '16G' (= GiB), '12000MiB', '1e9' -> bytes. GiB/MiB are binary, GB/MB decimal; at most
    MAX_SIZE (a number past a float's range, 1e400, is refused as too large, not an overflow)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m[2].lower() if m else None
    if not m or unit not in _UNITS:
        raise UserError(f"cannot read the size {str(text)[:40]!r}: use a number with B, KiB, MiB, GiB, TiB "
                        "(binary) or KB, MB, GB, TB (decimal), e.g. 24GiB")
    value = float(m[1]) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise UserError(f"the size {str(text)[:40]!r} is too large: at most {MAX_SIZE // 2**60} EiB")
    return int(value)


# ---- the model ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What memory depends on, from a Clover GGUF's metadata."""

    n_layer: int
    n_vocab: int
    n_embd: int
    context_length: int
    block_size: int
    recurrent: tuple[bool, ...]  # per layer: a GDN layer (recurrent state) or full attention (KV cache)
    kv_per_cell: int  # K + V elements of one layer for one cell: n_head_kv * (key_length + value_length)
    state_per_seq: int  # f32 elements of one GDN layer's state for one sequence: conv window + delta-rule state
    block_mode: bool

    @classmethod
    def from_kv(cls, kv: dict[str, Any], where: str) -> "Shape":
        from clover_gguf.gguf_header import ArrayInfo

        if kv.get(md.ARCHITECTURE) != md.ARCH:
            raise UserError(f"{where} is not a Clover GGUF (architecture {kv.get(md.ARCHITECTURE)!r})")

        def key(name: str, default: Any = None) -> Any:
            v = kv.get(md.hparam(name), default)
            if v is None:
                raise UserError(f"{where}: the GGUF has no {md.hparam(name)}")
            return v

        n_layer = int(key("block_count"))
        recr = kv.get(md.hparam("attention.recurrent_layers"))
        if not isinstance(recr, list) or len(recr) < n_layer:
            interval = int(key("full_attention_interval", 4))
            recr = [(i + 1) % interval != 0 for i in range(n_layer)]
        n_head_kv = key("attention.head_count_kv")
        if isinstance(n_head_kv, list):
            n_head_kv = max(n_head_kv)
        d_conv, d_inner = int(key("ssm.conv_kernel")), int(key("ssm.inner_size"))
        d_state, n_group = int(key("ssm.state_size")), int(key("ssm.group_count"))
        tokens = kv.get("tokenizer.ggml.tokens")
        n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens or []) or int(key("vocab_size"))
        return cls(
            n_layer=n_layer, n_vocab=n_vocab, n_embd=int(key("embedding_length")),
            context_length=int(key("context_length")), block_size=int(kv.get(md.BLOCK_SIZE, 32)),
            recurrent=tuple(bool(r) for r in recr[:n_layer]),
            kv_per_cell=int(n_head_kv) * (int(key("attention.key_length")) + int(key("attention.value_length"))),
            # llama.cpp's n_embd_r + n_embd_s (llama-hparams.cpp): (d_conv - 1) * conv channels + d_state * d_inner
            state_per_seq=(d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner,
            block_mode=bool(kv.get(md.BLOCK_MODE, False)))


@dataclass
class Model:
    """A model to fit: its shape, its weights (name -> bytes as stored, padded to the file's alignment), and a
    GGUF llama.cpp can read for the compute dry run (the file itself, or a header-only skeleton)."""

    shape: Shape
    weights: dict[str, int]
    gguf: Path
    label: str
    file_name: str
    is_file: bool


def model_from_file(path: Path) -> Model:
    """The file, checked as generate checks it (gguf_header.read_clover) before llama.cpp sees it."""
    from clover_gguf.gguf_header import read_clover, tensor_bytes

    path = Path(path)
    h = read_clover(path)
    shape = Shape.from_kv(h.kv, str(path))
    weights = {n: _pad(tensor_bytes(qt, s), h.alignment) for n, (s, qt) in h.tensors.items()}
    return Model(shape, weights, path, f"{path.name} ({_size(sum(weights.values()))} of weights)", str(path), True)


def model_from_config(config: Path, qtype: str, workdir: Path) -> Model:
    """The weights of `quantize --plan --config config.json --type T` (the same call), on a skeleton of the model."""
    from clover_gguf.gguf_header import read_header
    from clover_gguf.quantize import plan
    from clover_gguf.skeleton import write_skeleton

    config = Path(config)
    if not config.is_file():
        raise UserError(f"no such config file: {config}")
    qp = plan(qtype, config=config)
    skeleton = workdir / "skeleton.gguf"
    write_skeleton(config, skeleton)
    shape = Shape.from_kv(read_header(skeleton).kv, str(config))
    weights = {t.name: _pad(t.bytes, qp.alignment) for t in qp.tensors}
    return Model(shape, weights, skeleton, f"{config.name} as {qp.ftype} ({qp.size_gib:.2f} GiB file)",
                 f"clover-{qp.ftype.lower()}.gguf", False)


# ---- one configuration ------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """What the runtime is asked to do (fit's options) and how the weights are placed (the plan's choice)."""

    mode: str = "auto"
    rollback: str = "redecode"
    parallel: int = 1
    mmap: bool = True
    n_gpu_layers: int = 0  # llama.cpp's meaning: ALL (-1) or a count, the output layer counting as one
    n_cpu_moe: int = 0
    threads: int | None = None  # --threads / --poll: the run's (None: its defaults, clover_gguf.threads)
    poll: int | None = None
    flash_attn: str = "auto"  # --flash-attn: the run's (its compute buffers depend on it)


@dataclass
class Prediction:
    ctx: int
    parts: dict[str, int]  # PARTS, for all slots
    device_bytes: int
    host_bytes: int


class Predictor:
    """Bytes of a model in a setup at a context, part by part."""

    def __init__(self, model: Model, setup: Setup, compute_at: "ComputeCurve"):
        self.model, self.setup, self.compute_at = model, setup, compute_at

    def settings(self, ctx: int) -> dict:
        from clover_gguf.runtime import context_settings

        s, n = self.model.shape, self.setup.parallel
        # serve --parallel N: one context for the N slots (their cells, their sequences), each keeping a prefix and
        # a prompt
        return context_settings(s.block_size, ctx, s.context_length, self.setup.rollback, keep_prefix=n > 1, slots=n,
                                keep_prompt=n > 1)

    def __call__(self, ctx: int, n_gpu_layers: int | None = None, n_cpu_moe: int | None = None) -> Prediction:
        s, st = self.model.shape, self.setup
        ngl = st.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        k = st.n_cpu_moe if n_cpu_moe is None else n_cpu_moe
        patterns = Offload(n_cpu_moe=k).expert_patterns(s.n_layer)
        cs = self.settings(ctx)

        w_dev = sum(b for n, b in self.model.weights.items() if on_device(n, s.n_layer, ngl, patterns))
        w_host = sum(self.model.weights.values()) - w_dev
        layer_dev = [on_device(f"blk.{i}.", s.n_layer, ngl, []) for i in range(s.n_layer)]
        kv_layer = _pad(cs["n_ctx"], CTX_PAD) * s.kv_per_cell * (F32 if cs["exact"] else F16)
        rs_layer = cs["n_seq_max"] * (1 + cs["n_rs_seq"]) * s.state_per_seq * F32
        kv = {True: 0, False: 0}
        rs = {True: 0, False: 0}
        for i in range(s.n_layer):
            if s.recurrent[i]:
                rs[layer_dev[i]] += rs_layer
            else:
                kv[layer_dev[i]] += kv_layer
        rows = 1 if st.mode == "ar" else cs["n_outputs_max"]
        output = output_bytes(max(cs["n_seq_max"], rows), s.n_vocab)  # host (pinned on a GPU build)
        # serve's slots share one context: the sizes above are all of theirs; the curve is keyed by one slot's context
        n_slot = cs["n_ctx"] // st.parallel
        c_dev, c_host = self.compute_at(n_slot, ngl, s)
        device = w_dev + kv[True] + rs[True] + c_dev
        host = w_host + kv[False] + rs[False] + c_host + output
        parts = {"weights_device": w_dev, "weights_host": w_host, "kv": kv[True] + kv[False],
                 "recurrent": rs[True] + rs[False], "compute": c_dev + c_host + output}
        return Prediction(n_slot, parts, device, host)


class ComputeCurve:
    """Compute-buffer bytes (device, host) by context, from llama.cpp's dry run at two contexts. In between it is
    linear: the attention mask (n_ctx x n_ubatch) is the part that grows. The plan's final context is then dry-run
    exactly (`exact`)."""

    def __init__(self, dry: Any, settings_at: Any, lo: int, hi: int, gpu_here: bool):
        self.dry, self.settings_at, self.gpu_here = dry, settings_at, gpu_here
        self.points: dict[int, tuple[int, int]] = {}
        for c in sorted({lo, hi}):
            self.points[c] = self.measure(c)

    def measure(self, ctx: int) -> tuple[int, int]:
        b = self.dry.buffers(**self.settings_at(ctx))
        comp = b.get("compute", {})
        from clover_gguf.llama_memory import is_host_buffer

        dev = sum(v for k, v in comp.items() if not is_host_buffer(k))
        host = sum(v for k, v in comp.items() if is_host_buffer(k))
        return dev, host

    def exact(self, ctx: int) -> None:
        n = _pad(ctx, CTX_PAD)
        if n not in self.points:
            self.points[n] = self.measure(n)

    def _total(self, ctx: int) -> tuple[int, int]:
        n = _pad(ctx, CTX_PAD)
        if n in self.points:
            return self.points[n]
        (c0, v0), (c1, v1) = sorted(self.points.items())[0], sorted(self.points.items())[-1]
        if c1 == c0:
            return v0
        t = (n - c0) / (c1 - c0)
        return tuple(round(a + (b - a) * t) for a, b in zip(v0, v1))  # type: ignore[return-value]

    def __call__(self, ctx: int, n_gpu_layers: int, shape: Shape) -> tuple[int, int]:
        dev, host = self._total(ctx)
        total = dev + host
        if n_gpu_layers == 0:
            return 0, total
        if self.gpu_here:
            return dev, host  # as this machine's backends split it (dry-run with every layer on the GPU)
        # planned for a GPU on a machine without one: the graph runs on the GPU, llama.cpp keeps the input
        # embedding rows (n_embd x n_ubatch floats) on the CPU; with some layers on the CPU both sides need a
        # buffer for the largest layer (counted in full on both: an upper bound)
        if 0 < n_gpu_layers <= shape.n_layer:
            return total, total
        return total, shape.n_embd * max(512, shape.block_size) * F32


# ---- the plan ---------------------------------------------------------------------------------------------------
@dataclass
class Budget:
    vram: int | None  # None: no GPU (everything in host memory)
    ram: int
    unified: bool  # Apple silicon: the GPU's memory is part of host memory
    device: str  # where vram came from


@dataclass
class FitResult:
    fits: bool
    model: str
    mode: str
    parallel: int
    rollback: str
    gpu_layers: int  # layers on the GPU, the output layer counting as one (n_layer + 1 = all)
    n_cpu_moe: int
    ctx: int
    n_layer: int
    parts: dict[str, int]
    device_bytes: int
    host_bytes: int
    budget: Budget
    command: str
    notes: list[str] = field(default_factory=list)
    llama_fit: str | None = None
    measured: dict[str, int] | None = None
    pass_costs: dict[str, dict[str, float]] | None = None  # --measure: ms per pass by kind and rows (auto.PassCosts)
    pass_spread: dict[str, dict[str, list[float]]] | None = None  # --measure: [lowest, highest ms, timings] of each
    threading: dict | None = None  # --measure: the threads and poll the run chose, and why (threads.Threading)
    ctx_asked: int | None = None  # a --ctx above the model's context (planned for the model's): the plan line says so

    def to_json(self) -> dict:
        out = {"fits": self.fits, "gpu_layers": self.gpu_layers, "n_cpu_moe": self.n_cpu_moe, "ctx": self.ctx,
               "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "parts": dict(self.parts),
               "command": self.command, "model": self.model, "mode": self.mode, "parallel": self.parallel,
               "rollback": self.rollback, "vram_bytes": self.budget.vram, "ram_bytes": self.budget.ram,
               "unified_memory": self.budget.unified, "device": self.budget.device, "margin_bytes": MARGIN,
               "notes": self.notes}
        if self.llama_fit is not None:
            out["llama_fit_params"] = self.llama_fit
        if self.measured is not None:
            out["measured"] = dict(self.measured)
        if self.pass_costs is not None:
            out["pass_ms"] = self.pass_costs
            out["pass_ms_spread"] = self.pass_spread
            out["threads"] = self.threading
        return out

    def format(self) -> str:
        b = self.budget
        # without a GPU the line speaks of host memory only (the JSON's device says none was found)
        where = (f"{_gib(b.vram)} GiB on the GPU ({b.device}){' shared with' if b.unified else ' +'} "
                 f"{_gib(b.ram)} GiB of host memory, 1 GiB kept free on each" if b.vram is not None else
                 f"{_gib(b.ram)} GiB of host memory, 1 GiB of it kept free")
        lines = [f"model    {self.model}", f"target   {where}",
                 f"mode     {self.mode}" + (f", rollback {self.rollback}" if self.mode in ("draft-self", "auto") else "")
                 + (f", {self.parallel} slots" if self.parallel > 1 else "")]
        verdict = "fits" if self.fits else "does NOT fit"
        capped = f" (the model's most: --ctx {self.ctx_asked} is above it)" if self.ctx_asked else ""
        lines.append(f"plan     {verdict}: context {self.ctx}{capped}, {self._placement()}")
        lines.append("")
        meas = self.measured
        head = f"  {'part (MiB)':<16} {'predicted':>12}" + (f" {'measured':>12} {'pred/meas':>10}" if meas else "")
        lines.append(head)
        for p in PARTS:
            row = f"  {p:<16} {_mib(self.parts[p]):>12}"
            if meas:
                m = meas.get(p, 0)
                ratio = f"{self.parts[p] / m:10.3f}" if m else f"{'-':>10}"
                row += f" {_mib(m):>12} {ratio}"
            lines.append(row)
        left_dev = (b.vram - MARGIN - self.device_bytes) if b.vram is not None else None
        host_room = b.ram - MARGIN - self.host_bytes - (self.device_bytes if b.unified else 0)
        lines.append(f"device   {_gib(self.device_bytes)} GiB, {_gib(left_dev)} GiB left" if left_dev is not None
                     else "device   none")
        lines.append(f"host     {_gib(self.host_bytes)} GiB, {_gib(host_room)} GiB left")
        said = f"--ctx {self.ctx_asked} is above" if self.ctx_asked else None  # the plan line said it
        lines += [f"note     {n}" for n in self.notes if not (said and n.startswith(said))]
        if self.llama_fit is not None:
            lines.append(f"llama.cpp's own fit (llama-fit-params): {self.llama_fit}")
        if self.threading is not None:
            lines.append(f"threads  {self.threading['describe']}")
        if self.pass_costs is not None:
            lines.append(f"passes   {passes_line(self.pass_costs, self.pass_spread)}")
        lines.append(f"run      {self.command}")
        return "\n".join(lines)

    def _placement(self) -> str:
        if self.budget.vram is None or self.gpu_layers == 0:
            return "everything on the CPU"
        bits = ["all layers on the GPU" if self.gpu_layers > self.n_layer else f"{self.gpu_layers} layers on the GPU"]
        bits.append(f"routed experts of the first {self.n_cpu_moe} layers in host memory" if self.n_cpu_moe else
                    "no expert offload")
        return ", ".join(bits)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def make_budget(vram: str | None, ram: str | None, unified: bool | None, has_library_gpu: list) -> Budget:
    ram_b = parse_size(ram) if ram is not None else host_memory()
    if vram is not None:
        return Budget(parse_size(vram), ram_b, bool(unified), "--vram")
    if has_library_gpu:
        d = has_library_gpu[0]
        return Budget(d.free, ram_b, d.integrated if unified is None else unified,
                      f"{d.name}: {d.description}, free memory")
    return Budget(None, ram_b, False, "none found by llama.cpp")


def _fits(pred: Prediction, budget: Budget) -> bool:
    # a plan that puts nothing on the device fits any GPU, also one with less than the margin (--vram 0)
    if budget.vram is not None and pred.device_bytes and pred.device_bytes > budget.vram - MARGIN:
        return False
    host = pred.host_bytes + (pred.device_bytes if budget.unified else 0)
    return host <= budget.ram - MARGIN


def _round_ctx(ctx: int) -> int:
    return ctx // 1024 * 1024 if ctx >= 1024 else ctx // CTX_PAD * CTX_PAD


def _step_down(ctx: int) -> int:
    return ctx - 1024 if ctx > 1024 else ctx - CTX_PAD


def _largest_ctx(predict: Predictor, budget: Budget, hi: int, ngl: int, k: int) -> int:
    """The largest context (a multiple of 1024, or of 256 below 1024) up to `hi` that fits; 0 if none."""
    if _fits(predict(hi, ngl, k), budget):
        return hi
    best, lo, top = 0, 1, hi // CTX_PAD  # binary search in units of CTX_PAD
    while lo <= top:
        mid = (lo + top) // 2
        if _fits(predict(mid * CTX_PAD, ngl, k), budget):
            best, lo = mid * CTX_PAD, mid + 1
        else:
            top = mid - 1
    return _round_ctx(best)


CTX_NOTE = "--ctx {ctx} is above the model's {most}: planned for {most}"  # JSON's note; the text's plan line says it


def plan(model: Model, budget: Budget, setup: Setup, ctx: int | None, dry: Any, gpu_here: bool) -> FitResult:
    """The placement and context for `budget`: with --ctx, the least offload that holds it; without, the largest
    context up to the model's that fits as it is, or, if that is below the runtime's default context, the least
    offload that holds the default and then the largest context there. Experts leave the device before attention
    layers do (--n-cpu-moe 1, 2, ... n_layer, then fewer --gpu-layers)."""
    s = model.shape
    notes = []
    if ctx is not None and ctx > s.context_length:
        notes.append(CTX_NOTE.format(ctx=ctx, most=s.context_length))
    target = min(ctx or s.context_length, s.context_length)
    floor = min(ctx or _default_ctx(), s.context_length)
    predictor = Predictor(model, setup, None)  # type: ignore[arg-type]
    curve = ComputeCurve(dry, predictor.settings, min(floor, 4096), target, gpu_here)
    predictor.compute_at = curve

    candidates: list[tuple[int, int]] = []
    if budget.vram is not None:
        candidates += [(ALL, k) for k in range(s.n_layer + 1)]
        candidates += [(ngl, s.n_layer) for ngl in range(s.n_layer, 0, -1)]
    candidates.append((0, 0))
    chosen = None
    for ngl, k in candidates:
        c = _largest_ctx(predictor, budget, target, ngl, k)
        while c >= floor:  # the estimate between the two dry runs is linear; check the final context exactly
            curve.exact(c)
            if _fits(predictor(c, ngl, k), budget):
                break
            c = _step_down(c)
        if c >= floor:
            chosen = (ngl, k, c)
            break
    fits = chosen is not None
    if chosen is None:
        chosen = (*candidates[-1], floor)
        notes.append(f"nothing holds {floor} tokens of context: too little memory for this file")
    ngl, k, c = chosen
    curve.exact(c)
    setup.n_gpu_layers, setup.n_cpu_moe = ngl, k
    pred = predictor(c, ngl, k)
    if not model.is_file:
        notes.append("weights from `quantize --plan` of a header-only skeleton (tokenizer metadata not counted)")
    if budget.vram is not None and not gpu_here:
        notes.append("no GPU here: compute buffers sized by this machine's CPU backend running the same graph")
    return FitResult(fits, model.label, setup.mode, setup.parallel, setup.rollback,
                     s.n_layer + 1 if ngl == ALL else ngl, k, pred.ctx, s.n_layer, pred.parts, pred.device_bytes,
                     pred.host_bytes, budget, _command(model, setup, pred.ctx, ngl, k, budget.vram is not None), notes,
                     ctx_asked=ctx if ctx is not None and ctx > s.context_length else None)


def _default_ctx() -> int:
    from clover_gguf.runtime import DEFAULT_CTX

    return DEFAULT_CTX


def _command(model: Model, setup: Setup, ctx: int, ngl: int, k: int, gpu: bool) -> str:
    """The command line to run; --gpu-layers left at its default (auto) when that is what the plan says."""
    off = Offload(gpu_layers="auto" if ngl == ALL or not gpu else ngl, n_cpu_moe=k if k < model.shape.n_layer else 0,
                  cpu_moe=k >= model.shape.n_layer and k > 0, mmap=setup.mmap, threads=setup.threads,
                  poll=setup.poll, flash_attn=setup.flash_attn)
    cmd = ["clover-gguf", "serve" if setup.parallel > 1 else "chat", model.file_name, "--mode", setup.mode,
           "--ctx", str(ctx), *off.cli_args()]
    if setup.parallel > 1:
        cmd += ["--parallel", str(setup.parallel)]
    if setup.rollback != "redecode" and setup.mode in ("draft-self", "auto"):
        cmd += ["--rollback", setup.rollback]
    return " ".join(cmd)


def output_bytes(rows: int, n_vocab: int) -> int:
    """llama.cpp's output buffer for `rows` rows: the logits, and, since the runtime selects in the graph (llama.cpp's
    backend sampling, docs/runtime.md), the sampled logits, probabilities and candidates it keeps at the same stride
    of n_vocab per row, and a token per row (llama_context::output_reserve)."""
    return rows * n_vocab * 4 * F32 + rows * F32


# ---- serve's slots ------------------------------------------------------------------------------------------------
def check_slots(parallel: int, breakdown: dict[str, dict[str, int]], host_bytes: int | None = None,
                devices: list | None = None) -> None:
    """`serve --parallel N` once its one context is made: what llama.cpp holds (LlamaContext.memory_breakdown: the
    weights, the N slots' cells and states, the compute buffers) against this machine's memory and its GPUs' (all of
    it: a plan that cannot fit an empty machine is refused before it is touched, since a host allocation may succeed
    on paper and fail on first use; one that merely finds it busy is llama.cpp's to report). UserError, one line."""
    from clover_gguf.llama_memory import is_host_buffer

    host_bytes = host_memory() if host_bytes is None else host_bytes
    limits = {d.name: d.total for d in devices or [] if not d.integrated}
    on_host = {k: is_host_buffer(k) or k not in limits for k in breakdown}  # a device without a limit: unified memory
    held = {k: sum(v.values()) for k, v in breakdown.items()}
    checks = [("host memory", sum(b for k, b in held.items() if on_host[k]), host_bytes)]
    checks += [(name, held[name], total) for name, total in limits.items() if held.get(name)]
    for where, need, total in checks:
        if need > total:
            raise UserError(f"--parallel {parallel} cannot fit: llama.cpp holds {_size(need)} of {where} for the "
                            f"weights and {parallel} slots, and this machine has {_size(total)}: fewer slots or a "
                            "smaller --ctx")


# ---- measuring ------------------------------------------------------------------------------------------------
def passes_line(ms: dict[str, dict[str, float]], spread: dict[str, dict[str, list[float]]] | None = None) -> str:
    """--measure's pass costs for a person: the AR step, the largest causal and block passes timed (medians, with the
    range of the timings each is taken over), and what a draft must yield to pay on this machine (auto's rule:
    clover_gguf.auto), or that none can: a block holds no more tokens than its rows."""
    def largest(kind: str) -> tuple[int, float] | None:
        rows = ms.get(kind, {})
        return max(((int(r), v) for r, v in rows.items()), default=None)

    def span(kind: str, rows: int) -> str:
        lo_hi = (spread or {}).get(kind, {}).get(str(rows))
        return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f} over {lo_hi[2]})" if lo_hi else ""

    ar = ms.get("causal", {}).get("1")
    causal, block = largest("causal"), largest("block")
    parts = [f"AR step {ar:.2f} ms{span('causal', 1)}" if ar is not None else "AR step not timed"]
    if causal is not None and causal[0] > 1:
        parts.append(f"{causal[0]}-token causal pass {causal[1]:.2f} ms{span('causal', causal[0])}")
    if block is not None:
        parts.append(f"{block[0]}-token block pass {block[1]:.2f} ms{span('block', block[0])}"
                     + (f" ({block[1] / ar:.1f} AR steps)" if ar else ""))
        if ar and causal is not None:
            need = (block[1] + causal[1]) / ar
            parts.append(f"a draft pays here from {need:.1f} tokens per block pass" if need <= block[0] else
                         f"no draft can pay here: a block pass and its verification cost {need:.1f} AR steps, more "
                         f"than the {block[0]} tokens a block holds (auto decodes AR)")
    return ", ".join(parts) + " (medians)"


MEASURE_ROUNDS = 5  # answers per mode whose passes --measure times: its medians rest on that many passes or more


def measure(model: Model, result: FitResult, setup: Setup) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
    """Load the model with the plan's settings, answer one short prompt in the plan's mode (a block pass in the
    block modes), and read what llama.cpp allocated: its buffer-size lines at load, and the compute size llama_free
    reports after the passes. The logits output buffer grows at the first call that asks for more rows than the
    sequences; a Release build of llama.cpp does not log that, so it is taken as rows x n_vocab floats with the
    rows the run asked for (LlamaContext.max_outputs). Then MEASURE_ROUNDS short answers per mode (AR, and draft-self
    on a block-capable file), after one that warms it, time the passes auto chooses from: their medians and ranges.
    -> (bytes by part, ms per pass by kind and rows, [lowest, highest, timings] of each, the threads chosen)."""
    from clover_gguf.auto import PassCosts
    from clover_gguf.llama_context import capture_llama_log
    from clover_gguf.llama_memory import buffer_sizes, is_host_buffer
    from clover_gguf.runtime import CloverRuntime

    off = Offload(gpu_layers="all" if setup.n_gpu_layers == ALL else setup.n_gpu_layers,
                  n_cpu_moe=setup.n_cpu_moe, mmap=setup.mmap, threads=setup.threads, poll=setup.poll,
                  flash_attn=setup.flash_attn)
    with capture_llama_log() as load_log:
        rt = CloverRuntime(model.gguf, n_ctx=result.ctx, rollback=setup.rollback, offload=off,
                           keep_prefix=setup.parallel > 1, keep_prompt=setup.parallel > 1,
                           slots=setup.parallel)  # serve's one context
    try:
        # threshold 0: a block pass resolves every position; then one block pass and one committed block (all its
        # logits) reach the largest graphs of the mode: draft-self commits its draft before it emits a token,
        # diffusion commits a block when the answer goes on past it
        # (auto: draft-self's graphs, the largest it may take)
        mode = "draft-self" if setup.mode == "auto" else setup.mode
        new = {"ar": 4, "draft-self": 1}.get(mode, rt.block_size + 1)
        rt.generate("Hello", mode=mode, max_new_tokens=new, threshold=0.0, think=False)
        rows = rt.ctx.max_outputs
        modes = ("ar", "draft-self") if rt.default_mode != "ar" else ("ar",)
        for r in range(1 + MEASURE_ROUNDS):  # one round to warm, whose passes (cold graphs) the medians leave out
            if r == 1:
                rt.pass_costs = PassCosts()
            for m in modes:  # drafts of one block pass each (threshold 0): the passes' costs, whatever they propose
                rt.generate("Hello", mode=m, max_new_tokens=8, think=False, threshold=0.0 if m != "ar" else None)
        costs, spread = rt.pass_costs.to_json(), rt.pass_costs.spread_json()
        threading = _threading(rt)
    finally:
        with capture_llama_log() as free_log:
            rt.close()
    at_load, at_free = buffer_sizes(load_log), buffer_sizes(free_log)
    model_b = at_load.get("model", {})
    output = max(sum(at_load.get("output", {}).values()), output_bytes(rows, model.shape.n_vocab))
    return {"weights_device": sum(v for k, v in model_b.items() if not is_host_buffer(k)),
            "weights_host": sum(v for k, v in model_b.items() if is_host_buffer(k)),
            "kv": sum(at_load.get("KV", {}).values()), "recurrent": sum(at_load.get("RS", {}).values()),
            "compute": sum((at_free.get("compute") or at_load.get("compute", {})).values()) + output}, costs, spread, \
        threading


def _threading(rt: Any) -> dict | None:
    """The runtime's context's threads and poll (threads.Threading), with its sentence."""
    t = getattr(rt.ctx, "threading", None)  # a serve slot's context passes it through from the shared one
    if t is None:
        return None
    guard = getattr(rt.ctx, "guard", None)  # what the stall guard did while fit measured (threads.StallGuard)
    out = dict(t.to_json(), describe=t.describe())
    if guard is not None:
        out["guard"] = guard.describe()
        out["describe"] += "; " + out["guard"]
    return out


# ---- llama.cpp's own fitting -------------------------------------------------------------------------------------
def llama_fit_params(model: Model, setup: Setup, ctx: int | None, floor: int) -> str:
    """llama-fit-params on the same file and context settings: its `-c N -ngl N -ot ...` line, or why not."""
    from clover_gguf.quantize import llama_tool

    if not model.is_file:
        return "not run: it needs the quantized file itself, not a config"
    try:
        tool = llama_tool("llama-fit-params")
    except UserError:
        return "not run: llama-fit-params is not in this build (`clover-gguf build-llama`)"
    from clover_gguf.runtime import N_SEQ

    cmd = [str(tool), "-m", str(model.gguf), "-ub", str(max(512, model.shape.block_size)), "-np", str(N_SEQ),
           "-kvu", "--fit-target", str(MARGIN // MiB), "--fit-ctx", str(floor)]
    if ctx:
        cmd += ["-c", str(ctx)]
    if setup.flash_attn != "auto":
        cmd += ["-fa", setup.flash_attn]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(tool.parent), env.get("LD_LIBRARY_PATH")]))
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                           timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {e}"
    out = [ln.strip() for ln in p.stdout.splitlines() if ln.strip().startswith("-c ")]
    if p.returncode != 0 or not out:
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        return f"failed (exit {p.returncode}): {err[-1].strip() if err else 'no output'}"
    return out[-1]


# ---- the command --------------------------------------------------------------------------------------------------
def fit(model_path: Path | None = None, config: Path | None = None, qtype: str | None = None,
        vram: str | None = None, ram: str | None = None, ctx: int | None = None, mode: str | None = None,
        parallel: int = 1, rollback: str = "redecode", mmap: bool = True, unified: bool | None = None,
        do_measure: bool = False, threads: int | None = None, poll: int | None = None,
        flash_attn: str = "auto") -> FitResult:
    from clover_gguf.llama_context import gpu_devices
    from clover_gguf.llama_memory import DryRun

    if (model_path is None) == (config is None):
        raise UserError("give either MODEL.gguf or --config config.json --type T")
    if config is not None and not qtype:
        raise UserError("--config needs --type (the file you would download or make, e.g. Q4_K_M)")
    if model_path is not None and qtype:
        raise UserError("--type goes with --config; a GGUF file already has its types")
    if do_measure and model_path is None:
        raise UserError("--measure loads the model: give MODEL.gguf")
    if parallel < 1:
        raise UserError("--parallel must be at least 1")
    if ctx is not None and ctx < CTX_PAD:
        raise UserError(f"--ctx must be at least {CTX_PAD}")
    flash_attn = check_flash_attn(flash_attn)
    budget_in = (vram, ram)
    for v in budget_in:
        if v is not None:
            parse_size(v)  # bad units fail before any work
    # the file's checks come before any scratch folder; TERM and HUP remove the folder as Ctrl-C does
    file_model = model_from_file(Path(model_path)) if model_path is not None else None
    with temp_dir("clover-fit-") as tmp:
        model = file_model or model_from_config(Path(config), qtype, tmp)  # type: ignore[arg-type]
        mode = mode or ("auto" if model.shape.block_mode else "ar")  # as the runtime's default_mode
        if mode != "ar" and not model.shape.block_mode:
            from clover_gguf.runtime import no_block_tensors

            raise UserError(no_block_tensors(Path(model.label), mode))
        setup = Setup(mode=mode, rollback=rollback, parallel=parallel, mmap=mmap, threads=threads, poll=poll,
                      flash_attn=flash_attn)
        devices = gpu_devices()
        if do_measure and vram is not None and not devices:
            raise UserError("--measure loads the model on this machine, which has no GPU: leave out --vram")
        budget = make_budget(vram, ram, unified, devices)
        with DryRun(model.gguf, Offload(flash_attn=setup.flash_attn)) as dry:
            result = plan(model, budget, setup, ctx, dry, gpu_here=bool(devices))
        if devices:
            result.llama_fit = llama_fit_params(model, setup, ctx, min(ctx or _default_ctx(),
                                                                      model.shape.context_length))
        if do_measure:
            result.measured, result.pass_costs, result.pass_spread, result.threading = measure(model, result, setup)
    return result
