# probing: `make demo` shows it, `make test` proves it. Both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# the suite runs in a random order (pytest-randomly), this one in CI; another
# number tries another order (`make test PYTEST_SEED=7`)
PYTEST_SEED ?= 20261205

.PHONY: setup jobenvs demo test bench accuracy lint clean vm-test image

setup:
	@bash .ci/setup.sh

# the jobs' own environments the suite runs in (other numpy, pyarrow and Pythons,
# the frameworks): the tests' and benchmarks' set-up, not the demo's
jobenvs: setup
	@bash .ci/jobenvs.sh
	@bash .ci/testtools.sh

demo: setup
	@$(PY) -m probing demo

test: jobenvs
	$(VENV)/bin/ruff check probing tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -rs --durations=30 -p randomly --randomly-seed=$(PYTEST_SEED) $(PYTEST_ARGS)

bench: jobenvs
	@$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]" 2>&1 | { grep -v "^WARNING: Location" || true; }
	@for b in benchmarks/*.py; do case $$b in */accuracy.py|*/surface_diff.py) continue ;; esac; echo "== $$b" >&2; $(PY) $$b || exit 1; done

# how right `probing diagnose` is against jobs that record their own truth
# (root; 48 cases, ~21 min): writes its table into docs/accuracy.md
accuracy: jobenvs
	$(PY) benchmarks/accuracy.py --out docs/accuracy.md

lint: setup
	$(VENV)/bin/ruff check probing tests benchmarks
	$(VENV)/bin/ruff format --check probing tests benchmarks
	$(VENV)/bin/mypy

# the privileged suite in a Debian trixie VM (kernel 6.12, Python 3.13): docs/vm.md
VM_TESTS ?= paths
vm-test:
	@bash vagrant/vm-test.sh $(VM_TESTS)

# the agent's image, localhost/probing-agent:<version> (root, ~3 min; docs/deploy.md):
# a Debian root filesystem made with mmdebstrap, no image pulled; not part of make test
image:
	@bash deploy/container/build.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build dist *.egg-info
