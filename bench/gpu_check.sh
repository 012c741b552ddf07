#!/usr/bin/env bash
# GPU check for the offload library, in at most ~10 minutes (~2-4 when all goes well) on one CUDA GPU (made for an H200):
#   1. versions (python, torch, CUDA, GPU, kernel backend);
#   2. the CUDA-marked tests (tests/test_cuda.py: streams, hooks, copies, vs torch.optim.AdamW,
#      swapped masters; tests/test_memory.py: cudaHostRegister'd pool buffers);
#   3. a short benchmark: bf16 params whose fp32 Adam states exceed a device-memory budget,
#      offload="cpu", step time with overlapping side streams vs synchronous copies, and the
#      profiler's stream timeline summary (bench/offload_step.py --gpu);
#   4. the same benchmark with int8 moments and a bf16 master (compressed states, 1/6 of the
#      host state bytes);
#   5. stage 3 (offload.shard of a CUDA model): tests/test_shard_cuda.py's CUDA tests (1 rank;
#      NCCL on 2 ranks when there are 2 GPUs) and bench/shard_gpu.py: forward + backward of a
#      GPT-2-sized TinyGPT, offload_params="cpu", gathers on their side stream vs. on the
#      compute stream (the overlap ratio);
#   6. the host CPU's SIMD units (AVX-512 where it has it, which this project's CPU-only
#      machines so far lacked): the units' bits against each other and AdamW's bits against
#      torch's ops (tests/test_kernel_bits.py, test_torch_parity_edges.py's decay test).
# Usage: bash bench/gpu_check.sh [extra args for bench/offload_step.py --gpu]
# Environment: it reuses .venv if its torch sees CUDA (else .venv-gpu, else python3). Only when
# none does, and only with OFFLOAD_GPU_CHECK_PIP=1, it pip-installs torch into .venv-gpu (an
# offline device machine has torch in python3 and no network: it would only burn time).
# The native kernels: carry offload/kernels/liboffload_native.so (git-ignored) or the script
# builds them (needs g++; numba or torch serve if that fails).
# Every stage runs under its own timeout (20 + 60 + 120 + 150 + 90 + 75 + 75 s at most, plus up to 3 x 60 s
# of probes for a python with CUDA torch and 60 s for the native build; ~3-4 min when all
# goes well) and the script goes on after a failure, so one run prints everything there is to
# see; the exit status is the number of failed stages. With $OUT set (the device tool's
# output folder), everything printed is also written to $OUT/gpu_check.log.
set -u
export PYTHONUNBUFFERED=1  # a stage killed at its timeout still leaves what it printed
self="$(readlink -f "$0")"
cd "$(dirname "$self")/.."
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ] && [ -z "${GPU_CHECK_TEED:-}" ]; then
  # Re-run under tee so a run killed at its limit still leaves its log behind.
  GPU_CHECK_TEED=1 bash "$self" "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
fails=0
say() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

has_cuda_torch() { timeout 60 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY=""
for cand in .venv/bin/python .venv-gpu/bin/python python3; do
  if command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then PY="$cand"; break; fi
done
if [ -z "$PY" ]; then
  # A CPU-only torch (the .venv of a CPU machine) is left alone: the CUDA build goes into its
  # own venv; PyPI's default torch wheel for Linux x86-64 is the CUDA one.
  if [ "${OFFLOAD_GPU_CHECK_PIP:-0}" != 1 ]; then
    echo "no python with CUDA torch found (set OFFLOAD_GPU_CHECK_PIP=1 to pip install one)"; exit 98
  fi
  say "no python with CUDA torch found: pip install torch into .venv-gpu"
  [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu \
    || { echo "cannot create .venv-gpu"; exit 99; }
  PY=.venv-gpu/bin/python
  timeout 150 "$PY" -m pip install -q torch numpy pytest || echo "pip install torch failed (no network?)"
  has_cuda_torch "$PY" || { echo "torch still has no CUDA here; nothing more to check"; exit 98; }
fi
timeout 60 "$PY" -c 'import torch; print("using", __import__("sys").executable, "torch", torch.__version__)'
# Python deps of the package itself, only where missing (offline machines keep what they have).
timeout 60 "$PY" -c 'import numpy, pytest' >/dev/null 2>&1 || timeout 60 "$PY" -m pip install -q numpy pytest \
  || echo "pip install numpy pytest failed"
if [ ! -f offload/kernels/liboffload_native.so ]; then
  say "building the native kernels (pip install -e .)"
  timeout 60 "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
    || echo "native build failed: the numba or torch backend will run (slower CPU step)"
fi

say "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
PYTHONPATH=. timeout 20 "$PY" - <<'EOF' || fails=$((fails + 1))
import os, platform, sys, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB", "cpus", os.cpu_count())
from offload.kernels import backend_status, get_backend
print("kernel backend", get_backend().name, backend_status())
EOF

say "CUDA-marked tests"
PYTHONPATH=. timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs --ignore=tests/test_shard_cuda.py tests \
  || fails=$((fails + 1))

say "GPU benchmark: offload='cpu', overlap vs synchronous copies"
PYTHONPATH=. timeout 150 "$PY" bench/offload_step.py --gpu "$@" || fails=$((fails + 1))

say "GPU benchmark: int8 moments and a bf16 master (compressed states on CUDA params)"
PYTHONPATH=. timeout 90 "$PY" bench/offload_step.py --gpu --steps 3 --state-dtype int8 --master-dtype bfloat16 \
  || fails=$((fails + 1))

say "stage 3 on the GPU: CUDA tests (tests/test_shard_cuda.py)"
PYTHONPATH=. timeout 75 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_shard_cuda.py \
  || fails=$((fails + 1))

say "stage 3 on the GPU: offload_params='cpu', gathers on a side stream vs on the compute stream"
PYTHONPATH=. timeout 75 "$PY" bench/shard_gpu.py || fails=$((fails + 1))

say "the host CPU's SIMD units: bits of every unit, AdamW against torch's ops"
if grep -q -w avx512f /proc/cpuinfo; then echo "host CPU has AVX-512"; else echo "no AVX-512 on this host"; fi
OFFLOAD_BACKEND=native PYTHONPATH=. timeout 60 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_bits.py \
  "tests/test_torch_parity_edges.py::test_adamw_decay_is_rounded_before_the_step_is_added" || fails=$((fails + 1))

say "done: $fails failed stage(s)"
exit "$fails"
