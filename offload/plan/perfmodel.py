"""Performance model (pure): bytes and seconds of one training step, phase by phase.

No torch, no allocation: arithmetic on a model profile, a hardware profile and the byte counts
the planner places on each tier. A phase lasts as long as its busiest resource (GPU compute,
PCIe each way, NVMe, CXL, host DRAM bandwidth, CPU update) since transfers on independent
links overlap compute, plus a non-overlappable startup of one chunk. CPU cores that run the
optimizer also drive NVMe I/O; host DRAM bandwidth is shared by the CPU update and all DMA.
On a GPU the host thread that launches the kernels is a resource too ("host launch"): every op
and module hook costs it `host.op_overhead_us` (measured through the engine by `finetune
profile`), and in backward it shares the cores with the CPU update, so a small step is bound by
Python, dispatch and the update, not by the device.

Per-optimizer numbers (CPU rate, forwards, whether there is a backward, the rank) come from
the optimizer table, `offload.update.table`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

from ..core.chunks import ParamSpec
from ..core.errors import TierwiseError
from ..core.options import recomputed_blocks
from ..core.vocab import COMPUTE_BYTES
from ..update.table import OptimizerSpec
from ...profiles.hardware import HardwareProfile
from ...profiles.model import ModelProfile

if TYPE_CHECKING:
    from .ranks import Collectives

GB = 1e9
KINDS = ("compute", "grad", "master", "state")


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute copy."""
    try:
        return COMPUTE_BYTES[precision]
    except KeyError:
        raise TierwiseError(f"unknown precision '{precision}' (use fp32 or bf16)") from None


def param_update_flops(spec: ParamSpec, *, cost: OptimizerSpec, rank: int | None = None,
                       projected: bool) -> float:
    """Matmul flops of the update beyond elementwise work: project the gradient down and the
    update back up, 2 * 2*m*n*r (GaLore's periodic SVD is amortised away). `projected`: the
    table's projection rule (`table.projected_params`) holds for this parameter."""
    if not (cost.low_rank and projected):
        return 0.0
    m, n = spec.shape[0], spec.numel // spec.shape[0]
    return 4.0 * m * n * min(cost.default_rank if rank is None else rank, m, n)


def ops_per_forward(model: ModelProfile, *, adapters: int = 0, decoded: int = 0) -> int:
    """Ops one forward dispatches, counting a module hook as an op: per decoder layer ~48 (2
    RMSNorms of 8, 7 linears, rotary, SDPA, reshapes, residuals, SwiGLU, 9 hooked modules), plus
    the embedding, the final norm, lm_head and the loss; per LoRA adapter 4 (its two linears,
    the scaling, the add) and per encoded base weight 2 (its decode and the cast). A MoE layer
    dispatches about 27% more than a dense one (its router, top-k, sort, offsets and two grouped
    matmuls: 98 aten ops against 77, transformers 5's grouped_mm experts), 41% more with
    Qwen2-MoE's shared expert and its gate (109); Qwen3's q/k norms 2 RMSNorms more, Gemma-3's
    four norms 2 more again; a Gemma RMSNorm 10 ops (its fp32 weight plus one)."""
    norms = 2 + (2 if model.qk_norm else 0) + (2 if model.post_norms else 0)
    layer = 32 + norms * (10 if model.gemma else 8) \
        + (0 if not model.moe else 19 if model.shared_expert_intermediate_size else 13)
    return layer * model.num_hidden_layers + 24 + 4 * adapters + 2 * decoded


def model_flops(*, model: ModelProfile, batch_size: int, seq_len: int, windows: bool = False) -> float:
    """Forward flops of one step: 2 per matmul parameter per token, plus attention scores (every
    query-key pair SDPA computes; with `windows`, activation_parts', a window shorter than a
    long row: its blocks' pairs)."""
    tokens, window = batch_size * seq_len, model.sliding_window or seq_len
    pairs = [window_blocks(seq_len, window)[1] if windows and model.slides(n) and SEGMENTS_FROM <= seq_len > window
             else seq_len**2 for n in range(model.num_hidden_layers)]
    return 2.0 * model.matmul_params * tokens + 4.0 * batch_size * model.q_dim * sum(pairs)


HEAD_TILE_BYTES = 256 << 20
"""fp32 logits of one tile of the engine's head loss (offload.engine.headloss)."""


def loss_bytes(*, t: int, batch_size: int, vocab: int, h: int, e: int, head_grad: bool, own: bool = False) -> int:
    """What a causal LM's loss saves for backward over `t` tokens (offload.engine.headloss).
    Logits that fit one tile: the model's own loss, log_softmax's fp32 output (4*T*V) + int64
    targets + a scalar. Beyond: the head in tiles saves the gradient of its input (e*T*h) and,
    when the head trains (`head_grad`), of its weight (e*V*h); nothing of the logits. `own`: the
    model's own loss at any length (a model the tiled loss does not take: its router's loss)."""
    if own_loss(t, vocab, own, h=h, e=e, head_grad=head_grad):
        # targets: the labels shifted in a padded S+1 copy; with one sequence a view of all of it
        return 4 * t * vocab + 8 * (t + (batch_size == 1)) + 4
    return _tiled_grads(t=t, vocab=vocab, h=h, e=e, head_grad=head_grad)


def _tiled_grads(*, t: int, vocab: int, h: int, e: int, head_grad: bool) -> int:
    """The gradients the tiled loss returns and saves: of the head's input (e*T*h) and, when the
    head trains, of its weight (e*V*h)."""
    return e * t * h + (e * vocab * h if head_grad else 0)


def own_loss(t: int, vocab: int, own: bool = False, *, h: int = 0, e: int = 4, head_grad: bool = False) -> bool:
    """Whether the model's own loss runs (`own`: always), not the tiled one, for `t` tokens over
    `vocab` words: where all it holds (its saved fp32 log-softmax and backward's two fp32
    gradients of the logits: 12 bytes a token a word) fits one tile, or is no more than the
    tiled loss would hold (`head_grad`, a head trained in e < 4 bytes: its gradient and their
    fp32 sum, 4 + e bytes a word a hidden unit). There it is plain PyTorch's bit for bit;
    beyond, the tiled loss holds less (a third or less of it with a frozen head)."""
    whole = 12 * t * vocab
    return own or whole <= HEAD_TILE_BYTES or whole <= _tiled_grads(t=t, vocab=vocab, h=h, e=e, head_grad=head_grad) \
        + _tiled_workspace(t=t, vocab=vocab, h=h, e=e, grads=True, head_grad=head_grad)


