"""Token-wise parts of a block run in sequence tiles: no intermediate of the whole sequence.

A Llama-family MLP (gate, up, their product, down) makes 3 to 4 tensors of tokens x
intermediate size: at 32K tokens and an 8B model's 14,336 that is 0.94 GB each in bf16. It
is token-wise (each token's output depends on that token alone), so it can run a tile of
tokens at a time:
- forward (the block's first, gradient-free forward, and its recompute): tile by tile into
  one output tensor; in the recompute of a block that only adds the output to its residual
  (perfmodel.RESIDUAL_MLP_FAMILIES) not at all: nothing reads it, and backward computes each
  tile again anyway (so a tiled MLP costs no more than an untiled one);
- backward: each tile is computed again with gradients and backpropagated at once; the input's
  gradient is written tile by tile, the parameters' gradients are summed over the tiles and
  handed to autograd once (so the engine's gradient hooks see one contribution per backward,
  whatever the number of tiles).
Only the MLP's input is kept for backward; at most one tile's intermediates exist at a time.

Exactness: every output row is computed as without tiles; the parameters' gradients are the
same sums in another order (the tiles'), so they agree with the untiled ones to rounding
(tests/test_tiled_mlp.py, fp32: within 1e-6 of their norm). An MLP with an active dropout is not tiled (its
noise would be drawn per tile).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..plan import perfmodel
from ..plan.perfmodel import RESIDUAL_MLP_FAMILIES, TILED_FAMILIES, mlp_tile_tokens

# The tile's bytes (perfmodel.MLP_TILE_BYTES) and the families (TILED_FAMILIES) are the
# planner's: one place for the figures both use. A sequence of one tile runs untiled.


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], spec: tuple, x: torch.Tensor,  # type: ignore[override]
                *params: torch.Tensor) -> torch.Tensor:
        tiles, ctx.context, values = spec
        ctx.run, ctx.tiles, ctx.params = run, tiles, params  # (the parameters themselves: leaves)
        ctx.save_for_backward(x)
        if not values:  # (the block's recompute, whose output nothing reads: only its graph)
            return torch.zeros_like(x)
        with torch.no_grad():
            return _forward(run, tiles, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        gx = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        for a, b in ctx.tiles:
            with torch.enable_grad(), ctx.context():  # what the tile saves is the engine's to keep
                xt = x[:, a:b].detach().requires_grad_(want_x)
                yt = ctx.run(xt)
            got = torch.autograd.grad(yt, ([xt] if want_x else []) + wanted, grad[:, a:b], allow_unused=True)
            if want_x:
                gx[:, a:b] = got[0]
                got = got[1:]
            for k, g in enumerate(got):  # (summed in fp32: one rounding to a bf16 weight's dtype, at the end)
                if g is not None:
                    sums[k] = g.float() if sums[k] is None else sums[k].add_(g)
            del xt, yt, got
        it = iter(sums)
        grads = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        grads = [g if g is None or p is None else g.to(p.dtype) for g, p in zip(grads, ctx.params)]
        return (None, None, gx, *grads)


def _forward(run: Callable[[torch.Tensor], torch.Tensor], tiles: list, x: torch.Tensor) -> torch.Tensor:
    out = None
    for a, b in tiles:
        y = run(x[:, a:b])
        if out is None:
            out = y.new_empty((y.shape[0], x.shape[1], *y.shape[2:]))
        out[:, a:b] = y
    assert out is not None
    return out


def _active_dropout(drops: list[torch.nn.Module]) -> bool:
    return any([m.p > 0 and m.training for m in drops])


def tiled(forward: Callable[..., torch.Tensor], mlp: torch.nn.Module, *, width: int,
          tile_bytes: "int | None" = None, context: Callable[[], Any] = contextlib.nullcontext,
          enabled: Callable[[], bool] = lambda: True, values: bool = True) -> Callable[..., torch.Tensor]:
    """`forward` of `mlp` (token-wise, [batch, tokens, hidden] -> the same) run in sequence
    tiles when the sequence is longer than one tile (`width`: the MLP's intermediate size;
    `tile_bytes`: None, perfmodel.MLP_TILE_BYTES as it is at the call). `context()`: what a tile's computation
    in backward runs under (the engine's saved-tensor hooks: a weight it saves is a chunk's,
    which may leave the device before the tile's backward reads it). `enabled()`: whether to
    tile now (the engine's: where the blocks are its units of residency, whose chunks stay on
    the device through all the tiles; with the modules as units each tile would fetch them).
    `values` False: a forward with gradients returns zeros of the output's shape, not the
    output: right only where nothing reads it but the residual add of a block whose recompute
    (the engine's checkpointed blocks: their first forward runs without gradients) is run for
    its graph alone, so backward's tiles are the MLP's only recomputation (tiled_mlps says
    where)."""
    # its dropouts, found again when its children change (walking modules() at every forward
    # costs Python calls per module); the tile's tokens per (itemsize, rows, tile bytes)
    found: list = [None, []]
    sizes: dict[tuple[int, int, int], int] = {}

    def wrapper(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or x.dim() != 3 or not enabled():
            return forward(x, *args, **kwargs)
        children = tuple(mlp._modules.values())  # (inline: this runs for every MLP forward)
        if children != found[0]:
            found[0], found[1] = children, [m for m in mlp.modules() if isinstance(m, torch.nn.Dropout)]
        if found[1] and _active_dropout(found[1]):
            return forward(x, *args, **kwargs)
        key = (x.element_size(), x.shape[0], perfmodel.MLP_TILE_BYTES if tile_bytes is None else tile_bytes)
        size = sizes.get(key)
        if size is None:
            size = sizes[key] = mlp_tile_tokens(width, key[0], key[1], key[2])
        if x.shape[1] <= size:
            return forward(x)
        tiles = _tiles(x.shape[1], size)
        if not torch.is_grad_enabled():
            return _forward(forward, tiles, x)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _TiledMLP.apply(forward, (tiles, context, values), x, *params)

    return wrapper


def tiled_mlps(blocks: list[torch.nn.Module], model_type: "str | None") -> list[tuple[torch.nn.Module, int, bool]]:
    """(mlp, its intermediate size, whether the block reads more of its output than the residual
    add: `tiled`'s `values`) of each block whose MLP runs in tiles: a family in TILED_FAMILIES,
    the block's `mlp` child with a gate/up/down projection (refused otherwise: left untiled)."""
    if model_type not in TILED_FAMILIES:
        return []
    out = []
    for b in blocks:
        mlp = getattr(b, "mlp", None)
        up = getattr(mlp, "up_proj", None)
        width = getattr(getattr(up, "base_layer", up), "out_features", None)
        if mlp is not None and width and hasattr(mlp, "down_proj"):
            out.append((mlp, int(width), model_type not in RESIDUAL_MLP_FAMILIES))
    return out
