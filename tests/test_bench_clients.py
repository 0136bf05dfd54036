"""bench/clients.py's pure parts, without npm or a model: the forcing rule (the first call, in each API's spelling),
the answers read back from each API's stream, the recording proxy in front of a fake server (requests kept as sent,
a stream passed through, the forced body forwarded), the judge of a run, the table, the clients' configuration in a
fresh HOME, and bad arguments as one line with exit 2."""

from __future__ import annotations

import json
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from bench_scripts import load_bench

clients = load_bench("clients.py")
proxy = load_bench("client_proxy.py")

CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
              {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
MSG_TOOLS = [{"name": "Read", "input_schema": {"type": "object"}}, {"name": "Bash", "input_schema": {"type": "object"}}]
RESP_TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}, {"type": "web_search"}]


# ---- the forcing rule -----------------------------------------------------------------------------------------------
def test_the_first_turn_is_forced_in_each_apis_spelling():
    user = [{"role": "user", "content": "read notes.txt"}]
    assert proxy.force_tool_choice("chat", {"messages": user, "tools": CHAT_TOOLS}, "read_file") == {
        "type": "function", "function": {"name": "read_file"}}
    assert proxy.force_tool_choice("chat", {"messages": user, "tools": CHAT_TOOLS}, None) == "required"
    assert proxy.force_tool_choice("chat", {"messages": user, "tools": CHAT_TOOLS}, "Read") == "required"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "read notes.txt"}]},
            {"role": "system", "content": "Available agent types ..."}]  # Claude Code's system message after it
    assert proxy.force_tool_choice("messages", {"messages": msgs, "tools": MSG_TOOLS}, "Read") == {
        "type": "tool", "name": "Read"}
    assert proxy.force_tool_choice("messages", {"messages": msgs, "tools": MSG_TOOLS}, None) == {"type": "any"}
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read notes.txt"}]},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env"}]}]
    assert proxy.force_tool_choice("responses", {"input": items, "tools": RESP_TOOLS}, "shell") == {
        "type": "function", "name": "shell"}
    assert proxy.force_tool_choice("responses", {"input": items, "tools": RESP_TOOLS}, None) == "required"
    assert proxy.force_tool_choice("responses", {"input": "read notes.txt", "tools": RESP_TOOLS}, None) == "required"


def test_turns_after_a_tool_result_without_tools_or_with_the_clients_own_choice_go_as_sent():
    after_tool = [{"role": "user", "content": "read"}, {"role": "assistant", "tool_calls": []},
                  {"role": "tool", "tool_call_id": "1", "content": "x"}]
    assert proxy.force_tool_choice("chat", {"messages": after_tool, "tools": CHAT_TOOLS}, "read_file") is None
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": "x"}]}]
    assert proxy.force_tool_choice("messages", {"messages": result, "tools": MSG_TOOLS}, "Read") is None
    items = [{"role": "user", "content": "read"}, {"type": "function_call", "name": "shell", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "1", "output": "x"}]
    assert proxy.force_tool_choice("responses", {"input": items, "tools": RESP_TOOLS}, "shell") is None
    user = [{"role": "user", "content": "hi"}]
    assert proxy.force_tool_choice("chat", {"messages": user}, "read_file") is None  # no tools (a title request)
    assert proxy.force_tool_choice("chat", {"messages": user, "tools": CHAT_TOOLS, "tool_choice": "none"},
                                   "read_file") is None
    assert proxy.force_tool_choice("messages", {"messages": user, "tools": MSG_TOOLS,
                                                "tool_choice": {"type": "tool", "name": "Bash"}}, "Read") is None
    assert proxy.force_tool_choice("responses", {"input": items[:1], "tools": [{"type": "web_search"}]}, None) is None


def test_tool_results_are_found_in_each_api():
    assert proxy.carries_tool_result("chat", {"messages": [{"role": "tool", "content": [
        {"type": "text", "text": "line"}]}]}) == ["line"]
    assert proxy.carries_tool_result("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": [{"type": "text", "text": "a"}]}, {"type": "text", "text": "b"}]}]}) == ["a"]
    assert proxy.carries_tool_result("responses", {"input": [{"type": "function_call_output", "output": "c"}]}) == ["c"]
    assert proxy.carries_tool_result("responses", {"input": "text"}) == []


