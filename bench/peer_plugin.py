"""The pytest plugin bench/peer_suite.py loads into llama.cpp's own server tests (tools/server/tests in the pinned
sdist, run where they were extracted, never copied into this repository): it picks the tests, says why the others
are left out (the same for serve and llama-server), keeps the suite from downloading models, and writes each test's
outcome to $PEER_RESULTS as JSON.

The suite's ServerProcess starts $LLAMA_SERVER_BIN_PATH with llama-server's command-line arguments: peer_suite.py
points it at its wrapper (`peer_suite.py --wrap`), which starts serve or llama-server on our local GGUFs.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

# the tests about OpenAI's API and the llama.cpp extensions clients send; every other test of these files is left
# out with the reason below (a file not named here is not run)
FILES = ("test_chat_completion.py", "test_tokenize.py", "test_security.py", "test_basic.py", "test_tool_call.py")

TEXT = "asserts the text or token counts of llama.cpp's test model (stories260K) or of a named template"
VERBOSE = "asserts the rendered prompt of a named template (llama-server's --verbose __verbose field)"
NATIVE = "llama-server's native /completion(s) body (`content`), not OpenAI's"
DOWNLOAD = "needs a model download (a Hugging Face repo)"
OFFER = "a llama-server feature serve does not offer"

LEFT_OUT = {
    "test_chat_completion.py": {
        "test_chat_completion": TEXT,
        "test_chat_completion_cached_tokens": TEXT,
        "test_chat_completion_stream": TEXT,
        "test_chat_completion_with_openai_library": TEXT,
        "test_chat_template": VERBOSE,
        "test_chat_template_assistant_prefill": VERBOSE,
        "test_chat_template_continue_final_message_vllm_compat": VERBOSE,
        "test_chat_template_continue_final_message_mutual_exclusion": OFFER + " (continue_final_message)",
        "test_apply_chat_template": TEXT + " (command-r's)",
        "test_logit_bias": OFFER + " (logit_bias)",
        "test_return_progress": OFFER + " (return_progress, prompt_progress events)",
        "test_chat_completions_token_count": OFFER + " (/chat/completions/input_tokens)",
        "test_verbose_debug": VERBOSE,
    },
    "test_tokenize.py": {
        "test_tokenize_with_bos": TEXT + " (BOS id 1: Clover's tokenizer adds no BOS)",
    },
    "test_security.py": {
        "test_access_static_assets_without_api_key": OFFER + " (llama.cpp's web UI files)",
        "test_correct_api_key": NATIVE,
        "test_correct_api_key_anthropic_header": NATIVE,
        "test_cors_origins_localhost_reflects": OFFER + " (router mode, --cors-origins)",
        "test_cors_origins_localhost_rejects": OFFER + " (router mode, --cors-origins)",
        "test_cors_origins_defaults_to_localhost_with_tools_enabled": OFFER + " (router mode, built-in tools)",
        "test_cors_proxy_only_forwards_explicit_proxy_headers": OFFER + " (the web UI's MCP proxy)",
        "test_local_media_file": OFFER + " (vision, --media-path)",
    },
    "test_basic.py": {
        "test_server_multiple_addresses": OFFER + " (several --host addresses)",
        "test_server_slots": OFFER + " (llama-server's /slots fields and its 501 without --slots)",
        "test_load_split_model": DOWNLOAD,
        "test_no_ui": OFFER + " (llama.cpp's web UI, --no-ui)",
        "test_server_model_aliases_and_tags": OFFER + " (--alias lists, --tags)",
    },
    "test_tool_call.py": {
        "test_completion_with_required_tool_real_model": DOWNLOAD,
        "test_completion_without_tool_call_slow": DOWNLOAD + " (slow: real models)",
        "test_weather": DOWNLOAD,
        "test_calc_result": DOWNLOAD,
        "test_thoughts": DOWNLOAD,
        "test_hello_world": DOWNLOAD,
    },
}


def _no_downloads() -> None:
    """utils.py imports wget (not installed here, and nothing may be downloaded): a stand-in that refuses."""
    if "wget" not in sys.modules:
        stub = types.ModuleType("wget")

        def download(*_a, **_k):
            raise RuntimeError("peer_suite: no downloads")

        stub.download = download
        sys.modules["wget"] = stub


_no_downloads()


def left_out(file: str, name: str) -> str | None:
    """Why the test `name` (without its parameters) of `file` is not run, or None when it is."""
    if file not in FILES:
        return "not in the files peer_suite runs"
    return LEFT_OUT.get(file, {}).get(name)


def pytest_collection_modifyitems(session, config, items) -> None:
    utils = sys.modules.get("utils")
    if utils is not None:  # conftest's session fixture would start every preset once, to download its model
        utils.ServerPreset.load_all = staticmethod(lambda: None)
    for item in items:
        file = os.path.basename(str(item.fspath))
        why = left_out(file, getattr(item, "originalname", None) or item.name)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))


_results: dict[str, dict] = {}


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry = {"outcome": report.outcome}
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2].removeprefix("Skipped: ")
        elif report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["why"] = (crash.message if crash is not None else report.longreprtext or "").strip()
            entry["why"] = entry["why"].splitlines()[0][:300] if entry["why"] else ""
        _results[report.nodeid] = entry


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get("PEER_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
