"""Uploads give way to the trainer (cachemgr.host.foreground) for a time scaled to the bytes
they move next: under a trainer that never pauses, a part of 64 MiB waits the whole MAX_DEFER_S,
a 64 KiB file 1/1,024 of it, so small files keep pace with a writer instead of each waiting 2 s
(issue 35: an 8,192-shard DCP save uploaded nothing until its commit). Virtual time (trio's
MockClock, the Foreground's clock), so nothing here depends on the machine's speed."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from cachemgr.host import foreground
from cachemgr.host.foreground import DEFER_BYTES, MAX_DEFER_S, QUIET_S, Foreground


def _waits(nbytes_list: list[int | None], busy: bool) -> list[float]:
    """How long (virtual seconds) each `yield_to(nbytes)` waited, the trainer busy throughout
    (the probe says "written since last asked" every time) or quiet."""

    async def main() -> list[float]:
        await trio.sleep(1)  # the clock starts at 0, as does "the trainer's last I/O"
        fg = Foreground(lambda: busy, clock=trio.current_time)
        out = []
        for n in nbytes_list:
            start = trio.current_time()
            await fg.yield_to(n)
            out.append(trio.current_time() - start)
        return out

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_busy_trainer_holds_an_upload_for_a_time_scaled_to_its_bytes():
    small, part, big = 64 << 10, DEFER_BYTES, 4 * DEFER_BYTES
    waits = _waits([small, part, big, None, 0], busy=True)
    assert waits[0] == pytest.approx(MAX_DEFER_S * small / DEFER_BYTES)  # 2 ms
    assert waits[1] == pytest.approx(MAX_DEFER_S)
    assert waits[2] == pytest.approx(MAX_DEFER_S)  # capped: never longer than before
    assert waits[3] == pytest.approx(MAX_DEFER_S)  # no size: a whole wait, as before
    assert waits[4] == 0  # nothing to move: no wait


def test_a_quiet_trainer_holds_nothing():
    assert _waits([64 << 10, DEFER_BYTES, None], busy=False) == [0, 0, 0]


def test_the_wait_ends_once_the_trainer_pauses():
    """The trainer writes for 0.5 s more, then pauses: a whole-part wait ends QUIET_S after
    that, not at MAX_DEFER_S."""

    async def main() -> float:
        await trio.sleep(1)
        fg = Foreground(lambda: trio.current_time() < 1.5, clock=trio.current_time)
        await fg.yield_to(DEFER_BYTES)
        return trio.current_time() - 1

    waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 0.5 <= waited <= 0.5 + QUIET_S + 1e-9
    assert waited < foreground.MAX_DEFER_S
