"""Issue 70's pieces without a model: the compact session store (bench/session_store.py) rebuilds every request
exactly, the stored sessions in bench/sessions hold at least five turns of three clients, the clients' continue flags
(bench/clients.py --session), and bench/agent_session.py's replayed bodies, its first-token rule per API, its figures
and its bad arguments."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from bench_scripts import BENCH, load_bench

store = load_bench("session_store.py")
clients = load_bench("clients.py")
session = load_bench("agent_session.py")


def _bodies():
    """Three requests the way an agent sends them: the same long prefix each time, an early block that changes
    (a billing header), a little appended."""
    tools = [{"name": f"Tool{i}", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}
             for i in range(12)]
    msgs = [{"role": "user", "content": "read notes.txt"}]
    out = []
    for i in range(3):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={i:05x};"},
                  {"type": "text", "text": "You are an agent. " * 40}]
        out.append({"model": "clover", "max_tokens": 32000, "system": system, "tools": tools,
                    "messages": [dict(m) for m in msgs], "stream": True})
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Read",
                                                     "input": {"file_path": "notes.txt"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                               "content": f"line {i} é ünïcode"}]}]
    return out


def test_the_store_rebuilds_every_request_exactly_and_keeps_only_what_changed(tmp_path):
    bodies = _bodies()
    reqs = [{"path": "/v1/messages?beta=true", "headers": {"anthropic-beta": "x"}, "forced": None, "body": b}
            for b in bodies]
    path = store.save(tmp_path / "s.json.gz", {"client": "claude-code"}, reqs)
    meta, back = store.load(path)
    assert meta == {"client": "claude-code"}
    # the bytes a replay sends are the client's: the same JSON text, key order included
    assert [json.dumps(r["body"]) for r in back] == [json.dumps(b) for b in bodies]
    assert [r["path"] for r in back] == [r["path"] for r in reqs]
    stored = json.loads(gzip.decompress(path.read_bytes()))
    later = json.dumps(stored["requests"][1]["edits"])
    # a later request is its edits only: the changed billing line and the appended messages, not the tool list
    assert "Tool3" not in later and "cch=00001" in later and "line 0" in later
    assert len(later) < len(json.dumps(bodies[1])) / 3


def test_edits_out_of_order_are_refused():
    with pytest.raises(ValueError, match="out of order"):
        store.apply_edits(["a", "b", "c"], [[2, 3, ["x"]], [0, 1, ["y"]]])
    with pytest.raises(ValueError, match="no request comes before"):
        store.unpack({"requests": [{"edits": []}]})


def test_the_recorded_sessions_hold_three_clients_of_five_turns_or_more():
    found = sorted((BENCH / "sessions").glob("*.json.gz"))
    assert len(found) >= 3
    for p in found:
        meta, reqs = store.load(p)
        assert len(reqs) >= 5, p.name
        apis = {session.api_of(r["path"]) for r in reqs}
        assert apis == {meta["api"]}, p.name
        # each turn resends the conversation: the last request carries a tool result the client sent back
        assert any(clients.carries_tool_result(meta["api"], r["body"]) for r in reqs), p.name
        assert os.path.getsize(p) < 400_000, p.name


def test_a_session_goes_on_with_each_clients_continue_flag(tmp_path):
    base = "http://127.0.0.1:5555"
    expect = {"claude-code": ["--continue"], "opencode": ["--continue"], "qwen-code": ["--continue"],
              "codex": ["resume", "--last"], "aider": ["--restore-chat-history"]}
    for name, c in clients.CLIENTS.items():
        first, _ = clients.configure(c, tmp_path / c.binary, base, tmp_path / name, tmp_path / "w", 4096, "one",
                                     session=True)
        later, _ = clients.configure(c, tmp_path / c.binary, base, tmp_path / name, tmp_path / "w", 4096, "two",
                                     resume=True)
        flags = expect[name]
        assert not any(f in first for f in flags) and "one" in first, name
        assert all(f in later for f in flags) and "two" in later, name
        # a session keeps the client's own record of it: nothing that turns it off
        assert "--no-session-persistence" not in first + later and "--ephemeral" not in first + later
    one_shot, _ = clients.configure(clients.CLIENTS["claude-code"], tmp_path / "claude", base, tmp_path / "x",
                                    tmp_path / "w", 4096)
    assert "--no-session-persistence" in one_shot


# ---- agent_session.py ------------------------------------------------------------------------------------------------
def test_the_replayed_body_is_the_clients_with_stream_greedy_neutral_penalties_and_the_cap():
    chat = {"model": "m", "messages": [], "tools": [1], "max_tokens": 32000, "temperature": 0.7}
    out = session.replay_body("chat", chat, 24)
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}
    assert out["max_tokens"] == 24 and out["temperature"] == 0.0 and out["tools"] == [1]
    assert out["presence_penalty"] == 0.0 and out["repetition_penalty"] == 1.0 and out["repeat_penalty"] == 1.0
    assert chat["temperature"] == 0.7  # the record itself untouched
    assert session.replay_body("chat", {"max_completion_tokens": 10}, 24)["max_tokens"] == 10
    assert session.replay_body("messages", {"max_tokens": 32000}, 24)["max_tokens"] == 24
    assert session.replay_body("responses", {}, 24)["max_output_tokens"] == 24


def test_the_first_token_is_the_first_event_with_output_in_each_api():
    assert not session.carries_output("chat", {"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert session.carries_output("chat", {"choices": [{"delta": {"reasoning_content": "h"}}]})
    assert session.carries_output("chat", {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert not session.carries_output("messages", {"type": "message_start"})
    assert not session.carries_output("messages", {"type": "content_block_start",
                                                   "content_block": {"type": "text", "text": ""}})
    assert session.carries_output("messages", {"type": "content_block_delta", "delta": {"type": "text_delta"}})
    assert session.carries_output("messages", {"type": "content_block_start",
                                               "content_block": {"type": "tool_use", "name": "Read"}})
    assert not session.carries_output("responses", {"type": "response.created"})
    assert session.carries_output("responses", {"type": "response.output_text.delta", "delta": "x"})


def _turn(n, ttft, text="a", reused=0, rss=2**20):
    return session.Turn(n, "chat", prompt=100 * n, reused=reused, ttft_s=ttft, decode_tps=10.0, rss=rss, text=text)


def test_the_figures_are_medians_over_runs_and_the_text_of_run_one_is_compared():
    runs = {"serve": [([_turn(1, 1.0), _turn(2, 0.2)], 5 * 2**20), ([_turn(1, 3.0), _turn(2, 0.4)], 7 * 2**20),
                      ([_turn(1, 2.0), _turn(2, 0.9)], 6 * 2**20)],
            "llama-server": [([_turn(1, 2.0), _turn(2, 0.5, text="b")], 9 * 2**20)] * 3}
    rows = session.summary(runs)
    assert rows[0]["serve"]["ttft_s"] == 2.0 and rows[1]["serve"]["ttft_s"] == 0.4
    assert rows[0]["same"] and not rows[1]["same"]
    tot = session.totals(runs)
    # the session's wait: the median over runs of each run's sum (1.2, 3.4, 2.9)
    assert tot["serve"]["wait_s"] == pytest.approx(2.9) and tot["serve"]["peak"] == 6 * 2**20
    text = session.table("s", rows, tot)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[3:]]
    assert cells[1][:3] == ["2", "200", "0"] and cells[1][-2:] == ["0.80", "no"]
    assert cells[2][0] == "total" and cells[2][-2:] == [f"{2.9 / 2.5:.2f}", "1/2"]


@pytest.mark.parametrize("argv, message", [
    (["--servers", "vllm"], "--servers: unknown vllm"),
    (["--sessions", "no-such-client"], "no such file"),
    (["--runs", "0"], "--runs must be at least 1"),
    (["--turns", "0"], "--turns must be at least 1"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such file"),
    (["--slice", "--model", str(BENCH)], "--slice and --model: give one"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        session.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_interleaved_turns_go_to_both_servers_in_alternating_order(monkeypatch):
    """--interleave: each turn goes to every server before the next turn, the servers' order alternating, so that a
    turn's figures on both meet the same load; each server gets its own turns, in order."""
    a = session
    sent = []

    def one_turn(http, base, n, req, pid, max_tokens):
        sent.append((base, n))
        return a.Turn(n, "chat", status=200)

    monkeypatch.setattr(a, "one_turn", one_turn)
    monkeypatch.setattr(a, "memory", lambda pid: (0, pid))
    out = a.replay_interleaved({"serve": ("S", 1), "llama-server": ("L", 2)}, [{}, {}, {}], 32)
    assert sent == [("S", 1), ("L", 1), ("L", 2), ("S", 2), ("S", 3), ("L", 3)]
    assert [t.n for t in out["serve"][0]] == [1, 2, 3] and out["serve"][1] == 1 and out["llama-server"][1] == 2