def loss_workspace(*, t: int, vocab: int, h: int, e: int, grads: bool = True, head_grad: bool = False,
                   transform: bool = False, stats: bool = False, own: bool = False) -> int:
    """What a causal LM's loss holds beside what it saves (`loss_bytes`), at its worst moment:
    the transient tensors of the logits (offload.engine.headloss). The engine books it on the
    simulated device while a default loss runs; CUDA's allocator measures it (offload.engine.
    workspace). Measured against RSS on CPU (tests/test_headloss.py).
    Logits that fit one tile (the model's own loss): `grads`, backward's two fp32 gradients of
    the logits, 8*T*V (forward's logits and their fp32 copy are fewer); without, forward's
    logits, their fp32 copy (when e < 4) and log_softmax's output. Beyond, the tiled loss: one
    tile's logits in fp32 (e < 4: with their e copy and its gradient, 1.5 tiles; a family's
    transform of them, 3 and 2 tiles), a tile of e inputs and of their gradient; when the head
    trains in e < 4, its fp32 gradient sum (4*V*h) and an eighth of a tile's product in e and in
    fp32 (headloss.SLICES); in backward, the scaled gradients returned (e*T*h, and e*V*h when
    the head trains). `stats`: SFTTrainer's token statistics are counted too (headloss.
    TokenStats): a tile's fp32 copy of the model's own logits, and an eighth of a tile for the
    entropy. `own`: the model's own loss at any length
    (a model the tiled loss does not take)."""
    if own_loss(t, vocab, own, h=h, e=e, head_grad=head_grad and grads):
        whole = 8 * t * vocab if grads else (e + 4 + (4 if e < 4 else 0)) * t * vocab
        return max(whole, (e + 4) * t * vocab + t * vocab // 2) if stats else whole
    return _tiled_workspace(t=t, vocab=vocab, h=h, e=e, grads=grads, head_grad=head_grad, transform=transform,
                            stats=stats)


def _tiled_workspace(*, t: int, vocab: int, h: int, e: int, grads: bool, head_grad: bool,
                     transform: bool = False, stats: bool = False) -> int:
    """The tiled loss's part of loss_workspace."""
    n = min(t, max(1, HEAD_TILE_BYTES // (4 * vocab)))
    tile = 4 * n * vocab
    if not grads:  # (no fp32 copy of the gradient: the transform's temporaries count)
        logits = tile * (3 if transform else 1) if e == 4 else tile * (5 if transform else 3) // 2
        return (max(logits, tile + tile // 8) if stats else logits) + e * n * h
    logits = tile * (3 if transform else 1) if e == 4 else tile * (4 if transform else 3) // 2
    if stats:
        logits = max(logits, tile + tile // 8)
    narrow = head_grad and e < 4
    forward = (max(logits, e * n * vocab + (e + 4) * vocab * h * narrow // 8) + 4 * vocab * h * narrow
               + 2 * e * n * h)
    return max(forward, _tiled_grads(t=t, vocab=vocab, h=h, e=e, head_grad=head_grad))


def zo_loss_workspace(*, t: int, vocab: int, e: int) -> int:
    """MeZO's loss (offload.update.zeroth.hf_split_losses: one forward over the batch doubled,
    then transformers' loss on each half, `t` tokens): both halves' logits, and the second
    half's fp32 copy (when e < 4) and log_softmax output. Measured against RSS on CPU
    (bench/loss_workspace.py)."""
    return loss_workspace(t=t, vocab=vocab, h=0, e=e, grads=False, own=True) + e * t * vocab


def loss_tail(*, t: int, vocab: int, h: int, e: int, head_grad: bool = False, own: bool = False) -> int:
    """What the loss's transients leave while the head's own backward runs (after the gradient of
    its output is made): the model's own loss, that gradient (e*T*V); the tiled loss, the scaled
    gradients it returns (e*T*h, and e*V*h when the head trains)."""
    if own_loss(t, vocab, own, h=h, e=e, head_grad=head_grad):
        return e * t * vocab
    return _tiled_grads(t=t, vocab=vocab, h=h, e=e, head_grad=head_grad)


#: Packed rows of at least this many tokens are attended one segment at a time (no S x S mask:
#: offload.engine.segments); shorter ones take transformers' mask (at most 48 MiB a row with its
#: additive copy), one SDPA call a layer instead of one per segment.
SEGMENTS_FROM = 4096

#: A recomputed block's MLP runs in sequence tiles of this many bytes of intermediates
#: (offload.engine.tiled), in these families (a token-wise `mlp` of gate, up and down).
MLP_TILE_BYTES = 256 << 20
TILED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3", "granite",
                            "cohere", "olmo", "olmo2", "smollm3"})  # (not phi3: one fused gate_up_proj)
#: Of those, the families whose block only adds its MLP's output to the residual (no norm after
#: it saves it): their recompute need not compute that output (offload.engine.tiled).
RESIDUAL_MLP_FAMILIES = TILED_FAMILIES - {"gemma2", "gemma3_text", "gemma3", "olmo2"}


def mlp_tile_tokens(width: int, itemsize: int, rows: int, tile_bytes: "int | None" = None) -> int:
    """Tokens of an MLP tile: its 3 x rows x tokens x width intermediates within `tile_bytes`
    (None: MLP_TILE_BYTES as it is at the call)."""
    return max(1, (tile_bytes or MLP_TILE_BYTES) // (3 * width * itemsize * max(1, rows)))


def activation_parts(*, model: ModelProfile, batch_size: int, seq_len: int, precision: str,
                     checkpointing: bool | int | None = None, padded: bool = False,
                     lora: "tuple[frozenset[str], int] | tuple[frozenset[str], int, int] | None" = None,
                     row_positions: bool = False, offload: bool = False, tiles: bool = True,
                     windows: bool = False) -> dict[str, int]:
    """Bytes autograd saves for backward, by part, as the engine counts them (per saved tensor
    storage, deduplicated) for a Hugging Face Llama-family model with SDPA attention and every
    decoder layer checkpointed. e = compute bytes, T = batch * seq tokens:

    fixed   token ids (int64, the embedding) + rotary cos/sin (S x head_dim, e each, shared by
            all layers) + position ids (int64, S); with padding, the bool attention mask
            (B x S x S, a checkpointed block input shared by all layers)
    inputs  one saved block input per recomputed layer, e*T*h (the last block's output is the
            final norm's)
    norm    an RMSNorm: its fp32 input (a new fp32 copy in bf16 runs; in fp32 the input itself,
            which for a block's first norm is the already-counted block input), rsqrt (fp32, T),
            the normalised and the weighted output (e*T*h each)
    block   one layer's internals while it is recomputed: 2 norms, q/k/v after rotary and the
            attention output (e*T*(2 q_dim + 2 kv_dim)), the logsumexp (fp32, B*heads*S), the
            MLP's gate, up, silu and product (4 e*T*i; of one tile, B x mlp_tile_tokens, where
            the MLP runs in tiles: a TILED_FAMILIES model longer than a tile; its input is the
            norm's output, already counted); with padding also SDPA's additive mask
            (e*B*S*S) and k/v repeated to every query head (2 e*T*(q_dim - kv_dim) more: SDPA
            takes grouped heads only without a mask); Qwen3's q/k norms (qk_norm_bytes); Phi-3's
            o_proj input, a copy (e*T*q_dim), and its v, a view of the fused qkv output that SDPA
            keeps whole (e*T*(q_dim + kv_dim) more, unless a mask repeats grouped heads); 0
            without checkpointing
    layers  the layers kept (not recomputed): each one's internals (untiled) and, in fp32 runs,
            its first norm's fp32 input (the block input itself; in bf16 it is not saved),
            held from forward to their backward; 0 when every layer is recomputed
    head    the final norm + what the loss saves (loss_bytes) + its transients (loss_workspace:
            the engine books them with the activations, till the head's input has its gradient)
    final_norm  the part of head still saved once log_softmax's backward has run
    loss_tail   what the loss's transients leave while the head's backward runs (loss_tail)
    The peak is fixed + the larger of inputs_end + layers + head (end of forward) and inputs +
    block (a recompute in backward: the recomputed layers are the first ones, reached after the
    kept layers' activations and the head's are freed).

    `checkpointing`: the layers recomputed (core.options.recomputed_blocks: True all, False
    none, an int n the first n, None all when there are several). Without any (`False`, or None
    with a single decoder layer) no position ids are saved (only the checkpoint keeps them).

    `offload`: checkpointed blocks' inputs that need a gradient live in host memory between
    forward and backward (offload.engine.actoffload): on the device at most one at the end of
    forward (`inputs_end`: the last one's copy out may still be under way) and two in backward
    (`inputs`: the block's own and the one fetched ahead), the rest in `host_inputs` (a LoRA
    run's first block input, the frozen embedding's output, stays). Written to NVMe instead, they
    pass through at most two host buffers at once: `host_staging`. Without offload `inputs_end`
    is `inputs`.

    `tiles`: the MLP runs in tiles where it can (the engine tiles it where the blocks are its
    units of residency: offload.plan.needs.units_are_blocks); False: never.

    `windows`: the attention is offload.engine.segments' (finetune's, for the families whose
    packed rows it keeps apart): without `padded` at SEGMENTS_FROM tokens or more a layer whose
    sliding window is shorter than the row attends it in blocks (window_blocks), with no dense
    mask; a window as long as the row takes none.

    `row_positions`: the batch carries position_ids per row (packed rows kept apart,
    cli.data): the rotary cos/sin and the position ids are then per row (B x S), not shared,
    and without `padded` at SEGMENTS_FROM tokens or more the attention runs per segment
    (offload.engine.segments), whose joined output is one more e*T*q_dim in a block's internals.

    `padded`: the batch's attention takes a dense B x 1 x S x S mask (transformers builds one
    for an attention_mask with zeros, for packed rows its SDPA path keeps apart, for a sliding
    window shorter than S, for eager attention); a batch without one uses is_causal. So such a
    batch of the same shape saves more: the run's worst step whenever some batch has one.

    `lora`: (targeted linears, rank) of a LoRA run over a frozen base (plan.lora). Autograd
    then saves only what some gradient needs: no token ids (frozen embedding), no norm's
    normalised output (frozen weights), a norm's weighted output only when a linear it feeds
    is targeted (the adapter's lora_A saves it), the MLP product only when down_proj is,
    nothing of the final norm but its input and rsqrt (frozen lm_head), and per targeted
    linear the adapter's rank-r intermediate (e*T*r). Without recompute, layer 0's first
    norm saves nothing of its own (its input needs no gradient).
    `lora` = (targets, rank, mask) with LoRA dropout (PEFT's lora.Linear computes
    lora_B(lora_A(dropout(x)))): each targeted linear's lora_A then saves its own dropped copy of
    its input instead of the input shared by its group (q/k/v, gate/up; o_proj's input, the
    attention output, is saved by SDPA anyway: one more copy), and, where its input needs a
    gradient, dropout saves what its backward multiplies by: `mask` bytes per input element (the
    scaled noise in the compute dtype on the CPU, `mask` = e; CUDA's fused kernel keeps a bool
    mask, `mask` = 1).
    """
    e = compute_bytes(precision)
    t, s, h, i = batch_size * seq_len, seq_len, model.hidden_size, model.intermediate_size
    own = model.router_loss  # (a router's loss joins the model's own: the tiled loss does not take it)
    fp32_copy = 4 * t * h
    # a Gemma norm computes in fp32: its normalised input is fp32, and it saves its 1 + weight
    gemma_w = gemma_weight_bytes(model)
    norm = 4 * t + e * t * h + (4 if model.gemma else e) * t * h + fp32_copy + gemma_w
    first_norm = norm - (fp32_copy if e == 4 else 0)
    # Gemma-3's norms of the attention's and the MLP's outputs: each one's fp32 input (the
    # linear's output itself in fp32), rsqrt, normalised input (a trained weight) and 1 + weight
    post_norm = 4 * t * h + 4 * t + (4 * t * h if lora is None else 0) + gemma_w if model.post_norms else 0
    post = 2 * post_norm
    layers = model.num_hidden_layers
    recomputed = recomputed_blocks(checkpointing, model_blocks(model))
    checkpointed = recomputed > 0
    # the layers whose attention takes a dense mask: all with padding, else the sliding ones whose
    # window is no longer than the row (transformers' SDPA path skips it only for a longer window);
    # with `windows` from SEGMENTS_FROM tokens none: a shorter window runs in blocks, one as long as
    # the row is plain causal attention (offload.engine.segments)
    masked = [padded or (model.slides(n) and s >= (model.sliding_window or s + 1)) for n in range(layers)]
    if windows and not padded and s >= SEGMENTS_FROM:  # (offload.engine.segments: its own blocks, no dense mask)
        masked = [False] * layers
    windowed = [windows and not padded and s >= SEGMENTS_FROM and model.slides(n) and s > (model.sliding_window or s)
                for n in range(layers)]
    # o_proj's input is a copy of the attention's output where packed rows are attended per segment
    # (their outputs joined), or the rotary's cat made q contiguous (Phi-3: and so SDPA's output);
    # else one SDPA call's output is laid out as o_proj reads it
    o_copy = model.fused or (not padded and row_positions and s >= SEGMENTS_FROM)

    # k/v repeated per query head (transformers' repeat_kv, where SDPA takes a mask) are copies only
    # with grouped heads: one key/value head is expanded as a view of itself
    copies = 1 < model.num_key_value_heads < model.num_attention_heads

    def attention_of(mask: bool, window: bool = False) -> int:  # one layer's attention, with its mask or without
        out = e * t * (2 * model.q_dim + 2 * model.kv_dim) + 4 * batch_size * model.num_attention_heads * s \
            + qk_norm_bytes(model, t=t, e=e, weighted=lora is None) + (e * t * model.q_dim if o_copy else 0)
        if mask:  # the additive mask and k/v repeated per query head, as SDPA saves them
            out += e * batch_size * s * s + (2 * e * t * (model.q_dim - model.kv_dim) if copies else 0)
        if window:  # blocks of a window's queries: each one's additive band mask and (grouped heads) its
            # keys and values repeated per query head; their outputs joined (o_proj's input a copy)
            keys, pairs = window_blocks(s, model.sliding_window or s)
            out += e * batch_size * pairs + (0 if o_copy else e * t * model.q_dim)  # (the join: a copy)
            if copies:  # (packed documents no longer than the window run whole: k/v's views saved)
                out += 2 * e * batch_size * model.q_dim * keys - (0 if row_positions else 2 * e * t * model.kv_dim)
        # a fused layer's v is a view of the qkv output, which SDPA keeps whole (the engine runs
        # without a KV cache, whose concatenation would copy it out); with a mask (or in a window's
        # blocks) and grouped heads, repeat_kv copies it out instead
        if model.fused and (not (mask or window) or not copies):
            out += e * t * (model.q_dim + model.kv_dim)
        return out

    attention = [attention_of(m, w) for m, w in zip(masked, windowed)]
    # the MLP's tokens at once: a tile's when it runs in tiles (offload.engine.tiled)
    mlp_t = batch_size * min(s, mlp_tile_tokens(i, e, batch_size)) if (
        tiles and checkpointed and model.family in TILED_FAMILIES) else t
    mlp, kept_mlp = (moe_mlp_bytes(model, t=t, e=e),) * 2 if model.moe else (4 * e * mlp_t * i, 4 * e * t * i)
    kinds = {model.slides(n) for n in range(layers)}  # (local and global: Gemma-3's two kinds of layer)
    # the dense masks a checkpointed block keeps (bool, shared by the layers of a kind): one per kind
    # of layer that takes one (a window's without padding is one row's, broadcast over the batch)
    mask_bytes = (batch_size if padded else 1) * s * s
    masked_kinds = {model.slides(n) for n in range(recomputed) if masked[n]}
    mask = mask_bytes * len(masked_kinds)
    # rotary cos/sin (e each, one pair per kind of layer) and position ids (int64, saved by a
    # checkpointed block), per row or shared
    rotary = (batch_size if row_positions else 1) * s * 2 * model.rotary_dim * e  # (one kind's cos and sin)
    positions = rotary * len(kinds) + (batch_size if row_positions else 1) * s * (8 if checkpointed else 0)

    def recompute_peak(internals: "list[int]") -> int:
        """`block`: the most a recomputed layer's internals hold beyond `inputs` while it runs (the
        layers below it still keep their inputs; a kind of layer none of them is has freed its
        cos/sin and mask), over the recomputed layers' `internals`."""
        best, first, below = 0, 1 if lora is not None and offload else 0, set()
        held = first + min(len(internals) - first, 2) if offload else len(internals)
        for n, inner in enumerate(internals):
            below.add(model.slides(n))
            gone = sum(rotary + (mask_bytes if k in masked_kinds else 0) for k in kinds - below)
            # of `inputs`, those layer n's recompute finds held: its own and the ones below it; offloaded,
            # its own and the one fetched ahead, and a LoRA run's first (it stays)
            fewer = held - min(n + 1, held)
            best = max(best, inner - fewer * e * t * h - gone)
        return best
    if lora is not None:  # (a MoE's dense MLP is its shared expert, none for Mixtral; its routed experts: `moe`)
        dense = model.shared_expert_intermediate_size if model.moe else i
        routed = moe_mlp_bytes(model, t=t, e=e, frozen=True) if model.moe else 0
        # the copy: saved by o_proj's own adapter only, and with dropout not even there (its dropped copy is)
        unsaved = e * t * model.q_dim if "o_proj" not in lora[0] or len(lora) == 3 else 0
        parts = _lora_parts(lora, e=e, t=t, s=s, h=h, i=dense, layers=layers,
                            attention=[a - (unsaved if o_copy or w else 0) for a, w in zip(attention, windowed)],
                            post_norm=post_norm,
                            fixed=mask + positions, recomputed=recomputed, model=model, batch_size=batch_size,
                            mlp_t=mlp_t, routed=routed, peak=recompute_peak,
                            rotary_alone=rotary if sum(model.slides(n) == model.slides(0) for n in range(layers)) == 1
                            else 0)
    else:
        kept_input = e * t * h if e == 4 else 0  # (a kept layer's first norm's fp32 input, the block input)
        parts = {
            "fixed": 8 * t + positions + mask + (e if model.gemma else 0),  # (Gemma: the embedding's scale)
            "inputs": recomputed * e * t * h,
            "block": recompute_peak([first_norm + a + norm + post + mlp for a in attention[:recomputed]]),
            "layers": sum(first_norm + a + norm + post + kept_mlp + kept_input for a in attention[recomputed:]),
            "final_norm": norm,
            "head": norm + loss_bytes(t=t, batch_size=batch_size, vocab=model.vocab_size, h=h, e=e, head_grad=True,
                                      own=own) + loss_workspace(t=t, vocab=model.vocab_size, h=h, e=e, head_grad=True,
                                                                own=own),
            "loss_tail": loss_tail(t=t, vocab=model.vocab_size, h=h, e=e, head_grad=True, own=own),
        }
    if model.router_loss:  # every layer's router logits joined (e each) and their top-k's indices
        # (int64), until the loss's backward: part of the end of forward's peak
        parts["head"] += layers * t * (e * model.num_experts + 8 * model.num_experts_per_tok)
    parts["host_inputs"] = parts["host_staging"] = 0
    parts["inputs_end"] = parts["inputs"]
    if offload and checkpointed:
        kept = e * t * h if lora is not None else 0  # (a LoRA run's first block input needs no gradient)
        moved = parts["inputs"] - kept
        parts["host_inputs"] = moved
        parts["inputs"] = kept + min(moved, 2 * e * t * h)
        parts["inputs_end"] = kept + min(moved, e * t * h)  # (actoffload.IN_FLIGHT)
        parts["host_staging"] = min(moved, 2 * e * t * h)  # on their way to NVMe: two host buffers
    return parts


#: The linears that read a layer's attention input, and its MLP's input: Llama's or, fused, Phi-3's.
QKV = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"})
MLP_IN = frozenset({"gate_proj", "up_proj", "gate_up_proj"})


def gemma_weight_bytes(model: ModelProfile) -> int:
    """What a Gemma RMSNorm over the hidden width saves besides the others': its 1 + weight (fp32,
    a new tensor each call, for its input's gradient); 0 for other families."""
    return 4 * model.hidden_size if model.gemma else 0


def window_blocks(s: int, window: int) -> tuple[int, int]:
    """(keys, query-key pairs) over the blocks a row of `s` tokens is attended in through a
    sliding `window` (offload.engine.segments): blocks of `window` queries, the first over its
    own keys, each other one over its own and the window - 1 before them."""
    blocks = -(-s // window)
    first, last = min(window, s), s - (blocks - 1) * window
    squares = first * first + (blocks - 2) * window * window + last * last if blocks > 1 else first * first
    return s + (blocks - 1) * (window - 1), squares + (window - 1) * (s - first)


def qk_norm_bytes(model: ModelProfile, *, t: int, e: int, weighted: bool = True,
                  parts: "tuple[str, ...]" = ("q", "k")) -> int:
    """What a QK_NORM_FAMILIES layer's per-head RMSNorms on the queries and keys save over `t`
    tokens: each one's fp32 input (a copy in bf16, the projection's output itself in fp32),
    rsqrt (fp32, one a head) and, when its weight is trained (`weighted`), the normalised input
    (e); their outputs go through the rotary embedding, which saves none of them. 0 for others."""
    if not model.qk_norm:
        return 0
    width = {"q": (model.q_dim, model.num_attention_heads), "k": (model.kv_dim, model.num_key_value_heads)}
    normalised = (4 if model.gemma else e) if weighted else 0  # (a Gemma norm's is fp32, with its 1 + weight)
    return sum(t * ((4 + normalised) * width[p][0] + 4 * width[p][1]) + (4 * model.dim_per_head if model.gemma else 0)
               for p in parts)


def moe_mlp_bytes(model: ModelProfile, *, t: int, e: int, frozen: bool = False) -> int:
    """What a MoE layer's MLP saves for backward over `t` tokens, as transformers' grouped_mm
    experts (its default) save it, measured through the engine (tests/test_plan_moe.py): per
    routed token-expert pair (S = t x top-k) the gathered input and the down projection's output
    (e*h each), the gate/up output, its activation and their product (4 e*x); the router's fp32
    logits and probabilities' share (4*t*experts), per-expert offsets; Mixtral's renormalised
    top-k weights; Qwen2-MoE's shared expert (a dense MLP, 4 e*t*width) and its gated output.
    `frozen` (a LoRA run: experts and router frozen): no gathered input and no product (only
    the weights' gradients need them), and without the shared expert, which the LoRA formulas
    price as a dense MLP (its linears may be targets)."""
    h, x, n = model.hidden_size, model.expert_size, model.num_experts
    pairs = t * model.num_experts_per_tok
    common = pairs * ((3 if frozen else 4) * e * x + (1 if frozen else 2) * e * h) + 4 * t * n + 4 * n
    if model.family == "mixtral":
        return common + 40 * pairs + 4 * t
    width = 0 if frozen else model.shared_expert_intermediate_size
    return common + (32 + e) * pairs + e * t + e * t * h + 4 * e * t * width


def _lora_parts(lora: "tuple[frozenset[str], int] | tuple[frozenset[str], int, int]", *, e: int, t: int, s: int,
                h: int, i: int, layers: int, attention: "list[int]", post_norm: int, fixed: int, recomputed: int,
                model: ModelProfile, batch_size: int, mlp_t: int, peak: "Callable[[list[int]], int]",
                rotary_alone: int, routed: int = 0) -> dict[str, int]:
    """activation_parts of a LoRA run (see there). `attention`: each layer's attention bytes;
    `post_norm`: one of its norms of the attention's and the MLP's outputs (Gemma-3's). `mlp_t`:
    the MLP's tokens at once in a recomputed layer (a tile's when it runs in tiles, which it does
    not with dropout; its input is then saved whatever the targets); a kept layer's MLP runs
    untiled; `peak`: the recomputed layers' internals to `block` (activation_parts);
    `rotary_alone`: layer 0's cos/sin where no other layer shares them (Gemma-3's kinds of
    layer: a kept layer 0 whose q and k need no gradient saves none). A MoE layer: `i` is its
    shared expert's width (0 for Mixtral), `routed` its routed experts' bytes (moe_mlp_bytes,
    frozen)."""
    targets, rank, drop = (*lora, None) if len(lora) == 2 else lora
    targets &= frozenset(_INPUT)  # (a decoder layer's: a vision tower's linears never run on text)
    own = model.router_loss  # (as activation_parts)
    if drop is not None and targets & (MLP_IN | {"down_proj"}):
        mlp_t = t  # (an adapter's dropout in the MLP would draw its noise per tile: untiled)
    fp32_copy = 4 * t * h
    gemma_w, post = gemma_weight_bytes(model), 2 * post_norm
    first = 4 * t + (fp32_copy if e != 4 else 0) + (e * t * h if targets & QKV else 0) + gemma_w
    mlp_targets = len(targets & (MLP_IN | {"down_proj"}))

    def internals_at(mt: int, att: int) -> int:  # one layer's, its MLP over `mt` tokens at once
        # (post_attention_layernorm before the MLP; Gemma-3's pre_feedforward_layernorm)
        second = 4 * t + fp32_copy + gemma_w + (e * t * h if targets & (MLP_IN | {"shared_expert_gate"})
                                                or mt != t else 0)
        mlp = 3 * e * mt * i + (e * mt * i if "down_proj" in targets else 0) + routed
        out = first + att + second + post + mlp + e * rank * (t * (len(targets) - mlp_targets) + mt * mlp_targets)
        if drop is not None:
            out += _dropout_bytes(targets, e=e, mask=drop, t=t, h=h, i=i, q=model.q_dim, grad_in=lambda part: True)
        return out

    def layer0_less(mt: int, att: int) -> int:
        """What layer 0 does not save of what the others do (kept or recomputed): nothing for the
        part before its first targeted linear, its input (the frozen embedding's output) needing
        no gradient."""
        less = 4 * t + (fp32_copy if e != 4 else 0) + gemma_w
        if targets & QKV:  # a q/k norm over an untargeted projection: nothing
            less += qk_norm_bytes(model, t=t, e=e, weighted=False,
                                  parts=tuple(p for p in ("q", "k") if f"{p}_proj" not in targets))
        else:
            less += att - (e * t * model.q_dim if "o_proj" in targets else 0)  # o_proj's adapter saves its input
            if "o_proj" not in targets:
                less += 4 * t + fp32_copy + gemma_w  # the second norm's input needs no gradient either
                less += post_norm  # nor, in Gemma-3, the norm of the attention's output
                mlp_in = targets & MLP_IN
                # of gate, up and silu(gate): what the targeted side's gradient needs (a fused gate_up: both)
                sides = 2 if "gate_up_proj" in mlp_in else len(mlp_in)
                less += e * mt * i * {0: 3, 1: 2 if "up_proj" in mlp_in else 1, 2: 0}[sides]
                if routed:  # frozen routed experts whose input needs no gradient save nothing; of the
                    # shared expert's gate, its sigmoid (and the shared output, the gate being a target)
                    less += routed - e * t - (e * t * h if "shared_expert_gate" in targets else 0)
        if drop is not None:  # layer 0 saves no dropout mask where its input needs no gradient
            less += _dropout_bytes(targets, e=e, mask=drop, t=t, h=h, i=i, q=model.q_dim, grad_in=lambda part: True) \
                - _dropout_bytes(targets, e=e, mask=drop, t=t, h=h, i=i, q=model.q_dim,
                                 grad_in=lambda part: _needs_grad_in(part, targets))
        return less

    final = 4 * t + fp32_copy + gemma_w  # the final norm's input and rsqrt
    kept_input = e * t * h if e == 4 else 0  # a kept layer's first norm's fp32 input, the block input
    # a kept layer 0 whose q and k need no gradient saves no cos/sin: gone where no other layer
    # of its kind saves them
    layer0 = 0 if recomputed else layer0_less(t, attention[0]) + kept_input + (
        0 if targets & {"q_proj", "k_proj", "qkv_proj"} else rotary_alone)
    return {
        "fixed": fixed,  # the mask and positions (no token ids: the embedding is frozen)
        "inputs": recomputed * e * t * h,
        "block": peak([internals_at(mlp_t, a) - (layer0_less(mlp_t, a) if n == 0 else 0)
                       for n, a in enumerate(attention[:recomputed])]),
        "layers": sum(internals_at(t, a) + kept_input for a in attention[recomputed:]) - layer0,
        "final_norm": final,
        "head": final + loss_bytes(t=t, batch_size=batch_size, vocab=model.vocab_size, h=h, e=e, head_grad=False,
                                   own=own) + loss_workspace(t=t, vocab=model.vocab_size, h=h, e=e, own=own),
        "loss_tail": loss_tail(t=t, vocab=model.vocab_size, h=h, e=e, own=own),
    }


_INPUT = {"q_proj": "h", "k_proj": "h", "v_proj": "h", "qkv_proj": "h", "o_proj": "q", "gate_proj": "h",
          "up_proj": "h", "gate_up_proj": "h",
          "down_proj": "i", "shared_expert_gate": "h"}  # (Qwen2-MoE's: it reads the MLP's input)


def _dropout_bytes(targets: frozenset[str], *, e: int, mask: int, t: int, h: int, i: int, q: int,
                   grad_in: Callable[[str], bool]) -> int:
    """What LoRA dropout adds to one layer's saved activations (activation_parts): the dropped
    copies beyond the one input a group shares without dropout, and a mask per targeted linear
    whose input needs a gradient (`grad_in(linear)`)."""
    width = {"h": h, "q": q, "i": i}
    qkv = len(targets & QKV)
    gate_up = len(targets & (MLP_IN | {"shared_expert_gate"}))
    copies = e * t * h * (max(0, qkv - 1) + max(0, gate_up - 1))
    if "o_proj" in targets and grad_in("o_proj"):
        copies += e * t * q
    masks = sum(mask * t * width[_INPUT[lin]] for lin in targets if grad_in(lin))
    return copies + masks


def _needs_grad_in(part: str, targets: frozenset[str]) -> bool:
    """Layer 0 without recompute (its input, the frozen embedding's output, needs no gradient):
    whether the input of linear `part` needs one, i.e. some linear before it is targeted."""
    attention = QKV | {"o_proj"}
    before = {"o_proj": QKV, "gate_proj": attention, "up_proj": attention, "gate_up_proj": attention,
              "down_proj": attention | MLP_IN, "shared_expert_gate": attention}
    return bool(targets & before.get(part, set()))


LoraAct = Optional[Union[tuple[frozenset[str], int], tuple[frozenset[str], int, int]]]
"""LoRA in the activations: (targets, rank) or, with dropout, (targets, rank, bytes of its mask)."""


def activation_bytes(*, model: ModelProfile, batch_size: int, seq_len: int, precision: str,
                     backward: bool = True, checkpointing: bool | int | None = None, padded: bool = False,
                     lora: LoraAct = None, row_positions: bool = False, offload: bool = False,
                     tiles: bool = True, windows: bool = False) -> int:
    """Peak bytes of saved activations in one step (see activation_parts; `padded`: the step's
    batch has padding). Without backward (zeroth-order optimizers) autograd saves nothing: the
    loss's transients alone (zo_loss_workspace)."""
    if not backward:
        return zo_loss_workspace(t=batch_size * seq_len, vocab=model.vocab_size, e=compute_bytes(precision))
    p = activation_parts(model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
                         checkpointing=checkpointing, padded=padded, lora=lora, row_positions=row_positions,
                         offload=offload, tiles=tiles, windows=windows)
    return p["fixed"] + max(p["inputs_end"] + p["layers"] + p["head"], p["inputs"] + p["block"])


def checkpoints_blocks(model: ModelProfile, checkpointing: bool | int | None = None) -> bool:
    """Whether the engine checkpoints any decoder layer (core.options.recomputed_blocks, the rule
    Activations(recompute=...) applies)."""
    return recomputed_blocks(checkpointing, model_blocks(model)) > 0


def model_blocks(model: ModelProfile) -> int:
    """The repeated blocks the engine finds in such a model (offload.engine.model_info.find_blocks:
    a list of at least two layers): its decoder layers, none where it has one."""
    return model.num_hidden_layers if model.num_hidden_layers > 1 else 0


def buffer_bytes(model: ModelProfile) -> int:
    """Module buffers: the rotary embedding's inv_freq and original_inv_freq (fp32, head_dim/2;
    one pair per kind of layer, Gemma-3's local and global), Gemma's embedding scale (fp32), a
    vision tower's position ids (int64, one per patch)."""
    kinds = len({model.slides(n) for n in range(model.num_hidden_layers)})
    return kinds * 2 * 4 * (model.rotary_dim // 2) + (4 if model.gemma else 0) + 8 * model.patches


@dataclass(frozen=True, kw_only=True)
class StepLoad:
    """What one step moves and computes, as placed by the planner."""

    tokens_flops_fwd: float
    """Forward flops of the model over one micro-batch."""
    placed: dict[str, dict[str, int]]
    """Bytes per tier per kind of the streamed chunks (tiers host/cxl/nvme), as the ledger names them."""
    stream_bytes: dict[str, int]
    """Per host-side tier: bytes of the compute sources (bf16 compute copies, or fp32 masters) there."""
    fetched_bytes: int
    """Compute-copy bytes copied host -> device per micro-batch (forward + backward, less cache hits)."""
    grad_d2h_bytes: int
    """Gradient bytes sent device -> host per micro-batch (compute dtype, streamed chunks)."""
    cpu_params: int
    """Parameters updated on the CPU (streamed chunks)."""
    cpu_fp32_params: int
    """Of those, the ones with fp32 moments under an 8-bit optimizer (its embeddings,
    update.table.fp32_embeddings): updated at the fp32 AdamW rate."""
    cpu_flops: float
    """Matmul flops of the CPU update (low-rank projections)."""
    cpu_update_bytes: int
    """Host-memory bytes read and written by the CPU update."""
    gpu_params: int
    """Parameters updated on the device (gpu-home chunks)."""
    gpu_fp32_params: int
    """Of those, the ones with fp32 moments under an 8-bit optimizer (priced on the simulated
    device, whose update runs on the host's cores)."""
    gpu_update_bytes: int
    """Device-memory bytes read and written by the device update."""
    gpu_update_flops: float
    """Matmul flops of the device update."""
    chunk_compute_bytes: int
    """Compute-copy bytes of the largest streamed chunk (startup of a pass)."""
    chunk_params: int
    """Parameters of the largest CPU-updated chunk (the update tail after backward)."""
    chunk_fp32_params: int = 0
    """Of those, the ones with fp32 moments under an 8-bit optimizer (cpu_fp32_params)."""
    num_chunks: int = 0
    """Chunks in all (the update runs one kernel call per chunk)."""
    streamed_chunks: int = 0
    """Chunks that are not gpu-home."""
    ops_per_forward: int = 0
    """Torch ops and module hooks one forward dispatches (each pays host.op_overhead_us)."""
    recompute: float = 1.0
    """The share of the decoder blocks backward recomputes (their forward again: 3 forwards'
    flops when all are, 2 when none)."""
    weight_grads: bool = True
    """Backward computes weight gradients (2 forwards' flops); False for a LoRA run over a frozen
    base: only the activations' gradients (1 forward's flops; the adapters' are negligible)."""
    link_bytes: int | None = None
    """Bytes crossing the link host -> device per micro-batch (None: `fetched_bytes`); less for an
    encoded frozen base (its chunks cross encoded and are decoded on the device)."""
    dequant_bytes: int = 0
    """Bytes the device reads (encoded) and writes (decoded) per micro-batch to decode the base."""
    offloaded: dict[str, int] = field(default_factory=dict)
    """Bytes of block inputs offloaded per micro-batch, by the tier they wait in (host, cxl, nvme):
    out over the link in forward, back in backward."""
    grad_staged: bool = False
    """Gradients land in a host staging buffer, converted or added there by the copy worker (CUDA)."""


@dataclass(frozen=True, kw_only=True)
class StepPrediction:
    """Predicted seconds of a step, phase by phase and resource by resource."""

    phases: dict[str, float]
    """Seconds of each phase ("forward", "backward", "update"); they run one after another."""
    resources: dict[str, dict[str, float]] = field(hash=False)
    """Busy seconds of each resource in each phase."""
    step_s: float
    bottleneck: str
    """Resource that bounds the most step time."""
    tokens_per_s: float
    bounds: dict[str, str] = field(default_factory=dict, hash=False)
    """The resource that bounds each phase (its busiest)."""


def dispatch_s(load: StepLoad, overhead_us: float | None) -> tuple[float, float]:
    """Host seconds to dispatch one forward and one backward (`overhead_us` per op and hook):
    backward runs each op's backward (twice its forward's dispatches) plus, with recompute,
    the forward again."""
    each = (overhead_us or 0.0) * 1e-6 * load.ops_per_forward
    return each, each * (2 + load.recompute)


def _phase(busy: dict[str, float], startup: float) -> tuple[float, str]:
    busy = {k: v for k, v in busy.items() if v > 0}
    top = max(busy, key=busy.__getitem__, default="gpu compute")
    return busy.get(top, 0.0) + startup, top


def _finish(phases: dict[str, float], resources: dict[str, dict[str, float]], tops: dict[str, str], tokens: int) -> StepPrediction:
    step = sum(phases.values())
    share: dict[str, float] = {}
    for name, seconds in phases.items():
        share[tops[name]] = share.get(tops[name], 0.0) + seconds
    bottleneck = max(share, key=share.__getitem__) if share else "gpu compute"
    return StepPrediction(phases=phases, resources=resources, step_s=step, bottleneck=bottleneck,
                          tokens_per_s=tokens / step if step > 0 else float("inf"), bounds=dict(tops))


def _cpu_rate(hw: HardwareProfile, cost: OptimizerSpec) -> float:
    return float(getattr(hw.host, f"{cost.cpu_rate}_params_per_s")) * cost.cpu_rate_scale


def _cpu_params_s(hw: HardwareProfile, cost: OptimizerSpec, params: int, fp32: int, share: float = 1.0) -> float:
    """Seconds of a CPU update's elementwise work over `params` parameters, `fp32` of them with
    fp32 moments under an 8-bit optimizer, on all of the host's cores (`share` of them)."""
    return ((params - fp32) / _cpu_rate(hw, cost) + fp32 / hw.host.adamw_params_per_s) / share


def predict_step(*, hardware: HardwareProfile, precision: str, cost: OptimizerSpec, load: StepLoad,
                 tokens: int, micro_batches: int = 1, collectives: "Collectives | None" = None) -> StepPrediction:
    """Price one step of `load` on `hardware` (see the module docstring for the model).
    `collectives`: one rank of several (plan.ranks): its broadcasts run on the copy thread after
    its own host-to-device copies ("h2d + gather"); its gradient reduces on their own thread,
    overlapping backward ("grad reduce"); through host memory (gpu_link "host") both also pass
    host DRAM twice."""
    if hardware.simulated:
        return _predict_simulated(hardware=hardware, precision=precision, cost=cost, load=load, tokens=tokens,
                                  micro_batches=micro_batches, collectives=collectives)
    hw, pl = hardware, load.placed

    def get(tier: str, kind: str) -> int:
        return pl.get(tier, {}).get(kind, 0)

    # a step's kernels against the GEMM rate: attention, norms, elementwise (`finetune profile`)
    gpu_rate = hw.gpu_tflops(precision) * 1e12 / (hw.host.step_calibration or 1.0)
    h2d, d2h = hw.pcie.h2d_pinned_gbps * GB, hw.pcie.d2h_pinned_gbps * GB
    dram = hw.host.dram_bandwidth_gbps * GB
    nv_r = hw.nvme.read_gbps * GB if hw.nvme else 1.0
    nv_w = hw.nvme.write_gbps * GB if hw.nvme else 1.0
    cxl = hw.cxl.bandwidth_gbps * GB if hw.cxl else 1.0
    src = load.stream_bytes
    stream = (load.fetched_bytes if load.link_bytes is None else load.link_bytes) / 2  # per pass
    on_nvme = src.get("nvme", 0)
    dequant = load.dequant_bytes / 2 / (hw.gpu.memory_bandwidth_gbps * GB)  # per pass, memory-bound
    bwd_passes = load.recompute + (2 if load.weight_grads else 1)
    launch_fwd, launch_bwd = dispatch_s(load, hw.host.op_overhead_us)

    # forward: stream every streamed compute source in; nvme sources pass a DRAM bounce buffer.
    fwd_busy = {
        "gpu compute": load.tokens_flops_fwd / gpu_rate + dequant,
        "host launch": launch_fwd,
        "pcie h2d": stream / h2d,
        "nvme read": on_nvme / nv_r,
        "cxl": src.get("cxl", 0) / cxl,
        "host dram": (src.get("host", 0) + 2 * on_nvme) / dram,
    }
    startup = load.chunk_compute_bytes / h2d + (load.chunk_compute_bytes / nv_r if on_nvme else 0)
    phases, resources, tops = {}, {}, {}
    gather_s = reduce_s = 0.0
    if collectives is not None:
        link = collectives.gbps * GB
        gather_s, reduce_s = collectives.gather_bytes / 2 / link, collectives.reduce_bytes / link
        fwd_busy["h2d + gather"] = fwd_busy.pop("pcie h2d") + gather_s
        if collectives.via == "host":
            fwd_busy["host dram"] += collectives.gather_bytes / dram  # in and out: half each pass
    act = sum(load.offloaded.values())  # block inputs: out in forward, back in backward
    act_nvme, act_cxl = load.offloaded.get("nvme", 0), load.offloaded.get("cxl", 0)
    if act:
        fwd_busy["pcie d2h"] = act / d2h
        fwd_busy["nvme write"] = act_nvme / nv_w
        fwd_busy["cxl"] += act_cxl / cxl
        fwd_busy["host dram"] += (act - act_cxl + act_nvme) / dram
    t, top = _phase(fwd_busy, startup if stream else 0.0)
    phases["forward"], resources["forward"], tops["forward"] = t * cost.forwards * micro_batches, fwd_busy, top

    nv_read = on_nvme + sum(get("nvme", k) for k in ("master", "state", "grad"))
    nv_write = sum(get("nvme", k) for k in KINDS if k != "grad")
    nv_update = nv_read / nv_r + nv_write / nv_w
    io_cores = 1 if nv_update > 0 and hw.host.cpu_cores > 1 else 0
    cores = (hw.host.cpu_cores - io_cores) / hw.host.cpu_cores
    host_share = sum(get("host", k) for k in KINDS) / max(1, sum(get(t, k) for t in pl for k in KINDS))
    cxl_share = sum(get("cxl", k) for k in KINDS) / max(1, sum(get(t, k) for t in pl for k in KINDS))
    cpu_update = max(_cpu_params_s(hw, cost, load.cpu_params, load.cpu_fp32_params, cores), load.cpu_update_bytes * host_share / dram,
                     load.cpu_update_bytes * cxl_share / cxl, load.cpu_flops / (hw.host.cpu_fp32_tflops * 1e12))
    gpu_update = load.gpu_update_bytes / (hw.gpu.memory_bandwidth_gbps * GB) \
        + load.gpu_update_flops / (hw.gpu.fp32_tflops * 1e12)
    tail = _cpu_params_s(hw, cost, load.chunk_params, load.chunk_fp32_params, cores) if load.cpu_params else 0.0

    if cost.needs_grad:  # backward (with recompute by default); CPU updates overlap it, group by group
        staged = _staged_bytes(load.grad_d2h_bytes, compute_bytes(precision), micro_batches) if load.grad_staged else 0
        bwd_busy = {
            "gpu compute": (bwd_passes * load.tokens_flops_fwd / gpu_rate + dequant) * micro_batches
            + gpu_update,
            # the CPU update's threads take every core, the launching thread's too: they add up
            # (H200 host, 0.85B, bench/README.md "gpu_check.sh": AdamW 0.361 s vs AdamW8bit 0.294 s
            # per step, as their CPU updates differ)
            "host launch": launch_bwd * micro_batches + (cpu_update if launch_bwd else 0.0),
            "pcie h2d": (stream + act) / h2d * micro_batches,
            # the copy worker converts / adds each staged gradient on the host before its next copy
            "pcie d2h": load.grad_d2h_bytes / d2h * micro_batches + staged / dram,
            # the base: read again per micro-batch
            "nvme": nv_update + (on_nvme * (micro_batches - 1) + act_nvme * micro_batches) / nv_r,
            "cxl": ((src.get("cxl", 0) + act_cxl) * micro_batches + load.cpu_update_bytes * cxl_share) / cxl,
            "cpu update": cpu_update,
            "host dram": (src.get("host", 0) + load.grad_d2h_bytes + act - act_cxl + act_nvme) * micro_batches / dram
            + (staged + load.cpu_update_bytes * host_share + 2 * (nv_read + nv_write)) / dram,
        }
        if collectives is not None:
            bwd_busy["h2d + gather"] = bwd_busy.pop("pcie h2d") + gather_s * micro_batches
            bwd_busy["grad reduce"] = reduce_s
            bwd_busy["host dram"] += 2 * collectives.reduce_bytes / dram + (
                collectives.gather_bytes * micro_batches / dram if collectives.via == "host" else 0.0)
        t, top = _phase(bwd_busy, (startup if stream else 0.0) + tail)
        phases["backward"], resources["backward"], tops["backward"] = t, bwd_busy, top
    else:  # zeroth order: the update follows the second forward
        upd_busy = {"cpu update": cpu_update, "gpu compute": gpu_update, "nvme": nv_update,
                    "cxl": load.cpu_update_bytes * cxl_share / cxl,
                    "host dram": (load.cpu_update_bytes * host_share + 2 * (nv_read + nv_write)) / dram}
        t, top = _phase(upd_busy, 0.0)
        phases["update"], resources["update"], tops["update"] = t, upd_busy, top
    return _finish(phases, resources, tops, tokens)


def _staged_bytes(grad_bytes: int, e: int, micro_batches: int) -> int:
    """Host DRAM bytes the copy worker moves for `grad_bytes` of gradients (compute dtype, `e`
    bytes each) per micro-batch staged on CUDA (offload.engine.gradients): the first
    micro-batch's converted into their fp32 homes (none in fp32: copied there directly), each
    later one's added (read staged and home, write home)."""
    n = grad_bytes // e
    first = n * (e + 4) if e != 4 else 0
    return first + (micro_batches - 1) * n * (e + 8)


def _predict_simulated(*, hardware: HardwareProfile, precision: str, cost: OptimizerSpec, load: StepLoad,
                       tokens: int, micro_batches: int, collectives: "Collectives | None" = None) -> StepPrediction:
    """The simulated device: "gpu" compute, the copy threads and the optimizer all run on the
    same CPU cores, so their times add up instead of overlapping (the update's CPU work is priced
    after backward: on shared cores it costs the same during backward), device-home chunks with
    the same CPU kernels. Each op also pays a fixed dispatch cost (`host.op_overhead_us`), which
    dominates tiny models. Both are scaled by the profile's calibration: dispatch by
    `dispatch_calibration` (bf16: `dispatch_calibration_bf16`), the rest of forward and backward
    by `step_calibration` (bf16: `step_calibration_bf16`). The disk is not a core: NVMe traffic overlaps the CPU work of its
    phase (a phase lasts the longer of the two) - the forward's fetches of NVMe-resident compute
    sources, and in backward its refetches plus the update's reads and write-backs of master,
    state and gradient, which the early update (offload.engine.early) runs during backward; the
    step's last write-backs run on into the next forward, where the disk would idle. A fetch from
    NVMe (not decoded) is read into the cache buffer in place, and an fp32 master in DRAM is
    computed from where it lies (one rank, not MeZO): no copy to price."""
    hw = hardware
    rate = hw.gpu_tflops(precision) * 1e12
    copy = hw.pcie.h2d_pinned_gbps * GB
    back = hw.pcie.d2h_pinned_gbps * GB
    overhead = (hw.host.op_overhead_us or 0.0) * 1e-6
    dispatch_fwd, dispatch_bwd = dispatch_s(load, hw.host.op_overhead_us)
    link: float = load.fetched_bytes if load.link_bytes is None else load.link_bytes
    if load.link_bytes is None and not load.dequant_bytes:  # no copy: NVMe reads land in the cache
        # buffer, and fp32 masters in DRAM are computed from in place (offload.engine.residency)
        inplace = load.stream_bytes.get("nvme", 0)
        if precision == "fp32" and cost.needs_grad and collectives is None:
            inplace += load.stream_bytes.get("host", 0)
        link -= load.fetched_bytes * inplace / max(1, sum(load.stream_bytes.values()))
    decode = load.dequant_bytes / 2 / (hw.host.dram_bandwidth_gbps * GB)  # per pass, on the CPU cores
    act = sum(load.offloaded.values())  # block inputs: out in forward, back in backward
    fwd = {"gpu compute": load.tokens_flops_fwd / rate, "pcie h2d": link / 3 / copy,
           "dispatch": dispatch_fwd, "dequant": decode}
    flops = load.recompute + (2 if load.weight_grads else 1)
    bwd = {"gpu compute": flops * load.tokens_flops_fwd / rate, "pcie h2d": 2 * link / 3 / copy,
           "pcie d2h": load.grad_d2h_bytes / back, "dispatch": dispatch_bwd, "dequant": decode}
    if act:
        fwd["pcie d2h"] = act / back
        bwd["pcie h2d"] += act / copy
    # (the simulated device's update runs on the same cores)
    upd = {"cpu update": _cpu_params_s(hw, cost, load.cpu_params + load.gpu_params,
                                       load.cpu_fp32_params + load.gpu_fp32_params)
           + load.cpu_flops / (hw.host.cpu_fp32_tflops * 1e12),
           "dispatch": 4 * load.num_chunks * overhead}
    if collectives is not None:  # gloo between processes: copies on the same cores, added up
        link_s = collectives.gbps * GB
        fwd["gather"] = bwd["gather"] = collectives.gather_bytes / 2 / link_s
        upd["grad reduce"] = collectives.reduce_bytes / link_s
    phases, resources, tops = {}, {"forward": fwd, "backward": bwd, "update": upd}, {}
    scale = (precision == "bf16" and hw.host.step_calibration_bf16) or hw.host.step_calibration or 1.0
    ops = (precision == "bf16" and hw.host.dispatch_calibration_bf16) or hw.host.dispatch_calibration or scale
    disk = _simulated_nvme(hw, load, needs_grad=cost.needs_grad, fp32=precision == "fp32")
    idle = 0.0  # seconds the forward leaves the disk idle
    for name, busy, n in (("forward", fwd, cost.forwards * micro_batches), ("backward", bwd, micro_batches),
                          ("update", upd, 1)):
        if name == "backward" and not cost.needs_grad:
            continue
        # calibrated (the update is not): dispatch and the rest scale apart
        seconds = busy if name == "update" else {k: v * (ops if k == "dispatch" else scale) for k, v in busy.items()}
        phases[name] = sum(seconds.values()) * n
        tops[name] = max(seconds, key=seconds.__getitem__)  # the busiest resource once calibrated
        nvme = disk.get(name, 0.0) * (n if name == "forward" else 1)
        if name == "forward":
            idle = max(0.0, phases[name] - nvme)
        elif name == "backward":  # the last write-backs drain into the next forward's idle disk
            nvme -= min(idle, disk.get("deferred", 0.0))
        if nvme > 0:
            busy["nvme"] = nvme
            if nvme > phases[name]:
                phases[name], tops[name] = nvme, "nvme"
    return _finish(phases, resources, tops, tokens)


def _simulated_nvme(hw: HardwareProfile, load: StepLoad, *, needs_grad: bool, fp32: bool) -> dict[str, float]:
    """Disk seconds per phase on the simulated device: the forward's reads of NVMe-resident
    compute sources (their share of the forward's fetches), and (with a backward) the backward's
    refetches plus the update's reads (less the masters it copies from the cache) and writes,
    which overlap backward; without a backward the update's I/O is its own phase."""
    on = load.placed.get("nvme", {})
    act = load.offloaded.get("nvme", 0)  # block inputs: written in forward, read in backward
    if hw.nvme is None or not (on or act):
        return {}
    nv_r, nv_w = hw.nvme.read_gbps * GB, hw.nvme.write_gbps * GB
    share = load.stream_bytes.get("nvme", 0) / max(1, sum(load.stream_bytes.values()))
    fwd = load.fetched_bytes / (2 + load.recompute)
    # the update reads master and state and writes them back (and a bf16 compute copy); a gradient
    # on NVMe reaches the early update in its staging buffer, so it is neither written nor read
    writes = on.get("master", 0) + on.get("state", 0) + on.get("compute", 0)
    refetch = (load.fetched_bytes - fwd) * share
    # fp32 (the compute copy is the master's bytes): a master the backward refetched is still
    # cached when its update starts, which copies it from there (offload.engine.residency.
    # copy_master), not from NVMe. (MeZO copies some too, those of the second forward's last
    # chunks: not priced, its reads are overestimated.)
    cached = min(on.get("master", 0), refetch) if needs_grad and fp32 else 0
    reads = on.get("master", 0) - cached + on.get("state", 0)
    update = reads / nv_r + writes / nv_w
    if not needs_grad:
        return {"forward": fwd * share / nv_r, "update": update}
    # the step's last write-backs (one chunk's, at most) are left in flight when the step returns
    # (offload.runtime.swapping.update_all, defer=True): they overlap the next forward
    deferred = min(writes, load.chunk_params * writes / max(1, load.cpu_params)) / nv_w
    return {"forward": fwd * share / nv_r + act / nv_w, "backward": refetch / nv_r + update + act / nv_r,
            "deferred": deferred}
