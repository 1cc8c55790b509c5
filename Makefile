# Two set-up commands (README): `make demo` and `make test`. Both install what they need, idempotently.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The model family `make demo` / `make serve` run (python_backends/maskedit/families): its tiny preset is built.
FAMILY ?= flux_fill
MODEL_DIR ?= models/tiny-$(subst _,-,$(FAMILY))
export MASKEDIT_MODEL_DIR ?= $(abspath $(MODEL_DIR))
# importing diffusers makes torch's inductor cache directory (/tmp/torchinductor_$USER by default): kept in build/
export TORCHINDUCTOR_CACHE_DIR ?= $(abspath build/torchinductor)

.PHONY: setup model demo serve test test-unit perf render-gpu calibrate bench-engine bench-loader bench-batching bench-temporal bench-serving bench-addons router-sim router-validate router-sensitivity router-scale router-cpu serve-cluster chaos faults overload pacing soak bench-tenants device-dry-run clean

setup: $(STAMP)

# Re-run only when the pins change. torch is pinned to the local CPU build (requirements.txt).
$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@# perf_analyzer (from the tritonclient wheel) links Debian's libb64.
	@ldconfig -p | grep -q libb64.so.0d || { \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq libb64-0d) >/dev/null; \
	  else echo "warning: install libb64-0d (apt) for perf_analyzer"; fi; }
	touch $@

model: $(STAMP)
	$(VENV)/bin/maskedit-build-model $(MASKEDIT_MODEL_DIR) --family $(FAMILY)

demo: model
	$(PY) -m maskedit.demo --family $(FAMILY)

# One Triton instance; with INSTANCES=N (N > 1), N instances behind the router (same as serve-cluster), whose ports
# are ROUTER_GRPC_PORT (Triton's gRPC protocol), ROUTER_HTTP_PORT (Triton's HTTP/REST protocol, /metrics, /health),
# OPENAI_PORT (the OpenAI API; 0: off) and ROUTER_POLICY the routing policy (docs/router.md). With
# MASKEDIT_API_KEYS_FILE set, always behind the router (a lone Triton checks no keys), the backends guarded by a
# backend key (docs/security.md).
ROUTER_GRPC_PORT ?= 7001
ROUTER_HTTP_PORT ?= 7002
OPENAI_PORT ?= 7003
ROUTER_POLICY ?= predicted
# Both exec the server in make's own shell (no sub-make): Ctrl-C stops it cleanly, with nothing else to report.
CLUSTER = $(PY) -m maskedit_lab.harness.cluster --instances $${INSTANCES:-2} --port $(ROUTER_GRPC_PORT) \
	  --http-port $(ROUTER_HTTP_PORT) --openai-port $(OPENAI_PORT) --policy $(ROUTER_POLICY)
serve: model
	@$(PY) -m maskedit.samples out  # the docs' example inputs: out/template.png, out/mask_*.png, out/edges.png
	@if [ "$${INSTANCES:-1}" -gt 1 ] || [ -n "$$MASKEDIT_API_KEYS_FILE" ]; then \
	  INSTANCES=$${INSTANCES:-1}; exec $(CLUSTER); else \
	  exec $(VENV)/bin/maskedit-server --http-port $${HTTP_PORT:-8000} --grpc-port $${GRPC_PORT:-8001} --metrics-port $${METRICS_PORT:-8002}; fi

# Then the engine and cache unit tests again in bfloat16 (the dtype a GPU serves in; a float32-only path once
# crashed there): the same invariants, within the stated reduced-precision tolerance (tests/conftest.py).
# --durations: the slowest tests at the end of every run, so CI's time against its 40 minutes can be kept in hand.
test: model
	$(PY) -m pytest -q -ra --durations=25 $(PYTEST_ARGS)
	MASKEDIT_DTYPE=bfloat16 $(PY) -m pytest -q -ra -m "not integration" $(BF16_TESTS) $(PYTEST_ARGS)

BF16_TESTS := tests/unit/maskedit/cache/test_invariants.py tests/unit/maskedit/cache/test_heal.py \
	tests/unit/maskedit/cache/test_follow.py tests/unit/maskedit/test_packed_batch.py tests/unit/maskedit/test_engine.py \
	tests/unit/maskedit/test_local_parity.py tests/unit/maskedit/test_unet_family.py

