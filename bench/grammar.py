"""The grammar engine for constrained output (issue 49 item 2), measured at the 35B's vocabulary (V = 248,320):
xgrammar against llguidance, the two engines on the registry made for token masks with rollback.

    python bench/grammar.py [--workdir out/bench-grammar] [--vocab-size 248320] [--rounds 5] [--threads 2]
        [--engines xgrammar,llguidance] [--json]

1. The vocabulary: a byte-level BPE of V - 243 tokens (make_tiny's UNUSED_VOCAB_ROWS: the rows past the tokenizer
   stay empty, as in Qwen's checkpoints), trained here with HF tokenizers on 100 MB of this Python installation's
   text (its .py, .md, .txt, .json, .rst files: code and prose, as an agent writes), split by the Qwen3.5
   pre-tokenizer, plus the tiny Clover's control and think tokens; made once in the work folder. A grown list of
   lowercase runs (make_tiny's grow_bpe) would flatter every engine: a real vocabulary has punctuation, quotes,
   newlines and digits in its tokens, which is what a grammar's mask must sort out.
2. Three grammars in the forms serve compiles (clover_gguf.grammar): `response_format` json_schema (a nested object:
   strings, an integer, a number, a boolean, an enum, an array of strings, an object), the same after a thinking
   span of 13 lines of prose (thinking on, as Clover answers by default: "think+json"), and `tool_choice: required`
   over three tools in Clover's tool-call format (Qwen3.5's `<tool_call>` / `<function=..>` / `<parameter=..>`):
   a thinking span, then a write_file call whose content is 40 lines of Python, then a run call with an integer and
   an object. Each engine gets the grammar in its own language (llguidance: Lark with inline JSON schemas;
   xgrammar: a structural tag), both describing the same texts; llguidance runs as serve runs it
   (clover_gguf.grammar's Engine on the grammars clover_gguf.serve.tools writes).
3. Per engine and grammar, medians over --rounds:
   - setup: the engine's vocabulary object (once per model), compiling a grammar never seen (every round; serve
     keeps compiled grammars, so a grammar seen before costs a lookup), and a request's matcher;
   - mask per token: the answer's tokens in order, a mask before each (then the token accepted): mean, median,
     90th percentile and most, in ms;
   - draft verification (the decoders' draft-self and auto): from every 32nd position, a mask, then 32 times (accept
     the drafted token, a mask), then a rollback of 32: ms per verification (33 masks, 32 accepts, one rollback).
   Masks are written into one int32 bitmask of ceil(V / 32) words, the layout clover_gguf.constraint takes.
4. Forced tokens (issue 54 item 3): how many of each answer's tokens the grammar forces at this vocabulary (llguidance's
   fast-forward tokens at each state along the answer): the passes an AR decode saves on it.
Figures are printed (and written to WORKDIR/grammar.json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from clover_gguf.testing.make_tiny import UNUSED_VOCAB_ROWS  # noqa: E402
from clover_gguf.testing.tokenizer import (QWEN35_PRETOKENIZE_REGEX, SPECIAL_TOKENS, THINK_TOKENS,  # noqa: E402
                                           bytes_to_unicode)
from measure import at_least  # noqa: E402

CORPUS_BYTES = 100 * 2**20
DRAFT = 32
TEXT_SUFFIXES = (".py", ".md", ".txt", ".json", ".rst")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "email", "score", "active", "role", "tags", "address", "bio"],
    "additionalProperties": False,
}
ANSWER_JSON = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@analytical-engine.org", "score": 97.25, "active": True,
    "role": "editor", "tags": ["mathematics", "computing", "poetry", "Babbage"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "bio": "Wrote the first published algorithm for Charles Babbage's Analytical Engine (1843), with notes that "
           "looked past calculation: \"the engine might compose elaborate pieces of music\".",
}

TOOLS = [
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"enum": ["w", "a"]}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout": {"type": "integer"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a place",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
            "required": ["location"]}}},
]
CODE = '''\
"""Count the words of a text file, most frequent first."""

import collections
import re
import sys


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def main(path: str, top: int = 10) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            counts = collections.Counter(words(f.read()))
    except OSError as e:
        print(f"cannot read {path}: {e}", file=sys.stderr)
        return 2
    width = max((len(w) for w, _ in counts.most_common(top)), default=0)
    for word, n in counts.most_common(top):
        print(f"{word:<{width}}  {n:>6}")
    total = sum(counts.values())
    print(f"{len(counts)} distinct words, {total} in all")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print("usage: wordcount.py FILE [TOP]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 10))
'''
PLAN = """\
The user asks for a record of Ada Lovelace in the schema they gave. Let me go through the fields one by one.

