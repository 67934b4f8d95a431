"""Offload inside a Hugging Face Trainer script: one changed line (OffloadTrainer for Trainer).

The engine streams the model's weights, gradients and optimizer state through a small device
budget while the Trainer keeps its loop, schedule, logging, evaluation and checkpoints. This
script builds a tiny Llama and a tiny dataset locally (nothing is downloaded) and trains a few
steps on the CPU in seconds:

    python examples/offload_trainer.py

A TRL script does the same with `with_offload(SFTTrainer)(..., offload={...})`.
"""

from __future__ import annotations

import tempfile

import torch

from tierwise.offload.hf import OffloadTrainer  # (before transformers: bitsandbytes' import-time
# notice that an optional Hub kernel is unavailable offline is then kept at debug level)
from tierwise.cli.builtin import build_tokenizer, sample_lines, tiny_llama_config
from transformers import LlamaForCausalLM, TrainingArguments

SEQ_LEN = 32


class TinyTextDataset(torch.utils.data.Dataset):
    """Built-in sample sentences packed into SEQ_LEN-token blocks (labels = input ids)."""

    def __init__(self, tokenizer):
        ids = [t for line in sample_lines() for t in tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]]
        self.blocks = [ids[i:i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN + 1, SEQ_LEN)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.blocks[i])
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 learning_rate=1e-3, max_steps=8, warmup_steps=2, max_grad_norm=1.0,
                                 logging_steps=2, save_strategy="no", report_to=[], use_cpu=True)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=TinyTextDataset(tokenizer),
                                 offload={"gpu_mem": "2M", "chunk_bytes": "256K"})  # the engine's budgets
        trainer.train()
        peaks = trainer.engine.ledger.peaks()
        print(f"gpu peak {peaks['gpu'] / 2**20:.2f} MiB of a 2 MiB budget; host peak {peaks['host'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
