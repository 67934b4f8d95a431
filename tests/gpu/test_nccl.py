"""Several ranks over NCCL: run with `python -m pytest -m gpu tests/gpu` on a machine with at
least two CUDA devices (skipped otherwise). `finetune --nproc-per-node 2` on the quickstart tiny
model equals one rank with `--grad-accum 2` (the same micro-batches): the gather of compute copies
runs over NCCL between the GPUs, the gradient reduce and the scalars over gloo (host tensors).
CUDA's matmuls are not bit-reproducible across devices, hence a tolerance, not equality."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

RUN = ["--steps", "3", "--chunk-size", "64K"]


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def finetune(out: Path, *args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "tierwise.cli.main", *RUN, "--output", str(out), *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_two_gpus_over_nccl_equal_one_gpu_with_twice_the_accumulation(tmp_path):
    finetune(tmp_path / "two", "--nproc-per-node", "2")
    finetune(tmp_path / "one", "--grad-accum", "2")
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(two) == len(one) == 3
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-5)
