"""The DeepSpeed side of bench/e2e_vs_deepspeed.py; runs inside bench/.ds-venv.

    ds_runner.py --build-ops      JIT-build cpu_adam and async_io into $TORCH_EXTENSIONS_DIR
    ds_runner.py --spec FILE      train as FILE says; last stdout line: E2E_RESULT {json}

ZeRO-3 with parameters and optimizer state offloaded to NVMe, set up as shared/PEERS.md
found it must be on DeepSpeed 0.19.8 for fp32 results that agree with plain PyTorch:
- construction partitioned by deepspeed.zero.Init(module=..., config_dict_or_path=cfg) with no
  dtype (else fp32 parameters silently become bf16 on a CPU without fp16);
- sub_group_size 1 (else gradients at offsets that are not a multiple of 512 bytes are read
  with O_DIRECT, "succeed", and read nothing: stale gradients);
- max_in_cpu 0 (parameters really on NVMe) with stage3_max_reuse_distance 0 and
  stage3_prefetch_bucket_size 0 (else it asserts);
- aio threads via intra_op_parallelism; aio.block_size is also the size below which a
  tensor is not swapped at all.
With the spec's `lora` (--lora) the model is peft.get_peft_model over the same Llama
(e2e_common.build: the same adapters as ours), the optimizer gets the adapters only, and
offload_optimizer goes where `ds_offload_optimizer` says (--lora default: cpu, the adapters'
state is a few MiB; sub_group_size 1 is the NVMe optimizer's workaround, so with cpu it is
DeepSpeed's default).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_common as common  # noqa: E402


def build_ops() -> None:
    """Build what a run JIT-compiles: cpu_adam, async_io, and on the CPU accelerator its
    shared-memory comm op and pin_memory (cached in $TORCH_EXTENSIONS_DIR)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    names = ["CPUAdamBuilder", "AsyncIOBuilder"]
    if acc.device_name() == "cpu":
        names += ["ShareMemCommBuilder", "PinMemoryBuilder"]
    for name in names:
        builder = acc.create_op_builder(name)
        if builder is None:
            continue
        if not builder.is_compatible(verbose=True):
            raise SystemExit(f"DeepSpeed op {builder.name} cannot be built here (see above)")
        builder.load(verbose=False)
        print(f"{builder.name}: ready", flush=True)


def ds_config(spec: dict, *, largest_param: int) -> dict:
    """ZeRO-3, params on NVMe, optimizer state on NVMe (or the CPU), fp32, AdamW (see the module docstring)."""
    nvme = spec["nvme_path"]
    opt_device = spec.get("ds_offload_optimizer", "nvme")
    offload_optimizer = ({"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4}
                         if opt_device == "nvme" else {"device": "cpu", "pin_memory": True})
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": spec["betas"], "eps": spec["eps"],
                                                  "weight_decay": spec["weight_decay"]}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1 if opt_device == "nvme" else 1_000_000_000,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "max_in_cpu": 0,
                              "buffer_count": spec["ds_buffer_count"],
                              "buffer_size": largest_param},
            "offload_optimizer": offload_optimizer,
        },
        "aio": {"block_size": spec["aio_block_size"], "queue_depth": 8, "intra_op_parallelism": spec["aio_threads"],
                "single_submit": False, "overlap_events": True},
    }


def train(spec: dict) -> None:
    import torch

    common.pin_threads(spec)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    cuda = spec["device"] == "cuda"
    model = common.build(spec)
    checksum = common.weights_checksum(model)
    n_params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)  # before zero.Init empties the parameters
    largest = max(p.numel() for p in model.parameters())
    cfg = ds_config(spec, largest_param=largest)
    batches = common.make_batches(vocab=spec["hf_config"]["vocab_size"], count=spec["warmup"] + spec["steps"],
                                  batch=spec["batch"], seq=spec["seq"], seed=spec["data_seed"])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), auto_mpi_discovery=False)
    deepspeed.zero.Init(module=model, config_dict_or_path=cfg)  # partitions now; no dtype: fp32 stays fp32
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=cfg)
    dtypes = sorted({str(p.ds_tensor.dtype) for p in model.parameters() if hasattr(p, "ds_tensor")})
    device = engine.device

    def step(x):
        x = x.to(device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out = common.timed_loop(step, batches, warmup=spec["warmup"], sync=sync)
    out.update(side="ds", n_params=n_params, n_trainable=n_trainable, checksum=checksum, partition_dtypes=dtypes,
               deepspeed=deepspeed.__version__, accelerator=get_accelerator().device_name(),
               optimizer=type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, "optimizer")
               else type(engine.optimizer).__name__)
    if cuda:
        out["gpu_peak_alloc"] = torch.cuda.max_memory_allocated()
    common.emit(out)
    os._exit(0)  # skip DeepSpeed's atexit teardown (slow, and noisy on the CPU accelerator)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-ops", action="store_true")
    ap.add_argument("--spec")
    a = ap.parse_args()
    if a.build_ops:
        build_ops()
    elif a.spec:
        train(common.load_spec(a.spec))
    else:
        ap.error("--build-ops or --spec FILE")


if __name__ == "__main__":
    main()
