"""The engine with state on NVMe and a (emulated) CXL tier, against plain PyTorch."""

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tierwise.offload import Activations, Budget, Engine, Optim, Precision, flat_options
from tierwise.offload.core.errors import NvmeError
from tests.models import batches, tiny_llama, train_reference

CHUNK = 16 << 10


def weights(eng):
    return dict(eng.named_parameters_fp32())


@pytest.mark.parametrize("tiers", ["host+nvme", "cxl+nvme", "cxl-state+nvme"])
def test_fp32_bit_exact_with_state_on_nvme_and_cxl(tmp_path, tiers):
    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(), data)
    # (fp32 masters take DRAM, then CXL, before states: offload.plan.homes)
    budgets = {"host+nvme": dict(cpu_mem="1M"), "cxl+nvme": dict(cpu_mem="1M", cxl_mem="256K"),
               "cxl-state+nvme": dict(cpu_mem="1M", cxl_mem="1M")}[tiers]
    eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem="500K", chunk_bytes=CHUNK, nvme_path=str(tmp_path / "swap"),
                 cxl_bandwidth=20e9, **budgets))
    assert eng.homes.bytes["nvme"]["state"] > 0
    if tiers == "cxl-state+nvme":
        assert eng.homes.bytes["cxl"]["state"] > 0 and "master" not in eng.homes.bytes["nvme"]
    else:
        assert eng.homes.bytes["nvme"]["master"] > 0
        assert tiers == "host+nvme" or eng.homes.bytes["cxl"]["master"] > 0
    assert [eng.step(b) for b in data] == ref_losses
    assert eng.early.updated > 0  # chunks were updated during backward, and the result is the same
    if tiers != "cxl-state+nvme":
        assert eng.residency.copied_masters > 0  # masters taken from cached compute copies, not NVMe
    assert eng.reads_ahead > 0  # and master and state read before the chunk's gradient completed
    assert eng.residency.kept > 0  # the next forward's first chunks stayed resident over the steps' ends
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    for tier, peak in eng.ledger.peaks().items():
        budget = eng.ledger.budgets[tier]
        assert budget is None or peak <= budget, tier
    assert os.listdir(tmp_path / "swap")
    cache = eng.residency.cache
    eng.close()
    assert not (tmp_path / "swap").exists() or not os.listdir(tmp_path / "swap")
    assert not cache.spares and not cache.entries  # the cache's buffers (kept ones too) go with the engine


@pytest.mark.parametrize("load", ["load_weights", "init_weights_"])
def test_weights_loaded_between_steps_replace_the_copies_kept_over_a_steps_end(tmp_path, load):
    """The next forward's first chunks stay resident over a step's end (rewritten from their new
    masters): new weights loaded between steps must not meet those copies."""
    data = batches(3)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="1M", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    for b in data[:2]:
        eng.step(b)
    assert eng.residency.kept > 0 and any(eng.residency.cache.resident(c) for c in eng.residency.keep)
    other = tiny_llama(seed=5)
    if load == "load_weights":
        eng.load_weights((n, p.detach()) for n, p in other.named_parameters())
    else:
        eng.init_weights_(seed=3)
        with torch.no_grad():
            for n, p in other.named_parameters():
                p.copy_(dict(eng.named_parameters_fp32())[n])
    with torch.no_grad():
        ref = other(**data[2]).loss.item()
    assert eng.eval_loss(data[2]) == ref
    eng.close()


def test_the_first_update_of_a_backward_starts_from_a_read_ahead(tmp_path):
    """The master and state of the chunk that completed first in the last backward are read
    before backward starts (not once its gradient is complete): the first update does not
    begin with a wait on the disk. Bit-exact against plain PyTorch."""
    data = batches(4)
    ref_losses, _ = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="1M", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    events = []
    read, submit = eng.nvme.read_async, eng.early.submit
    eng.nvme.read_async = lambda key, *a, **k: (events.append(("read", key)), read(key, *a, **k))[1]
    eng.early.submit = lambda cid, *a, **k: (events.append(("complete", cid)), submit(cid, *a, **k))[1]
    losses = []
    for b in data:
        events.clear()
        losses.append(eng.step(b))
    first = eng._order[0]
    assert any(t == "nvme" for t in eng.homes.tiers[first].values())
    assert events.index(("read", f"c{first}.state")) < events.index(("complete", first))
    assert losses == ref_losses
    eng.close()


