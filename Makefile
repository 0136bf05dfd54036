# clover-gguf developer targets. PY is the project's virtual environment when it exists.
PY ?= $(shell test -x .venv/bin/python && echo .venv/bin/python || echo python3)
DEMO_DIR ?= out/demo

.PHONY: venv test demo llama clean

venv:
	python3 -m venv .venv
	.venv/bin/python -m pip install -q --upgrade pip
	.venv/bin/python -m pip install -q -e '.[test]'

# The tests. The llama.cpp parity tests need the patched library: `make llama` builds it once (cached).
test: llama
	$(PY) -m pytest -q

# Not --quiet: the first build takes minutes and prints its progress (a line per tenth when not on a terminal).
BACKEND ?= cpu
llama:
	$(PY) -m clover_gguf build-llama --backend $(BACKEND) $(if $(JOBS),--jobs $(JOBS)) $(if $(CUDA_ARCH),--cuda-arch '$(CUDA_ARCH)')

# The main job on the bundled default model: convert, quantize, answer a few prompts in each mode with stats.
DEMO_PROMPTS ?= "Count from 12 to 17." "What is 34 + 58?" "Reverse: c l o v e r"
demo: llama
	mkdir -p $(DEMO_DIR)
	$(PY) -m clover_gguf convert clover_gguf/assets/tiny-clover -o $(DEMO_DIR)/tiny-clover-f32.gguf --outtype f32 --force --quiet
	$(PY) -m clover_gguf quantize $(DEMO_DIR)/tiny-clover-f32.gguf $(DEMO_DIR)/tiny-clover-q8_0.gguf --type Q8_0 --force --quiet
	$(PY) -m clover_gguf info $(DEMO_DIR)/tiny-clover-q8_0.gguf
	@for mode in ar diffusion draft-self; do for p in $(DEMO_PROMPTS); do \
		echo "== $$mode: $$p"; \
		$(PY) -m clover_gguf generate $(DEMO_DIR)/tiny-clover-q8_0.gguf -p "$$p" --mode $$mode --stats || exit 1; \
	done; done

clean:
	rm -rf out .pytest_cache