Name: Ada Lovelace (born Augusta Ada Byron, 10 December 1815; died 27 November 1852), so she was 36.
Email: the schema wants a string; there is no real address, so I will make up a plausible one and keep it short.
Score: a number; 97.25 is fine. Active: true. Role: one of admin, editor, viewer -- "editor" fits best, since she
annotated (and greatly extended) Menabrea's paper rather than writing the engine's design herself.

Tags: at most 8 strings. mathematics, computing, poetry ("poetical science" was her phrase), Babbage.
Address: St James's Square, London -- she lived at number 12 for some years; zip as a UK postcode, SW1Y 4JH.

Bio: one or two sentences. Note G (the Bernoulli numbers program) is the famous part; her remark that the
engine "might compose elaborate and scientific pieces of music" is a nice quote to include. Keep the quotes
escaped in JSON. Check: every required field present, no extra ones. Done.
"""
THINKING = ("The user wants a word counter. I will write it to wordcount.py, then run it on the README to check "
            "that it works, with a timeout so that a hang does not block us.\n")
ANSWER_TOOLS = (
    f"{THINKING}</think>\n\n"
    "<tool_call>\n<function=write_file>\n<parameter=path>\nwordcount.py\n</parameter>\n"
    f"<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=run>\n<parameter=command>\npython wordcount.py README.md 5\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n"
    '<parameter=env>\n{"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"}\n</parameter>\n</function>\n</tool_call>'
)


# ---- the vocabulary ------------------------------------------------------------------------------------------
def corpus(limit: int) -> list[str]:
    """About `limit` characters of this Python installation's text files, in a stable order."""
    roots = [Path(sys.base_prefix) / "lib", Path(sys.prefix) / "lib"]
    texts, total = [], 0
    for root in dict.fromkeys(roots):
        for p in sorted(root.rglob("*")):
            if p.suffix not in TEXT_SUFFIXES or not p.is_file():
                continue
            try:
                t = p.read_text("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(t)
            total += len(t)
            if total >= limit:
                return texts
    return texts


def vocabulary(wd: Path, vocab_size: int) -> tuple[list[bytes], dict[str, int], object]:
    """-> (token bytes for every id of the model's vocabulary, the special ids, the HF tokenizer). Control tokens
    are marked with a leading 0xFF byte (never text); rows past the tokenizer are b""."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    n_tokens = vocab_size - UNUSED_VOCAB_ROWS
    added = SPECIAL_TOKENS + THINK_TOKENS
    path = wd / f"bpe-{n_tokens}.json"
    if not path.is_file():
        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=n_tokens, special_tokens=added, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus(CORPUS_BYTES), trainer)
        wd.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
        print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - t0:.0f} s -> {path}",
              file=sys.stderr)
    tok = Tokenizer.from_file(str(path))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens = [b""] * vocab_size
    special = {}
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if text in added:
            special[text] = i
            tokens[i] = (b"\xff" if text in SPECIAL_TOKENS else b"") + text.encode()
        else:
            tokens[i] = bytes(byte_of[c] for c in text)
    return tokens, special, tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# ---- the engines ----------------------------------------------------------------------------------------------
class LLGuidance:
    """llguidance 1.9.1 as serve runs it: clover_gguf.grammar's Engine on the grammars serve writes."""

    name = "llguidance"

    def __init__(self, tokens, special, tok, threads):
        from clover_gguf import grammar

        self.g = grammar
        marked = [grammar.CONTROL + t[1:] if t.startswith(b"\xff") else t for t in tokens]
        self.engine = grammar.Engine(grammar.Vocabulary(marked, (special["<|im_end|>"],), lambda s: encode(tok, s)))

    def grammar(self, kind: str) -> str:
        from clover_gguf.serve import tools

        g = self.g
        if kind != "tool_calls":
            return g.source(f"body: {g.json_value(SCHEMA)}\n", thinking="open" if kind == "think+json" else "none")
        return g.source(tools.calls_rules(tools.read_tools(TOOLS), None, parallel=True), thinking="open")

    def compile(self, source: str):
        self.engine._compiled.clear()  # each round compiles (a grammar never seen)
        return self.engine.compile(source)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask) -> None:
        self.engine.llg.numpy.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, t) -> bool:
        return m.consume_token(t)

    def rollback(self, m, n) -> None:
        m.rollback(n)


