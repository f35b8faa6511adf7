"""A /metrics scrape as the metrics tests read it (tests/unit/test_metrics.py,
tests/mount/test_metrics_mount.py): fetched over HTTP and parsed with prometheus_client's parser
into samples by (name, labels).
"""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def fetch(port: int, path: str = "/metrics", host: str = "127.0.0.1") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Scrape:
    """One parsed scrape: samples by (name, labels)."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), default)

    def counters(self) -> dict[tuple[str, frozenset], float]:
        return {k: v for k, v in self.samples.items() if k[0].endswith("_total")}


def scrape(port: int) -> Scrape:
    code, text = fetch(port)
    assert code == 200, text
    return Scrape(text)
