"""The pieces of scripts/bench_roofline.py: machine limits, model shapes, step timings, the plot."""
