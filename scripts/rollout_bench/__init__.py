"""The parts of scripts/bench_rollout.py: the two checkpoints, the traffic, the summary and plot."""
