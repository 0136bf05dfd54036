"""Tool calls in Clover's own format: the tools a request offers, the calls in the model's answer (parsed, streamed or
whole, into OpenAI's tool_calls), the grammar that forces a call (tool_choice required or named), and the words a
chat template that ignores tools is given instead (the real template's own).

The format, as Clover's chat template (Qwen3.5's, in the GGUF) teaches it:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

one `<parameter>` block per argument, several calls one after another. The rules this module reads it by (and the
grammar forces it by):
- text before a call, between calls and after the last one is the message's content: each such piece stripped of its
  surrounding whitespace, the non-empty ones joined by a blank line;
- a value runs from the line after `<parameter=KEY>` to the first `</parameter>`, less the newline before that tag:
  strings are kept verbatim, newlines included (a string cannot hold "</parameter>"; the grammar enforces a string's
  minLength and maxLength, not its pattern or format); a value the tool's JSON schema types as something else is
  JSON (true/false/null also as Python writes them, as the template renders them); a schema that allows strings and
  other types takes the JSON reading when the value parses as one of the other types;
- whitespace between the tags is free; the call ends at `</tool_call>`;
- a call is malformed when its function is unknown, a required parameter is missing, a parameter is unknown to a
  schema without additionalProperties, is given twice or has a value of the wrong type, or the call is not closed
  before the answer ends: its text is then content like any other text (never an error);
- with parallel_tool_calls false, calls after the first are dropped.
Streamed, a call is sent once it is complete and valid (its text held back until then): one chunk with its index,
id and name, then its arguments in fragments (one per parameter) that join to exactly the `arguments` of the
non-streamed answer, which is fed through the same parser in one piece.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from clover_gguf import grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
NAME_FORBIDDEN = re.compile(r"[<>=\s]")  # what cannot stand in <function=NAME> or <parameter=KEY>
KEY_FORBIDDEN = re.compile(r"[<>\n\r]")
JSON_TYPES = {"object": dict, "array": list, "boolean": bool, "null": type(None)}

# The system text the real template (Qwen3.5's) writes for `tools`, given to a template that ignores them.
TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>")


class ToolError(ValueError):
    """A tool, tool choice or tool call in the request that cannot be used (a 400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # the JSON schema of the arguments (an object schema; {} when the tool gave none)
    raw: dict  # the tool as the request gave it (what the chat template renders)

    @property
    def properties(self) -> dict:
        p = self.parameters.get("properties")
        return p if isinstance(p, dict) else {}

    @property
    def required(self) -> list[str]:
        r = self.parameters.get("required")
        return [k for k in r if isinstance(k, str)] if isinstance(r, list) else []

    @property
    def closed(self) -> bool:
        """No parameters beyond `properties` (additionalProperties false)."""
        return self.parameters.get("additionalProperties") is False


def read_tools(tools: list[Any] | None) -> list[Tool]:
    """OpenAI's `tools` -> Tools; ToolError for one that cannot be written in the call format."""
    out: dict[str, Tool] = {}
    for i, t in enumerate(tools or []):
        where = f"tools.{i}"
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise ToolError("only tools of type function are supported", where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or NAME_FORBIDDEN.search(name):
            raise ToolError(f"tool name {name!r}: 1-256 characters without whitespace, '<', '>' or '='",
                            f"{where}.function.name")
        if name in out:
            raise ToolError(f"two tools are named {name!r}", f"{where}.function.name")
        params = f.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolError("parameters must be a JSON schema object", f"{where}.function.parameters")
        props = params.get("properties")
        if props is not None and not isinstance(props, dict):
            raise ToolError("parameters.properties must be an object", f"{where}.function.parameters")
        required = params.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(k, str) for k in required)):
            raise ToolError("parameters.required must be an array of strings", f"{where}.function.parameters")
        for key in [*(props or {}), *(required or [])]:
            if not key or KEY_FORBIDDEN.search(key):
                raise ToolError(f"parameter name {key!r}: not empty, without '<', '>' or newlines",
                                f"{where}.function.parameters")
        out[name] = Tool(name, params, t)
    return list(out.values())


