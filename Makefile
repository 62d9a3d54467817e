# Quick start: `make test` (whole suite) and `make run` (generate text).
PYTHON_SYS := $(shell scripts/find_python.sh)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test lint run venv clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON_SYS)" || (echo "no Python >= 3.12 found" && exit 1)
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check .

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

run: venv
	$(PY) -m metrale_jax.cli generate --stream --chat "Write one sentence about the sea."

clean:
	rm -rf $(VENV)
