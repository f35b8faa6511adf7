"""The replica tests' cluster and helpers (tests/multinode/test_replicas.py,
test_replicas_confirm.py, test_replicas_k2.py, test_hang_multinode.py; an offer document for
tests/unit/test_replicas_unit.py): `cluster`, the fixture of nodes with --peers on one moto S3
store, each optionally behind a FaultProxy; what a node's status says of its replicas and sets;
what the store holds.
"""

from __future__ import annotations

import json
import time

import pytest

import ckptfs
from tests.conftest import wait_for
from tests.faultproxy import FaultProxy

SECRET = b"replica-secret-for-tests-0123456"
EXIT_USAGE, EXIT_STORE = 2, 7


@pytest.fixture
def cluster(mount_factory, s3_bucket, tmp_path):
    """cluster(name, *extra, proxied=False) -> a started node with --peers; `proxied`: its
    store requests go through cluster.proxy (a FaultProxy in front of the store), or through
    the FaultProxy given."""
    endpoint, bucket = s3_bucket
    proxy = FaultProxy(endpoint).start()
    made = []

    def node(name: str, *extra: str, proxied: bool = False):
        sf = tmp_path / f"{name}.secret"
        sf.write_bytes(SECRET)
        sf.chmod(0o600)
        m = mount_factory(name)
        via = proxy if proxied is True else proxied or None
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint",
                via.url if via is not None else endpoint, "--s3-path-style",
                "--refresh-interval", "1",
                "--peers", "--peer-address", "127.0.0.1", "--peer-secret-file", str(sf), *extra)
        m.node_id = ckptfs.status(m.path)["tiering"]["store"]["node"]
        made.append(m)
        return m

    proxies = [proxy]

    def new_proxy() -> FaultProxy:
        """Another FaultProxy in front of the store, stopped after the nodes are."""
        proxies.append(FaultProxy(endpoint).start())
        return proxies[-1]

    node.proxy, node.endpoint, node.bucket, node.new_proxy = proxy, endpoint, bucket, new_proxy
    try:
        yield node
    finally:
        for p in proxies:
            p.clear()
        try:
            for m in made:
                errors = m.unexpected_errors()
                assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
                    "\n".join(errors)
                assert SECRET.decode() not in m.log_text(), "the secret was logged"
        finally:
            for m in made:   # while the proxy still runs: the proxied nodes' uploads finish
                m.cleanup()
            for p in proxies:
                p.stop()


def _store_get(cluster, key: str) -> bytes:
    import boto3

    s3 = boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1")
    return s3.get_object(Bucket=cluster.bucket, Key=key)["Body"].read()


def unnamed_objects(cluster) -> list[str]:
    """The data objects in the store that no manifest there names."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=cluster.bucket, Prefix="p/") for o in page.get("Contents", [])]
    named = {"p/" + f["object"]["key"]
             for k in keys if k.startswith("p/manifests/")
             for f in json.loads(_store_get(cluster, k))["files"]}
    return sorted(k for k in keys if k.startswith("p/data/") and k not in named)


def replication(m) -> dict:
    return ckptfs.status(m.path)["tiering"]["peers"]["replication"]


def set_row(m, path: str) -> dict:
    rows = [s for s in ckptfs.status(m.path)["tiering"]["sets"] if s["path"] == path]
    assert rows, path
    return max(rows, key=lambda s: s["seq"])


def knows_buddy(a, b) -> None:
    wait_for(lambda: replication(a)["buddies"] == [b.node_id], timeout=20,
             what=f"{a.node_id} to list {b.node_id} as its buddy")


def replica_files(m) -> list[str]:
    root = m.cache_dir / "replicas"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) \
        if root.exists() else []


def _offer(port: int, **over) -> bytes:
    doc = {"format": "ckptfs-replica-offer", "version": 1, "origin": "evil", "generation": 1,
           "seq": 7, "path": "run/step_9", "kind": "dir", "committed_ns": time.time_ns(),
           "reason": "rename", "endpoint": {"host": "127.0.0.1", "port": port},
           "files": [{"rel": "model.pt", "size": 1000, "mode": 0o644, "mtime_ns": 1}],
           "dirs": [], "symlinks": []}
    doc.update(over)
    return json.dumps(doc).encode()


def peer_endpoint(m) -> str:
    return ckptfs.status(m.path)["tiering"]["peers"]["server"]["endpoint"]
