"""A recording proxy between an agent CLI and a server (bench/clients.py): every request kept as the client sent it
(issue 70 replays them), the answer read back in the API it was asked in (text, tool calls, usage), and one rule the
bench may apply on the way: the first call forced.

Why a proxy and not the servers' own logs: the same record for `clover-gguf serve` and llama-server, with the
request's bytes before anything (the forcing rule included) touched them.

Forcing (`force_tool_choice`): a tiny model rarely calls a tool on its own inside an agent's long system prompt, so on
the turn right after the user's message (the request's last message is the user's own words, not a tool result) of a
request that offers tools, the proxy sets tool_choice to the named tool (when the client offers it: its read tool) or
to "any call" in the API's own spelling. Every other request goes through untouched. The record keeps the body as sent
and says which tool_choice the proxy set.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

APIS = ("chat", "messages", "responses")
# request headers that name a secret: kept in the record by name only
SECRET_HEADERS = ("authorization", "x-api-key", "api-key")
HOP_BY_HOP = ("connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host",
              "proxy-connection", "upgrade", "te", "trailer")


def api_of(path: str) -> str | None:
    """The API a request path speaks (query left out): chat completions, Anthropic Messages, OpenAI Responses."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/messages"):
        return "messages"
    if p.endswith("/responses"):
        return "responses"
    return None


# ---- the requests' shapes, per API ---------------------------------------------------------------------------------
def tool_names(api: str, body: dict) -> list[str]:
    """The function tools a request offers (Responses' other tool types, e.g. web_search, are not callable here)."""
    out = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if api == "chat" and t.get("type", "function") == "function":
            out.append((t.get("function") or {}).get("name"))
        elif api == "messages" and t.get("name"):
            out.append(t["name"])
        elif api == "responses" and t.get("type") == "function":
            out.append(t.get("name"))
    return [n for n in out if n]


def _is_tool_result_block(b) -> bool:
    return isinstance(b, dict) and b.get("type") == "tool_result"


def carries_tool_result(api: str, body: dict) -> list[str]:
    """The texts of the tool results a request sends back (empty when it sends none)."""
    out = []
    if api == "chat":
        for m in body.get("messages") or []:
            if isinstance(m, dict) and m.get("role") == "tool":
                out.append(_text_of_content(m.get("content")))
    elif api == "messages":
        for m in body.get("messages") or []:
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), list):
                out += [_text_of_content(b.get("content")) for b in m["content"] if _is_tool_result_block(b)]
    elif api == "responses":
        items = body.get("input")
        for it in items if isinstance(items, list) else []:
            if isinstance(it, dict) and it.get("type") in ("function_call_output", "custom_tool_call_output"):
                out.append(_text_of_content(it.get("output")))
    return out


