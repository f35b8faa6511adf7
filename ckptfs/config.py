"""The mount configuration: one frozen, validated object built by the CLI (or by Python callers).

Everything a daemon needs to know is here; nothing reads argv or the environment after this.

State: none that changes. A `MountConfig` is frozen and validated in `__post_init__`, so it is
shared freely (the daemon's main thread, the trio loop, worker threads) without a guard. The
module-level functions read the environment (uid, XDG_*) each time they are called.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cachemgr.format.validate import is_host

LOG_LEVELS = ("debug", "info", "warning", "error")
# --prefetch: the restore policies of cachemgr.restore.restorer (MODES there)
PREFETCH_MODES = ("auto", "set", "file", "reads", "none")


def _is_endpoint_url(url: str) -> bool:
    """http(s)://host[:port][/path]: what botocore takes as an endpoint (checked here so that a
    malformed value is a usage error, exit 2, not a store that fails at mount, exit 7)."""
    import urllib.parse

    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and not any(
        c.isspace() for c in url)


# (uid_t)-1 means "no change" to chown(2): no owner can be it.
ID_NONE = (1 << 32) - 1

# The AWS environment the S3 options fall back to (flag > environment > AWS config files), in
# the order each is looked at. botocore 1.44 reads AWS_ENDPOINT_URL[_S3], AWS_DEFAULT_REGION
# and AWS_PROFILE itself, but not AWS_REGION; ckptfs resolves the endpoint and the region here,
# once, so that the value is validated (exit 2), shown by `ckptfs status`, the same in the
# background daemon, and passed to boto3 explicitly (an explicit value is what boto3 uses: no
# variable is applied twice). The profile is left to boto3 (it reads AWS_PROFILE).
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
IGNORE_ENDPOINTS_ENV = "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"


def s3_from_env(endpoint_url: str | None, region: str | None,
                environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(endpoint URL, region): the flag's value, else the first AWS variable set (as boto3 and
    the AWS CLI order them; AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true ignores the endpoint
    variables, as boto3 does), else None (boto3 then reads the AWS config files)."""
    env = os.environ if environ is None else environ
    if endpoint_url is None and env.get(IGNORE_ENDPOINTS_ENV, "").lower() != "true":
        endpoint_url = next((env[k] for k in ENDPOINT_ENV if env.get(k)), None)
    if region is None:
        region = next((env[k] for k in REGION_ENV if env.get(k)), None)
    return endpoint_url, region


class ConfigError(ValueError):
    """A bad option value. The CLI prints it as one line and exits with EXIT_USAGE."""


def default_cache_dir() -> Path:
    """Where the cache lives when --cache-dir is not given: the node's cache directory."""
    if os.getuid() == 0:
        return Path("/var/cache/ckptfs")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptfs"


def default_store_url() -> str:
    """The embedded store used when --store is not given: a file:// store in the user's data
    directory (one per user, shared by that user's mounts, like one bucket)."""
    if os.getuid() == 0:
        return "file:///var/lib/ckptfs/store"
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return f"file://{base}/ckptfs/store"


def default_store_note() -> str:
    """What a mount on the default store says about it (success message and log line): the
    store is not private to the mount, so an operator should not assume it is."""
    who = ("every mount on this machine run as root" if os.getuid() == 0
           else "every mount of this user on this machine")
    return f"embedded default store, shared by {who} without --store"


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5T', '4096' -> bytes (binary units). Refuses anything that is not a
    finite number >= 0 ('nan', 'inf', '1e400' parse as floats, but are no size)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        v = float(t)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (e.g. 512M, 20G)") from None
    if not math.isfinite(v):
        raise ConfigError(f"not a size: {text!r} (must be a finite number, e.g. 512M, 20G)")
    if v < 0:
        raise ConfigError(f"size must be >= 0: {text!r}")
    return int(v * mult)


def parse_listen(text: str) -> tuple[str, int]:
    """--metrics: 'PORT' -> ('127.0.0.1', PORT) (loopback unless an address is given);
    'ADDR:PORT' with an IPv4 address or localhost; '[ADDR]:PORT' with an IPv6 address."""
    t = text.strip()
    host = "127.0.0.1"
    if t.startswith("["):
        inner, sep, rest = t[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"--metrics {text!r}: write an IPv6 address as [ADDR]:PORT")
        host, t = inner, rest[1:]
        _check_ip(host, text, version=6)
    elif ":" in t:
        host, _, t = t.rpartition(":")
        if not host:
            raise ConfigError(f"--metrics {text!r}: no address before ':' (0.0.0.0:PORT "
                              "listens on every interface)")
        if host != "localhost":
            _check_ip(host, text, version=4)
    if not (t.isascii() and t.isdigit()) or not (1 <= int(t) <= 65535):
        raise ConfigError(f"--metrics {text!r}: the port must be a number from 1 to 65535")
    return host, int(t)


