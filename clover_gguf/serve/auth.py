"""Who may use `serve`: the API key (--api-key) checked before anything else, and whether a host is loopback."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from clover_gguf.errors import UserError
import clover_gguf.serve.anthropic as anthropic
from clover_gguf.serve.page import PAGE_PATHS
from clover_gguf.serve.schema import error_body


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_api_key(key: str) -> str:
    """An API key is 1..4096 printable ASCII characters without spaces (what a Bearer token can carry in an HTTP
    header on every client). An empty key would turn authentication off (`--api-key "$KEY"` with KEY unset); a
    non-ASCII one reaches the server as whatever bytes each client encodes it to."""
    if not key:
        raise UserError("the API key is empty (--api-key '' or an empty $CLOVER_GGUF_API_KEY): an empty key would "
                        "turn authentication off; give a key, or leave the option out")
    if len(key) > 4096 or not all("!" <= c <= "~" for c in key):
        raise UserError("the API key must be at most 4096 printable ASCII characters without spaces (a Bearer "
                        "token in an HTTP header)")
    return key


class RequireKey:
    """ASGI middleware: with an API key set, every path but /health and the chat page's files (the API,
    /openapi.json) needs it. It runs before routing and before the body is read, so a request without the key learns
    nothing else (401 first). The page holds nothing of the server's; it asks for the key before it calls the API."""

    OPEN = frozenset({"/health"}) | PAGE_PATHS

    def __init__(self, app: Any, api_key: str):
        self.app, self.key = app, check_api_key(api_key).encode("ascii")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            headers = Headers(scope=scope)
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
            # header values are bytes, which Starlette decodes as latin-1: encoded back, they are what was sent
            if not hmac.compare_digest(token.encode("latin-1", "replace"), self.key):
                message = "missing or wrong API key (send Authorization: Bearer KEY, or x-api-key: KEY)"
                body = (anthropic.error_body(401, message) if anthropic.owns(scope["path"])
                        else error_body(message, "authentication_error", code="invalid_api_key"))
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
