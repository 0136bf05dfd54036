"""Real agent CLIs against `clover-gguf serve` and the patched llama-server, side by side, on the tool-trained tiny
Clover: does each client connect, run a tool call, send its result back and show the answer?

    python bench/clients.py [--clients claude-code,codex,opencode,qwen-code,aider] [--servers serve,llama-server]
                            [--model DIR|GGUF] [--ctx 65536] [--threads 1] [--mode auto] [--timeout 900]
                            [--force | --no-force] [--workdir out/bench-clients] [--json]

The clients, pinned (CLIENTS): Claude Code, Codex CLI, OpenCode and Qwen Code from npm (the machine's node/npm:
Debian's `nodejs` and `npm` packages), Aider from PyPI in its own virtual environment, installed once into
<clover-gguf cache>/clients/<name>-<version> (outside the repository; CLOVER_GGUF_CACHE_DIR moves it). Each run gets
a fresh temporary folder outside any repository: its HOME (and CODEX_HOME, XDG folders) with the client's
configuration written there, so nothing reaches the user's own, and the task's work folder; removed after the run
(the client's output stays in <workdir>/runs). Autoupdate, telemetry and other traffic off where the client has a
switch.

The task: a work folder with notes.txt (three lines) and the request "Read the file notes.txt and tell me its second
line." Aider has no tool calls: it is given the file (--read) and asked the same. The clients run in their own
default permission modes (Claude Code -p, OpenCode run, Qwen Code --approval-mode default; Codex exec with
`-s read-only` and approval_policy never): reading a file is allowed, anything else a tiny model's call might ask for
(a shell command, a write) is refused by the client and that refusal goes back as the tool's result.

The model: the tool-trained tiny Clover (clover_gguf.testing.agent.TOOL_MODEL) converted to F32 with its context
length raised to --ctx (model_gguf: it was trained on 4,096 tokens; Claude Code's first prompt is about 45,500 tokens
in its tokenizer), or --model. Both servers in bench/agent.py's exact settings (its start_ours, start_peer), one
slot each, --ctx tokens of context.

Between each client and each server sits a recording proxy (bench/client_proxy.py): every request the client sends
is kept as it sent it in <workdir>/requests/<server>/<client>/NNN.json (for issue 70's replay), with the answer's
text, calls and usage. --force (the default) sets the first call: on the request right after the user's words, if it
offers tools and chose none itself, tool_choice becomes the client's read tool by name (CLIENTS' read_tool; "any
call" in the API's spelling where it has none), because a tiny model rarely calls a tool on its own inside an agent's
long prompt. llama-server takes no named tool_choice (a string only: its log says "Wrong type supplied for
parameter 'tool_choice'" and it falls back to auto), so there the proxy sets "required" / {"type": "any"}: the model
picks the tool. Every other request goes as sent; the record says which requests the proxy forced.

Per client and server, from the record and the client's output: connected (a request answered 2xx), the tool the
model called, whether a tool result came back in a later request (and whether it holds notes.txt's line: the client
really read the file), whether the last answer's text is in what the client printed, prompt and cached tokens of
turn 2 (the request that carries the tool result: how much of turn 1's prompt the server kept), wall time. A client
that fails says why in one line of the table's notes; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from client_proxy import Exchange, RecordingProxy, carries_tool_result  # noqa: E402
from session_store import KEEP_HEADERS, SESSIONS, file_of, save  # noqa: E402

API_KEY = "clover-bench-key"  # what the clients send; neither server is started with --api-key
MODEL_NAME = "clover"
NOTES = "alpha one\nthe code word is heron\ngamma three\n"
LINE = "the code word is heron"
PROMPT = "Read the file notes.txt and tell me its second line."
SERVERS = ("serve", "llama-server")
# --session: one session of these prompts, each going on with the one before (the client's continue flag); with the
# forced first call each prompt is a tool round trip, two requests or more
TODO = "buy milk\nfix the build\ncall the plumber\n"
SESSION_PROMPTS = (PROMPT, "Now read todo.txt and tell me its first line.", "What is the third line of notes.txt?")


@dataclass(frozen=True)
class Client:
    name: str
    version: str
    api: str  # the API it speaks: chat, messages, responses
    registry: str  # npm or pypi
    package: str
    binary: str  # its command, under the install's bin folder
    read_tool: str | None  # the tool the forcing rule names (None: any call)


CLIENTS = {c.name: c for c in (
    Client("claude-code", "2.1.197", "messages", "npm", "@anthropic-ai/claude-code", "claude", "Read"),
    Client("codex", "0.171.0", "responses", "npm", "@openai/codex", "codex", "exec_command"),
    Client("opencode", "1.18.33", "chat", "npm", "opencode-ai", "opencode", "read"),
    Client("qwen-code", "0.15.10", "chat", "npm", "@qwen-code/qwen-code", "qwen", "read_file"),
    Client("aider", "0.86.2", "chat", "pypi", "aider-chat", "aider", None),
)}


class BenchError(Exception):
    """One line naming what failed (printed without a traceback)."""


# ---- arguments ------------------------------------------------------------------------------------------------------
def pick(text: str, known, what: str) -> list[str]:
    """A comma-separated choice -> its names in order; an unknown or missing name is one line (BenchError)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError(f"--{what} names none of {', '.join(known)}")
    bad = [n for n in names if n not in known]
    if bad:
        raise BenchError(f"--{what}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


# ---- installing -----------------------------------------------------------------------------------------------------
def clients_cache() -> Path:
    from clover_gguf.build import cache_root

    return cache_root() / "clients"


def install_dir(c: Client, cache: Path) -> Path:
    return cache / f"{c.name}-{c.version}"


def binary_path(c: Client, cache: Path) -> Path:
    d = install_dir(c, cache)
    return d / "bin" / c.binary if c.registry == "pypi" else d / "node_modules" / ".bin" / c.binary


def install(c: Client, cache: Path) -> Path:
    """The client's command, installed at its pinned version first if it is not in the cache."""
    exe = binary_path(c, cache)
    if exe.exists():
        return exe
    d = install_dir(c, cache)
    d.mkdir(parents=True, exist_ok=True)
    if c.registry == "npm":
        if not shutil.which("npm") or not shutil.which("node"):
            raise BenchError(f"installing {c.name}: needs node and npm (Debian: `apt-get install nodejs npm`)")
        cmd = ["npm", "install", "--prefix", str(d), "--no-audit", "--no-fund", "--loglevel=error",
               f"{c.package}@{c.version}"]
    else:
        venv = subprocess.run([sys.executable, "-m", "venv", str(d)], capture_output=True, text=True)
        if venv.returncode != 0:
            raise BenchError(f"installing {c.name}: python -m venv failed: {venv.stderr.strip()[-300:]}")
        cmd = [str(d / "bin" / "pip"), "install", "-q", f"{c.package}=={c.version}"]
    print(f"installing {c.name} {c.version} into {d} ...", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not exe.exists():
        raise BenchError(f"installing {c.name}: {' '.join(cmd[:3])} ... failed: {p.stderr.strip()[-300:]}")
    return exe


# ---- configuring: a fresh HOME per run ------------------------------------------------------------------------------
def base_env(home: Path) -> dict:
    """The environment every client runs in: the machine's PATH, a fresh HOME and XDG folders under it, nothing of
    the user's own configuration or keys."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "USER", "SHELL")}
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local"
                                                                                                      / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local" / "state"),
            "NO_COLOR": "1", "CI": "1"}


def configure(c: Client, exe: Path, base: str, home: Path, work: Path, ctx: int, prompt: str = PROMPT,
              session: bool = False, resume: bool = False) -> tuple[list[str], dict]:
    """(argv, env) running client `c` once on `prompt` against the server at `base` (its root URL: each client
    adds its own /v1), with its configuration files written under `home`. session: the client keeps its record of
    the session (for prompts that go on with it); resume: the prompt goes on the client's last session in that HOME
    and work folder (its own continue flag), as a user's next prompt does."""
    session = session or resume
    home.mkdir(parents=True, exist_ok=True)
    env = base_env(home)
    v1 = base.rstrip("/") + "/v1"
    if c.name == "claude-code":
        env.update({"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": API_KEY, "ANTHROPIC_MODEL": MODEL_NAME,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME, "ANTHROPIC_SMALL_FAST_MODEL": MODEL_NAME,
                    "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"})
        # a session that goes on needs the client's own record of it: persistence stays on then
        keep = ["--continue"] if resume else [] if session else ["--no-session-persistence"]
        return [str(exe), "-p", prompt, "--model", MODEL_NAME, *keep], env
    if c.name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(v1))
        env.update({"CODEX_HOME": str(codex_home), "CLOVER_API_KEY": API_KEY})
        head = [str(exe), "exec", *(["resume", "--last"] if resume else [])]
        return [*head, "--skip-git-repo-check", *([] if session else ["--ephemeral"]), "--color", "never",
                "-s", "read-only", "-c", 'approval_policy="never"', "-C", str(work), prompt], env
    if c.name == "opencode":
        d = home / ".config" / "opencode"
        d.mkdir(parents=True, exist_ok=True)
        (d / "opencode.json").write_text(json.dumps(opencode_config(v1), indent=1) + "\n")
        env.update({"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1"})
        return [str(exe), "run", *(["--continue"] if resume else []), "-m", f"{MODEL_NAME}/{MODEL_NAME}", prompt], env
    if c.name == "qwen-code":
        d = home / ".qwen"
        d.mkdir(parents=True, exist_ok=True)
        (d / "settings.json").write_text(json.dumps(qwen_settings(), indent=1) + "\n")
        env.update({"OPENAI_BASE_URL": v1, "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": MODEL_NAME})
        return [str(exe), *(["--continue"] if resume else []), "--approval-mode", "default", "--auth-type", "openai",
                "-m", MODEL_NAME, prompt], env
    if c.name == "aider":
        env.update({"OPENAI_API_BASE": v1, "OPENAI_API_KEY": API_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                    "AIDER_ANALYTICS": "false"})
        return [str(exe), "--model", f"openai/{MODEL_NAME}", "--message", prompt, "--read", "notes.txt", "--no-git", "--yes-always", "--no-suggest-shell-commands",
                "--no-check-update", "--no-show-model-warnings", "--analytics-disable", "--no-pretty",
                "--no-fancy-input", "--map-tokens", "0", *(["--restore-chat-history"] if resume else [])], env
    raise BenchError(f"no configuration for client {c.name}")


def codex_config(v1: str) -> str:
    """Codex's config.toml: a provider at `v1` speaking Responses (Codex's only wire API), its key from
    CLOVER_API_KEY."""
    return (f'model = "{MODEL_NAME}"\nmodel_provider = "clover"\n\n'
            f'[model_providers.clover]\nname = "clover-gguf bench"\nbase_url = "{v1}"\nwire_api = "responses"\n'
            f'env_key = "CLOVER_API_KEY"\n\n[analytics]\nenabled = false\n')


def opencode_config(v1: str) -> dict:
    """OpenCode's opencode.json: a provider through @ai-sdk/openai-compatible (chat completions) at `v1`."""
    return {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "provider": {MODEL_NAME: {"npm": "@ai-sdk/openai-compatible", "name": "clover-gguf bench",
                                      "options": {"baseURL": v1, "apiKey": API_KEY},
                                      "models": {MODEL_NAME: {"name": MODEL_NAME, "tool_call": True}}}}}


def qwen_settings() -> dict:
    return {"security": {"auth": {"selectedType": "openai"}}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True}, "privacy": {"usageStatisticsEnabled": False}}


