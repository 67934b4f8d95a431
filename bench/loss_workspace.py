"""The loss's transient bytes, measured (peak anonymous RSS on CPU) against perfmodel.loss_workspace.

A causal LM's loss makes tensors it does not save: the logits' gradients in backward (the
model's own loss), a tile's logits (the tiled head loss, offload.engine.headloss). The engine
books perfmodel.loss_workspace for them on the simulated device and the planner prices it, so
a run's RSS agrees with its ledger. The cases run in a child process (glibc's mmap threshold
fixed, as `finetune` fixes it, so a freed tensor leaves RSS), each three times; the last counts.
The peak is the kernel's (VmHWM, reset through /proc/self/clear_refs before each run), not a
sampled one: a sub-millisecond peak of a small case counts too.
The ledger books what the loss saves (loss_bytes) when it is saved, and the workspace for the
whole loss: the peak RSS over the loss's forward and backward must stay within their sum, and
near it (the ratio printed).

    python bench/loss_workspace.py                 # 32,000 words, 512 / 8,192 tokens (~2 min)
    python bench/loss_workspace.py --tile 32M --tokens 64 --tiled-tokens 1024 --json   # the test's
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys

CASES = [  # (path, dtype, flags)
    ("own", "float32", ""), ("own", "bfloat16", ""), ("own", "float32", "stats"), ("own", "bfloat16", "nograd"),
    ("tiled", "float32", ""), ("tiled", "bfloat16", ""), ("tiled", "float32", "stats"),
    ("tiled", "bfloat16", "cap"), ("tiled", "float32", "cap"), ("tiled", "bfloat16", "head"),
    ("tiled", "float32", "nograd"), ("tiled", "float32", "nograd cap"), ("tiled", "float32", "nograd stats"),
    ("zo", "float32", "nograd"), ("zo", "bfloat16", "nograd"),  # MeZO's two losses of one doubled forward
]


def _status(key: str) -> int:
    """Bytes of /proc/self/status's `key` (VmRSS: now; VmHWM: the most since clear_refs)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(path: str, dtype_name: str, flags: str, tokens: int, vocab: int, hidden: int) -> dict:
    import torch
    import torch.nn.functional as F

    from tierwise.offload.engine import headloss
    from tierwise.offload.plan import perfmodel

    dtype = getattr(torch, dtype_name)
    grads, stats, cap, head_grad = "nograd" not in flags, "stats" in flags, "cap" in flags, "head" in flags
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype).requires_grad_(head_grad)
    x = torch.randn(1, tokens, hidden, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    transform = headloss.transform_of(type("C", (), {"model_type": "gemma2", "final_logit_softcapping": 30.0})()
                                      ) if cap else None
    assert path == "tiled" or transform is None  # (the model's own soft-capping saves its tanh: an activation)

    doubled = x.detach().expand(2, -1, -1).contiguous()

    class Doubled(torch.nn.Module):  # a causal LM of the head alone, as hf_split_losses calls it
        config = type("C", (), {"vocab_size": vocab})()

        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, input_ids):  # (the body's last hidden states: both halves' rows, contiguous)
            return type("Out", (), {"logits": self.head(doubled)})()

        def loss_function(self, **kw):
            from transformers.loss.loss_utils import ForCausalLMLoss
            return ForCausalLMLoss(**kw)

    def loss_of() -> torch.Tensor:
        if path == "zo":
            from tierwise.offload.update.zeroth import hf_split_losses
            return torch.tensor(hf_split_losses(Doubled(), {"input_ids": labels, "labels": labels}, 1))
        targets = headloss.next_tokens(labels)
        if path == "own":  # as transformers' ForCausalLMLoss, the logits dropped before backward
            logits = head(x)
            loss = F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1), ignore_index=-100)
            if stats:
                with torch.no_grad():
                    headloss.TokenStats().add_logits(logits, targets)
            return loss
        return headloss.HeadLoss.apply(x, head.weight, None, targets.reshape(-1), None, transform, grads, None,
                                       headloss.TokenStats() if stats else None)

    peak = 0
    for _ in range(3):
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # the kernel's peak RSS (VmHWM) starts again from now
            f.write("5")
        with torch.set_grad_enabled(grads):
            loss = loss_of()
        if grads:
            loss.backward()
        del loss
        peak = _status("VmHWM") - base
        x.grad = head.weight.grad = None
    e = dtype.itemsize
    saved = perfmodel.loss_bytes(t=tokens, batch_size=1, vocab=vocab, h=hidden, e=e, head_grad=head_grad) if grads else 0
    if path == "zo":
        model = perfmodel.zo_loss_workspace(t=tokens, vocab=vocab, e=e)
    else:
        model = perfmodel.loss_workspace(t=tokens, vocab=vocab, h=hidden, e=e, grads=grads, head_grad=head_grad,
                                         transform=cap, stats=stats)
        assert perfmodel.own_loss(tokens, vocab, h=hidden, e=e, head_grad=head_grad and grads) == (path == "own"), \
            "tokens: pick the tiled / own path the case names"
    # (x's gradient is the model's backward's, not the loss's)
    return {"case": f"{path} {dtype_name} {flags}".strip(), "peak": peak - grads * e * tokens * hidden,
            "saved": saved, "workspace": model}


def main() -> None:
    from tierwise.offload.core.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=512, help="the model's own loss (perfmodel.own_loss) and MeZO's")
    ap.add_argument("--tiled-tokens", type=int, default=8192, help="the tiled loss")
    ap.add_argument("--tile", default="256M", help="fp32 logits of a tile (perfmodel.HEAD_TILE_BYTES)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    tile = parse_size(a.tile)
    if a.child:
        ctypes.CDLL(None).mallopt(-3, 128 << 10)  # (M_MMAP_THRESHOLD, as cli.main.fix_mmap_threshold)
        from tierwise.offload.plan import perfmodel

        perfmodel.HEAD_TILE_BYTES = tile
        print(json.dumps([child(path, dtype, flags, a.tiled_tokens if path == "tiled" else a.tokens, a.vocab, a.hidden)
                          for path, dtype, flags in CASES]))
        return
    cmd = [sys.executable, __file__, "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--tokens", str(a.tokens),
           "--tiled-tokens", str(a.tiled_tokens), "--tile", a.tile, "--child"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the measuring child failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    if a.json:
        print(json.dumps(rows))
        return
    mib = 1 << 20
    print(f"vocab {a.vocab}, hidden {a.hidden}, {a.tokens} / {a.tiled_tokens} tokens, tile {a.tile}")
    print(f"{'case':24} {'peak RSS':>10} {'saved':>10} {'workspace':>10} {'peak / both':>11}")
    for r in rows:
        print(f"{r['case']:24} {r['peak'] / mib:6.0f} MiB {r['saved'] / mib:6.0f} MiB {r['workspace'] / mib:6.0f} MiB "
              f"{r['peak'] / (r['saved'] + r['workspace']):11.2f}")

if __name__ == "__main__":
    main()
