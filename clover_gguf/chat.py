"""`clover-gguf chat`: a terminal chat on a Clover GGUF with the GGUF's chat template.

Text streams as tokens are accepted (in the block modes a block appears as it resolves); thinking is shown dimmed
or hidden. Commands: /reset, /mode ar|diffusion|draft-self, /stats, /quit. Ctrl-C stops the current answer and
keeps the program; Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from clover_gguf.decoding import MODES
from clover_gguf.errors import UserError
from clover_gguf.offload import Offload
from clover_gguf.runtime import CloverRuntime, RunStats, split_thinking

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingRenderer:
    """Prints streamed raw text, with <think>...</think> dimmed (tty) or dropped (hidden), tags never shown."""

    TAGS = ("<think>", "</think>")

    def __init__(self, out: TextIO, show_thinking: bool, color: bool, thinking_at_start: bool = False):
        self.out, self.show, self.color = out, show_thinking, color
        self.inside = thinking_at_start
        self.buf = ""

    def feed(self, text: str) -> None:
        self.buf += text
        while self.buf:
            tag_at = min((i for i in (self.buf.find(t) for t in self.TAGS) if i >= 0), default=-1)
            if tag_at < 0:
                # hold back what could be the start of a tag
                keep = max((k for k in range(1, 9) if any(t.startswith(self.buf[-k:]) for t in self.TAGS)
                            and k <= len(self.buf)), default=0)
                self._write(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            self._write(self.buf[:tag_at])
            tag = next(t for t in self.TAGS if self.buf.startswith(t, tag_at))
            self.inside = tag == "<think>"
            self.buf = self.buf[tag_at + len(tag):]

    def flush(self) -> None:
        self._write(self.buf)
        self.buf = ""

    def _write(self, s: str) -> None:
        if not s:
            return
        if self.inside:
            if not self.show:
                return
            s = f"{DIM}{s}{RESET}" if self.color else s
        self.out.write(s)
        self.out.flush()


class ChatSession:
    def __init__(self, model: Path, mode: str = "draft-self", max_new_tokens: int = 1024, think: bool = True,
                 show_thinking: bool = True, temp: float = 0.0, seed: int | None = None, n_ctx: int | None = None,
                 out: TextIO = sys.stdout, inp: TextIO = sys.stdin, rollback: str = "redecode",
                 offload: Offload | None = None):
        self.rt = CloverRuntime(model, n_ctx=n_ctx, rollback=rollback, offload=offload)
        self.mode, self.max_new_tokens, self.think, self.show_thinking = mode, max_new_tokens, think, show_thinking
        self.temp, self.seed = temp, seed
        self.out, self.inp = out, inp
        self.messages: list[dict[str, str]] = []
        self.last: RunStats | None = None

    def say(self, s: str = "") -> None:
        self.out.write(s + "\n")
        self.out.flush()

    def command(self, line: str) -> bool:
        """Handle a /command; False to quit."""
        cmd, _, arg = line.partition(" ")
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.messages.clear()
            self.say("(conversation cleared)")
        elif cmd == "/mode":
            if arg.strip() not in MODES:
                self.say(f"(modes: {', '.join(MODES)}; now {self.mode})")
            else:
                self.mode = arg.strip()
                self.say(f"(mode: {self.mode})")
        elif cmd == "/stats":
            self.say(json.dumps(self.last.__dict__) if self.last else "(no answer yet)")
        else:
            self.say("(commands: /reset, /mode ar|diffusion|draft-self, /stats, /quit)")
        return True

    def answer(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        color = hasattr(self.out, "isatty") and self.out.isatty()
        view = ThinkingRenderer(self.out, self.show_thinking, color)
        raw = ""
        try:
            for piece, stats in self.rt.stream(self.messages, mode=self.mode, max_new_tokens=self.max_new_tokens,
                                               temp=self.temp, seed=self.seed, think=self.think):
                raw += piece
                view.feed(piece)
                self.last = stats
        except KeyboardInterrupt:
            view.flush()
            self.say("\n(stopped)")
        except UserError as e:
            self.messages.pop()
            self.say(f"error: {e}")
            return
        else:
            view.flush()
            self.say()
        self.messages.append({"role": "assistant", "content": split_thinking(raw)[1]})

    def loop(self) -> None:
        self.say(f"clover-gguf chat: {self.rt.path.name}, mode {self.mode}. /reset /mode /stats /quit")
        try:
            while True:
                try:
                    self.out.write("> ")
                    self.out.flush()
                    line = self.inp.readline()
                except KeyboardInterrupt:
                    self.say()
                    continue
                if not line:  # Ctrl-D / end of input
                    break
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if not self.command(line):
                        break
                    continue
                self.answer(line)
        finally:
            self.rt.close()
