#!/usr/bin/env bash
# The GPU check of the Pallas attention kernel, in one go (run from the repository root on the
# GPU machine): the kernel tests compiled for real (every case of the slow grid included),
# then the kernel benchmark. Results: benchmarks/results/kernels-gpu.{json,log}; make the PNG
# anywhere with `python -m benchmarks.kernels --plot-only benchmarks/results/kernels-gpu.json`.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
python -c "import jax; print(jax.__version__, jax.devices())"
python -m pytest -q -p no:cacheprovider tests/test_attention_pallas.py -m "" \
    2>&1 | tail -n 25
python -m benchmarks.kernels --out benchmarks/results/kernels-gpu.json "$@" \
    2>&1 | tee benchmarks/results/kernels-gpu.log
