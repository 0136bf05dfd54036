"""Where tests and the GPU check (bench/device/run.sh) place a model's layers.

CLOVER_GGUF_TEST_GPU_LAYERS=N makes the tests that load a model (parity, runtime) offload N layers (-1: all); unset,
as in CI, they pass no offload option and run as a user's default does. run.sh sets it to -1 on the CUDA build.
"""

from __future__ import annotations

import inspect
import os

ENV_GPU_LAYERS = "CLOVER_GGUF_TEST_GPU_LAYERS"


def offload_kwargs(gpu_layers: int, n_cpu_moe: int = 0) -> dict:
    """Keyword arguments of LlamaContext / CloverRuntime that put `gpu_layers` layers (-1: all) on the GPU, the routed
    experts of the first `n_cpu_moe` layers in host memory. Both signatures are served: `n_gpu_layers` (no expert
    placement: NotImplementedError for n_cpu_moe > 0) and the `offload` option (clover_gguf.offload) replacing it."""
    from clover_gguf.llama_context import LlamaContext

    if "offload" in inspect.signature(LlamaContext).parameters:
        from clover_gguf.offload import Offload

        return {"offload": Offload(gpu_layers="all" if gpu_layers < 0 else gpu_layers, n_cpu_moe=n_cpu_moe)}
    if n_cpu_moe:
        raise NotImplementedError("this runtime has no expert placement (--n-cpu-moe): clover_gguf.offload is missing")
    return {"n_gpu_layers": gpu_layers}


def env_offload_kwargs() -> dict:
    """offload_kwargs for $CLOVER_GGUF_TEST_GPU_LAYERS; {} when it is unset."""
    value = os.environ.get(ENV_GPU_LAYERS)
    return offload_kwargs(int(value)) if value else {}

