"""One rule for every budget: more than the hardware has is refused in one line, never priced as
fitting. The hardware is the --hardware profile's for a plan of another machine, and this
machine's for a run (or a plan without --hardware); a what-if plan is not refused by this
machine's RAM or disk, it gets a note saying a run here would be."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import tierwise.cli.machine as machine
from tierwise.cli.main import app
from tests.tinyhf import error_line

GiB = 1 << 30


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def small_machine(monkeypatch):
    """This machine has 16 GiB of RAM available, 50 GiB free under any --nvme-path, and no GPU."""
    monkeypatch.setattr(machine, "available_ram", lambda: 16 * GiB)
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    monkeypatch.setattr("tierwise.cli.planning.free_disk", lambda path: 50 * GiB)


def test_gpu_budget_above_the_profiles_card_is_refused():
    line = error_line(_invoke("plan", "--model", "llama-8b", "--gpu-mem", "48G", "--cpu-mem", "64G",
                              "--hardware", "rtx4090"))
    assert "--gpu-mem 48.00 GiB is more than the GPU of hardware profile 'rtx4090' has (24.00 GiB)" in line


@pytest.mark.parametrize("args", [["plan", "--model", "llama-1b", "--gpu-mem", "4G"],
                                  ["--model", "tiny", "--steps", "1", "--dry-run"],
                                  ["--model", "tiny", "--steps", "1"]], ids=["plan", "dry-run", "run"])
def test_cpu_budget_above_available_ram_is_refused_here(small_machine, tmp_path, args):
    line = error_line(_invoke(*args, "--cpu-mem", "20G", "--output", str(tmp_path / "o"))
                      if args[0] != "plan" else _invoke(*args, "--cpu-mem", "20G"))
    assert line.startswith("error: --cpu-mem 20.00 GiB")
    assert "for the process is more than this machine has available (16.00 GiB" in line
    assert not (tmp_path / "o").exists()


def test_a_run_is_bound_by_this_machine_even_when_it_names_a_profile(small_machine, tmp_path):
    line = error_line(_invoke("--model", "tiny", "--steps", "1", "--cpu-mem", "20G", "--hardware", "rtx4090",
                              "--dry-run"))
    assert "more than this machine has available" in line


def test_cpu_budget_counts_the_process_and_the_simulated_device(small_machine):
    """16 GiB available: 16100M of --cpu-mem leaves too little for the process beside it, and 8G
    beside an 8G simulated device too; 8G alone fits."""
    for extra in (["--cpu-mem", "16100M"], ["--cpu-mem", "8G", "--gpu-mem", "8G"]):
        line = error_line(_invoke("plan", "--model", "llama-1b", *extra))
        assert "more than this machine has available (16.00 GiB" in line, line
    assert "more than this machine" not in _invoke("plan", "--model", "llama-1b", "--cpu-mem", "8G",
                                                   "--gpu-mem", "4G").output


@pytest.mark.parametrize("args", [["plan"], ["--steps", "1", "--dry-run"], ["--steps", "1"]],
                         ids=["plan", "dry-run", "run"])
def test_a_simulated_device_above_available_ram_is_refused_without_cpu_mem_too(small_machine, tmp_path, args):
    """The simulated device is host RAM: --gpu-mem alone, over what is available, names itself."""
    line = error_line(_invoke(*args, "--gpu-mem", "100T", *(["--output", str(tmp_path / "o")] if len(args) > 1
                                                          else [])))
    assert line.startswith("error: --gpu-mem 100.00 TiB (the simulated device: host RAM) + about"), line
    assert line.endswith("lower --gpu-mem (to plan another machine: finetune plan --hardware NAME)"), line
    assert "--gpu-mem 30.00 GiB" in (line := error_line(_invoke("plan", "--gpu-mem", "30G", "--cpu-mem", "1G")))
    assert "lower --gpu-mem" in line  # the larger of the two, not --cpu-mem
    line = error_line(_invoke("plan", "--gpu-mem", "10G", "--nproc-per-node", "2"))  # a device each
    assert "--gpu-mem 10.00 GiB x 2 ranks (the simulated device: host RAM)" in line, line
    assert "more than this machine" not in _invoke("plan", "--gpu-mem", "10G").output
    assert not (tmp_path / "o").exists()


def test_what_if_plan_is_priced_on_the_profile_with_notes_about_this_machine(small_machine, tmp_path):
    args = ["plan", "--model", "llama-70b", "--gpu-mem", "24G", "--cpu-mem", "256G", "--nvme-path",
            str(tmp_path / "nv"), "--hardware", "rtx4090", "--optimizer", "adamw8bit"]
    r = _invoke(*args)
    assert r.exit_code == 0, r.output
    assert "verdict: fits" in r.output
    assert ("note: --cpu-mem 256.00 GiB + --gpu-mem 24.00 GiB (the simulated device: host RAM) + about 360.00 MiB "
            "for the process is more than this machine has available (16.00 GiB") in r.output
    assert "note: --nvme-path here has 50.00 GiB free" in r.output and "a run here would be refused" in r.output
    # --nvme-mem states the other machine's drive: a smaller one does not fit
    line = error_line(_invoke(*args, "--nvme-mem", "300G"))
    assert "--nvme-path has 300.00 GiB of space: needs at least" in line
    assert _invoke(*args, "--nvme-mem", "1T").exit_code == 0


def test_missing_nvme_dir_is_priced_by_the_disk_it_would_be_created_on(small_machine, tmp_path, monkeypatch):
    """Without --hardware a missing --nvme-path is this machine's disk (its nearest existing
    parent), never the profile's capacity; the run creates it."""
    monkeypatch.setattr(machine, "available_ram", lambda: 64 * GiB)
    line = error_line(_invoke("plan", "--model", "llama-8b", "--gpu-mem", "12G", "--cpu-mem", "24G",
                              "--nvme-path", str(tmp_path / "missing" / "swap")))
    assert "--nvme-path has 50.00 GiB of space" in line


