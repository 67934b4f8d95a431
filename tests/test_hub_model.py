"""`--model ORG/NAME` resolves through huggingface_hub: the local cache first, with no network
(HF_HUB_OFFLINE), as it lies on disk after a download; one missing offline is a one-line error."""

from __future__ import annotations

from typer.testing import CliRunner

from tests.tinyhf import error_line, make_tiny_llama_dir, write_jsonl
from tierwise.cli.main import app

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(cache, repo_id: str):
    """A Hugging Face hub cache holding `repo_id` at revision main, laid out as huggingface_hub
    lays it (refs/main naming the snapshot's commit)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    make_tiny_llama_dir(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_a_cached_hub_id_trains_offline(tmp_path, monkeypatch):
    _cache_with(tmp_path / "hub", "tiny-org/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} of the cached model's data"} for i in range(16)])
    r = CliRunner().invoke(app, ["--model", "tiny-org/tiny-llama", "--data", str(data), "--steps", "2",
                                 "--seq-len", "16", "--output", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()


def test_an_uncached_hub_id_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = error_line(CliRunner().invoke(app, ["--model", "nobody/nothing", "--steps", "1",
                                               "--output", str(tmp_path / "run")]))
    assert "--model nobody/nothing: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set" in line
