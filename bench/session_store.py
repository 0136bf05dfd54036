"""Recorded agent sessions, stored small (bench/sessions/<client>.json.gz): each request as the previous one plus what
changed.

An agent resends its whole system prompt, tool list and history on every turn with a little appended, so a session of
six 150 KB requests is mostly repeats. Each request body is written as JSON text, one line per value
(json.dumps(indent=1): a changed early block, e.g. Claude Code's per-request `cch=` in its first system block, stays a
one-line change), and every request after the first is kept as the line edits that turn the previous request's lines
into it (difflib's opcodes, the replaced lines' new text only); gzip on top. Unpacking rebuilds every body exactly
(`json.loads` of the same text): the client's own bytes, key order included, are what a replay sends.

    {"client": ..., "version": ..., "api": ..., "prompts": [...],
     "requests": [{"path": ..., "headers": {...}, "forced": ..., "answer": {...}, "body": <first> | "edits": [...]}]}

An edit is [i1, i2, [new lines]]: lines i1..i2 of the previous request become those lines.
"""

from __future__ import annotations

import difflib
import gzip
import json
from pathlib import Path

SESSIONS = Path(__file__).resolve().parent / "sessions"  # bench/sessions: the recorded sessions in the repository
SUFFIX = ".json.gz"


def file_of(name: str, folder: Path = SESSIONS) -> Path:
    """The file of the session recorded of client `name` in `folder`."""
    return folder / f"{name}{SUFFIX}"


def recorded(folder: Path = SESSIONS) -> list[str]:
    """The names of the sessions stored in `folder`, sorted."""
    return sorted(p.name[:-len(SUFFIX)] for p in folder.glob(f"*{SUFFIX}"))


# the request headers a server may read (the rest: the client's transport, proxies, secrets)
KEEP_HEADERS = ("anthropic-beta", "anthropic-version", "user-agent", "x-app", "openai-beta", "originator", "session_id",
                "x-stainless-helper-method")


def lines_of(body) -> list[str]:
    return json.dumps(body, indent=1, ensure_ascii=False).split("\n")


def edits(old: list[str], new: list[str]) -> list:
    """The line edits that turn `old` into `new` (only the changed spans, with their new lines)."""
    sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
    return [[i1, i2, new[j1:j2]] for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]


def apply_edits(old: list[str], ops: list) -> list[str]:
    out, at = [], 0
    for i1, i2, repl in ops:
        if i1 < at or i2 < i1 or i2 > len(old):
            raise ValueError(f"edit [{i1}, {i2}] out of order or past the previous request's {len(old)} lines")
        out += old[at:i1] + list(repl)
        at = i2
    return out + old[at:]


def pack(meta: dict, requests: list[dict]) -> dict:
    """`requests`: [{"body": <JSON>, ...other fields kept as given}] -> the stored form (bodies as edits)."""
    out, prev = [], None
    for r in requests:
        cur = lines_of(r["body"])
        row = {k: v for k, v in r.items() if k != "body"}
        if prev is None:
            row["body"] = r["body"]
        else:
            row["edits"] = edits(prev, cur)
        out.append(row)
        prev = cur
    return {**meta, "requests": out}


def unpack(stored: dict) -> list[dict]:
    """The stored form -> the requests with their bodies whole."""
    out, prev = [], None
    for i, row in enumerate(stored.get("requests") or []):
        r = {k: v for k, v in row.items() if k not in ("body", "edits")}
        if "body" in row:
            body = row["body"]
            prev = lines_of(body)
        elif prev is None:
            raise ValueError(f"request {i + 1} is stored as edits but no request comes before it")
        else:
            prev = apply_edits(prev, row["edits"])
            body = json.loads("\n".join(prev))
        out.append({**r, "body": body})
    return out


def save(path: Path, meta: dict, requests: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime 0: the same session writes the same bytes
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
        z.write(json.dumps(pack(meta, requests), ensure_ascii=False, separators=(",", ":")).encode())
    return path


def load(path: Path) -> tuple[dict, list[dict]]:
    """(the session's fields, its requests whole)."""
    stored = json.loads(gzip.decompress(Path(path).read_bytes()))
    return {k: v for k, v in stored.items() if k != "requests"}, unpack(stored)