# ---- llama-server's template ----------------------------------------------------------------------------------------
# the model's template refuses a system message that is not first; serve renders one as a user turn with its text
# (docs/serve.md, /v1/messages), and so does the tolerant copy given to llama-server with --peer-template tolerant
LATER_SYSTEM_REFUSAL = "{%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}"
LATER_SYSTEM_AS_USER = ("{%- if not loop.first %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
                        "{%- endif %}")


def tolerant_template(template: str) -> str:
    """The model's chat template with its refusal of a later system message replaced by a user turn of its text."""
    if LATER_SYSTEM_REFUSAL not in template:
        raise BenchError("--peer-template tolerant: the model's template has no refusal of a later system message "
                         "to replace")
    return template.replace(LATER_SYSTEM_REFUSAL, LATER_SYSTEM_AS_USER)


def peer_args(kind: str, gguf: Path, workdir: Path) -> tuple:
    """llama-server's extra arguments for --peer-template: none for the model's own template, else a tolerant copy."""
    if kind == "model":
        return ()
    from clover_gguf.gguf_header import read_header

    template = read_header(gguf).kv.get("tokenizer.chat_template")
    if not isinstance(template, str):
        raise BenchError(f"--peer-template tolerant: {gguf} has no chat template")
    path = workdir / "tolerant-template.jinja"
    path.write_text(tolerant_template(template))
    return ("--chat-template-file", str(path))


