"""Stage 6: verify and profiler: real engines against the planner's figures."""
