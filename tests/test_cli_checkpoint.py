"""cli.checkpoint: round trip of nested state, atomic saves, crash safety, cleanup."""

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tierwise.cli import checkpoint as ckpt


def _engine_state(scale: float) -> dict:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale
    return {
        "weights": {"a": w, "a_row": w[0], "b": torch.ones(2, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(2.0)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "step": 2, "dtype": torch.bfloat16, "shape": torch.Size([3, 4]), "empty": torch.empty(0),
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_nested_state_and_rng(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    rng = ckpt.capture_rng()
    expected = (torch.rand(2), np.random.rand(2), random.random())
    ckpt.save_checkpoint(tmp_path, step=5, engine_state=_engine_state(1.0),
                         trainer_state={"rng": rng, "data": {"epoch": 1, "index": 2}})
    engine, trainer = ckpt.load_latest(tmp_path)
    _assert_same(_engine_state(1.0), engine)
    assert trainer["step"] == 5 and trainer["data"] == {"epoch": 1, "index": 2}
    torch.rand(5), np.random.rand(5), random.random()
    ckpt.restore_rng(trainer["rng"])
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_keeps_the_last_n_and_points_latest_at_the_newest(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step=step, engine_state=_engine_state(step),
                             trainer_state={}, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000003"
    ckpt.save_checkpoint(tmp_path, step=3, engine_state=_engine_state(9.0), trainer_state={})
    _assert_same(ckpt.load_latest(tmp_path)[0], _engine_state(9.0))  # same step re-saved


def test_exception_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, step=1, engine_state=_engine_state(1.0), trainer_state={})
    real = ckpt.save_tree

    def crash_after_engine(directory, name, obj):
        real(directory, name, obj)
        if name == "engine":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_tree", crash_after_engine)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, step=2, engine_state=_engine_state(2.0), trainer_state={})
    assert not (tmp_path / "ckpt-000002.tmp").exists()  # removed at once: frees a full disk
    engine, trainer = ckpt.load_latest(tmp_path)
    assert trainer["step"] == 1
    _assert_same(engine, _engine_state(1.0))
    monkeypatch.setattr(ckpt, "save_tree", real)
    ckpt.save_checkpoint(tmp_path, step=2, engine_state=_engine_state(2.0), trainer_state={})
    assert not list(tmp_path.glob("*.tmp"))
    assert ckpt.load_latest(tmp_path)[1]["step"] == 2


def test_process_killed_mid_write_keeps_previous_checkpoint(tmp_path):
    """SIGKILL the writer while a chunk of the new checkpoint is being streamed into its file."""
    script = textwrap.dedent(f"""
        import contextlib, os, signal, torch
        from tierwise.cli import checkpoint as ckpt
        from tierwise.offload.runtime.lazy import Deferred
        state = {{"w": torch.ones(4)}}
        ckpt.save_checkpoint({str(tmp_path)!r}, step=1, engine_state=state, trainer_state={{}})

        @contextlib.contextmanager
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
            yield torch.zeros(4)

        ckpt.save_checkpoint({str(tmp_path)!r}, step=2, engine_state={{"w": torch.zeros(4),
                             "chunk": Deferred(torch.float32, (4,), die)}}, trainer_state={{}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    partial = tmp_path / "ckpt-000002.tmp" / "engine.safetensors"
    assert partial.exists()  # killed while that file was being written
    engine, trainer = ckpt.load_latest(tmp_path)
    assert trainer["step"] == 1 and torch.equal(engine["w"], torch.ones(4))


def test_stale_latest_pointer_falls_back_to_newest_complete(tmp_path):
    ckpt.save_checkpoint(tmp_path, step=4, engine_state={"x": torch.ones(1)}, trainer_state={})
    (tmp_path / "latest").write_text("ckpt-000009\n")
    assert ckpt.latest_checkpoint(tmp_path).name == "ckpt-000004"
    assert ckpt.load_latest(tmp_path / "nothing-here") is None
