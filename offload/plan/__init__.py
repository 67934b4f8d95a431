"""Stage 3: where each chunk lives and when it moves: the device needs (one formula for the
engine and the planner), placement, homes, the performance model, the planner and the
schedule. No torch (`finetune plan` runs without it)."""
