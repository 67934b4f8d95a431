"""Built-in tiny assets for the no-model default: a sample corpus, a tokenizer, a Llama config.

Nothing here is downloaded: the corpus is generated from a seeded grammar, the tokenizer is a
byte-level BPE trained on that corpus with the `tokenizers` library (milliseconds), and the
model is a small `LlamaConfig`. Tests build their checkpoints from the same pieces.
"""

from __future__ import annotations

import functools
import random

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]

#: A role-tagged chat template (Jinja, as Hugging Face tokenizers use). Each turn is
#: "<|role|>\ncontent</s>\n"; the rendering of a conversation's prefix is always a string prefix
#: of the full rendering, which is what lets cli.data find the assistant spans exactly.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SUBJECTS = ["the cat", "a small dog", "the old engine", "my neighbour", "the river",
             "a red bird", "the teacher", "every chunk", "the tiny model", "a quiet city"]
_VERBS = ["sees", "moves", "likes", "carries", "follows", "remembers", "builds", "reads",
          "streams", "finds"]
_OBJECTS = ["the moon", "a warm bread", "the green field", "many numbers", "the long road",
            "a paper boat", "the memory tier", "some old songs", "the fast disk", "a cold wind"]
_ENDINGS = ["today", "at night", "in the morning", "every day", "once again", "with care",
            "without a sound", "before the rain", "after lunch", "for a while"]


@functools.lru_cache(maxsize=4)
def sample_lines(n: int = 400, *, seed: int = 1234) -> tuple[str, ...]:
    """`n` short English-like sentences from a fixed grammar; same seed, same lines."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_ENDINGS))
        lines.append(" ".join(words).capitalize() + ".")
    return tuple(lines)


def sample_rows(n: int = 400) -> list[dict]:
    """The built-in sample dataset as `{"text": ...}` rows."""
    return [{"text": line} for line in sample_lines(n)]


def build_tokenizer(*, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the sample corpus, as a PreTrainedTokenizerFast.

    It has bos/eos/pad/unk tokens, prepends <s> when `add_special_tokens=True`, and carries
    CHAT_TEMPLATE. `vocab_size` must be at least 256 + len(SPECIAL_TOKENS).
    """
    from transformers import PreTrainedTokenizerFast

    tok = _bpe(vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, model_max_length=4096,
    )


def _bpe(vocab_size: int):
    """The trained `tokenizers.Tokenizer` behind build_tokenizer (no transformers, no torch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample_lines(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


@functools.lru_cache(maxsize=2)
def builtin_vocab_size(vocab_size: int = 384) -> int:
    """len(build_tokenizer(vocab_size=...)), without transformers: what a model profile's
    vocabulary grows to (cli.loading)."""
    return _bpe(vocab_size).get_vocab_size()


def tiny_llama_config(*, vocab_size: int = 384, hidden: int = 64, layers: int = 2,
                      tie: bool = False, tokenizer=None):
    """A LlamaConfig small enough to train in seconds on a CPU."""
    from transformers import LlamaConfig

    extra = {}
    if tokenizer is not None:
        extra = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=tie, **extra,
    )
