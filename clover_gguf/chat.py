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
from clover_gguf.runtime import CloverRuntime, RunStats
from clover_gguf.thinking import ThinkSplitter

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingRenderer:
    """Prints the (thinking, answer) pieces of a ThinkSplitter: thinking dimmed (tty) or dropped (hidden), then a
    newline and the answer. The tags never show: the splitter removed them."""

    def __init__(self, out: TextIO, show_thinking: bool, color: bool):
        self.out, self.show, self.color = out, show_thinking, color
        self.thought = False  # some thinking was printed, so the answer starts on a new line

    def write(self, thinking: str, answer: str) -> None:
        if thinking and self.show:
            self.out.write(f"{DIM}{thinking}{RESET}" if self.color else thinking)
            self.thought = True
        if answer:
            if self.thought:
                self.out.write("\n")
                self.thought = False
            self.out.write(answer)
        self.out.flush()


class ChatSession:
    def __init__(self, model: Path, mode: str | None = None, max_new_tokens: int = 1024, think: bool = True,
                 show_thinking: bool = True, temp: float = 0.0, seed: int | None = None, n_ctx: int | None = None,
                 json_stats: bool = False, out: TextIO = sys.stdout, inp: TextIO = sys.stdin,
                 rollback: str = "redecode", offload: Offload | None = None, **runtime_kwargs):
        self.rt = CloverRuntime(model, n_ctx=n_ctx, rollback=rollback, offload=offload, **runtime_kwargs)
        mode = mode or self.rt.default_mode
        self.mode, self.max_new_tokens, self.think, self.show_thinking = mode, max_new_tokens, think, show_thinking
        self.temp, self.seed, self.json_stats = temp, seed, json_stats
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
                if note := self.rt.reading_note(self.mode):
                    self.say(f"({note})")
        elif cmd == "/stats":
            self.say(self.stats_line() if self.last else "(no answer yet)")
        else:
            self.say("(commands: /reset, /mode ar|diffusion|draft-self, /stats, /quit)")
        return True

    def stats_line(self) -> str:
        """The last answer's stats: RunStats.summary (as `generate --stats` prints it), or its JSON."""
        return json.dumps(self.last.to_json()) if self.json_stats else f"({self.last.summary()})"

    def answer(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        color = hasattr(self.out, "isatty") and self.out.isatty()
        view = ThinkingRenderer(self.out, self.show_thinking, color)
        answer: list[str] = []
        self.last = None
        try:
            ids = self.rt.prompt_ids(self.messages, think=self.think)
            split = ThinkSplitter(self.rt.thinking_at_start(ids))
            for piece, stats in self.rt.stream_ids(ids, mode=self.mode, max_new_tokens=self.max_new_tokens,
                                                   temp=self.temp, seed=self.seed):
                self.last = stats
                thinking, said = split.feed(piece)
                answer.append(said)
                view.write(thinking, said)
        except KeyboardInterrupt:
            self.say("\n(stopped)")
        except UserError as e:
            self.messages.pop()
            self.say(f"error: {e}")
            return
        else:
            thinking, said = split.close()
            answer.append(said)
            view.write(thinking, said)
            self.say()
        if self.last is not None:
            self.say(self.stats_line())
        self.messages.append({"role": "assistant", "content": "".join(answer)})

    def loop(self) -> None:
        self.say(f"clover-gguf chat: {self.rt.path.name}, mode {self.mode}. /reset /mode /stats /quit")
        if note := self.rt.reading_note(self.mode):
            self.say(f"({note})")
        try:
            while True:
                try:
                    self.out.write("> ")
                    self.out.flush()
                    line = self.inp.readline()
                except KeyboardInterrupt:
                    self.say()
                    continue
                except UnicodeDecodeError:  # the terminal sent bytes that are not UTF-8
                    self.say("error: that line is not UTF-8 text")
                    continue
                if not line:  # Ctrl-D / end of input: end the prompt's line, then leave
                    self.say()
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
