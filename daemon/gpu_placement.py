"""Where each scheduler runs: one GPU (or one group of GPUs) each, named to it through CUDA_VISIBLE_DEVICES.

A scheduler process sees only its own group's GPUs, so its engine always names the first as "cuda:0" and no two
schedulers can reach the same device by accident. `auto` means one scheduler per visible GPU, or one on the CPU
where there is none.

The daemon never imports torch (it must start fast and stay small), so it counts GPUs the way the system shows
them: CUDA_VISIBLE_DEVICES when it is set (an operator's or a container runtime's choice, honoured: "cuda:1" is
its second entry, as torch would number it), else the NVIDIA kernel driver's /proc/driver/nvidia/gpus/ entries,
one per GPU whenever the driver is loaded. That is a directory listing; `nvidia-smi -L` would start NVML in a
subprocess, which costs a second and can hang on a wedged GPU.

A CPU group may name its cores, `cpu@2` or `cpu@0-3` (vLLM's CPU backend binds its OpenMP threads the same way):
the scheduler is bound to them and runs one torch thread per core, so two schedulers never fight over a core,
the way two GPU groups never share a device.

A group may end in its role: `cuda:0=prefill`, `cpu@1=decode` (disaggregated serving); without one it is
`mixed`, running both parts of every request.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.lanes import Role

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_CUDA = re.compile(r"cuda(?::(\d+))?")
_PINNED_CPU = re.compile(r"cpu@(\d+)(?:-(\d+))?")


@dataclass(frozen=True, slots=True)
class Placement:
    """One scheduler: which model, on which devices, and what its process is told."""

    model_index: int
    model_name: str
    key: str  # the option that asked for it: "device" or "models[i].groups"
    label: str  # the devices as configured, e.g. "cuda:1" or "cuda:0,cuda:1"
    engine_device: str  # as the scheduler's engine names it: "cuda:0" (under its CUDA_VISIBLE_DEVICES), "cpu"
    cuda_visible_devices: str | None  # for its environment; None leaves the daemon's (CPU schedulers)
    cpu_cores: tuple[int, ...] = ()  # a pinned CPU group's cores ("cpu@0-1"); empty: wherever the daemon may run
    role: Role = Role.MIXED


@dataclass(frozen=True, slots=True)
class ModelShare:
    """What one model's schedulers take of a GPU they share: a fraction of its memory, or a fixed KV budget."""

    gpu_memory_utilization: float
    kv_cache_bytes: int | None


