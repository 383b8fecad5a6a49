# loopwatch — `make help` lists the targets.
SHELL := /bin/bash
PY    := .venv/bin/python
KAFKA_PORT ?= 19092
export LOOPWATCH_BOOTSTRAP ?= 127.0.0.1:$(KAFKA_PORT)

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.venv/.installed: pyproject.toml guard/pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q -e ./guard
	touch $@

# the compiled span path (native/): built when a Rust toolchain is there or can be installed,
# else one line says what is missing and the pure-Python path is used (scripts/build-native.sh)
NATIVE_SRC := $(wildcard native/src/*.rs native/src/*/*.rs) native/Cargo.toml native/Cargo.lock native/pyproject.toml
.venv/.native: .venv/.installed $(NATIVE_SRC)
	@scripts/build-native.sh

native: .venv/.installed ## (re)build the native extension loopwatch_native into .venv
	@scripts/build-native.sh

install: .venv/.installed .venv/.native ## create .venv, install loopwatch with its dev tools, build the native span path

tools: ## install the system tools the tests use (JDK check, prometheus, promtool, alertmanager)
	scripts/install-tools.sh

kafka-up: .venv/.installed ## start the local single-node KRaft Kafka broker (127.0.0.1:$(KAFKA_PORT))
	scripts/kafka.sh start

kafka-down: ## stop the local Kafka broker
	scripts/kafka.sh stop

run: .venv/.installed ## start broker + worker + API, produce the examples, print loop_detected events (Ctrl-C stops all)
	scripts/run-local.sh

replay: .venv/.installed .venv/.native ## replay the examples without a broker and print events
	.venv/bin/loopwatch replay --config examples/loopwatch.yaml examples/

test: .venv/.installed .venv/.native ## run the whole test suite (starts the local broker; installs missing tools)
	scripts/install-tools.sh
	scripts/kafka.sh start
	$(PY) -m pytest

chaos: .venv/.installed ## long reliability suite: SIGKILLs, broker restarts, rebalance, malformed input, canaries (scripts/chaos.sh)
	scripts/chaos.sh

lint: .venv/.installed ## ruff + mypy (strict on detectors/)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy detectors streams alerts bench tests/support
	.venv/bin/mypy guard/loopwatch_guard --exclude 'guard/loopwatch_guard/detectors/'

bench: .venv/.installed .venv/.native ## run the benchmarks and print the results table (writes bench/results/*.json)
	scripts/kafka.sh start
	$(PY) -m bench

examples: .venv/.installed ## regenerate examples/ with the real opentelemetry-sdk OTLP encoder
	$(PY) examples/generate.py

clean: ## remove caches (keeps .venv and the Kafka download cache)
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info native/target

.PHONY: help native install tools kafka-up kafka-down run replay test chaos lint bench examples clean
