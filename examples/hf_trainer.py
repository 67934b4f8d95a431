"""Use a tierwise optimizer with the Hugging Face Trainer (no engine, no offload).

Every tierwise optimizer that steps on gradients (AdamW8bit, GaLore, APOLLO) is a drop-in
torch.optim.Optimizer, so `Trainer(optimizers=(opt, sched))` takes it as is (MeZO steps on a
closure of two forward passes, which the Trainer does not give it). This script builds a tiny Llama and a tiny dataset locally (nothing is
downloaded) and trains a few steps on the CPU in seconds:

    python examples/hf_trainer.py
"""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments, get_cosine_schedule_with_warmup

from tierwise.cli.builtin import build_tokenizer, sample_lines, tiny_llama_config

try:
    from tierwise.optim import AdamW8bit as Optimizer  # 8-bit moments: a quarter of AdamW's state
except ImportError:  # an older tierwise: plain AdamW works the same way
    from torch.optim import AdamW as Optimizer

STEPS = 8
SEQ_LEN = 32


class TinyTextDataset(torch.utils.data.Dataset):
    """Built-in sample sentences packed into SEQ_LEN-token blocks (labels = input ids)."""

    def __init__(self, tokenizer):
        ids = [t for line in sample_lines() for t in
               tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]]
        self.blocks = [ids[i:i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN + 1, SEQ_LEN)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.blocks[i])  # [T]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def main() -> None:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(tokenizer=tokenizer))
    optimizer = Optimizer(model.parameters(), lr=3e-3, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=STEPS)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4,
                                 logging_steps=2, report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=TinyTextDataset(tokenizer),
                          optimizers=(optimizer, scheduler))
        result = trainer.train()
    print(f"{type(optimizer).__name__}: {STEPS} steps, final train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
