"""--output's free space checked before the first step (cli.diskspace), against what runs write.

The reference is the disk itself: each run here measures its --output (bytes in its files) at
every checkpoint's worst moment (written, not yet renamed into place: the ones kept are still
there) and at the end (export included), and the check's figure must cover the largest of
them, by no more than its fixed allowances. A free space one byte short of it is refused before
anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line, make_tiny_llama_dir, write_jsonl  # noqa: E402

from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli import diskspace  # noqa: E402
from tierwise.cli.main import app  # noqa: E402

STREAM = ["--seq-len", "32", "--batch-size", "2", "--chunk-size", "64K", "--gpu-mem", "700K"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    rows = [{"text": f"The tiny model streams chunk {i % 7} through the memory tier."} for i in range(48)]
    return make_tiny_llama_dir(root / "tiny"), write_jsonl(root / "train.jsonl", rows)


def _bytes_in(path: Path) -> tuple[int, int]:
    """(bytes of checkpoints and exported weights, bytes of every file) under `path`."""
    files = [p for p in path.rglob("*") if p.is_file()]
    weights = [p for p in files if p.relative_to(path).parts[0].startswith("ckpt-") or p.suffix == ".safetensors"]
    return sum(p.stat().st_size for p in weights), sum(p.stat().st_size for p in files)


def _run(assets, out: Path, *extra: str, monkeypatch, free: "int | None" = None):
    """(the CliRunner result, the check's figure, the most --output held at a save or the end:
    (checkpoints and weights, every file))."""
    model, data = assets
    seen: dict = {"held": []}
    real_check, real_fault = diskspace.check, ckpt._fault

    def check(where, **kw):
        seen["need"] = real_check(where, **kw)
        return seen["need"]

    def fault(step, moment):  # a checkpoint written, not yet renamed into place
        if moment == "before_rename":
            seen["held"].append(_bytes_in(out))
        real_fault(step, moment)

    monkeypatch.setattr(diskspace, "check", check)
    monkeypatch.setattr(ckpt, "_fault", fault)
    if free is not None:
        monkeypatch.setattr(diskspace, "free_disk", lambda path: free)
    result = CliRunner().invoke(app, ["--model", str(model), "--data", str(data), *STREAM,
                                      "--output", str(out), *extra], env={"COLUMNS": "200"})
    if result.exit_code == 0:
        seen["held"].append(_bytes_in(out))
    return result, seen.get("need"), tuple(max(h) for h in zip(*seen["held"])) or (0, 0)


@pytest.mark.parametrize("extra", [
    ("--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "2"),
    ("--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "0"),
    ("--steps", "3"),
    ("--steps", "4", "--checkpoint-every", "2", "--lora-rank", "4"),
], ids=["keep2", "keep-all", "end-only", "lora"])
def test_the_check_covers_what_the_run_writes(assets, tmp_path, monkeypatch, extra):
    result, need, held = _run(assets, tmp_path / "run", *extra, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    checkpoints = len(ckpt.list_checkpoints(tmp_path / "run"))
    weights, files = held
    assert weights <= need - diskspace.RUN_EXTRA <= weights + (checkpoints + 1) * diskspace.CHECKPOINT_EXTRA, \
        (held, need)
    assert files <= need
    # --dry-run says it from the plan's bytes: the same figure, but for the model's buffers
    planned, real_written = [], diskspace.written
    monkeypatch.setattr(diskspace, "written", lambda **kw: planned.append(real_written(**kw)) or planned[-1])
    model, data = assets
    dry = CliRunner().invoke(app, ["--model", str(model), "--data", str(data), *STREAM, "--output",
                                   str(tmp_path / "dry"), *extra, "--dry-run"], env={"COLUMNS": "200"})
    assert dry.exit_code == 0 and "disk: each checkpoint" in dry.output, dry.output
    assert planned[0][0] - diskspace.RUN_EXTRA == pytest.approx(need - diskspace.RUN_EXTRA, rel=1e-3)


def test_resume_counts_the_checkpoints_already_there(assets, tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ("--checkpoint-every", "2", "--keep-checkpoints", "3")
    result, _, _ = _run(assets, out, "--steps", "4", *args, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    before = _bytes_in(out)[0]
    result, need, (held, _) = _run(assets, out, "--steps", "8", "--resume", *args, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert held - before <= need - diskspace.RUN_EXTRA <= held - before + 4 * diskspace.CHECKPOINT_EXTRA


def test_too_little_space_is_refused_before_anything_is_written(assets, tmp_path, monkeypatch):
    out = tmp_path / "probe"
    result, need, _ = _run(assets, out, "--steps", "2", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    out = tmp_path / "run"
    result, _, _ = _run(assets, out, "--steps", "2", monkeypatch=monkeypatch, free=need - 1)
    line = error_line(result)
    assert line.startswith(f"error: {out} has ") and "1 checkpoint of " in line, line
    assert "free space or point --output elsewhere" in line
    assert not ckpt.list_checkpoints(out) and not (out / "metrics.jsonl").exists()
    result, _, _ = _run(assets, out, "--steps", "2", monkeypatch=monkeypatch, free=need)
    assert result.exit_code == 0, result.output


def test_a_save_killed_midway_counts_as_free(tmp_path, monkeypatch):
    """A `.tmp` checkpoint left by a killed save is removed by the next save: its bytes are free."""
    stale = tmp_path / "ckpt-000003.tmp"
    stale.mkdir()
    (stale / "engine.safetensors").write_bytes(b"\0" * 4096)
    kw = dict(tensors=1 << 20, export=0, start=0, total=1, every=0, keep=2)
    monkeypatch.setattr(diskspace, "free_disk", lambda path: 1 << 40)
    need = diskspace.check(tmp_path, **kw)
    monkeypatch.setattr(diskspace, "free_disk", lambda path: need - 4096)
    assert diskspace.check(tmp_path, **kw) == need
    monkeypatch.setattr(diskspace, "free_disk", lambda path: need - 4097)
    with pytest.raises(diskspace.OutputSpaceError):
        diskspace.check(tmp_path, **kw)


def test_saves_and_peaks_as_checkpoint_save_leaves_them(tmp_path, monkeypatch):
    """held() against the directory save_checkpoint leaves: the most checkpoint directories at
    a rename's moment, and those at the end."""
    real = ckpt._fault
    for existing, saves, keep in [(0, 1, 2), (0, 5, 2), (3, 1, 2), (3, 4, 2), (1, 3, 0), (0, 4, 1), (2, 2, 3)]:
        out = tmp_path / f"{existing}-{saves}-{keep}"
        for step in range(1, existing + 1):
            ckpt.save_checkpoint(out, step=step, engine_state={"w": torch.ones(2)}, trainer_state={}, keep=0)
        counts = [existing]
        monkeypatch.setattr(ckpt, "_fault", lambda step, moment, out=out, counts=counts: (
            counts.append(len(list(out.glob("ckpt-*")))) if moment == "before_rename" else None))
        for step in range(existing + 1, existing + saves + 1):
            ckpt.save_checkpoint(out, step=step, engine_state={"w": torch.ones(2)}, trainer_state={}, keep=keep)
        monkeypatch.setattr(ckpt, "_fault", real)
        assert diskspace.held(existing=existing, saves=saves, keep=keep) == \
            (max(counts), len(ckpt.list_checkpoints(out))), (existing, saves, keep)


