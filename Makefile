# clover-gguf developer targets. Each of `make demo` and `make test` makes the virtual environment it needs first
# (.venv, from pyproject.toml: the package for the demo, plus the test extra for the tests), then the patched
# llama.cpp (cached in ~/.cache/clover-gguf). PY may name another interpreter, whose environment is then yours.
VENV ?= .venv
# CLI: what `make demo` ends by naming, the venv's clover-gguf (on PATH only once the venv is activated)
ifeq ($(origin PY),undefined)
PY := $(VENV)/bin/python
CORE_ENV := $(VENV)/.core
TEST_ENV := $(VENV)/.test
CLI := $(VENV)/bin/clover-gguf
CLI_NOTE := or, after running . $(VENV)/bin/activate once in your shell, clover-gguf as the README writes it
else
CLI := $(PY) -m clover_gguf
CLI_NOTE := the README writes it clover-gguf
endif
DEMO_DIR ?= out/demo

.PHONY: venv test test-fast demo llama mlx browser screenshots clean

# setuptools tells every editable install "Please be careful with folders in your working directory...": a note for
# its own users that reads like a warning to ours; this filter drops that one note (the build backend inherits it)
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# the test extra's torch: the CPU build (PyTorch's CPU index; PyPI's Linux torch is the CUDA one, several GB), unless
# pip's own configuration already holds it (a local wheel: --no-index finds it silently). TORCH_INDEX=URL: another.
TORCH := $(shell grep -o '"torch==[^"]*"' pyproject.toml | head -n 1 | tr -d '"')
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# the package with serve's extra (what the demo and the README's Use need) and with the test extra; redone when
# pyproject.toml changes
$(VENV)/.core: pyproject.toml
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(EDITABLE) $(VENV)/bin/python -m pip install -q -e '.[serve]'
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(VENV)/bin/python -m pip install -q --no-deps --no-index '$(TORCH)' 2>/dev/null || \
		$(VENV)/bin/python -m pip install -q --no-deps --index-url $(TORCH_INDEX) '$(TORCH)'
	$(EDITABLE) $(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.test

# Every test, the slow ones included (`make test-fast`: pytest -m "not slow"; times in the README).
test: $(TEST_ENV) llama browser
	$(PY) -m pytest -q

test-fast: $(TEST_ENV) llama browser
	$(PY) -m pytest -q -m "not slow"

# The chat page's tests (tests/test_chat_page.py) drive Debian's headless Chromium through its chromedriver: installed
# from apt where missing (as root, or through sudo), never downloaded from anywhere else. CLOVER_GGUF_CHROMEDRIVER and
# CLOVER_GGUF_CHROMIUM name other ones (another system's), which this leaves alone.
CHROMEDRIVER := $(or $(CLOVER_GGUF_CHROMEDRIVER),/usr/bin/chromedriver)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@test -x $(CHROMEDRIVER) || { \
		echo "installing Debian's chromium and chromium-driver (apt) for the chat page's tests"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

# The pictures of the chat page in docs/ (and the README), made by the tests' browser
screenshots: $(TEST_ENV) llama browser
	CLOVER_GGUF_SCREENSHOTS=docs $(PY) -m pytest -q tests/test_chat_page.py -k screenshots

# Not --quiet: the first build takes minutes and prints its progress (a line per tenth when not on a terminal).
BACKEND ?= cpu
llama: $(CORE_ENV)
	$(PY) -m clover_gguf build-llama --backend $(BACKEND) $(if $(JOBS),--jobs $(JOBS)) $(if $(CUDA_ARCH),--cuda-arch '$(CUDA_ARCH)')

# The main job on the bundled default model: convert, quantize, answer a few prompts in each mode with stats; then one
# agent turn on the tool-trained tiny model (serve, the openai SDK: a tool call, its result, the answer).
DEMO_PROMPTS ?= "Count from 12 to 17." "What is 34 + 58?" "Reverse: c l o v e r"
demo: $(CORE_ENV) llama
	mkdir -p $(DEMO_DIR)
	$(PY) -m clover_gguf convert clover_gguf/assets/tiny-clover -o $(DEMO_DIR)/tiny-clover-f32.gguf --outtype f32 --force --quiet
	$(PY) -m clover_gguf quantize $(DEMO_DIR)/tiny-clover-f32.gguf $(DEMO_DIR)/tiny-clover-q8_0.gguf --type Q8_0 --force --quiet
	$(PY) -m clover_gguf info $(DEMO_DIR)/tiny-clover-q8_0.gguf
	@for mode in ar diffusion draft-self; do for p in $(DEMO_PROMPTS); do \
		echo "== $$mode: $$p"; \
		$(PY) -m clover_gguf generate $(DEMO_DIR)/tiny-clover-q8_0.gguf -p "$$p" --mode $$mode --stats || exit 1; \
	done; done
	$(PY) -m clover_gguf.testing.agent --out $(DEMO_DIR)
	@echo '== done. Run the commands of the README (Use) as $(CLI) ($(CLI_NOTE)).'

# Clover on Apple's MLX (docs/mac.md): the mlx extra into the same environment, the checkout kept editable (a plain
# `pip install '.[mlx]'` would replace the editable install with a copy of today's files)
mlx: $(CORE_ENV)
	$(EDITABLE) $(PY) -m pip install -q -e '.[serve,mlx]'
	$(PY) -m clover_gguf doctor | grep '^mlx'

clean:
	rm -rf out .pytest_cache
