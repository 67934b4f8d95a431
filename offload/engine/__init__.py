"""Stage 5: the Engine (engine.py) and the helpers that hook it into the user's model."""
