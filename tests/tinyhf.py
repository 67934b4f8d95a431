"""Build tiny, real Hugging Face model directories for tests (no downloads, well under 2 s).

    path = make_tiny_llama_dir(tmp_path / "m", layers=2, shard=True)
    AutoModelForCausalLM.from_pretrained(path)  # works: config.json, safetensors, tokenizer
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tierwise.cli.builtin import build_tokenizer, tiny_llama_config
from tierwise.offload.core.options import Optim


def make_tiny_llama_dir(path, *, vocab_size: int = 384, hidden: int = 64, layers: int = 2,
                        tie: bool = False, seed: int = 0, shard: bool = False,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (or 2+ shards + index when `shard`), tokenizer
    files and generation_config.json of a seeded random LlamaForCausalLM into `path`."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    config = tiny_llama_config(vocab_size=vocab_size, hidden=hidden, layers=layers, tie=tie,
                               tokenizer=tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # A shard size below the model's size forces a multi-file checkpoint with an index.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = max(total // 3, 1 << 12) if shard else "5GB"
    model.save_pretrained(path, max_shard_size=max_shard, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if shard:
        assert (path / "model.safetensors.index.json").exists(), "expected a sharded save"
    return path


def write_jsonl(path, rows) -> Path:
    """Write `rows` (dicts, or raw strings written verbatim) one per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


class _Ledger:
    def __init__(self, model):
        self._bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def peaks(self) -> dict:
        return {"gpu": self._bytes, "host": 3 * self._bytes}

    def usage(self) -> dict:
        return {"gpu": {"params": self._bytes}, "host": {"master": self._bytes,
                                                         "optim": 2 * self._bytes}}


