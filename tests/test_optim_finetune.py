"""A tiny Llama fine-tuned for a few hundred steps: each optimizer against torch AdamW's loss."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from tierwise.optim import AdamW8bit, ApolloAdamW, GaLoreAdamW, MeZO  # noqa: E402

STEPS = 200


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def token_batches(steps):
    # a fixed synthetic stream with structure to learn: next token = (3 * token + 7) mod 256
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, 256, (8, 1), generator=gen)
        seq = [start]
        for _ in range(31):
            seq.append((3 * seq[-1] + 7) % 256)
        yield torch.cat(seq, dim=1)


def rank_groups(model, rank):
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    ids = {id(p) for p in mats}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": mats, "rank": rank}, {"params": rest}]


def final_loss(make_opt):
    model = tiny_llama()
    opt = make_opt(model)
    losses = []
    for batch in token_batches(STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10


@pytest.fixture(scope="module")
def adamw_loss():
    torch.set_num_threads(2)
    return final_loss(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0))


def test_adamw8bit_within_1_percent(adamw_loss):
    loss = final_loss(lambda m: AdamW8bit(m.parameters(), lr=3e-3, weight_decay=0.0))
    print(f"final loss {loss:.4f} vs AdamW {adamw_loss:.4f}")
    assert loss <= adamw_loss * 1.01, (loss, adamw_loss)


@pytest.mark.parametrize("make", [
    lambda m: GaLoreAdamW(rank_groups(m, 32), lr=3e-3, update_proj_gap=50, scale=1.0),
    lambda m: ApolloAdamW(rank_groups(m, 32), lr=3e-3, update_proj_gap=50, scale=1.0),
], ids=["galore", "apollo"])
def test_low_rank_within_3_percent(adamw_loss, make):
    loss = final_loss(make)
    print(f"final loss {loss:.4f} vs AdamW {adamw_loss:.4f}")
    assert loss <= adamw_loss * 1.03, (loss, adamw_loss)


def test_mezo_decreases_loss():
    torch.set_num_threads(2)
    model = tiny_llama()
    opt = MeZO(model.parameters(), lr=1e-4, eps=1e-3)
    batches = list(token_batches(1))
    batch = batches[0]
    with torch.no_grad():
        first = model(input_ids=batch, labels=batch).loss.item()
        for _ in range(100):
            opt.step(lambda: model(input_ids=batch, labels=batch).loss)
        last = model(input_ids=batch, labels=batch).loss.item()
    assert last < first - 0.01, (first, last)
