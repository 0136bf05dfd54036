"""A soak of `clover-gguf serve` under mixed agent requests (issue 68): after it, every slot is idle, /health and
/slots agree, and a normal request is answered.

    python bench/soak.py [--model clover_gguf/assets/tiny-clover-tools] [--minutes 10] [--parallel 2] [--clients 8]
                         [--seed 0] [--workdir out/bench-soak] [--json]

One server (`clover-gguf serve MODEL --parallel 2`, loopback) and `--clients` clients, each sending requests one after
another until the time is up, of these kinds at random (the held-out tasks of the tool-trained tiny model give the
conversations and tools):
- task: a held-out agent turn (tools, tool results in the history) whole, or streamed and read to the end;
- required / named: the same turn with tool_choice required, or naming a tool with a maxLength on its string;
- schema: response_format json_schema (an object of an integer and a bounded string);
- logprobs: a plain question with logprobs and top_logprobs;
- cut: a streamed answer of up to 3,000 tokens (or the context less 128), closed after a few chunks (or before its headers);
- leave: a streamed request closed after 0.05-1.5 s whether or not it got a slot (clients that leave while waiting);
- burst: 20 such streams at once, left unread and closed together after 0.5-3 s (most of them waiting: the slots
  change hands while their clients go, issue 68's lost slot);
- hostile: a schema that admits no value, a pattern too complex for the lexer, required: 5 (a 400 each).
Every answer is checked for its status (200 for the good kinds, 400 for the hostile ones; never a 5xx). At the end:
the slots must go idle (a hang guard of 60 s), /health's slots_idle and requests_waiting must agree with /slots, and
one plain request must be answered. Exit 1 when any of that fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from clover_gguf.testing.agent import TOOL_MODEL, held_out_tasks  # noqa: E402
from measure import at_least  # noqa: E402
from serve import free_port, start_logged, stop, wait_ready  # noqa: E402

KINDS = {"task": 4, "required": 2, "named": 2, "schema": 2, "logprobs": 1, "cut": 3, "leave": 4, "burst": 1,
         "hostile": 1}
BURST = 20  # streams a burst opens at once, left unread and closed together
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "note": {"type": "string", "maxLength": 120}},
          "required": ["answer", "note"]}
HOSTILE = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, 400),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^(x{1000}){1000}$"}}}}, 400),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]}, 400),
]


class Soak:
    def __init__(self, base: str, tasks: list, rng: random.Random, max_tokens: int, long_tokens: int):
        self.base, self.tasks, self.rng, self.max_tokens = base, tasks, rng, max_tokens
        self.long_tokens = long_tokens  # of the answers cut or left (3,000, or what the context leaves)
        self.counts: collections.Counter = collections.Counter()  # (kind, outcome)
        self.bad: list[str] = []

    def note(self, kind: str, outcome: str, ok: bool, detail: str = "") -> None:
        self.counts[(kind, outcome)] += 1
        if not ok:
            self.bad.append(f"{kind}: {outcome} {detail[:300]}")

    def body(self, kind: str) -> tuple[dict, int]:
        rng = self.rng
        task = rng.choice(self.tasks)
        base = {"messages": task.messages, "tools": task.tools, "max_tokens": self.max_tokens,
                "mode": rng.choice(["auto", "ar", "diffusion", "draft-self"])}
        if kind == "required":
            return {**base, "tool_choice": "required"}, 200
        if kind == "named":
            tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
                "key": {"type": "string", "maxLength": rng.choice([64, 100, 1000])}}, "required": ["key"]}}}
            return {**base, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, 200
        if kind == "schema":
            return {**base, "tools": None, "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMA}}}, 200
        if kind == "logprobs":
            return {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 16, "logprobs": True,
                    "top_logprobs": 3, "mode": base["mode"]}, 200
        if kind == "hostile":
            extra, status = rng.choice(HOSTILE)
            return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}, status
        return base, 200

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind in ("cut", "leave"):
            await self.cut(client, kind)
            return
        if kind == "burst":
            after = self.rng.uniform(0.5, 3.0)
            await asyncio.gather(*(self.cut(client, "burst", after) for _ in range(BURST)))
            return
        body, want = self.body(kind)
        body = {k: v for k, v in body.items() if v is not None}
        stream = kind == "task" and self.rng.random() < 0.5
        try:
            if stream:
                status, text = await self.streamed(client, {**body, "stream": True})
            else:
                r = await client.post("/v1/chat/completions", json=body)
                status, text = r.status_code, r.text
        except httpx.HTTPError as e:
            self.note(kind, type(e).__name__, False, str(e))
            return
        ok = status == want
        if ok and kind == "schema" and json.loads(text)["choices"][0]["finish_reason"] == "stop":  # not cut short
            try:
                doc = json.loads(json.loads(text)["choices"][0]["message"]["content"])
                ok = isinstance(doc.get("answer"), int) and len(doc.get("note", "")) <= 120
            except (ValueError, AttributeError):
                ok = False
        self.note(kind + ("-stream" if stream else ""), str(status), ok, text)

    async def streamed(self, client: httpx.AsyncClient, body: dict) -> tuple[int, str]:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            text = "".join([line async for line in r.aiter_lines()])
            if r.status_code == 200 and ('"server_error"' in text or "data: [DONE]" not in text):
                return 500, text  # an error sent as an event, or an answer that never ended
            return r.status_code, text

    async def cut(self, client: httpx.AsyncClient, kind: str, after: float | None = None) -> None:
        """A stream closed after a few chunks (cut) or after a moment, waiting or not (leave, burst: `after`)."""
        body = {"messages": [{"role": "user", "content": "Count from 1 to 1000."}], "max_tokens": self.long_tokens,
                "stream": True, "mode": self.rng.choice(["auto", "ar", "diffusion", "draft-self"])}

        async def go() -> str:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if kind == "cut" and n >= self.rng.randint(2, 40):
                        return "cut"
                return "ended"

        try:
            limit = after if after is not None else self.rng.uniform(0.05, 1.5) if kind == "leave" else 120
            outcome = await asyncio.wait_for(go(), limit)
        except asyncio.TimeoutError:
            outcome = "left"
        except httpx.HTTPError as e:
            outcome = type(e).__name__
        self.note(kind, outcome, outcome in ("cut", "ended", "left"), outcome)


async def run_clients(soak: Soak, clients: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients * (BURST + 1), max_keepalive_connections=0)

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=soak.base, timeout=300, limits=limits) as client:
            while time.monotonic() < deadline:
                await soak.one(client)

    await asyncio.gather(*(worker() for _ in range(clients)))


def settle(base: str, parallel: int) -> dict:
    """After the load: wait for the slots to go idle (at most 60 s) -> what /health and /slots say, and a plain
    request's answer."""
    deadline = time.monotonic() + 60
    while True:
        slots = httpx.get(base + "/slots", timeout=10).json()
        health = httpx.get(base + "/health", timeout=10).json()
        idle = sum(s["state"] == "idle" for s in slots)
        if (idle == parallel and health["slots_idle"] == parallel and health["requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    r = httpx.post(base + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16})
    return {"slots_idle_by_slots": idle, "health": health, "plain_status": r.status_code,
            "plain_answer": (r.json()["choices"][0]["message"] if r.status_code == 200 else r.text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=TOOL_MODEL, help="a GGUF, or a checkpoint folder (converted first)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--parallel", type=at_least(1), default=2)
    ap.add_argument("--clients", type=at_least(1), default=8)
    ap.add_argument("--max-tokens", type=at_least(1), default=96, help="of the agent turns")
    ap.add_argument("--ctx", type=at_least(256), default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-soak")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.minutes <= 0:
        ap.error("--minutes must be above 0")
    if a.workdir.exists() and not a.workdir.is_dir():
        ap.error(f"--workdir: {a.workdir} is not a folder")
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.model
    if gguf.is_dir():
        from clover_gguf.convert import convert

        gguf = a.workdir / "model-f32.gguf"
        convert(a.model, gguf, outtype="f32", quiet=True, force=True)
    tasks = held_out_tasks(a.model if a.model.is_dir() else TOOL_MODEL)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = start_logged([sys.executable, "-m", "clover_gguf", "serve", str(gguf), "--port", str(port), "--parallel",
                         str(a.parallel), "--ctx", str(a.ctx)], a.workdir / "serve.log", cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, "clover-gguf serve")
        soak = Soak(base, tasks, random.Random(a.seed), a.max_tokens, min(3000, a.ctx - 128))
        t0 = time.monotonic()
        asyncio.run(run_clients(soak, a.clients, a.minutes * 60))
        took = time.monotonic() - t0
        end = settle(base, a.parallel)
        alive = proc.poll() is None
    finally:
        stop(proc)
    total = sum(soak.counts.values())
    agree = (end["slots_idle_by_slots"] == a.parallel == end["health"]["slots_idle"]
             and end["health"]["requests_waiting"] == 0)
    ok = not soak.bad and agree and end["plain_status"] == 200 and alive
    out = {"minutes": round(took / 60, 2), "parallel": a.parallel, "clients": a.clients, "requests": total,
           "counts": {f"{k} {o}": n for (k, o), n in sorted(soak.counts.items())}, "bad": soak.bad[:20],
           "end": end, "agree": agree, "server_alive": alive, "ok": ok}
    (a.workdir / "soak.json").write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"soak: {total} requests in {took / 60:.1f} min, {a.clients} clients, --parallel {a.parallel}")
        for (k, o), n in sorted(soak.counts.items()):
            print(f"  {k:<16} {o:<16} {n:>6}")
        for b in soak.bad[:20]:
            print(f"  BAD {b}")
        h = end["health"]
        print(f"after: /slots idle {end['slots_idle_by_slots']} of {a.parallel}; /health slots_idle {h['slots_idle']}, "
              f"requests_waiting {h['requests_waiting']} ({'agree' if agree else 'DISAGREE'}); a plain request: "
              f"{end['plain_status']}; server {'alive' if alive else 'DEAD'}")
        print(f"{'ok' if ok else 'FAILED'} (figures in {a.workdir / 'soak.json'})")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
