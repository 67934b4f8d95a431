import pytest

from tierwise.offload.core.errors import BudgetExceeded
from tierwise.offload.runtime.ledger import Ledger


def test_reserve_release_peak_and_kinds():
    led = Ledger({"gpu": 1000, "host": None})
    led.reserve("gpu", "compute", 600)
    led.reserve("gpu", "activation", 300)
    led.release("gpu", "compute", 600)
    led.reserve("host", "master", 10**12)
    assert led.used("gpu") == 300 and led.peaks()["gpu"] == 900
    assert led.peak_breakdown()["gpu"] == {"compute": 600, "activation": 300}
    assert led.kind_peak("gpu", "compute") == 600
    assert led.free("gpu") == 700 and led.free("host") is None


def test_over_budget_raises_naming_tier_budget_and_ask():
    led = Ledger({"gpu": 1 << 20})
    led.reserve("gpu", "compute", 1 << 19)
    with pytest.raises(BudgetExceeded, match=r"tier 'gpu' budget 1.00 MiB exceeded: 512.00 KiB in use, asked for 768.00 KiB more \(grad\)"):
        led.reserve("gpu", "grad", 768 << 10)
    assert led.used("gpu") == 1 << 19  # a refused reservation changes nothing


def test_releasing_more_than_held_is_a_bug():
    led = Ledger({"gpu": None})
    with pytest.raises(AssertionError):
        led.release("gpu", "grad", 1)
