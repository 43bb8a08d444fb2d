"""How scripts/test spreads the files over its two pytest-xdist workers (`--dist loadgroup`).

Each file is one group, so a file's module fixtures (its daemon, its checkpoint) live in one worker, as with
`--dist loadfile`. The files whose daemons run several scheduler processes at once (prefill/decode pairs, rollouts,
autoscaling, tensor-parallel ranks) share one group instead: they run one after another on one worker, so two of
them never split the machine's two cores between four schedulers, while the other worker takes the lighter files.
"""

from __future__ import annotations

MANY_PROCESS_FILES = frozenset(
    [
        "test_autoscale.py",
        "test_disaggregated.py",
        "test_handover_failures.py",
        "test_rollout.py",
        "test_serve_lifecycle.py",
        "test_structured_lanes.py",
        "test_tensor_parallel_daemon.py",
        "test_tensor_parallel_model.py",
    ]
)
MANY_PROCESS_GROUP = "many-processes"


def worker_group(file_name: str) -> str:
    """The xdist group of a test file (its path under tests/)."""
    return MANY_PROCESS_GROUP if file_name.rsplit("/", 1)[-1] in MANY_PROCESS_FILES else file_name
