"""`ckptfs csi`: the command line of the CSI node plugin (ckptfs/csi/server.py serves it).

Exit codes: 0 stopped by SIGTERM/SIGINT; 1 the socket cannot be served or the `csi` extra
(grpcio, protobuf) is missing; 2 a bad option.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..storeargs import seconds

# The node's cache volumes live here unless --cache-root says otherwise (the DaemonSet mounts
# an NVMe hostPath at it).
DEFAULT_CACHE_ROOT = Path("/var/lib/ckptfs-csi")
# ~kubelet's own deadline for a NodeUnpublishVolume call (2 minutes) less the unmount's time:
# a longer drain goes on past kubelet's deadline, whose retry then answers ABORTED until it ends.
DEFAULT_DRAIN_TIMEOUT = 90.0
# sun_path holds 108 bytes with its NUL
MAX_SOCKET_PATH = 107


def socket_path(endpoint: str) -> Path:
    """unix:///csi/csi.sock (or unix:/csi/csi.sock, or /csi/csi.sock) -> /csi/csi.sock."""
    path = endpoint
    for prefix in ("unix://", "unix:"):
        if endpoint.startswith(prefix):
            path = endpoint[len(prefix):]
            break
    if not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"{endpoint!r} is not unix:///absolute/path")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise argparse.ArgumentTypeError(f"socket path longer than {MAX_SOCKET_PATH} bytes")
    return Path(path)


def _node_id(s: str) -> str:
    if not s.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return s


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "csi", help="run the Kubernetes CSI node plugin (docs/KUBERNETES.md)",
        description="Serve the CSI Identity and Node services on a unix socket: kubelet's "
        "NodePublishVolume mounts ckptfs at the pod's target path, NodeUnpublishVolume drains "
        "the uploads (up to --drain-timeout) and unmounts. Runs until SIGTERM; mounts outlive "
        "it. Exit 0 stopped; 1 cannot serve the socket or the csi extra is missing; 2 usage.")
    c.add_argument("--endpoint", required=True, type=socket_path, metavar="unix:///PATH",
                   help="the socket to serve (the registrar's --csi-address)")
    c.add_argument("--node-id", required=True, type=_node_id,
                   help="this node's id for NodeGetInfo (the Kubernetes node name)")
    c.add_argument("--cache-root", type=Path, default=DEFAULT_CACHE_ROOT,
                   help="where each volume's cache dir is made, ideally NVMe: one dir per "
                   f"volume, named after its id (default {DEFAULT_CACHE_ROOT})")
    c.add_argument("--drain-timeout", type=seconds, default=DEFAULT_DRAIN_TIMEOUT,
                   help="seconds an unpublish waits for committed sets to become durable before "
                   "unmounting anyway; what is left uploads at the next publish of the volume "
                   f"on this node (default {DEFAULT_DRAIN_TIMEOUT:g})")
    c.add_argument("--allow-file-stores", action="store_true",
                   help="accept file:// stores (directories of the plugin's container; for "
                   "tests: on a cluster an inline volume could name any of them)")
    c.add_argument("--log-level", default="info", type=str.lower,
                   choices=("debug", "info", "warning", "error"), help="default info")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from . import server
        from .volume import Settings
    except ImportError as e:
        print(f"ckptfs: ckptfs csi needs the csi extra (pip install 'ckptfs[csi]'): {e}",
              file=sys.stderr)
        return 1
    settings = Settings(node_id=args.node_id, cache_root=args.cache_root.absolute(),
                        drain_timeout=args.drain_timeout,
                        allow_file_stores=args.allow_file_stores)
    try:
        return server.serve(settings, args.endpoint)
    except (server.ServeError, OSError) as e:
        print(f"ckptfs: {e}", file=sys.stderr)
        return 1