def parse_peer_listen(text: str) -> tuple[str, int]:
    """--peer-listen: 'PORT' -> ('0.0.0.0', PORT) (every interface: other nodes connect);
    'ADDR:PORT' with an IPv4 address; port 0: one of the kernel's choice."""
    host, _, port = text.strip().rpartition(":")
    host = host or "0.0.0.0"  # the peer port is for other nodes: every interface
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(f"--peer-listen {text!r}: the address must be an IPv4 address") \
            from None
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--peer-listen {text!r}: the port must be a number from 0 to 65535")
    return host, int(port)


MAX_PEER_SEEDS = 64


def parse_peer_seeds(text: str) -> tuple[tuple[str, int], ...]:
    """--peer-seeds: 'HOST:PORT[,HOST:PORT...]' (a host name, an IPv4 address, or an IPv6
    address in brackets), at most MAX_PEER_SEEDS."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        host, _, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--peer-seeds {item!r}: not HOST:PORT")
        if not is_host(host):
            raise ConfigError(f"--peer-seeds {item!r}: {host!r} is not a host name or address")
        out.append((host, int(port)))
    if len(out) > MAX_PEER_SEEDS:
        raise ConfigError(f"--peer-seeds: at most {MAX_PEER_SEEDS} seeds (one name may "
                          "resolve to many addresses)")
    return tuple(out)


def primary_address() -> str:
    """The address other nodes reach this one at, when --peer-address is not given: the
    source address of a route to a public address (no packet is sent), else the host name's."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is asked
        addr: str = s.getsockname()[0]
        return addr
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    finally:
        s.close()


MAX_SECRET_BYTES = 4096
# Fewer bytes than this are refused: the HMAC of one captured request lets an eavesdropper try
# secrets offline, so the secret must not be guessable (32 random bytes: docs/SECURITY.md).
MIN_SECRET_BYTES = 16