# ---- one run and what it shows --------------------------------------------------------------------------------------
@dataclass
class Row:
    client: str
    version: str
    api: str
    server: str
    connected: bool = False
    tool_call: str | None = None  # the tool the model called first
    result_sent: bool = False
    result_has_line: bool = False  # the tool result holds notes.txt's line: the client really read the file
    answer_shown: bool = False
    turn2_prompt: int | None = None
    turn2_cached: int | None = None
    turn1_prompt: int | None = None
    requests: int = 0
    forced: int = 0
    wall_s: float = 0.0
    exit_code: int | None = None
    note: str = ""
    answer: str = ""


def _flat(text: str) -> str:
    return " ".join(text.split())


def judge(row: Row, exchanges: list[Exchange], output: str) -> Row:
    """Fill `row` from the proxy's record of one run and what the client printed."""
    api_ex = [e for e in exchanges if e.api]
    row.requests = len(api_ex)
    row.forced = sum(e.forced is not None for e in api_ex)
    row.connected = any(200 <= e.status < 300 for e in api_ex)
    errors = [e for e in api_ex if e.status >= 400]
    if errors and not row.note:
        row.note = f"HTTP {errors[0].status} on {errors[0].method} {errors[0].path}: {_flat(errors[0].error or '')[:160]}"
    called = [e for e in api_ex if e.answer.calls]
    if called:
        row.tool_call = called[0].answer.calls[0]
    # the first request sending a tool result back: turn 2 of the tool loop
    with_result = [e for e in api_ex if isinstance(e.body, dict) and carries_tool_result(e.api, e.body)]
    if with_result:
        row.result_sent = True
        row.result_has_line = any(LINE in r for r in carries_tool_result(with_result[0].api, with_result[0].body))
        t2 = with_result[0]
        row.turn2_prompt, row.turn2_cached = t2.answer.prompt_tokens, t2.answer.cached_tokens
        firsts = [e for e in api_ex if e.seq < t2.seq and e.answer.calls]
        if firsts:
            row.turn1_prompt = firsts[-1].answer.prompt_tokens
    # the answers in text (no call); shown: one of them is in the client's output (the last such, else the last
    # answer: a client's side requests, e.g. Qwen Code's check of who speaks next, answer in text too)
    answered = [e.answer.text.strip() for e in api_ex
                if 200 <= e.status < 300 and e.answer.text.strip() and not e.answer.calls]
    shown = [t for t in answered if _flat(t)[:60] in _flat(output)]
    row.answer_shown = bool(shown)
    row.answer = (shown or answered or [""])[-1]
    return row


