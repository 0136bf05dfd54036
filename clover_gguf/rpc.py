"""llama.cpp's RPC backend: the model's layers on `ggml-rpc-server`s on other machines (docs/serve.md, "RPC").

The devices are chosen as llama.cpp's own `--rpc` does (common/arg.cpp, llama.cpp's default device list): each
server is added through the RPC registry's `ggml_backend_rpc_add_server`, and the model gets the servers' devices
first, then this machine's GPUs (integrated GPUs only when there is no discrete one). Offloaded layers are spread
over those devices in proportion to their free memory; the input embedding stays on this machine's CPU.

ggml aborts the process when a server cannot be reached or answers anything but its protocol, and waits forever
(SIGINT deferred) on one that accepts and never answers. So every endpoint is checked before ggml sees it
(`check_peer`): resolved as ggml resolves it (IPv4), connected, and asked HELLO and DEVICE_COUNT as the pinned
ggml-rpc speaks them (ggml/src/ggml-rpc/ggml-rpc.cpp), every step under one timeout; a peer that fails says which
one and why, in one line. Upstream calls the RPC backend a proof of concept, "fragile and insecure": never expose a
server on an open network.
"""

from __future__ import annotations

import ctypes
import re
import socket
import struct
import time
from typing import Any, Sequence

from clover_gguf.errors import UserError

DEVICE_GPU, DEVICE_IGPU = 1, 2  # enum ggml_backend_dev_type
CONNECT_TIMEOUT_S = 5.0  # the whole check of one peer: resolve aside, connect + HELLO + DEVICE_COUNT

# The pinned ggml-rpc's wire format (ggml/src/ggml-rpc/ggml-rpc.cpp, ggml/include/ggml-rpc.h, transport.h):
# request  | cmd: u8 | size: u64 | data |      response | size: u64 | data |      (little endian)
RPC_CMD_HELLO, RPC_CMD_DEVICE_COUNT = 14, 15  # enum rpc_cmd ("RPC_CMD_HELLO must be always 14")
RPC_PROTO_MAJOR, RPC_PROTO_MINOR, RPC_PROTO_PATCH = 7, 0, 0  # RPC_PROTO_*_VERSION; ggml refuses another major
CONN_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: rpc_msg_hello_req = caps; all zero = plain TCP, no RDMA upgrade
HELLO_RSP_SIZE = 4 + CONN_CAPS_SIZE  # rpc_msg_hello_rsp: major, minor, patch, padding (u8 each), caps
DEVICE_COUNT_RSP_SIZE = 4  # rpc_msg_device_count_rsp: u32

