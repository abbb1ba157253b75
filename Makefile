# The two commands: `make demo` and `make test`. Both create .venv when it is missing.
#
# TORCH_SPEC chooses the PyTorch build. The default is the CPU build;
# on a GPU machine pass the pip arguments for the CUDA build you want, e.g.
#   make demo TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-busy slow-checks lint bench clean finetune

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainwise train

# Fine-tune a Hugging Face model end to end (no download): examples/finetune/run.py.
finetune: $(STAMP)
	$(BIN)/python examples/finetune/run.py --out runs/finetune-example

# Most test time is waiting on launched processes (start-up, rendezvous, kills, restarts):
# TEST_JOBS test files run at once (each file on one pytest worker, so a module's shared
# launch runs once); the tests that compare timings (marked serial) run alone afterwards.
# Bytecode first: where PYTHONDONTWRITEBYTECODE is set (CI images often set it) no process
# writes it, and every launcher and worker would compile trainwise's sources again.
TEST_JOBS ?= 3
test: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/python -m compileall -q -j 0 src tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not serial and not slow_check" --durations=15 tests
	$(BIN)/python -m pytest -q -m "serial and not slow_check" tests

# The slow checks make test leaves out (marker slow_check): bench/slow_checks.sh.
slow-checks: $(STAMP)
	bench/slow_checks.sh

# The same suite beside two CPU-bound busy loops that tests/busy.sh starts and stops: the
# tests' time limits follow the machine's measured speed (tests/limits.py), so it passes too.
test-busy: $(STAMP)
	MAKE="$(MAKE)" tests/busy.sh TEST_JOBS=$(TEST_JOBS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs
