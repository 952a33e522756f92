# parnas: `make search` is the main job (search.yaml: about 4 minutes on a 2-core CPU, progress shown), `make test` runs the
# tests (`make test-fast`: the quick ones). All create .venv when absent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch first and pinned: an open range in a fresh venv pulls a multi-GB CUDA build.
# GPU users: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" make install
TORCH_SPEC ?= torch==2.13.0
# Developers and CI read WikiText from ../shared/data; users get it downloaded into ~/.cache/parnas.
ifneq ($(wildcard ../shared/data),)
export PARNAS_DATA_DIR ?= $(abspath ../shared/data)
endif
STEPS  ?= 300
PORT   ?= 8080

.PHONY: install test test-fast test-gpu search train lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# Every test, one pytest worker per core (pytest-xdist; a worker that finishes its share takes the slow tests
# another has queued); pytest ends with the 10 slowest and the total ("N passed in S s"). CI runs this.
test: install
	$(PY) -m pytest -q -n auto --dist worksteal --durations=10

# The edit-test loop: the tests not marked slow (under a minute on a 2-core CPU).
test-fast: install
	$(PY) -m pytest -q -n auto --dist worksteal -m "not slow" --durations=5

# The CUDA tests alone (pytest -m gpu): every command on the GPU, resume, checkpoints across devices, bf16,
# host syncs, the compiled step.
test-gpu: install
	$(PY) -m pytest -q -m gpu

# Style, then the layers (pyproject.toml [tool.importlinter]): imports point down and never in a circle. Both read
# the checkout as it is: every package sits where its import path says, so nothing is built or copied.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Starts search.yaml's NNI experiment and shows its trials' progress until it is done, then the architectures
# found (Ctrl-C stops it); the web UI stays up until `nnictl stop <id>`.
search: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/parnas launch --config search.yaml --port $(PORT) --wait

# A short training run of the fixed standard Transformer-XL on WikiText-2.
train: install
	$(VENV)/bin/parnas train --config wt2-seed --set train.max_steps=$(STEPS) --set train.warmup_steps=100 \
	    --set train.lr=1e-3 --set train.eval_every=$(STEPS) --set train.out_dir=runs/train

bench: install
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/search_step.py

clean:
	rm -rf runs lightning_logs .pytest_cache build .lint  # build, .lint: what older builds and lint runs left
