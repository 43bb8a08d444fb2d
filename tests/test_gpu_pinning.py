"""One GPU (or one group) per scheduler: each scheduler process sees only its own through CUDA_VISIBLE_DEVICES,
`auto` means one per visible GPU, a GPU shared without shares is refused, and a start on a device that cannot
run exits 78 naming the device and what was asked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from daemon_harness import ROOT, Daemon, free_port

from daemon.child_specs import scheduler_specs
from daemon.cli import build_parser
from daemon.config import ServeConfig, load_serve_config
from daemon.gpu_placement import visible_gpus
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from gpu_runtime.worker.engine_start import TEST_CUDA_AS_CPU
from tokend.v1 import tokend_pb2 as pb


def _load(tmp_path: Path, toml: str, environ: dict[str, str]) -> ServeConfig:
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(toml)
    return load_serve_config(build_parser().parse_args(["serve", "--config", str(config_file)]), environ)


def _placed(tmp_path: Path, toml: str, monkeypatch, visible: str) -> list[tuple[str, str, str | None]]:
    """(worker id, engine device, CUDA_VISIBLE_DEVICES) of each scheduler the daemon would start."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = _load(tmp_path, toml, {"CUDA_VISIBLE_DEVICES": visible})
    return [(s.worker_id, s.engine.device, s.cuda_visible_devices) for s in scheduler_specs(config, tmp_path)]


def test_auto_runs_one_scheduler_per_visible_gpu_each_seeing_only_its_own(tmp_path, monkeypatch):
    # The operator's (or the container runtime's) CUDA_VISIBLE_DEVICES is honoured: its entries are the GPUs.
    placed = _placed(tmp_path, 'device = "auto"\n', monkeypatch, "3,GPU-5c1e")
    model = placed[0][0].split("/")[0]
    assert placed == [(f"{model}/0", "cuda:0", "3"), (f"{model}/1", "cuda:0", "GPU-5c1e")]


def test_groups_name_gpus_as_torch_numbers_them_here(tmp_path, monkeypatch):
    toml = (
        '[[models]]\nname = "a"\ngroups = ["cuda:1", "cuda:0,cuda:2"]\n'
        '[[models]]\nname = "b"\ngroups = ["cuda:3"]\n\n[[models]]\nname = "c"\ngroups = ["cpu"]\n'
    )
    placed = _placed(tmp_path, toml, monkeypatch, "4,5,6,7")
    assert placed == [("a/0", "cuda:0", "5"), ("a/1", "cuda:0", "4,6"), ("b/0", "cuda:0", "7"), ("c/0", "cpu", None)]


def test_without_gpus_auto_is_one_cpu_scheduler(tmp_path, monkeypatch):
    assert _placed(tmp_path, 'device = "auto"\n', monkeypatch, "")[0][1:] == ("cpu", None)
    assert len(_placed(tmp_path, 'device = "auto"\n', monkeypatch, "")) == 1


def test_gpus_are_counted_from_the_driver_when_nothing_narrows_them(tmp_path):
    gpus = tmp_path / "gpus"
    for bus_id in ("0000:18:00.0", "0000:3b:00.0"):
        (gpus / bus_id).mkdir(parents=True)
    assert visible_gpus({}, gpus) == ["0", "1"]
    assert visible_gpus({}, tmp_path / "no-driver") is None  # unknown: an explicit cuda:N is tried as given
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 0,-1,3"}, gpus) == ["2", "0"]  # CUDA stops at "-1"


@pytest.mark.parametrize(
    ("toml", "visible", "expected"),
    [
        ('device = "cuda:2"\n', "0,1", "device: cuda:2 does not exist: 2 GPU(s)"),
        ('device = "cuda"\n', "", "device: cuda:0 does not exist: 0 GPU(s)"),
        ('[[models]]\nname = "a"\ngroups = ["cuda:0,cpu"]\n', "0", "models[0].groups: a group must be"),
    ],
)
def test_a_gpu_that_is_not_there_is_refused_naming_the_key(tmp_path, toml, visible, expected):
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        _load(tmp_path, toml, {"CUDA_VISIBLE_DEVICES": visible})


TWO_MODELS = '[[models]]\nname = "small"\n{small}\n[[models]]\nname = "big"\n{big}\n'