def error_line(result) -> str:
    """The single stderr line of a user error from a CliRunner result (exit 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def fast_profiler(monkeypatch) -> list:
    """`finetune profile` with every measurement but the NVMe probe stubbed (the real one runs
    at its quick size); returns the list of paths the NVMe probe was given."""
    import tierwise.offload.tools.profiler as profiler

    seen: list = []
    real = profiler.nvme_bandwidth
    monkeypatch.setattr(profiler, "FULL", profiler.QUICK)
    monkeypatch.setattr(profiler, "nvme_bandwidth", lambda sz, path: seen.append(path) or real(sz, path))
    for name, value in (("copy_bandwidths", {"h2d_pinned": 9.0}), ("dram_bandwidth", 12.0),
                        ("optimizer_rates", {"adamw": 1e8}), ("gemm_tflops", 0.5),
                        ("op_overhead_us", 20.0), ("cxl_bandwidths", {})):
        monkeypatch.setattr(profiler, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(profiler, "to_toml", lambda r, **k: "name = 'x'\n\n[nvme]\n")
    factors = ("step_calibration", "step_calibration_bf16", "dispatch_calibration", "dispatch_calibration_bf16")
    monkeypatch.setattr(profiler, "calibrations", lambda text, quick: dict.fromkeys(factors, 1.0))
    return seen


def tiny_run_assets(root: Path) -> tuple[Path, Path]:
    """A tiny Llama checkpoint and a 48-row JSONL under `root`: (model dir, data file)."""
    rows = [{"text": f"The tiny model streams chunk {i % 7} through the memory tier."} for i in range(48)]
    return make_tiny_llama_dir(root / "tiny"), write_jsonl(root / "train.jsonl", rows)


def train_as_the_cli(model, cfg, tokenizer) -> list[float]:
    """`cfg`'s run in plain PyTorch: the CLI's batches, attention (packed rows per segment:
    cli.packing.use_segments, installed on `model`) and LR schedule, fused AdamW over the
    trainable parameters of `model` (trained in place); returns the step losses."""
    from tierwise.cli.data import Batches, isolates, load_blocks
    from tierwise.cli.packing import use_segments
    from tierwise.cli.schedule import LRSchedule

    use_segments(model.get_base_model() if hasattr(model, "get_base_model") else model)  # (PEFT's: its base)

    batches = Batches(load_blocks(cfg.data, tokenizer, seq_len=cfg.seq_len, pack=cfg.pack,
                                  isolate=isolates(model.config, pack=cfg.pack)),
                      batch_size=cfg.batch_size, seed=cfg.seed)
    schedule = LRSchedule(kind=cfg.schedule, base_lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                          total_steps=cfg.steps)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, fused=True)
    losses = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss = model(**batches.next()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def logits_engine(seen: dict):
    """The real Engine class, whose loss_fn also keeps the last batch's logits in seen["logits"]
    (monkeypatch cli.train.engine_class to return it: an eval batch's logits after a CLI run)."""
    from tierwise.offload import Engine

    class LogitsEngine(Engine):
        def __init__(self, model, **kwargs):
            def loss_fn(m, batch):
                out = m(**batch)
                seen["logits"] = out.logits.detach().to("cpu", copy=True)
                return out.loss
            super().__init__(model, loss_fn=loss_fn, **kwargs)

    return LogitsEngine


def _materialize_meta_params(model) -> None:
    """Give every meta parameter CPU storage (tied parameters stay tied); buffers untouched."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                     requires_grad=p.requires_grad)
                setattr(module, name, made[id(p)])


class StandInEngine:
    """Tests only: the offload.Engine API over a plain model and torch AdamW (no offload).

    `step` splits the batch into `grad_accum` micro-batches along dim 0, weighs each by its
    share of the step's target tokens (as the Engine), clips and updates once.
    """

    def __init__(self, model, *, optim=Optim(lr=1e-4), **_ignored):
        _materialize_meta_params(model)
        self.model, self.grad_clip = model, optim.grad_clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                     weight_decay=optim.weight_decay)
        self.ledger = _Ledger(model)
        self.timeline: list[dict] = []
        self.phase_times: dict = {}
        self.device_plan = None  # nothing placed: measure() has nothing to adjust
        self.skip_nonfinite, self.skipped_last, self.last_grad_norm, self.nvme = False, False, None, None
        self.closed = False
        self.steps = 0

    def load_weights(self, named) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                if name in params:
                    params[name].copy_(t)

    def init_weights_(self, *, seed: int = 0, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.fill_(1.0 if "norm" in name else 0.0)

    def measure(self, batch: dict) -> None:
        pass

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self, batch: dict, grad_accum: int = 1) -> float:
        self.model.train()
        total = 0.0
        micro = [{k: v.chunk(grad_accum)[i] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                 for i in range(grad_accum)]
        counts = [int((m["labels"][..., 1:] != -100).sum()) for m in micro]
        for m, n in zip(micro, counts):
            out = self.model(**m)
            (out.loss * (n / sum(counts))).backward()
            total += float(out.loss.detach()) * (n / sum(counts))
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        gpu = self.ledger.peaks()["gpu"]
        self.timeline = [{"moment": i, "phase": ph, "bytes": {"gpu": gpu * (1 + i % 3),
                                                              "host": gpu * 3}}
                         for i, ph in enumerate(["forward"] * 4 + ["backward"] * 4 + ["update"] * 2)]
        return total

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> float:
        self.model.eval()
        return float(self.model(**batch).loss)

    def state_dict(self, *, deferred: bool = False) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "step": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.steps = sd["step"]

    def named_parameters_fp32(self):
        for name, p in self.model.named_parameters():
            yield name, p.detach().float()

    def close(self) -> None:
        self.closed = True


#: Tiny configs of each causal-LM family the CLI is tested on: hidden 32, 2 layers, 4 heads,
#: no dropout (training runs are compared with plain PyTorch step for step).
FAMILIES = {
    "llama": ("LlamaConfig", dict(intermediate_size=64, num_key_value_heads=2,
                                  tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(intermediate_size=64, num_key_value_heads=2,
                                       tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt-neox": ("GPTNeoXConfig", dict(intermediate_size=64, max_position_embeddings=64,
                                       hidden_dropout=0.0, attention_dropout=0.0)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=64, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=64, num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(intermediate_size=64, num_key_value_heads=2)),
    "phi3": ("Phi3Config", dict(intermediate_size=64, num_key_value_heads=2, resid_pdrop=0.0,
                                embd_pdrop=0.0, attention_dropout=0.0)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
    "gemma": ("GemmaConfig", dict(intermediate_size=64, num_key_value_heads=1, head_dim=8)),  # (one key/value head)
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                        sliding_window_pattern=2)),  # (a local layer, then a global one)
    # Gemma-3 4B and up: the text model of "gemma3" inside Gemma3ForConditionalGeneration, beside a
    # SigLIP vision tower and its projector that text-only training never runs
    "gemma3-vl": ("Gemma3Config", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                       sliding_window_pattern=2)),
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64,
                              dropout=0.0, attention_dropout=0.0)),
    "falcon": ("FalconConfig", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(intermediate_size=64, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, num_key_value_heads=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4,
                                      num_experts_per_tok=2, num_key_value_heads=2)),
}


def family_config(family: str, *, vocab_size: int = 288, tokenizer=None):
    """The tiny transformers config of `family` (a FAMILIES key)."""
    import transformers

    cls, extra = FAMILIES[family]
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4)
    if cls == "GPT2Config":
        common = dict(vocab_size=vocab_size)
    if tokenizer is not None:
        common.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    if cls == "Gemma3Config":  # (the image tokens: the vocabulary's last three ids)
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14, vision_use_head=False)  # (as the checkpoints)
        return transformers.Gemma3Config(text_config={**common, **extra}, vision_config=vision, mm_tokens_per_image=4,
                                         boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                                         image_token_index=vocab_size - 1)
    return getattr(transformers, cls)(**common, **extra)


def make_tiny_family_dir(path, family: str, *, vocab_size: int = 288, seed: int = 0,
                         **save) -> Path:
    """A seeded random model of `family` saved by save_pretrained (fp32; `save` goes to it, e.g.
    save_original_format=False), with the built-in tokenizer."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab_size=vocab_size,
                                                           tokenizer=tokenizer))
    model.save_pretrained(path, **save)
    tokenizer.save_pretrained(path)
    return path


