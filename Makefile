# Better Compute — developer entry points.
#   make dev    run the system: embedded PostgreSQL, control plane, demo tenant and fleet
#   make test   run the whole test suite
#   make bench  run the benchmarks (figures go in docs/benchmarks.md)
#   make proto  regenerate the protobuf code (committed; `make proto-check` fails when stale)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# make test's workers: each runs whole test files (module fixtures stay per file); 1 runs serially.
TEST_WORKERS ?= 2

.PHONY: venv dev test bench proto proto-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --python_out=. --grpc_python_out=. --mypy_out=. \
		$$(find proto -name '*.proto' | sort)

proto-check: $(STAMP)
	@tmp=$$(mktemp -d); \
	$(PY) -m grpc_tools.protoc -Iproto --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp \
		$$(find proto -name '*.proto' | sort); \
	for f in $$(cd $$tmp && find . -name '*.py' -o -name '*.pyi'); do \
		cmp -s $$tmp/$$f $$f || { echo "generated code is stale: $$f (run make proto)"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated code is current"

dev: $(STAMP)
	$(PY) -m controlplane.cli dev

test: $(STAMP) proto-check
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench
	$(PY) -m bench --earliest --bookings 100000 --horizon-days 14 --no-baselines --seconds 3
	$(PY) -m bench.fleet

clean:
	rm -rf $(VENV) .dev
