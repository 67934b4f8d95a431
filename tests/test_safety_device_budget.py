"""The automatic GPU budget never exceeds the device's memory: on CUDA the free memory
torch.cuda.mem_get_info reports, on the simulated device the machine's RAM. On the old code a run
without --gpu-mem was planned with the hardware profile's 8 GiB and run with no device budget at
all, whatever the device had."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine  # noqa: E402

import tierwise.cli.train  # noqa: E402
from tierwise.cli import machine, planning  # noqa: E402
from tierwise.cli.config import TrainConfig  # noqa: E402
from tierwise.offload.core.errors import InfeasibleBudget  # noqa: E402


def test_device_memory_is_cuda_free_memory_or_the_ram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (3 << 30, 24 << 30))
    assert machine.device_memory() == 3 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine, "physical_ram", lambda: 5 << 30)
    assert machine.device_memory() == 5 << 30


def _h100(monkeypatch, free: int) -> None:
    """This machine's device: an 80 GiB H100 with `free` bytes free."""
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "cuda_device", lambda: ("NVIDIA H100 80GB HBM3", 80 << 30, 1))
    monkeypatch.setattr(machine, "device_memory", lambda: free)


def test_the_automatic_gpu_budget_is_the_devices_at_most(monkeypatch):
    _h100(monkeypatch, 1 << 20)  # 1 MiB free
    cfg = TrainConfig(model="tiny", recompute=True)
    assert planning.gpu_budget(cfg) == 1 << 20
    with pytest.raises(InfeasibleBudget, match="gpu"):  # the profile's 8 GiB is not there
        planning.make_plan(cfg)
    monkeypatch.setattr(machine, "device_memory", lambda: 3 << 30)
    assert planning.make_plan(cfg).budgets["gpu"] == 3 << 30
    assert planning.gpu_budget(TrainConfig(model="tiny", gpu_mem="2M")) == 2 << 20  # given: as given
    monkeypatch.setattr(machine, "device_memory", lambda: 70 << 30)  # the device's, not cpu-sim's 8 GiB
    plan = planning.make_plan(cfg)
    assert plan.budgets["gpu"] == 70 << 30 and plan.hardware == "h100"
    # another machine's plan (--hardware) keeps that profile's memory
    monkeypatch.setattr(machine, "device_memory", lambda: 1 << 20)
    other = planning.make_plan(TrainConfig(model="tiny", recompute=True, hardware="cpu-sim"))
    assert other.budgets["gpu"] == 8 << 30


