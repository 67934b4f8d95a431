"""`finetune` on several ranks: `--nproc-per-node 2` starts torchrun (`python -m
torch.distributed.run ... -m tierwise.cli.main`, what a user types by hand) on the quickstart
tiny model; its losses equal one rank's with --grad-accum 2 (the same micro-batches), bit for
bit; rank 0 alone prints; what is not built yet is refused in one line."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import error_line  # noqa: E402

from tierwise.cli.launch import RankInfo, drop_option, from_env, node_share  # noqa: E402
from tierwise.cli.main import app  # noqa: E402

STEPS = ["--steps", "3"]


def train_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_nproc_per_node_2_equals_one_rank_with_grad_accum_2(tmp_path):
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "tierwise.cli.main", "--nproc-per-node", "2", *STEPS,
                           "--output", str(two)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("warm-up step") == 1 and proc.stdout.count("done: model exported") == 1  # rank 0 only
    assert "2 ranks" in proc.stdout
    one = tmp_path / "one"
    result = CliRunner().invoke(app, ["--grad-accum", "2", *STEPS, "--output", str(one)])
    assert result.exit_code == 0, result.output
    assert train_losses(two) == train_losses(one) and len(train_losses(one)) == 3
    assert (two / "model" / "model.safetensors").exists()
    from safetensors.torch import load_file
    import torch

    a, b = load_file(two / "model" / "model.safetensors"), load_file(one / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(two.glob("ckpt-*"))  # no checkpoints with several ranks (not built yet)


def test_resume_with_several_ranks_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line = error_line(CliRunner().invoke(app, [*STEPS, "--output", str(tmp_path), "--resume"]))
    assert line.startswith("error: rank 1: --resume with several ranks (2) is not built yet")


def test_node_budgets_are_divided_among_local_ranks():
    info = from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert info == RankInfo(rank=3, world=4, local_rank=1, local_world=2)
    assert node_share(64 << 30, info) == 32 << 30 and node_share(None, info) is None
    assert from_env({}) == RankInfo()
    assert drop_option(["--steps", "3", "--nproc-per-node", "2", "--nproc-per-node=4", "-x"],
                       "--nproc-per-node") == ["--steps", "3", "-x"]
