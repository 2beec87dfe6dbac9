#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no network, torch of its own): the versions this checkout's venv
# tests with, into .whl/ (ignored by git; about 22 MB; it travels with `run`'s carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=.venv/bin/python
version() { "$venv" -c "from importlib.metadata import version; print(version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
packages=()
for name in trl transformers datasets peft accelerate dill multiprocess hjson pydantic pydantic_core annotated-types \
            typing-inspection; do
  packages+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "${packages[@]}" "liger-kernel==${LIGER_VERSION:-0.8.5}"
# DeepSpeed publishes no wheel: build its pure-Python one (no compiled ops; they build on first use) with our torch.
"$venv" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
ls -la .whl
du -sh .whl