def test_the_state_of_the_chunk_after_next_is_read_before_the_next_gradient_completes(tmp_path):
    """Two update sets: while one chunk's update writes back from one set, the chunk expected
    after the next is read into it as soon as those writes land (swapping.chained_read), not once
    the next chunk's gradient is complete. Backward is held at that chunk's completion until the
    read has started: without the chained read it never would. Bit-exact against plain PyTorch."""
    import threading

    data = batches(4)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="600K", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    losses = [eng.step(b) for b in data[:2]]
    order = eng._order
    assert len(order) > 3 and all(eng.homes.tiers[c].get("state") == "nvme" for c in order[:4])
    started, read, submit = threading.Event(), eng.nvme.read_async, eng.early.submit
    watch = f"c{order[3]}.state"  # the third read ahead of the backward (read_ahead takes 2)
    waited = []

    def read_async(key, *a, **k):
        if key == watch:
            started.set()
        return read(key, *a, **k)

    def held_submit(cid, *a, **k):
        if cid == order[2]:
            waited.append(started.wait(timeout=10))
        return submit(cid, *a, **k)

    eng.nvme.read_async, eng.early.submit = read_async, held_submit
    for b in data[2:]:
        started.clear()
        losses.append(eng.step(b))
    assert waited == [True, True]
    assert losses == ref_losses
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


def test_kept_first_chunks_not_cached_come_from_the_update_sets(tmp_path):
    """The next forward's first chunks, when not cached at their update (the embedding: backward
    never reads it), are put into the cache from the update set that holds their new master
    (residency.evict_updated), so that forward reads none of them from NVMe. Bit-exact."""
    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="600K", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    events, cache = [], eng.residency.cache
    read, read_sync, put, backward = eng.nvme.read_async, eng.nvme.read, cache.put, eng.backward
    eng.nvme.read_async = lambda key, *a, **k: (events.append(("read", key)), read(key, *a, **k))[1]
    eng.nvme.read = lambda key, *a, **k: (events.append(("read", key)), read_sync(key, *a, **k))[1]
    cache.put = lambda cid, fill: (events.append(("put", cid)), put(cid, fill))[1]
    eng.backward = lambda *a, **k: (events.append(("backward", None)), backward(*a, **k))[1]
    assert [eng.step(b) for b in data] == ref_losses
    puts = [i for i, e in enumerate(events) if e[0] == "put"]
    assert len(puts) >= len(data) - 2  # every step once the schedule exists
    for i in puts:
        forward = events[i:events.index(("backward", None), i)] if ("backward", None) in events[i:] else events[i:]
        assert ("read", f"c{events[i][1]}.master") not in forward
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


@pytest.mark.parametrize("offload", [False, True, "nvme"], ids=["kept", "offloaded", "offloaded to nvme"])
@pytest.mark.parametrize("where", ["between forward and backward", "in the loss function"])
def test_a_step_that_fails_before_its_backward_gives_its_activations_back(tmp_path, where, offload):
    """Ctrl-C between a step's forward and its backward, or a loss function that raises once the
    model has run: the step is dropped (Engine.step aborts it), the activations its forward
    saved are given back to the ledger (ActivationTracker.abandon: a graph whose backward never
    runs holds them in a reference cycle the collector does not free), and training goes on as
    plain PyTorch's does on the other batches, bit for bit. With the blocks' inputs offloaded,
    their host, device and NVMe bytes too (Offloader.abandon)."""
    import gc

    from tierwise.offload import Activations

    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(), [b for i, b in enumerate(data) if i != 2])
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="600K", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3), activations=Activations(recompute=True, offload=bool(offload),
                                                               host=(64 << 10) * bool(offload),
                                                               nvme=(1 << 20) * (offload == "nvme")))
    backward, loss_fn = eng.backward, eng.loss_fn

    def interrupted(loss):
        raise KeyboardInterrupt

    def bad_batch(model, batch):
        loss_fn(model, batch)
        raise ValueError("bad batch")

    losses = []
    for i, b in enumerate(data):
        if i != 2:
            losses.append(eng.step(b))
            continue
        if where == "in the loss function":
            eng.loss_fn = bad_batch
        else:
            eng.backward = interrupted
        with pytest.raises((KeyboardInterrupt, ValueError)):
            eng.step(b)
        eng.backward, eng.loss_fn = backward, loss_fn
        gc.collect()
        assert eng.ledger.usage()["gpu"].get("activation", 0) == 0
        spares = eng.tracker.offloader.spare_bytes if offload else 0  # (kept for the next step's inputs)
        assert eng.ledger.usage()["host"].get("activation", 0) == spares
        assert eng.ledger.usage()["nvme"].get("activation", 0) == 0
    assert losses == ref_losses
    assert (eng.ledger.kind_peak("nvme", "activation") > 0) == (offload == "nvme")
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