def mean_eval_loss(model, batches) -> float:
    """Token-weighted mean loss of a plain model, exactly as cli.train.evaluate weighs the engine's."""
    total = weight = 0.0
    with torch.no_grad():
        for b in batches:
            n = float((b["labels"][:, 1:] != -100).sum())
            total += float(model(**b).loss) * n
            weight += n
    return total / weight


def activation_peak(profile, *, precision: str, checkpointing, lora=None, padded: bool = False,
                    rows: int = 2, seq: int = 20, windows: bool = False, offload: bool = False) -> int:
    """The engine's ledger peak of saved activations in one step of `profile`'s model (seeded
    random weights and tokens; `padded`: the first row's last 3 tokens are padding; `windows`:
    its attention offload.engine.segments', as finetune's; `offload`: recomputed layers' inputs
    in host memory): what the planner's activation_bytes must equal."""
    import transformers

    from tierwise.offload import Activations, Budget, Engine, Precision
    from tierwise.offload.engine.segments import use_segments

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(profile.to_hf_config())
    if windows:
        assert use_segments(model)
    eng = Engine(model, budget=Budget(chunk=16 << 10), precision=Precision(precision),
                 activations=Activations(recompute=checkpointing, offload=offload),
                 **({} if lora is None else {"lora": lora}))
    try:
        x = torch.randint(0, profile.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": x, "labels": x}
        if padded:
            batch["attention_mask"] = torch.ones_like(x)
            batch["attention_mask"][0, -3:] = 0
        eng.step(batch)
        return eng.ledger.kind_peak("gpu", "activation")
    finally:
        eng.close()