@pytest.mark.parametrize(
    ("top", "small", "big"),
    [
        ("", "", ""),  # both take the default 0.9
        ("", "gpu_memory_utilization = 0.5", "gpu_memory_utilization = 0.6"),
        ("", "kv_cache_bytes = 1073741824", ""),
    ],
)
def test_two_models_on_one_gpu_without_shares_are_refused_naming_both(tmp_path, top, small, big):
    with pytest.raises(ValueError) as refused:
        _load(tmp_path, top + TWO_MODELS.format(small=small, big=big), {"CUDA_VISIBLE_DEVICES": "0"})
    message = str(refused.value)
    assert message.startswith("device: GPU 0 would run 2 schedulers")
    assert "small on cuda:0" in message and "big on cuda:0" in message and "gpu_memory_utilization" in message


@pytest.mark.parametrize(
    ("top", "small", "big"),
    [
        ("gpu_memory_utilization = 0.45\n", "", ""),
        ("", "gpu_memory_utilization = 0.3", "gpu_memory_utilization = 0.6"),
        ("kv_cache_bytes = 1073741824\n", "", ""),
        ("", "kv_cache_bytes = 1073741824", "kv_cache_bytes = 2147483648"),
    ],
)
def test_two_models_on_one_gpu_each_with_its_share_are_placed_there(tmp_path, monkeypatch, top, small, big):
    placed = _placed(tmp_path, top + TWO_MODELS.format(small=small, big=big), monkeypatch, "0")
    assert placed == [("small/0", "cuda:0", "0"), ("big/0", "cuda:0", "0")]


def test_a_models_share_reaches_its_schedulers(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    toml = TWO_MODELS.format(small="gpu_memory_utilization = 0.25", big="gpu_memory_utilization = 0.7")
    specs = scheduler_specs(_load(tmp_path, toml, {"CUDA_VISIBLE_DEVICES": "0"}), tmp_path)
    assert [s.engine.gpu_memory_utilization for s in specs] == [0.25, 0.7]


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def test_a_daemon_on_two_gpus_pins_each_scheduler_to_its_own(tmp_path):
    """A real daemon with groups cuda:0 and cuda:1, its workers told by the test hook to run on the CPU once they
    would have called set_device: each scheduler process has its own GPU in its environment, and both serve."""
    config = tmp_path / "tokend.toml"
    config.write_text(f'[[models]]\nname = "tiny"\npath = "{TINY_RANDOM_MODEL_NAME}"\ngroups = ["cuda:0", "cuda:1"]\n')
    env = {"CUDA_VISIBLE_DEVICES": "0,1", TEST_CUDA_AS_CPU: "1"}
    with Daemon("--config", str(config), env=env) as daemon:
        pids = daemon.child_pids("tokend: scheduler")
        assert sorted(_environ(pid).get("CUDA_VISIBLE_DEVICES") for pid in pids) == ["0", "1"]
        ready = {e["worker"]: e["cuda_visible_devices"] for e in daemon.log_entries("engine_ready")}
        assert ready == {"tiny/0": "0", "tiny/1": "1"}

        def stream(seed: int) -> str:
            request = pb.GenerateRequest(
                model="tiny", prompt=f"prompt {seed}", sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True)
            )  # long enough that the eight streams overlap, however the machine schedules their starts
            return list(daemon.generation.Generate(request, timeout=60))[-1].finish_reason

        # Sent the moment health says SERVING, which waits for the daemon to count both workers serving: a
        # worker only ready is passed over by routing (all eight once went to one group before health waited).
        before = daemon.steps_by_group("tiny")
        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(stream, range(8))) == {"length"}
        assert len(daemon.wait_every_group_stepped("tiny", before)) == 2  # both groups ran some of the eight


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch may really start on a GPU")
def test_a_cuda_device_this_torch_cannot_use_exits_78_naming_it_without_restarting(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "0"}
    env.pop(TEST_CUDA_AS_CPU, None)
    command = [
        sys.executable, "-m", "daemon.cli", "serve", "--model", TINY_RANDOM_MODEL_NAME, "--device", "cuda",
        "--grpc-port", str(free_port()), "--metrics-port", "0", "--http-port", "0", "--state-dir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr[-3000:]
    failures = [line for line in result.stderr.splitlines() if '"engine_failed_to_start"' in line]
    assert len(failures) == 1 and '"restarting"' not in result.stderr, result.stderr[-3000:]
    message = failures[0]
    for asked in ("cuda:0", "CUDA_VISIBLE_DEVICES=0", TINY_RANDOM_MODEL_NAME, "dtype auto",
                  "gpu_memory_utilization=0.9", "built without CUDA"):  # fmt: skip
        assert asked in message, message


def test_tensor_parallel_ranks_take_one_gpu_each_of_their_group(tmp_path, monkeypatch):
    toml = 'tensor_parallel_size = 2\n[[models]]\nname = "a"\ngroups = ["cuda:0,cuda:1", "cuda:2,cuda:3"]\n'
    assert _placed(tmp_path, toml, monkeypatch, "0,1,2,3") == [("a/0", "cuda:0", "0,1"), ("a/1", "cuda:0", "2,3")]
    toml = 'tensor_parallel_size = 2\n[[models]]\nname = "a"\ngroups = ["cuda:0,cuda:1,cuda:2"]\n'
    expected = "tensor_parallel_size: 2 ranks need a group of 2 GPUs, one each, but models[0].groups gives a the group"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)} 'cuda:0,cuda:1,cuda:2' of 3"):
        _load(tmp_path, toml, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})


