"""Configuration checks beyond one field's value: TP beside P/D roles, the rollout roots, who may read the files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from common.lanes import Role
from daemon.gpu_placement import Placement
from gpu_runtime.default_model import cache_dir


def check_no_roles_under_tp(placement: Placement, tensor_parallel_size: int) -> None:
    """A prefill or decode group under tensor parallelism is refused until each rank hands over its own KV shard:
    today only rank 0's pages move, so the decode ranks >= 1 would attend over whatever their pages held before,
    possibly another tenant's."""
    if tensor_parallel_size == 1 or placement.role is Role.MIXED:
        return
    raise ValueError(
        f"tensor_parallel_size: {tensor_parallel_size} ranks cannot serve a {placement.role} group yet ({placement.key}"
        f" gives {placement.model_name or 'a spare'} {placement.label}={placement.role}): a handover moves only rank "
        f"0's KV shard; set tensor_parallel_size = 1, or drop the =prefill/=decode roles from {placement.key}"
    )


def rollout_roots(configured: tuple[str, ...], model_paths: list[str | None]) -> list[str]:
    """The directories a rollout's weights must lie in, symlinks resolved: `model_roots` as given, else those
    holding the configured models (a new checkpoint beside the old one) and the model cache (the built-ins)."""
    if configured:
        return [os.path.realpath(root) for root in configured]
    roots = [os.path.realpath(cache_dir())]
    for path in model_paths:
        if path is not None and (os.path.isabs(path) or os.path.exists(path)):
            roots.append(os.path.dirname(os.path.realpath(path)))
    return list(dict.fromkeys(roots))


def is_within(path: str, roots: list[str]) -> bool:
    """Whether the resolved `path` is one of `roots` or below one (by whole path components)."""
    return any(os.path.commonpath([path, root]) == root for root in roots)


def readable_by_others(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(key, path, mode) of each file that its group or everyone may read: keys and their hashes are the
    service user's alone. A file that cannot be stat'ed is left to the reader, which names it."""
    found = []
    for key, path in files.items():
        if not path:
            continue
        try:
            mode = Path(path).stat().st_mode
        except OSError:
            continue
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            found.append((key, str(path), oct(stat.S_IMODE(mode))))
    return found