@contextlib.contextmanager
def _removed(folder: Path):
    """The folder is removed at the block's end, whatever happens (Ctrl-C included)."""
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fresh_run(c: Client, server: str, workdir: Path, tag: str, files: dict) -> tuple[Path, Path, Path, Path]:
    """A run's folders, emptied: (where the client's output goes, its sandbox, the task's work folder holding
    `files`, where the proxy records its requests)."""
    run_dir = workdir / "runs" / f"{tag}{server}-{c.name}"  # the client's output
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # its HOME and its work folder: a fresh temporary folder outside any repository (inside one, Aider writes its
    # history at the repository's root and the others read the repository's state into their prompts)
    sandbox = Path(tempfile.mkdtemp(prefix=f"clover-clients-{tag}{server}-{c.name}-"))
    work = sandbox / "work"
    work.mkdir()
    for name, text in files.items():
        (work / name).write_text(text)
    record = workdir / "requests" / f"{tag}{server}" / c.name
    shutil.rmtree(record, ignore_errors=True)
    return run_dir, sandbox, work, record


def run_client(c: Client, exe: Path, server: str, upstream: str, workdir: Path, timeout: float, force: bool,
               ctx: int) -> Row:
    """Client `c` once on the task against `upstream` through a recording proxy -> its row."""
    run_dir, sandbox, work, record = fresh_run(c, server, workdir, "", {"notes.txt": NOTES})
    row = Row(c.name, c.version, c.api, server)
    # llama-server takes tool_choice only as a string (auto, none, required: a named function is "Wrong type
    # supplied for parameter 'tool_choice'" and falls back to auto; its Messages face maps a named tool to required)
    read_tool = c.read_tool if server == "serve" else None
    with RecordingProxy(upstream, record, force=force, read_tool=read_tool) as proxy, _removed(sandbox):
        argv, env = configure(c, exe, proxy.base, sandbox / "home", work, ctx)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            out, err, row.exit_code = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            row.note = f"stopped after {timeout:.0f} s"
        row.wall_s = time.perf_counter() - t0
        exchanges = list(proxy.exchanges)
    (run_dir / "stdout.txt").write_text(out)
    (run_dir / "stderr.txt").write_text(err)
    judge(row, exchanges, out)
    if row.exit_code not in (0, None) and not row.note:
        last = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
        row.note = f"exit {row.exit_code}: {last[-1][:160] if last else ''}"
    if not row.requests and not row.note:
        row.note = "sent no request"
    return row


