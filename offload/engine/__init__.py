"""Stage 5: the Engine (engine.py), a composition of residency, gradients, timeline and
surgery, and the helpers that hook it into the user's model (hooks, reads, early, gradspill,
actoffload). Nothing here imports engine.py: each gets the objects it uses."""
