"""The mount configuration: one frozen, validated object built by the CLI (or by Python callers).

Everything a daemon needs to know is here; nothing reads argv or the environment after this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A bad option value. The CLI prints it as one line and exits with EXIT_USAGE."""


def default_cache_dir() -> Path:
    """Where the cache lives when --cache-dir is not given: the node's cache directory."""
    if os.getuid() == 0:
        return Path("/var/cache/ckptfs")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptfs"


def runtime_dir() -> Path:
    """Where running daemons register themselves (mount point -> pid, cache dir)."""
    if os.getuid() == 0:
        return Path("/run/ckptfs")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "ckptfs" if xdg else Path(f"/tmp/ckptfs-{os.getuid()}")


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    cache_dir: Path
    foreground: bool = False
    log_file: Path | None = None
    log_level: str = "info"
    # Kernel attribute/entry cache lifetime. All changes on this node go through the kernel,
    # which updates its cache itself, so this only bounds how long a change made behind the
    # kernel's back could stay invisible.
    attr_timeout: float = 10.0
    # direct_io on write opens (see docs/ARCHITECTURE.md for the measurements behind it).
    direct_io_writes: bool = True
    # Kernel writeback cache (off by default; measured in docs/ARCHITECTURE.md).
    writeback_cache: bool = False
    # 0: blocking file I/O inline on the event loop (default, measured fastest); N > 0: data
    # reads and writes in up to N worker threads.
    io_threads: int = 0
    # Kernel readahead for the mount's backing device; 0 leaves the kernel default (128 KiB).
    read_ahead_kb: int = 1024
    allow_other: bool = os.getuid() == 0

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if not (0 <= self.attr_timeout <= 3600):
            raise ConfigError("--attr-timeout must be between 0 and 3600 seconds")
        if not (0 <= self.io_threads <= 64):
            raise ConfigError("--io-threads must be between 0 and 64")
        if not (0 <= self.read_ahead_kb <= 65536):
            raise ConfigError("--read-ahead-kb must be between 0 and 65536")

    @property
    def effective_log_file(self) -> Path | None:
        if self.log_file is not None:
            return self.log_file
        return None if self.foreground else self.cache_dir / "ckptfs.log"
