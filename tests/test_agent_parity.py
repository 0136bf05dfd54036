"""The patched `llama-server --jinja` and `serve --mode ar` on the same GGUF (the tool-trained tiny Clover) and the
same requests: tool_choice auto, greedy, every penalty off, both in the exact settings (flash attention off, F32 K/V),
one held-out task of each kind (a call, two calls, a final answer after one result and after two, JSON after a
lookup, a plain answer with tools offered). The same tool_calls (names and arguments, parsed) and the same content on
each: two parsers of the format, written apart (llama.cpp's common/chat's Qwen3-Coder XML parser and
clover_gguf.serve.tools), read the same answers. bench/agent.py compares every held-out task (docs/serve.md).
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from clover_gguf.serve import create_app  # noqa: E402
from clover_gguf.testing.agent import held_out_tasks  # noqa: E402
from clover_gguf.testing.tool_tasks import KINDS  # noqa: E402

from bench_scripts import load_bench  # noqa: E402
from test_server import _Server  # noqa: E402


bench = load_bench("agent.py")


# the long kind's task: long-11, the first long copy the model writes whole (2 of the 15 are; the others' calls are
# the model's misses, and the check below that both servers read the task's own calls needs a right one)
FIRST_OF_KIND = {"long": "long-11"}


def one_of_each_kind():
    out = {}
    for t in held_out_tasks():
        if FIRST_OF_KIND.get(t.kind, t.id) == t.id:
            out.setdefault(t.kind, t)
    return list(out.values())


TASKS = one_of_each_kind()


@pytest.fixture(scope="module")
def servers(tool_gguf, tmp_path_factory):
    ours = _Server(create_app(tool_gguf, mode="ar", parallel=1, ctx=4096, runtime_kwargs={"exact": True}))
    procs: list = []
    try:
        with bench.servers_stopped(procs):
            peer = bench.start_peer(tool_gguf, tmp_path_factory.mktemp("peer"), 2, 4096, procs)
            yield ours.base, peer
    finally:
        ours.stop()


def test_llama_server_reads_the_same_tool_calls(servers):
    assert {t.kind for t in TASKS} == set(KINDS)
    rows = bench.peer_compare(*servers, TASKS)
    for t, r in zip(TASKS, rows):
        assert r["same_calls"] and r["same_content"], r
        # and they are the right ones (both could not misread alike): the task's calls, or none
        assert r["ours_calls"] == [(n, a) for n, a in (t.calls or [])], (t.id, r["ours_calls"], t.calls)
        assert r["ours_prompt_tokens"] == r["peer_prompt_tokens"], r  # one template, one rendering
    assert sum(bool(r["ours_calls"]) for r in rows) == 3  # the call, the two calls and the long call
