"""The tool-calling tiny Clover's tasks (clover_gguf/assets/tiny-clover-tools/; docs/tiny-model.md).

    python -m clover_gguf.testing.tool_tasks OUT [train_tiny's options]     # trains it (train_tiny's machinery)

Single-turn agent conversations with tools offered (add, multiply, lookup, write_file; the needed ones and up to
two others, shuffled), rendered by this family's chat template (tool_template.jinja, through the runtime's own Jinja
environment, so training text is what serve renders). The model never computes: the tools compute, the model copies.
The answered turn is one of:
- call: one call for the user's question (arguments copied from it; write_file's content is the text the user gave);
- calls2: two calls in one answer (two questions);
- final: after one call and its result, the final answer (arithmetic restated; a lookup record restated one line per
  field; a write_file result restated);
- final2: after two calls and their results, both answers;
- json: after a lookup, the record's named keys as a JSON object (values copied);
- plain: a question that needs no tool (count, copy, reverse), tools offered all the same;
- long: a write_file call whose content is a long text the user gave (LONG_LINES lines, answers of about 130-350
  tokens): the long structured answers agents write, where a draft can copy many tokens at once.
Thinking as the bundled model: the answered turn thinks 70% of the time (train_tiny.THINK), else follows the empty
thinking span of enable_thinking=False. Held out by the bundled model's rule on the user's message (its crc32).
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from clover_gguf.serve.tools import render_call
from clover_gguf.testing import train_tiny
from clover_gguf.testing.train_tiny import THINK, Family, is_held_out

TEMPLATE_PATH = Path(__file__).with_name("tool_template.jinja")
ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-clover-tools"


def _tool(name: str, description: str, props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


INT, STR = {"type": "integer"}, {"type": "string"}
TOOLS = {
    "add": _tool("add", "Add two integers.", {"a": INT, "b": INT}),
    "multiply": _tool("multiply", "Multiply two integers.", {"a": INT, "b": INT}),
    "lookup": _tool("lookup", "Look up a record by its key.", {"key": STR}),
    "write_file": _tool("write_file", "Write text to a file.", {"path": STR, "content": STR}),
}

FIRST = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena", "Milo", "Nora",
         "Omar", "Pia", "Rex", "Sara", "Theo", "Uma", "Vera", "Wes", "Yara", "Zane"]
LAST = ["Moss", "Reed", "Hale", "Stone", "Vale", "Frost", "Lane", "Brook", "Shaw", "Wood", "Fox", "Gray", "Kerr",
        "Marsh", "North", "Price", "Quinn", "Rowe", "Snow", "Tate"]
CITIES = ["Lima", "Oslo", "Pune", "Kyiv", "Lyon", "Cork", "Turin", "Quito", "Perth", "Porto", "Riga", "Bern",
          "Dakar", "Hanoi", "Tunis", "Cusco"]
TEAMS = ["red", "blue", "green", "gold", "silver", "black", "white", "orange"]
ROLES = ["admin", "editor", "viewer", "owner", "guest", "tester", "writer", "analyst"]
STREETS = ["Elm", "Oak", "Pine", "Lake", "Hill", "Mill", "Park", "River", "Bay", "Cedar"]
KEY_WORDS = ["moon", "star", "fish", "tree", "rock", "lamp", "ship", "bird", "door", "king", "leaf", "rain", "sand",
             "cup", "book", "sky"]
FIELDS = ("name", "email", "phone", "city", "street", "age", "team", "role", "since")
TEXT_WORDS = ["apple", "sky", "cat", "dog", "tree", "moon", "fish", "star", "rock", "lamp", "cup", "book", "rain",
              "leaf", "ship", "bird", "door", "milk", "sand", "king", "buy", "call", "send", "fix", "read", "plan",
              "the", "a", "to", "and", "new", "old", "big", "red", "blue", "on", "for", "with", "before", "after",
              "today", "soon", "notes", "list", "meeting", "bread", "eggs", "paint", "box", "key"]
FOLDERS = ["notes", "docs", "todo", "data", "logs"]

# the answered turn's kind, and how often training draws it
KINDS = ("call", "calls2", "final", "final2", "json", "plain", "long")
KIND_WEIGHTS = (3, 2, 3, 1, 2, 1, 2)
# the tokenizer's corpus draws these (the kinds of the first 6,000 steps: the shipped tokenizer was trained on them,
# and a continuation must keep it; long adds no word)
CORPUS_KINDS = KINDS[:6]
TEXT_LINES, LONG_LINES = (4, 9), (14, 30)  # a write_file text's lines: a call's, a long call's
ARITH = {"add": "+", "multiply": "*"}
# eval rows per kind (each row: one conversation, all held out); 165 in all (long last: the rows before it are the
# 150 of the first 6,000 steps, drawn as they were)
EVAL_ROWS = {"call": 40, "calls2": 20, "final": 40, "final2": 15, "json": 20, "plain": 15, "long": 15}
CALL_KINDS = ("call", "calls2", "long")  # the answered turn is calls
NO_THINK_SHARE = train_tiny.NO_THINK_SHARE


def lookup_record(key: str) -> dict:
    """The record the lookup tool returns for `key`: fixed by the key (a demo's tool can return the same)."""
    rng = random.Random(zlib.crc32(key.encode()))
    first, last = rng.choice(FIRST), rng.choice(LAST)
    values = {"name": f"{first} {last}", "email": f"{first.lower()}.{last.lower()}@example.com",
              "phone": f"555-{rng.randint(1000, 9999)}", "city": rng.choice(CITIES),
              "street": f"{rng.randint(1, 99)} {rng.choice(STREETS)} Street", "age": rng.randint(18, 90),
              "team": rng.choice(TEAMS), "role": rng.choice(ROLES), "since": rng.randint(1990, 2026)}
    n = rng.randint(6, len(FIELDS))
    keep = sorted(rng.sample(range(len(FIELDS)), n))
    return {FIELDS[i]: values[FIELDS[i]] for i in keep}


def run_tool(name: str, args: dict) -> str:
    """The tools' results as the tool messages carry them."""
    if name == "add":
        return str(args["a"] + args["b"])
    if name == "multiply":
        return str(args["a"] * args["b"])
    if name == "lookup":
        return json.dumps(lookup_record(args["key"]), ensure_ascii=False)
    if name == "write_file":
        return json.dumps({"path": args["path"], "bytes": len(args["content"].encode())})
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------------------------
# Questions: (user text, [(tool, arguments)]) and the final answers
# ---------------------------------------------------------------------------------------------------------------
def _number(rng: random.Random) -> int:
    return rng.randint(0, 10 ** rng.randint(1, 4) - 1)


def _key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_WORDS)}{rng.randint(1, 999)}"


