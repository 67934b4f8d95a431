"""A run whose output is not a terminal (nohup, a scheduler, `> log`) can be followed from the
log: a plan line first, a plain line every --log-every steps (first and last always), a line per
checkpoint, nothing folded at 80 columns."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from tierwise.cli.main import app


def test_a_run_piped_to_a_file_prints_a_line_every_n_steps(tmp_path):
    r = CliRunner().invoke(app, ["--output", str(tmp_path / "run"), "--log-every", "10", "--checkpoint-every", "20"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert re.fullmatch(r"steps 1-39 \(13 an epoch\), about \d+:\d\d at the plan's [\d.]+ s a step",
                        next(x for x in lines if x.startswith("steps 1-39 (")))
    steps = [int(m.group(1)) for x in lines if (m := re.match(r"step (\d+)/39, loss [\d.]+, lr [\d.e-]+, "
                                                              r"[\d,]+ tok/s, peak gpu [\d.]+ [KMG]iB, "
                                                              r"elapsed \d+:\d\d, ETA \d+:\d\d$", x))]
    assert steps == [1, 10, 20, 30, 39]
    assert "step 20: checkpoint ckpt-000020 saved" in lines
    assert any(len(x) > 80 and x.startswith("activations:") for x in lines)  # whole, not folded
    assert "━" not in r.output  # no progress bar in a log


def test_bitsandbytes_optional_kernel_notice_is_kept_at_debug(caplog):
    """bitsandbytes' 'Failed to load CPU gemm_4bit_forward ...' warning (an optional hub kernel,
    on CPUs with AVX512-BF16) opened every LoRA run on stderr, and a user's own script's too:
    importing the engine keeps it at debug."""
    import logging

    import tierwise.offload  # noqa: F401 - installs the filter

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no network")
        log.warning("another warning")
    assert "Failed to load" not in caplog.text and "another warning" in caplog.text
