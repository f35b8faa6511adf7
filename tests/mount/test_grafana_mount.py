"""deploy/grafana/ckptfs-dashboard.json against what a real mount exports (the dashboard's own
checks: tests/unit/test_grafana.py).

  * Every metric name any panel's PromQL uses is exported: a mount with `--metrics` on a free
    port does a little work (a checkpoint written through a temporary name and renamed, made
    durable in a moto S3 store, evicted with --keep-local 0, read back from the store, a lookup
    of a missing name), then `/metrics` is scraped over HTTP and each name is looked up in it
    (a family declared with no samples yet, e.g. errors that did not happen, counts: Grafana
    shows it as empty, not as a typo). The names are parsed out of the expressions: an
    identifier that is not a function, a keyword, a label (matchers, `by (...)`) or a range.
"""

from __future__ import annotations

import os
import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import ckptfs
from tests.conftest import wait_for
from tests.grafana_helpers import load_dashboard, metric_names, panels

MiB = 1 << 20


def exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p["targets"]]


# ----------------------------------------------------------------------------------------------
# against a real mount's scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> tuple[set[str], dict[str, float]]:
    """(every metric name the scrape declares, unlabelled sums by sample name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    names: set[str] = set()
    sums: dict[str, float] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(fam.name + s for s in suffixes.get(fam.type, ()))
        for s in fam.samples:
            names.add(s.name)
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return names, sums


def test_every_metric_the_dashboard_uses_is_exported(mount_factory, s3_bucket):
    endpoint, bucket = s3_bucket
    port = free_port()
    m = mount_factory()
    m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
            "--keep-local", "0", "--cache-size", "1G", "--metrics", str(port))
    data = os.urandom(3 * MiB + 17)
    tmp = m.path / "step_1.pt.tmp"
    tmp.write_bytes(data)
    os.rename(tmp, m.path / "step_1.pt")
    ckptfs.wait_durable(m.path / "step_1.pt", timeout=120)
    # --keep-local 0: the durable file leaves the cache, and the read below comes from the store
    wait_for(lambda: scrape(port)[1].get("ckptfs_cache_evictions_total", 0) >= 1, timeout=60,
             what="the durable checkpoint to be evicted")
    assert (m.path / "step_1.pt").read_bytes() == data
    assert not (m.path / "missing").exists()  # a lookup answered ENOENT: ckptfs_fuse_errors
    names, sums = scrape(port)
    assert sums["ckptfs_upload_bytes_total"] >= len(data)
    assert sums["ckptfs_restore_bytes_total"] >= len(data)
    assert sums["ckptfs_fuse_errors_total"] >= 1
    # this node's lease in the store (README "Metrics"; Engine.statistics carries it)
    assert sums["ckptfs_lease_held"] == 1 and sums["ckptfs_lease_lapses_total"] == 0

    used: dict[str, list[str]] = {}
    for title, expr in exprs(load_dashboard()):
        for name in metric_names(expr):
            used.setdefault(name, []).append(title)
    assert len(used) >= 30, sorted(used)
    odd = sorted(n for n in used if not n.startswith(("ckptfs_", "process_")))
    assert not odd, f"not metric names (the parser slipped?): {odd}"
    missing = {n: t for n, t in used.items() if n not in names}
    assert not missing, f"panels use metrics the daemon does not export: {missing}"
    m.stop()
    assert not m.unexpected_errors()
