PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# MODEL names a model bin/fetch-model knows: `make run MODEL=gemma3`
MODEL  ?= smollm2
MODEL_FILE_smollm2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_FILE_gemma3  := models/gemma-3-270m-q4_k_m.gguf
MODEL_FILE_qwen    := models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
MODEL_FILE := $(MODEL_FILE_$(MODEL))
ifeq ($(MODEL_FILE),)
$(error unknown MODEL '$(MODEL)' (known: smollm2, gemma3, qwen))
endif

.PHONY: run serve test fuzz fuzz-hostile setup model models lint bench clean

## run: set up, fetch the model (MODEL=smollm2, gemma3 or qwen) and generate 32 tokens with the prealloc KV cache
run: setup model
	$(BIN)/model-generate --kv prealloc $(MODEL_FILE) "Once upon a time" 32

## serve: set up, fetch the model and serve it over the OpenAI API on http://127.0.0.1:8080 (model-serve)
serve: setup model
	$(BIN)/model-serve $(MODEL_FILE)

## test: set up, fetch every model the tests use and run the test suite
test: setup models
	$(BIN)/pytest -q

## fuzz: 5,000 mutated GGUF files through model-generate with Numba's bounds checks on (make test runs
## 1,360 without them). Bounds-checked kernels compile into their own cache: Numba's cache key ignores
## the flag. A first case alone compiles them once, before the workers start.
FUZZ_ENV := NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR=build/numba-boundscheck
fuzz: setup
	$(FUZZ_ENV) $(BIN)/python tests/gguf_fuzz.py --cases 1 --workers 1 > /dev/null
	$(FUZZ_ENV) $(BIN)/python tests/gguf_fuzz.py --cases 5000 --first-seed 100000

## fuzz-hostile: 1,200 generated hostile inputs (--batch lines, config.json files, kv-memcalc flags, chat
## templates, snapshots, every command's flags and file paths, model-serve's HTTP requests), each a
## subprocess: one line and exit 2, or a run; never a traceback, a signal, a hang, or a refusal past 1 GB
fuzz-hostile: setup
	$(BIN)/python tests/hostile_fuzz.py --cases 1200 --seed 1000

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

model: $(MODEL_FILE)

models: $(MODEL_FILE_smollm2) $(MODEL_FILE_gemma3) $(MODEL_FILE_qwen)

$(MODEL_FILE_smollm2):
	PYTHON=$(BIN)/python bin/fetch-model smollm2

$(MODEL_FILE_gemma3):
	PYTHON=$(BIN)/python bin/fetch-model gemma3

$(MODEL_FILE_qwen):
	PYTHON=$(BIN)/python bin/fetch-model qwen

lint: setup
	$(BIN)/ruff check .

bench: setup model
	$(BIN)/python -m inferno.bench --model $(MODEL_FILE)

clean:
	rm -rf $(VENV) build *.egg-info
