# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
GDAT_STAMP := $(VENV)/.gdat-stamp
OPENVINO_STAMP := $(VENV)/.openvino-stamp
TENSORFLOW_STAMP := $(VENV)/.tensorflow-stamp
# The CPU build of torch the GDAT tests run on: pinned here, not in the extra, so users
# with GPUs install theirs; this machine's wheel folder serves the CPU wheel.
TORCH_CPU ?= torch==2.13.0
SAMPLE ?= cnn
PRECISION ?= exact
OUT    ?= out
# pytest-xdist workers for `make test` and `make test-load`: four cases side by side (most
# wait on daemons, workers, sockets and their jobs' wall-clock budgets), each test stolen
# by whichever worker is free (a module's fixtures may then run in several). Each worker
# locks a device of its own (tests/conftest.py), and a test that needs the machine quiet
# holds every worker's. Under the load of `make test-load`, four took 592 s (890b4c3; 597 s
# at 484ea3f; 644 s at 9580aab, with one lock shared by the workers), one run each.
WORKERS ?= 4

.PHONY: run test test-long lint docs test-cluster test-load protos bench bench-quick clean soak

# Two distributions from this tree: the light client (client/, aoed-client) and the daemon
# (aoed), which requires aoed-client==0.1.0. Each pip call names both, so that the local
# client satisfies that requirement and everything else comes from the package index.
PROJECTS := pyproject.toml client/pyproject.toml
CLIENT := -e ./client

$(STAMP): $(PROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[test]'
	touch $(STAMP)

# Tune a sample model embedded (no daemon) and print baseline, tuned and where outputs are.
# It tunes into a bank of its own under $(OUT), so the first run is never answered from
# another bank (a second `make run` is: that is the bank-hit path).
run: $(STAMP)
	$(BIN)/python -m aoed.samples $(SAMPLE) -o $(OUT)/models
	$(BIN)/aoe tune $(OUT)/models/$(SAMPLE).onnx --precision $(PRECISION) --output $(OUT) --bank $(OUT)/bank

# torch for the GDAT tests: the CPU build explicitly first, then the extra (which it
# satisfies), so pip never reaches for a CUDA build.
$(GDAT_STAMP): $(STAMP) $(PROJECTS)
	$(BIN)/python -m pip install --quiet '$(TORCH_CPU)'
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[gdat]'
	touch $(GDAT_STAMP)

# OpenVINO and NNCF (the openvino extra), after the CPU torch so that nothing they bring
# reaches for another build.
$(OPENVINO_STAMP): $(GDAT_STAMP) $(PROJECTS)
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[gdat,openvino]'
	touch $(OPENVINO_STAMP)

# TensorFlow (CPU) and tf2onnx (the tensorflow extra), for SavedModel inputs; after the
# openvino stamp, so that pip resolves them beside everything installed before.
$(TENSORFLOW_STAMP): $(OPENVINO_STAMP) $(PROJECTS)
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[gdat,openvino,tensorflow]'
	touch $(TENSORFLOW_STAMP)

# The unit checks need systemd-analyze: installed from the distribution when missing and
# possible (root with apt-get), else those tests skip saying why.
test: $(STAMP) $(GDAT_STAMP) $(OPENVINO_STAMP) $(TENSORFLOW_STAMP)
	@command -v systemd-analyze >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	    && apt-get install -y -qq --no-install-recommends systemd >/dev/null 2>&1; } \
	    || echo "make: systemd-analyze is missing and could not be installed: the unit checks will skip"
	@echo "make test: about 7 min on an idle 2-core machine on 4 workers (1,354 tests in 405 s at eca83ce), about 10 min under make test-load (1,354 tests in 592 s at 890b4c3); later runs print an estimate from this machine's own durations"
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal -m "not soak and not cluster and not long"

