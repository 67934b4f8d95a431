"""Memory-lean optimizers: drop-in torch.optim classes whose step math is a pure function."""
from .adamw import SGD, AdamW, adamw_step_, init_adamw_state
from .adamw8bit import Adam8bit, AdamW8bit, adamw8bit_step_, eight_bit_groups, init_adamw8bit_state
from .apollo import ApolloAdamW, ApolloMini, apollo_step_, init_apollo_state
from .costs import OptimizerCost
from .galore import GaLoreAdamW, GaLoreAdamW8bit, galore_step_, init_galore_state
from .mezo import MeZO, mezo_update_, perturb_
from .registry import OPTIMIZERS, get_optimizer

__all__ = [
    "OPTIMIZERS", "Adam8bit", "AdamW", "AdamW8bit", "ApolloAdamW", "ApolloMini", "GaLoreAdamW",
    "GaLoreAdamW8bit", "MeZO", "OptimizerCost", "SGD", "adamw8bit_step_", "adamw_step_", "eight_bit_groups",
    "apollo_step_", "galore_step_", "get_optimizer", "init_adamw8bit_state", "init_adamw_state",
    "init_apollo_state", "init_galore_state", "mezo_update_", "perturb_",
]
