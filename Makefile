# Developer targets for mhattn. CI runs the same scripts from .ci/run.
PYTHON ?= python3

.PHONY: build test sanitize fuzz valgrind

build:
	$(PYTHON) setup.py -q build_ext --inplace

test: build
	PYTHONPATH=python $(PYTHON) -m pytest -q

# The whole test suite against an ASan + UBSan build (in build/sanitize).
sanitize:
	PYTHON=$(PYTHON) bash tools/sanitize.sh

# FUZZ_TIME seconds of atheris over fuzz/fuzz_mha.py, from fuzz/corpus; new
# inputs go to build/fuzz-corpus, failing ones to build/fuzz-*.
FUZZ_TIME ?= 60
fuzz: build
	mkdir -p build/fuzz-corpus
	PYTHONPATH=python $(PYTHON) fuzz/fuzz_mha.py -max_total_time=$(FUZZ_TIME) \
		-artifact_prefix=build/fuzz- build/fuzz-corpus fuzz/corpus

# memcheck on a smoke run; fails on any error in mhattn's own frames.
valgrind: build
	PYTHONPATH=python bash tools/valgrind_smoke.sh