def run_session(c: Client, exe: Path, server: str, upstream: str, workdir: Path, timeout: float, force: bool,
                ctx: int, prompts=SESSION_PROMPTS) -> tuple[Row, list[Exchange]]:
    """Client `c` through `prompts` in one session (one HOME and work folder; every prompt after the first with the
    client's continue flag) against `upstream` through one recording proxy -> (the row of the whole session, every
    exchange in order)."""
    run_dir, sandbox, work, record = fresh_run(c, server, workdir, "session-", {"notes.txt": NOTES, "todo.txt": TODO})
    row = Row(c.name, c.version, c.api, server)
    read_tool = c.read_tool if server == "serve" else None
    outs = []
    with RecordingProxy(upstream, record, force=force, read_tool=read_tool) as proxy, _removed(sandbox):
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            argv, env = configure(c, exe, proxy.base, sandbox / "home", work, ctx, prompt, session=True, resume=i > 0)
            try:
                p = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                                   stdin=subprocess.DEVNULL)
                out, err, row.exit_code = p.stdout, p.stderr, p.returncode
            except subprocess.TimeoutExpired:
                out, err, row.note = "", "", f"prompt {i + 1} stopped after {timeout:.0f} s"
            (run_dir / f"stdout-{i + 1}.txt").write_text(out)
            (run_dir / f"stderr-{i + 1}.txt").write_text(err)
            outs.append(out)
            if row.note or row.exit_code not in (0, None):
                break
        row.wall_s = time.perf_counter() - t0
        exchanges = list(proxy.exchanges)
    judge(row, exchanges, "\n".join(outs))
    if row.exit_code not in (0, None) and not row.note:
        row.note = f"exit {row.exit_code} on prompt {len(outs)}"
    return row, exchanges


