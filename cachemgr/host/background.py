"""Upload work at idle priority: the trainer gets the CPU and the cache disk first.

`run_idle(fn, *args)` is what a trio worker thread runs for an upload's reading, CRC32C and
compression (cachemgr.transfer.upload): for the length of the call the thread is at `SCHED_IDLE`
(it runs only on a CPU nothing else wants) and `IOPRIO_CLASS_IDLE` (its reads of the cache disk go
when nothing else reads or writes it), then back to what it was. Both are per thread on Linux,
and trio reuses its worker threads, so the restore matters: an fsync must not inherit an
upload's priority.

Lowering is always allowed; going back from `SCHED_IDLE` needs CAP_SYS_NICE. A daemon that is
not root keeps every thread at normal priority (`enabled()` is False, said once in the log);
the store still gets every byte either way, only later when the trainer is busy.

State: `_ENABLED` is decided once at import and never changes (read by any thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# ioprio_set/ioprio_get (linux/ioprio.h); the syscall numbers of the architectures we run on.
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}
_IOPRIO_WHO_PROCESS = 1          # with id 0: the calling thread
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_IDLE = 3
_IDLE_IOPRIO = _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT

_libc = ctypes.CDLL(None, use_errno=True)
_ioprio = _IOPRIO_SYSCALLS.get(platform.machine())
_ENABLED = os.geteuid() == 0 and hasattr(os, "SCHED_IDLE")


def enabled() -> bool:
    """Whether upload threads run at idle priority (root only: see the module docstring)."""
    return _ENABLED


def _ioprio_get() -> int | None:
    if _ioprio is None:
        return None
    r = _libc.syscall(_ioprio[1], _IOPRIO_WHO_PROCESS, 0)
    return None if r < 0 else int(r)


def _ioprio_set(value: int) -> None:
    if _ioprio is not None:
        _libc.syscall(_ioprio[0], _IOPRIO_WHO_PROCESS, 0, value)


def run_idle(fn: Callable[..., _T], *args: object, cpu: bool = True) -> _T:
    """`fn(*args)` on this (worker) thread at idle CPU and I/O priority, restored after.
    `cpu=False`: idle I/O priority only, for a thread that reads the cache disk for an upload
    but whose CPU work is the network's (sendfile: cachemgr.store.plainhttp), which stays at
    normal CPU priority as the CRT's and boto3's senders' does (`idle_thread` says why)."""
    if not _ENABLED:
        return fn(*args)
    policy = os.sched_getscheduler(0)
    if policy == os.SCHED_IDLE:
        # Already idle (a call inside another run_idle: a small file's whole staging,
        # cachemgr.store.local `stage_path`): nothing to switch, and nothing to restore; each
        # switch is a chance for the kernel to park the thread behind every runnable one.
        return fn(*args)
    param = os.sched_getparam(0)
    io = _ioprio_get()
    try:
        if cpu:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _ioprio_set(_IDLE_IOPRIO)
    except OSError as e:  # a seccomp profile, a container without the syscall
        log.debug("cannot lower this upload thread's priority: %s", e)
    try:
        return fn(*args)
    finally:
        if cpu:
            os.sched_setscheduler(0, policy, param)
        if io is not None:
            _ioprio_set(io)


def idle_thread(tid: int, cpu: bool = True) -> None:
    """Thread `tid` of this process at idle I/O priority (and, with `cpu`, idle CPU priority)
    for good: for a native library's worker threads that do only upload work
    (cachemgr.store.crt's upload client), which no `run_idle` call wraps. Root only, like
    `run_idle`; failures are logged at debug."""
    if not _ENABLED:
        return
    try:
        if cpu:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        if _ioprio is not None:
            _libc.syscall(_ioprio[0], _IOPRIO_WHO_PROCESS, tid, _IDLE_IOPRIO)
    except OSError as e:
        log.debug("cannot lower thread %d's priority: %s", tid, e)
