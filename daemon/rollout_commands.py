"""An operator's rollout command (Admin.Rollout, `tokend rollout`), checked and handed to the worker pool."""

from __future__ import annotations

import os

from common.lanes import Pool, RolloutStrategy
from daemon.config_checks import is_within
from daemon.reconcile import PoolTarget
from daemon.worker_pool import WorkerPool
from frontend.control_messages import CommandResult, RolloutCommand
from gpu_runtime.default_model import BUILT_IN_MODELS, MODEL_REFERENCE, is_model_reference


def handle_rollout(pool: WorkerPool, command: RolloutCommand) -> CommandResult:
    """Starts the rollout (or rollback) the command asks for, or says which field is wrong."""
    rollout = pool.rollouts.get(command.model_name)
    if rollout is None:
        return _refused(command, "NOT_FOUND", f"model: {command.model_name!r} is not served here; "
                        f"served: {sorted(pool.rollouts)}")  # fmt: skip
    if not 0 <= command.canary_percent <= 100:
        message = f"canary_percent: must be in [0, 100], got {command.canary_percent}"
        return _refused(command, "INVALID_ARGUMENT", message)
    try:
        strategy = _strategy(pool, command)
    except ValueError as error:
        return _refused(command, "INVALID_ARGUMENT", str(error))
    if command.rollback:
        if not rollout.history:
            return _refused(command, "FAILED_PRECONDITION", f"rollback: model {command.model_name!r} has no "
                            "earlier weights to go back to")  # fmt: skip
        pool.roll_back(command.model_name, strategy)
        return CommandResult(command.command_id, rollout=pool.status(command.model_name))
    path, refusal = _checked_path(pool, command)
    if refusal is not None:
        return refusal
    new_weights = pool.is_new_weights(command.model_name, path)
    if rollout.phase.in_progress and new_weights:
        return _refused(command, "FAILED_PRECONDITION", f"model: a rollout of {command.model_name!r} to "
                        f"{rollout.path} is in progress ({rollout.phase}); wait for it, or roll it back")  # fmt: skip
    no_spare = not pool.spare_slots(command.model_name, strategy, Pool.ROUTED)
    if new_weights and strategy == RolloutStrategy.SURGE and no_spare:
        return _refused(command, "FAILED_PRECONDITION", "strategy: surge needs a free group to start new workers "
                        "on (spare_devices; beside prefill workers, one not for prefill); use in-place")  # fmt: skip
    canary_error = _canary_error(pool, command, strategy, pool.targets[command.model_name][Pool.ROUTED].serving)
    if canary_error:
        return _refused(command, "FAILED_PRECONDITION", canary_error)
    pool.begin_rollout(command.model_name, path, strategy, command.canary_percent)
    return CommandResult(command.command_id, rollout=pool.status(command.model_name))


def _checked_path(pool: WorkerPool, command: RolloutCommand) -> tuple[str, CommandResult | None]:
    """The weights' path resolved once (symlinks too), so that what is checked is what loads and what is reported;
    or the refusal. A built-in model's name passes as it is; a path must be absolute (a relative one would be the
    daemon's working directory's, not the caller's) and lie in model_roots."""
    path = command.path
    if path in BUILT_IN_MODELS:
        return path, None
    if not os.path.isabs(path):
        return path, _refused(command, "INVALID_ARGUMENT", f"path: must be absolute (or a built-in model: "
                              f"{', '.join(BUILT_IN_MODELS)}), got {path!r}")  # fmt: skip
    resolved = os.path.realpath(path)
    roots = pool.config.rollout_roots()
    if not is_within(resolved, roots):
        shown = f"{path!r} (resolved: {resolved})" if resolved != path else repr(path)
        return path, _refused(command, "FAILED_PRECONDITION", f"model_roots: {shown} is outside the directories "
                              f"rollouts may load from, {roots}; add its directory to model_roots")  # fmt: skip
    if not is_model_reference(resolved):
        return path, _refused(command, "INVALID_ARGUMENT", f"path: expected {MODEL_REFERENCE}, got {resolved!r}")
    return resolved, None


def _canary_error(pool: WorkerPool, command: RolloutCommand, strategy: RolloutStrategy, count: int) -> str:
    """Why a canary cannot hold here: it needs old workers left serving beside its new ones (in place: a model
    on at least two groups), and a surge canary needs a free group for each of its new workers. `count` is the
    routed pool's workers (beside prefill workers, those are what a canary's share is of)."""
    target = PoolTarget(0, count, strategy=strategy, canary_percent=command.canary_percent)
    if not target.is_canary:
        return ""
    if strategy == RolloutStrategy.IN_PLACE and target.count_wanted >= count:
        return (f"canary_percent: an in-place canary of {command.canary_percent}% would replace all {count} "
                "group(s) of the model; use a smaller share, more groups, or a surge with spare_devices")  # fmt: skip
    free = len(pool.spare_slots(command.model_name, strategy, Pool.ROUTED))
    if strategy == RolloutStrategy.SURGE and target.count_wanted > free:
        return (f"canary_percent: {command.canary_percent}% of {count} worker(s) is {target.count_wanted} new "
                f"worker(s), but {free} group(s) are free for a surge (spare_devices)")  # fmt: skip
    return ""


def _strategy(pool: WorkerPool, command: RolloutCommand) -> RolloutStrategy:
    """As asked; unset: surge where a free group of the routed pool allows it, else in-place."""
    if command.strategy:
        try:
            return RolloutStrategy(command.strategy)
        except ValueError:
            raise ValueError(f"strategy: must be surge|in-place, got {command.strategy!r}") from None
    if pool.spare_slots(command.model_name, RolloutStrategy.SURGE, Pool.ROUTED):
        return RolloutStrategy.SURGE
    return RolloutStrategy.IN_PLACE


def _refused(command: RolloutCommand, code: str, error: str) -> CommandResult:
    return CommandResult(command.command_id, error=error, code=code)
