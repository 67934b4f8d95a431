"""The executor: the only owner of copy streams (CUDA) or copy threads (simulated device).

It moves bytes between the `gpu` tier and host-side tiers and hands out Tickets that the
compute thread waits on just before it needs the data (never a whole-device sync). It
carries no policy: what to move and when is decided by the engine's schedule.

Simulated device: one thread per direction (PCIe is full duplex), each copy optionally
throttled by a Link so that overlap can be measured on a CPU-only machine.
CUDA: one stream per direction; a Ticket is an event the compute stream waits on. A job that
leaves no host buffer for a later one to overwrite (`reuses_host=False`: a fill from a chunk's
pinned home) is done for the launching thread once its copy is enqueued: the compute stream
waits on its event, the host on nothing. One that reads a reused host buffer (an NVMe bounce
buffer, an update set) is waited for by its worker before the lane's next job, and its ticket
by the host: what the counters call a host wait (`host_sync`).
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
from typing import Any, Callable

import torch

from .link import Link

class Ticket:
    """Completion of one transfer. `wait()` is called on the compute thread before use (or on a
    CPU thread that reads the host memory it filled)."""

    def __init__(self, future: Future, event: "torch.cuda.Event | None" = None, *, host_sync: bool = True):
        self._future = future
        self._event = event
        # on CUDA, waiting for this ticket waits for the device's copy to finish (a host wait on
        # device progress); the simulated device sets it as CUDA would, for the counters
        self.host_sync = host_sync

    def done(self) -> bool:
        """The transfer is over (on CUDA, without waiting: its event is queried)."""
        if not self._future.done():
            return False
        return self.host_sync or self._event is None or self._event.query()

    @property
    def future(self) -> Future:
        """Done once the transfer is over, for copies and jobs with `host_sync` (on CUDA: their
        bytes have landed); for the others, once their copies are enqueued."""
        return self._future

    def wait(self) -> None:
        """The compute stream may use the bytes (on CUDA the host waits for the enqueue only,
        unless `host_sync`)."""
        self._future.result()  # re-raises a copy error on the compute thread
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def landed(self) -> None:
        """(A host consumer, any thread.) Wait until the bytes have landed; no stream waits on
        anything (the update worker's thread would otherwise make the compute stream wait)."""
        self._future.result()
        if self._event is not None and not self.host_sync:
            self._event.synchronize()

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
        self.host_waits = 0  # of those waits, the ones that wait for device progress (Ticket.host_sync)

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
            job = fn = None  # (its tensors are not kept alive while the lane waits for the next)

    def _submit(self, lane_name: str, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        self.lanes[lane_name].jobs.put((fn, fut))
        return fut

    def copy(self, lane_name: str, dst: torch.Tensor, src: torch.Tensor, *,
             accumulate: bool = False, staging: torch.Tensor | None = None,
             then: Callable[[], None] | None = None) -> Ticket:
        """dst (+)= src on `lane_name`; `then` runs on the worker after the copy lands.

        The source was produced on the compute stream, so on CUDA the copy stream first waits
        for an event recorded there now. `staging`: a host buffer of src's dtype and size the
        bytes land in first; the worker then adds them to dst (`accumulate`) or copies them
        there, converting to dst's dtype on the CPU, so they cross the link as src holds them
        (a bf16 gradient for an fp32 home: half the bytes); a staging buffer smaller than src (both
        flat) takes it in slices. On CUDA `accumulate` needs one. The lane's copies may share one
        staging buffer: each is done with it before the next starts.
        """
        if self.cuda and accumulate and staging is None:
            raise ValueError("accumulating a device-to-host copy on CUDA needs a staging buffer")
        lane = self.lanes[lane_name]
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        done_event = torch.cuda.Event(blocking=True) if self.cuda else None  # (its waiter sleeps, not spins)

        def run() -> None:
            start = time.perf_counter()
            if staging is not None:
                self._staged(lane, ready, done_event, dst, src, staging, accumulate)
            elif self.cuda:
                with torch.cuda.stream(lane.stream):
                    lane.stream.wait_event(ready)
                    dst.copy_(src, non_blocking=True)
                    done_event.record(lane.stream)
                if dst.device.type == "cpu":
                    done_event.synchronize()
            else:
                dst.add_(src) if accumulate else dst.copy_(src)
            lane.link.wait_for(src.numel() * src.element_size(), start)
            if then is not None:
                then()

        return Ticket(self._submit(lane_name, run), done_event, host_sync=accumulate or lane_name == "d2h")

    def _staged(self, lane: "_Lane", ready: Any, done: Any, dst: torch.Tensor, src: torch.Tensor,
                staging: torch.Tensor, accumulate: bool) -> None:
        """copy's body through `staging`, a slice of src at a time (on the lane's worker)."""
        step = max(1, staging.numel())  # (a gradient of no elements: nothing to copy)
        for a in range(0, src.numel(), step):
            b = min(src.numel(), a + step)
            part = staging[: b - a]
            if self.cuda:
                with torch.cuda.stream(lane.stream):
                    lane.stream.wait_event(ready)
                    part.copy_(src[a:b], non_blocking=True)
                    done.record(lane.stream)
                done.synchronize()
            else:
                part.copy_(src[a:b])
            dst[a:b].add_(part) if accumulate else dst[a:b].copy_(part)

    def job(self, lane_name: str, fn: Callable[["torch.cuda.Stream | None"], None], *,
            nbytes: int, links: tuple[Link, ...] = (), reuses_host: bool = True) -> Ticket:
        """Run `fn(stream)` on a lane's worker (e.g. read a swap file, then copy to the device).

        On CUDA, `fn` issues its device copies on `stream`; the Ticket's event follows them.
        The lane's link (and `links`, e.g. a CXL link) are charged `nbytes`. `reuses_host`: fn
        reads a host buffer a later job may overwrite, so its worker waits for its copies to
        land before the next job (and so does a host waiting on its ticket); False: its ticket
        is done for the compute stream once enqueued.
        """
        lane = self.lanes[lane_name]
        ready = None
        if self.cuda:  # fn writes device buffers the compute stream allocated (a cache buffer
            # whose memory a chunk evicted a moment ago still feeds queued kernels): wait for them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        done_event = torch.cuda.Event(blocking=True) if self.cuda else None

        def run() -> None:
            start = time.perf_counter()
            if self.cuda:
                with torch.cuda.stream(lane.stream):
                    lane.stream.wait_event(ready)
                    try:
                        fn(lane.stream)
                    finally:  # (fn raised: what it enqueued still writes its buffers until this)
                        done_event.record(lane.stream)
                if reuses_host:
                    done_event.synchronize()  # fn's host buffers may be reused by the next job
            else:
                fn(None)
            for link in (lane.link, *links):
                link.wait_for(nbytes, start)

        return Ticket(self._submit(lane_name, run), done_event, host_sync=reuses_host)

    def wait(self, ticket: Ticket) -> None:
        """Wait on the compute thread, counting the time spent (not overlapped)."""
        self.host_waits += ticket.host_sync and not ticket.done()  # (a landed copy: no wait)
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