def visible_gpus(environ: Mapping[str, str] = os.environ, proc_gpus: Path = PROC_GPUS) -> list[str] | None:
    """The GPUs this process may use, each as the CUDA_VISIBLE_DEVICES entry that names it to a child; None when
    nothing says (no CUDA_VISIBLE_DEVICES and no NVIDIA driver loaded)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        entries = []
        for entry in value.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry ("-1" hides them all)
                break
            entries.append(entry)
        return entries
    try:
        count = sum(1 for entry in proc_gpus.iterdir() if entry.is_dir())
    except OSError:
        return None
    return [str(index) for index in range(count)]


def place(
    models: Sequence[tuple[str, list[str]]],
    devices: list[str],
    shares: Sequence[ModelShare],
    visible: list[str] | None,
) -> list[Placement]:
    """One Placement per scheduler: each model (name, groups) on each of its groups, or on `devices` when it names
    none. ValueError names the key of a device that does not exist, or of a GPU shared without shares."""
    placements = []
    for index, (name, groups) in enumerate(models):
        key = f"models[{index}].groups" if groups else "device"
        for group in groups or devices:
            placements.extend(_place_group(index, name, key, group, visible))
    _check_shared_gpus(placements, shares)
    return placements


def _place_group(index: int, name: str, key: str, group: str, visible: list[str] | None) -> list[Placement]:
    group, _, text = group.partition("=")
    text = text.strip() or Role.MIXED
    if text not in set(Role):
        raise ValueError(f"{key}: the role after '=' must be one of {', '.join(Role)}, got {text!r}")
    role = Role(text)
    return [dataclasses.replace(placement, role=role) for placement in _place_devices(index, name, key, group.strip(),
                                                                                      visible)]  # fmt: skip


def _place_devices(index: int, name: str, key: str, group: str, visible: list[str] | None) -> list[Placement]:
    if group == "auto":
        if not visible:
            return [Placement(index, name, key, "cpu", "cpu", None)]
        return [Placement(index, name, key, f"cuda:{i}", "cuda:0", gpu) for i, gpu in enumerate(visible)]
    pinned = _PINNED_CPU.fullmatch(group)
    if pinned:
        return [Placement(index, name, key, group, "cpu", None, _pinned_cores(key, group, pinned))]
    parts = [part.strip() for part in group.split(",")]
    matches = [_CUDA.fullmatch(part) for part in parts]
    if not any(matches):
        if len(parts) > 1:
            raise ValueError(f"{key}: a group of several devices must be CUDA devices (cuda:0,cuda:1), got {group!r}")
        return [Placement(index, name, key, group, group, None)]  # cpu, or a device torch resolves in the engine
    if not all(matches):
        raise ValueError(f"{key}: a group must be all CUDA devices or one other device, got {group!r}")
    indices = [int(match.group(1) or 0) for match in matches]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{key}: a group names each device once, got {group!r}")
    if visible is not None:
        missing = [i for i in indices if i >= len(visible)]
        if missing:
            raise ValueError(
                f"{key}: cuda:{missing[0]} does not exist: {len(visible)} GPU(s) are visible to tokend "
                "(its CUDA_VISIBLE_DEVICES, else the NVIDIA driver's count)"
            )
    # Where nothing says which GPUs exist (no driver here) the indices go as given: the scheduler names what fails.
    # A group of several is visible whole to its scheduler, whose engine (no tensor parallelism yet) uses the first.
    gpus = [visible[i] if visible is not None else str(i) for i in indices]
    label = ",".join(f"cuda:{i}" for i in indices)
    return [Placement(index, name, key, label, "cuda:0", ",".join(gpus))]


def _pinned_cores(key: str, group: str, match: re.Match) -> tuple[int, ...]:
    """The cores of `cpu@N` or `cpu@N-M`, each one this process may run on. ValueError names the key."""
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        raise ValueError(f"{key}: {group!r} names its cores low to high (cpu@{last}-{first})")
    cores = tuple(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    outside = [core for core in cores if core not in allowed]
    if outside:
        raise ValueError(
            f"{key}: {group!r} names core {outside[0]}, which tokend may not run on (its cores: "
            f"{_cpulist(sorted(allowed))})"
        )
    return cores


def _cpulist(cores: list[int]) -> str:
    """Cores the way Linux lists them: 0-3,6."""
    ranges: list[list[int]] = []
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _check_shared_gpus(placements: list[Placement], shares: Sequence[ModelShare]) -> None:
    """Two schedulers on one GPU would each size their KV cache from the same memory: refused unless each was
    given its share (fractions summing to <= 1, or a fixed kv_cache_bytes each)."""
    on_gpu: dict[str, list[Placement]] = {}
    for placement in placements:
        for gpu in (placement.cuda_visible_devices or "").split(","):
            if gpu:
                on_gpu.setdefault(gpu, []).append(placement)
    for gpu, sharing in on_gpu.items():
        if len(sharing) < 2:
            continue
        taken = [shares[p.model_index] for p in sharing]
        if all(share.kv_cache_bytes is not None for share in taken):
            continue
        total = sum(share.gpu_memory_utilization for share in taken)
        if total <= 1.0 + 1e-9:
            continue
        names = ", ".join(f"{p.model_name} on {p.label} ({p.key})" for p in sharing)
        fractions = " + ".join(f"{share.gpu_memory_utilization:g}" for share in taken)
        raise ValueError(
            f"{sharing[-1].key}: GPU {gpu} would run {len(sharing)} schedulers: {names}; their "
            f"gpu_memory_utilization adds up to {fractions} = {total:g} of its memory. Give each its share: "
            "gpu_memory_utilization (per model in [[models]], or for all) summing to <= 1, or kv_cache_bytes for each"
        )
