# Quick start: `make demo` (set up, then run the simulated 8-GPU node), `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test lint bench proto clean

setup: $(VENV)/.installed

# Re-install whenever the project's metadata changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/nvplug demo

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict nvplug
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/check_names.py
	$(BIN)/python scripts/gen_proto.py --check

# Figures, not pass/fail: see bench/README.md. Run as root for the udev measures.
bench: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/dir_watch.py
	$(BIN)/python bench/allocation.py
	$(BIN)/python bench/labels.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/storm.py

proto: setup
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Packages for a GPU node (packaging/README.md): dist/nvplug_<version>-1_amd64.deb
# and dist/nvplug-<version>-1.x86_64.rpm. Pinned wheels are cached in build/wheel-cache.
.PHONY: deb rpm packages
deb:
	bash packaging/build-deb.sh

rpm:
	bash packaging/build-rpm.sh

packages: deb rpm
