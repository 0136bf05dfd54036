"""A small byte-level BPE tokenizer in the Qwen format (tokenizer.json), trained here on a built-in corpus.

The pre-tokenizer regex is the one llama.cpp uses for `tokenizer.ggml.pre = qwen35`, so llama.cpp and the HF
tokenizer split text identically.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

# Qwen3.5's pre-tokenizer pattern as llama.cpp spells it for LLAMA_VOCAB_PRE_TYPE_QWEN35.
QWEN35_PRETOKENIZE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # control tokens
THINK_TOKENS = ["<think>", "</think>"]  # added, not special (as in Qwen3)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif -%}\n"
    "{%- endif -%}\n"
)

DEFAULT_CORPUS = """\
<|im_start|>user
Count from 3 to 9.<|im_end|>
<|im_start|>assistant
<think>
Counting up.
</think>

3 4 5 6 7 8 9<|im_end|>
<|im_start|>user
What is 123 + 456?<|im_end|>
<|im_start|>assistant
<think>
Adding the numbers.
</think>

The answer is 579.<|im_end|>
Reverse the string: hello world. Copy the string: abc def. Recall the key: apple -> red, sky -> blue.
The quick brown fox jumps over the lazy dog. She said it's what we'll do; they're here, I'm sure you've seen it.
user assistant system answer question count from to numbers letters string reverse copy key value recall think
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


# A close-enough splitter for training merges (the tokenizer itself applies the exact regex above).
_TRAIN_SPLIT = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+")


def exact_pieces(text: str) -> list[str]:
    """`text` split by the tokenizer's own pre-tokenizer regex (QWEN35_PRETOKENIZE_REGEX, in HF tokenizers' engine):
    the pieces BPE merges apply within."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated")
    return [p for p, _ in split.pre_tokenize_str(text)]


def train_bpe(corpus: str, n_merges: int, exact_split: bool = False) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Plain BPE over byte-level words: repeatedly merge the most frequent adjacent pair (ties: first seen).

    exact_split: words as the tokenizer's regex splits them (exact_pieces), so merges can span what it keeps
    together ("<tool", "_call", ">\\n"); else the close-enough _TRAIN_SPLIT (the bundled model's tokenizer)."""
    b2u = bytes_to_unicode()
    for tok in SPECIAL_TOKENS + THINK_TOKENS:  # matched before the split: never part of a word
        corpus = corpus.replace(tok, "\n" if exact_split else " ")
    pieces = exact_pieces(corpus) if exact_split else _TRAIN_SPLIT.findall(corpus)
    words = collections.Counter(tuple(b2u[b] for b in piece.encode("utf-8")) for piece in pieces)
    vocab = {b2u[b]: i for i, b in enumerate(sorted(b2u))}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: kv[1])[0]
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        merged = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return vocab, merges


def grow_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], n_vocab: int) -> None:
    """Add merges (in place) until the BPE vocabulary has n_vocab entries: a real-sized vocabulary for load-time and
    memory figures. Each new token is an existing word-like token (a lowercase run, with or without the leading
    space byte) plus one lowercase letter, breadth first ("Ġa".."Ġz", "aa".."zz", "Ġaa", ...), so every merge's
    parts and result are in the vocabulary, as HF tokenizers and llama.cpp require. They rank after the trained
    merges, so the trained ones still apply first."""
    b2u = bytes_to_unicode()
    space, letters = b2u[ord(" ")], [b2u[b] for b in range(ord("a"), ord("z") + 1)]

    def add(a: str, b: str) -> str:
        if a + b not in vocab and len(vocab) < n_vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
        return a + b

    queue = collections.deque([add(space, c) for c in letters] + letters)
    while len(vocab) < n_vocab:
        word = queue.popleft()
        queue.extend(add(word, c) for c in letters)


def write_tokenizer(out: Path, corpus: str = DEFAULT_CORPUS, n_merges: int = 200, n_tokens: int | None = None,
                    template: str = CHAT_TEMPLATE, exact_split: bool = False) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (`template`); return the special token ids.

    n_tokens: grow the vocabulary (grow_bpe) so that BPE tokens plus the added tokens number n_tokens.
    exact_split: merges trained on the tokenizer's own pieces (train_bpe)."""
    vocab, merges = train_bpe(corpus, n_merges, exact_split)
    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    if n_tokens is not None:
        if n_tokens < len(vocab) + n_added:
            raise ValueError(f"a tokenizer of {n_tokens} tokens is smaller than the trained one "
                             f"({len(vocab) + n_added})")
        grow_bpe(vocab, merges, n_tokens - n_added)
    added = []
    ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + THINK_TOKENS:
        ids[tok] = len(vocab) + len(added)
        added.append({"id": ids[tok], "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": tok in SPECIAL_TOKENS})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_PRETOKENIZE_REGEX}, "behavior": "Isolated",
             "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in merges]},
    }
    out = Path(out)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "errors": "replace",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "chat_template.jinja").write_text(template)
    return ids
