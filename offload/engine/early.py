"""Updates that start during backward: a chunk whose gradients are complete is updated while
backward goes on with earlier layers (its disk reads and writes, and on a GPU machine its CPU
work, overlap the rest of backward). Only when nothing can still change its gradient: the last
micro-batch of a step, and no global-norm clipping (which needs every gradient first); and not a
chunk the first backward still read after its last gradient (a weight also used through
.detach(): GradientRouter.read_in_backward), whose update would change what backward reads.
"Complete" is counted from the first backward (GradientRouter._learn_uses): every parameter of the
chunk has delivered its sum of as many contributions as that backward gave it (a weight
shared by several recomputed blocks gets one per block).

One worker thread takes the chunks in the order they complete, in batches, and runs the same
update (`update_all`) as the end of the step; the step's own update then skips them.
A chunk whose gradient lives on NVMe comes with it still in host memory (`handed`: the gradient
spill's staging buffer, offload.engine.gradspill), so the update neither waits for its write
nor reads it back; the buffer goes back to the spill once that chunk is updated. Before
backward the worker starts reading the master and state of the chunk that completed first in
the last step (`ahead`); each pass also reads ahead those of the chunk that completed next
(offload.runtime.swapping.update_all, `expect`), and chains the read of the one after that
behind its own write-backs (`expect_after`); it takes an fp32 master from the device cache
while it is there (offload.engine.residency.copy_master).
After a failure the worker runs no more updates until wait() has reported it: with several
ranks a later chunk's reduce would be a collective out of step with the other ranks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class EarlyUpdater:
    """Gets `update(chunks, handed, final)`: the step's update of those chunks (update_all on
    the store; `final` False: their reduce only); `handed`: {chunk: (its gradient in host
    memory, called once it is consumed)}; `on_error(exc)`: called on the worker when an update
    fails (it wakes what waits on the failed chunks)."""

    def __init__(self, update: Callable[[list[int]], None],
                 on_error: "Callable[[BaseException], None] | None" = None):
        self.update, self.on_error = update, on_error
        self.jobs: queue.Queue = queue.Queue()
        self.done: set[int] = set()
        self.updated = 0  # chunks updated during backward, over the run
        self.error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, daemon=True, name="tierwise-update")
        self._thread.start()

    def submit(self, cid: int, tickets: list[Any], handed: "tuple[Any, Callable[[], None]] | None" = None, *,
               final: bool = True) -> None:
        """Update chunk `cid` once `tickets` (its gradients' copies) are done; `handed`: its
        gradient in a host buffer and what gives the buffer back. `final` False (several ranks,
        a micro-batch before the step's last): only reduce it onto its owner, no update."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self.jobs.put((cid, tickets, handed, final))

    def ahead(self, fn: Callable[[], None]) -> None:
        """Run `fn` (a read-ahead: offload.runtime.swapping.read_ahead) on the worker, before the
        updates submitted after it; a failure is reported as an update's."""
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self.jobs.put(fn)

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            if self.error is None:
                fn()
        except BaseException as exc:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self._done(1)

    def _done(self, n: int) -> None:
        with self._lock:
            self._pending -= n
            if self._pending == 0:
                self._idle.set()

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            if callable(item):
                self._run(item)
                continue
            batch = [item]
            while True:  # take every chunk already complete: one pipelined pass over them
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)
                    break
                if callable(nxt):
                    self._run(nxt)
                    continue
                batch.append(nxt)
            handed = {c: h for c, _, h, _ in batch if h is not None}
            final = all(f for *_, f in batch)  # (one backward's jobs: all final or none)
            try:
                if self.error is None:  # (after a failure: skipped, until wait() reports it)
                    for _, tickets, _, _ in batch:
                        for t in tickets:
                            t.landed()  # the gradient has landed in host memory (no stream waits)
                    chunks = [c for c, *_ in batch]
                    self.update(chunks, handed, final=final)
                    if final:
                        self.done.update(c for c, *_ in batch)
                        self.updated += len(batch)
            except BaseException as exc:  # raised on the compute thread by wait()
                self.error = exc
                if self.on_error is not None:
                    self.on_error(exc)
            finally:
                for _, give_back in handed.values():  # (once each: update_all pops what it used)
                    give_back()
            self._done(len(batch))

    def wait(self) -> None:
        """Block until every submitted chunk is updated; re-raise a failure."""
        self._idle.wait()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=30)
