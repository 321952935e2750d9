# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap .venv from nothing
# but Python 3.11 and PyPI (MPI comes from the `mpich` wheel when the system has none).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
NP ?= 2
# pytest workers (pytest-xdist): most tests wait on subprocesses (the CLI, mpiexec), so two
# share two cores well; a worker that runs out of tests takes the other's queued ones
# (--dist worksteal), so the end of the run is not one worker's long tests alone.
TEST_WORKERS ?= 2

.PHONY: demo test clean

$(STAMP): pyproject.toml
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,mpi,chem,plot]'
	touch $@

demo: $(STAMP)
	$(BIN)/chainexec plan configs/fourindex.yaml
	$(BIN)/chainexec generate configs/fourindex.yaml
	$(BIN)/mpiexec -n $(NP) $(BIN)/chainexec run configs/fourindex.yaml --report --report-json runs/fourindex/report.json
	$(BIN)/chainexec verify configs/fourindex.yaml

# The tests start thousands of Python processes (the CLI, mpiexec's ranks), each importing
# chainexec from its source; where the environment sets PYTHONDONTWRITEBYTECODE none of them keeps
# the bytecode it compiles, and each compiles about 60 modules again (0.15 s a process). Compiled
# once here, they are read.
test: $(STAMP)
	$(BIN)/python -m compileall -q chainexec tests
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal --durations=15

clean:
	rm -rf $(VENV) runs .pytest_cache
