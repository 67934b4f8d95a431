"""CLI names -> optimizer classes; every class has cost() -> OptimizerCost."""
from __future__ import annotations

from .adamw import SGD, AdamW
from .adamw8bit import AdamW8bit
from .apollo import ApolloAdamW, ApolloMini
from .galore import GaLoreAdamW, GaLoreAdamW8bit
from .mezo import MeZO

OPTIMIZERS: dict[str, type] = {
    "adamw": AdamW,
    "adamw8bit": AdamW8bit,
    "galore": GaLoreAdamW,
    "galore8bit": GaLoreAdamW8bit,
    "apollo": ApolloAdamW,
    "apollo-mini": ApolloMini,
    "mezo": MeZO,
    "sgd": SGD,
}


def get_optimizer(name: str) -> type:
    """The class registered under `name`; a clear error listing the choices otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}") from None
