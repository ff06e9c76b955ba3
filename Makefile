# Quick start: `make demo` (train a small GPT on 4 CPU ranks next to DDP) and `make test`.
# Each target sets up .venv on a fresh machine first. torch is pinned to 2.13.0 here (and only
# here): pip takes the local CPU build where one is on disk (our CI machines); elsewhere PyPI's
# Linux wheel is the CUDA build, so install torch from the CPU index into .venv first (README).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.fshard-installed
export GLOO_SOCKET_IFNAME ?= lo

.PHONY: setup demo test test-long lint typecheck docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check numpy -e ".[test,docs,hf,examples,dev,plot]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh 4 --steps 20

test: $(STAMP)
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -q tests; \
	  rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check fshard tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy fshard

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis
