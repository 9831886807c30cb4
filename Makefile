# tierline: the two commands are `make demo` and `make test`; each installs what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
PYTEST_ARGS ?=

.PHONY: install peers llama-server eval-peers gguf-converter chromium demo test lint bench bench-peers zoo images clean help

help:
	@echo "make demo    run the platform on localhost (cloud API, console, edge agent)"
	@echo "make test    run the test suite"
	@echo "make lint    ruff + mypy"
	@echo "make bench   benchmarks (JSON)"
	@echo "make install create .venv and install tierline[dev]"
	@echo "make peers   build (once, cached) and install tierline[peers]: llama.cpp for the peer benchmarks/tests"
	@echo "make llama-server  build (once, cached) llama.cpp's C++ server, the HTTP peer of bench engine --vs llamacpp"
	@echo "make images  build the container image tierline:latest (deploy/Dockerfile; cached)"

# Re-installs only when the project's dependency files change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The LiteLLM proxy for `tierline bench scale --vs litellm`, in a virtualenv of its own (its pins clash with ours).
bench-peers:
	test -x .venv-peers/bin/python || $(PYTHON) -m venv .venv-peers
	.venv-peers/bin/python -m pip install --quiet "litellm[proxy]==$$(sed -n 's/^litellm==//p' constraints.txt)"

# The third-party peers (tierline[peers]: llama.cpp through llama-cpp-python), compiled from source once into a
# wheel cache keyed by the CPU's features (llama.cpp builds for the host's instruction set), then installed from it.
CPU_FLAGS_HASH := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-8)
WHEEL_CACHE ?= $(HOME)/.cache/tierline-wheels/$(shell uname -m)-$(CPU_FLAGS_HASH)
# llama.cpp's AMX kernels crash on the zoo's small Q8_0 matrices (a segfault in ggml_backend_amx_mul_mat): built
# for this CPU without them where the compiler knows the flags.
NO_AMX := $(shell echo | cc -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -E - >/dev/null 2>&1 && echo '-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')
LLAMA_CMAKE_ARGS ?= $(if $(NO_AMX),-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)')
PEERS_STAMP := $(VENV)/.peers-stamp
$(PEERS_STAMP): $(STAMP)
	mkdir -p $(WHEEL_CACHE)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir -c constraints.txt --find-links $(WHEEL_CACHE) -w $(WHEEL_CACHE) llama-cpp-python
	$(BIN)/python -m pip install --quiet -c constraints.txt --find-links $(WHEEL_CACHE) -e '.[dev,peers]'
	touch $(PEERS_STAMP)

# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py with its gguf-py), which derive runs for GGUF
# exports: taken from the llama-cpp-python sdist of the pinned version (it vendors llama.cpp), unpacked once.
GGUF_CONVERTER := $(HOME)/.cache/tierline/llama-cpp-python-$(shell sed -n 's/^llama-cpp-python==//p' constraints.txt)-convert
$(GGUF_CONVERTER)/convert_hf_to_gguf.py: constraints.txt
	rm -rf $(GGUF_CONVERTER).tmp && mkdir -p $(GGUF_CONVERTER).tmp/sdist
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -c constraints.txt -d $(GGUF_CONVERTER).tmp/sdist llama-cpp-python
	tar -xzf $(GGUF_CONVERTER).tmp/sdist/llama_cpp_python-*.tar.gz -C $(GGUF_CONVERTER).tmp --strip-components=3 --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm -rf $(GGUF_CONVERTER).tmp/sdist $(GGUF_CONVERTER) && mv $(GGUF_CONVERTER).tmp $(GGUF_CONVERTER)

gguf-converter: $(STAMP) $(GGUF_CONVERTER)/convert_hf_to_gguf.py

