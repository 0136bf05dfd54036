"""Agent turns on the tiny tool-trained Clover through `serve`, with clients nobody here wrote: the model the tests,
bench/agent.py and `make demo` use (one place: TOOL_MODEL), the tools it was trained on (their OpenAI schemas and a
Python function each), and the openai SDK's tool loop (the model calls, Python runs the tool, its result goes back as
a `tool` message, the model answers).

    python -m clover_gguf.testing.agent [GGUF] [--mode auto] [--task call-1] [--out out/demo]   # make demo's turn
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_gguf.testing.ports import free_port, stop
from clover_gguf.testing.tool_tasks import ASSET_DIR, TOOLS, run_tool as _run_tool

# The model every agent test, bench/agent.py and the demo run (its eval.jsonl: the held-out tasks): switching models
# is this one line (today the asset clover_gguf.testing.tool_tasks trains).
TOOL_MODEL = ASSET_DIR


def run_tool(name: str, arguments: dict) -> str:
    """A call's result as the `tool` message's text (the tools of clover_gguf.testing.tool_tasks); a call the tool
    cannot take gets its error, as an agent would send it back."""
    try:
        return _run_tool(name, arguments)
    except (KeyError, TypeError, ValueError) as e:
        return f"error: {type(e).__name__}: {e}"


@dataclass
class Task:
    """A held-out task of the tool model's eval set: the conversation up to the answered turn, the tools offered,
    what the answer should be (the calls, or the final text), thinking on or off."""

    id: str
    kind: str  # call, calls2, final, final2, json, plain, long (tool_tasks.KINDS)
    task: str
    messages: list[dict]
    tools: list[dict]
    answer: str
    think: bool = True
    calls: list[tuple[str, dict]] | None = None

    @property
    def question(self) -> list[dict]:
        """The conversation's first user message alone: where an agent's trace starts."""
        return [self.messages[0]]

    @property
    def schema(self) -> dict | None:
        """A JSON task's answer as a json_schema response_format (the keys asked for, in order; their types)."""
        if not self.task.startswith("json:"):
            return None
        doc = json.loads(self.answer)
        props = {k: {"type": "integer" if isinstance(v, int) else "string"} for k, v in doc.items()}
        return {"type": "json_schema", "json_schema": {"name": "record", "strict": True, "schema": {
            "type": "object", "properties": props, "required": list(props), "additionalProperties": False}}}


