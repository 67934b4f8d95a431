"""tierwise's heterogeneous memory manager, one sub-package per stage of a step, each
importing only those above it in this list (tests/test_structure.py holds the order):

    core     errors, byte sizes, parameter specs and chunk packing   (no torch)
    update   the optimizer table (no torch); optimizer math on chunk storage (updaters, MeZO)
    plan     needs, placement, homes, performance model, planner, schedule  (no torch)
    runtime  ledger, tiers, links, aligned/CXL/NVMe storage, executor, store, cache, trace
    engine   the Engine and the helpers that hook it into the model
    tools    verify and profiler (run engines and planner against each other)

This face is lazy (module `__getattr__`): `import tierwise.offload` and its torch-free stages
work without torch; `Engine` imports it on first use."""

import logging
from importlib import import_module


class _NoKernelHubNotice(logging.Filter):
    """bitsandbytes warns at import that an optional CPU kernel from the Hugging Face Hub could
    not be loaded (no network, or an unverified publisher): nothing a user can act on (its own
    CPU path runs), and it reads like an error of the run. Kept at debug level; here, so a
    user's own script that imports the engine gets it too, not only `finetune`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "kernels-community" in record.getMessage():
            logging.getLogger(__name__).debug("bitsandbytes: %s", record.getMessage())
            return False
        return True


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelHubNotice())

_EXPORTS = {
    "Engine": ".engine.engine",
    "Budget": ".core.options", "Optim": ".core.options", "Precision": ".core.options",
    "Activations": ".core.options", "Distributed": ".core.options", "Streaming": ".core.options",
    "flat_options": ".core.options",
    "BudgetExceeded": ".core.errors", "InfeasibleBudget": ".core.errors", "SizeError": ".core.errors",
    "TierwiseError": ".core.errors",
    "format_size": ".core.units", "parse_size": ".core.sizes",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
