"""llama.cpp's own server tests, run against `clover-gguf serve` and llama-server side by side on the same GGUFs.

    python bench/peer_suite.py [--workdir out/peer-suite] [--only serve|llama-server] [-k EXPR]

The tests are tools/server/tests of the pinned sdist (clover_gguf.llama_sdist; extracted into the workdir on each
run, never copied into this repository), pytest, whose utils.ServerProcess starts $LLAMA_SERVER_BIN_PATH with
llama-server's command-line arguments. That path is a wrapper (this file with --wrap) that starts, on local files
(no download: the suite's presets name Hugging Face repos):
- the server under test: `clover-gguf serve` (PEER_TARGET=serve) or the cached build's llama-server;
- the bundled model (clover_gguf/assets/tiny-clover) as an F32 GGUF, or the tool model where the test's alias says
  tool calls (test_tool_call.py);
- with what the arguments say that both servers have (host, port, context, slots, API key, reasoning); each one's
  chat template is the GGUF's (a test's --chat-template / --chat-template-file names a template of another model).
llama-server on this model's template does not think unless asked (it turns thinking on only for templates it
knows), so serve gets --reasoning off unless the test asks for reasoning: the same prompt for both.
bench/peer_plugin.py picks the tests and says why the others are left out, the same for both servers. The table:
per file, the tests run, what each server passes, and every test one passes and the other does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ("llama-server", "serve")
TESTS = "tools/server/tests/"
TOOL_ALIAS = "tool-call"  # test_tool_call.py's preset alias is tinyllama-2-tool-call


# ---- the wrapper: llama-server's arguments -> the server under test -------------------------------------------------
def _parse_server_args(argv: list[str]) -> dict:
    """The llama-server options the suite passes that matter here (utils.ServerProcess.start), by their long names."""
    flags = {"--jinja", "--no-jinja", "--slots", "--no-slots", "--offline", "--metrics", "--verbose", "--cont-batching",
             "--embedding", "--reranking", "--kv-unified", "--swa-full", "--no-ui", "--context-shift",
             "--no-models-autoload", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling"}
    out: dict = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in flags:
            out[a] = True
            i += 1
        else:
            out[a] = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
    return out


def server_command(argv: list[str], target: str, env: dict) -> list[str]:
    """The command line that serves what the suite's arguments ask, on our files, for `target`."""
    a = _parse_server_args(argv)
    alias = a.get("--alias") or ""
    model = env["PEER_TOOL_GGUF"] if TOOL_ALIAS in alias else env["PEER_BUNDLED_GGUF"]
    n_slots = int(a.get("--parallel") or 1)
    n_ctx = int(a.get("--ctx-size") or 0)
    host, port = a.get("--host", "127.0.0.1"), a.get("--port", "8080")
    if target == "llama-server":
        cmd = [env["PEER_LLAMA_SERVER"], "-m", model, "--host", host, "--port", port, "--jinja", "--no-warmup",
               "-t", "2", "--parallel", str(n_slots)]
        for opt in ("--ctx-size", "--batch-size", "--ubatch-size", "--n-predict", "--api-key", "--alias", "--temp",
                    "--seed", "--reasoning-format", "--reasoning", "--cors-origins"):
            if opt in a:
                cmd += [opt, a[opt]]
        cmd += [f for f in ("--slots", "--no-slots", "--metrics", "--verbose") if f in a]
        return cmd
    cmd = [sys.executable, "-m", "clover_gguf", "serve", model, "--host", host, "--port", port, "--threads", "2",
           "--parallel", str(n_slots), "--reasoning", a.get("--reasoning", "off")]
    if n_ctx:  # llama-server's --ctx-size is shared by its slots; serve's --ctx is per slot
        cmd += ["--ctx", str(max(16, n_ctx // n_slots))]
    for opt in ("--api-key", "--alias", "--seed"):
        if opt in a:
            cmd += [opt, a[opt]]
    return cmd


def wrap(argv: list[str]) -> int:
    cmd = server_command(argv, os.environ["PEER_TARGET"], dict(os.environ))
    os.execvp(cmd[0], cmd)  # the suite terminates this process: it must be the server itself


# ---- the run -------------------------------------------------------------------------------------------------------
def extract_tests(workdir: Path) -> Path:
    """tools/server/tests (and the templates its tests name) of the pinned sdist, fresh in workdir/llama.cpp."""
    from clover_gguf.build import writable_cache_root
    from clover_gguf.llama_sdist import PINNED, fetch_sdist

    sdist = fetch_sdist(writable_cache_root() / "sdist", quiet=True)
    tree = workdir / "llama.cpp"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(PINNED.vendor_prefix):] if m.name.startswith(PINNED.vendor_prefix) else None
            if rel and (rel.startswith(TESTS) or rel.startswith("models/templates/")) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(tree, members=members, filter="data")
    return tree / TESTS


def models(workdir: Path) -> tuple[Path, Path]:
    """The bundled model and the tool model as F32 GGUFs (converted once per workdir)."""
    from clover_gguf.convert import convert
    from clover_gguf.testing.agent import TOOL_MODEL

    out = []
    for src, name in ((ROOT / "clover_gguf" / "assets" / "tiny-clover", "tiny-clover.gguf"),
                      (TOOL_MODEL, "tiny-clover-tools.gguf")):
        path = workdir / name
        if not path.exists():
            convert(src, path, outtype="f32", quiet=True)
        out.append(path)
    return out[0], out[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_suite(target: str, tests: Path, workdir: Path, bundled: Path, tool: Path, extra: list[str]) -> dict:
    from clover_gguf.build import llama_tool

    wrapper = workdir / "server-wrapper"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --wrap \"$@\"\n")
    wrapper.chmod(0o755)
    results = workdir / f"results-{target}.json"
    results.unlink(missing_ok=True)
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(wrapper), PEER_TARGET=target, PEER_RESULTS=str(results),
               PEER_BUNDLED_GGUF=str(bundled), PEER_TOOL_GGUF=str(tool), PEER_LLAMA_SERVER=str(llama_tool("llama-server")),
               PORT=str(free_port()), LLAMA_CACHE=str(workdir / "llama-cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    files = [str(tests / "unit" / f) for f in __import__("peer_plugin").FILES]
    log = workdir / f"pytest-{target}.log"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "pytest", "-p", "peer_plugin", "-p", "no:cacheprovider", "-q", "-rN",
                        *files, *extra], cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not results.exists():
        raise SystemExit(f"the suite wrote no results for {target}: see {log}")
    return json.loads(results.read_text())


def table(res: dict[str, dict]) -> str:
    """Per file and in total: tests run (not left out) and what each server passes; then the differences and the
    tests left out with their reasons."""
    ids = sorted(set().union(*[set(r) for r in res.values()]))
    run = [i for i in ids if any(r.get(i, {}).get("outcome") != "skipped" for r in res.values())]
    files = sorted({i.split("::")[0].split("/")[-1] for i in ids})
    lines = ["| file | tests run | " + " | ".join(f"{t} passes" for t in res) + " |",
             "|---|---|" + "---|" * len(res)]
    totals = [0] * (1 + len(res))
    for f in files:
        mine = [i for i in run if i.split("::")[0].endswith(f)]
        if not mine:
            continue
        counts = [len(mine)] + [sum(r.get(i, {}).get("outcome") == "passed" for i in mine) for r in res.values()]
        totals = [a + b for a, b in zip(totals, counts)]
        lines.append(f"| {f} | " + " | ".join(map(str, counts)) + " |")
    lines.append("| **total** | " + " | ".join(f"**{c}**" for c in totals) + " |")
    names = list(res)
    if len(names) == 2:
        for a, b in (names, names[::-1]):
            diff = [i for i in run if res[a].get(i, {}).get("outcome") == "passed"
                    and res[b].get(i, {}).get("outcome") != "passed"]
            if diff:
                lines.append(f"\n{a} passes, {b} does not:")
                lines += [f"- {i.split('::', 1)[1]}: {res[b].get(i, {}).get('why', res[b].get(i, {}).get('outcome'))}"
                          for i in diff]
    reasons: dict[str, list[str]] = {}
    first = next(iter(res.values()))
    for i in ids:
        if i not in run and first.get(i, {}).get("reason"):
            reasons.setdefault(first[i]["reason"], []).append(i.split("::", 1)[1].split("[")[0])
    lines.append("\nleft out (the same for both):")
    for why, tests in sorted(reasons.items()):
        uniq = sorted(set(tests))
        lines.append(f"- {why}: {len(tests)} tests ({', '.join(uniq)})")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--wrap":
        sys.exit(wrap(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "peer-suite")
    ap.add_argument("--only", choices=TARGETS, help="run one server only")
    ap.add_argument("-k", dest="keyword", help="pytest -k: a subset of the tests")
    ap.add_argument("--json", action="store_true", help="print the outcomes as JSON too")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    tests = extract_tests(args.workdir)
    bundled, tool = models(args.workdir)
    extra = ["-k", args.keyword] if args.keyword else []
    res = {t: run_suite(t, tests, args.workdir, bundled, tool, extra) for t in TARGETS if args.only in (None, t)}
    print(table(res))
    if args.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
