# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plot,otel]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hybridpd.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

# Tests marked slow (none today: the soak and two-host tests fit `make test`'s budget); exit 5 = none selected.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info
