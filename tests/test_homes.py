import pytest

from offload.errors import InfeasibleBudget
from offload.homes import assign_homes, minimum_host


def chunks(n, *, state=800, master=400, grad=400, compute=None):
    d = {"grad": grad, "state": state, "master": master}
    if compute:
        d["compute"] = compute
    return {c: dict(d) for c in range(n)}


def test_everything_in_dram_when_it_fits():
    h = assign_homes(kinds=chunks(3), host=None)
    assert all(t == "host" for d in h.tiers.values() for t in d.values()) and h.bounce == 0


def test_working_set_prefers_dram_compute_prefers_cxl():
    h = assign_homes(kinds=chunks(2, compute=200), host=10_000, cxl=10_000)
    assert all(d["compute"] == "cxl" and d["state"] == "host" and d["master"] == "host" for d in h.tiers.values())


def test_states_fill_dram_before_masters_then_overflow_to_nvme_with_bounce():
    k = chunks(4)  # grads 1600, states 3200, masters 1600: 6400 in all
    h = assign_homes(kinds=k, host=6000, nvme=True)
    assert h.bounce == 2 * 1200 + 400  # two update sets (state + master) + a fetch staging buffer
    assert [h.tiers[c]["state"] for c in range(4)] == ["host", "host", "nvme", "nvme"]
    assert [h.tiers[c]["master"] for c in range(4)] == ["nvme"] * 4
    assert h.bytes["nvme"] == {"state": 1600, "master": 1600}
    assert sum(h.bytes["host"].values()) + h.bounce <= 6000


def test_refusal_names_minimum_host_and_minimum_works():
    k = chunks(4)
    with pytest.raises(InfeasibleBudget, match="--nvme-path") as e:
        assign_homes(kinds=k, host=1000)
    assert e.value.minimum["host"] == 6400
    assign_homes(kinds=k, host=6400)
    with pytest.raises(InfeasibleBudget):
        assign_homes(kinds=k, host=6399)
    need = minimum_host(k, cxl=None, nvme=True)
    assign_homes(kinds=k, host=need, nvme=True)
    with pytest.raises(InfeasibleBudget):
        assign_homes(kinds=k, host=need - 1, nvme=True)
