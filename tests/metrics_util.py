"""Scraping a daemon's Prometheus endpoint, and what its clients and the kernel see of it
(the tests and bench/soak_surfaces.py stall it with half requests)."""

from __future__ import annotations

import os
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_util import DaemonProcess

__all__ = [
    "HALF_A_REQUEST",
    "Samples",
    "metrics_address",
    "open_fds",
    "sample_value",
    "scrape",
    "server_side",
    "url_port",
]


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


HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow"


def url_port(url: str) -> int:
    return int(url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)[1])


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def server_side(port: int) -> list[str]:
    """The TCP states (hex, as /proc/net/tcp writes them) of the connections whose local
    port is `port`, taken or not yet taken by the server (its listener left out)."""
    states = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":
                states.append(fields[3])
    return states
