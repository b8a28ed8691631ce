# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SAMPLE ?= cnn
OUT    ?= out

.PHONY: run test protos clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Tune a sample model embedded (no daemon) and print baseline, tuned and where outputs are.
run: $(STAMP)
	$(BIN)/python -m aoed.samples $(SAMPLE) -o $(OUT)/models
	$(BIN)/aoe tune $(OUT)/models/$(SAMPLE).onnx --output $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos \
	    --python_out=client --grpc_python_out=client --pyi_out=client \
	    protos/aoe/v1/*.proto

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info
