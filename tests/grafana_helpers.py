"""deploy/grafana/ckptfs-dashboard.json as the dashboard tests read it (tests/unit/test_grafana.py,
tests/mount/test_grafana_mount.py): its panels, and the metric names a PromQL expression selects
(`metric_names`: an identifier that is not a function, a keyword, a label (matchers,
`by (...)`) or a range).
"""

from __future__ import annotations

import json
import re

from tests.conftest import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "ckptfs-dashboard.json"

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
