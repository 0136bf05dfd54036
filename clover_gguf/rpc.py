"""llama.cpp's RPC backend: the model's layers on `ggml-rpc-server`s on other machines (docs/serve.md, "RPC").

The devices are chosen as llama.cpp's own `--rpc` does (common/arg.cpp, llama.cpp's default device list): each
server is added through the RPC registry's `ggml_backend_rpc_add_server`, and the model gets the servers' devices
first, then this machine's GPUs (integrated GPUs only when there is no discrete one). Offloaded layers are spread
over those devices in proportion to their free memory; the input embedding stays on this machine's CPU.

ggml aborts the process when a server cannot be reached, so every endpoint is checked with a plain TCP connect
first. Upstream calls the RPC backend a proof of concept, "fragile and insecure": never expose a server on an open
network.
"""

from __future__ import annotations

import ctypes
import socket
from typing import Any, Sequence

from clover_gguf.errors import UserError

DEVICE_GPU, DEVICE_IGPU = 1, 2  # enum ggml_backend_dev_type
CONNECT_TIMEOUT_S = 5.0


def parse_endpoints(spec: str | Sequence[str] | None) -> list[str]:
    """"HOST:PORT[,HOST:PORT...]" (or a list of them) -> ["HOST:PORT", ...]; one clear error for a malformed one.
    ggml splits an endpoint at its first colon, so a host cannot contain one (no IPv6 literals)."""
    if not spec:
        return []
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in s.split(",")]
    out = []
    for item in (i.strip() for i in items):
        host, sep, port = item.partition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise UserError(f"--rpc: {item!r} is not HOST:PORT (a host name or IPv4 address, a port 1-65535)")
        out.append(f"{host}:{int(port)}")
    return out


def check_reachable(endpoints: Sequence[str], timeout: float = CONNECT_TIMEOUT_S) -> None:
    for ep in endpoints:
        host, _, port = ep.partition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                pass
        except OSError as e:
            reason = e.strerror or type(e).__name__
            raise UserError(f"RPC server {ep} is unreachable ({reason}): start `ggml-rpc-server -H HOST -p PORT` "
                            "there, or check the address") from None


def devices(ggml: Any, endpoints: Sequence[str]) -> Any:
    """NULL-terminated ggml_backend_dev_t array for llama_model_params.devices: the servers' devices, then local
    GPUs. `ggml` is the ctypes handle of libggml (llama_context.ggml_library())."""
    vp = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.restype = vp
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = vp
    ggml.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_count.argtypes = [vp]
    ggml.ggml_backend_reg_dev_get.restype = vp
    ggml.ggml_backend_reg_dev_get.argtypes = [vp, ctypes.c_size_t]
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = vp
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    ggml.ggml_backend_dev_type.argtypes = [vp]

    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise UserError("this llama.cpp build has no RPC backend: rebuild it with `clover-gguf build-llama`")
    addr = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not addr:
        raise UserError("this llama.cpp build's RPC backend lacks ggml_backend_rpc_add_server")
    check_reachable(endpoints)  # ggml aborts the process on a server it cannot reach
    add_server = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(addr)
    found: list[int] = []
    for ep in endpoints:
        server = add_server(ep.encode())
        if not server:
            raise UserError(f"RPC server {ep} offers no devices")
        found += [ggml.ggml_backend_reg_dev_get(server, i) for i in range(ggml.ggml_backend_reg_dev_count(server))]
    local = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
    gpus = [d for d in local if ggml.ggml_backend_dev_type(d) == DEVICE_GPU]
    found += gpus or [d for d in local if ggml.ggml_backend_dev_type(d) == DEVICE_IGPU][:1]
    return (vp * (len(found) + 1))(*found, None)