def load_peer_secret(path: Path) -> bytes:
    """The shared secret of --peer-secret-file (surrounding whitespace stripped). ConfigError
    (exit 2, one line, never the secret) for a file that cannot be read, is readable by its
    group or others, is not a regular file, or is empty or shorter than MIN_SECRET_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError as e:
        raise ConfigError(f"--peer-secret-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--peer-secret-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"--peer-secret-file {path}: readable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    if not secret:
        raise ConfigError(f"--peer-secret-file {path}: empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"--peer-secret-file {path}: {len(secret)} bytes, fewer than "
                          f"{MIN_SECRET_BYTES} (an HMAC key that short can be guessed; use "
                          "head -c 32 /dev/urandom)")
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"--peer-secret-file {path}: over {MAX_SECRET_BYTES} bytes")
    return secret


def _check_ip(host: str, text: str, version: int) -> None:
    try:
        ok = ipaddress.ip_address(host).version == version
    except ValueError:
        ok = False
    if not ok:
        want = "an IPv6 address" if version == 6 else \
            "an IPv4 address or localhost (IPv6 as [ADDR]:PORT)"
        raise ConfigError(f"--metrics {text!r}: the address must be {want}")


# Where root daemons register (root-owned, 0755): the one registration directory every user
# trusts besides their own (docs/ARCHITECTURE.md "Control socket").
ROOT_RUNTIME_DIR = Path("/run/ckptfs")


def runtime_dir() -> Path:
    """Where this process's daemons register themselves (mount point -> pid, control socket):
    /run/ckptfs for root; else the user's private runtime dir ($XDG_RUNTIME_DIR/ckptfs, or
    /tmp/ckptfs-<uid>), which must be owned by the user with mode 0700 (checked by
    `ckptfs.mount.own_runtime_dir`)."""
    if os.getuid() == 0:
        return ROOT_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "ckptfs" if xdg else Path(f"/tmp/ckptfs-{os.getuid()}")


def user_runtime_dirs(uid: int) -> list[Path]:
    """Where a daemon of another (non-root) user `uid` registers if it runs with the usual
    environment: only root looks there (a user's runtime dir is private)."""
    return [Path(f"/run/user/{uid}/ckptfs"), Path(f"/tmp/ckptfs-{uid}")]


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
    # FUSE passthrough for files the cache holds whole (docs/ARCHITECTURE.md "Data path"): on
    # wherever it works; off, or where it cannot work, the daemon serves every byte.
    passthrough: bool = True
    # 0: blocking file I/O inline on the event loop (default, measured fastest); N > 0: data
    # reads and writes in up to N worker threads.
    io_threads: int = 0
    # Kernel readahead for the mount's backing device; 0 leaves the kernel default (128 KiB).
    read_ahead_kb: int = 1024
    # Who besides the mounting user may use the mount (FUSE allow_other / allow_root; a
    # non-root daemon needs `user_allow_other` in /etc/fuse.conf for either). None: allow_other
    # for a root daemon (its users are the trainers), else only the mounting user.
    allow_other: bool | None = None
    allow_root: bool = False
    # --uid / --gid: the owner every inode is reported with (and checked against by the kernel),
    # as with mount-s3; None: each inode's own (its creator's; the daemon's user for sets from
    # the store). Ownership changes to another id are refused (EPERM) while set.
    uid: int | None = None
    gid: int | None = None
    # --read-only: a ro kernel mount; every change is EROFS and nothing is written to the store.
    read_only: bool = False
    # -- tiering ---------------------------------------------------------------------------
    # s3://bucket/prefix or file:///dir; None: the embedded default, default_store_url().
    store: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = False
    s3_profile: str | None = None
    # --s3-transfer: auto (sendfile up over http://, else CRT up; boto3 down), crt (both),
    # boto3 (neither): S3Options.native/native_gets/plain_http
    s3_transfer: str = "auto"
    compress: str = "auto"
    # 64 MiB parts: measured ~120 MB/s to moto with 8 parts in flight, vs ~24 MB/s with 16 MiB
    # (ANCHORS.md); S3 allows 10,000 parts, so 64 MiB parts cap an object at 625 GiB.
    part_size: int = 64 << 20
    parts_in_flight: int = 8        # memory bound of uploads: part_size * parts_in_flight
    upload_files: int = 4           # files uploading at once
    cache_size: int | None = None   # bytes; None: bounded only by the cache disk
    keep_local: int | None = None   # keep only the newest N durable sets' data locally
    # Restore policy (cachemgr.restore.restorer, docs/ARCHITECTURE.md "Restore policy"): auto, set
    # (the whole set on open), file (the file opened), reads (read-ahead of sequential reads), none.
    prefetch: str = "auto"
    prefetch_concurrency: int = 8   # GETs in flight per prefetch (memory: x prefetch_range)
    prefetch_range: int = 64 << 20  # bytes per prefetch GET (docs/ARCHITECTURE.md: measured)
    refresh_interval: float = 10.0  # seconds between listings of the store's manifests
    commit_timeout: float = 1800.0  # a multi-node commit fails after waiting this long
    lease: float = 120.0            # a node not renewed for this long is gone (tiering.members)
    # Mount even when the store's sets cannot be listed (the namespace then holds only this
    # cache's sets until a listing succeeds); default: such a mount fails with exit 7.
    allow_empty_namespace: bool = False
    # Use a store whose conditional PUTs the mount's probe found ignored (last writer wins);
    # default: such a store fails the mount with exit 7 (docs/STORES.md).
    store_ignores_conditions: bool = False
    # --metrics [ADDR:]PORT: serve Prometheus metrics there (ckptfs.metrics); None: off.
    metrics: str | None = None
    # --peers: restore chunks from other nodes' caches and serve ours (docs/ARCHITECTURE.md
    # "Peers"); --peer-listen [ADDR:]PORT (None: 0.0.0.0, a port of the kernel's choice),
    # --peer-address (None: this host's primary address), --peer-secret-file (required).
    peers: bool = False
    peer_listen: str | None = None
    peer_address: str | None = None
    peer_secret_file: Path | None = None
    peer_seeds: str | None = None
    # --replicas K: buddies each committed set is copied to (None: 1 with --peers, else 0)
    replicas: int | None = None

    def __post_init__(self) -> None:
        if self.store is not None and not (self.store.startswith("s3://")
                                           or self.store.startswith("file:///")):
            raise ConfigError("--store must be s3://bucket[/prefix] or file:///absolute/dir")
        if self.store is not None and self.store.startswith("s3://") and \
                len(self.store) <= len("s3://"):
            raise ConfigError("--store s3:// needs a bucket name")
        if self.s3_endpoint is not None and not _is_endpoint_url(self.s3_endpoint):
            raise ConfigError(f"--endpoint-url (or AWS_ENDPOINT_URL[_S3]) must be an http:// or "
                              f"https:// URL with a host (and optional port), not "
                              f"{self.s3_endpoint!r}")
        if self.allow_other and self.allow_root:
            raise ConfigError("--allow-other and --allow-root exclude each other")
        for name, v in (("--uid", self.uid), ("--gid", self.gid)):
            if v is not None and not 0 <= v < ID_NONE:
                raise ConfigError(f"{name} must be between 0 and {ID_NONE - 1}")
        if self.compress not in ("auto", "lz4", "off"):
            raise ConfigError("--compress must be auto, lz4 or off")
        if not (5 << 20 <= self.part_size <= 5 << 30):
            raise ConfigError("--part-size must be between 5 MiB and 5 GiB (S3's limits)")
        if not (1 <= self.parts_in_flight <= 256):
            raise ConfigError("--parts-in-flight must be between 1 and 256")
        if not (1 <= self.upload_files <= 64):
            raise ConfigError("--upload-files must be between 1 and 64")
        if self.cache_size is not None and self.cache_size < (64 << 20):
            raise ConfigError("--cache-size must be at least 64M")
        if self.prefetch not in PREFETCH_MODES:
            raise ConfigError(f"--prefetch must be one of {', '.join(PREFETCH_MODES)}")
        if not (1 <= self.prefetch_concurrency <= 256):
            raise ConfigError("--prefetch-concurrency must be between 1 and 256")
        if not (1 << 20 <= self.prefetch_range <= 1 << 30):
            raise ConfigError("--prefetch-range must be between 1M and 1G")
        if not (0 <= self.refresh_interval <= 86400):
            raise ConfigError("--refresh-interval must be between 0 and 86400 seconds")
        if not (1 <= self.commit_timeout <= 7 * 86400):
            raise ConfigError("--commit-timeout must be between 1 second and 7 days")
        if not (2 <= self.lease <= 3600):
            raise ConfigError("--lease must be between 2 and 3600 seconds")
        if self.keep_local is not None and self.keep_local < 0:
            raise ConfigError("--keep-local must be >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if not (0 <= self.attr_timeout <= 3600):
            raise ConfigError("--attr-timeout must be between 0 and 3600 seconds")
        if not (0 <= self.io_threads <= 64):
            raise ConfigError("--io-threads must be between 0 and 64")
        if not (0 <= self.read_ahead_kb <= 65536):
            raise ConfigError("--read-ahead-kb must be between 0 and 65536")
        if self.metrics is not None:
            parse_listen(self.metrics)
        self._check_peers()

    def _check_peers(self) -> None:
        if not self.peers:
            if self.peer_listen or self.peer_address or self.peer_secret_file or \
                    self.peer_seeds:
                raise ConfigError("--peer-listen, --peer-address, --peer-seeds and "
                                  "--peer-secret-file need --peers")
            if self.replicas is not None:
                raise ConfigError("--replicas needs --peers (replicas go to other nodes' "
                                  "peer servers)")
            return
        if self.replicas is not None and not 0 <= self.replicas <= 16:
            raise ConfigError("--replicas must be from 0 to 16")
        if self.peer_secret_file is None:
            raise ConfigError("--peers needs --peer-secret-file (the secret every node shares)")
        load_peer_secret(self.peer_secret_file)
        if self.peer_listen is not None:
            parse_peer_listen(self.peer_listen)
        if self.peer_seeds is not None:
            parse_peer_seeds(self.peer_seeds)
        if self.peer_address is not None and not is_host(self.peer_address):
            raise ConfigError(f"--peer-address {self.peer_address!r} is not a host name or "
                              "address")

    @property
    def peer_endpoint(self) -> tuple[str, int, str]:
        """(listen address, port (0: any), advertised address) of --peers."""
        host, port = ("0.0.0.0", 0) if self.peer_listen is None else \
            parse_peer_listen(self.peer_listen)
        return host, port, self.peer_address or primary_address()

    @property
    def access(self) -> str | None:
        """The FUSE option that lets others in: 'allow_other', 'allow_root', or None (only the
        mounting user)."""
        if self.allow_root:
            return "allow_root"
        if self.allow_other or (self.allow_other is None and os.getuid() == 0):
            return "allow_other"
        return None

    @property
    def metrics_listen(self) -> tuple[str, int] | None:
        """(address, port) of --metrics, or None when it is off."""
        return None if self.metrics is None else parse_listen(self.metrics)

    @property
    def effective_log_file(self) -> Path | None:
        if self.log_file is not None:
            return self.log_file
        return None if self.foreground else self.cache_dir / "ckptfs.log"
