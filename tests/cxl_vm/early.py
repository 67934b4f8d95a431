"""The CXL VMs a test session uses, booted as soon as collection ends, one at a time in a
background thread: a guest spends minutes in software emulation, mostly on one core, so its
boot overlaps the rest of the suite (tests/conftest.py runs the cxl_vm tests last and starts
them here); the `vm` fixture then waits for its report."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future

from tests.cxl_vm import harness

#: the guest's limit when it shares the cores with the rest of the suite
TIMEOUT_S = 1200

_reports: dict[tuple, Future] = {}
_lock = threading.Lock()


def _boot(setups: list[tuple]) -> None:
    for setup in setups:
        future = _reports[setup]
        try:
            try:
                harness.check_tools()
                harness.find_kernel()
            except harness.Missing as exc:
                future.set_result({"missing": str(exc)})
                continue
            devices, interleave, _ = setup
            future.set_result(harness.run_guest([sys.executable, "-m", "tests.cxl_vm.guest"], devices=devices,
                                                interleave=interleave, timeout=TIMEOUT_S))
        except BaseException as exc:  # any error: the fixture raises it in its test (never a hang)
            future.set_exception(exc)


def start(setups: list[tuple]) -> None:
    """Boot these setups' VMs in turn, in a daemon thread (a QEMU still running at exit is killed)."""
    with _lock:
        new = [s for s in setups if s not in _reports]
        for setup in new:
            _reports[setup] = Future()
    if new:
        threading.Thread(target=_boot, args=(new,), name="cxl-vm-boot", daemon=True).start()


def report(setup: tuple) -> dict:
    """The setup's run_guest report ({"missing": why} without QEMU or a kernel): waits for it,
    and boots it now if nothing started it."""
    start([setup])
    return _reports[setup].result()
