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
	$(BIN)/pip install -q -e '.[test,plot]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hybridpd.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

clean:
	rm -rf $(VENV) build *.egg-info
