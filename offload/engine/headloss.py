"""A causal LM's loss without its full logits: the head and the cross-entropy in token tiles.

A Hugging Face causal LM computes `lm_head(hidden)` for every token at once, casts the logits
to fp32 and takes the cross-entropy: tokens x vocab x (4 + 4 + e) bytes held at the end of
forward (16.8 GB of fp32 logits alone at 32K tokens and Llama-3's 128,256 words). Here the
model runs as it is with its head's forward swapped for `HeadLoss`, which takes the head's
input and walks the target tokens in tiles of at most perfmodel.HEAD_TILE_BYTES of fp32 logits (256 MiB: 523 tokens of 128,256 words): each tile's
logits, loss and gradients (of the head's input, weight and bias) are made and dropped in
forward, the same way a fused linear + cross-entropy kernel does. Backward then only scales
the saved gradients by the incoming one. What stays saved: the input's gradient (tokens x
hidden, e bytes) and, when the head trains, its weight's (vocab x hidden, e bytes).

Tokens whose label is -100 (prompts, padding, each row's last position) are skipped; their
gradients are zero, as plain PyTorch's are. The loss is the token mean over the batch, or the
sum over `num_items_in_batch` when the batch gives it (transformers' ForCausalLMLoss).

A batch whose logits fit one tile runs the model's own forward and loss (so a small step is
plain PyTorch's, bit for bit). The tiled path is exact to rounding: the sums run in another
order (tests hold it to plain PyTorch in fp32 at 1e-5).

Only families whose forward is known to end in `lm_head` + ForCausalLMLoss take it
(FAMILIES), with their transforms of the logits (gemma2's final soft-capping, cohere's
logit_scale, granite's logits_scaling); anything else runs the model's own loss.

Inside `collecting()`, each loss also counts what TRL's SFTTrainer logs of the target tokens
(`TokenStats`: the entropy of the next-token distribution, whether the label is its first
argmax), from the same tiles, as device tensors: nothing is read back during the step.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from ..plan import perfmodel
from ..plan.perfmodel import loss_tail, loss_workspace, own_loss

log = logging.getLogger(__name__)

IGNORE = -100
SLICES = 8  # a tile's temporaries are made in this many pieces (the entropy, the head's bf16 gradient)

FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                      "gemma2", "gemma3_text", "gemma3", "phi3", "gpt2", "gpt_neox", "opt", "falcon", "granite", "cohere",
                      "olmo", "olmo2", "smollm3", "starcoder2", "stablelm"})
"""transformers model types whose CausalLM forward is `lm_head(hidden)` [+ transform] + ForCausalLMLoss."""


class Transform:
    """A family's elementwise transform of the head's output before the loss, and its derivative."""

    def __init__(self, name: str, apply: Callable[[torch.Tensor], torch.Tensor],
                 backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        # backward(raw, g): the gradient of raw from out's (g, which it may overwrite), in autograd's order
        self.name, self.apply, self.backward = name, apply, backward


def transform_of(config: Any) -> Transform | None | str:
    """The family's transform of the head's output (None: none), or a string saying why this
    model cannot take the tiled loss."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one whose head and loss are known"
    if getattr(config, "output_router_logits", False):
        return "the router's auxiliary loss is added to the model's own loss"
    if getattr(config, "loss_type", None) not in (None, "ForCausalLM"):
        return f"loss_type {config.loss_type!r}"
    cap = getattr(config, "final_logit_softcapping", None)
    if kind in ("gemma2", "gemma3_text") and cap is not None:
        def capped_grad(raw: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            # autograd's order ((g * cap) * (1 - t*t) / cap), in place: one temporary, not five
            t = raw.div(cap).tanh_().square_().neg_().add_(1)
            return g.mul_(cap).mul_(t).div_(cap)

        return Transform("soft-capping", lambda z: torch.tanh(z / cap) * cap, capped_grad)
    if kind == "cohere":
        scale = config.logit_scale
        return Transform("logit_scale", lambda z: z * scale, lambda raw, g: g.mul_(scale))
    if kind == "granite":
        div = config.logits_scaling
        return Transform("logits_scaling", lambda z: z / div, lambda raw, g: g.div_(div))
    return None


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target: the label after it (the last position's IGNORE), as
    transformers' ForCausalLMLoss shifts them; shaped like `labels` (B, S)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers causal LM inside `model` (itself, or a PEFT wrapper's base), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_output_embeddings") or not hasattr(base, "config"):
        return None
    return base


def tiled_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor | None:
    """`model(**batch).loss` computed with the head in tiles (see the module docstring), or None
    when this batch or model does not take it (the caller runs the model's own loss)."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        return None
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if lm is not None else None
    if not isinstance(head, torch.nn.Linear):
        return None
    if own_loss(labels.numel(), head.out_features, h=head.in_features, e=head.weight.element_size(),
                head_grad=head.weight.requires_grad and torch.is_grad_enabled()):
        return None  # one tile: the model's own loss is as small, and plain PyTorch's bit for bit
    transform = transform_of(lm.config)
    if isinstance(transform, str):
        _note_once(lm, transform)
        return None
    shift = batch.get("shift_labels")  # (given already shifted, as transformers' loss takes them)
    shifted = (shift if isinstance(shift, torch.Tensor) else next_tokens(labels)).reshape(-1)
    keep = None
    host = _host.of(labels) if labels.device.type != "cpu" and not isinstance(shift, torch.Tensor) else None
    if host is not None:  # the targets kept, found on the host: no wait for the device to count them
        keep = next_tokens(host).reshape(-1).ne(IGNORE).nonzero().squeeze(1)
        keep = keep.pin_memory().to(labels.device, non_blocking=True) if labels.is_cuda else keep.to(labels.device)
    items = batch.get("num_items_in_batch")
    rest = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    box: list[torch.Tensor] = []
    stats = collected()
    with _head_forward(head, lambda hidden: _run(head, hidden, shifted, items, transform, box, keep, stats)):
        model(**rest)
    return box[0]


def workspace(model: torch.nn.Module, batch: Any, grads: bool) -> tuple[int, int, int]:
    """The transient bytes of the engine's default loss on `batch`, tiled or the model's own as
    `tiled_loss` decides: during forward (perfmodel.loss_workspace), from forward's end to the
    gradient of the head's output (the same: the model's own loss makes them in backward; the
    tiled loss's are gone), then through the head's backward (perfmodel.loss_tail). Zeros for
    what is not a causal LM's loss."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    lm = causal_lm(model)
    head = lm.get_output_embeddings() if lm is not None else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or not isinstance(head, torch.nn.Linear):
        return 0, 0, 0
    t, vocab, h, e = labels.numel(), head.out_features, head.in_features, head.weight.element_size()
    transform = transform_of(lm.config)
    trains = grads and head.weight.requires_grad
    own = own_loss(t, vocab, isinstance(transform, str), h=h, e=e, head_grad=trains)
    during = loss_workspace(t=t, vocab=vocab, h=h, e=e, grads=grads, head_grad=trains,
                            transform=isinstance(transform, Transform), stats=collected() is not None, own=own)
    tail = loss_tail(t=t, vocab=vocab, h=h, e=e, head_grad=trains, own=own) if grads else 0
    return during, during if own else tail, tail


class _HostLabels:
    """The last batch's labels as the host had them, keyed by their device copy (the engine's
    to_device, offload.engine.batches): the tokens the loss keeps are found from them."""

    def __init__(self) -> None:
        self.ref: Any = None
        self.host: torch.Tensor | None = None

    def known(self, host: torch.Tensor, device: torch.Tensor) -> None:
        if host.dim() == 2:
            self.ref, self.host = weakref.ref(device), host

    def of(self, labels: torch.Tensor) -> torch.Tensor | None:
        return self.host if self.ref is not None and self.ref() is labels else None


_host = _HostLabels()
known_labels = _host.known


def _run(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, items: Any,
         transform: Transform | None, box: list[torch.Tensor], keep: torch.Tensor | None = None,
         stats: "TokenStats | None" = None) -> torch.Tensor:
    """The swapped head's forward: keeps the loss in `box`, returns empty logits for the model's
    own code to pass on (nothing of them is used)."""
    if hidden.shape[:-1].numel() != targets.numel():
        raise ValueError(f"the head saw {hidden.shape[:-1].numel()} positions for {targets.numel()} labels")
    # (inside the Function grad mode is off: whether gradients are wanted is decided here)
    box.append(HeadLoss.apply(hidden, head.weight, head.bias, targets, items, transform, torch.is_grad_enabled(),
                              keep, stats))
    return hidden.new_zeros(*hidden.shape[:-1], 0)


@contextlib.contextmanager
def _head_forward(head: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """`head`'s forward is `forward` inside (its module hooks still run around it)."""
    had = "forward" in head.__dict__
    saved = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if had:
            head.forward = saved
        else:
            del head.forward


_noted: set[int] = set()


def _note_once(model: torch.nn.Module, why: str) -> None:
    if id(model) not in _noted:
        _noted.add(id(model))
        log.info("the loss holds every token's logits (the tiled head loss does not apply: %s)", why)


def _exp_shifted_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z (rows, vocab) becomes exp(z - its row max), in place (no tile-sized temporary, as
    logsumexp makes one); returns the row maxima and the rows' sums, (rows, 1) each."""
    top = z.amax(1, keepdim=True)
    z.sub_(top).exp_()
    return top, z.sum(1, keepdim=True)


def _tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, rows: torch.Tensor,
          transform: Transform | None, scale: Any, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
          grad_b: torch.Tensor | None, stats: "TokenStats | None") -> torch.Tensor:
    """One tile's summed loss; its gradients added into grad_h/w/b (those not None). A function
    so that the tile's tensors are freed when it returns, before the next tile's are made; the
    softmax is made in the fp32 logits' own storage (perfmodel.loss_workspace counts what is left)."""
    raw = F.linear(x, weight, bias)
    dtype = raw.dtype
    zf = (transform.apply(raw) if transform is not None else raw).float()
    if transform is None:  # (raw is only the transform's derivative's input)
        del raw
    picked = zf.gather(1, y.unsqueeze(1)).squeeze(1)
    if stats is not None:
        stats.add_top1(zf, y)
    top, sums = _exp_shifted_(zf)
    g = zf  # (one name left for the tile: to(dtype) below frees its fp32 storage)
    del zf
    loss = (top.squeeze(1) + sums.log().squeeze(1) - picked).sum()
    want = grad_h is not None or grad_w is not None or grad_b is not None
    if not want and stats is None:
        return loss
    g.div_(sums)  # the softmax; d loss / d z = (softmax - onehot) * scale
    if stats is not None:
        stats.add_entropy(g)
    if not want:
        return loss
    g.scatter_add_(1, y.unsqueeze(1), g.new_full((y.numel(), 1), -1.0))
    g.mul_(scale)
    g = g.to(dtype)  # (the fp32 tile is freed here when computing in bf16/fp16)
    if transform is not None:
        g = transform.backward(raw, g)
        del raw
    if grad_h is not None:
        grad_h.index_copy_(0, rows, g @ weight)
    if grad_w is not None:  # (in fp32 summed in place; a bf16 product summed in fp32, by slices of
        if grad_w.dtype == g.dtype:  # the vocabulary: the product and its fp32 copy are an eighth)
            grad_w.addmm_(g.t(), x)
        else:
            part = -(-grad_w.shape[0] // SLICES)
            for v in range(0, grad_w.shape[0], part):
                grad_w[v:v + part] += g[:, v:v + part].t() @ x
    if grad_b is not None:
        grad_b += g.sum(0, dtype=torch.float32)
    return loss


class HeadLoss(torch.autograd.Function):
    """loss = CE(transform(hidden @ W^T + b).float(), targets) over the tokens whose target is
    not IGNORE, in tiles; the gradients are made in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, items: Any, transform: Any, grads: bool = True,
                keep: torch.Tensor | None = None, stats: "TokenStats | None" = None) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        if keep is None:  # (`keep`: the positions whose target is not IGNORE, found on the host)
            keep = (targets != IGNORE).nonzero().squeeze(1)
        if stats is not None:
            stats.tokens += keep.numel()
        count = keep.numel() if items is None else items
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        want_b = grads and bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(h) if want_h else None
        acc = torch.float32 if weight.dtype != torch.float32 else weight.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        if isinstance(count, torch.Tensor):  # (a device count is not read back: 0 gives inf, a nan loss)
            scale: Any = 1.0 / count.to(torch.float32)
        else:
            scale = 1.0 / float(count) if count > 0 else math.nan
        step = max(1, perfmodel.HEAD_TILE_BYTES // (4 * weight.shape[0]))
        for start in range(0, keep.numel(), step):
            rows = keep[start:start + step]
            total += _tile(h.index_select(0, rows), weight, bias, targets.index_select(0, rows), rows, transform,
                           scale, grad_h, grad_w, grad_b, stats)
        ctx.save_for_backward(grad_h.reshape(hidden.shape) if want_h else None,
                              grad_w.to(weight.dtype) if want_w else None,
                              grad_b.to(bias.dtype) if want_b else None)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad, None if grad_w is None else grad_w * grad,
                None if grad_b is None else grad_b * grad, None, None, None, None, None, None)


class TokenStats:
    """Sums over one loss's target tokens, on the device: `entropy` (nats), `top1` (the label
    is the first argmax of the logits, as TRL's is_top1), `tokens` (how many; a host int), and
    the model's `aux_loss` (a MoE router's) where its own loss ran. TRL's SFTTrainer logs
    entropy / tokens and top1 / tokens."""

    def __init__(self) -> None:
        self.entropy: Any = 0.0
        self.top1: Any = 0
        self.tokens: Any = 0
        self.aux_loss: torch.Tensor | None = None
        self.counted = True  # False: a loss whose logits could not be lined up with the labels

    def add_top1(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.top1 = self.top1 + logits.argmax(1).eq(labels).sum()

    def add_entropy(self, probs: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """The entropy of each row of `probs` (of the rows `mask` keeps), summed; in slices of rows:
        entr's temporary is an eighth of the tile."""
        step = max(1, -(-probs.shape[0] // SLICES))
        for r in range(0, probs.shape[0], step):  # (entr's slice is freed before the next is made)
            part = (torch.special.entr(probs[r:r + step]).sum(dtype=torch.float32) if mask is None
                    else torch.special.entr(probs[r:r + step]).sum(1).mul_(mask[r:r + step]).sum())
            self.entropy = self.entropy + part

    @torch.no_grad()
    def add_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """From a model's own (batch, seq, vocab) logits and its labels shifted to line up with
        them, in tiles; masked rather than selected (selecting reads a count back from the device)."""
        z = logits.reshape(-1, logits.shape[-1])
        y = labels.reshape(-1)
        mask = y != IGNORE
        self.tokens = self.tokens + mask.sum()
        step = max(1, perfmodel.HEAD_TILE_BYTES // (4 * z.shape[-1]))
        for start in range(0, y.numel(), step):
            zf = z[start:start + step].to(torch.float32, copy=True)
            m = mask[start:start + step]
            self.top1 = self.top1 + zf.argmax(1).eq(y[start:start + step]).logical_and_(m).sum()
            p = zf.div_(_exp_shifted_(zf)[1])  # (in place, as the tiled loss's softmax)
            self.add_entropy(p, m)


_stats: contextvars.ContextVar[TokenStats | None] = contextvars.ContextVar("tierwise_token_stats", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[TokenStats]:
    """Each loss computed inside (the tiled one or the model's own, offload.engine.batches)
    adds its target tokens' statistics to the TokenStats yielded."""
    stats = TokenStats()
    token = _stats.set(stats)
    try:
        yield stats
    finally:
        _stats.reset(token)


collected = _stats.get
"""The TokenStats a `collecting()` around the caller gathers into, or None (a C call: no
Python frame a step)."""
