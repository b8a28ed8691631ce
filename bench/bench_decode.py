"""Decoding with a KV cache as a generation loop runs it: decode tokens per second at
several past lengths, and prefill tokens per second, as deployed, written into
bench/RESULTS.md.

    python bench/bench_decode.py [--quick] [--budget S] [--no-write] [--out bench/RESULTS.md]

Two decoders, random weights, each one step of a generation loop with the past length
dynamic:

- the repository's KV-cache decoder sample (aoed.samples.kv_decoder: a pre-norm
  GPT-style decoder exported by torch.onnx's dynamo exporter) at SIZE below; its step
  takes one token, so it is timed at decode only;
- a Qwen2-style decoder as transformers builds it (bench/torch_models.py `hf_qwen2_kv`:
  grouped-query attention, rotary positions; a random-weight checkpoint saved with
  `save_pretrained`, and one step exported by the dynamo exporter with `seq` and `past`
  dynamic), timed at decode and at prefill (PROMPT tokens, no past).

Each gets `aoe tune --precision int8` and `--precision int4` with no shape flag (the job
derives its profile), and quantize_dynamic's model. The Qwen2 checkpoint also goes
through onnxruntime-genai's model builder at int4 (`python -m
onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p int4 -e cpu`, its defaults: the
int4 anchor), and at fp32, which is not timed: its logits against the export's, on the
same synthetic past, show that the builder's KV layout (`past_key_values.L.key`,
[batch, kv heads, past, head], keys after the rotary embedding) takes the same values as
the export's, so every logits' cosine below is on one synthetic past.

At each step, every model is timed with one onnxruntime session per process, in turns
(bench/deployed.py): the models aoe shipped are opened with `aoe.session`, the others
with onnxruntime's defaults; one step per run, so decode tokens per second is 1000 / the
median step in ms, prefill tokens per second PROMPT * 1000 / the median. The logits'
cosine against the input model's is given for each.

Targets: aoe int8 decode tokens/s >= 1.3x the input model at every past length (both
decoders); aoe int4 decode tokens/s >= onnxruntime-genai's int4 at every past length
(Qwen2).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import deployed
import measure
from bench_bank import publish
from machine import Machine
from run import Log, aoe_tune, holding_device, quantize

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- decode:begin -->", "<!-- decode:end -->"
PASTS = (16, 256, 1024)
#: prefill: prompt tokens in one step, no past
PROMPT = 128
SIZE = {"hidden": 384, "heads": 6, "layers": 4, "vocab": 2048, "max_positions": 2048}
#: the decode target: aoe int8 over the input model at every past length
INT8_TARGET = 1.3
GENAI_BUILD_TIMEOUT_S = 600.0
#: the builder's names for the cache (its genai_config.json says them too)
GENAI_PAST = "past_key_values.{layer}.{kind}"
#: variants, in the order tables list them; "genai" only where a checkpoint exists
LABELS = {
    "input": "input",
    "qdyn": "quantize_dynamic",
    "int8": "aoe int8",
    "int4": "aoe int4",
    "genai": "genai int4",
}


@dataclass(frozen=True)
class Decoder:
    """One decoder under test: its step's ONNX file, how to feed it at a past length and
    a number of new tokens, and (where it has one) the checkpoint genai's builder reads."""

    name: str
    src: Path
    describe: str
    feed: Callable[[int, int], dict[str, np.ndarray]]
    checkpoint: Path | None = None
    prefill: bool = False


