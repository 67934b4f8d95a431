"""Manual check: a 2-layer d=1024 (ff 4096) nn.TransformerEncoder, default 64 MiB chunks, no
budget, two steps: the engine's losses against plain PyTorch's (fused AdamW).

    python bench/encoder_1024.py
"""
import copy
import torch
import torch.nn.functional as F
from torch import nn
from tierwise.offload import Engine, Optim
torch.manual_seed(0)
V, D = 256, 1024
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True, dropout=0.0), 2,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(D, V)
    def forward(self, x): return self.head(self.enc(self.emb(x)))
def loss_fn(m, b): return F.cross_entropy(m(b["x"]).flatten(0, 1), b["y"].flatten())
g = torch.Generator().manual_seed(1)
data = [{"x": torch.randint(0, V, (2, 16), generator=g), "y": torch.randint(0, V, (2, 16), generator=g)} for _ in range(2)]
model = M()
ref = copy.deepcopy(model)
opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
rl = []
for b in data:
    loss = loss_fn(ref, b)
    loss.backward()
    opt.step()
    opt.zero_grad()
    rl.append(loss.item())
eng = Engine(model, optim=Optim(lr=1e-4), loss_fn=loss_fn)
out_proj = [eng.plan.slots[f"enc.layers.{i}.self_attn.out_proj.weight"].chunk for i in range(2)]
in_proj = [eng.plan.slots[f"enc.layers.{i}.self_attn.in_proj_weight"].chunk for i in range(2)]
print("chunks", len(eng.plan.chunks), "in_proj in", in_proj, "out_proj in", out_proj, "engine", [eng.step(b) for b in data], "pytorch", rl)
eng.close()
