"""Stage 2: optimizer math on chunk storage (AdamW/SGD/8-bit/low-rank updaters, MeZO)."""