def read_tool_choice(choice: Any, tools: list[Tool]) -> tuple[str, str | None]:
    """OpenAI's tool_choice -> (mode, name): ("auto" | "none" | "required" | "named", the named function)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError("tool_choice must be auto, none, required or a function", "tool_choice")
        if choice == "required" and not tools:
            raise ToolError("tool_choice required needs tools", "tool_choice")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return "named", name
    raise ToolError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": '
                    '...}}', "tool_choice")


# ---- values ----------------------------------------------------------------------------------------------------
def value_kind(schema: Any, root: dict | None = None, depth: int = 0) -> str:
    """How a parameter's value is written: "raw" (text: the schema allows a string, or says nothing), "enum" (one of
    the schema's strings, and nothing but strings) or "json" (no string is allowed: JSON)."""
    if not isinstance(schema, dict) or depth > 16:
        return "raw"
    target = _ref(schema, root)
    if target is not None:
        return value_kind(target, root, depth + 1)
    if "const" in schema:
        return "enum" if isinstance(schema["const"], str) else "json"
    if isinstance(schema.get("enum"), list):
        strs = [v for v in schema["enum"] if isinstance(v, str)]
        return "enum" if strs and len(strs) == len(schema["enum"]) else "raw" if strs else "json"
    t = schema.get("type")
    if isinstance(t, str):
        return "raw" if t == "string" else "json"
    if isinstance(t, list):
        return "raw" if "string" in t else "json"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            kinds = {value_kind(s, root, depth + 1) for s in schema[key]}
            return "json" if kinds == {"json"} else "raw"
    return "raw"


def _ref(schema: dict, root: dict | None) -> dict | None:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or root is None:
        return None
    m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
    defs = root.get(m.group(1)) if m else None
    target = defs.get(m.group(2)) if isinstance(defs, dict) else None
    return target if isinstance(target, dict) else None


def _types(schema: Any, root: dict | None, depth: int = 0) -> set[str] | None:
    """The JSON types a schema allows (None: any)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    target = _ref(schema, root)
    if target is not None:
        return _types(target, root, depth + 1)
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return {_json_type(v) for v in values}
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for s in schema[key]:
                sub = _types(s, root, depth + 1)
                if sub is None:
                    return None
                out |= sub
            return out
    return None


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return {dict: "object", list: "array"}.get(type(v), "null")


def _fits(v: Any, types: set[str]) -> bool:
    t = _json_type(v)
    return t in types or (t == "integer" and "number" in types)


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def typed_value(raw: str, schema: Any, root: dict | None) -> tuple[bool, Any]:
    """A parameter's text -> (valid, value) by its schema (the module's rules)."""
    kind = value_kind(schema, root)
    types = _types(schema, root)
    if kind in ("raw", "enum"):
        if types is not None and types <= {"string"}:
            return True, raw
        try:
            v = json.loads(raw.strip())
        except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
            return True, raw
        if not isinstance(v, str) and (types is None or _fits(v, types)):
            return True, v
        return True, raw
    text = raw.strip()
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        if text not in _PYTHON_LITERALS:
            return False, None
        v = _PYTHON_LITERALS[text]
    if types is not None:
        if isinstance(v, float) and v.is_integer() and "integer" in types and "number" not in types:
            v = int(v)
        if not _fits(v, types):
            return False, None
    return True, v


def arguments_fragments(args: dict) -> list[str]:
    """The arguments' JSON text in pieces, one per parameter, that join to json.dumps(args, ensure_ascii=False)."""
    if not args:
        return ["{}"]
    out = []
    for i, (k, v) in enumerate(args.items()):
        out.append(("{" if i == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": "
                   + json.dumps(v, ensure_ascii=False))
    out[-1] += "}"
    return out


# ---- parsing -----------------------------------------------------------------------------------------------------
@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: dict = field(default_factory=dict)

    @property
    def fragments(self) -> list[str]:
        return arguments_fragments(self.arguments)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.fragments)}}


_WS = re.compile(r"\s*")


class _Incomplete(Exception):
    pass


class _Malformed(Exception):
    pass


