#!/usr/bin/env bash
# The GPU run (issues 32, 55): a check, not a demo. bf16 CUDA training rows of ours against TRL's nearest equivalent
# (off-policy, on-policy, sampled-token, LoRA, MoE, another tokenizer, teacher cache) and the fused loss vs Liger's
# Triton kernels, in under 5 minutes on one H200; exits non-zero when any row fails, printing its last lines.
# See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run.sh [OUTPUT_DIR] [--rows NAME,...] [--row_timeout_s S] [--deadline_s S]
#                                                  # on the GPU machine; OUTPUT_DIR: $OUT, else benchmarks/results/gpu
#   bash benchmarks/gpu/run.sh --cpu-dry-run DIR [...]   # every row at tiny sizes on this CPU (the test suite runs it)
#
# The GPU machine has torch but not trl, deepspeed, datasets, liger-kernel or our transformers: `make gpu-wheels`
# (here, with PyPI) puts them in .whl/, which travels with the working tree (carry: [".whl"]) and is installed below.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=gpu
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
  mode=cpu-dry-run
  shift
fi
out="${OUT:-benchmarks/results/gpu}"
if [[ $# -gt 0 && "$1" != --* ]]; then
  out="$1"
  shift
fi
python="${PYTHON:-python3}"
if [[ "$mode" == gpu && -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/trl_distill_site \
    .whl/*.whl
  export PYTHONPATH="/tmp/trl_distill_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ "$mode" == cpu-dry-run && -z "${PYTHON:-}" && -x .venv/bin/python ]]; then
  python=.venv/bin/python
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$python" benchmarks/gpu/gpu_bench.py --mode "$mode" --output_dir "$out" "$@"
