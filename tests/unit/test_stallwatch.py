"""The loop-stall watchdog (ckptfs/stallwatch.py): a blocked trio loop is logged with the code
it is in, once per stall, and the stall's length when it ends."""

from __future__ import annotations

import logging
import threading

import trio

from ckptfs.stallwatch import LoopStats, StallWatch


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []
        self.stalled = threading.Event()
        self.recovered = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.records.append(msg)
        if "stalled" in msg:
            self.stalled.set()
        if "ran again" in msg:
            self.recovered.set()


def test_a_blocked_loop_is_logged_with_its_stack_and_its_length():
    sw = StallWatch(threshold=0.2, period=0.02)
    seen = _Seen()
    logger = logging.getLogger("ckptfs.stallwatch")
    logger.addHandler(seen)
    try:
        def blocking_call_on_the_loop() -> None:
            # blocks the loop thread until the watchdog has reported it: gated, not timed
            assert seen.stalled.wait(20), "the watchdog never reported the blocked loop"

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(sw.beat)
                sw.start()
                assert sw.statistics().stalls == 0
                blocking_call_on_the_loop()
                assert await trio.to_thread.run_sync(seen.recovered.wait, 20), \
                    "the end of the stall was never reported"
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        sw.stop()
        logger.removeHandler(seen)
    stalled = [m for m in seen.records if "stalled" in m]
    assert len(stalled) == 1, seen.records          # one line per stall, not one per check
    assert "blocking_call_on_the_loop" in stalled[0]  # where the loop was
    st = sw.statistics()
    assert st.stalls == 1
    assert st.longest_s >= 0.2
    assert st.stalled_now_s == 0


def test_a_loop_that_turns_is_never_reported():
    now = [0.0]
    sw = StallWatch(threshold=2.0, period=0.5, clock=lambda: now[0])
    for _ in range(20):      # the loop stamps every period; the watchdog checks in between
        now[0] += 0.5
        sw._beat = now[0]
        sw.check()
    assert sw.statistics() == LoopStats(stalls=0, longest_s=0.0, stalled_now_s=0.0)
    now[0] += 3.0            # no stamp for 3 s
    sw.check()
    assert sw.statistics().stalls == 1 and sw.statistics().stalled_now_s == 3.0
    sw.check()               # still the same stall
    assert sw.statistics().stalls == 1


def test_a_long_stall_dumps_every_thread_s_stack_into_the_log_file(tmp_path):
    """A loop that makes no turn for `dump_after` s gets every thread's stack dumped into the
    log file by faulthandler's C thread (no GIL needed: the watchdog thread cannot log while
    another thread holds the GIL), naming the code the loop was in; a loop that turns never
    dumps (the dump is re-armed at every stamp)."""
    import subprocess
    import sys

    log_file = tmp_path / "daemon.log"
    prog = f"""
import logging, time, trio
from ckptfs.stallwatch import StallWatch
logging.getLogger().addHandler(logging.FileHandler({str(log_file)!r}))
sw = StallWatch(threshold=5.0, period=0.05, dump_after=0.5)

def blocking_call_holding_the_loop():
    time.sleep(1.5)

async def main():
    async with trio.open_nursery() as nursery:
        await nursery.start(sw.beat)
        sw.start()                          # the watchdog thread arms the dump, as the daemon's
        await trio.sleep(1.0)               # turning: no dump
        logging.getLogger().warning("turned")
        blocking_call_holding_the_loop()    # no turn for 1.5 s: a dump after 0.5 s
        nursery.cancel_scope.cancel()
trio.run(main)
sw.stop()
"""
    res = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    text = log_file.read_text()
    before, _, after = text.partition("turned")
    assert "most recent call first" not in before, text
    assert "most recent call first" in after, text
    assert "blocking_call_holding_the_loop" in after, text


_CAUSE_PROG = """
import logging, sys, threading, time, trio
from ckptfs.stallwatch import StallWatch
logging.basicConfig(filename={log!r}, level=logging.INFO,
                    format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
sw = StallWatch(threshold=0.2, period=0.02, dump_after=0.3)

def stalled_for(s):
    return sw.statistics().stalled_now_s >= s

def spinning_on_the_loop():
    # computes on the loop thread until it has had 0.6 s of CPU and the watchdog saw the stall
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.6 or not stalled_for(0.3):
        pass

def sleeping_on_the_loop():
    # a blocking call on the loop thread, until the stall is 0.6 s long (the watchdog's clock)
    while not stalled_for(0.6):
        threading.Event().wait(0.01)

async def main():
    async with trio.open_nursery() as nursery:
        await nursery.start(sw.beat)
        sw.start()
        await trio.sleep(0.2)
        {call}()
        while sw.statistics().stalled_now_s:     # until the watchdog logged the stall's end
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
trio.run(main)
sw.stop()
"""