def _text(rng: random.Random, n_lines: tuple[int, int]) -> str:
    lines = []
    for _ in range(rng.randint(*n_lines)):
        words = [rng.choice(TEXT_WORDS) for _ in range(rng.randint(3, 8))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(1, 99)))
        lines.append("- " + " ".join(words))
    return "\n".join(lines)


def _arith_call(rng: random.Random) -> tuple[str, tuple[str, dict]]:
    name = rng.choice(list(ARITH))
    a, b = _number(rng), _number(rng)
    return f"{a} {ARITH[name]} {b}", (name, {"a": a, "b": b})


def question(rng: random.Random, kind: str) -> tuple[str, list[tuple[str, dict]], str]:
    """-> (user message, calls it needs, task name)."""
    if kind in ("call", "final"):
        task = rng.choice(["add", "multiply", "lookup", "write_file"])
    elif kind in ("calls2", "final2"):
        task = rng.choice(["arith2", "lookup2"])
    elif kind == "long":
        task = "write_file"
    else:
        task = "lookup"
    if task in ("add", "multiply"):
        a, b = _number(rng), _number(rng)
        return rng.choice(["What is {}?", "Compute {}.", "Use a tool: {}"]).format(f"{a} {ARITH[task]} {b}"), \
            [(task, {"a": a, "b": b})], task
    if task == "lookup" and kind != "json":
        k = _key(rng)
        return rng.choice(["Look up {}.", "What is the record for {}?", "Find {}."]).format(k), \
            [("lookup", {"key": k})], task
    if task == "lookup":  # json
        k = _key(rng)
        fields = [f for f in FIELDS if f in lookup_record(k)]
        asked = rng.sample(fields, rng.randint(2, 4))
        return f"Look up {k} and give me its {', '.join(asked[:-1])} and {asked[-1]} as JSON.", \
            [("lookup", {"key": k})], "json:" + ",".join(asked)
    if task == "write_file":
        path = f"{rng.choice(FOLDERS)}/{rng.choice(KEY_WORDS)}.txt"
        text = _text(rng, LONG_LINES if kind == "long" else TEXT_LINES)
        return f"Save this to {path}:\n{text}", [("write_file", {"path": path, "content": text})], task
    if task == "arith2":
        (e1, c1), (e2, c2) = _arith_call(rng), _arith_call(rng)
        return f"What is {e1} and {e2}?", [c1, c2], task
    k1, k2 = _key(rng), _key(rng)
    while k2 == k1:
        k2 = _key(rng)
    return f"Look up {k1} and {k2}.", [("lookup", {"key": k1}), ("lookup", {"key": k2})], task


