"""Scraping a daemon's Prometheus endpoint."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_util import DaemonProcess

__all__ = ["Samples", "metrics_address", "sample_value", "scrape"]


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_address(d: DaemonProcess) -> str:
    found = re.search(r"metrics on (http://\S+/metrics)", d.log())
    assert found, d.log()
    return found.group(1)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
