"""Upload work at idle priority (cachemgr.host.background): the calling thread is at SCHED_IDLE and
IOPRIO_CLASS_IDLE for the call and back to what it was after it, also when the call raises (trio
reuses worker threads: the next job on the same thread must not inherit the priority)."""

from __future__ import annotations

import os

import pytest
import trio

from cachemgr.host import background

IDLE_IO = 3 << 13  # IOPRIO_CLASS_IDLE, level 0


def current() -> tuple[int, int | None]:
    """(scheduling policy, I/O priority) of the calling thread."""
    return os.sched_getscheduler(0), background._ioprio_get()


def test_run_idle_lowers_the_thread_for_the_call_and_restores_it():
    if not background.enabled():
        pytest.skip("idle priority needs root (the daemon then runs uploads at normal priority)")
    before = current()
    seen = background.run_idle(current)
    assert seen == (os.SCHED_IDLE, IDLE_IO)
    assert current() == before

    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError):
        background.run_idle(boom)
    assert current() == before


def test_a_reused_trio_worker_thread_is_back_to_normal_priority():
    if not background.enabled():
        pytest.skip("idle priority needs root")

    async def main() -> list:
        out = []
        limiter = trio.CapacityLimiter(1)  # one worker thread, reused
        out.append(await trio.to_thread.run_sync(background.run_idle, current,
                                                 limiter=limiter))
        out.append(await trio.to_thread.run_sync(current, limiter=limiter))
        return out

    idle, after = trio.run(main)
    assert idle[0] == os.SCHED_IDLE and idle[1] == IDLE_IO
    assert after[0] == os.SCHED_OTHER and after[1] != IDLE_IO


def test_a_nested_run_idle_switches_nothing_and_the_outer_one_restores():
    """A small file's whole staging runs in one run_idle (cachemgr.store.local `stage_path`),
    and the copy, CRC and sample inside it call run_idle again: those find the thread idle
    already, switch nothing, and leave the restore to the outer call."""
    if not background.enabled():
        pytest.skip("idle priority needs root")
    before = current()

    def inner() -> tuple:
        return background.run_idle(current), current()

    inside, after_inner = background.run_idle(inner)
    assert inside == after_inner == (os.SCHED_IDLE, IDLE_IO)
    assert current() == before
