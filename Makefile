# Two entry points for a fresh Debian machine (as root): `make demo` and `make test`.
# Both install what is missing first (scripts/setup.sh), so they are safe to run repeatedly.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-test demo test pytest lint bench bundle clean

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh --test

demo: setup
	@$(PY) -m recorder.demo_live

test: setup-test
	@$(PY) -m ruff check recorder store mcp_server bpf tests benchmarks
	@.venv/bin/lint-imports --no-cache
	@$(PY) -m mypy
	@$(PY) scripts/cli_reference.py --check
	@$(MAKE) --no-print-directory pytest

# The tests in two runs: those without real probes on both CPUs (a file to a worker), then the
# `bpf` ones (tests/conftest.py marks them) one at a time, as the machine's load moves what they
# measure. Both run whatever the first found; a run that PYTEST_ARGS leaves with no test (exit
# status 5) is not a failure.
pytest:
	@failed=0; \
	$(PY) -m pytest -q -ra --durations=20 -n 2 --dist loadfile -m 'not bpf' $(PYTEST_ARGS) || [ $$? -eq 5 ] || failed=1; \
	$(PY) -m pytest -q -ra --durations=40 -m bpf $(PYTEST_ARGS) || [ $$? -eq 5 ] || failed=1; \
	exit $$failed

lint: setup-test
	@$(PY) -m ruff check recorder store mcp_server bpf tests benchmarks
	@.venv/bin/lint-imports --no-cache
	@$(PY) -m mypy
	@$(PY) scripts/cli_reference.py --check

bench: setup-test
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0  # the training-job benchmark
	@$(PY) benchmarks/run_all.py

# The offline bundle for nodes without BCC, a compiler or a suitable Python (docs/deploy.md)
bundle: setup
	@$(PY) scripts/build_bundle.py

clean:
	rm -rf build .pytest_cache .ruff_cache *.egg-info

-include kernel-patches/check.mk