def held_out_tasks(model: Path = TOOL_MODEL) -> list[Task]:
    """The model folder's eval.jsonl rows (tool_tasks.make_eval_set's) as Tasks, numbered by kind."""
    out, seen = [], {}
    for line in (Path(model) / "eval.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        seen[r["kind"]] = seen.get(r["kind"], 0) + 1
        calls = [(c["name"], c["arguments"]) for c in r["calls"]] if "calls" in r else None
        out.append(Task(f"{r['kind']}-{seen[r['kind']]}", r["kind"], r.get("task", ""), r["messages"], r["tools"],
                        r["answer"], r.get("think", True), calls))
    return out


# ---- the openai SDK's tool loop ------------------------------------------------------------------------------------
@dataclass
class Step:
    """One model answer of the loop: its text, its calls (name, arguments as sent) and their results."""

    content: str | None
    reasoning: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict | None = None  # clover_stats


def _streamed(chunks) -> tuple[dict, str | None, dict | None]:
    """A streamed answer -> (assistant message, finish_reason, clover_stats), its deltas joined as an SDK user does."""
    content, reasoning, calls, finish, stats = "", "", {}, None, None
    for c in chunks:
        extra = getattr(c, "model_extra", None) or {}
        stats = extra.get("clover_stats", stats)
        for ch in c.choices or ():
            d = ch.delta
            content += d.content or ""
            reasoning += (getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content")
                          or "")
            for t in d.tool_calls or ():
                acc = calls.setdefault(t.index, {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
                acc["id"] += t.id or ""
                if t.function:
                    acc["function"]["name"] += t.function.name or ""
                    acc["function"]["arguments"] += t.function.arguments or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    msg = {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg, finish, stats


def tool_loop(client: Any, messages: list[dict], tools: list[dict], mode: str | None = None, stream: bool = False,
              tool_choice: Any = "auto", max_steps: int = 4, max_tokens: int = 400, **extra: Any
              ) -> tuple[list[Step], list[dict]]:
    """The openai SDK's tool loop (openai.OpenAI `client`): ask; while the answer calls tools, run each in Python
    (run_tool), append the call and a `tool` message per result, ask again (tool_choice `auto` after the first
    answer, so a forced first call can still end in an answer). -> (the answers, the whole conversation)."""
    messages = list(messages)
    body = {"extra_body": {**({"mode": mode} if mode else {}), **extra}}
    steps: list[Step] = []
    choice = tool_choice
    for _ in range(max_steps):
        r = client.chat.completions.create(model="clover", messages=messages, tools=tools, tool_choice=choice,
                                           max_tokens=max_tokens, temperature=0, stream=stream, **body)
        if stream:
            msg, finish, stats = _streamed(r)
        else:
            m = r.choices[0].message
            msg = {"role": "assistant", "content": m.content,
                   "reasoning_content": getattr(m, "reasoning_content", None)
                   or (m.model_extra or {}).get("reasoning_content")}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
            finish, stats = r.choices[0].finish_reason, (r.model_extra or {}).get("clover_stats")
        step = Step(msg["content"], msg.pop("reasoning_content"), finish_reason=finish, stats=stats)
        steps.append(step)
        messages.append(msg)
        if not msg.get("tool_calls"):
            break
        for c in msg["tool_calls"]:
            step.calls.append((c["function"]["name"], c["function"]["arguments"]))
            result = run_tool(c["function"]["name"], json.loads(c["function"]["arguments"]))
            step.results.append(result)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
        choice = "auto"
    return steps, messages


# ---- the demo: `clover-gguf serve` in a subprocess, one agent turn through the openai SDK ------------------------


def demo(gguf: Path, mode: str, task: Task) -> int:
    """`clover-gguf serve GGUF` in a subprocess, then one agent turn through the openai SDK: the question, the model's
    call, the tool's result (run here), the model's answer; each answer's decoding stats. Imports only what `make demo`
    installs (the serve extra: openai, which brings httpx2, not httpx) and the standard library."""
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf", "serve", str(gguf), "--port", str(port),
                             "--mode", mode, "--ctx", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                print(f"error: clover-gguf serve exited: {proc.stderr.read().strip()[-500:]}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                print("error: clover-gguf serve did not start in 120 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        names = [t["function"]["name"] for t in task.tools]
        print(f"== one agent turn: clover-gguf serve {gguf.name} --mode {mode}, the openai SDK's tool loop\n"
              f"tools offered: {', '.join(names)}\nuser: {task.question[0]['content']}")
        steps, _ = tool_loop(client, task.question, task.tools, mode=mode, think=task.think)
        for s in steps:
            st = s.stats or {}
            how = (f"[{st.get('generated_tokens')} tokens in {st.get('decode_passes')} passes, "
                   f"{st.get('prompt_tokens')} prompt tokens ({st.get('reused_tokens')} kept from the last turn)]")
            if s.reasoning:
                print(f"model thinks: {s.reasoning}")
            for (name, args), result in zip(s.calls, s.results):
                print(f"model calls: {name}({args}) {how}\ntool result: {result}")
            if not s.calls:
                print(f"model answers: {s.content} {how}")
        return 0
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    from clover_gguf.convert import convert

    ap = argparse.ArgumentParser(prog="python -m clover_gguf.testing.agent", description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", type=Path,
                    help="a GGUF of the tool model (default: TOOL_MODEL converted to F32 into --out)")
    ap.add_argument("--out", type=Path, default=Path("out/demo"), help="where the converted GGUF goes")
    ap.add_argument("--mode", default="auto", choices=["ar", "diffusion", "draft-self", "auto"])
    ap.add_argument("--task", default="call-1", help="a held-out task's id (its kind and number: call-1, final-3)")
    a = ap.parse_args(argv)
    tasks = {t.id: t for t in held_out_tasks()}
    if a.task not in tasks:
        print(f"error: no held-out task {a.task!r} (e.g. {', '.join(list(tasks)[:3])})", file=sys.stderr)
        return 2
    gguf = a.gguf
    if gguf is None:
        gguf = a.out / f"{TOOL_MODEL.name}-f32.gguf"
        a.out.mkdir(parents=True, exist_ok=True)
        convert(TOOL_MODEL, gguf, outtype="f32", quiet=True, force=True)
    return demo(gguf, a.mode, tasks[a.task])


if __name__ == "__main__":
    sys.exit(main())
