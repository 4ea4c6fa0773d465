PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run test setup model lint bench clean

## run: set up, fetch the default model and generate 32 tokens with the prealloc KV cache
run: setup model
	$(BIN)/model-generate --kv prealloc $(MODEL) "Once upon a time" 32

## test: set up, fetch the default model and run the test suite
test: setup model
	$(BIN)/pytest -q

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

model: $(MODEL)

$(MODEL):
	PYTHON=$(BIN)/python bin/fetch-model

lint: setup
	$(BIN)/ruff check .

bench: setup model
	$(BIN)/python -m inferno.bench

clean:
	rm -rf $(VENV) build *.egg-info