def _text_of_content(c) -> str:
    """A content field's text: a string, or the text parts of a list of parts/blocks."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "\n".join(_text_of_content(p.get("text") if isinstance(p, dict) and "text" in p else
                                          p.get("content") if isinstance(p, dict) else p) for p in c)
    return "" if c is None else json.dumps(c)


def after_user_words(api: str, body: dict) -> bool:
    """Whether the request's last message is the user's own words (not a tool result): the turn an agent answers
    first after the user spoke. System and developer messages after it do not count (Claude Code sends a system
    message after the user's)."""
    if api in ("chat", "messages"):
        msgs = [m for m in body.get("messages") or []
                if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
        if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "user":
            return False
        c = msgs[-1].get("content")
        return not (isinstance(c, list) and any(_is_tool_result_block(b) for b in c))
    if api == "responses":
        items = body.get("input")
        if isinstance(items, str):
            return True
        if isinstance(items, list):
            items = [it for it in items if not (isinstance(it, dict) and it.get("role") in ("system", "developer"))]
        if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
            return False
        last = items[-1]
        return last.get("type", "message") == "message" and last.get("role") == "user"
    return False


def force_tool_choice(api: str, body: dict, tool: str | None) -> dict | str | None:
    """The tool_choice the bench sets on this request, in the API's spelling, or None to leave it as sent: only on
    the turn after the user's words, only where tools are offered and the client did not already pick one itself
    (tool_choice "none" or a named tool is the client's)."""
    names = tool_names(api, body)
    if not names or not after_user_words(api, body):
        return None
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") not in (None, "auto"):
        return None
    if isinstance(tc, str) and tc not in ("auto",):
        return None
    named = tool if tool in names else None
    if api == "chat":
        return {"type": "function", "function": {"name": named}} if named else "required"
    if api == "messages":
        return {"type": "tool", "name": named} if named else {"type": "any"}
    return {"type": "function", "name": named} if named else "required"


# ---- the answers, per API -------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """What a server answered, read in the request's API: its text, the tools it called, its token counts (prompt:
    every prompt token, cached ones included; cached: those the server did not compute again)."""

    text: str = ""
    calls: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    stop: str | None = None


def sse_events(data: bytes) -> list[dict]:
    """The JSON payloads of a server-sent event stream (`data:` lines; [DONE] and anything not JSON left out)."""
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                try:
                    out.append(json.loads(payload))
                except json.JSONDecodeError:
                    pass
    return out


def _usage_chat(a: Answer, u: dict | None, timings: dict | None = None) -> None:
    if u:
        a.prompt_tokens = u.get("prompt_tokens", a.prompt_tokens)
        a.completion_tokens = u.get("completion_tokens", a.completion_tokens)
        details = u.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            a.cached_tokens = details["cached_tokens"]
    if timings and a.cached_tokens is None and "cache_n" in timings:  # llama-server's own count
        a.cached_tokens = timings["cache_n"]


def _usage_messages(a: Answer, u: dict | None) -> None:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache; cache_read_input_tokens (and
    cache_creation_input_tokens) the others."""
    if not u:
        return
    if "input_tokens" in u:
        cached = int(u.get("cache_read_input_tokens") or 0)
        a.prompt_tokens = int(u["input_tokens"]) + cached + int(u.get("cache_creation_input_tokens") or 0)
        a.cached_tokens = cached
    if "output_tokens" in u:
        a.completion_tokens = u["output_tokens"]


def _usage_responses(a: Answer, u: dict | None) -> None:
    if not u:
        return
    a.prompt_tokens = u.get("input_tokens", a.prompt_tokens)
    a.completion_tokens = u.get("output_tokens", a.completion_tokens)
    a.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens", a.cached_tokens)


def _responses_output(a: Answer, resp: dict) -> None:
    text = []
    for it in resp.get("output") or []:
        if it.get("type") == "message":
            text += [p.get("text", "") for p in it.get("content") or [] if p.get("type") == "output_text"]
        elif it.get("type") in ("function_call", "custom_tool_call"):
            a.calls.append(it.get("name"))
    a.text = "".join(text)
    a.stop = resp.get("status")
    _usage_responses(a, resp.get("usage"))


def parse_answer(api: str, content_type: str, data: bytes) -> Answer:
    """A server's answer (JSON or an event stream) in the request's API -> Answer."""
    a = Answer()
    if "text/event-stream" not in content_type:
        try:
            body = json.loads(data or b"null")
        except json.JSONDecodeError:
            return a
        if not isinstance(body, dict):
            return a
        if api == "chat":
            ch = (body.get("choices") or [{}])[0]
            msg = ch.get("message") or {}
            a.text = msg.get("content") or ""
            a.calls = [(c.get("function") or {}).get("name") for c in msg.get("tool_calls") or []]
            a.stop = ch.get("finish_reason")
            _usage_chat(a, body.get("usage"), body.get("timings"))
        elif api == "messages":
            blocks = body.get("content") or []
            a.text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
            a.calls = [b.get("name") for b in blocks if b.get("type") == "tool_use"]
            a.stop = body.get("stop_reason")
            _usage_messages(a, body.get("usage"))
        elif api == "responses":
            _responses_output(a, body)
        return a
    text = []
    for ev in sse_events(data):
        if api == "chat":
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                text.append(d.get("content") or "")
                for c in d.get("tool_calls") or []:
                    name = (c.get("function") or {}).get("name")
                    if name:
                        a.calls.append(name)
                a.stop = ch.get("finish_reason") or a.stop
            _usage_chat(a, ev.get("usage"), ev.get("timings"))
        elif api == "messages":
            kind = ev.get("type")
            if kind == "message_start":
                _usage_messages(a, (ev.get("message") or {}).get("usage"))
            elif kind == "content_block_start" and (ev.get("content_block") or {}).get("type") == "tool_use":
                a.calls.append(ev["content_block"].get("name"))
            elif kind == "content_block_delta" and (ev.get("delta") or {}).get("type") == "text_delta":
                text.append(ev["delta"].get("text", ""))
            elif kind == "message_delta":
                a.stop = (ev.get("delta") or {}).get("stop_reason") or a.stop
                u = ev.get("usage") or {}
                _usage_messages(a, u if "input_tokens" in u else None)
                if "output_tokens" in u:
                    a.completion_tokens = u["output_tokens"]
        elif api == "responses":
            if ev.get("type") == "response.output_text.delta":
                text.append(ev.get("delta", ""))
            elif ev.get("type") in ("response.completed", "response.incomplete", "response.failed"):
                _responses_output(a, ev.get("response") or {})
                text = [a.text]
    a.text = "".join(text)
    return a


# ---- the proxy ----------------------------------------------------------------------------------------------------
@dataclass
class Exchange:
    """One request as the client sent it and what came back."""

    seq: int
    method: str
    path: str
    api: str | None
    headers: dict
    body: object  # the request's JSON as sent (or its text, or None)
    forced: object = None  # the tool_choice the proxy set, if it set one
    status: int = 0
    seconds: float = 0.0
    answer: Answer = field(default_factory=Answer)
    error: str | None = None  # an HTTP error's body (its start)

    def to_json(self) -> dict:
        return asdict(self)


class _QuietServer(ThreadingHTTPServer):
    """A client that drops its connection (Claude Code opens one it never uses) is no error worth a traceback."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class RecordingProxy:
    """An HTTP proxy on loopback in front of `upstream` (a server's base URL) that keeps every exchange (in memory and
    as NNN.json in `folder`) and applies the forcing rule when `force` is on (`read_tool`: the tool to name)."""

    def __init__(self, upstream: str, folder: Path, force: bool = True, read_tool: str | None = None):
        self.upstream, self.folder, self.force, self.read_tool = upstream.rstrip("/"), Path(folder), force, read_tool
        self.folder.mkdir(parents=True, exist_ok=True)
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=httpx.Timeout(1800, connect=10))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the record is the log
                pass

            def do_any(self):
                proxy._handle(self)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = do_any

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read_body(self, h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    h.rfile.readline()
                    return out
                out += h.rfile.read(size)
                h.rfile.readline()
        n = int(h.headers.get("content-length") or 0)
        return h.rfile.read(n) if n else b""

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        t0 = time.perf_counter()
        raw = self._read_body(h)
        api = api_of(h.path)
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = raw.decode("utf-8", "replace")
        with self._lock:
            ex = Exchange(seq=len(self.exchanges) + 1, method=h.command, path=h.path, api=api,
                          headers={k: ("<secret>" if k.lower() in SECRET_HEADERS else v) for k, v in h.headers.items()},
                          body=body)
            self.exchanges.append(ex)
        self._save(ex, t0)  # the request as sent, kept even if no answer ever comes; saved again with it
        send = raw
        if self.force and api and isinstance(body, dict):
            tc = force_tool_choice(api, body, self.read_tool)
            if tc is not None:
                ex.forced = tc
                send = json.dumps({**body, "tool_choice": tc}).encode()
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["accept-encoding"] = "identity"
        data = b""
        try:
            req = self._http.build_request(h.command, self.upstream + h.path, headers=headers,
                                           content=send if raw else None)
            resp = self._http.send(req, stream=True)
        except httpx.HTTPError as e:
            msg = json.dumps({"error": {"message": f"proxy: {type(e).__name__}: {e}"}}).encode()
            h.send_response(502)
            h.send_header("content-type", "application/json")
            h.send_header("content-length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
            ex.status = 502
            self._save(ex, t0)
            return
        try:
            ex.status = resp.status_code
            h.send_response(resp.status_code)
            for k, v in resp.headers.multi_items():
                if k.lower() not in HOP_BY_HOP:
                    h.send_header(k, v)
            chunked = h.command != "HEAD" and resp.status_code not in (204, 304)
            if chunked:
                h.send_header("transfer-encoding", "chunked")
            else:
                h.send_header("content-length", "0")
            h.end_headers()
            if chunked:
                for piece in resp.iter_raw():
                    if piece:
                        data += piece
                        h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        h.wfile.flush()
                h.wfile.write(b"0\r\n\r\n")
                h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client went away: its record stays
            pass
        finally:
            resp.close()
        if ex.status >= 400:
            ex.error = data[:2000].decode("utf-8", "replace")
        elif api:
            ex.answer = parse_answer(api, resp.headers.get("content-type", ""), data)
        self._save(ex, t0)

    def _save(self, ex: Exchange, t0: float) -> None:
        ex.seconds = time.perf_counter() - t0
        (self.folder / f"{ex.seq:03d}.json").write_text(json.dumps(ex.to_json(), indent=1) + "\n")
