"""Pure pieces of what `finetune` prints and writes: the warm-up report, the summary, metrics
truncation on resume, safetensors I/O errors as OSError."""

import errno
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli.metrics import MetricsWriter, read_metrics, truncate_metrics  # noqa: E402
from tierwise.cli.report import phase_delta, summary, warmup_report  # noqa: E402

MEASURED = {"forward": 0.0123, "backward": 0.5, "update": 0.0004}
PEAKS = {"gpu": 700 << 10, "host": 3 << 20}


def test_phase_delta():
    assert phase_delta({"forward": 3.0, "update": 1.0}, {"forward": 1.0}) == \
        {"forward": 2.0, "update": 1.0}


def test_warmup_report_with_plan_is_aligned():
    plan = SimpleNamespace(hardware="cpu-sim", padded=False, phases={"forward": 0.002, "backward": 0.004},
                           peak={"gpu": 1 << 20, "host": 3 << 20, "cxl": 0, "nvme": 0})
    lines = warmup_report(measured_times=MEASURED, measured_peaks=PEAKS, plan=plan,
                          budgets={"gpu": 800 << 10})
    assert len(lines) == 3
    assert lines[0].split() == ["warm-up", "step", "forward", "backward", "update", "peak",
                                "gpu", "peak", "host"]
    assert lines[1].split()[:5] == ["measured", "12.3", "ms", "500.0", "ms"]
    assert "400 µs" in lines[1] and "700.00 KiB" in lines[1] and "(--gpu-mem 800.00 KiB)" in lines[1]
    assert lines[2].split()[0] == "planned" and "1.00 MiB" in lines[2] and "cpu-sim" in lines[2]
    assert "the warm-up's include one-time work" in lines[2]  # (512 ms measured against 6 ms planned)
    close = warmup_report(measured_times={"forward": 0.002, "backward": 0.005}, measured_peaks=PEAKS, plan=plan)
    assert "one-time" not in close[2]
    assert len({len(line.split("   (")[0]) for line in lines}) == 1  # right-aligned columns


def test_warmup_report_without_plan_says_why():
    lines = warmup_report(measured_times=MEASURED, measured_peaks=PEAKS,
                          plan_error="--gpu-mem 700.00 KiB is too small")
    assert len(lines) == 3 and "no prediction: --gpu-mem 700.00 KiB is too small" in lines[2]


@pytest.mark.parametrize("losses,first,text", [
    ([5.0, 4.0], 1, "steps 1-2 in 2.0 s (1.00 s/step), loss 5.0000 -> 4.0000"),
    ([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], 5, "steps 5-10 in 2.0 s (0.33 s/step), loss 5.5000 -> "
                                        "1.5000 (mean of first/last 2 steps)"),
    ([], 1, "no steps run"),
], ids=["two", "resumed", "none"])
def test_summary(losses, first, text):
    assert summary(losses, first_step=first, seconds=2.0) == text


def test_summary_s_per_step_leaves_out_evaluation_and_checkpoints():
    assert summary([5.0, 4.0], first_step=1, seconds=3.0, step_seconds=1.0) == \
        "steps 1-2 in 3.0 s (0.50 s/step), loss 5.0000 -> 4.0000"


def test_truncate_metrics_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        for step in (1, 2, 3):
            m.write(kind="train", step=step, loss=float(step))
        m.write(kind="eval", step=2, loss=0.5)
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')  # a SIGKILL mid-line
    assert truncate_metrics(path, after_step=2) == 1
    assert [(r["kind"], r["step"]) for r in read_metrics(path)] == \
        [("train", 1), ("train", 2), ("eval", 2)]
    assert truncate_metrics(tmp_path / "none.jsonl", after_step=1) == 0


def test_failed_save_removes_its_tmp_dir_and_keeps_the_previous(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, step=1, engine_state={"w": torch.ones(3)},
                         trainer_state={"x": 1})
    monkeypatch.setenv(ckpt.FAULT_ENV, "2:fsize")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        with pytest.raises(OSError) as info:
            ckpt.save_checkpoint(tmp_path, step=2, engine_state={"w": torch.ones(1 << 15)},
                                 trainer_state={"x": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG
    assert not (tmp_path / "ckpt-000002.tmp").exists() and not (tmp_path / "ckpt-000002").exists()
    assert ckpt.latest_checkpoint(tmp_path).name == "ckpt-000001"
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "ckpt-000001")[0]["w"], torch.ones(3))