def test_an_update_that_fails_midway_leaves_no_read_in_flight(tmp_path, monkeypatch):
    """An update that raises after it started reading the next chunk into the other set: the
    error leaves once those reads landed (a later read into that set would race them)."""
    import time

    data = batches(3)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="1M", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3, overlap_update=False))  # one update_all, every chunk
    for b in data[:2]:
        eng.step(b)
    reads, real_read, real_preadv = [], eng.nvme.read_async, os.preadv
    eng.nvme.read_async = lambda *a, **k: (reads.append(real_read(*a, **k)), reads[-1])[1]
    monkeypatch.setattr(os, "preadv", lambda *a: (time.sleep(0.05), real_preadv(*a))[1])
    calls, real_step = [0], eng.updater.step

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("update failed")
        return real_step(*a, **k)

    eng.updater.step = failing
    with pytest.raises(RuntimeError, match="update failed"):
        eng.step(data[2])
    assert reads and all(f.done() for f in reads)
    eng.close()


def test_a_failed_write_back_stops_the_run_with_no_wrong_loss(tmp_path, monkeypatch):
    """The update's last write-backs outlive the step (update_all's `defer`): a write that
    fails there stops the run at the next step at the latest, and every loss returned before
    is the reference's (nothing read from the failed file reaches a forward)."""
    import errno

    data = batches(6)
    ref_losses, _ = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="1M", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    losses = [eng.step(b) for b in data[:2]]
    real = os.pwritev

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(NvmeError, match="No space left|no valid data"):
        for b in data[2:]:
            losses.append(eng.step(b))
    assert 2 <= len(losses) <= 3 and losses == ref_losses[: len(losses)]
    monkeypatch.setattr(os, "pwritev", real)


def test_fp32_masters_in_dram_with_states_on_nvme_keep_every_cached_first_chunk(tmp_path):
    """fp32 masters take DRAM before states (offload.plan.homes): a chunk whose state is on
    NVMe but whose master is in DRAM is updated through the bounce sets too; its cached copy
    must still be rewritten from the new master and kept over the step's end, not evicted and
    fetched again. Bit-exact with plain PyTorch."""
    data = batches(5)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", chunk=CHUNK, cpu="1500K", nvme=str(tmp_path / "swap")),
                 optim=Optim(lr=1e-3))
    assert eng.homes.bytes["nvme"]["state"] > 0 and "master" not in eng.homes.bytes["nvme"]
    res, cached, kept = eng.residency, [], []

    def evict_updated(orig=res.evict_updated):
        cached.append(sum(res.cache.resident(c) for c in res.keep))  # cached through their update
        before = res.kept
        orig()
        kept.append(res.kept - before)

    res.evict_updated = evict_updated
    assert [eng.step(b) for b in data] == ref_losses
    assert sum(cached) > len(data) and kept == cached  # each of them kept, none fetched again
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


def mixed_precision_reference(model, data, *, lr=1e-3):
    """bf16 compute, fp32 master weights and AdamW: the textbook mixed-precision loop."""
    master = copy.deepcopy(model)
    work = copy.deepcopy(model)
    for p in work.parameters():  # parameters only: buffers (rotary frequencies) stay fp32
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0, fused=True)
    losses = []
    for b in data:
        loss = work(**b).loss
        loss.backward()
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad = pw.grad.float()
            pw.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), work.parameters()):
                pw.copy_(pm)
        losses.append(loss.float().item())
    return losses, master