# ---- answers read back ----------------------------------------------------------------------------------------------
def sse(*events, done=False) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_streamed_answers_are_read_in_their_api():
    a = proxy.parse_answer("chat", "text/event-stream", sse(
        {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "read_file", "arguments": ""}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": 80}}}, done=True))
    assert (a.text, a.calls, a.prompt_tokens, a.cached_tokens, a.stop) == ("Hello", ["read_file"], 90, 80, "tool_calls")
    a = proxy.parse_answer("messages", "text/event-stream; charset=utf-8", sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 300}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "name": "Read"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 5}}))
    assert (a.text, a.calls, a.prompt_tokens, a.cached_tokens, a.completion_tokens, a.stop) == (
        "ok", ["Read"], 310, 300, 5, "tool_use")
    done = {"output": [{"type": "reasoning"}, {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
                       {"type": "function_call", "name": "shell", "arguments": "{}"}],
            "status": "completed", "usage": {"input_tokens": 50, "output_tokens": 3,
                                             "input_tokens_details": {"cached_tokens": 40}}}
    a = proxy.parse_answer("responses", "text/event-stream", sse(
        {"type": "response.output_text.delta", "delta": "h"}, {"type": "response.completed", "response": done}))
    assert (a.text, a.calls, a.prompt_tokens, a.cached_tokens) == ("hi", ["shell"], 50, 40)
    a = proxy.parse_answer("responses", "application/json", json.dumps(done).encode())
    assert (a.text, a.calls, a.prompt_tokens, a.cached_tokens) == ("hi", ["shell"], 50, 40)


def test_llama_servers_cache_count_stands_in_for_missing_details():
    a = proxy.parse_answer("chat", "application/json", json.dumps({
        "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 9},
        "timings": {"cache_n": 6}}).encode())
    assert (a.prompt_tokens, a.cached_tokens) == (9, 6)


# ---- the proxy in front of a fake server ----------------------------------------------------------------------------
class FakeUpstream:
    """Streams a chat answer in three chunks; keeps the bodies it got."""

    def __init__(self):
        self.bodies = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                fake.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for e in ({"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                          {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}):
                    self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_the_proxy_records_as_sent_forwards_the_forced_body_and_streams_back(tmp_path):
    up = FakeUpstream()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "read"}], "tools": CHAT_TOOLS}
    try:
        with proxy.RecordingProxy(up.base, tmp_path / "rec", force=True, read_tool="read_file") as p:
            with httpx.stream("POST", p.base + "/v1/chat/completions", json=body,
                              headers={"Authorization": "Bearer sekrit"}) as r:
                got = b"".join(r.iter_bytes())
            assert r.status_code == 200
            exchanges = list(p.exchanges)
    finally:
        up.server.shutdown()
    assert got.count(b"data: ") == 4 and b'"content": "b"' in got
    assert up.bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    saved = json.loads((tmp_path / "rec" / "001.json").read_text())
    assert saved["body"] == body and "tool_choice" not in saved["body"]  # the record: the request as sent
    assert saved["forced"] == up.bodies[0]["tool_choice"]
    assert saved["headers"]["Authorization"] == "<secret>"
    assert exchanges[0].answer.text == "ab" and exchanges[0].answer.prompt_tokens == 3


# ---- judging a run and the table ------------------------------------------------------------------------------------
def exchange(seq, body, status=200, text="", calls=(), prompt=None, cached=None, api="messages"):
    return proxy.Exchange(seq=seq, method="POST", path="/v1/messages?beta=true", api=api, headers={}, body=body,
                          status=status, answer=proxy.Answer(text=text, calls=list(calls), prompt_tokens=prompt,
                                                             cached_tokens=cached))


def tool_loop(result_text: str) -> list:
    user = {"role": "user", "content": "read notes.txt"}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]}
    back = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": result_text}]}
    return [exchange(1, {"messages": [user]}, calls=["Read"], prompt=1000, cached=0),
            exchange(2, {"messages": [user, call, back]}, text="The second line is: the code word is heron.",
                     prompt=1050, cached=990)]


def test_a_tool_loop_is_judged_from_the_record_and_the_output():
    row = clients.judge(clients.Row("claude-code", "2.1.197", "messages", "serve"),
                        tool_loop("1\talpha one\n2\tthe code word is heron"),
                        "The second line is:\n the code word is heron.\n")
    assert (row.connected, row.tool_call, row.result_sent, row.result_has_line, row.answer_shown) == (
        True, "Read", True, True, True)
    assert (row.turn1_prompt, row.turn2_prompt, row.turn2_cached) == (1000, 1050, 990)
    row = clients.judge(clients.Row("claude-code", "2.1.197", "messages", "serve"), tool_loop("File not found"), "")
    assert (row.result_sent, row.result_has_line, row.answer_shown) == (True, False, False)
    # a side request answered in text after the one the client showed: the shown one counts
    side = tool_loop("x") + [exchange(3, {"messages": []}, text='{"next_speaker": "user"}')]
    row = clients.judge(clients.Row("qwen-code", "0.15.10", "chat", "serve"), side,
                        "The second line is: the code word is heron.")
    assert row.answer_shown and row.answer.startswith("The second line")


