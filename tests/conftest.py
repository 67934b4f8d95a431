"""Test setup. `tierwise` resolves to THIS checkout (tests/devtree/tierwise; README,
Development), here and in every subprocess a test starts, whichever checkout is installed."""

import os
import sys
from pathlib import Path

_DEVTREE = str(Path(__file__).resolve().parent / "devtree")
if sys.path[:1] != [_DEVTREE]:
    sys.path.insert(0, _DEVTREE)
for _name in [n for n in sys.modules if n == "tierwise" or n.startswith("tierwise.")]:
    del sys.modules[_name]  # imported from elsewhere before this ran (a plugin): rebind
os.environ["PYTHONPATH"] = os.pathsep.join([_DEVTREE, *filter(None, [os.environ.get("PYTHONPATH")])])

import pytest  # noqa: E402 - after binding `tierwise` to this checkout
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The 2-rank cases of tests/test_dist.py and tests/test_dist_lora.py: one launch of two
    gloo ranks for both (tests/dist_cases.run_two_ranks)."""
    from tests.dist_cases import run_two_ranks

    return run_two_ranks(tmp_path_factory.mktemp("two-ranks"))
