"""GDAT on PyTorch DDP: DDP's defaults, the best of an exhaustive grid, and aoed's choice,
side by side in one run, written into bench/RESULTS.md.

    python bench/bench_gdat.py [--quick] [--no-write] [--out bench/RESULTS.md] [--link loopback|slow|both]
                               [--models cnn,encoder,fc]

World size 2 on this machine (gloo over loopback, one rank per core), three models built
here with random weights and synthetic inputs, exported with torch.export:

  cnn      a ResNet-style CNN (3 stages of 2 basic blocks, 32/64/128 channels, BatchNorm),
           batch 8 of 3x32x32
  encoder  a BERT-style encoder (token embedding 8000 x 256, 4 layers of nn.TransformerEncoderLayer,
           4 heads, feed-forward 1024, no dropout), batch 8 of 64 tokens
  fc       large fully connected layers (1024 -> 6 x Linear(1024, 1024) -> 16), batch 8:
           25 MiB of gradients for a few milliseconds of compute, a step dominated by
           gradient traffic

For each: `aoe tune --job-type gdat` embedded (its tuning time is the wall time of the
whole job, model loading and worlds included); the grid: every configuration of the same
knobs (bucket caps of the ladder up to one bucket, first-bucket caps, gradient_as_bucket_view,
static_graph; quick mode: caps x gradient_as_bucket_view only), configurations that give
DDP the same buckets measured once, each in the same interleaved rounds, the grid's best
being the lowest median; then DDP's defaults, the grid's best and aoed's choice measured
again in fresh interleaved rounds of one world. Ratios are the median of per-round ratios
with a 95% distribution-free interval (aoed.engine.stats), as the tuner's own confirmation.
Under --gradient-precision fp16 the grid has the fp16 hooks (torch's fp16, aoed's
fp16_scaled) only where aoed's gate passed them; a hook the gate rejected is measured beside them for its speed alone.

The slow link: the same, for the fc model (and, in full mode, the others), inside a network
namespace whose loopback is limited to `SLOW_RATE` with a token bucket filter (`tc qdisc
... tbf`), exact and --gradient-precision fp16. netem is not available on this kernel; tbf
is. Where neither a namespace nor tbf can be made, the section says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from machine import Machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- gdat:begin -->", "<!-- gdat:end -->"
NETNS = "aoed-gdat-bench"
#: The slow link's rate (tc's spelling) and how it reads in the report.
SLOW_RATE, SLOW_WORDS = "2gbit", "2 Gbit/s"
MODELS = ("cnn", "encoder", "fc")


# --------------------------------------------------------------------------- models


def build(name: str):
    """(module, example args) of a model built in code, random weights."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "cnn":

        class Block(nn.Module):
            def __init__(self, cin: int, cout: int, stride: int) -> None:
                super().__init__()
                self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
                self.b1 = nn.BatchNorm2d(cout)
                self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
                self.b2 = nn.BatchNorm2d(cout)
                self.skip = (
                    nn.Sequential()
                    if stride == 1 and cin == cout
                    else nn.Sequential(
                        nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                    )
                )

            def forward(self, x):
                return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.skip(x))

        class ResNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.stem = nn.Sequential(
                    nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
                )
                layers, cin = [], 32
                for cout, stride in ((32, 1), (64, 2), (128, 2)):
                    layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
                    cin = cout
                self.layers = nn.Sequential(*layers)
                self.fc = nn.Linear(128, 10)

            def forward(self, x):
                return self.fc(self.layers(self.stem(x)).mean((2, 3)))

        return ResNet(), (torch.randn(8, 3, 32, 32),)
    if name == "encoder":

        class Encoder(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(8000, 256)
                self.pos = nn.Parameter(torch.randn(1, 64, 256) * 0.02)
                layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
                self.head = nn.Linear(256, 256)

            def forward(self, ids):
                return self.head(self.encoder(self.embed(ids) + self.pos))

        return Encoder(), (torch.randint(0, 8000, (8, 64)),)
    layers = [nn.Linear(1024, 1024) for _ in range(6)]
    body = [m for lin in layers for m in (lin, nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(1024, 16)), (torch.randn(8, 1024),)


def export(name: str, out: Path) -> Path:
    import torch

    module, args = build(name)
    path = out / f"{name}.pt2"
    torch.export.save(torch.export.export(module, args), str(path))
    return path


# --------------------------------------------------------------------------- measuring


def grid(layout, quick: bool, hooks: list[str]) -> list:
    """Every configuration of the knobs the search explores, with each of `hooks` ("" for
    none), configurations with the same buckets and options once."""
    from aoe.gdat import DDPConfig
    from aoed.gdat import space

    # every rung of the ladder up to the first cap that holds all gradients, and DDP's default
    total_mb = layout.grad_bytes / 2**20
    top = min((c for c in space.LADDER_MB if c >= total_mb), default=space.LADDER_MB[-1])
    caps = [None, *[c for c in space.LADDER_MB if c <= top]]
    firsts = [None] if quick else [None, *space.FIRST_MB]
    flags = (
        [(False, False), (True, False)]
        if quick
        else [(v, s) for v in (False, True) for s in (False, True)]
    )
    configs = []
    for cap in caps:
        for first in firsts:
            if first is not None and cap is not None and first >= cap:
                continue
            for view, static in flags:
                for hook in hooks:
                    configs.append(
                        DDPConfig(
                            bucket_cap_mb=cap,
                            first_bucket_mb=first,
                            gradient_as_bucket_view=view,
                            static_graph=static,
                            hook=hook,
                        )
                    )
    return space.distinct(layout, configs)


async def side_by_side(world, entrants: list, rounds: int, steps: int) -> dict:
    from aoed.gdat.race import Meter, race

    meter = Meter({"": world}, lambda s, c: None, lambda: math.inf, warmup=2, steps=steps)
    return await race(meter, "bench", entrants, rounds, drop=False, min_rounds=rounds)


async def one(model: Path, name: str, precision: str, quick: bool, work: Path) -> dict[str, Any]:
    """aoed's job, the grid and the side-by-side rounds for one model; figures as JSON."""
    from aoe.config import load_config
    from aoe.gdat import DDPConfig
    from aoe.gradlayout import GradientLayout
    from aoed.engine import stats
    from aoed.engine.confirm import verdict_of
    from aoed.engine.world import World, WorldSpec, inspect_model
    from aoed.gdat import GdatOptions, run_gdat
    from aoed.gdat.race import Entrant

    out = work / f"{name}-{precision}"
    out.mkdir(parents=True)
    config = dataclasses.replace(
        load_config(env={}).replace(bank=out / "bank"), runtime_dir=out / "rt"
    )
    # Quick mode: fewer rounds and steps per turn for aoed too (its budget follows).
    few = {"rounds": 4, "confirm_rounds": 9, "steps": 3, "warmup": 1} if quick else {}
    t0 = time.monotonic()
    job = await run_gdat(GdatOptions(model, out, precision=precision, **few), config)
    job_s = time.monotonic() - t0
    # The grid's ceiling is over what the gate allows: a hook the job's gate rejected is
    # measured only as an ungated reference, for its speed.
    passed = {g["config"].rsplit("hook=", 1)[-1] for g in job.gates if g["passed"]}
    rejected = sorted(
        {g["config"].rsplit("hook=", 1)[-1] for g in job.gates if not g["passed"]} - passed
    )

    info = await inspect_model({"kind": "pt2", "path": str(model)}, "gloo", 2, out)
    layout = GradientLayout.of(info["params"], 2, "gloo")
    world = World(
        WorldSpec({"kind": "pt2", "path": str(model)}, 2, "gloo"), out / "bench-world", out / "rt"
    )
    try:
        t0 = time.monotonic()
        configs = grid(layout, quick, ["", *sorted(passed)])
        figs = await side_by_side(
            world, [Entrant(c.label, c) for c in configs], 3 if quick else 5, 5
        )
        grid_s = time.monotonic() - t0
        ok = {k: f.measurement() for k, f in figs.items() if f.measurement().ok}
        grid_best = figs[min(ok, key=lambda k: ok[k].median_us)].config
        final = [
            Entrant("defaults", DDPConfig()),
            Entrant("grid best", grid_best),
            Entrant("aoed", job.shipped),
        ]
        final += [
            Entrant(f"{h} hook, rejected by the gate (speed only)", DDPConfig(hook=h))
            for h in rejected
        ]
        final_figs = await side_by_side(world, final, 9 if quick else 15, 5)
    finally:
        await world.aclose()
        world.close_locks()
    base = final_figs["defaults"]
    rows = {}
    for label, f in final_figs.items():
        m = f.measurement()
        # speedup: defaults / this, per round
        ratios = stats.paired_ratios(base.rounds_us, f.rounds_us)
        verdict, med, ci = (
            verdict_of([1 / r for r in ratios]) if len(ratios) >= 3 else ("", 1.0, (1.0, 1.0))
        )
        rows[label] = {
            "step_ms": m.median_us / 1e3 if m.ok else None,
            "tail_ms": f.tail_us / 1e3,
            "speedup": 1 / med,
            "speedup_ci95": [1 / ci[1], 1 / ci[0]],
            "verdict": verdict,
            "rounds": len(ratios),
            "config": f.config.label,
        }
    a, g = final_figs["aoed"], final_figs["grid best"]
    vs_grid = stats.paired_ratios(a.rounds_us, g.rounds_us)
    return {
        "model": name,
        "precision": precision,
        "grad_mb": layout.grad_bytes / 2**20,
        "rows": rows,
        "aoed_vs_grid": stats.median(vs_grid) if vs_grid else None,
        "aoed_vs_grid_ci95": list(stats.median_ci(vs_grid, 0.95)) if len(vs_grid) >= 3 else None,
        "grid_configs": len(configs),
        "grid_s": grid_s,
        "job_s": job_s,
        "job_verdict": job.verdict,
        "job_improvement": job.improvement,
        "job_improvement_ci95": list(job.improvement_ci95),
        "job_measured": len(
            {c["name"] for c in job.configurations if c.get("step_ms") is not None}
        ),
        "gates": job.gates,
        "job_notes": job.notes,
    }


async def run_all(
    models: dict[str, Path], plan: list[tuple[str, str]], quick: bool, work: Path
) -> list[dict]:
    out = []
    for name, precision in plan:
        print(f"bench_gdat: {name} ({precision})", file=sys.stderr, flush=True)
        out.append(await one(models[name], name, precision, quick, work))
    return out


# --------------------------------------------------------------------------- the slow link


@contextlib.contextmanager
def slow_link():
    """A network namespace whose loopback carries SLOW_RATE; yields None, or why it
    cannot be made (then nothing is left behind)."""

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    made = False
    try:
        subprocess.run(["ip", "netns", "delete", NETNS], capture_output=True, timeout=30)
        sh("ip", "netns", "add", NETNS)
        made = True
        sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        sh(
            "ip",
            "netns",
            "exec",
            NETNS,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            SLOW_RATE,
            "burst",
            "1mb",
            "latency",
            "100ms",
        )
        yield None
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        yield f"{' '.join(getattr(exc, 'cmd', []) or [])}: {str(detail).strip()}"
    finally:
        if made:
            subprocess.run(["ip", "netns", "delete", NETNS], capture_output=True, timeout=30)


# --------------------------------------------------------------------------- report


def _x(row: dict) -> str:
    lo, hi = row["speedup_ci95"]
    return f"{row['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


def render(
    host: Machine,
    loop: list[dict],
    slow: list[dict],
    slow_why: str,
    quick: bool,
    models: Sequence[str] = MODELS,
) -> str:
    lines = [
        "## GDAT: gradient communication of data-parallel training (`python bench/bench_gdat.py"
        + (" --quick" if quick else "")
        + ("" if tuple(models) == MODELS else f" --models {','.join(models)}")
        + f"`, {'quick' if quick else 'full'} mode)",
        "",
        f"Machine: {host.describe('torch', 'trio')}.",
        "",
        "World size 2 over gloo (one rank per core), "
        + (
            "three models"
            if tuple(models) == MODELS
            else f"the models {', '.join(models)} (this run: --models {','.join(models)})"
        )
        + " built in code with random weights and "
        "synthetic inputs (bench/bench_gdat.py says what they are). Per model, side by side in one world: "
        "DDP's defaults, the best configuration of an exhaustive grid over the knobs aoed searches, and the "
        "configuration `aoe tune --job-type gdat` shipped. Step = the slowest rank's forward, backward and SGD "
        "step, median of per-round medians; tail = end of the last gradient's computation to the end of "
        "backward; speedup = the median of per-round ratios defaults/this with its 95% interval."
        + (
            " Quick mode: fewer rounds, a grid of bucket caps x gradient_as_bucket_view."
            if quick
            else ""
        ),
    ]

    def table(results: list[dict], title: str) -> None:
        lines.extend(
            [
                "",
                f"### {title}",
                "",
                "| model | gradients | precision | configuration | step | tail | speedup over defaults |",
                "|---|---|---|---|---|---|---|",
            ]
        )
        for r in results:
            for label, row in r["rows"].items():
                lines.append(
                    f"| {r['model']} | {r['grad_mb']:.1f} MiB | {r['precision']} | {label}: `{row['config']}` | "
                    f"{row['step_ms']:.2f} ms | {row['tail_ms']:.2f} ms | "
                    f"{'—' if label == 'defaults' else _x(row)} |"
                )
        lines.extend(
            [
                "",
                "| model | precision | aoed / grid best (step) | aoed tuning | grid | configurations: aoed, grid "
                "| aoed's own verdict |",
                "|---|---|---|---|---|---|---|",
            ]
        )
        for r in results:
            ci = r["aoed_vs_grid_ci95"]
            ratio = f"{r['aoed_vs_grid']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "n/a"
            lo, hi = r["job_improvement_ci95"]
            lines.append(
                f"| {r['model']} | {r['precision']} | {ratio} | {r['job_s']:.0f} s | {r['grid_s']:.0f} s "
                f"({r['job_s'] / r['grid_s']:.0%}) | {r['job_measured']}, {r['grid_configs']} | "
                f"{r['job_verdict']} ({r['job_improvement']:+.1%}, [{lo:+.1%}, {hi:+.1%}]) |"
            )
        for r in results:
            for g in r["gates"]:
                lines.append(
                    f"\nGate, {r['model']} ({r['precision']}): `{g['config']}` "
                    f"{'passed' if g['passed'] else 'rejected'}: {g['why']}."
                )

    table(loop, "Loopback (no rate limit)")
    if slow:
        table(slow, f"A slow link: loopback limited to {SLOW_WORDS} (a network namespace, tc tbf)")
    else:
        lines.extend(
            [
                "",
                "### A slow link",
                "",
                f"Not measured: this machine could not make one ({slow_why}).",
            ]
        )
    lines.extend(["", "### Targets", "", "| target | result |", "|---|---|"])
    for r in [*loop, *slow]:
        where = f"{r['model']} {r['precision']}" + (" (slow link)" if r in slow else "")
        a = r["rows"]["aoed"]
        never = a["verdict"] != "slower"
        lines.append(
            f"| never slower than defaults: {where} | {'met' if never else 'MISSED'}: {_x(a)} ({a['verdict'] or 'n/a'}) |"
        )
        if r["aoed_vs_grid"] is not None:
            within, cheaper = r["aoed_vs_grid"] <= 1.05, r["job_s"] < r["grid_s"]
            lines.append(
                f"| within 5% of the grid's best at a fraction of its cost: {where} | "
                f"{'met' if within and cheaper else 'MISSED'}: aoed/grid {r['aoed_vs_grid']:.3f} "
                f"({'within' if within else 'not within'} 5%), tuning {r['job_s']:.0f} s vs grid "
                f"{r['grid_s']:.0f} s ({r['job_s'] / r['grid_s']:.0%}) |"
            )
        if r["model"] == "fc":
            want = 1.10 if r["precision"] == "exact" else 1.4
            ref = [(k, v) for k, v in r["rows"].items() if "rejected by the gate" in k]
            extra = "".join(f"; {k}: {_x(v)}" for k, v in ref)
            lines.append(
                f"| fc {r['precision']} >= {want:.2f}x over defaults, gradients within the bound"
                f"{' (slow link)' if r in slow else ''} | {'met' if a['speedup'] >= want else 'MISSED'}: "
                f"aoed {_x(a)}, tail {r['rows']['defaults']['tail_ms']:.2f} -> {a['tail_ms']:.2f} ms{extra} |"
            )
    notes = [n for r in [*loop, *slow] for n in r["job_notes"]]
    if notes:
        lines.extend(["", "Notes from aoed's jobs: " + "; ".join(sorted(set(notes))) + "."])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds, a smaller grid, the slow link for fc only",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results file to write into")
    ap.add_argument("--link", choices=("loopback", "slow", "both"), default="both")
    ap.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, of {', '.join(MODELS)} (default all); fp16 runs on fc only",
    )
    # the slow-link half, run in the namespace
    ap.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-gdat-"))
    if args.inside is not None:
        plan = json.loads(args.inside.read_text())
        models = {n: export(n, work) for n in {n for n, _ in plan["plan"]}}
        results = trio.run(run_all, models, [tuple(p) for p in plan["plan"]], args.quick, work)
        args.inside.write_text(json.dumps(results))
        return 0

    chosen = [m for m in args.models.split(",") if m]
    if not chosen or set(chosen) - set(MODELS):
        ap.error(f"--models: choose from {', '.join(MODELS)}")
    host = Machine()
    loop: list[dict] = []
    slow: list[dict] = []
    slow_why = "not asked for (--link loopback)"
    if args.link in ("loopback", "both"):
        models = {n: export(n, work) for n in chosen}
        plan = [(n, "exact") for n in chosen] + ([("fc", "fp16")] if "fc" in chosen else [])
        loop = trio.run(run_all, models, plan, args.quick, work)
    if args.link in ("slow", "both"):
        plan = [p for p in (("fc", "exact"), ("fc", "fp16")) if "fc" in chosen] + [
            (n, "exact") for n in chosen if n != "fc" and not args.quick
        ]
        with slow_link() as why:
            if why is None:
                spec = work / "slow.json"
                spec.write_text(json.dumps({"plan": plan}))
                cmd = [
                    "ip",
                    "netns",
                    "exec",
                    NETNS,
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--inside",
                    str(spec),
                ]
                r = subprocess.run(cmd + (["--quick"] if args.quick else []), env=os.environ.copy())
                if r.returncode == 0:
                    slow = json.loads(spec.read_text())
                else:
                    slow_why = f"the run inside the namespace failed with status {r.returncode}"
            else:
                slow_why = why
    host.finish()
    text = render(host, loop, slow, slow_why, args.quick, chosen)
    from bench_bank import publish

    publish(text, args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    import signal

    # A terminated run still deletes its namespace (the finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(HERE))
    sys.exit(main())
