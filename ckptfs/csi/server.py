"""The plugin's gRPC server on its unix socket: bind, serve, stop on SIGTERM/SIGINT.

Stopping the plugin leaves every mount as it is: each daemon runs on in its own session, and
kubelet unpublishes through the next plugin (deploy/kubernetes/daemonset.yaml says what a
restart of the plugin's container does to them).

State: the server and its worker threads, started and stopped by `serve` alone.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ..mount import MountError, check_fuse
from . import DRIVER_NAME, csi_pb2_grpc
from .node import Identity, Node
from .volume import Settings

log = logging.getLogger(__name__)

# Calls served at once: a publish or unpublish holds its worker for up to minutes (the mount's
# readiness, the drain); kubelet's calls per node are few, and Probe must still get through.
WORKERS = 16
STOP_GRACE_S = 5.0  # calls in flight at SIGTERM get this long; their mounts carry on anyway
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class ServeError(Exception):
    """The socket cannot be served; one line, exit 1."""


def prepare_socket(path: Path) -> None:
    """Make the socket's directory and remove a stale socket of an earlier run."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServeError(f"{path} exists and is not a socket")
    path.unlink()


def serve(settings: Settings, sock: Path) -> int:
    """Serve until SIGTERM or SIGINT; the exit code."""
    try:
        check_fuse()
    except MountError as e:
        log.warning("%s: every publish will fail until it is fixed (Probe says so)", e.msg)
    prepare_socket(sock)
    # SIGTERM and SIGINT are taken by sigwait below, blocked first so that every thread started
    # after this (gRPC's and the workers') inherits the mask and none of them gets the signal:
    # no Python handler runs at an arbitrary point of the main thread (a handler setting an
    # Event there can deadlock on the Event's own lock). SIGUSR1 writes every thread's stack to
    # stderr (the plugin's log), for a stop that hangs.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(settings), server)
    try:
        server.add_insecure_port(f"unix://{sock}")
    except RuntimeError as e:
        raise ServeError(f"cannot listen on {sock}: {e}") from None
    os.chmod(sock, 0o660)  # kubelet and the registrar run as root
    server.start()
    log.info("%s serving on %s (node %s, cache root %s, drain timeout %gs)", DRIVER_NAME,
             str(sock), settings.node_id, str(settings.cache_root), settings.drain_timeout)
    sig = signal.sigwait(STOP_SIGNALS)
    log.info("%s: stopping; mounts stay as they are", signal.Signals(sig).name)
    server.stop(STOP_GRACE_S).wait(STOP_GRACE_S + 5)
    sock.unlink(missing_ok=True)
    return 0