def final_answer(task: str, calls: list[tuple[str, dict]], results: list[str]) -> str:
    """The answer after the tools' results: the results copied into it."""
    if task.startswith("json:"):
        record = json.loads(results[0])
        return json.dumps({f: record[f] for f in task[5:].split(",")}, ensure_ascii=False)
    out = []
    for (name, args), res in zip(calls, results):
        if name in ARITH:
            out.append(f"{args['a']} {ARITH[name]} {args['b']} = {res}")
        elif name == "lookup":
            lines = "\n".join(f"{k}: {v}" for k, v in json.loads(res).items())
            out.append(f"{args['key']}:\n{lines}" if len(calls) > 1 else lines)
        else:
            r = json.loads(res)
            out.append(f"Saved {r['bytes']} bytes to {r['path']}.")
    return ("\n\n" if any(n == "lookup" for n, _ in calls) else "\n").join(out)


def calls_text(calls: list[tuple[str, dict]]) -> str:
    """An answer of calls in the call format (serve.tools.render_call, one per call, a newline between)."""
    return "\n".join(render_call(n, a) for n, a in calls)


# ---------------------------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------------------------
_TEMPLATE = None


def render(messages: list[dict], tools: list[dict] | None, think: bool = True, add_generation_prompt: bool = True
           ) -> str:
    """This family's chat template, compiled as the runtime compiles a GGUF's (vocab.compile_chat_template)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from clover_gguf.vocab import compile_chat_template

        _TEMPLATE = compile_chat_template(TEMPLATE_PATH.read_text())
    return _TEMPLATE.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                            enable_thinking=think, **({"tools": list(tools)} if tools else {}))


@dataclass(frozen=True)
class ToolConversation:
    """messages up to the answered assistant turn (system-free; tools offered), the answer, thinking on/off."""

    messages: tuple
    tools: tuple
    answer: str
    think: bool = True
    kind: str = "call"
    task: str = ""
    calls: tuple = field(default=())  # the expected calls of a call / calls2 turn: ((name, arguments), ...)

    def prompt_text(self) -> str:
        return render(list(self.messages), list(self.tools), self.think)

    def target_text(self) -> str:
        return (THINK if self.think else "") + self.answer + "<|im_end|>"


def _tool_messages(calls: list[tuple[str, dict]]) -> list[dict]:
    """The assistant's calls and the tools' results as chat messages (OpenAI's shapes; arguments as objects, as
    serve gives them to the template)."""
    ids = [f"call_{i}" for i in range(len(calls))]
    out = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}]
    out += [{"role": "tool", "tool_call_id": i, "content": run_tool(n, a)} for i, (n, a) in zip(ids, calls)]
    return out


def draw_tool_conversation(rng: random.Random, held_out: bool = False, kind: str | None = None,
                           think: bool | None = None) -> ToolConversation:
    kind = kind or rng.choices(KINDS, KIND_WEIGHTS)[0]
    if think is None:
        think = rng.random() >= NO_THINK_SHARE
    while True:
        if kind == "plain":
            task = rng.choice(["count", "copy", "reverse"])
            user, answer = train_tiny.make_task(rng, task)
            calls: list = []
        else:
            user, calls, task = question(rng, kind)
            answer = ""
        if is_held_out(user) == held_out:
            break
    needed = list(dict.fromkeys(n for n, _ in calls))
    others = [t for t in TOOLS if t not in needed]
    offered = needed + rng.sample(others, rng.randint(0 if needed else 1, min(1, len(others))))
    rng.shuffle(offered)
    messages = [{"role": "user", "content": user}]
    if kind in CALL_KINDS:
        answer = calls_text(calls)
    elif kind != "plain":
        history = _tool_messages(calls)
        messages += history
        answer = final_answer(task, calls, [m["content"] for m in history[1:]])
    return ToolConversation(tuple(messages), tuple(TOOLS[t] for t in offered), answer, think, kind, task,
                            tuple(calls) if kind in CALL_KINDS else ())


def make_eval_set(per_kind: dict[str, int] = EVAL_ROWS, seed: int = 54321) -> list[dict]:
    """Held-out rows (the user's message held out, distinct within a kind): kind, task, think, tools, messages (up to
    the answered turn), answer (the text after the thinking), calls (call kinds: [{"name", "arguments"}])."""
    rng, out = random.Random(seed), []
    for kind, n in per_kind.items():
        seen: set[str] = set()
        while len(seen) < n:
            c = draw_tool_conversation(rng, held_out=True, kind=kind)
            if c.messages[0]["content"] in seen:
                continue
            seen.add(c.messages[0]["content"])
            row = {"kind": kind, "task": c.task, "think": c.think, "tools": list(c.tools),
                   "messages": list(c.messages), "answer": c.answer}
            if c.calls:
                row["calls"] = [{"name": n_, "arguments": a} for n_, a in c.calls]
            out.append(row)
    return out


def row_conversation(row: dict) -> ToolConversation:
    return ToolConversation(tuple(row["messages"]), tuple(row["tools"]), row["answer"], row.get("think", True),
                            row["kind"], row.get("task", ""),
                            tuple((c["name"], c["arguments"]) for c in row.get("calls", [])))


def bpe_corpus(n: int = 600, seed: int = 7) -> str:
    def draw(rng: random.Random, i: int) -> ToolConversation:
        return draw_tool_conversation(rng, kind=CORPUS_KINDS[i % len(CORPUS_KINDS)])

    return train_tiny.corpus_text(draw, n, seed)


# ---------------------------------------------------------------------------------------------------------------
# Judging an answer
# ---------------------------------------------------------------------------------------------------------------
def judge(row: dict, text: str) -> dict:
    """A generated answer (thinking removed) against its row -> {"name", "args", "answer", "json", "lines", "ok"}
    (None where a check does not apply). Calls are read by serve's parser (serve.tools.parse_answer), the one reading
    of the format: name = the called tools' names in order; args = names and arguments; answer = the final text equal
    to the row's (stripped) and no call; json = the JSON object equal to the row's; lines (a long row's write_file) =
    (lines of the content right at their place, lines the content should have): how much of a long copy is right
    when the whole is not."""
    from clover_gguf.serve.tools import parse_answer, read_tools

    content, calls = parse_answer(text, read_tools(row["tools"]))
    want = row.get("calls")
    res: dict = {"name": None, "args": None, "answer": None, "json": None, "lines": None}
    if want is not None:
        got = [(c.name, c.arguments) for c in calls]
        res["name"] = [g[0] for g in got] == [w["name"] for w in want]
        res["args"] = got == [(w["name"], w["arguments"]) for w in want]
        if row["kind"] == "long":
            lines = want[0]["arguments"]["content"].split("\n")
            path = want[0]["arguments"]["path"]
            wrote = next((str(a.get("content", "")).split("\n") for n, a in got
                          if n == "write_file" and isinstance(a, dict) and a.get("path") == path), [])
            res["lines"] = (sum(a == b for a, b in zip(lines, wrote)), len(lines))
        res["ok"] = res["args"] and not content
        return res
    res["answer"] = not calls and content.strip() == row["answer"].strip()
    if row.get("task", "").startswith("json:"):
        try:
            res["json"] = json.loads(content) == json.loads(row["answer"])
        except ValueError:
            res["json"] = False
    res["ok"] = res["answer"]
    return res


FAMILY = Family(name="tools", draw=draw_tool_conversation, corpus=bpe_corpus, eval_set=make_eval_set,
                template=TEMPLATE_PATH.read_text, n_merges=600, exact_split=True)


def main(argv: list[str] | None = None) -> int:
    return train_tiny.main(argv, family=FAMILY)


if __name__ == "__main__":
    sys.exit(main())
