"""The executor: the only owner of copy streams (CUDA) or copy threads (simulated device).

It moves bytes between the `gpu` tier and host-side tiers and hands out Tickets that the
compute thread waits on just before it needs the data (never a whole-device sync). It
carries no policy: what to move and when is decided by the engine's schedule.

Simulated device: one thread per direction (PCIe is full duplex), each copy optionally
throttled by a Link so that overlap can be measured on a CPU-only machine.
CUDA: one stream per direction; a Ticket is an event the compute stream waits on.
Every copy goes through its lane's worker, also on CUDA: enqueueing device-only copies from
the calling thread instead ("direct copies") was measured on an H200 (bench/README.md,
gpu_check.sh, 2026-12-04 third session) 1.18-1.24x slower per step and changed a QLoRA run's
losses, so it was removed.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable

import torch

from .link import Link

class Ticket:
    """Completion of one transfer. `wait()` is called on the compute thread before use (or on a
    CPU thread that reads the host memory it filled)."""

    def __init__(self, future: Future, event: "torch.cuda.Event | None" = None):
        self._future = future
        self._event = event

    def done(self) -> bool:
        return self._future.done()

    @property
    def future(self) -> Future:
        """Done once the transfer is over (on CUDA: its bytes have landed, for copies and jobs
        whose destination or source is host memory)."""
        return self._future

    def wait(self) -> None:
        self._future.result()  # re-raises a copy error on the compute thread
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def settle(self) -> None:
        """Wait until the transfer is over, failed or not: its buffer is being dropped (a failed
        copy's error is for whoever uses the bytes; nobody will)."""
        futures_wait([self._future])
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


@dataclass(kw_only=True)
class _Lane:
    """One direction: a worker thread with its queue, its link and (on CUDA) its stream."""

    name: str
    link: Link
    stream: "torch.cuda.Stream | None" = None
    jobs: queue.Queue = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None


class Executor:
    """Runs copies between tiers asynchronously. `device` is 'cuda' or 'cpu' (simulated)."""

    def __init__(self, *, device: torch.device, h2d_bandwidth: float | None = None,
                 d2h_bandwidth: float | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.lanes = {
            "h2d": _Lane(name="h2d", link=Link(name="h2d", bandwidth=h2d_bandwidth)),
            "d2h": _Lane(name="d2h", link=Link(name="d2h", bandwidth=d2h_bandwidth)),
        }
        for lane in self.lanes.values():
            if self.cuda:
                lane.stream = torch.cuda.Stream(device=device)
            lane.thread = threading.Thread(target=self._work, args=(lane,), daemon=True,
                                           name=f"tierwise-{lane.name}")
            lane.thread.start()
        self.wait_seconds = 0.0  # compute-thread time spent waiting on tickets

    def _work(self, lane: _Lane) -> None:
        while True:
            job = lane.jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiter
                fut.set_exception(exc)

    def _submit(self, lane_name: str, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        self.lanes[lane_name].jobs.put((fn, fut))
        return fut

    def copy(self, lane_name: str, dst: torch.Tensor, src: torch.Tensor, *,
             accumulate: bool = False, staging: torch.Tensor | None = None,
             then: Callable[[], None] | None = None) -> Ticket:
        """dst (+)= src on `lane_name`; `then` runs on the worker after the copy lands.

        The source was produced on the compute stream, so on CUDA the copy stream first waits
        for an event recorded there now. `accumulate` into a host tensor needs a `staging`
        host buffer on CUDA (the add runs on the CPU once the bytes have landed).
        """
        lane = self.lanes[lane_name]
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        done_event = torch.cuda.Event() if self.cuda else None

        def run() -> None:
            start = time.perf_counter()
            if self.cuda:
                with torch.cuda.stream(lane.stream):
                    lane.stream.wait_event(ready)
                    target = staging if accumulate else dst
                    target.copy_(src, non_blocking=True)
                    done_event.record(lane.stream)
                if accumulate or dst.device.type == "cpu":
                    done_event.synchronize()
                if accumulate:
                    dst.add_(staging)
            elif accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)
            lane.link.wait_for(src.numel() * src.element_size(), start)
            if then is not None:
                then()

        return Ticket(self._submit(lane_name, run), done_event)

    def job(self, lane_name: str, fn: Callable[["torch.cuda.Stream | None"], None], *,
            nbytes: int, links: tuple[Link, ...] = ()) -> Ticket:
        """Run `fn(stream)` on a lane's worker (e.g. read a swap file, then copy to the device).

        On CUDA, `fn` issues its device copies on `stream`; the Ticket's event follows them.
        The lane's link (and `links`, e.g. a CXL link) are charged `nbytes`.
        """
        lane = self.lanes[lane_name]
        ready = None
        if self.cuda:  # fn writes device buffers the compute stream allocated (a cache buffer
            # whose memory a chunk evicted a moment ago still feeds queued kernels): wait for them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        done_event = torch.cuda.Event() if self.cuda else None

        def run() -> None:
            start = time.perf_counter()
            if self.cuda:
                with torch.cuda.stream(lane.stream):
                    lane.stream.wait_event(ready)
                    fn(lane.stream)
                    done_event.record(lane.stream)
                done_event.synchronize()  # fn's host buffers may be reused by the next job
            else:
                fn(None)
            for link in (lane.link, *links):
                link.wait_for(nbytes, start)

        return Ticket(self._submit(lane_name, run), done_event)

    def wait(self, ticket: Ticket) -> None:
        """Wait on the compute thread, counting the time spent (not overlapped)."""
        if ticket.done() and not self.cuda:
            ticket.wait()
            return
        start = time.perf_counter()
        ticket.wait()
        self.wait_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Block until every queued copy has finished."""
        for lane in self.lanes.values():
            self._submit(lane.name, lambda: None).result()
        if self.cuda:
            for lane in self.lanes.values():
                lane.stream.synchronize()

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.jobs.put(None)
        for lane in self.lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=10)