def test_bf16_bit_exact_with_mixed_precision_reference(tmp_path):
    data = batches(4)
    ref_losses, ref = mixed_precision_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", cpu="1500K", cxl="1M", chunk=CHUNK, nvme=str(tmp_path)),
                 optim=Optim(lr=1e-3), precision=Precision("bf16"))
    assert eng.homes.bytes["cxl"].get("compute", 0) > 0  # latency-tolerant copies go to CXL first
    assert [eng.step(b) for b in data] == ref_losses
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


def test_flipped_byte_and_truncated_swap_file_fail_clearly_and_checkpoint_survives(tmp_path):
    eng = Engine(tiny_llama(), budget=Budget(gpu="500K", cpu="1M", chunk=CHUNK, nvme=str(tmp_path / "swap"), nvme_checksum=True),
                 optim=Optim(lr=1e-3))
    eng.step(batches(1)[0])
    ckpt = tmp_path / "ckpt.pt"
    torch.save(eng.state_dict(), ckpt)
    key = next(d.key for ch in eng.store.chunks for _, _, d in ch.kinds() if hasattr(d, "key"))
    path = eng.nvme.path(key)
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(NvmeError, match="checksum mismatch"):
        eng.state_dict()
    os.truncate(path, 4096)
    with pytest.raises(NvmeError, match="truncated"):
        eng.state_dict()
    eng.close()
    saved = torch.load(ckpt)
    fresh = Engine(tiny_llama(), budget=Budget(chunk=CHUNK), optim=Optim(lr=1e-3))
    fresh.load_state_dict(saved)  # the checkpoint written before the damage is whole
    assert fresh.steps == 1


def test_swap_files_removed_on_ctrl_c(tmp_path):
    swap = tmp_path / "swap"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.models import tiny_llama, batches
        from tierwise.offload import Budget, Engine
        eng = Engine(tiny_llama(), budget=Budget(gpu="500K", cpu="1M", chunk={CHUNK}, nvme={str(swap)!r}))
        eng.step(batches(1)[0])
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert os.listdir(swap)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert not swap.exists() or not os.listdir(swap)


def test_activation_offload_is_exact_and_lowers_the_device_minimum():
    data = batches(3, seq=64, vocab=32)
    ref_losses, ref = train_reference(tiny_llama(layers=8, vocab=32), data)
    minimum = {}
    for offload in (False, True):
        eng = Engine(tiny_llama(layers=8, vocab=32), budget=Budget(gpu="8M", chunk=CHUNK), optim=Optim(lr=1e-3),
                     activations=Activations(offload=offload))
        assert [eng.step(b) for b in data] == ref_losses
        assert all(torch.equal(weights(eng)[n], p.detach()) for n, p in ref.named_parameters())
        minimum[offload] = eng.minimum_gpu_bytes
        host_peak = eng.ledger.kind_peak("host", "activation")
        assert (host_peak > 0) == offload  # block inputs waited in host memory
        usage = eng.ledger.usage()
        spares = eng.tracker.offloader.spare_bytes if offload else 0  # (kept for the next step's inputs)
        assert not usage["gpu"].get("activation") and usage["host"].get("activation", 0) == spares
    block_inputs = 8 * 4 * 64 * 64 * 4  # layers x tokens x hidden x fp32
    assert minimum[True] <= minimum[False] - block_inputs // 2


def test_activation_offload_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="needs checkpointing"):
        Engine(tiny_llama(layers=2, vocab=32), budget=Budget(gpu="8M", chunk=CHUNK),
               activations=Activations(offload=True, recompute=False))


