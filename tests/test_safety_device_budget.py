"""The automatic GPU budget never exceeds the device's memory: on CUDA the free memory
torch.cuda.mem_get_info reports, on the simulated device the machine's RAM. On the old code a run
without --gpu-mem was planned with the hardware profile's 8 GiB and run with no device budget at
all, whatever the device had."""

from __future__ import annotations

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


def test_the_automatic_gpu_budget_is_the_devices_at_most(monkeypatch):
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "device_memory", lambda: 1 << 20)  # a 1 MiB device
    cfg = TrainConfig(model="tiny", recompute=True)
    assert planning.gpu_budget(cfg) == 1 << 20
    with pytest.raises(InfeasibleBudget, match="gpu"):  # the profile's 8 GiB is not there
        planning.make_plan(cfg)
    monkeypatch.setattr(machine, "device_memory", lambda: 3 << 30)
    assert planning.make_plan(cfg).budgets["gpu"] == 3 << 30
    assert planning.gpu_budget(TrainConfig(model="tiny", gpu_mem="2M")) == 2 << 20  # given: as given
    monkeypatch.setattr(machine, "device_memory", lambda: 64 << 40)  # more than the profile's
    assert planning.make_plan(cfg).budgets["gpu"] == 8 << 30
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


def test_training_hands_the_engine_the_devices_memory(monkeypatch, tmp_path):
    seen = {}

    class Spy(StandInEngine):
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: Spy)
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "device_memory", lambda: 7 << 30)
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
