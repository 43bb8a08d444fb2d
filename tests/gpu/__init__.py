"""The GPU check (scripts/gpu_check.sh): its runner, its sections, and the checkpoints and engines they compare."""
