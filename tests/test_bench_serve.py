"""bench/serve.py's equal-work check, on fake servers: two OpenAI-shaped streaming servers that count prompt and
generated tokens as told. The bench gives a ratio only where every request's prompt tokens and generated tokens are
the same on both sides and the generated tokens are the fixed budget; otherwise it says which request differs and
how. An HTTP error is one line naming the step."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench_scripts import load_bench

MAX_TOKENS = 8


bench = load_bench("serve.py")


class Fake:
    """A chat-completions server that streams `max_tokens` one-word tokens (fewer where `short(i)` says, i the
    request's number in arrival order) and counts a prompt as its words plus `extra_prompt` (a template of its own)."""

    def __init__(self, short=lambda i: None, extra_prompt: int = 5, status: int = 200):
        self.n, self.lock = 0, threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if status != 200:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": {"message": "request needs 9999 tokens, the context "
                                                           "holds 1024", "type": "invalid_request_error"}}).encode())
                    return
                with fake.lock:
                    i, fake.n = fake.n, fake.n + 1
                text = body["messages"][-1]["content"]
                n = body["max_tokens"] if body.get("ignore_eos") else 3
                n = fake_short if (fake_short := short(i)) is not None else n
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                events = [{"choices": [{"index": 0, "delta": {"content": f"w{k} "}, "finish_reason": None}]}
                          for k in range(n)]
                events.append({"choices": [], "usage": {"prompt_tokens": len(text.split()) + extra_prompt,
                                                        "completion_tokens": n,
                                                        "prompt_tokens_details": {"cached_tokens": 0}}})
                self.wfile.write("".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
                                 + b"data: [DONE]\n\n")  # one write: no small packets waiting on each other

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes(request):
    made = []

    def make(**kw) -> Fake:
        made.append(Fake(**kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _rounds(fake: Fake, rounds: int = 2, clients: int = 2) -> list:
    """What the bench keeps of a configuration: its rounds' (summary, records)."""
    out = []
    for r in range(rounds):
        bodies = bench.bodies_for(["What is 1 + 2?", "Count from 3 to 9, please."], 6, MAX_TOKENS, None, False)
        out.append(bench.run_load(fake.base, "fake", bodies, clients, f"round {r + 1}"))
    return out


def test_the_same_work_gets_a_ratio(fakes):
    ours, peer = _rounds(fakes()), _rounds(fakes())
    ratios, why = bench.compare(ours, peer, MAX_TOKENS)
    assert why is None and set(ratios) == {*bench.METRICS, "tps_rounds"} and len(ratios["tps_rounds"]) == 2
    assert all(r.completion_tokens == MAX_TOKENS for _, recs in ours for r in recs)
    assert bench.same_text(ours, peer) == (12, 12)


@pytest.mark.parametrize("kw, words", [
    (dict(short=lambda i: 5 if i == 9 else None), "request 3: 8 generated tokens against 5"),  # one answer ended early
    (dict(extra_prompt=6), "prompt tokens against"),  # another template: a token more in every prompt
])
def test_unequal_work_gets_no_ratio_and_says_why(fakes, kw, words):
    ours, peer = _rounds(fakes(), clients=1), _rounds(fakes(**kw), clients=1)
    ratios, why = bench.compare(ours, peer, MAX_TOKENS)
    assert ratios is None and words in why, why


def test_equal_lengths_short_of_the_budget_get_no_ratio(fakes):
    """Both sides ended early alike (neither honoured ignore_eos): equal, but not the work asked for."""
    ours, peer = _rounds(fakes(short=lambda i: 3)), _rounds(fakes(short=lambda i: 3))
    ratios, why = bench.compare(ours, peer, MAX_TOKENS)
    assert ratios is None and "not the budget of 8" in why


def test_an_http_error_is_one_line_naming_the_step(fakes):
    f = fakes(status=400)
    with pytest.raises(bench.BenchError) as e:
        bench.run_load(f.base, "llama-server", bench.bodies_for(["hi"], 2, MAX_TOKENS, None, False), 1,
                       "second turn (reuse)")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("second turn (reuse): llama-server answered HTTP 400: request needs")
