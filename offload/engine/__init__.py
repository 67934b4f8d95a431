"""Stage 5: the Engine (engine.py), a composition of residency, gradients, timeline and
surgery, and the helpers that hook it into the user's model (hooks, reads, early, gradspill,
actoffload). No module here imports engine.py but the package's face."""