def _run_stall(tmp_path, call: str):
    import subprocess
    import sys

    from ckptfs.stallwatch import parse_log

    log_file = tmp_path / f"{call}.log"
    res = subprocess.run([sys.executable, "-c", _CAUSE_PROG.format(log=str(log_file), call=call)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = log_file.read_text()
    stalls, unended = parse_log(text)
    assert len(stalls) == 1 and not unended, text
    return stalls[0], text


def test_a_stall_says_its_cause_and_its_dump_names_the_loop_thread_s_code(tmp_path):
    """The end of a stall says what the loop thread did (the kernel's counters): computing on
    the loop is `busy`, a blocking call on it `blocked`; the dump taken during it is parsed
    back (parse_log) with the loop thread's own stack, the code it was in."""
    busy, text = _run_stall(tmp_path, "spinning_on_the_loop")
    assert busy["cause"] == "busy", text
    assert busy["s"] >= 0.3
    assert "spinning_on_the_loop" in busy["loop_stacks"][0], text
    assert "ckptfs-stallwatch" not in busy["loop_stacks"][0]   # the loop thread's block only
    blocked, text = _run_stall(tmp_path, "sleeping_on_the_loop")
    assert blocked["cause"] == "blocked", text
    assert "sleeping_on_the_loop" in blocked["loop_stacks"][0], text


def test_cause_calls_starved_only_what_a_cpu_would_have_ended_within_the_threshold():
    from ckptfs.stallwatch import cause

    # 1.6 s window, 1.2 s of it runnable without a CPU: 0.4 s left, within 1 s
    assert cause(1.6, on_cpu_s=0.05, waiting_s=1.2, threshold=1.0) == "starved"
    # the same wait, but the loop also slept 1.1 s: the wait does not explain the stall
    assert cause(2.7, on_cpu_s=0.05, waiting_s=1.2, threshold=1.0) == "blocked"
    # 39 s: 10 s runnable, 29 s asleep while the machine's tasks stalled on memory 30 s
    assert cause(39.0, on_cpu_s=0.4, waiting_s=10.0, threshold=1.0, memory_s=30.0) == "memory"
    assert cause(39.0, on_cpu_s=0.4, waiting_s=10.0, threshold=1.0, memory_s=5.0) == "blocked"
    # the fault loop's 3.4 s: asleep waiting for the GIL while the process had 26 major page
    # faults (evicted pages read back) and the machine's tasks waited on I/O for most of it
    assert cause(4.3, on_cpu_s=0.03, waiting_s=0.51, threshold=1.0, memory_s=1.68, io_s=3.2,
                 majflt=26) == "memory"
    # the same I/O wait with no fault of its own: a blocking call on the loop, not the machine
    assert cause(4.3, on_cpu_s=0.03, waiting_s=0.51, threshold=1.0, memory_s=1.68, io_s=3.2,
                 majflt=0) == "blocked"
    # computing 1.5 s on a loaded machine is busy, whatever it waited besides
    assert cause(3.0, on_cpu_s=1.5, waiting_s=1.4, threshold=1.0) == "busy"


def test_the_thresholds_come_from_the_environment():
    from ckptfs.stallwatch import DEFAULT_THRESHOLD_S, DUMP_AFTER_S, from_env

    assert from_env({}) == (DEFAULT_THRESHOLD_S, DUMP_AFTER_S)
    assert from_env({"CKPTFS_STALL_S": "1", "CKPTFS_STALL_DUMP_S": "1.5"}) == (1.0, 1.5)
    assert from_env({"CKPTFS_STALL_S": "-1", "CKPTFS_STALL_DUMP_S": "x"}) == \
        (DEFAULT_THRESHOLD_S, DUMP_AFTER_S)


def test_the_loop_never_arms_the_dump_itself(monkeypatch):
    """Re-arming faulthandler's timer waits for its C thread to end: the watchdog thread does
    it, never the loop (a 1.3 s stall of a loop asleep in `dump_traceback_later` was seen)."""
    import faulthandler
    import logging
    import threading

    import trio

    from ckptfs.stallwatch import StallWatch

    armed_by: list[int] = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later",
                        lambda *a, **k: armed_by.append(threading.get_ident()))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: None)
    handler = logging.FileHandler("/dev/null")
    logging.getLogger().addHandler(handler)
    sw = StallWatch(threshold=5.0, period=0.01, dump_after=1.0)
    loop_thread: list[int] = []

    async def main():
        loop_thread.append(threading.get_ident())
        async with trio.open_nursery() as nursery:
            await nursery.start(sw.beat)
            sw.start()
            while len(armed_by) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        sw.stop()
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert len(armed_by) >= 3 and loop_thread[0] not in armed_by, (armed_by, loop_thread)