def test_a_refused_client_is_not_connected_and_the_note_says_why():
    ex = [exchange(1, {"messages": []}, status=404)]
    ex[0].error = '{"detail": "Not Found"}'
    row = clients.judge(clients.Row("codex", "0.171.0", "responses", "serve"), ex, "")
    assert not row.connected and row.tool_call is None and not row.result_sent
    assert row.note.startswith("HTTP 404 on POST /v1/messages?beta=true") and "Not Found" in row.note


def test_the_table_has_a_row_per_run_and_the_notes_below():
    rows = [clients.judge(clients.Row("claude-code", "2.1.197", "messages", "serve", wall_s=12.3),
                          tool_loop("the code word is heron"), "The second line is: the code word is heron."),
            clients.Row("aider", "0.86.2", "chat", "llama-server", connected=True, answer_shown=True,
                        note="exit 1: boom")]
    out = clients.table(rows).splitlines()
    assert [c.strip() for c in out[0].strip("|").split("|")] == list(clients.COLUMNS)
    assert [c.strip() for c in out[2].strip("|").split("|")] == [
        "claude-code", "2.1.197", "messages", "serve", "yes", "Read", "yes, with the line", "yes", "1050", "990", "12"]
    assert "n/a (no tools)" in out[3] and out[-1] == "- aider on llama-server: exit 1: boom"


# ---- configuration in a fresh HOME ---------------------------------------------------------------------------------
def test_each_client_is_configured_in_its_own_home_and_nothing_of_the_users_leaks(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "users-own-key")
    monkeypatch.setenv("OPENAI_API_KEY", "users-own-key")
    base = "http://127.0.0.1:5555"
    for name, c in clients.CLIENTS.items():
        home = tmp_path / name
        argv, env = clients.configure(c, tmp_path / "bin" / c.binary, base, home, tmp_path / "work", 32768)
        assert env["HOME"] == str(home) and "users-own-key" not in json.dumps(env)
        assert argv[0].endswith(c.binary) and clients.PROMPT in argv
    codex_home = tmp_path / "codex" / ".codex"
    cfg = tomllib.loads((codex_home / "config.toml").read_text())
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["base_url"] == base + "/v1" and provider["wire_api"] == "responses"
    oc = json.loads((tmp_path / "opencode" / ".config" / "opencode" / "opencode.json").read_text())
    assert oc["provider"]["clover"]["options"]["baseURL"] == base + "/v1"
    assert oc["provider"]["clover"]["npm"] == "@ai-sdk/openai-compatible"
    _, env = clients.configure(clients.CLIENTS["claude-code"], tmp_path / "claude", base, tmp_path / "cc",
                               tmp_path / "work", 32768)
    assert env["ANTHROPIC_BASE_URL"] == base and env["ANTHROPIC_API_KEY"] == clients.API_KEY


@pytest.mark.parametrize("argv, message", [
    (["--clients", "claude-code,vim"], "--clients: unknown vim"),
    (["--clients", ","], "--clients names none of"),
    (["--servers", "vllm"], "--servers: unknown vllm"),
    (["--ctx", "100"], "--ctx 100 is too small"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such file"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        clients.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_good_arguments_keep_the_order_given():
    args = clients.parse_args(["--clients", "codex,claude-code,codex", "--servers", "serve"])
    assert args.clients == ["codex", "claude-code"] and args.servers == ["serve"]


def test_the_tolerant_template_renders_a_later_system_message_as_a_user_turn():
    from pathlib import Path

    import jinja2

    template = (Path(clients.ROOT) / "clover_gguf" / "assets" / "tiny-clover-tools" / "chat_template.jinja").read_text()

    def refuse(message):
        raise ValueError(message)

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "system", "content": "later"}]
    with pytest.raises(ValueError, match="a system message must come first"):
        jinja2.Environment().from_string(template).render(messages=messages, raise_exception=refuse)
    out = jinja2.Environment().from_string(clients.tolerant_template(template)).render(
        messages=messages, raise_exception=refuse, add_generation_prompt=True)
    assert out.endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>user\nlater<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(clients.BenchError, match="no refusal of a later system message"):
        clients.tolerant_template("{{ messages }}")
