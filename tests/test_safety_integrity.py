"""Nothing corrupt flows on: swap checksums, NaN losses, checkpoint manifests, `latest`.

On the old code a swap file overwritten with 0xFF trained on to "done" with every loss NaN, a
flipped byte or an F32->I32 dtype edit in engine.safetensors resumed silently, `latest` could
point outside --output, and --resume with another --optimizer/--chunk-size was a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tinyhf import StandInEngine, tiny_run_assets, error_line as _error_line  # noqa: E402

import tierwise.cli.train  # noqa: E402
from tierwise.cli import checkpoint as ckpt  # noqa: E402
from tierwise.cli import manifest  # noqa: E402
from tierwise.cli.main import app  # noqa: E402
from tierwise.cli.metrics import read_metrics  # noqa: E402
from tierwise.offload.runtime import lazy  # noqa: E402

SWAPPING = ["--seq-len", "32", "--batch-size", "2", "--chunk-size", "64K", "--gpu-mem", "700K",
            "--cpu-mem", "1100K"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_run_assets(tmp_path_factory.mktemp("assets"))


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})




def _args(assets, out: Path, *extra: str) -> list[str]:
    model, data = assets
    return ["--model", str(model), "--data", str(data), *SWAPPING, "--lr", "3e-3",
            "--nvme-path", str(out.parent / "nvme"), "--checkpoint-every", "1",
            "--output", str(out), *extra]


# -- a corrupted swap file -----------------------------------------------------------------------

class _CorruptAfterStep2:
    """The real Engine; after step 2 (and its checkpoint), 4 KiB of 0xFF over the start of every
    master swap file."""

    def __new__(cls, *args, **kwargs):
        from tierwise.offload import Engine

        class Corrupting(Engine):
            def step(self, batch, grad_accum=1):
                if self.steps == 2:
                    for name in os.listdir(self.nvme.directory):
                        if name.endswith(".master.swp"):
                            with open(os.path.join(self.nvme.directory, name), "r+b") as f:
                                f.write(b"\xff" * 4096)
                return super().step(batch, grad_accum=grad_accum)

        return Corrupting(*args, **kwargs)


@pytest.mark.parametrize("checksum", ["--nvme-checksum", "--no-nvme-checksum"])
def test_corrupted_swap_file_stops_the_run_with_the_last_good_checkpoint(assets, tmp_path, monkeypatch,
                                                                         checksum):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: _CorruptAfterStep2)
    out = tmp_path / "run"
    line = _error_line(_invoke(*_args(assets, out, "--steps", "6", checksum)))
    # checksums on (the default): the read is refused; off: the NaN weights are not checkpointed
    assert ("checksum mismatch" in line) if checksum == "--nvme-checksum" else \
        ("NaN" in line.replace("nan", "NaN") and "ckpt-000002 is kept" in line), line
    assert ckpt.latest_checkpoint(out).name == "ckpt-000002"
    ckpt.load_checkpoint(out / "ckpt-000002")  # intact: its manifest verifies
    assert not (out / "model").exists() and not (tmp_path / "nvme").exists()  # swap removed


class _NanAtStep3(StandInEngine):
    def step(self, batch, grad_accum=1):
        loss = super().step(batch, grad_accum)
        return float("nan") if self.steps == 3 else loss


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: _NanAtStep3)
    out = tmp_path / "run"
    line = _error_line(_invoke("--seq-len", "32", "--batch-size", "2", "--steps", "5",
                               "--checkpoint-every", "1", "--output", str(out)))
    assert "step 3: the loss is nan" in line and "ckpt-000002 is kept" in line
    assert ckpt.latest_checkpoint(out).name == "ckpt-000002" and not (out / "model").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


# -- checkpoints ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """A real run of 2 steps with its checkpoints (copied by each tampering test)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    r = _invoke(*_args(assets, out, "--steps", "2"))
    assert r.exit_code == 0, (r.output, r.exception)
    return out


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def _rewrite_header(path: Path, edit) -> None:
    raw = bytearray(path.read_bytes())
    n, header = _header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text = text.ljust(-(-len(text) // 8) * 8)  # offsets count from the header's end: the data stay
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(raw[8 + n:]))  # valid, only its meaning changed


def _first_master(header: dict) -> dict:
    return next(v for k, v in header.items() if ".master" in k)


def _flip(d: Path):
    p = d / "engine.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x40  # an exponent bit of the last fp32 value
    p.write_bytes(bytes(raw))


def _dtype(d: Path):
    _rewrite_header(d / "engine.safetensors",
                    lambda h: _first_master(h).update(dtype="I32"))


def _shape(d: Path):
    def edit(h):
        t = _first_master(h)
        t["shape"] = [t["shape"][0] // 2, 2]  # the same bytes, another shape
    _rewrite_header(d / "engine.safetensors", edit)


def _truncate(d: Path):
    p = d / "engine.safetensors"
    os.truncate(p, p.stat().st_size // 2)


def _bad_header_length(d: Path):
    p = d / "engine.safetensors"
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)  # larger than the file
    p.write_bytes(bytes(raw))


def _json_key(d: Path):
    p = d / "engine.json"
    skel = json.loads(p.read_text())
    skel["__dict__"] = skel["__dict__"][1:]  # drop the first top-level key
    p.write_text(json.dumps(skel))


TAMPER = {"flipped-byte": _flip, "dtype-F32-to-I32": _dtype, "shape": _shape, "truncated": _truncate,
          "header-length": _bad_header_length, "engine.json-key": _json_key}


@pytest.mark.parametrize("remanifest", [False, True], ids=["manifest", "manifest-rewritten"])
@pytest.mark.parametrize("how", list(TAMPER))
def test_tampered_checkpoint_is_refused_on_resume(assets, trained, tmp_path, how, remanifest):
    """With its manifest, any change is refused naming the file; with the manifest rewritten to
    match (a deliberate edit), the loaders' own checks still refuse in one line."""
    if remanifest and how == "flipped-byte":
        pytest.skip("a flipped value with a matching manifest is a valid checkpoint: only the "
                    "manifest can tell")
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    d = ckpt.latest_checkpoint(out)
    TAMPER[how](d)
    if remanifest:
        manifest.write(d, [f"{n}.{e}" for n in ("engine", "trainer") for e in ("safetensors", "json")])
    line = _error_line(_invoke(*_args(assets, out, "--steps", "4", "--resume")))
    assert str(d) in line or d.name in line, line
    if not remanifest:
        assert "engine." in line, line


def test_latest_cannot_point_outside_output(tmp_path):
    inside, outside = tmp_path / "run", tmp_path / "elsewhere"
    for d, step in ((inside, 1), (outside, 9)):
        ckpt.save_checkpoint(d, step=step, engine_state={"w": 0}, trainer_state={})
    (inside / "latest").write_text("../elsewhere/ckpt-000009\n")
    assert ckpt.latest_checkpoint(inside) == inside / "ckpt-000001"
    (inside / "ckpt-000009").symlink_to(outside / "ckpt-000009")
    (inside / "latest").write_text("ckpt-000009\n")
    assert ckpt.latest_checkpoint(inside) == inside / "ckpt-000001"


def test_a_resume_that_falls_back_from_latest_says_so(assets, trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "ckpt-000002")  # the checkpoint `latest` names, deleted by hand
    r = _invoke(*_args(assets, out, "--steps", "3", "--resume"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert "resumed from ckpt-000001 (step 1; `latest` names ckpt-000002, not a complete checkpoint here)" in r.output


@pytest.mark.parametrize("flag,value", [("--optimizer", "sgd"), ("--optimizer", "adamw8bit"),
                                        ("--chunk-size", "32K"), ("--precision", "bf16")])
def test_resume_with_another_optimizer_or_chunk_size_is_one_line(assets, trained, tmp_path, flag, value):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    args = _args(assets, out, "--steps", "4", "--resume")
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    line = _error_line(_invoke(*args))
    assert f"--resume: {flag} differ" in line and "it used" in line, line


def _chunk_steps(d: Path) -> list[int]:
    engine_state, _ = ckpt.load_checkpoint(d)
    return [int(c["step"]) for c in engine_state["chunks"]]


def test_reset_optimizer_resumes_weights_rng_and_data_with_a_fresh_optimizer(assets, trained, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "model")
    assert _chunk_steps(out / "ckpt-000002") == [2] * len(_chunk_steps(out / "ckpt-000002"))
    # no step after the resume: the exported weights are the checkpoint's, bit for bit
    r = _invoke(*_args(assets, out, "--steps", "2", "--resume", "--reset-optimizer",
                       "--optimizer", "adamw8bit"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert "--reset-optimizer: weights, RNG and data position from ckpt-000002; adamw8bit starts " \
           "from fresh state (the checkpoint's adamw state is not used)" in r.output
    exported, reference = load_file(out / "model" / "model.safetensors"), \
        load_file(trained / "model" / "model.safetensors")
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    # one step on: the new optimizer's state has seen one step, the RNG and data go on as before
    r = _invoke(*_args(assets, out, "--steps", "3", "--resume", "--reset-optimizer",
                       "--optimizer", "adamw8bit"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert set(_chunk_steps(out / "ckpt-000003")) == {1}
    same = tmp_path / "same"
    shutil.copytree(trained, same)
    assert _invoke(*_args(assets, same, "--steps", "3", "--resume")).exit_code == 0
    assert set(_chunk_steps(same / "ckpt-000003")) == {3}
    mine, theirs = ckpt.load_trainer(out / "ckpt-000003"), ckpt.load_trainer(same / "ckpt-000003")
    assert mine["data"] == theirs["data"]
    assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"])
    # without the flag, the changed optimizer is refused and the flag named
    line = _error_line(_invoke(*_args(assets, same, "--steps", "4", "--resume", "--optimizer", "sgd")))
    assert "add --reset-optimizer" in line


def _nan_engine(at_steps: set):
    """The real Engine whose loss is NaN (and so its gradients) in the steps `at_steps` (1-based)."""
    from tierwise.offload import Engine

    class NanLoss(Engine):
        def forward(self, batch):
            loss = super().forward(batch)
            return loss * float("nan") if self.steps + 1 in at_steps else loss

    return NanLoss


def test_skip_nonfinite_skips_the_update_and_counts_it(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: _nan_engine({3}))
    out = tmp_path / "run"
    r = _invoke(*_args(assets, out, "--steps", "4", "--skip-nonfinite", "2", "--keep-checkpoints", "0"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert "step 3: the loss is nan: update skipped (1 in a row; --skip-nonfinite 2)" in r.output
    assert "steps 1-4 in" in r.output and "1 step skipped (non-finite loss or gradient norm)" in r.output
    before, _ = ckpt.load_checkpoint(out / "ckpt-000002")
    after, _ = ckpt.load_checkpoint(out / "ckpt-000003")
    for a, b in zip(before["chunks"], after["chunks"]):  # weights and optimizer state untouched
        assert all(torch.equal(lazy.load(a[k]), lazy.load(b[k])) for k in a)
    final, _ = ckpt.load_checkpoint(out / "ckpt-000004")
    assert all(bool(torch.isfinite(lazy.load(c["master"])).all()) for c in final["chunks"])
    assert [r["kind"] for r in read_metrics(out / "metrics.jsonl")] == ["train", "train", "skipped", "train"]


def test_skip_nonfinite_stops_after_n_in_a_row(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(tierwise.cli.train, "engine_class", lambda: _nan_engine({2, 3, 4}))
    out = tmp_path / "run"
    line = _error_line(_invoke(*_args(assets, out, "--steps", "5", "--skip-nonfinite", "2")))
    assert "step 4: the loss is nan after 2 skipped steps in a row (--skip-nonfinite)" in line, line
    assert "ckpt-000003 is kept" in line  # a skipped step's checkpoint holds the good weights
    assert not (out / "model").exists()
