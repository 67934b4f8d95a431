"""Stage 2: the optimizer table (`table`: every optimizer fact the CLI, planner and engine share;
no torch) and optimizer math on chunk storage (AdamW/SGD/8-bit/low-rank updaters, MeZO)."""
