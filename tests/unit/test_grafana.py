"""deploy/grafana/ckptfs-dashboard.json, without a mount (against what a real mount exports:
tests/mount/test_grafana_mount.py).

  * The JSON is a dashboard Grafana imports: a schemaVersion, a Prometheus datasource variable
    and an `$instance` variable, unique panel ids, every panel on that datasource with targets
    whose PromQL is filtered by `$instance`.
  * The metric names are parsed out of the expressions: an identifier that is not a function, a
    keyword, a label (matchers, `by (...)`) or a range.
"""

from __future__ import annotations

import json

from tests.grafana_helpers import load_dashboard, metric_names, panels


def test_metric_names_parses_selectors_functions_labels_and_suffixes():
    expr = ('histogram_quantile(0.99, sum by (le, op) (rate(x_seconds_bucket{op=~"a|b", '
            'instance=~"$instance"}[$__rate_interval]))) / on (op) group_left (v) y_total + '
            'z_info * 1e9 > bool 0 unless w offset 5m')
    assert metric_names(expr) == {"x_seconds_bucket", "y_total", "z_info", "w"}


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
