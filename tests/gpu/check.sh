#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU:
#   1. the GPU tests (float64 parity of the CuPy run with the CPU serial run, transfer counts),
#      and tests/device (every strategy's parity) on CuPy instead of the strict stand-in,
#   2. refmp train --device gpu (serial, dp 2, tp 2, pp 2, pp 2 x tp 2 with ZeRO-3) and
#      refmp generate --device gpu, each against the CPU (tests/gpu/cli_parity.py),
#   3. `refmp bench --device gpu` on a model that keeps the GPU busy, beside the same model in
#      PyTorch eager on CUDA (benchmarks/torch_anchor.py), and their ratio.
# Run from the repository root with refmp, CuPy and PyTorch installed:  bash tests/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
python - <<'PY' || { echo "check.sh: needs CuPy with a visible GPU (pip install -e '.[gpu]')"; exit 2; }
import cupy
n = cupy.cuda.runtime.getDeviceCount()
print(f"CuPy {cupy.__version__}, {n} GPU(s):", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
assert n > 0
PY
status=0
echo "== GPU tests"
python -m pytest tests/gpu -q -p no:cacheprovider || status=1
echo "== every strategy's parity on CuPy (tests/device, which CPU CI runs on a strict stand-in)"
REFMP_TEST_XP=cupy python -m pytest tests/device -q -p no:cacheprovider || status=1
echo "== refmp train and generate --device gpu against the CPU, layout by layout (float64)"
python tests/gpu/cli_parity.py --out "${OUT:-gpu-check}/cli" || status=1
echo "== refmp bench --device gpu (12 layers, n_embd 1024, block 1024)"
python -m refmp bench --device gpu --n-layer 12 --n-embd 1024 --n-head 16 --block-size 1024 \
    --batch-size 8 --vocab 50304 --steps 10 --warmup 3 || status=1
echo "== PyTorch eager CUDA, same model, beside refmp"
python benchmarks/torch_anchor.py --device gpu --n-layer 12 --n-embd 1024 --n-head 16 \
    --block-size 1024 --batch-size 8 --vocab 50304 --steps 10 --rounds 2 || status=1
exit $status
