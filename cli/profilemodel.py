"""`--model` as a model profile, torch-free: what `finetune plan --model 7b` needs without
torch or transformers. The model training builds from a profile (cli.loading) is the profile's
architecture with the vocabulary grown to the built-in tokenizer's; its parameters, in the
engine's order, are the profile's `param_specs()` at that vocabulary
(tests/test_cli_config.py checks them against the built module for every shipped profile)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..offload.core.chunks import ParamSpec
from ..profiles import ModelProfile, load_model_profile


def is_profile(spec: str | None) -> bool:
    """Whether `--model spec` names a model profile (a name or a .toml file), not a model
    directory (cli.loading.resolve_model decides by this too); None is the built-in model."""
    if spec is None:
        return False
    path = Path(spec).expanduser()
    if path.is_dir():
        return False
    if path.suffix == ".toml":
        return True
    return not (path.exists() or "/" in spec or spec.startswith("."))


def run_profile(name: str) -> ModelProfile:
    """The profile as training builds it: the vocabulary at least the built-in tokenizer's."""
    from .builtin import builtin_vocab_size

    profile = load_model_profile(name)
    vocab = max(profile.vocab_size, builtin_vocab_size())
    return profile if vocab == profile.vocab_size else dataclasses.replace(profile, vocab_size=vocab)


def profile_params(name: str) -> list[ParamSpec]:
    """The parameters the engine chunks for a run of profile `name`."""
    return run_profile(name).param_specs()
