"""The node's cores and NVMe I/O threads divided among its local ranks (offload.runtime.cores,
offload.runtime.nvme.threads_per_rank): the rules, without timing; the 2-rank launch of
tests/test_dist.py checks the threads an engine of each rank starts."""

import os
import subprocess
import sys

from tierwise.offload.runtime.cores import cpu_share, cpu_threads
from tierwise.offload.runtime.nvme import DEFAULT_THREADS, threads_per_rank

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1"}  # a torchrun worker's, OMP as torchrun sets it


def test_nvme_threads_per_rank_keep_the_node_at_one_store_s_4_in_flight():
    assert DEFAULT_THREADS == 4
    assert [threads_per_rank(n) for n in (1, 2, 3, 4, 5, 8)] == [4, 2, 2, 1, 1, 1]
    # the node: never fewer in flight than one store alone, never more than the ranks and 3
    assert all(4 <= n * threads_per_rank(n) <= n + 3 for n in range(1, 17))


def test_cpu_share_of_the_cores():
    assert [cpu_share(n, 16) for n in (1, 2, 3, 8, 32)] == [16, 8, 5, 2, 1]


def test_no_choice_is_lowered_to_the_share_never_raised():
    assert cpu_threads(2, current=16, env={}, n_cores=16).count == 8  # torch's every-core default
    assert cpu_threads(2, current=3, env={}, n_cores=16).count is None  # someone chose fewer
    assert cpu_threads(1, current=16, env={}, n_cores=16).count is None  # one rank: the node is its own


def test_torchrun_s_default_of_one_is_not_a_choice_the_user_s_one_is():
    assert cpu_threads(2, current=1, env=TORCHRUN, n_cores=16, launcher={"PATH": "/bin"}).count == 8
    kept = cpu_threads(2, current=1, env=TORCHRUN, n_cores=16, launcher={"OMP_NUM_THREADS": "1"})
    assert kept.count is None and kept.note is None
    # not under torchrun, another value, or torch set otherwise since: the user's choice
    assert cpu_threads(2, current=1, env={"OMP_NUM_THREADS": "1"}, n_cores=16, launcher={}).count is None
    assert cpu_threads(2, current=3, env=TORCHRUN | {"OMP_NUM_THREADS": "3"}, n_cores=16, launcher={}).count is None
    assert cpu_threads(2, current=2, env=TORCHRUN, n_cores=16, launcher={}).count is None


def test_when_the_launcher_cannot_be_read_one_is_kept_and_one_line_says_what_to_set():
    got = cpu_threads(4, current=1, env=TORCHRUN, n_cores=16, launcher=None)
    assert got.count is None and "\n" not in got.note and "set OMP_NUM_THREADS=4" in got.note


def test_the_launcher_s_environment_is_the_one_it_started_with():
    """What torchrun does: OMP_NUM_THREADS added to its own environment after it started, then a
    worker started; the worker reads the launcher's starting environment without it."""
    child = ("import sys; sys.path.insert(0, sys.argv[1]); import os; "
             "from tierwise.offload.runtime.cores import launcher_env; e = launcher_env(); "
             "print(e.get('TW_GIVEN'), e.get('TW_ADDED', 'absent'), os.environ['TW_ADDED'])")
    parent = ("import os, subprocess, sys; os.environ['TW_ADDED'] = '1'; "
              f"subprocess.run([sys.executable, '-c', {child!r}, sys.argv[1]], check=True)")
    devtree = os.path.join(os.path.dirname(__file__), "devtree")
    out = subprocess.run([sys.executable, "-c", parent, devtree], env=dict(os.environ, TW_GIVEN="7"),
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["7", "absent", "1"]
