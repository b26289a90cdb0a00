"""Stage 4: the planner's parts."""