def test_without_cuda_the_default_budgets_fit_the_ram_together(monkeypatch):
    """The simulated device is host RAM: by default it takes the profile's 8 GiB or half the RAM,
    and the host budget the rest, less the process's own; the plan's host RSS then fits the RAM."""
    from tierwise.offload.plan.planner import process_bytes

    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    for ram in (6 << 30, 64 << 30):
        monkeypatch.setattr(machine, "device_memory", lambda: ram)
        monkeypatch.setattr(planning, "physical_ram", lambda: ram)
        cfg = TrainConfig(model="tiny", recompute=True)
        device = min(8 << 30, ram // 2)
        assert planning.gpu_budget(cfg) == device
        assert planning.host_budget(cfg) == ram - device - process_bytes(lora=False)
        plan = planning.make_plan(cfg)
        assert plan.budgets["gpu"] == device and plan.budgets["host"] == ram - device - process_bytes(lora=False)
        assert plan.budgets["gpu"] + plan.budgets["host"] + plan.process_bytes == ram
        lora = TrainConfig(model="tiny", recompute=True, qlora=True)
        assert planning.host_budget(lora) == ram - device - process_bytes(lora=True) < planning.host_budget(cfg)
        two = TrainConfig(model="tiny", recompute=True, nproc_per_node=2)  # (a device each: half the RAM in all)
        assert planning.gpu_budget(two) == min(8 << 30, ram // 4)
        assert planning.host_budget(two) == ram - 2 * planning.gpu_budget(two) - 2 * process_bytes(lora=False) > 0
        with monkeypatch.context() as m:  # ranks torchrun started here, without --nproc-per-node: the same
            m.setenv("WORLD_SIZE", "2"), m.setenv("LOCAL_WORLD_SIZE", "2"), m.setenv("RANK", "1")
            started = TrainConfig(model="tiny", recompute=True)
            assert (planning.gpu_budget(started), planning.host_budget(started)) == \
                (planning.gpu_budget(two), planning.host_budget(two))


def test_training_hands_the_engine_the_devices_memory(monkeypatch, tmp_path):
    seen = {}

    class Spy(StandInEngine):
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: Spy)
    _h100(monkeypatch, 7 << 30)
    cfg = TrainConfig(steps=1, seq_len=32, batch_size=2, output=str(tmp_path / "o"), recompute=True)
    model = tierwise.cli.train.build_meta_model(tierwise.cli.train.resolve_model(None).config)
    tierwise.cli.train.make_engine(model, cfg)
    assert seen["budget"].gpu == 7 << 30


def test_a_given_host_budget_counts_the_default_simulated_device(monkeypatch):
    """--cpu-mem near the RAM beside the simulated device's default (host RAM too) is more than
    the machine has: refused, naming both; with --gpu-mem lowered it fits."""
    from tierwise.cli.config import ConfigError

    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    monkeypatch.setattr(machine, "device_memory", lambda: 24 << 30)
    monkeypatch.setattr(machine, "available_ram", lambda: 24 << 30)
    with pytest.raises(ConfigError, match=r"--cpu-mem 20.00 GiB \+ --gpu-mem 8.00 GiB \(the simulated device"):
        planning.check_budgets(TrainConfig(model="tiny", cpu_mem="20G"), here=True)
    planning.check_budgets(TrainConfig(model="tiny", cpu_mem="20G", gpu_mem="2G"), here=True)
    planning.check_budgets(TrainConfig(model="tiny"), here=True)  # the defaults fit together


@pytest.mark.parametrize("name,total,count,profile", [
    ("NVIDIA H100 80GB HBM3", 80 << 30, 1, "h100"),
    ("NVIDIA H200", 141 << 30, 1, "h200"),
    ("NVIDIA A100-SXM4-40GB", 40 << 30, 1, "a100-40g"),
    ("NVIDIA A100 80GB PCIe", 80 << 30, 2, "a100-80g"),
    ("NVIDIA A100-SXM4-80GB", 80 << 30, 8, "a100-80g"),
    ("NVIDIA GeForce RTX 4090", 24 << 30, 1, "rtx4090"),
    ("NVIDIA RTX A6000", 48 << 30, 1, "l40s"),  # none by name: the nearest memory
])
def test_a_cuda_device_is_priced_as_its_profile_with_its_own_memory(monkeypatch, name, total, count, profile):
    """Without --hardware a run on CUDA is planned for that device (its rates, its memory, its
    count), not for the simulated one: the same plan as --hardware PROFILE at that memory."""
    from tierwise.profiles import load_hardware_profile

    monkeypatch.setattr(machine, "cuda_device", lambda: (name, total, count))
    hw = planning.device_profile()
    ref = load_hardware_profile(profile)
    assert hw.name == profile and hw.gpu.memory == total and hw.pcie == ref.pcie
    assert hw.gpu.bf16_tflops == ref.gpu.bf16_tflops and not hw.simulated and hw.nvme is not None
    assert hw.gpus_per_node == count
    if count > 1:  # an SXM A100's GPUs reach each other over NVLink, a PCIe card's over PCIe
        assert hw.node.gpu_link == ("pcie" if "PCIe" in name else "nvlink")
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "device_memory", lambda: total - (1 << 30))
    cfg = TrainConfig(model="tiny", recompute=True, cpu_mem="1G")
    mine = planning.make_plan(cfg)
    if total == ref.gpu.memory:  # the explicit equivalent on another machine
        named = planning.make_plan(dataclasses.replace(cfg, hardware=profile, gpu_mem=f"{(total >> 30) - 1}G"),
                                   here=False)
        assert (mine.step_s, mine.budgets, mine.peak) == (named.step_s, named.budgets, named.peak)
    assert mine.budgets["gpu"] == total - (1 << 30)


def test_on_cuda_without_gpu_mem_the_automatic_recompute_judges_the_card(monkeypatch):
    """The plan prices this card's memory now, so --recompute's default decides on it: a model
    whose activations fit keeps them (less compute); one whose activations do not recomputes."""
    _h100(monkeypatch, 70 << 30)
    cfg = TrainConfig(model="tiny", cpu_mem="1G")
    assert planning.resolve_recompute(cfg).recompute is False
    monkeypatch.setattr(machine, "device_memory", lambda: 2 << 20)  # 2 MiB free: the same model recomputes
    assert planning.resolve_recompute(cfg).recompute is True