def _parse_block(text: str, tools: dict[str, Tool]) -> tuple[str, dict, int]:
    """One call block at the start of `text` -> (name, arguments, its length). Raises _Incomplete when `text` may
    still become a valid call, _Malformed when no continuation can: the decision depends only on the text seen, so
    the result is the same however the answer was cut into pieces."""
    pos = 0

    def expect(word: str) -> None:
        nonlocal pos
        pos = _WS.match(text, pos).end()
        chunk = text[pos:pos + len(word)]
        if chunk != word[:len(chunk)]:
            raise _Malformed()
        if len(chunk) < len(word):
            raise _Incomplete()
        pos += len(word)

    def name_until_gt() -> str:
        nonlocal pos
        end = text.find(">", pos)
        nl = text.find("\n", pos)
        if end < 0:
            if nl >= 0:
                raise _Malformed()
            raise _Incomplete()
        if 0 <= nl < end:
            raise _Malformed()
        name = text[pos:end]
        pos = end + 1
        return name

    expect(CALL_OPEN)
    expect(FUNCTION_OPEN)
    name = name_until_gt()
    tool = tools.get(name)
    if tool is None:
        raise _Malformed()
    args: dict[str, Any] = {}
    while True:
        pos = _WS.match(text, pos).end()
        rest = text[pos:pos + len(PARAMETER_OPEN)]
        if len(rest) < len(PARAMETER_OPEN) and PARAMETER_OPEN.startswith(rest):
            raise _Incomplete()  # "", "<", "<para": a parameter may still come
        if rest == PARAMETER_OPEN:
            pos += len(PARAMETER_OPEN)
            key = name_until_gt()
            if key in args or (key not in tool.properties and tool.closed):
                raise _Malformed()
            if text.startswith("\n", pos):
                pos += 1
            elif pos >= len(text):
                raise _Incomplete()
            end = text.find(PARAMETER_CLOSE, pos)
            if end < 0:
                raise _Incomplete()
            raw = text[pos:end]
            ok, value = typed_value(raw[:-1] if raw.endswith("\n") else raw, tool.properties.get(key, True),
                                    tool.parameters)
            if not ok:
                raise _Malformed()
            args[key] = value
            pos = end + len(PARAMETER_CLOSE)
            continue
        expect(FUNCTION_CLOSE)
        if any(k not in args for k in tool.required):
            raise _Malformed()
        expect(CALL_CLOSE)
        return name, args, pos


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest end of `text` that begins `word` (and is not all of it)."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


class CallParser:
    """The answer (the text after the thinking, as thinking.ThinkSplitter gives it) -> content and calls, streamed:
    feed() and close() return events ("content", text) and ("call", Call), by the module's rules."""

    def __init__(self, tools: list[Tool], parallel: bool = True, ids: Any = None):
        self.tools = {t.name: t for t in tools}
        self.parallel = parallel
        self.calls: list[Call] = []
        self._ids = ids or (lambda: "call_" + uuid.uuid4().hex[:24])
        self._buf = ""
        self._in_call = False
        # the content piece being written: stripped as it streams (leading whitespace dropped, trailing held back)
        self._started = False  # the piece has shown text
        self._held = ""  # its trailing whitespace so far
        self._shown = False  # some content was sent (a later piece is preceded by a blank line)
        self._events: list[tuple] = []

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def close(self) -> list[tuple]:
        self._run(final=True)
        self._content(self._buf)
        self._buf = ""
        return self._take()

    def _take(self) -> list[tuple]:
        out, self._events = self._events, []
        merged: list[tuple] = []
        for e in out:  # consecutive content events as one
            if merged and e[0] == "content" and merged[-1][0] == "content":
                merged[-1] = ("content", merged[-1][1] + e[1])
            else:
                merged.append(e)
        return merged

    def _run(self, final: bool) -> None:
        while self._buf:
            if not self._in_call:
                i = self._buf.find(CALL_OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, CALL_OPEN)
                    self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(self._buf[:i])
                self._buf = self._buf[i:]
                self._in_call = True
            try:
                name, args, n = _parse_block(self._buf, self.tools)
            except _Incomplete:
                if not final:
                    return
                self._not_a_call()  # unterminated at the end of the answer
                continue
            except _Malformed:
                self._not_a_call()
                continue
            self._buf = self._buf[n:]
            self._in_call = False
            if self.parallel or not self.calls:
                call = Call(len(self.calls), self._ids(), name, args)
                self.calls.append(call)
                self._events.append(("call", call))
            self._started, self._held = False, ""  # the piece before the call ends here

    def _not_a_call(self) -> None:
        """The block at the buffer's start is text: its `<tool_call>` goes to the content, the rest is read again."""
        self._in_call = False
        self._content(CALL_OPEN)
        self._buf = self._buf[len(CALL_OPEN):]

    def _content(self, s: str) -> None:
        if not s:
            return
        if not self._started:
            s = s.lstrip()
            if not s:
                return
            self._started = True
            if self._shown:
                s = "\n\n" + s
        s = self._held + s
        kept = s.rstrip()
        self._held = s[len(kept):]
        if kept:
            self._events.append(("content", kept))
            self._shown = True


