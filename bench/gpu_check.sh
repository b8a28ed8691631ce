#!/usr/bin/env bash
# The check for a lent NVIDIA GPU, in one call of at most 8 minutes: install the project
# with onnxruntime-gpu in a venv of its own (onnxruntime and onnxruntime-gpu must never
# share one), tune two models the bench builds, and write the comparison table
# (bench/gpu_check.py says what is measured) to $OUT/gpu_results.md, to be folded into
# bench/RESULTS.md.
#
#   bench/gpu_check.sh [--dry-run] [--wheels DIR] [--budget S]
#
# --dry-run   the same steps on the CPU with tiny models, in the current venv (.venv):
#             checks the script's logic here; its figures mean nothing
# --wheels D  install from wheel files in D only (a machine that reaches no package index:
#             onnxruntime-gpu, onnxconverter-common and the project's dependencies)
# Everything it writes goes under $OUT (default: out/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu_check}"
DRY=0 WHEELS="" BUDGET=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --wheels) WHEELS="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 AOED_RUNTIME_DIR="${AOED_RUNTIME_DIR:-$OUT/run}"

if [ "$DRY" = 1 ]; then
    PY="${PYTHON:-.venv/bin/python}"
else
    nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
    VENV="${GPU_VENV:-/tmp/aoed-gpu-venv}"
    python3 -m venv --clear "$VENV"
    PY="$VENV/bin/python"
    PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
    [ -n "$WHEELS" ] && PIP+=(--no-index --find-links "$WHEELS")
    # The swap docs/tuning.md describes, done up front: the dependencies of the client
    # (with its grpc extra) and of the daemon but onnxruntime and the client itself, the
    # GPU extra and onnxruntime-gpu, then both distributions without dependencies: pip
    # would otherwise bring the CPU onnxruntime too.
    mapfile -t DEPS < <("$PY" - <<'PYEOF'
import re, tomllib
client = tomllib.load(open("client/pyproject.toml", "rb"))["project"]
daemon = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = client["dependencies"] + client["optional-dependencies"]["grpc"]
deps += daemon["dependencies"] + daemon["optional-dependencies"]["gpu"] + ["onnxruntime-gpu>=1.20"]
for dep in deps:
    if re.match(r"(onnxruntime|aoed-client)\b(?!-gpu)", dep) is None:
        print(dep)
PYEOF
)
    "${PIP[@]}" "${DEPS[@]}"
    "${PIP[@]}" --no-deps -e ./client -e .
    "$PY" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" | tee "$OUT/providers.txt"
fi
ARGS=(--out "$OUT")
[ "$DRY" = 1 ] && ARGS+=(--dry-run)
[ -n "$BUDGET" ] && ARGS+=(--budget "$BUDGET")
timeout 420 "$PY" bench/gpu_check.py "${ARGS[@]}" 2>&1 | tee "$OUT/gpu_check.log"
