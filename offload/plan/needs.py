"""The device's needs besides chunks (pure, no torch): THE formula the engine
(`Engine._device_needs`) and the planner (`planner._Chunks.device_needs`) both call, so their
minimum gpu budgets are one number by construction (tests/test_needs.py feeds both the same
inputs)."""

from __future__ import annotations

from typing import Iterable, Sequence

from .placement import DeviceNeeds


def device_needs(*, compute: Sequence[int], home: Sequence[int], module_chunks: Iterable[Iterable[int]],
                 module_numels: Iterable[int], largest_param: int, element_size: int, needs_grad: bool,
                 buffers: int, activations: int, pinned: int = 0, gathered: Sequence[int] = ()) -> DeviceNeeds:
    """What one step needs on the device.

    compute / home: per chunk, bytes of its compute copy / of all its kinds (if gpu-home).
    module_chunks: for each module owning parameters, the chunks they live in; module_numels:
    for each such module, the elements of the parameters it owns (MeZO perturbs them).
    largest_param: elements of the largest parameter; gathered: of each chunk with a gradient,
    in chunk order; element_size: bytes per compute element.
    pinned: the most chunk bytes pinned at once so far (nested modules, parameters read outside
    their owner, measured by the engine): the window is at least that.

    The streaming window is the widest module's chunks plus one chunk being prefetched; the
    gradient reserve two neighbouring chunks' gradients gathered on the device (offload.engine.
    gradients: one chunk's on its way to its home while the next one's, backward's next, fill;
    at least the largest parameter's, in flight alone in the first backward), or for MeZO (no
    gradients) its +εz and -εz copies of the widest module's parameters."""
    widest = max(max((sum(compute[c] for c in cids) for cids in module_chunks), default=0), pinned)
    pair = max((a + b for a, b in zip(gathered, gathered[1:])), default=max(gathered, default=0))
    reserve = (max(largest_param, pair) * element_size if needs_grad
               else zo_workspace(module_numels, element_size))
    copy = max(largest_param, max(gathered, default=0)) * element_size if needs_grad else 0
    return DeviceNeeds(buffers=buffers, stream_window=widest + max(compute, default=0),
                       grad_reserve=reserve, activations=activations,
                       home_bytes=tuple(home), compute_bytes=tuple(compute), grad_copy=copy)


#: Gradients staged on the host on CUDA (offload.engine.gradients) pass through one registered
#: buffer of the largest copy's bytes, at most this many: a larger copy crosses in slices of it.
GRAD_STAGING_CAP = 64 << 20


def grad_staging_bytes(needs: DeviceNeeds) -> int:
    """The staging buffer's bytes (engine and planner alike)."""
    return min(needs.grad_copy, GRAD_STAGING_CAP)


#: Blocks are the unit of residency (one pair of hooks per block, its chunks acquired together
#: and kept through its recompute and backward) when their needs fit the gpu budget and the
#: window they take, the widest block's chunks plus one being fetched, is at most 1/BLOCK_SHARE
#: of it; under a tighter budget, the module is the unit (a smaller window fits more) at the cost
#: of a pair of hooks per module. Engine and planner both decide with `units_are_blocks`, once
#: the activations are known. The engine's minimum is the modules'; the planner's is the smaller
#: of the modules' and the blocks' (whose MLPs run in tiles: offload.engine.tiled).
BLOCK_SHARE = 4


def units_are_blocks(block_needs: DeviceNeeds, gpu_budget: "int | None") -> bool:
    """Whether the blocks are the units of residency: `block_needs`, the step's needs with blocks
    as the units (the allocator's margin counted among its activations); None: unlimited."""
    return gpu_budget is None or (block_needs.stream_window * BLOCK_SHARE <= gpu_budget
                                  and block_needs.minimum <= gpu_budget)


#: The CUDA allocator's room beside the ledger (offload.engine.workspace): the placement leaves
#: what the warm-up measured the allocator holding outside the ledger plus this margin for its
#: fragmentation: at least one small segment, or 1/16 of the gpu budget (125-295 MiB of 6 GiB
#: were seen unusable). The simulated device has no allocator: no margin there.
MARGIN_MIN = 2 << 20
MARGIN_SHARE = 16


def workspace_margin(budget: "int | None") -> int:
    """The fragmentation margin the engine keeps free on a CUDA device with this gpu budget."""
    return max(MARGIN_MIN, (budget or 0) // MARGIN_SHARE)


def minimum_with_margin(minimum: int) -> int:
    """The smallest gpu budget B that holds `minimum` bytes beside its own margin
    (B >= minimum + workspace_margin(B))."""
    b = max(minimum + MARGIN_MIN, minimum * MARGIN_SHARE // (MARGIN_SHARE - 1) - 2)  # at or below B
    while b < minimum + workspace_margin(b):
        b += 1
    return b


def zo_workspace(module_numels: Iterable[int], element_size: int) -> int:
    """MeZO's perturbed copies (+εz and -εz) of the widest module's parameters, in bytes."""
    return 2 * element_size * max(module_numels, default=0)


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def block_of(names: Sequence[str]) -> dict[str, str]:
    """Each parameter name's unit of residency, as the engine's module hooks see it
    (offload.engine.needs.module_chunks): its repeated block (`model.layers.7`: of the indexed
    collection with the most entries, the first on a tie, as offload.engine.model_info.find_blocks
    picks the largest ModuleList), else the module that owns it."""
    seen: dict[str, set[str]] = {}
    for n in names:
        parts = n.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                seen.setdefault(".".join(parts[:i]), set()).add(part)
    best = max(seen, key=lambda k: len(seen[k]), default=None)  # (max: the first of the largest)
    if best is None or len(seen[best]) < 2:
        return {n: module_of(n) for n in names}
    head = best + "." if best else ""
    out = {}
    for n in names:
        index, _, inner = n[len(head):].partition(".") if n.startswith(head) else ("", "", "")
        out[n] = head + index if index.isdigit() and inner else module_of(n)
    return out


def gathering(params: Sequence[Sequence[str]]) -> list[bool]:
    """Per chunk (its parameters' names), whether its gradients gather on the device in one
    buffer and cross in one copy (offload.engine.gradients): where it has several parameters,
    all in at most two units (`block_of`: a chunk across a block boundary is sent in two
    parts). A chunk of one parameter sends its gradient as it is; one across more units (a
    LoRA run's adapters, many layers' to a chunk) sends each parameter's gradient alone,
    instead of a chunk-sized buffer that is mostly zeros at every block."""
    units = block_of([n for names in params for n in names])
    return [len(names) > 1 and len({units[n] for n in names}) <= 2 for names in params]
