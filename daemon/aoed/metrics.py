"""The daemon's Prometheus metrics (`[metrics] listen`; off by default, loopback when on).

prometheus-client writes the text format (`generate_latest`); the daemon serves it
itself, from its trio run, at /metrics (aoed.endpoint: a bounded number of connections,
each with a time limit, none kept when descriptors run low; `[metrics] max_connections`
and `timeout_s`), so that whoever can reach the port cannot take the daemon's threads,
descriptors or memory. Every series but the RPC counts is read when Prometheus scrapes,
from the agents that own the figures (the job manager, the device agent, the compile
pool, the bank writer, the followers).

Invariants:
- The text is made in a worker thread (one scrape at a time), which never reads
  trio-owned state itself: it asks the trio run for one snapshot
  (`trio.from_thread.run` with the run's token), so the figures are those of one
  moment. When the run is gone (shutting down) a scrape gets the RPC counts only.
- RPCs are counted by a gRPC server interceptor (`RpcCounter`) in grpc's own threads,
  into prometheus-client's Counter, which is thread-safe.
- Each daemon has its own CollectorRegistry, never the process-wide default, so several
  daemons (tests) in one process do not mix their series.

Series (all prefixed `aoed_`):
  jobs{state}                      jobs the daemon keeps, by state
  queue_length                     jobs queued and not started
  device_busy_seconds_total{device}, device_measurements_total{device}
                                   time the device spent on requests, and how many
  compile_workers, compile_workers_busy
  bank_records{kind}, bank_used_bytes, bank_head_seq
                                   the custom bank: records by kind, pages in use, the
                                   sequence number of its last write
  bank_lookups_total{source,result}
                                   source engine: the bank tally of every job whose result
                                   was written, one per task (aoe.outcome.bank_tally):
                                   result hit (repo_hit_num: the bank knew the task) or
                                   miss (the rest of total_num), so a job moves them by its
                                   summary's counts; source api: LookupEntry calls, hit
                                   (an entry answered) or miss
  bank_follow_connected{peer}, bank_follow_behind_seqs{peer}, bank_follow_lag_seconds{peer},
  bank_follow_applied_seq{peer}, bank_follow_refused_total{peer}
                                   per followed peer: a stream is open; how many of its
                                   sequence numbers are not applied here; from its commit
                                   of the last record applied to the commit here
  rpcs_total{method,code}          RPCs served, by method and final status
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aoed.endpoint import Endpoint, Limits

__all__ = ["DaemonMetrics", "RpcCounter", "Snapshot"]

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """The figures of one moment (see the module doc for their meaning)."""

    jobs: dict[str, int] = field(default_factory=dict)
    queued: int = 0
    devices: dict[str, tuple[float, int]] = field(default_factory=dict)  # name: (busy s, requests)
    workers: int = 0
    workers_busy: int = 0
    bank_records: dict[str, int] = field(default_factory=dict)
    bank_used_bytes: int = 0
    bank_head: int = 0
    lookups: dict[tuple[str, str], int] = field(default_factory=dict)  # (source, result): n
    follow: dict[str, tuple[bool, int, float, int, int]] = field(default_factory=dict)
    # peer: (connected, behind, lag s, applied seq, refused)


class _Collector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        if s is None:
            return
        g = GaugeMetricFamily("aoed_jobs", "Jobs the daemon keeps, by state", labels=["state"])
        for state, n in sorted(s.jobs.items()):
            g.add_metric([state], n)
        yield g
        yield GaugeMetricFamily("aoed_queue_length", "Jobs queued and not started", value=s.queued)
        busy = CounterMetricFamily(
            "aoed_device_busy_seconds", "Seconds the device spent on requests", labels=["device"]
        )
        done = CounterMetricFamily(
            "aoed_device_measurements", "Requests the device answered", labels=["device"]
        )
        for name, (seconds, requests) in sorted(s.devices.items()):
            busy.add_metric([name], seconds)
            done.add_metric([name], requests)
        yield busy
        yield done
        yield GaugeMetricFamily("aoed_compile_workers", "Compile worker processes", value=s.workers)
        yield GaugeMetricFamily(
            "aoed_compile_workers_busy", "Compile workers with a request", value=s.workers_busy
        )
        g = GaugeMetricFamily(
            "aoed_bank_records", "Records in the custom bank, by kind", labels=["kind"]
        )
        for kind, n in sorted(s.bank_records.items()):
            g.add_metric([kind], n)
        yield g
        yield GaugeMetricFamily(
            "aoed_bank_used_bytes",
            "Bytes of the custom bank's pages in use",
            value=s.bank_used_bytes,
        )
        yield GaugeMetricFamily(
            "aoed_bank_head_seq", "Sequence number of the bank's last write", value=s.bank_head
        )
        c = CounterMetricFamily(
            "aoed_bank_lookups",
            "Bank lookups, by who asked and whether an entry answered",
            labels=["source", "result"],
        )
        for (source, result), n in sorted(s.lookups.items()):
            c.add_metric([source, result], n)
        yield c
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "connected": GaugeMetricFamily(
                "aoed_bank_follow_connected",
                "1 while a stream from the peer is open",
                labels=["peer"],
            ),
            "behind": GaugeMetricFamily(
                "aoed_bank_follow_behind_seqs",
                "The peer's sequence numbers not applied here yet",
                labels=["peer"],
            ),
            "lag": GaugeMetricFamily(
                "aoed_bank_follow_lag_seconds",
                "From the peer's commit of the last record applied to its commit here",
                labels=["peer"],
            ),
            "applied": GaugeMetricFamily(
                "aoed_bank_follow_applied_seq",
                "The peer's last sequence number applied here",
                labels=["peer"],
            ),
            "refused": CounterMetricFamily(
                "aoed_bank_follow_refused", "Records from the peer refused", labels=["peer"]
            ),
        }
        for peer, (connected, behind, lag, applied, refused) in sorted(s.follow.items()):
            for name, value in zip(
                families, (float(connected), behind, lag, applied, refused), strict=True
            ):
                families[name].add_metric([peer], value)
        yield from families.values()


class RpcCounter(grpc.ServerInterceptor):
    """Counts every RPC by method and final status into `counter` (labels method, code)."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        # "/aoe.v1.BankService/X" -> "BankService/X"
        method = handler_call_details.method.rsplit(".", 1)[-1]
        count = self._counter

        def code(context: grpc.ServicerContext, failed: bool) -> str:
            got = context.code()  # type: ignore[attr-defined]  # grpcio has it; its stubs do not
            if got is not None:
                return got.name
            if failed:
                return "UNKNOWN"
            return "OK" if context.is_active() else "CANCELLED"

        def unary(behavior):
            def wrapped(request, context):
                failed = True
                try:
                    reply = behavior(request, context)
                    failed = False
                    return reply
                finally:
                    count.labels(method, code(context, failed)).inc()

            return wrapped

        def streaming(behavior):
            def wrapped(request, context):
                failed = True
                try:
                    yield from behavior(request, context)
                    failed = False
                finally:
                    count.labels(method, code(context, failed)).inc()

            return wrapped

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                unary(handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                unary(handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                streaming(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            streaming(handler.stream_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )


class DaemonMetrics:
    """One daemon's registry: the RPC counter (`interceptor`) from creation, and the
    scrape-time series once `run` is given a way to take a snapshot."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpcs = Counter(
            "aoed_rpcs",
            "RPCs served, by method and final status",
            ["method", "code"],
            registry=self.registry,
        )
        self.interceptor = RpcCounter(self.rpcs)
        self.address = ""

    async def run(
        self,
        listen: str,
        snapshot: Callable[[], Any],
        limits: Limits = Limits(),
        *,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the registry at http://`listen`/metrics until cancelled, within
        `limits` (aoed.endpoint); `snapshot` is an async function (run in trio)
        returning a Snapshot. Reports the address served (the port chosen, for port 0)
        through `task_status`. Raises OSError when it cannot listen."""
        token = trio.lowlevel.current_trio_token()

        def take() -> Snapshot | None:  # the worker thread making the text
            try:
                return trio.from_thread.run(snapshot, trio_token=token)
            except trio.RunFinishedError:
                return None

        self.registry.register(_Collector(take))
        one_at_a_time = trio.CapacityLimiter(1)

        async def page() -> tuple[bytes, str]:
            body = await trio.to_thread.run_sync(
                generate_latest, self.registry, limiter=one_at_a_time, abandon_on_cancel=True
            )
            return body, CONTENT_TYPE_LATEST

        host, _, port = listen.rpartition(":")
        endpoint = Endpoint({"/metrics": page}, limits)
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(endpoint.run, host.strip("[]"), int(port))
            self.address = f"{host}:{bound}"
            log.info("aoed: metrics on http://%s/metrics", self.address)
            task_status.started(self.address)


def count_states(states: Sequence[str], every: Sequence[str]) -> dict[str, int]:
    """How many of `states` are each of `every` (zeros included)."""
    counts = collections.Counter(states)
    return {s: counts.get(s, 0) for s in every}
