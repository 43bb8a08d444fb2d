"""Rank 0's side of a tensor-parallel group: it starts ranks 1..N-1 as its own children, joins the group with
them, notices when one is gone, and stops them.

A rank dies with rank 0 (PR_SET_PDEATHSIG, SIGKILL: a stopped rank cannot handle SIGTERM), so a scheduler the
daemon kills or restarts never leaves ranks holding a GPU. A rank that dies first is seen by rank 0 at its next
collective (gloo and NCCL fail at once on a closed connection), or, while the engine idles, by `check_alive`, which
the scheduler loop calls between steps; a rank that hangs fails rank 0's next collective after the timeout. Either
way rank 0 raises, its process exits, and the daemon restarts the whole group (its streams end UNAVAILABLE).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.peer_auth import PeerAuth, read_secret, write_secret
from gpu_runtime.tp.group import RankSpec, join_group, leave_group, rank_device, started_marker
from gpu_runtime.tp.step_channel import Stop

# How long a collective may wait for the other ranks, the daemon's stall_timeout by default: past it rank 0's step
# fails (and the daemon's watchdog would have killed a scheduler stalled that long anyway).
DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0
_STOP_WAIT_S = 10.0
_START_POLL_S = 0.05


class RankLost(RuntimeError):
    """A rank of the group exited: the group cannot run another step."""


class RankGroup:
    """Starts ranks 1..N-1 for an engine whose rank 0 is this process, and joins the group with them.

    `config` is the engine's, its attention backend and dtype resolved (every rank builds the same model).
    The constructor returns once every rank has joined; `tp` and `channel` are then rank 0's."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        device: torch.device,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        log_level: str = "info",
    ):
        self.world_size = config.tensor_parallel_size
        self._threads_before = torch.get_num_threads()
        if device.type == "cpu":  # the ranks share this process's cores rather than each taking all of them
            torch.set_num_threads(max(1, self._threads_before // self.world_size))
        self._directory = Path(tempfile.mkdtemp(prefix="tokend-tp-"))  # 0700: the rendezvous file is ours alone
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        rendezvous = str(self._directory / "rendezvous")
        try:
            # The group's own secret, minted here: only this process and its children can read the directory.
            secret_path = write_secret(self._directory)
            auth = PeerAuth(read_secret(secret_path))
            for rank in range(1, self.world_size):
                spec = RankSpec(
                    rank=rank,
                    world_size=self.world_size,
                    rendezvous=rendezvous,
                    secret_path=str(secret_path),
                    engine=config,
                    model_dir=str(model_dir),
                    device=str(rank_device(device, rank)),
                    torch_threads=torch.get_num_threads(),
                    collective_timeout_s=collective_timeout_s,
                    log_level=log_level,
                )
                command = [sys.executable, "-m", "gpu_runtime.tp.rank_main", spec.to_json()]
                self._processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
            self._wait_until_started(rendezvous)
            self.tp, self.channel = join_group(0, self.world_size, rendezvous, device, collective_timeout_s, auth)
        except BaseException:  # a rank that exited, or one that could not prove it holds the secret (GroupRefused)
            self._kill()
            leave_group()
            torch.set_num_threads(self._threads_before)
            raise

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids, rank 1 first."""
        return [process.pid for process in self._processes]

    def _wait_until_started(self, rendezvous: str) -> None:
        """Returns once every rank has started (a marker file each), however slowly a loaded machine imports torch;
        raises RankLost as soon as one exits instead: joining the group would wait for it forever."""
        waiting = dict(enumerate(self._processes, start=1))
        while waiting:
            for rank, process in list(waiting.items()):
                if started_marker(rendezvous, rank).exists():
                    del waiting[rank]
                elif process.poll() is not None:
                    raise RankLost(f"tensor-parallel rank {rank} exited with status {process.returncode} at start")
            time.sleep(_START_POLL_S)

    def check_alive(self) -> None:
        """Raises RankLost naming the rank and its exit status if any rank has exited."""
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                raise RankLost(f"tensor-parallel rank {rank} (pid {process.pid}) exited with status {code}")

    def close(self) -> None:
        """Tells the ranks to stop and waits for them (killing any that does not); leaves the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.check_alive()
            self.channel.send(Stop("engine closed"))
        except (RankLost, RuntimeError):  # a rank is gone: the others cannot follow a broadcast; they are killed
            pass
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_STOP_WAIT_S)
        self._kill()
        leave_group()
        torch.set_num_threads(self._threads_before)

    def _kill(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self._directory, ignore_errors=True)
