# The two commands of the README: `make demo` and `make test`.
# Both create .venv and install the project with its dev extra first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kuralle-es demo

test: $(STAMP)
	$(BIN)/ruff check kuralle_es tests benchmarks
	$(BIN)/mypy kuralle_es
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/journal_overhead.py

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache .hypothesis
