# spanrl: the two set-up commands (README.md) and helpers.
# Everything heavy is installed once into $(CACHE) by infra/bootstrap.sh.
CACHE ?= $(or $(SPANRL_CACHE_DIR),$(HOME)/.cache/spanrl)
PY := $(CACHE)/venv/bin/python
export SPANRL_CACHE_DIR := $(CACHE)
# MODEL=qwen2.5-coder-0.5b (any target): the base policy (spanrl/core/model.py's MODELS), prepared by
# bootstrap and served, trained and evaluated by the rest; default smollm2-135m
ifdef MODEL
export SPANRL_MODEL := $(MODEL)
endif

.PHONY: bootstrap demo train study test test-slow test-unit docs up down status bench bench-sustained bench-rate bench-vllm-lora bench-tree-pack chaos soak gpu-check

bootstrap:
	@bash infra/bootstrap.sh

## Train an agent and evaluate it before and after (spanrl train): start the stack if it is down,
## run the agent on its training tasks, one update per iteration, stop the stack.
## AGENT=math (default: the one whose learning was measured) | sql | rag, or your own agent's spec,
## module:attribute of a spanrl.AgentSpec on PYTHONPATH (AGENT=my_pkg.my_agent:spec).
## `make demo` and `make train` are the same command.
AGENT ?= math
demo train: bootstrap
	$(PY) -m spanrl.infra.cli train --agent $(AGENT) $(ARGS)

## The main job once per run seed and one report across seeds (results/study/study.{json,png});
## the stack must be down. ARGS="--seeds 3" (default), e.g. ARGS="--seeds 5 --first-seed 10".
study: bootstrap
	$(PY) -m spanrl.infra.cli study $(ARGS)

## Unit + integration tests against the real local stack, the slow tier left out (what .ci/run
## calls; <= 20 min with the cache present). ARGS="tests/unit/test_x.py": just those.
test: bootstrap
	$(PY) -m spanrl.infra.cli test --tier fast $(ARGS)

## The slow tier (tests marked slow: multi-broker, multi-rank at ZeRO 2/3, the second vLLM,
## restarts and outages); must pass before a change to stream_jobs/, trainer/, infra/stack.py
## or infra/replay.py is merged (DEVELOPERS.md).
test-slow: bootstrap
	$(PY) -m spanrl.infra.cli test --tier slow $(ARGS)

## The unit tests alone (no stack), in parallel.
test-unit: bootstrap
	$(PY) -m pytest tests/unit -q -p xdist -n 2

## The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8000/; tests/unit/test_docs.py builds it
## with --strict in `make test`.
docs: bootstrap
	$(PY) -m mkdocs serve $(ARGS)

up: bootstrap
	$(PY) -m spanrl.infra.cli stack up $(ARGS)
down:
	$(PY) -m spanrl.infra.cli stack down
status:
	$(PY) -m spanrl.infra.cli stack status

## Benchmarks side by side with Agent Lightning (needs `make up`); writes bench/results/latest.json.
bench: bootstrap
	$(PY) -m bench.run $(ARGS)

## Sustained (10,000 rollouts as fast as accepted; 1+1 vs 2 workers + 2 bridges) and fixed-rate
## (1,000 spans/s for 300 s) runs, each side by side with Agent Lightning; writes
## bench/results/<mode>-<time>.{json,png,log}. Small: ARGS="--rollouts 500" / ARGS="--duration-s 20".
bench-sustained: bootstrap
	$(PY) -m bench.run --mode sustained --rollouts 10000 --workers 2 --bridges 2 $(ARGS)
bench-rate: bootstrap
	$(PY) -m bench.run --mode rate --spans-per-s 1000 --duration-s 300 --batch-rollouts 8 $(ARGS)

## vLLM's own LoRA serving (--enable-lora, load_lora_adapter) against merged weights + reload, on one
## vLLM of MODEL's base, side by side (bench/vllm_lora.py); ~13 min for MODEL=qwen2.5-coder-0.5b on
## 2 cores, nothing else running. Writes bench/results/vllm-lora.json.
bench-vllm-lora: bootstrap
	$(PY) -m bench.vllm_lora --out bench/results/vllm-lora.json $(ARGS)

## One update of recorded RAG samples (MODEL=qwen2.5-coder-0.5b, which recorded them: the 8-question
## setting's iteration 0) unpacked and tree-packed, side by side (bench/tree_pack.py); nothing else
## running. ARGS="--groups 4": half of the update. Writes bench/results/tree-pack.json.
bench-tree-pack: bootstrap
	$(PY) -m bench.tree_pack docs/data/bench/rag05_8q_samples_v0.json --out bench/results/tree-pack.json $(ARGS)

## Soak (issue 21): the sustained workload at a fixed rate with the trainer consuming, >= 1 h by
## default (80 spans/s, 65 min, 15 min warm-up); every process's RSS and CPU over time, calls in
## = transitions = samples = trained, 0 duplicated, memory flat after the warm-up; starts Kafka and
## MinIO if they are down. Writes bench/results/soak-<time>.{json,png,log}. Short:
## ARGS="--duration-s 600 --warmup-s 180".
soak: bootstrap
	$(PY) -m bench.soak $(ARGS)

## Fault injection: SIGKILL each component mid-run, prove nothing lost or duplicated (results/chaos.json).
chaos: bootstrap
	$(PY) -m spanrl.infra.cli chaos $(ARGS)

## On a machine with one NVIDIA GPU, offline (no bootstrap): vLLM's CUDA build serving the model
## from the spanrl cache, one trainer update (NCCL, bf16), a weight reload, tokens/s; <= 8 min;
## says what is missing first (docs/operations.md). ARGS="--cpu": the same steps on CPU.
gpu-check:
	$(PY) -m bench.gpu_check $(ARGS)