@pytest.mark.parametrize("start,total,every", [(0, 6, 2), (0, 7, 2), (3, 7, 2), (0, 5, 0), (4, 4, 2), (0, 1, 1)])
def test_saves_ahead_counts_the_loops_saves(start, total, every):
    steps = range(start + 1, total + 1)
    saved = {s for s in steps if every and s % every == 0} | ({total} if total > start else set())
    assert diskspace.saves_ahead(start=start, total=total, every=every) == len(saved)


def test_several_ranks_count_every_shard_in_the_shared_output(tmp_path, monkeypatch):
    """Every rank's shard lands in the shared --output: the ranks' tensor bytes are summed (a
    collective), not one rank's taken for all (shards differ in size: chunks are owned k mod N)."""
    from tierwise.cli import launch, train
    from tierwise.cli.config import TrainConfig
    from tierwise.offload.engine import ranks

    class Engine:
        nvme = None

        def state_dict(self, deferred=True):
            return {"chunks": [{"master": torch.zeros(1000)}]}

    seen = {}
    monkeypatch.setattr(launch, "from_env", lambda: launch.RankInfo(rank=1, world=2, local_rank=1, local_world=2))
    monkeypatch.setattr(ranks, "gather_objects", lambda obj, what: [obj * 3, obj])
    monkeypatch.setattr(diskspace, "check", lambda where, **kw: seen.update(kw))
    monkeypatch.setattr(launch, "agree", lambda *a: None)
    cfg = TrainConfig(output=str(tmp_path / "out"), steps=2)
    train._check_output_space(Engine(), cfg, tmp_path / "scratch", model=torch.nn.Linear(2, 2), total=2)
    assert seen["tensors"] == 4 * 4000 and seen["export"] == 0  # (rank 1: rank 0 exports)