class XGrammar:
    """xgrammar 0.2.8 (`pip install xgrammar==0.2.8`: it brings torch and, on Linux, triton) on a structural tag of
    the same texts: the thinking span and string values as any_text up to their end tag, JSON as xgrammar's compact
    JSON grammar, the rest as sequences, options and alternatives of constant strings."""

    name = "xgrammar"

    def __init__(self, tokens, special, tok, threads):
        import xgrammar

        self.xgr = xgrammar
        raw = [b"" if t.startswith(b"\xff") else t for t in tokens]  # control tokens: never text
        info = xgrammar.TokenizerInfo(raw, xgrammar.VocabType.RAW, vocab_size=len(tokens),
                                      stop_token_ids=[special["<|im_end|>"]])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def json(self, schema) -> dict:
        ebnf = self.xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return {"type": "grammar", "grammar": str(ebnf)}

    def grammar(self, kind: str) -> dict:
        def const(v):
            return {"type": "const_string", "value": v}

        def seq(*xs):
            return {"type": "sequence", "elements": list(xs)}

        think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
        gap = {"type": "regex", "pattern": r"[ \t\r\n]{0,4}"}
        if kind != "tool_calls":
            body = self.json(SCHEMA)
            return {"type": "structural_tag", "format": seq(think, gap, body) if kind == "think+json" else body}

        def param(key, schema, required):
            if "enum" in schema:
                values = {"type": "or", "elements": [const(v) for v in schema["enum"]]}
                body = seq(const(f"<parameter={key}>\n"), values, const("\n</parameter>\n"))
            elif schema.get("type") == "string":
                body = seq({"type": "tag", "begin": f"<parameter={key}>\n", "content": {"type": "any_text"},
                            "end": "</parameter>"}, const("\n"))
            else:
                body = seq(const(f"<parameter={key}>\n"), self.json(schema), const("\n</parameter>\n"))
            return body if required else {"type": "optional", "content": body}

        calls = []
        for tool in TOOLS:
            f = tool["function"]
            props, req = f["parameters"]["properties"], set(f["parameters"].get("required", []))
            calls.append(seq(const(f"<tool_call>\n<function={f['name']}>\n"),
                             *[param(k, v, k in req) for k, v in props.items()], const("</function>\n</tool_call>")))
        call = {"type": "or", "elements": calls}
        return {"type": "structural_tag",
                "format": seq(think, gap, call, {"type": "star", "content": seq(const("\n"), call)})}

    def compile(self, source):
        return self.compiler.compile_structural_tag(json.dumps(source))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, t) -> bool:
        return m.accept_token(t)

    def rollback(self, m, n) -> None:
        m.rollback(n)


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar}