# The cases marked long: each covers again, on another kind or a slower path, what a
# test in `make test` covers (the rest of the kill-point matrix: every job type and
# precision killed and resumed; restarts; a busy machine; the GPU check's dry run).
# About three minutes more; CI runs them after `make test`.
test-long: $(STAMP) $(GDAT_STAMP) $(OPENVINO_STAMP) $(TENSORFLOW_STAMP)
	$(BIN)/python -m pytest -q -m long

# The layout, the lint, the layering and the types (tests/test_structure.py runs the same four).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The reference parts of docs/ (each command's options, every setting with its default)
# rendered again from the code; tests/test_docs_reference.py fails while one differs.
docs: $(STAMP)
	$(BIN)/python -m aoed.docgen

# The tests that start a Ray cluster on this machine (three one-CPU nodes, one device each)
# and run a daemon on it: they need the cluster extra (ray), which `make test` leaves out.
CLUSTER_STAMP := $(VENV)/.cluster-stamp
$(CLUSTER_STAMP): $(STAMP) $(PROJECTS)
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[test,cluster]'
	touch $(CLUSTER_STAMP)

test-cluster: $(CLUSTER_STAMP)
	$(BIN)/python -m pytest -q -m cluster

# The suite as `make test` runs it, RUNS times (default 5) with LOOPS busy loops (default
# 2) beside it: each run's result and wall time, and how many were green.
RUNS  ?= 5
LOOPS ?= 2
test-load: $(STAMP) $(GDAT_STAMP) $(OPENVINO_STAMP) $(TENSORFLOW_STAMP)
	LOOPS=$(LOOPS) WORKERS=$(WORKERS) bench/suite_under_load.sh $(RUNS)

# Side-by-side benchmarks; they write bench/RESULTS.md and PNG plots beside it.
$(BENCH_STAMP): $(STAMP) $(GDAT_STAMP) $(PROJECTS)
	$(BIN)/python -m pip install --quiet $(CLIENT) -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/run.py
	$(BIN)/python bench/bench_claims.py
	$(BIN)/python bench/bench_bank.py
	$(BIN)/python bench/bench_cancel.py
	$(BIN)/python bench/bench_daemon.py
	$(BIN)/python bench/bench_sgat.py
	$(BIN)/python bench/bench_kernels.py
	$(BIN)/python bench/bench_gdat.py
	$(BIN)/python bench/bench_fleet.py
	$(BIN)/python bench/bench_dynamic.py
	$(BIN)/python bench/bench_decode.py

bench-quick: $(BENCH_STAMP)
	$(BIN)/python bench/run.py --quick
	$(BIN)/python bench/bench_claims.py --models hf_gpt2 --rounds 9
	$(BIN)/python bench/bench_bank.py --quick
	$(BIN)/python bench/bench_cancel.py --quick
	$(BIN)/python bench/bench_daemon.py --quick
	$(BIN)/python bench/bench_sgat.py --quick
	$(BIN)/python bench/bench_kernels.py --quick
	$(BIN)/python bench/bench_gdat.py --quick
	$(BIN)/python bench/bench_fleet.py --quick
	$(BIN)/python bench/bench_dynamic.py --quick --budget 20
	$(BIN)/python bench/bench_decode.py --quick --budget 20

# The suite's soak tests (kill -9 loops; `make test` leaves them out), then kill -9 of the
# daemon at 20 random points of its jobs (prints seeds, restarts and the bank entries
# verified intact), then 30 minutes of mixed load with the state dir on a 200 MB tmpfs
# filled and freed twice (needs root to mount it), then 10 minutes of every surface others
# reach attacked at once (hostile programs and records, a hostile peer, a flood on the
# metrics port: bench/soak_surfaces.py); their figures go into bench/RESULTS.md.
soak: $(STAMP) $(GDAT_STAMP)
	$(BIN)/python -m pytest -q -m soak
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/soak_disk.py --minutes 30
	$(BIN)/python bench/soak_surfaces.py --minutes 10

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos \
	    --python_out=client --grpc_python_out=client --pyi_out=client \
	    protos/aoe/v1/*.proto

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info client/build client/*.egg-info