# llama.cpp's own C++ server (llama-server), the HTTP peer of `tierline bench engine --vs llamacpp`: compiled with
# cmake from the same vendored llama.cpp as llama-cpp-python (the pinned sdist, kept in LLAMA_SDIST), with the same
# flags, statically, once per CPU into LLAMA_SERVER_DIR (bench/llama_server.py looks there; ~6 min on 2 cores). A
# failed build installs nothing: the bench's HTTP part and its test then skip, saying why.
LLAMA_CPP_PYTHON := $(shell sed -n 's/^llama-cpp-python==//p' constraints.txt)
LLAMA_SDIST := $(HOME)/.cache/tierline/sdist
LLAMA_SERVER_DIR ?= $(HOME)/.cache/tierline-wheels/llama-server-$(shell uname -m)-$(CPU_FLAGS_HASH)
$(LLAMA_SERVER_DIR)/llama-server: constraints.txt
	mkdir -p $(LLAMA_SDIST) && rm -rf $(LLAMA_SERVER_DIR).tmp && mkdir -p $(LLAMA_SERVER_DIR).tmp/src
	test -f $(LLAMA_SDIST)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz || $(BIN)/python -m pip download --quiet \
		--no-deps --no-binary :all: -c constraints.txt -d $(LLAMA_SDIST) llama-cpp-python
	tar -xzf $(LLAMA_SDIST)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_SERVER_DIR).tmp/src \
		--strip-components=3 llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
	cmake -S $(LLAMA_SERVER_DIR).tmp/src -B $(LLAMA_SERVER_DIR).tmp/build $(if $(shell command -v ninja),-G Ninja) -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CMAKE_ARGS) >$(LLAMA_SERVER_DIR).tmp/cmake.log
	cmake --build $(LLAMA_SERVER_DIR).tmp/build --target llama-server -j $$(nproc) >>$(LLAMA_SERVER_DIR).tmp/cmake.log
	$(LLAMA_SERVER_DIR).tmp/build/bin/llama-server --version
	mkdir -p $(LLAMA_SERVER_DIR) && cp $(LLAMA_SERVER_DIR).tmp/build/bin/llama-server $(LLAMA_SERVER_DIR)/llama-server.part
	mv $(LLAMA_SERVER_DIR)/llama-server.part $(LLAMA_SERVER_DIR)/llama-server && rm -rf $(LLAMA_SERVER_DIR).tmp

llama-server: $(LLAMA_SERVER_DIR)/llama-server

peers: $(PEERS_STAMP) gguf-converter

# lm-evaluation-harness (tierline[eval]): the third-party client of the prompt-logprobs test (tests skip without it).
eval-peers: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,eval]'

demo: install
	$(BIN)/tierline up

# The console's browser test drives Debian's chromium (never a downloaded browser); installed when missing and
# apt is usable, else that one test is skipped.
chromium:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] \
		|| apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "chromium is not installed: the console's browser test will be skipped"

# Files run on TEST_WORKERS processes (pytest-xdist), each file on one worker (its module fixtures start once), in
# the order tests/conftest.py gives them (longest first; xdist's own reorder would put one-test files last).
# The sources are compiled first: where PYTHONDONTWRITEBYTECODE is set (as on the CI host), each of the suite's
# ~1,000 Python processes (servers, engines, CLI calls) would otherwise compile every module it imports again.
TEST_WORKERS ?= 4
test: install chromium
	$(BIN)/python -m compileall -q -j 0 shared controlplane cloud console edge_agent tierline bench
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy shared controlplane tierline cloud edge_agent console bench tests

bench: install
	$(BIN)/tierline zoo build --preset demo
	$(BIN)/tierline bench zoo --preset demo
	$(BIN)/tierline bench engine --json --rounds 3
	$(BIN)/tierline bench spec --json
	$(BIN)/tierline bench prefix --json
	$(BIN)/tierline bench tensor --json
	$(BIN)/tierline bench edge --json
	$(BIN)/tierline bench cascade --json --plot docs/cascade.png
	$(BIN)/tierline bench api --preset tiny --json

# The container image (deploy/Dockerfile) as tierline:latest, for deploy/compose.yaml and the Kubernetes manifests.
# deploy/images.sh picks the base (python:3.11-slim, else a local one made once from Debian packages) and the CPU
# torch (PyTorch's CPU index, or pip's local wheel); layers are cached, so a second run takes seconds.
images:
	deploy/images.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
