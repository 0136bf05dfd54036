"""A slot handed to a waiting request whose client leaves in the same moment comes back (issue 68, cause 1).

A finished request passes its slot straight to the oldest waiter's future (serve.slots._FreeSlots.put_nowait). If that
waiter's task is cancelled (its client went: Watch gives up) before it runs again, the task ends cancelled with the
slot in its future: the slot was lost, /health counted one idle slot fewer than /slots showed, and once both were lost
every later request waited forever."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from clover_gguf.serve.slots import Pool

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from clover_gguf.serve import create_app  # noqa: E402
from test_server import SlowRuntime, _Server  # noqa: E402


def test_a_waiter_cancelled_as_it_is_handed_the_slot_gives_it_back():
    """The pool-level sequence: acquire, a second acquire waiting, release (the waiter's future gets the slot),
    cancel the waiter before it runs: the slot is free again, not lost with the cancelled task."""

    async def sequence() -> tuple[int, int]:
        pool = Pool([SlowRuntime()])
        try:
            rt = await pool.acquire()
            waiter = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0)  # it waits now
            assert not waiter.done() and pool.idle == 0
            pool.release(rt)  # handed to the waiter's future ...
            waiter.cancel()  # ... whose client leaves in the same loop turn
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            idle = pool.idle
            third = await asyncio.wait_for(pool.acquire(), 5)  # and the next request gets it
            return idle, int(third is rt)
        finally:
            pool.close()

    assert asyncio.run(sequence()) == (1, 1)


def test_a_waiter_cancelled_before_it_is_handed_the_slot_leaves_the_queue():
    """The other order (cancelled, then a release): the slot skips the gone waiter and stays free."""

    async def sequence() -> int:
        pool = Pool([SlowRuntime()])
        try:
            rt = await pool.acquire()
            waiter = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0)
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            pool.release(rt)
            return pool.idle
        finally:
            pool.close()

    assert asyncio.run(sequence()) == 1


class QuickRuntime(SlowRuntime):
    """One word per millisecond: slots change hands often while the waiting clients leave."""

    step_s = 0.001


async def _leave_unread(base: str, n: int, after: float, max_tokens: int) -> None:
    """n streamed requests at once, none read, all closed `after` seconds later (some by then run, most wait)."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        responses = []

        async def open_one(i: int) -> None:
            req = client.build_request("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"go {i}"}], "max_tokens": max_tokens, "stream": True})
            with contextlib.suppress(httpx.HTTPError):
                responses.append(await client.send(req, stream=True))

        openers = [asyncio.ensure_future(open_one(i)) for i in range(n)]
        await asyncio.sleep(after)
        for o in openers:  # those still waiting for their headers (a request waits for a slot before answering)
            o.cancel()
        for r in responses:
            await r.aclose()
        await asyncio.gather(*openers, return_exceptions=True)


def test_streams_left_unread_and_closed_lose_no_slot():
    """The server-level sequence of the issue: two slots, rounds of 40 streamed requests left unread and closed
    together; afterwards /health's idle count and /slots agree that both slots are idle, and a normal request is
    answered (before the fix /health said fewer idle slots than /slots showed, and with both lost a request waited
    forever)."""
    rts: list[SlowRuntime] = []

    def factory():
        rts.append(QuickRuntime())
        return rts[-1]

    s = _Server(create_app(factory, mode="ar", parallel=2))
    try:
        for k in range(6):
            asyncio.run(_leave_unread(s.base, 40, 0.3 + 0.1 * k, 3000))
        deadline = time.monotonic() + 30
        while True:  # every worker has stopped: /slots shows both idle (a hang guard, not a timing)
            slots = httpx.get(s.base + "/slots", timeout=10).json()
            health = s.health()
            if (all(x["state"] == "idle" for x in slots) and health["requests_waiting"] == 0
                    and health["slots_idle"] == 2) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [x["state"] for x in slots] == ["idle", "idle"]
        assert (health["slots_idle"], health["requests_waiting"]) == (2, 0), health
        r = httpx.post(s.base + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "again"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok tok"
    finally:
        s.stop()
