"""deploy/grafana/ckptfs-dashboard.json against what a real mount exports.

  * The JSON is a dashboard Grafana imports: a schemaVersion, a Prometheus datasource variable
    and an `$instance` variable, unique panel ids, every panel on that datasource with targets
    whose PromQL is filtered by `$instance`.
  * Every metric name any panel's PromQL uses is exported: a mount with `--metrics` on a free
    port does a little work (a checkpoint written through a temporary name and renamed, made
    durable in a moto S3 store, evicted with --keep-local 0, read back from the store, a lookup
    of a missing name), then `/metrics` is scraped over HTTP and each name is looked up in it
    (a family declared with no samples yet, e.g. errors that did not happen, counts: Grafana
    shows it as empty, not as a typo). The names are parsed out of the expressions: an
    identifier that is not a function, a keyword, a label (matchers, `by (...)`) or a range.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request

from conftest import REPO, wait_for
from prometheus_client.parser import text_string_to_metric_families

import ckptfs

DASHBOARD = REPO / "deploy" / "grafana" / "ckptfs-dashboard.json"
MiB = 1 << 20

# PromQL words that are followed neither by "(" nor by a selector: not metric names
_KEYWORDS = {"bool", "offset", "and", "or", "unless", "inf", "nan", "start", "end"}
# label lists: `by (a, b)`, `without (a)`, `on (a)`, `ignoring (a)`, `group_left (a)`
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values, strings
    e = re.sub(r"\{[^}]*\}", "{}", e)               # label matchers
    e = re.sub(r"\[[^\]]*\]", "[]", e)              # ranges, subqueries
    e = _LABEL_LISTS.sub(" ", e)
    e = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", " ", e)  # numbers (1e9, 0.99)
    return {n for n in _IDENT.findall(e) if n.lower() not in _KEYWORDS}


def test_metric_names_parses_selectors_functions_labels_and_suffixes():
    expr = ('histogram_quantile(0.99, sum by (le, op) (rate(x_seconds_bucket{op=~"a|b", '
            'instance=~"$instance"}[$__rate_interval]))) / on (op) group_left (v) y_total + '
            'z_info * 1e9 > bool 0 unless w offset 5m')
    assert metric_names(expr) == {"x_seconds_bucket", "y_total", "z_info", "w"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too; rows themselves are left out."""
    out = []
    for p in dash["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p["targets"]]


def test_dashboard_json_is_a_valid_dashboard():
    dash = load_dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    inst = variables["instance"]
    assert inst["type"] == "query" and inst["datasource"]["uid"] == "${datasource}"
    assert "label_values(ckptfs_info, instance)" in json.dumps(inst["query"])
    ids = [p["id"] for p in dash["panels"]] + [
        q["id"] for p in dash["panels"] if p["type"] == "row" for q in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    shown = panels(dash)
    assert len(shown) >= 20
    for p in shown:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    titles = " | ".join(p["title"] for p in shown)
    # what the brief asked every dashboard of ckptfs to show
    for want in ("not yet durable", "at risk", "Upload throughput", "Upload queue",
                 "Commit -> durable", "Read bytes by source", "Cache usage", "Evictions",
                 "Retries and errors", "FUSE requests", "FUSE errors"):
        assert want in titles, want


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

