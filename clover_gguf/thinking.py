"""Where the model's thinking ends and its answer begins: the one splitter of `<think>` text, streamed or whole.

The rule, for every caller (runtime, server, chat, the tiny model's trainer):
- a thinking span is open after `<think>` until the next `</think>`; the tags themselves are never shown;
- whether a span is open when the answer starts comes from the prompt's tokens (`prompt_opens_thinking`: its last
  `<think>` is not closed, as when a chat template starts the thinking for the model), so `plan</think>answer`
  after such a prompt is ("plan", "answer") wherever it is parsed;
- a caller that has only the text (no prompt) passes thinking_at_start=None: the text before the first tag is
  held back until a tag decides it (a `</think>` first: it was thinking), else it is answer. Streaming callers always
  know the prompt, so they never hold back more than a possible partial tag;
- with the prompt known, a `</think>` while no span is open closes nothing and is dropped;
- each channel (thinking, answer) loses its leading and trailing whitespace, as str.strip on the joined text;
- stop strings (the server's `stop`) are matched in the answer only and end it; the stop string is not returned;
- under a grammar (reopen=False: the server's constrained answers) the answer's text, once it has begun, is all
  answer: a tag there is text the grammar took (a JSON string may hold `<think>`), never a span, so the answer is
  exactly what the grammar accepted. A thinking span before the answer is still one.
"""

from __future__ import annotations

from typing import Sequence

from clover_gguf.controls import thinking_span

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
TAGS = (OPEN_TAG, CLOSE_TAG)


def prompt_opens_thinking(prompt_ids: Sequence[int], think_id: int | None, think_end_id: int | None) -> bool:
    """True when the prompt leaves a <think> span open: its last <think> is not followed by </think>."""
    if think_id is None or think_end_id is None:
        return False
    return thinking_span(prompt_ids, think_id, think_end_id, False) is not None


class _Strip:
    """Streams text with the leading and trailing whitespace of the whole removed (str.strip on the join)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.started = not enabled
        self.pending = ""

    def feed(self, s: str) -> str:
        if not self.enabled:
            return s
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        s = self.pending + s
        kept = s.rstrip()
        self.pending = s[len(kept):]
        return kept


def _partial_suffix(text: str, needles: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning (not the whole) of one of `needles`."""
    best = 0
    for n in needles:
        for k in range(min(len(n) - 1, len(text)), best, -1):
            if text.endswith(n[:k]):
                best = k
                break
    return best


class ThinkSplitter:
    """Streamed raw model text -> (thinking delta, answer delta) pairs, by the rule in the module docstring.

    thinking_at_start: True/False from prompt_opens_thinking, None when the prompt is unknown.
    tags=False passes the text through as it comes (no tags, no stripping): raw completions, where only stop
    strings apply. reopen=False: once the answer has begun, tags are its text (module docstring). Text that could
    be the start of a tag or a stop string is held back until it is decided."""

    def __init__(self, thinking_at_start: bool | None = False, stop: Sequence[str] = (), tags: bool = True,
                 reopen: bool = True):
        self.tags = tags
        self.reopen = reopen
        self.answered = False  # answer text other than whitespace has come
        self.inside = tags and bool(thinking_at_start)
        self.undecided = tags and thinking_at_start is None
        self.stop = [s for s in stop if s]
        self.stopped = False
        self.matched: str | None = None
        self._buf = ""  # raw text held back: a possible partial tag (all of it while undecided)
        self._held = ""  # answer held back as a possible partial stop string
        self._strip_t, self._strip_a = _Strip(tags), _Strip(tags)
        self._out_t: list[str] = []
        self._out_a: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        if not self.stopped:
            if not self.tags:
                self._answer(text)
            else:
                self._buf += text
                self._split(final=False)
        return self._take()

    def close(self) -> tuple[str, str]:
        """End of the answer: release everything held back (partial tags are plain text after all)."""
        if not self.stopped:
            if self.tags:
                self._split(final=True)
            if not self.stopped and self._held:
                self._out_a.append(self._strip_a.feed(self._held))
                self._held = ""
        return self._take()

    def _take(self) -> tuple[str, str]:
        t, a = "".join(self._out_t), "".join(self._out_a)
        self._out_t.clear()
        self._out_a.clear()
        return t, a

    def _split(self, final: bool) -> None:
        while self._buf and not self.stopped:
            if self.answered and not self.reopen and not self.inside:  # the answer has begun: the rest is its text
                self._route(self._buf)
                self._buf = ""
                return
            hits = [(i, t) for t in TAGS if (i := self._buf.find(t)) >= 0]
            if not hits:
                if self.undecided and not final:
                    return  # wait for a tag (or the end) to say what this text is
                keep = 0 if final else _partial_suffix(self._buf, TAGS)
                self._route(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            i, tag = min(hits)
            if self.undecided:  # a </think> before any <think>: what came before was thinking
                self.inside, self.undecided = tag == CLOSE_TAG, False
            self._route(self._buf[:i])
            self._buf = self._buf[i:]
            if self.answered and not self.reopen and not self.inside:
                continue  # the answer began before this tag: it is the answer's text (the loop's first test)
            self.inside = tag == OPEN_TAG
            self._buf = self._buf[len(tag):]

    def _route(self, s: str) -> None:
        if not s:
            return
        if self.inside:
            self._out_t.append(self._strip_t.feed(s))
        else:
            self.answered = self.answered or bool(s.strip())
            self._answer(s)

    def _answer(self, s: str) -> None:
        if not self.stop:
            self._out_a.append(self._strip_a.feed(s))
            return
        self._held += s
        hits = [(i, st) for st in self.stop if (i := self._held.find(st)) >= 0]
        if hits:
            i, st = min(hits)
            self._out_a.append(self._strip_a.feed(self._held[:i]))
            self._held, self.stopped, self.matched = "", True, st
            return
        keep = _partial_suffix(self._held, self.stop)
        self._out_a.append(self._strip_a.feed(self._held[:len(self._held) - keep]))
        self._held = self._held[len(self._held) - keep:]


def split_thinking(raw: str, thinking_at_start: bool | None = None) -> tuple[str, str]:
    """-> (thinking, answer) of a whole text: ThinkSplitter fed at once."""
    s = ThinkSplitter(thinking_at_start)
    t1, a1 = s.feed(raw)
    t2, a2 = s.close()
    return t1 + t2, a1 + a2