# ---- the measurements -----------------------------------------------------------------------------------------
def walk(engine, m, ids: list[int], bitmask) -> list[float]:
    """Seconds of each mask along the answer (a mask, then its token accepted)."""
    out = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        engine.fill(m, bitmask)
        out.append(time.perf_counter() - t0)
        if not (bitmask[0, t >> 5] >> (t & 31)) & 1 or not engine.accept(m, t):
            raise SystemExit(f"{engine.name}: token {i} ({t}) of the answer is refused")
    return out


def verifications(engine, compiled, ids: list[int], bitmask) -> list[float]:
    """Seconds per draft verification from every DRAFT-th position: a mask, then DRAFT x (accept, mask), rollback."""
    m = engine.matcher(compiled)
    out = []
    for start in range(0, len(ids) - DRAFT, DRAFT):
        t0 = time.perf_counter()
        engine.fill(m, bitmask)
        for t in ids[start:start + DRAFT]:
            engine.accept(m, t)
            engine.fill(m, bitmask)
        engine.rollback(m, DRAFT)
        out.append(time.perf_counter() - t0)
        for t in ids[start:start + DRAFT]:  # on to the next block's start
            engine.accept(m, t)
    return out


def forced_share(engine, compiled, ids: list[int]) -> dict | None:
    """How many of the answer's tokens the grammar forces (llguidance's fast-forward tokens, what the decoders place
    without a pass: docs/runtime.md, "Forced tokens"): positions whose state forces a token, and of them the ones
    where the answer's own token is another (a tokenization the forcing would not give); None for an engine without
    them."""
    m = engine.matcher(compiled)
    if not hasattr(m, "compute_ff_tokens"):
        return None
    forced = other = 0
    for t in ids:
        ff = [] if m.is_accepting() else m.compute_ff_tokens()
        if ff:
            forced += 1
            other += ff[0] != t
        engine.accept(m, t)
    return {"forced": forced, "other": other}


def ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean": 1e3 * statistics.fmean(xs), "median": 1e3 * statistics.median(xs),
            "p90": 1e3 * xs[int(0.9 * (len(xs) - 1))], "max": 1e3 * xs[-1], "n": len(xs)}


