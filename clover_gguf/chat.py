"""`clover-gguf chat`: a terminal chat on a Clover GGUF with the GGUF's chat template.

Text streams as tokens are accepted (in the block modes a block appears as it resolves); thinking is shown dimmed
(between `<think>` and `</think>` lines when the output is not a terminal) or hidden. Commands: /reset,
/mode auto|ar|diffusion|draft-self, /stats, /quit. Ctrl-C stops the current answer and keeps the program; Ctrl-D or
/quit leaves.

Ctrl-C is the chat's own (`loop` installs a SIGINT handler): at the prompt it drops the line being typed (a
KeyboardInterrupt raised there and only there); at any other moment it asks the answer under way to stop at its
next piece. So no Ctrl-C, however many and however close together, lands in the middle of the chat's own
bookkeeping (printing "(stopped)", the stats) and ends the program.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import TextIO

from clover_gguf.decoding import MODES
from clover_gguf.errors import UserError
from clover_gguf.offload import Offload
from clover_gguf.runtime import CloverRuntime, RunStats
from clover_gguf.thinking import CLOSE_TAG, OPEN_TAG, ThinkSplitter

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingRenderer:
    """Prints the (thinking, answer) pieces of a ThinkSplitter: thinking dimmed (a terminal), between `<think>` and
    `</think>` lines (piped: no dimming to tell it apart, so the model's own tags do, as `generate` prints them and
    thinking.split_thinking splits them), or dropped (hidden); then a newline and the answer."""

    def __init__(self, out: TextIO, show_thinking: bool, color: bool):
        self.out, self.show, self.color = out, show_thinking, color
        self.thought = False  # some thinking was printed, so the answer starts on a new line
        self.open = False  # piped: a <think> line was written and its </think> not yet

    def write(self, thinking: str, answer: str) -> None:
        if thinking and self.show:
            if self.color:
                self.out.write(f"{DIM}{thinking}{RESET}")
            else:
                self.out.write(thinking if self.open else f"{OPEN_TAG}\n{thinking}")
                self.open = True
            self.thought = True
        if answer:
            if self.thought:
                self.out.write(f"\n{CLOSE_TAG}\n\n" if self.open else "\n")
                self.thought = self.open = False
            self.out.write(answer)
        self.out.flush()

    def finish(self) -> None:
        """The answer is over: close a thinking span that no answer closed."""
        if self.open:
            self.out.write(f"\n{CLOSE_TAG}")
            self.out.flush()
            self.open = False


class ChatSession:
    def __init__(self, model: Path, mode: str | None = None, max_new_tokens: int = 1024, think: bool = True,
                 show_thinking: bool = True, temp: float = 0.0, seed: int | None = None, n_ctx: int | None = None,
                 json_stats: bool = False, out: TextIO | None = None, inp: TextIO | None = None,
                 rollback: str = "redecode", offload: Offload | None = None, runtime: CloverRuntime | None = None,
                 **runtime_kwargs):
        # each turn continues from the state kept after the previous turn's messages (docs/runtime.md, "Prefix reuse");
        # runtime: one already loaded (an mlx_runtime.MlxRuntime), used instead
        self.rt = runtime or CloverRuntime(model, n_ctx=n_ctx, rollback=rollback, offload=offload, keep_prefix=True,
                                           **runtime_kwargs)
        mode = mode or self.rt.default_mode
        self.mode, self.max_new_tokens, self.think, self.show_thinking = mode, max_new_tokens, think, show_thinking
        self.temp, self.seed, self.json_stats = temp, seed, json_stats
        # sys.stdout / sys.stdin as they are now, not when this module was imported (the CLI guards stdout)
        self.out, self.inp = out or sys.stdout, inp or sys.stdin
        self.messages: list[dict[str, str]] = []
        self.last: RunStats | None = None
        self._armed = False  # waiting for a line: a Ctrl-C raises KeyboardInterrupt (see the module docstring)
        self._stop = False  # a Ctrl-C came while not waiting for a line: the answer under way stops

    def _on_sigint(self, signum, frame) -> None:
        if self._armed:
            self._armed = False  # disarmed before raising: a second Ctrl-C cannot land in the handler's code
            raise KeyboardInterrupt
        self._stop = True

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
            self.rt.forget_prefix()
            self.say("(conversation cleared)")
        elif cmd == "/mode":
            if not arg.strip():
                self.say(f"(modes: {', '.join(MODES)}; now {self.mode})")
            elif arg.strip() not in MODES:
                self.say(f"(unknown mode {arg.strip()!r}: the modes are {', '.join(MODES)}; still {self.mode})")
            else:
                self.mode = arg.strip()
                self.say(f"(mode: {self.mode})")
                if note := self.rt.reading_note(self.mode):
                    self.say(f"({note})")
        elif cmd == "/stats":
            self.say(self.stats_line() if self.last else "(no answer yet)")
        else:
            self.say("(commands: /reset, /mode auto|ar|diffusion|draft-self, /stats, /quit)")
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
        self._stop = stopped = False
        try:
            ids, keep = self.rt.prompt_and_keep(self.messages, think=self.think)
            split = ThinkSplitter(self.rt.thinking_at_start(ids))
            pieces = self.rt.stream_ids(ids, mode=self.mode, max_new_tokens=self.max_new_tokens, temp=self.temp,
                                        seed=self.seed, keep=keep)
            try:
                for piece, stats in pieces:
                    self.last = stats
                    if self._stop:  # Ctrl-C (the handler of loop): nothing decoded after it is shown
                        stopped = True
                        break
                    thinking, said = split.feed(piece)
                    answer.append(said)
                    view.write(thinking, said)
            finally:
                pieces.close()
        except KeyboardInterrupt:  # Ctrl-C where loop's handler is not installed (a caller of answer alone)
            stopped = True
        except UserError as e:
            self.messages.pop()
            self.say(f"error: {e}")
            return
        if stopped:  # nothing after the Ctrl-C but this line (a thinking span stays open, as the model left it)
            self.say("\n(stopped)")
        else:
            thinking, said = split.close()
            answer.append(said)
            view.write(thinking, said)
            view.finish()
            self.say()
        if self.last is not None:
            self.say(self.stats_line())
        self.messages.append({"role": "assistant", "content": "".join(answer)})

    def _own_ctrl_c(self):
        """Install the chat's SIGINT handler (main thread only; a SIGINT the user had ignored stays ignored);
        -> what to restore."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        return signal.signal(signal.SIGINT, self._on_sigint)

    def loop(self) -> None:
        previous = self._own_ctrl_c()
        try:
            self.say(f"clover-gguf chat: {self.rt.path.name}, mode {self.mode}. /reset /mode /stats /quit")
            if note := self.rt.reading_note(self.mode):
                self.say(f"({note})")
            while True:
                try:
                    self._armed = True  # from here to the end of readline a Ctrl-C drops the line
                    self.out.write("> ")
                    self.out.flush()
                    line = self.inp.readline()
                    self._armed = False
                except KeyboardInterrupt:
                    self._armed = False
                    self.say()
                    continue
                except UnicodeDecodeError:  # the terminal sent bytes that are not UTF-8
                    self._armed = False
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
            self._armed = False
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            self.rt.close()
