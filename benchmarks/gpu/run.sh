#!/usr/bin/env bash
# The GPU run (issue 32): bf16 CUDA training of a ZeRO-2 student beside a ZeRO-3 teacher, ours vs TRL's GKD, and the
# fused loss vs Liger's Triton kernels. About 5-8 minutes on one H200. See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run.sh [OUTPUT_DIR]        # on the GPU machine; OUTPUT_DIR: $OUT, else benchmarks/results/gpu
#   bash benchmarks/gpu/run.sh --cpu-dry-run DIR   # every step at tiny sizes on this CPU (the test suite runs it)
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
out="${1:-${OUT:-benchmarks/results/gpu}}"
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
exec "$python" benchmarks/gpu/gpu_bench.py --mode "$mode" --output_dir "$out"
