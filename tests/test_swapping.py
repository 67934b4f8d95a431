"""offload.runtime.swapping._after: a read chained behind an update set's write-backs."""

from concurrent.futures import Future

import pytest

from tierwise.offload.runtime.swapping import _after


def test_then_starts_once_every_request_before_it_is_done():
    before, inner, calls = [Future(), Future()], Future(), []
    out = _after(before, lambda: (calls.append("then"), [inner])[1])
    before[0].set_result(None)
    assert not calls
    before[1].set_result(None)
    assert calls == ["then"] and not out.done()  # started, not yet landed
    inner.set_result(None)
    assert out.result() is None


def test_nothing_before_it_starts_at_once():
    inner = Future()
    inner.set_result(None)
    assert _after([], lambda: [inner]).result() is None


def test_a_failed_write_before_it_fails_the_read_and_starts_nothing():
    """The set's last write-back failed: its bytes are not on disk, and the read must not be
    taken for the chunk's state (the update that uses it raises)."""
    before, calls = [Future(), Future()], []
    out = _after(before, lambda: calls.append("then") or [])
    before[0].set_exception(OSError(28, "No space left on device"))
    before[1].set_result(None)
    assert not calls
    with pytest.raises(OSError, match="No space left"):
        out.result()


def test_a_failed_read_or_start_is_reported():
    before, inner = Future(), Future()
    out = _after([before], lambda: [inner])
    before.set_result(None)
    inner.set_exception(RuntimeError("short read"))
    with pytest.raises(RuntimeError, match="short read"):
        out.result()

    def closed():
        raise RuntimeError("store closed")

    done = Future()
    done.set_result(None)
    with pytest.raises(RuntimeError, match="store closed"):
        _after([done], closed).result()
