"""What a NodePublishVolume request asks for, checked and turned into a `ckptfs mount` plan.

A request names a volume (its id, attributes and secrets) and a target path. The attributes
(`volumeAttributes` of the PersistentVolume or of an inline ephemeral volume) map one for one
onto `ckptfs mount` options (`ATTRIBUTES`); anything else is refused naming the key, so a typo
never mounts with a default silently in its place. The secrets (`nodePublishSecretRef`) become
the daemon's AWS_* environment (`SECRETS`), never its argv (readable by every user of the node in
/proc/PID/cmdline) nor a log line. Each volume has its own cache dir under the plugin's cache
root, named from its id so that no id can reach outside the root (`cache_dir_name`).

State: none; pure functions of the request and the plugin's settings.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from . import csi_pb2

# volumeAttributes key -> (`ckptfs mount` option, is a flag). A flag's value is "true" or
# "false"; any other value is passed as the option's value in one argv word (`--opt=value`, so
# a value starting with '-' stays a value) and checked by the CLI itself (exit 2 ->
# INVALID_ARGUMENT with its one-line reason). Left out on purpose: what the plugin decides for
# every volume (--cache-dir, --log-file, --foreground), --metrics (one port per volume would
# clash on the node's host network) and --profile (no AWS config files in the container:
# credentials come from the secret or the plugin's own environment).
ATTRIBUTES: dict[str, tuple[str, bool]] = {
    "store": ("--store", False),
    "endpoint": ("--endpoint-url", False),
    "region": ("--region", False),
    "path-style": ("--force-path-style", True),
    "store-ignores-conditions": ("--store-ignores-conditions", True),
    "allow-empty-namespace": ("--allow-empty-namespace", True),
    "compress": ("--compress", False),
    "cache-size": ("--cache-size", False),
    "keep-local": ("--keep-local", False),
    "part-size": ("--part-size", False),
    "parts-in-flight": ("--parts-in-flight", False),
    "upload-files": ("--upload-files", False),
    "prefetch": ("--prefetch", False),
    "prefetch-concurrency": ("--prefetch-concurrency", False),
    "prefetch-range": ("--prefetch-range", False),
    "refresh-interval": ("--refresh-interval", False),
    "commit-timeout": ("--commit-timeout", False),
    "lease": ("--lease", False),
    "attr-timeout": ("--attr-timeout", False),
    "no-passthrough": ("--no-passthrough", True),
    "no-direct-io": ("--no-direct-io", True),
    "writeback-cache": ("--writeback-cache", True),
    "io-threads": ("--io-threads", False),
    "read-ahead-kb": ("--read-ahead-kb", False),
    "log-level": ("--log-level", False),
}

# What kubelet adds to the attributes itself: with podInfoOnMount (csidriver.yaml) the pod's
# name, namespace, uid and service account, and for an inline volume `ephemeral`. Accepted and
# not passed on.
KUBELET_PREFIX = "csi.storage.k8s.io/"

# Secret key (in the Secret that nodePublishSecretRef names) -> the daemon's environment.
SECRETS: dict[str, str] = {
    "awsAccessKeyID": "AWS_ACCESS_KEY_ID",
    "awsSecretAccessKey": "AWS_SECRET_ACCESS_KEY",
    "awsSessionToken": "AWS_SESSION_TOKEN",
}
# Credentials of the plugin's own environment that a volume's secret replaces as a whole (a
# session token left over from the plugin's credentials would not match the volume's key).
AWS_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                      "AWS_SECURITY_TOKEN", "AWS_PROFILE")

FS_TYPES = ("", "ckptfs", "fuse.ckptfs")
# Longest readable part of a volume id kept in its cache dir's name (a name is at most 255
# bytes; the digest makes it unique).
NAME_KEEP = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class CsiError(Exception):
    """A refusal with its gRPC status code; the message is safe to log and return (it never
    holds a secret's value)."""

    def __init__(self, code: grpc.StatusCode, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


def invalid(msg: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, msg)


@dataclass(frozen=True)
class Settings:
    """The plugin's own configuration (`ckptfs csi` options)."""

    node_id: str
    cache_root: Path
    drain_timeout: float
    allow_file_stores: bool = False


@dataclass(frozen=True)
class Plan:
    """One mount to make: `argv` runs `ckptfs mount`, with `env` (holding the secrets)."""

    volume_id: str
    target: Path
    cache_dir: Path
    store: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    secret_values: tuple[str, ...]

    def __repr__(self) -> str:  # never the environment: it holds the secrets
        return f"Plan(volume_id={self.volume_id!r}, target={str(self.target)!r})"


def cache_dir_name(volume_id: str) -> str:
    """A single, safe path component for `volume_id`: its readable characters (others become
    '_', leading dots dropped, so never '.', '..' or hidden) and a digest of the whole id (so
    'a/b' and 'a_b' get different dirs)."""
    readable = _UNSAFE.sub("_", volume_id)[:NAME_KEEP].lstrip(".") or "volume"
    digest = hashlib.sha256(volume_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}-{digest}"


def volume_cache_dir(root: Path, volume_id: str) -> Path:
    d = root / cache_dir_name(volume_id)
    if d.parent != root or d.name in ("", ".", ".."):  # cannot happen; the guard is the point
        raise invalid("volume_id does not name a cache dir")
    return d


def require(value: str, name: str) -> str:
    if not value:
        raise invalid(f"{name} missing")
    if "\0" in value:
        raise invalid(f"{name} holds a NUL byte")
    return value


def target_path(value: str) -> Path:
    p = Path(require(value, "target_path"))
    if not p.is_absolute():
        raise invalid(f"target_path {value!r} is not absolute")
    return Path(os.path.normpath(p))


def check_capability(cap: csi_pb2.VolumeCapability | None) -> None:
    if cap is None:
        raise invalid("volume_capability missing")
    kind = cap.WhichOneof("access_type")
    if kind == "block":
        raise invalid("ckptfs is a filesystem: block volumes are not supported")
    if kind != "mount":
        raise invalid("volume_capability has no access type (mount)")
    if cap.mount.fs_type not in FS_TYPES:
        raise invalid(f"fs_type {cap.mount.fs_type!r} is not ckptfs")
    if cap.mount.mount_flags:
        raise invalid("mount flags (PersistentVolume mountOptions) are not supported; give "
                      "ckptfs options as volumeAttributes (docs/KUBERNETES.md)")


def _options(attrs: Mapping[str, str], settings: Settings) -> tuple[str, list[str]]:
    """(store URL, `ckptfs mount` options) from the volume attributes."""
    args: list[str] = []
    for key in sorted(attrs):
        if key.startswith(KUBELET_PREFIX):
            continue
        if key not in ATTRIBUTES:
            raise invalid(f"unknown volume attribute {key!r} (docs/KUBERNETES.md lists them)")
        opt, flag = ATTRIBUTES[key]
        value = attrs[key]
        if flag:
            if value.lower() not in ("true", "false"):
                raise invalid(f"volume attribute {key!r} must be true or false, not {value!r}")
            if value.lower() == "true":
                args.append(opt)
        elif key != "store":
            args.append(f"{opt}={value}")
    store = attrs.get("store", "")
    if not store:
        raise invalid("volume attribute 'store' missing (s3://bucket[/prefix])")
    if not store.startswith("s3://") and not (
            settings.allow_file_stores and store.startswith("file://")):
        # A file:// store is a directory of the plugin's container, where the node's kubelet
        # pods dir is mounted too: an inline volume's author could read other pods' volumes.
        raise invalid(f"store {store!r} is not s3://bucket[/prefix] (file:// stores need "
                      "`ckptfs csi --allow-file-stores`)")
    return store, args


def _environment(secrets: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    env = dict(os.environ)
    unknown = sorted(k for k in secrets if k not in SECRETS)
    if unknown:
        raise invalid(f"unknown secret key(s) {', '.join(map(repr, unknown))}; known: "
                      f"{', '.join(SECRETS)}")
    if secrets:
        for k in AWS_CREDENTIAL_ENV:
            env.pop(k, None)
        env.update({SECRETS[k]: v for k, v in secrets.items() if v})  # empty: not set
    return env, tuple(v for v in secrets.values() if v)


def plan(req: csi_pb2.NodePublishVolumeRequest, settings: Settings) -> Plan:
    """The mount `req` asks for, or CsiError(INVALID_ARGUMENT) naming what is wrong."""
    volume_id = require(req.volume_id, "volume_id")
    target = target_path(req.target_path)
    check_capability(req.volume_capability if req.HasField("volume_capability") else None)
    store, args = _options(req.volume_context, settings)
    if req.readonly:  # a pod's readOnly volume: EROFS for every change, nothing to the store
        args.append("--read-only")
    env, secret_values = _environment(req.secrets)
    cache_dir = volume_cache_dir(settings.cache_root, volume_id)
    argv = (sys.executable, "-m", "ckptfs", "mount", str(target), "--cache-dir", str(cache_dir),
            f"--store={store}", *args)
    return Plan(volume_id=volume_id, target=target, cache_dir=cache_dir, store=store,
                argv=argv, env=env, secret_values=secret_values)


def redact(text: str, secret_values: tuple[str, ...]) -> str:
    """`text` (a CLI message) with every secret value masked."""
    for v in secret_values:
        text = text.replace(v, "***")
    return text
