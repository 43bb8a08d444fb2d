"""How scripts/test spreads the files over its two pytest-xdist workers (`--dist loadfile`, with a scheduler of
our own: conftest's pytest_xdist_make_scheduler).

Each file is one unit, so a file's module fixtures (its daemon, its checkpoint) live in one worker, as loadfile
does. The files whose daemons run several scheduler processes at once (prefill/decode pairs, rollouts, autoscaling,
tensor-parallel ranks) are one unit together: they run one after another on one worker, so two of them never split
the machine's two cores between four schedulers, while the other worker takes the lighter files. (xdist's own
`--dist loadgroup` would say this with marks, but it stopped grouping on pytest 9.2: pytest-xdist#1386.)
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
MANY_PROCESS_UNIT = "many-processes"


def unit_of(nodeid: str) -> str:
    """The unit a test is scheduled in: its file's path, or the one unit of the many-process files."""
    path = nodeid.split("::", 1)[0]
    return MANY_PROCESS_UNIT if path.rsplit("/", 1)[-1] in MANY_PROCESS_FILES else path


def file_units_scheduler(config, log):
    """xdist's loadfile scheduling, its units from unit_of."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return FileUnits(config, log)
