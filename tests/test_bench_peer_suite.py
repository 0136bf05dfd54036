"""bench/peer_suite.py's wrapper and table (the run itself needs llama-server and minutes: `python
bench/peer_suite.py`, docs/serve.md "Requests written for llama-server")."""

import sys
from pathlib import Path

from bench_scripts import BENCH, load_bench

sys.path.insert(0, str(BENCH))  # the plugin module peer_suite names (pytest loads it with -p peer_plugin)
suite = load_bench("peer_suite.py")
plugin = load_bench("peer_plugin.py")

ENV = {"PEER_BUNDLED_GGUF": "/m/tiny.gguf", "PEER_TOOL_GGUF": "/m/tools.gguf", "PEER_LLAMA_SERVER": "/b/llama-server"}
ARGS = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline", "--hf-repo",
        "ggml-org/test-model-stories260K", "--batch-size", "32", "--no-slots", "--alias", "tinyllama-2",
        "--ctx-size", "512", "--parallel", "2", "--n-predict", "64", "--api-key", "k", "--jinja",
        "--chat-template-file", "../../../models/templates/x.jinja"]


def test_the_wrapper_starts_each_server_with_the_same_settings_on_our_files():
    serve = suite.server_command(ARGS, "serve", ENV)
    assert serve[1:4] == ["-m", "clover_gguf", "serve"] and serve[4] == "/m/tiny.gguf"
    opts = dict(zip(serve[5::2], serve[6::2]))
    # llama-server's --ctx-size is shared by its slots, serve's --ctx is per slot
    assert opts["--ctx"] == "256" and opts["--parallel"] == "2" and opts["--port"] == "8123"
    assert opts["--api-key"] == "k" and opts["--alias"] == "tinyllama-2" and opts["--seed"] == "42"
    assert opts["--reasoning"] == "off"  # llama-server does not think on this template unless asked
    llama = suite.server_command(ARGS, "llama-server", ENV)
    assert llama[:3] == ["/b/llama-server", "-m", "/m/tiny.gguf"] and "--jinja" in llama
    assert "--chat-template-file" not in llama and "--hf-repo" not in llama  # the GGUF's template, no download
    assert llama[llama.index("--ctx-size") + 1] == "512"
    tools = ARGS[:ARGS.index("--alias") + 1] + ["tinyllama-2-tool-call"] + ARGS[ARGS.index("--alias") + 2:]
    assert suite.server_command(tools, "serve", ENV)[4] == "/m/tools.gguf"
    asked = suite.server_command(ARGS + ["--reasoning", "on"], "serve", ENV)
    assert dict(zip(asked[5::2], asked[6::2]))["--reasoning"] == "on"


def test_the_table_counts_per_file_and_lists_the_differences():
    res = {"llama-server": {"unit/test_a.py::t1": {"outcome": "passed"}, "unit/test_a.py::t2": {"outcome": "passed"},
                            "unit/test_b.py::t3": {"outcome": "skipped", "reason": "why"}},
           "serve": {"unit/test_a.py::t1": {"outcome": "passed"},
                     "unit/test_a.py::t2": {"outcome": "failed", "why": "assert 1 == 2"},
                     "unit/test_b.py::t3": {"outcome": "skipped", "reason": "why"}}}
    text = suite.table(res)
    assert "| test_a.py | 2 | 2 | 1 |" in text and "| **total** | **2** | **2** | **1** |" in text
    assert "- t2: assert 1 == 2" in text and "- why: 1 tests (t3)" in text


def test_the_plugin_leaves_out_by_name_with_a_reason():
    assert plugin.left_out("test_chat_completion.py", "test_chat_completion") == plugin.TEXT
    assert plugin.left_out("test_chat_completion.py", "test_completion_with_grammar") is None
    assert plugin.left_out("test_embedding.py", "test_x") == "not in the files peer_suite runs"
