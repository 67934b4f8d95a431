"""The wheel as a user installs it: `tierwise` is the only top-level name it adds (no bare
`offload`, `optim`, `cli`, `profiles` that would collide with other distributions), with the
public imports, the `finetune` console script and the profiles' TOML data."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "-q", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_wheel_installs_only_tierwise(tmp_path):
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the checkout
    for name in ("offload", "optim", "cli", "profiles"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("tierwise-*.whl")
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)

    dist_info = [p.name for p in target.iterdir() if p.name.endswith(".dist-info")]
    assert len(dist_info) == 1 and dist_info[0].startswith("tierwise-")
    added = {p.name for p in target.iterdir()} - {"bin", dist_info[0]}
    assert added == {"tierwise"}, added
    assert [p.name for p in (target / "bin").iterdir()] == ["finetune"]
    entry = (target / dist_info[0] / "entry_points.txt").read_text()
    assert "finetune = tierwise.cli.main:main" in entry

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(target)!r})
        import importlib.util
        assert all(importlib.util.find_spec(bare) is None or {str(target)!r} not in str(importlib.util.find_spec(bare).origin)
                   for bare in ("offload", "optim", "cli", "profiles"))
        from tierwise.offload import Engine
        from tierwise.optim import AdamW8bit
        from tierwise.cli.main import main
        from tierwise.profiles import known_profiles, load_model_profile
        import tierwise, tierwise.profiles
        # a namespace package: an editable install behind the target (CI's) adds its path hook
        # after the target's folder; every module must still come from the wheel.
        assert list(tierwise.__path__)[0] == {str(target / "tierwise")!r}, tierwise.__path__
        import tierwise.offload.engine.engine as eng, tierwise.optim as opt, tierwise.cli.main as cm
        assert all(m.__file__.startswith({str(target)!r}) for m in (eng, opt, cm, tierwise.profiles)), \
            [m.__file__ for m in (eng, opt, cm, tierwise.profiles)]
        assert Engine.__module__ == "tierwise.offload.engine.engine" and callable(main) and AdamW8bit
        assert load_model_profile("7b").num_params > 6e9 and len(known_profiles("hardware")) > 3
        print("ok")
    """)
    # -I: neither PYTHONPATH (tests/devtree) nor the cwd; the checkout's editable install may be
    # on sys.path behind the target, so the script asserts where `tierwise` came from.
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