test-unit: model
	$(PY) -m pytest -q -ra -m "not integration" $(PYTEST_ARGS)

perf: model
	$(PY) -m maskedit.perf_analyzer run

render-gpu: $(STAMP)
	$(PY) -m maskedit.repository --kind gpu --out build/model_repository_gpu

clean:
	rm -rf out build

# The GPU machine's scripts on this CPU (docs/gpu.md, "The dry run"): tiny presets, one step, results under $(DRY_OUT).
DRY_OUT ?= out/device-dry-run
device-dry-run: model
	OUT=$(DRY_OUT) PYTHON=$(abspath $(PY)) bash tools/device/gpu_check.sh --dry-run $${MODES:-tests calibrate bench unet serving}
	PYTHON=$(abspath $(PY)) bash tools/device/triton_pack.sh --dry-run
	bash tools/device/wheels.sh --dry-run

calibrate: $(STAMP)
	$(VENV)/bin/maskedit-calibrate

bench-engine: $(STAMP)
	$(VENV)/bin/maskedit-bench-engine

# The row loader's host time per step by verify threads (docs/gpu.md); LOADER_ARGS="--device cuda" on a GPU.
bench-loader: $(STAMP)
	$(PY) -m maskedit_lab.engine.bench_loader $(LOADER_ARGS)

bench-serving: $(STAMP)
	$(VENV)/bin/maskedit-bench-serving $(BENCH_ARGS)

bench-batching: $(STAMP)
	$(VENV)/bin/maskedit-bench-batching

# Temporal reuse x mask-aware reuse (docs/caching.md, "Temporal reuse"): full, mask-only, temporal-only and both,
# interleaved, at mask 0.2 with a 60 % step mask, First Block Cache and TaylorSeer -> perf_profiles/results/temporal.json
bench-temporal: $(STAMP)
	$(VENV)/bin/maskedit-bench-temporal $(BENCH_ARGS)

# LoRA adapters (docs/lora.md, Benchmark): base, warm, cold, naive stock Diffusers, mixed vs same-adapter batches on
# the bench preset, and the adapter path at FLUX.1 widths -> perf_profiles/results/addons.json / .png
bench-addons: $(STAMP)
	$(PY) -m maskedit_lab.addons.bench_addons $(ARGS)

router-sim: $(STAMP)
	$(VENV)/bin/maskedit-router-sim $(ARGS)

router-validate: $(STAMP)
	$(VENV)/bin/maskedit-router-validate $(ARGS)

# A router-validate file's runs replayed with the host slowed or noisy (seconds; docs/router.md):
# make router-sensitivity ARGS="--from perf_profiles/results/router_validation.json"
router-sensitivity: $(STAMP)
	$(PY) -m maskedit_lab.routing.validate_sensitivity $(ARGS)

# The real router process in front of 32 and 128 emulated Triton instances (maskedit_lab.routing.triton_emulator,
# docs/router.md).
router-scale: $(STAMP)
	$(PY) -m maskedit_lab.routing.scale $(ARGS)

router-cpu: $(STAMP)
	$(PY) -m maskedit_lab.routing.router_cpu $(ARGS)

serve-cluster: model
	@$(PY) -m maskedit.samples out
	@exec $(CLUSTER)

# Reliability (docs/reliability.md; the lab's reliability room, maskedit_lab.reliability): faults under load, 2x
# overload, a 30-minute soak; JSON + plots in perf_profiles/results.
chaos: model
	$(PY) -m maskedit_lab.reliability.chaos $(ARGS)

# Storage and client faults (corrupt entries, unwritable disk tier, full memory filesystem, idle streams).
faults: model
	$(PY) -m maskedit_lab.reliability.faults $(ARGS)

overload: model
	$(PY) -m maskedit_lab.reliability.overload $(ARGS)

# Pre-processing's pacing in a flood with Triton's queue policy (old) and with intake (new), side by side.
pacing: model
	$(PY) -m maskedit_lab.reliability.pacing $(ARGS)

soak: model
	$(PY) -m maskedit_lab.reliability.soak $(ARGS)

# Fair share between tenants (docs/security.md): a flood at 3x capacity beside four light tenants, on and off.
bench-tenants: model
	$(PY) -m maskedit_lab.reliability.tenant_fairness $(ARGS)
