"""Kept prompt states in host memory, for any slot of a server (llama-server's --cache-ram).

A slot keeps the state after its last conversation's messages and the state before its last prompt's last token
(runtime.LlamaBackend, "Prefix reuse" in docs/runtime.md). When the slot goes to another conversation, those states
would be lost; instead they are saved here (llama.cpp's state of one sequence: its KV cells and its recurrent state,
llama_state_seq_get_data) and a later request whose prompt starts with the tokens of one and goes on past them, on
whichever slot, restores the longest instead of prefilling those tokens again. Least recently used entries go first
once the byte budget is full."""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import numpy as np


# serve's default budget (--cache-ram, MiB): on the 35B a conversation's state is about 63 MiB of recurrent state (30
# GDN layers) plus 20 KiB per token of KV cells, so this holds about a dozen conversations of a few thousand tokens
DEFAULT_CACHE_RAM_MIB = 1024

State = bytes | np.ndarray  # a sequence's state as llama.cpp serializes it (LlamaContext.state_seq_get: uint8)


class StateCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[tuple[int, ...], State] = collections.OrderedDict()
        self.hits = 0  # prompts continued from an entry (/metrics)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tokens: Sequence[int], state: State) -> None:
        """Keep `state`, the state after `tokens` (replacing an older one); an entry larger than the whole budget is
        not kept."""
        key = tuple(int(t) for t in tokens)
        if not key or len(state) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= len(old)
            while self._items and self.bytes + len(state) > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.bytes -= len(dropped)
            self._items[key] = state
            self.bytes += len(state)

    def refresh(self, tokens: Sequence[int]) -> bool:
        """Whether the state after `tokens` is kept (it then becomes the most recently used): a slot dropping a state
        the cache already has need not read it out of llama.cpp again (a copy of all of it, while every slot waits)."""
        key = tuple(int(t) for t in tokens)
        with self._lock:
            if key not in self._items:
                return False
            self._items.move_to_end(key)
            return True

    def get(self, ids: Sequence[int]) -> tuple[list[int], State] | None:
        """The longest kept prefix of `ids` that `ids` goes on past -> (its tokens, its state), now the most recently
        used entry (it stays: two requests of one conversation may come at once); None: none."""
        ids = tuple(int(t) for t in ids)
        with self._lock:
            best = max((k for k in self._items if len(k) < len(ids) and ids[:len(k)] == k), key=len, default=None)
            if best is None:
                return None
            self._items.move_to_end(best)
            self.hits += 1
            return list(best), self._items[best]