def test_nvme_mem_needs_nvme_path():
    line = error_line(_invoke("plan", "--model", "llama-8b", "--nvme-mem", "1T"))
    assert "--nvme-mem is the capacity of --nvme-path's drive: give --nvme-path too" in line


def test_cxl_budget_trains_on_this_machine_without_a_profile(tmp_path):
    """No --hardware: the run plans this machine (its CXL nodes, or the node the engine emulates
    in host memory), where it used to be refused for the default profile's lack of a [cxl] table."""
    r = _invoke("--model", "tiny", "--cxl-mem", "2M", "--steps", "1", "--output", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "run" / "model").is_dir()


def test_plan_takes_the_detected_cxl_nodes(monkeypatch):
    from tierwise.cli.config import TrainConfig
    from tierwise.cli.planning import this_machine
    from tierwise.offload.runtime import cxl
    from tierwise.offload.runtime.cxl import NumaNode

    nodes = [NumaNode(id=1, mem_total=3 * GiB, cpus=(), cxl="CXL region0"),
             NumaNode(id=2, mem_total=5 * GiB, cpus=(), cxl="CXL region1")]
    monkeypatch.setattr(cxl, "detect_cxl_nodes", lambda: nodes)
    assert this_machine(TrainConfig(model="tiny", cxl_mem="1G")).cxl.memory == 8 * GiB
    assert this_machine(TrainConfig(model="tiny", cxl_mem="1G", cxl_node="2")).cxl.memory == 5 * GiB
    assert this_machine(TrainConfig(model="tiny")) is None  # no CXL budget: the default profile


def test_lora_defaults_follow_the_qlora_recipe(monkeypatch):
    """--qlora / --lora-rank without --lr or --precision: lr 2e-4, and bf16 compute on a GPU
    (a GPU profile, or this machine's CUDA device); fp32 on the simulated device, saying so."""
    from tierwise.cli.config import TrainConfig

    full = TrainConfig(model="llama-8b")
    assert (full.lr, full.precision, full.precision_note) == (1e-4, "fp32", None)
    on_gpu = TrainConfig(model="llama-8b", hardware="h100")  # (a full fine-tune: fp32, saying bf16 is a flag away)
    assert on_gpu.precision == "fp32" and "unless --precision bf16" in on_gpu.precision_note
    assert TrainConfig(model="llama-8b", hardware="h100", precision="fp32").precision_note is None
    gpu = TrainConfig(model="llama-70b", qlora=True, hardware="rtx4090")
    assert (gpu.lr, gpu.precision, gpu.precision_note) == (2e-4, "bf16", None)
    monkeypatch.setattr(machine, "has_cuda", lambda: False)
    cpu = TrainConfig(model="tiny", lora_rank=8)
    assert cpu.precision == "fp32" and "simulated device" in cpu.precision_note
    assert TrainConfig(model="tiny", qlora=True, precision="bf16", lr=1e-3).lr == 1e-3  # given wins
    assert TrainConfig(model="llama-8b", lora_rank=8, base_dtype="fp32", hardware="rtx4090").precision == "fp32"


def test_qlora_headline_plans_in_bf16_as_typed():
    r = _invoke("plan", "--model", "llama-70b", "--gpu-mem", "24G", "--cpu-mem", "64G", "--hardware", "rtx4090",
                "--qlora")
    assert r.exit_code == 0, r.output
    assert "on rtx4090: adamw, bf16," in r.stdout


def test_a_refused_plan_prints_the_command_of_its_fastest_fit():
    r = _invoke("plan", "--model", "llama-70b", "--gpu-mem", "24G", "--cpu-mem", "64G", "--hardware", "rtx4090")
    assert r.exit_code == 2
    line = next(x for x in r.output.splitlines() if x.startswith("fastest: "))
    assert line == "fastest: finetune plan --model llama-70b --gpu-mem 24G --cpu-mem 64G --hardware rtx4090 --qlora"
    again = _invoke(*line.removeprefix("fastest: finetune ").split())
    assert again.exit_code == 0 and "verdict: fits" in again.output
