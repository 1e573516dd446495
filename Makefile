# One entry point per job. Every target sets up what it needs first, so each works on a fresh clone.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: setup compiled run sim test lint test-vllm test-vllm-routes test-deploy test-clients test-image test-observability test-ui test-fleet chaos chaos-engines chaos-pods soak bench docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The compiled build (setup.py, proxy/compiled.py) installed apart from the editable one, which stays pure: `make test`
# runs the suite once on each (scripts/test-both.sh). Rebuilt when a source changes (~30 s).
COMPILED := build/compiled
compiled: $(COMPILED)/.built  ## the data plane compiled with mypyc into build/compiled (PYTHONPATH=build/compiled runs it)

$(COMPILED)/.built: $(VENV)/.installed setup.py pyproject.toml $(shell find proxy lifeguard_sim -name '*.py' -o -name '*.html' -o -name '*.json')
	rm -rf $(COMPILED) build/lib.* build/temp.* build/bdist.*
	$(BIN)/pip install -q --no-deps --no-build-isolation --target $(COMPILED) .
	touch $@

run: setup  ## the proxy in front of the embedded simulator, chosen explicitly
	$(BIN)/vllm-lifeguard serve --upstream sim

sim: setup  ## the simulator alone on :8000
	$(BIN)/vllm-lifeguard sim --port 8000

lint: setup  ## ruff on everything Python; mypy --strict on the packages and on the scripts that run in this venv
	$(BIN)/ruff check proxy lifeguard_sim tests scripts benchmarks setup.py
	$(BIN)/ruff format --check proxy lifeguard_sim tests scripts benchmarks setup.py
	$(BIN)/mypy
	$(BIN)/mypy benchmarks scripts/gpu_check.py scripts/vllm/route_scan.py scripts/ci_summary.py scripts/prometheus_rule.py \
		scripts/docs

test: setup lint compiled  ## unit, simulator conformance and proxy end-to-end tests: compiled on uvloop (serve's loop), pure on asyncio's, side by side
	bash scripts/test-both.sh $(BIN) $(COMPILED)

test-vllm: setup  ## end-to-end against a real vLLM-for-CPU (installs it once, ~3 min)
	bash scripts/test-vllm.sh

test-vllm-routes: setup  ## the route table against the newest vLLM wheel: an AST scan, no GPU (wheel cached once)
	bash scripts/vllm/check-routes.sh

test-deploy: setup  ## Dockerfile, k8s manifests, config and trainer guides
	bash scripts/check-deploy.sh

test-clients: setup  ## the trainers' own client code (SkyRL, TRL, AReaL, openai SDK) through the proxy
	bash scripts/test-clients.sh

test-image: setup  ## podman builds and runs the image; the k8s pod runs around a real vLLM-for-CPU (~10 min cold)
	bash scripts/test-image.sh

test-observability: setup  ## real Prometheus scraping the proxy; every panel and alert has data
	bash scripts/check-observability.sh

test-ui: setup  ## the status page in headless Chromium (installs Debian's chromium); screenshots in build/ui/
	bash scripts/test-ui.sh

test-fleet: setup  ## vllm-router in front of three lifeguards, one engine sleeping in cycles: /health vs /lifeguard/serving (~1 min)
	bash scripts/test-fleet.sh

chaos: setup  ## the full chaos run (CI runs a bounded one); CHAOS_ARGS go to chaos_run.py
	bash scripts/chaos.sh $(CHAOS_ARGS)

chaos-engines: setup  ## the bounded chaos run of two engines on one GPU (110 s): never more awake than fits
	bash scripts/chaos.sh --engines 2 --quick $(CHAOS_ARGS)

chaos-pods: setup  ## the bounded chaos run of 3 pods (a proxy each) on one GPU, one gpu_lock_dir, proxy restarts (110 s)
	bash scripts/chaos.sh --pods 3 --quick $(CHAOS_ARGS)

SOAK_S ?= 120
soak: setup  ## proxy + simulator processes under mixed load and a trainer's loop for SOAK_S s (120; 3600: an hour): nothing lost, every lifecycle 200 true, RSS and fds flat
	$(BIN)/python -m tests.chaos.soak_run --duration $(SOAK_S)

bench: setup  ## the performance table against nginx, Envoy, vllm-router and a real vLLM-for-CPU, and its charts (docs/performance.md)
	bash scripts/bench.sh --vllm

docs: setup  ## the reference in docs/reference/ (settings, routes, headers, errors, metrics, config schema), from the code
	$(BIN)/python -m scripts.docs.reference

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