def bench(engine_cls, tokens, special, tok, rounds: int, threads: int) -> dict:
    t0 = time.perf_counter()
    engine = engine_cls(tokens, special, tok, threads)
    out = {"vocabulary_s": time.perf_counter() - t0, "grammars": {}}
    bitmask = np.zeros((1, -(-len(tokens) // 32)), dtype=np.int32)
    answers = (("json_schema", json.dumps(ANSWER_JSON, ensure_ascii=False)),
               ("think+json", PLAN + "</think>\n\n" + json.dumps(ANSWER_JSON, ensure_ascii=False)),
               ("tool_calls", ANSWER_TOOLS))
    for kind, text in answers:
        ids = encode(tok, text)
        source = engine.grammar(kind)
        rows = []
        for r in range(rounds):
            t0 = time.perf_counter()
            compiled = engine.compile(source)
            t1 = time.perf_counter()
            m = engine.matcher(compiled)
            t2 = time.perf_counter()
            per_token = walk(engine, m, ids, bitmask)
            rows.append({"compile_ms": 1e3 * (t1 - t0), "matcher_ms": 1e3 * (t2 - t1), "mask": ms(per_token),
                         "answer_ms": 1e3 * sum(per_token),
                         "verify": ms(verifications(engine, compiled, ids, bitmask))})
            print(f"  {engine.name} {kind} round {r + 1}/{rounds}: mask mean {rows[-1]['mask']['mean']:.3f} ms, "
                  f"verification mean {rows[-1]['verify']['mean']:.2f} ms", file=sys.stderr, flush=True)
        med = lambda f: statistics.median(f(x) for x in rows)  # noqa: E731
        out["grammars"][kind] = {
            "tokens": len(ids), "rounds": rows, "forced": forced_share(engine, engine.compile(source), ids),
            "median": {"compile_ms": med(lambda x: x["compile_ms"]), "matcher_ms": med(lambda x: x["matcher_ms"]),
                       "mask_mean_ms": med(lambda x: x["mask"]["mean"]),
                       "mask_median_ms": med(lambda x: x["mask"]["median"]),
                       "mask_p90_ms": med(lambda x: x["mask"]["p90"]), "mask_max_ms": med(lambda x: x["mask"]["max"]),
                       "answer_ms": med(lambda x: x["answer_ms"]),
                       "verify_mean_ms": med(lambda x: x["verify"]["mean"]),
                       "verify_max_ms": med(lambda x: x["verify"]["max"])}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-grammar")
    ap.add_argument("--vocab-size", type=at_least(UNUSED_VOCAB_ROWS + 512), default=248_320)
    ap.add_argument("--rounds", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(1), default=2, help="xgrammar's compiler threads")
    ap.add_argument("--engines", default="llguidance,xgrammar", help="xgrammar: when installed")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    # before the minute of BPE training
    unknown = [e for e in a.engines.split(",") if e not in ENGINES]
    if unknown or not a.engines.strip(","):
        ap.error(f"--engines: {', '.join(unknown) or 'none given'}: choose from {', '.join(ENGINES)}")
    if a.workdir.exists() and not a.workdir.is_dir():
        ap.error(f"--workdir: {a.workdir} is not a folder")
    tokens, special, tok = vocabulary(a.workdir, a.vocab_size)
    results = {"vocab_size": a.vocab_size, "tokens": a.vocab_size - UNUSED_VOCAB_ROWS, "engines": {}}
    for name in a.engines.split(","):
        try:
            results["engines"][name] = bench(ENGINES[name], tokens, special, tok, a.rounds, a.threads)
        except ImportError as e:
            print(f"{name}: not installed ({e}), left out", file=sys.stderr)
    (a.workdir / "grammar.json").write_text(json.dumps(results, indent=1) + "\n")
    if a.json:
        print(json.dumps(results, indent=1))
        return
    print(f"V = {a.vocab_size} ({results['tokens']} BPE tokens); medians of {a.rounds} rounds, ms")
    print(f"{'engine':<11} {'grammar':<12} {'tokens':>6} {'vocab':>7} {'compile':>8} {'matcher':>7} "
          f"{'mask mean':>9} {'median':>7} {'p90':>6} {'max':>6} {'answer':>7} {'verify 32':>9} {'max':>6}")
    for name, e in results["engines"].items():
        for kind, g in e["grammars"].items():
            w = g["median"]
            print(f"{name:<11} {kind:<12} {g['tokens']:>6} {1e3 * e['vocabulary_s']:7.0f} {w['compile_ms']:8.2f} "
                  f"{w['matcher_ms']:7.3f} {w['mask_mean_ms']:9.4f} {w['mask_median_ms']:7.4f} {w['mask_p90_ms']:6.3f} "
                  f"{w['mask_max_ms']:6.2f} {w['answer_ms']:7.1f} {w['verify_mean_ms']:9.3f} {w['verify_max_ms']:6.2f}")
    print("\ntokens the grammar forces (placed without a pass by the decoders; 'other': the answer's own token differs "
          "from the forced one there):")
    for name, e in results["engines"].items():
        for kind, g in e["grammars"].items():
            if g.get("forced"):
                f = g["forced"]
                print(f"{name:<11} {kind:<12} {f['forced']:>4} of {g['tokens']:>4} tokens "
                      f"({f['forced'] / g['tokens']:.0%}), other {f['other']}")
    print(f"\nfigures in {a.workdir / 'grammar.json'}")


if __name__ == "__main__":
    main()