# a host name or IPv4 address as ggml's gethostbyname takes it: ASCII labels of 1-63 letters, digits and hyphens
_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOST = re.compile(rf"(?=[^\n]{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
_checked: set[str] = set()  # endpoints ggml was given in this process (it keeps a connection to each: not twice)


def _shown(text: str, limit: int = 60) -> str:
    """A user's value inside a one-line message: quoted, escaped (no newline survives), cut if long."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit - 4] + "...'"


def parse_endpoints(spec: str | Sequence[str] | None) -> list[str]:
    """"HOST:PORT[,HOST:PORT...]" (or a list of them) -> ["HOST:PORT", ...]; one clear error for a malformed one.
    ggml splits an endpoint at its first colon and resolves the host with gethostbyname (IPv4), so a host is a DNS
    name or an IPv4 address (no IPv6 literals), and the port is 1-65535 in ASCII digits."""
    if not spec:
        return []
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in s.split(",")]
    out = []
    for item in (i.strip() for i in items):
        host, sep, port = item.partition(":")
        if not (sep and _HOST.fullmatch(host) and _PORT.fullmatch(port) and 0 < int(port) < 65536):
            raise UserError(f"--rpc: {_shown(item)} is not HOST:PORT (a host name or IPv4 address, a port 1-65535)")
        out.append(f"{host}:{int(port)}")
    return out


class _Peer:
    """One connection of the check, every step bounded by the same deadline."""

    def __init__(self, endpoint: str, timeout: float):
        self.ep, self.deadline = endpoint, time.monotonic() + timeout
        self.timeout = timeout
        self.sock: socket.socket | None = None

    def fail(self, why: str) -> UserError:
        return UserError(f"RPC server {self.ep} {why}")

    def left(self) -> float:
        return max(0.01, self.deadline - time.monotonic())

    def connect(self) -> None:
        host, _, port = self.ep.partition(":")
        try:  # as ggml: gethostbyname, the first IPv4 address
            addr = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4]
        except (OSError, UnicodeError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__
            raise self.fail(f"is unreachable: cannot resolve {_shown(host)} ({why})") from None
        try:
            self.sock = socket.create_connection(addr, timeout=self.left())
        except socket.timeout:
            raise self.fail(f"is unreachable: no connection within {self.timeout:g} s") from None
        except OSError as e:
            raise self.fail(f"is unreachable ({e.strerror or type(e).__name__}): start `ggml-rpc-server -H HOST "
                            "-p PORT` there, or check the address") from None

    def ask(self, cmd: int, name: str, payload: bytes, size: int) -> bytes:
        """Send one command, read its reply of `size` bytes (after the u64 size, which must say `size`)."""
        assert self.sock is not None
        try:
            self.sock.settimeout(self.left())
            self.sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
            head = self._read(8, name)
            (got,) = struct.unpack("<Q", head)
            if got != size:
                raise self.fail(f"is not a ggml-rpc-server (or not this llama.cpp's): its reply to {name} begins "
                                f"{_shown(head.decode('latin-1'), 40)}, not ggml's RPC")
            return self._read(size, name)
        except socket.timeout:
            raise self.fail(f"accepted the connection but did not answer {name} within {self.timeout:g} s: it is "
                            "not a ggml-rpc-server, or one busy with another client") from None
        except ConnectionError:  # reset or closed under our write: the same as a close under our read
            raise self._closed(name) from None
        except OSError as e:
            raise self.fail(f"broke the connection during {name} ({e.strerror or type(e).__name__}): is it a "
                            "ggml-rpc-server?") from None

    def _closed(self, name: str, got: int | None = None, n: int = 0) -> UserError:
        part = f" ({got} of {n} bytes of the reply)" if got is not None else ""
        return self.fail(f"closed the connection during {name}{part}: it is not a ggml-rpc-server, or not one of "
                         "this llama.cpp")

    def _read(self, n: int, name: str) -> bytes:
        assert self.sock is not None
        buf = b""
        while len(buf) < n:
            self.sock.settimeout(self.left())
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise self._closed(name, len(buf), n)
            buf += chunk
        return buf

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def check_peer(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Connect to one endpoint and speak ggml-rpc's HELLO and DEVICE_COUNT as the pinned ggml does, within
    `timeout` seconds; -> its device count. UserError (one line: which peer, what went wrong) for anything ggml
    would abort or hang on. The connection is closed again: ggml opens its own."""
    peer = _Peer(endpoint, timeout)
    peer.connect()
    try:
        rsp = peer.ask(RPC_CMD_HELLO, "the RPC handshake (HELLO)", bytes(CONN_CAPS_SIZE), HELLO_RSP_SIZE)
        major, minor, patch = rsp[0], rsp[1], rsp[2]
        if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
            raise peer.fail(f"speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp speaks "
                            f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.{RPC_PROTO_PATCH}: run the same llama.cpp on both "
                            "sides")
        (count,) = struct.unpack("<I", peer.ask(RPC_CMD_DEVICE_COUNT, "DEVICE_COUNT", b"", DEVICE_COUNT_RSP_SIZE))
    finally:
        peer.close()
    if count == 0:
        raise peer.fail("offers no devices")
    return count


def check_reachable(endpoints: Sequence[str], timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Every endpoint ggml has not been given yet in this process passes check_peer (all of them before ggml sees
    any: a good server listed first must not be connected while a later one is bad)."""
    for ep in endpoints:
        if ep not in _checked:
            check_peer(ep, timeout)


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
    check_reachable(endpoints)  # ggml aborts (or hangs) on a server it cannot reach or that is not one
    add_server = ctypes.CFUNCTYPE(vp, ctypes.c_char_p)(addr)
    found: list[int] = []
    for ep in endpoints:
        server = add_server(ep.encode())
        _checked.add(ep)
        if not server:
            raise UserError(f"RPC server {ep} offers no devices")
        found += [ggml.ggml_backend_reg_dev_get(server, i) for i in range(ggml.ggml_backend_reg_dev_count(server))]
    local = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
    gpus = [d for d in local if ggml.ggml_backend_dev_type(d) == DEVICE_GPU]
    found += gpus or [d for d in local if ggml.ggml_backend_dev_type(d) == DEVICE_IGPU][:1]
    return (vp * (len(found) + 1))(*found, None)
