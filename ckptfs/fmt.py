"""Plain-text formatting of numbers for people, shared by the commands that draw with rich
(ckptfs/ui.py) and those that print plain lines (ckptfs/storetools.py). No rich, no state."""

from __future__ import annotations


def human(n: float) -> str:
    """A byte count: 512 B, 1.5 KiB, ..., 3.0 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def duration(s: float) -> str:
    """12s, 3m05s, 2h03m, 4d02h."""
    s = max(0, int(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