def parse_answer(text: str, tools: list[Tool], parallel: bool = True) -> tuple[str, list[Call]]:
    """A whole answer -> (content, calls): CallParser fed at once."""
    p = CallParser(tools, parallel)
    events = p.feed(text) + p.close()
    return "".join(e[1] for e in events if e[0] == "content"), p.calls


# ---- the grammar of forced calls --------------------------------------------------------------------------------
def calls_rules(tools: list[Tool], name: str | None, parallel: bool, rule: str = "body") -> str:
    """Lark rules (clover_gguf.grammar) whose `rule` is one call of `name` (or of any tool) or, with `parallel` and
    no name, one or more calls joined by "\\n": parameters in the order of `properties` (then the required ones it
    lacks), required ones present, optional ones may be left out, values as the module's rules write them."""
    lit = grammar.literal
    rules, calls, terminals = [], [], {}
    for i, tool in enumerate(tools):
        if name is not None and tool.name != name:
            continue
        parts = []
        keys = [*tool.properties, *(k for k in tool.required if k not in tool.properties)]
        for j, key in enumerate(keys):
            rules.append(f"p{i}_{j}: {lit(f'{PARAMETER_OPEN}{key}>' + chr(10))} "
                         f"{_value_rule(key, tool.properties.get(key, True), tool.parameters, terminals)}")
            parts.append(f"p{i}_{j}" + ("" if key in tool.required else "?"))
        rules.append(f"call{i}: {lit(f'{CALL_OPEN}{chr(10)}{FUNCTION_OPEN}{tool.name}>{chr(10)}')} "
                     + "".join(p + " " for p in parts) + lit(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"))
        calls.append(f"call{i}")
    if not calls:
        raise ToolError(f"no tool named {name!r}", "tool_choice")
    more = ' (' + lit("\n") + ' call)*' if parallel and name is None else ""
    # a string value: any text up to the first </parameter> (lazy: the shortest), then the line break after it
    return "\n".join([f"{rule}: call{more}", "call: " + " | ".join(calls), *rules, *terminals.values(),
                      f"text_value[lazy]: /(?s:.*){PARAMETER_CLOSE.replace('/', chr(92) + '/')}/"]) + "\n"


def _value_rule(key: str, schema: Any, root: dict, rules: dict[str, str]) -> str:
    """The Lark expression of a parameter's value and what follows it (rules: terminals it needs, added)."""
    lit = grammar.literal
    end = lit(f"\n{PARAMETER_CLOSE}\n")
    kind = value_kind(schema, root)
    target = (_ref(schema, root) or schema) if isinstance(schema, dict) else {}
    if kind == "raw":
        lo, hi = target.get("minLength"), target.get("maxLength")
        if target.get("type") == "string" and (isinstance(lo, int) or isinstance(hi, int)):
            # a string of lo..hi characters, then the newline and </parameter> (which it may not hold before)
            lo, hi = max(0, lo if isinstance(lo, int) else 0), hi if isinstance(hi, int) else ""
            name = f"TEXT_{lo}_{'N' if hi == '' else hi}"  # one name per bound: maxLength 0 is not "none"
            close = PARAMETER_CLOSE.replace("/", "\\/")
            # (the text without the tag written positively: a negation beside a count of ~90+ ran out of lexer fuel)
            rules[name] = (f"{name}: /(?s:.){{{lo},{hi}}}\\n{close}/ "
                           f"& /{grammar.regex_without(PARAMETER_CLOSE)}\\n{close}/")
            return f"{name} " + lit("\n")
        return "text_value " + lit("\n")
    if kind == "enum":
        values = [target["const"]] if "const" in target else target["enum"]
        return "(" + " | ".join(lit(v) for v in dict.fromkeys(values)) + ") " + end
    sub = dict(schema) if isinstance(schema, dict) else {}
    for defs in ("$defs", "definitions"):  # the root's definitions come along for the value's $refs
        if isinstance(root.get(defs), dict) and defs not in sub:
            sub[defs] = root[defs]
    return grammar.json_value(sub) + " " + end


# ---- the words of the real template, for a template that ignores tools --------------------------------------------
def render_value(v: Any) -> str:
    """An argument as the template writes it: objects and arrays as JSON (its tojson), the rest as Jinja's `string`
    filter (Python's str: True, None, 1.5)."""
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def render_call(name: str, arguments: dict) -> str:
    params = "".join(f"{PARAMETER_OPEN}{k}>\n{render_value(v)}\n{PARAMETER_CLOSE}\n" for k, v in arguments.items())
    return f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{CALL_CLOSE}"


def render_tools_system(tools: list[dict], system: str = "") -> str:
    """The system message's text with `tools` as the template writes it (the request's own system text after)."""
    text = TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_TAIL
    return text + ("\n\n" + system.strip() if system.strip() else "")


def inline_tools(messages: list[dict], tools: list[dict] | None, calls: bool) -> list[dict]:
    """Messages for a template that ignores `tools` (tools given: a system message says them) and, when `calls` is
    False, also tool calls and tool messages (the calls written into the assistant's content, the results into a
    user message of <tool_response> blocks), in the real template's words."""
    out: list[dict] = []
    msgs = list(messages)
    if tools:
        if msgs and msgs[0]["role"] == "system":
            out.append({"role": "system", "content": render_tools_system(tools, msgs[0].get("content") or "")})
            msgs = msgs[1:]
        else:
            out.append({"role": "system", "content": render_tools_system(tools)})
    for m in msgs:
        if calls:
            out.append(m)
        elif m["role"] == "assistant" and m.get("tool_calls"):
            content = (m.get("content") or "").strip()
            blocks = "\n".join(render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n\n" if content else "") + blocks})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{(m.get('content') or '').strip()}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_responses"} for m in out]


_SUPPORT: dict[str, tuple[bool, bool]] = {}  # chat template text -> template_support


def for_template(rt: Any, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the runtime's chat template is to get them: unchanged when it renders tools, tool calls
    and tool messages itself (Clover's does), else with what it ignores written into the messages in the real
    template's words (inline_tools). Runtimes without a template (raw concatenation) are left alone."""
    template, render = getattr(rt, "chat_template", None), getattr(rt, "render", None)
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not template or render is None or not (tools or history):
        return messages, tools or None
    support = _SUPPORT.get(template)
    if support is None:
        support = _SUPPORT[template] = template_support(
            lambda msgs, t: render(msgs, think=True, add_generation_prompt=False, tools=t))
    tools_ok, calls_ok = support
    if (tools_ok or not tools) and (calls_ok or not history):
        return messages, tools or None
    return inline_tools(messages, None if tools_ok else tools, calls_ok), (tools or None) if tools_ok else None


PROBE = "clover_probe_fn_7f3a"


def template_support(render: Any) -> tuple[bool, bool]:
    """(renders tools, renders tool calls and tool messages) of a chat template, by rendering probes: a tool whose
    name shows in the text; an assistant call of it and a tool result whose text shows. `render(messages, tools)`
    renders (without a generation prompt); a template that fails on a probe does not handle it."""
    tool = {"type": "function", "function": {"name": PROBE, "description": "", "parameters": {
        "type": "object", "properties": {"k": {"type": "string"}}}}}
    user = {"role": "user", "content": "probe"}
    try:
        tools_ok = PROBE in render([user], [tool])
    except Exception:
        tools_ok = False
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": PROBE + "_call", "arguments": {"k": "v"}}}]}
    result = {"role": "tool", "content": PROBE + "_result", "tool_call_id": "call_0"}
    try:
        text = render([user, call, result, {"role": "user", "content": "probe"}], [tool] if tools_ok else None)
        calls_ok = PROBE + "_call" in text and PROBE + "_result" in text
    except Exception:
        calls_ok = False
    return tools_ok, calls_ok