def test_a_cpu_group_names_its_cores_and_runs_a_torch_thread_on_each(tmp_path, monkeypatch):
    core = min(os.sched_getaffinity(0))
    config = _load(tmp_path, f'device = "cpu@{core}"\nspare_devices = "cpu@{core}-{core}"\n', {})
    [spec] = scheduler_specs(config, tmp_path)
    assert (spec.engine.device, spec.cpu_cores, spec.cpu_threads) == ("cpu", [core], 1)
    assert [p.cpu_cores for p in config.spare_placements()] == [(core,)]


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu@3-1", "device: 'cpu@3-1' names its cores low to high"), ("cpu@4096", "device: 'cpu@4096' names core 4096")],
)
def test_cpu_cores_that_cannot_be_used_are_refused_naming_the_key(tmp_path, device, expected):
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        _load(tmp_path, f'device = "{device}"\n', {})


def _allowed_cores(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.MULTILINE).group(1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_daemon_on_two_pinned_cpu_groups_binds_each_scheduler_to_its_core(tmp_path):
    """Two CPU groups, one core each: each scheduler process (and so every torch thread in it) may run only on
    its core, with one torch thread, and both serve."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    with Daemon("--device", f"cpu@{first},cpu@{second}") as daemon:
        ready = {e["worker"]: (e["cpu_cores"], e["torch_threads"]) for e in daemon.log_entries("engine_ready")}
        model = next(iter(ready)).split("/")[0]
        assert ready == {f"{model}/0": ([first], 1), f"{model}/1": ([second], 1)}
        pids = daemon.child_pids("tokend: scheduler")
        assert sorted(_allowed_cores(pid) for pid in pids) == sorted([str(first), str(second)])

        def stream(seed: int) -> str:
            request = pb.GenerateRequest(
                prompt=f"prompt {seed}", sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)
            )
            return list(daemon.generation.Generate(request, timeout=60))[-1].finish_reason

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(stream, range(8))) == {"length"}


def test_a_group_names_its_role_and_each_scheduler_is_told(tmp_path, monkeypatch):
    toml = '[[models]]\nname = "a"\ngroups = ["cuda:0=prefill", "cuda:1 = decode", "cuda:2"]\n'
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    config = _load(tmp_path, toml, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    specs = scheduler_specs(config, tmp_path)
    assert [(s.worker_id, s.cuda_visible_devices, s.role) for s in specs] == [
        ("a/0", "0", "prefill"), ("a/1", "1", "decode"), ("a/2", "2", "mixed")
    ]  # fmt: skip
    assert len({s.kv_address for s in specs}) == 3 and all(s.kv_address.startswith("ipc://") for s in specs)
    with pytest.raises(ValueError, match=r"^models\[0\]\.groups: the role after '=' must be one of mixed, prefill, "):
        _load(tmp_path, '[[models]]\nname = "a"\ngroups = ["cuda:0=prefil"]\n', {"CUDA_VISIBLE_DEVICES": "0"})
