#!/usr/bin/env bash
# The one prepared run for a lent GPU (device tool), meant to end in under 8 minutes:
#   run --timeout_s 540 'bash bench/gpu_check.sh'
# 1. install the project without touching the machine's torch (it reaches no registry),
# 2. the CUDA tests (tests/gpu; the bitsandbytes case skips where bitsandbytes is absent),
# 3. engine vs plain PyTorch on a ~1B random Llama: tokens/s, MFU, link GB/s.
# Everything it prints is also written to $OUT (or /tmp) as gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu_check.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -m pip install -q --no-deps --no-build-isolation -e . || echo "pip install failed: running from the tree"
  timeout 180 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider
  echo "tests/gpu exit $?"
  timeout 300 python bench/gpu_check.py "$@"
  echo "gpu_check.py exit $?"
} 2>&1 | tee "$log"