def test_gradients_on_nvme_with_accumulation_and_clipping_bit_exact(tmp_path):
    data = batches(4, batch=8)
    ref_losses, ref = train_reference(tiny_llama(), data, grad_accum=2, clip=0.05)
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", cpu="400K", chunk=CHUNK, nvme=str(tmp_path)),
                 optim=Optim(lr=1e-3, grad_clip=0.05))
    assert eng.homes.bytes["nvme"]["grad"] > eng.homes.bytes["host"].get("grad", 0)
    assert [eng.step(b, grad_accum=2) for b in data] == ref_losses
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    assert eng.ledger.peaks()["host"] <= 400 << 10


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_nvme_gradients_go_straight_to_the_early_update_bit_exact(tmp_path, grad_accum):
    """Gradients on NVMe, updated during backward: the update takes each chunk's sum from the
    spill's staging buffer, so after the warm-up the update reads no gradient file (only the
    spill reads back an earlier micro-batch's sum, urgently) and, without accumulation, hardly
    any is written; the numbers are plain PyTorch's."""
    data = batches(4, batch=4 * grad_accum)
    ref_losses, ref = train_reference(tiny_llama(), data, grad_accum=grad_accum)
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", cpu="400K", chunk=CHUNK, nvme=str(tmp_path)),
                 optim=Optim(lr=1e-3))
    assert eng.homes.bytes["nvme"]["grad"] > eng.homes.bytes["host"].get("grad", 0)
    reads, writes = [], []
    read_async, write_async = eng.nvme.read_async, eng.nvme.write_async
    eng.nvme.read_async = lambda key, dst, urgent=False: reads.append((key, urgent)) or read_async(key, dst, urgent=urgent)
    eng.nvme.write_async = lambda key, src: writes.append(key) or write_async(key, src)
    losses = []
    for i, b in enumerate(data):
        reads.clear(), writes.clear()
        losses.append(eng.step(b, grad_accum=grad_accum))
        if i:  # after the warm-up every chunk is updated early
            assert not [k for k, urgent in reads if k.endswith(".grad") and not urgent]
            assert any(k.endswith(".master") for k, _ in reads)  # (the wrapper sees the update's reads)
            spilled = [c for c, ch in enumerate(eng.store.chunks) if hasattr(ch.grad, "key")]
            if grad_accum == 1:  # (a chunk flushed early, when a third one opened, is still written)
                assert len([k for k in writes if k.endswith(".grad")]) < len(spilled) // 4
    assert losses == ref_losses and eng.early.updated > 0 and eng.reads_ahead > 0
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    assert eng.ledger.peaks()["host"] <= 400 << 10
    eng.close()


def test_a_read_ahead_of_another_chunk_is_dropped_bit_exact(tmp_path):
    """The update reads ahead the chunk it expects next; when another one comes first, the
    read-ahead is waited for and dropped (its set reused), and the numbers stay plain PyTorch's.
    Here it always expects chunk 0 (the last to complete): wrong but for the last chunk (which
    may come in one batch with the one before it: then every read-ahead is dropped); and chunk 1
    after it, whose read chained into the set just written is dropped too (swapping.chained_read)."""
    data = batches(4)
    ref_losses, ref = train_reference(tiny_llama(), data)
    eng = Engine(tiny_llama(), budget=Budget(gpu="600K", cpu="400K", chunk=CHUNK, nvme=str(tmp_path)),
                 optim=Optim(lr=1e-3))
    assert eng.homes.bytes["nvme"]["master"] > 0 and eng.homes.bytes["nvme"]["state"] > 0
    eng._expected = lambda chunks: (None, None) if 0 in chunks else (0, None if 1 in chunks else 1)
    assert [eng.step(b) for b in data] == ref_losses
    assert eng._ahead["issued"] > eng.reads_ahead and eng.early.updated > 0  # some were dropped
    mine = weights(eng)
    assert all(torch.equal(mine[n], p.detach()) for n, p in ref.named_parameters())
    eng.close()


@pytest.mark.parametrize("nvme", [False, True])
def test_masters_copied_from_the_parameters_carry_no_autograd_history(tmp_path, nvme):
    """The engine copies the model's weights into its fp32 masters under grad mode: the masters
    must not join the parameters' graph (CopySlices on every master, requires_grad True): the
    update and every copy made from them would then be recorded by autograd."""
    kw = dict(cpu_mem="600K", nvme_path=str(tmp_path / "swap")) if nvme else {}
    eng = Engine(tiny_llama(), **flat_options(lr=1e-3, gpu_mem="500K", chunk_bytes=CHUNK, **kw))
    for b in batches(2):
        eng.step(b)
    masters = [ch.master for ch in eng.store.chunks if isinstance(ch.master, torch.Tensor)]
    assert masters and not any(t.requires_grad or t.grad_fn is not None for t in masters)
    assert not any(e.buf.requires_grad for e in eng.residency.cache.entries.values())
    eng.close()
