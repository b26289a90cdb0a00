"""Stages 2-3: what a step costs."""