def _sample_feed(past: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(past)
    head_dim = SIZE["hidden"] // SIZE["heads"]
    feed = {"input_ids": rng.integers(1, SIZE["vocab"], (1, seq)).astype(np.int64)}
    for i in range(SIZE["layers"]):
        for kind in ("key", "value"):
            feed[f"past_{kind}_{i}"] = rng.standard_normal(
                (1, SIZE["heads"], past, head_dim)
            ).astype(np.float32)
    return feed


def _qwen2_feed(info: Mapping) -> Callable[[int, int], dict[str, np.ndarray]]:
    def feed(past: int, seq: int) -> dict[str, np.ndarray]:
        """The export's inputs and, holding the same arrays, the builder's names for the
        cache (each worker takes the inputs its model has)."""
        rng = np.random.default_rng(past + seq)
        out = {
            "input_ids": rng.integers(1, info["vocab"], (1, seq)).astype(np.int64),
            "attention_mask": np.ones((1, past + seq), np.int64),
            "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
        }
        for i in range(info["layers"]):
            for kind in ("key", "value"):
                a = rng.standard_normal((1, info["kv_heads"], past, info["head_dim"]))
                out[f"past_{kind}_{i}"] = a.astype(np.float32)
                out[GENAI_PAST.format(layer=i, kind=kind)] = out[f"past_{kind}_{i}"]
        return out

    return feed


def _qwen2(work: Path) -> Decoder:
    """bench/torch_models.py hf_qwen2_kv in a child process (torch stays out of this
    one); RuntimeError with its last words when it fails."""
    out = work / "qwen2"
    cmd = [sys.executable, str(HERE / "torch_models.py"), "hf_qwen2_kv", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hf_qwen2_kv: {proc.stderr.strip().splitlines()[-1:]}")
    info = json.loads((out / "info.json").read_text())
    return Decoder(
        "Qwen2",
        Path(info["model"]),
        f"{info['description']}; the export's logits within {info['export_max_abs_error']:.1e} "
        "of torch's",
        _qwen2_feed(info),
        checkpoint=Path(info["checkpoint"]),
        prefill=True,
    )


def _genai(checkpoint: Path, precision: str, out: Path) -> Path:
    """onnxruntime-genai's model builder on the checkpoint folder (no download): its
    model.onnx; RuntimeError with its last words when it fails."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint)]
    cmd += ["-o", str(out), "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai_cache")]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=GENAI_BUILD_TIMEOUT_S, check=False
    )
    if proc.returncode != 0 or not (out / "model.onnx").exists():
        raise RuntimeError(f"genai builder -p {precision}: {proc.stderr.strip()[-300:]}")
    return out / "model.onnx"


def _logits(path: Path, feed: Mapping[str, np.ndarray], tuned: bool) -> np.ndarray:
    """`path`'s logits on the inputs of `feed` it has: a model aoe shipped opened with
    `aoe.session`, any other with onnxruntime's defaults."""
    import onnxruntime as ort

    import aoe

    sess = (
        aoe.session(path)
        if tuned
        else ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    )
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["logits"], {k: v for k, v in feed.items() if k in names})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return measure.accuracy([[a]], [[b]]).cosine


def _op_counts(path: Path) -> collections.Counter[str]:
    """How many nodes of each operator `path`'s graph has (none for an OpenVINO IR)."""
    import onnx

    if path.suffix != ".onnx":
        return collections.Counter()
    model = onnx.load(str(path), load_external_data=False)
    return collections.Counter(n.op_type for n in model.graph.node)


def _ops(path: Path) -> str:
    """The operators of `path`'s graph, most frequent first (a few), as text."""
    if path.suffix != ".onnx":
        return f"an OpenVINO IR ({path.name})"
    return ", ".join(f"{op} {n}" for op, n in _op_counts(path).most_common(8))


#: the fused operators a decoder's graph can hold, and what each does in one node
FUSED = {
    "MatMulNBits": "int4 blocks of weights times activations",
    "GroupQueryAttention": "rotary embedding, the cache's concatenation and the attention",
    "SkipSimplifiedLayerNormalization": "residual add and RMSNorm",
    "SimplifiedLayerNormalization": "RMSNorm",
    "DynamicQuantizeMatMul": "int8 activations times int8 weights",
    "MatMulInteger": "int8 activations times int8 weights",
}


#: runtimes as people spell them
RUNTIMES = {"openvino": "OpenVINO", "onnxruntime": "onnxruntime"}


def _searched(doc: Mapping) -> str:
    """Where an `aoe tune` job searched and checked: input_ids' shape at its profile's
    points (the middle one searched), as text."""
    profile = doc.get("shape_profile") or {}
    points = profile.get("points") or []
    if not points:
        return "its one fixed shape"
    shapes = ", ".join(str(pt.get("input_ids")) for pt in points)
    searched = points[profile.get("representative", 0)].get("input_ids")
    return f"input_ids {shapes}, searched at {searched}"


def _int4_rejections(doc: Mapping) -> tuple[int, int]:
    """(int4 candidates the job's search judged not clearly faster than what it kept,
    int4 candidates measured)."""
    tried = rejected = 0
    for task in doc.get("tasks", []):
        for cand in task.get("candidates", []):
            if cand.get("strategy", "").startswith("int4") and cand.get("ok"):
                tried += 1
        rejected += sum(1 for r in task.get("rejected", []) if r.startswith("int4"))
    return rejected, tried


def _shipped(doc: Mapping, path: Path) -> str:
    """What a job shipped, in words: the input, onnxruntime's graph, or another runtime
    with its options."""
    conf = doc.get("confirmation", {})
    if conf.get("shipped") == "input":
        return "the input model (its verdict: " + conf.get("verdict", "n/a") + ")"
    runtime = doc.get("runtime", "onnxruntime")
    if runtime == "onnxruntime":
        return f"an onnxruntime graph ({_ops(path)})"
    options = ", ".join(f"{k} {v}" for k, v in (doc.get("runtime_options") or {}).items())
    name = RUNTIMES.get(runtime, runtime)
    return f"an {name} model ({options or 'its defaults'}), no ONNX graph"


def _why(models: Mapping[str, deployed.Model], docs: Mapping[str, Mapping]) -> str:
    """The Qwen2 graphs side by side (the fused operators each has, against the input's
    MatMuls), and what aoe's jobs did and where, as sentences of facts."""
    counts = {k: _op_counts(models[k].path) for k in ("input", "genai")}

    def fused(k: str) -> str:
        got = [f"{op} {counts[k][op]}" for op in FUSED if counts[k][op]]
        return ", ".join(got) or "none"

    rejected, tried = _int4_rejections(docs["int4"])
    return (
        f"The Qwen2 graphs: the input model has MatMul {counts['input']['MatMul']}, fused "
        f"operators: {fused('input')}; genai int4 has {fused('genai')} ("
        + "; ".join(f"{op}: {what}" for op, what in FUSED.items() if counts["genai"][op])
        + "). aoe shipped, at int8: "
        + _shipped(docs["int8"], models["int8"].path)
        + "; at int4: "
        + _shipped(docs["int4"], models["int4"].path)
        + f". Both jobs' shape profiles hold {_searched(docs['int4'])}; a decode step is "
        "input_ids [1, 1]. "
        f"The int4 job judged {rejected} of the {tried} int4 candidates it measured there not "
        "clearly faster than what it kept."
    )


@dataclass
class Row:
    """One step of one decoder: tokens/s and logits' cosine per variant, and ratios."""

    decoder: str
    step: str  # "decode, past 16" or "prefill, 128 tokens"
    tps: dict[str, float]
    cos: dict[str, float]
    ratios: dict[str, measure.Ratio | None]
    errors: dict[str, str]


def _measure(
    decoder: Decoder,
    variants: Mapping[str, deployed.Model],
    past: int,
    seq: int,
    rounds: int,
    log: Log,
) -> Row:
    feed = decoder.feed(past, seq)
    step = f"decode, past {past}" if seq == 1 else f"prefill, {seq} tokens"
    log(f"{decoder.name} {step}: {rounds} rounds, one session per process")
    lat, errors = holding_device(
        lambda: deployed.latencies(variants, feed, rounds=rounds, budget_s=150.0, samples=20),
        log,
    )
    reference = _logits(decoder.src, feed, False)
    cos = {
        k: _cosine(reference, _logits(m.path, feed, m.tuned))
        for k, m in variants.items()
        if k != "input"
    }
    ratios = {
        "int8/input": measure.ratio(lat.get("input"), lat.get("int8")),
        "int4/input": measure.ratio(lat.get("input"), lat.get("int4")),
        "int8/qdyn": measure.ratio(lat.get("qdyn"), lat.get("int8")),
        "int4/genai": measure.ratio(lat.get("genai"), lat.get("int4")),
    }
    tps = {k: seq * 1000.0 / v.median_ms for k, v in lat.items()}
    return Row(decoder.name, step, tps, cos, ratios, errors)


def _cell(row: Row, key: str) -> str:
    return f"{row.tps[key]:.0f}" if key in row.tps else "n/a"


def _row_text(row: Row) -> str:
    r = row.ratios
    cos = " | ".join(
        f"{row.cos[k]:.5f}" if k in row.cos else "n/a" for k in ("int8", "int4", "qdyn", "genai")
    )
    errors = "; ".join(f"{LABELS[k]}: {v}" for k, v in row.errors.items())
    return (
        f"| {row.decoder} | {row.step} | "
        + " | ".join(_cell(row, k) for k in LABELS)
        + f" | {measure.ratio_text(r['int8/input'])} | {measure.ratio_text(r['int4/input'])} | "
        f"{measure.ratio_text(r['int8/qdyn'])} | {measure.ratio_text(r['int4/genai'])} | {cos} |"
        + (f" {errors}" if errors else "")
    )


def _met(rows: list[Row], key: str, at_least: float) -> bool:
    return all(r.ratios[key] is not None and r.ratios[key].median >= at_least for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = measure.shape_bench_args(__doc__, RESULTS, argv)
    from aoed import samples

    log, host = Log(), Machine()
    rounds = 7 if args.quick else 15
    work = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    log("building the decoders")
    sample = Decoder(
        "sample",
        samples.save(samples.kv_decoder(**SIZE), work / "decoder.onnx"),
        f"the repository's KV-cache decoder sample at {SIZE['layers']} layers, hidden "
        f"{SIZE['hidden']}, {SIZE['heads']} heads, vocabulary {SIZE['vocab']}, position table "
        f"{SIZE['max_positions']}",
        _sample_feed,
    )
    try:
        qwen2 = _qwen2(work)
        assert qwen2.checkpoint is not None
        log("onnxruntime-genai's model builder: int4, and fp32 (for the cache layout)")
        genai = _genai(qwen2.checkpoint, "int4", work / "genai_int4")
        genai_fp32 = _genai(qwen2.checkpoint, "fp32", work / "genai_fp32")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench_decode: {exc}", file=sys.stderr)
        return 1
    variants: dict[str, dict[str, deployed.Model]] = {}
    docs: dict[str, dict[str, Mapping]] = {}
    notes: list[str] = []
    for decoder in (sample, qwen2):
        peer = quantize(decoder.src, decoder.src.with_name(f"{decoder.src.stem}_qdyn.onnx"))
        models = {"input": deployed.Model(decoder.src)}
        if peer.path is not None:
            models["qdyn"] = deployed.Model(peer.path)
        said, took = "", []
        docs[decoder.name] = {}
        for precision in ("int8", "int4"):
            log(f"{decoder.name}: aoe tune --precision {precision} (no shape flags)")
            job = aoe_tune(
                decoder.src,
                precision,
                work / f"bank_{decoder.name}_{precision}",
                work / f"{decoder.name}_{precision}",
                args.budget,
            )
            if job.error or not job.doc:
                print(f"{decoder.name}: aoe tune {precision} failed: {job.error}", file=sys.stderr)
                return 1
            models[precision] = deployed.Model(Path(job.doc["tuned_model"]), tuned=True)
            docs[decoder.name][precision] = job.doc
            verdict = job.doc.get("confirmation", {}).get("verdict", "n/a")
            took.append(f"{precision} took {job.wall_s:.0f} s, verdict: {verdict}")
            said = said or next((n for n in job.doc["notes"] if n.startswith("shape profile:")), "")
        if decoder.checkpoint is not None:
            models["genai"] = deployed.Model(genai)
        variants[decoder.name] = models
        axes = said.split("; ")[-1] if said else "none said"
        notes.append(f"{decoder.name}: the jobs' shape profile: {axes}; {'; '.join(took)}")
    rows: dict[str, list[Row]] = {"sample": [], "Qwen2": []}
    for decoder in (sample, qwen2):
        for past in PASTS:
            rows[decoder.name].append(
                _measure(decoder, variants[decoder.name], past, 1, rounds, log)
            )
    layout = min(
        _cosine(_logits(qwen2.src, f, False), _logits(genai_fp32, f, False))
        for f in (qwen2.feed(p, 1) for p in PASTS)
    )
    prefill = _measure(qwen2, variants["Qwen2"], 0, PROMPT, rounds, log)
    host.finish()
    decode = rows["sample"] + rows["Qwen2"]
    int8_ok = _met(decode, "int8/input", INT8_TARGET)
    int4_ok = _met(rows["Qwen2"], "int4/genai", 1.0)
    graphs = "; ".join(
        f"{LABELS[k]}: {_ops(variants['Qwen2'][k].path)}" for k in ("int8", "int4", "genai")
    )
    why = _why(variants["Qwen2"], docs["Qwen2"])
    lines = [
        "## Decoding with a KV cache: tokens per second as deployed (`python bench/bench_decode.py`)",
        "",
        f"Machine: {host.describe('onnxruntime', 'onnx', 'torch', 'transformers', 'onnxruntime-genai')}.",
        "",
        "Two decoders, **synthetic** (random weights; a random past and random tokens at each "
        f"length), each one step of a generation loop with the past length dynamic: {sample.describe} "
        "(its step takes one token: decode only); and " + qwen2.describe + ". The Qwen2 "
        "checkpoint (saved with `save_pretrained`) also went through onnxruntime-genai's model "
        "builder, `python -m onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p int4 -e "
        "cpu` with its defaults (block 32, accuracy level 4): **genai int4**, the int4 anchor, "
        "timed as a plain onnxruntime session like the others (its own input names; the same "
        "past values). Its fp32 build's logits match the export's at cosine "
        f"{layout:.6f} or above at every past length: the builder's cache layout takes the "
        "same values, so every cosine below is on one synthetic past (against the input "
        f"model's logits). `aoe tune --precision int8` and `--precision int4`, `--budget "
        f"{args.budget:g}`, with no shape flag ({'. '.join(notes)}). Each step: every model, "
        f"one onnxruntime session per process in turns (bench/deployed.py), {rounds} rounds; "
        "decode tokens/s is 1000 / the median step (ms), prefill tokens/s "
        f"{PROMPT} x 1000 / the median step (the prompt in one step, no past); speedups are the "
        "median of the per-round ratios with a 95% interval.",
        "",
        "| model | step | input tokens/s | quantize_dynamic tokens/s | aoe int8 tokens/s | aoe "
        "int4 tokens/s | genai int4 tokens/s | aoe int8 vs input | aoe int4 vs input | aoe int8 "
        "vs quantize_dynamic | aoe int4 vs genai int4 | logits cosine (aoe int8) | (aoe int4) | "
        "(quantize_dynamic) | (genai int4) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row_text(r) for r in (*decode, prefill)),
        "",
        f"Targets: aoe int8 >= {INT8_TARGET}x the input model's decode tokens/s at every past "
        f"length, both decoders: **{'PASS' if int8_ok else 'MISS'}**. aoe int4 >= genai int4's "
        f"decode tokens/s at every past length (Qwen2): **{'PASS' if int4_ok else 'MISS'}**.",
        "",
        why,
        "",
        f"The Qwen2 graphs' operators (most frequent): {graphs}.",
    ]
    publish("\n".join(lines), args.out, BEGIN, END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
