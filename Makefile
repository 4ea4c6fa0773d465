PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run test fuzz setup model lint bench clean

## run: set up, fetch the default model and generate 32 tokens with the prealloc KV cache
run: setup model
	$(BIN)/model-generate --kv prealloc $(MODEL) "Once upon a time" 32

## test: set up, fetch the default model and run the test suite
test: setup model
	$(BIN)/pytest -q

## fuzz: 5,000 mutated GGUF files through model-generate with Numba's bounds checks on (make test runs
## 1,020 without them). Bounds-checked kernels compile into their own cache: Numba's cache key ignores
## the flag. A first case alone compiles them once, before the workers start.
FUZZ_ENV := NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=build/numba-boundscheck
fuzz: setup
	$(FUZZ_ENV) $(BIN)/python tests/gguf_fuzz.py --cases 1 --workers 1 > /dev/null
	$(FUZZ_ENV) $(BIN)/python tests/gguf_fuzz.py --cases 5000 --first-seed 100000

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
	$(BIN)/python bin/bench

clean:
	rm -rf $(VENV) build *.egg-info