def save_session(c: Client, exchanges: list[Exchange], prompts, folder: Path = SESSIONS) -> Path:
    """The session's model requests (those of an API, answered 2xx) as bench/sessions/<client>.json.gz: bodies as
    the client sent them (before the forcing rule), the tool_choice the proxy set, the request headers a server
    reads, and the recorded answer's text, calls and usage."""
    reqs = [{"path": e.path, "headers": {k.lower(): v for k, v in e.headers.items() if k.lower() in KEEP_HEADERS},
             "forced": e.forced, "answer": e.answer.__dict__, "body": e.body}
            for e in exchanges if e.api and 200 <= e.status < 300 and isinstance(e.body, dict)]
    meta = {"client": c.name, "version": c.version, "api": c.api, "prompts": list(prompts),
            "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
            "model": "the tool-trained tiny Clover (clover_gguf.testing.agent.TOOL_MODEL), bench/clients.py --session"}
    return save(file_of(c.name, folder), meta, reqs)


# ---- the table ------------------------------------------------------------------------------------------------------
COLUMNS = ("client", "version", "API", "server", "connected", "tool call", "result sent back", "answer shown",
           "turn 2 prompt", "turn 2 cached", "wall s")


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def cells(r: Row) -> list[str]:
    no_tools = CLIENTS[r.client].name == "aider"
    tool = "n/a (no tools)" if no_tools else (r.tool_call or "no")
    sent = "n/a" if no_tools else (("yes, with the line" if r.result_has_line else "yes") if r.result_sent else "no")
    return [r.client, r.version, r.api, r.server, _yes(r.connected), tool, sent, _yes(r.answer_shown),
            "-" if r.turn2_prompt is None else str(r.turn2_prompt),
            "-" if r.turn2_cached is None else str(r.turn2_cached), f"{r.wall_s:.0f}"]


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table (docs/serve.md takes it as printed), notes below it."""
    body = [list(COLUMNS)] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    fmt = lambda line: "| " + " | ".join(x.ljust(w) for x, w in zip(line, widths)) + " |"  # noqa: E731
    out = [fmt(body[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(x) for x in body[1:]]
    notes = [f"- {r.client} on {r.server}: {r.note}" for r in rows if r.note]
    return "\n".join(out + ([""] + notes if notes else []))


# ---- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated: " + ", ".join(CLIENTS))
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated: " + ", ".join(SERVERS))
    ap.add_argument("--model", type=Path, default=None, help="the tool model's folder (converted) or a GGUF")
    ap.add_argument("--ctx", type=int, default=65536,
                    help="context of both servers (Claude Code's first prompt is about 45,500 tokens with the tiny model's tokenizer)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", default="auto", help="serve's decoding mode")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per client run")
    ap.add_argument("--force", action=argparse.BooleanOptionalAction, default=True,
                    help="force the first tool call (tool_choice on the turn after the user's words)")
    ap.add_argument("--peer-template", choices=("model", "tolerant"), default="model",
                    help="llama-server's chat template: the model's own, or a copy that renders a later system "
                         "message as a user turn (as serve does) instead of refusing it")
    ap.add_argument("--session", action="store_true",
                    help="record one session per client (SESSION_PROMPTS, each going on with the one before) "
                         "against the first --servers and store it as bench/sessions/<client>.json.gz "
                         "(bench/agent_session.py replays them)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-clients")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.clients = pick(args.clients, CLIENTS, "clients")
        args.servers = pick(args.servers, SERVERS, "servers")
        if args.ctx < 1024:
            raise BenchError(f"--ctx {args.ctx} is too small for an agent's prompt (at least 1024)")
        if args.threads < 1 or args.timeout <= 0:
            raise BenchError("--threads and --timeout must be positive")
        if args.model is not None and not args.model.exists():
            raise BenchError(f"--model {args.model}: no such file or folder")
    except BenchError as e:
        ap.exit(2, f"error: {e}\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        rows = run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    print(table(rows))
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))


def model_gguf(model: Path | None, workdir: Path, ctx: int) -> Path:
    """The GGUF both servers load: a file as given; a folder (the tool-trained tiny model by default) converted to
    F32 with its context length raised to `ctx`. The tiny model was trained on 4,096 tokens and serve refuses a
    prompt past the model's context, but an agent's first prompt is longer (Claude Code's: about 45,500 tokens in the
    tiny tokenizer); past 4,096 the model's text is worse, which the table shows as it is: what is tested is whether
    the protocol carries a tool loop."""
    from clover_gguf.convert import convert
    from clover_gguf.testing.agent import TOOL_MODEL

    model = model or TOOL_MODEL
    if model.is_file():
        return model
    gguf = workdir / f"{model.name}-ctx{ctx}-f32.gguf"
    if not gguf.is_file():
        folder = workdir / f"{model.name}-ctx{ctx}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in model.iterdir():
            if f.is_file():
                (folder / f.name).symlink_to(f.resolve())
        cfg = json.loads((model / "config.json").read_text())
        cfg["max_position_embeddings"] = max(ctx, int(cfg.get("max_position_embeddings") or 0))
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        convert(folder, gguf, outtype="f32", quiet=True, force=True)
    return gguf


def run(args) -> list[Row]:
    from agent import start_ours, start_peer  # bench/agent.py's servers: serve and llama-server, exact settings
    from serve import BenchError as ServerError, servers_stopped

    args.workdir.mkdir(parents=True, exist_ok=True)
    cache = clients_cache()
    exes = {n: install(CLIENTS[n], cache) for n in args.clients}
    gguf = model_gguf(args.model, args.workdir, args.ctx)
    rows = []
    with servers_stopped([]) as procs:
        bases = {}
        try:
            for s in args.servers[:1] if args.session else args.servers:
                bases[s] = (start_ours(gguf, args.workdir, args.threads, args.ctx, procs, mode=args.mode)
                            if s == "serve" else start_peer(gguf, args.workdir, args.threads, args.ctx, procs,
                                                  peer_args(args.peer_template, gguf, args.workdir)))
        except ServerError as e:
            raise BenchError(str(e)) from None
        if args.session:
            s = args.servers[0]
            for n in args.clients:
                print(f"{n} {CLIENTS[n].version}: a session of {len(SESSION_PROMPTS)} prompts against {s} ...",
                      file=sys.stderr, flush=True)
                row, exchanges = run_session(CLIENTS[n], exes[n], s, bases[s], args.workdir, args.timeout,
                                             args.force, args.ctx)
                path = save_session(CLIENTS[n], exchanges, SESSION_PROMPTS)
                print(f"  {row.requests} requests -> {path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)"
                      + (f" ({row.note})" if row.note else ""), file=sys.stderr, flush=True)
                rows.append(row)
            return rows
        for n in args.clients:
            for s in args.servers:
                print(f"{n} {CLIENTS[n].version} against {s} ...", file=sys.stderr, flush=True)
                row = run_client(CLIENTS[n], exes[n], s, bases[s], args.workdir, args.timeout, args.force, args.ctx)
                print(f"  {', '.join(f'{k}: {v}' for k, v in zip(COLUMNS[4:], cells(row)[4:]))}"
                      + (f" ({row.note})" if row.note else ""), file=sys.stderr, flush=True)
                rows.append(row)
    (args.workdir / "clients.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
