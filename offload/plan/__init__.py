"""Stage 3: where each chunk lives and when it moves: placement, homes, the performance
model, the planner and the schedule. No torch at import (`finetune plan` runs without it)."""
