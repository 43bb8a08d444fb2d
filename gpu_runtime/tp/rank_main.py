"""A tensor-parallel rank other than 0: `python -m gpu_runtime.tp.rank_main '<RankSpec JSON>'`, started by rank
0's RankGroup. It loads its shard, sizes its KV pool with the others, then runs each step rank 0 broadcasts until
told to stop. It holds no scheduler, samples nothing, and talks to nothing but its group."""

from __future__ import annotations

import signal
import sys

from common.child_process import become_child
from common.logs import configure_logging
from gpu_runtime.ipc.peer_auth import PeerAuth, read_secret
from gpu_runtime.tp.group import RankSpec

_EXIT_FAILED = 1


def main(argv: list[str]) -> int:
    spec = RankSpec.from_json(argv[1])
    model = spec.engine.served_model_name or spec.engine.model or "default model"
    become_child(f"tokend: rank {spec.rank}/{spec.world_size} {model}", death_signal=signal.SIGKILL)
    log = configure_logging("tp_rank", spec.log_level).bind(rank=spec.rank, world_size=spec.world_size)
    try:
        auth = PeerAuth(read_secret(spec.secret_path))
    except (OSError, ValueError) as error:
        log.error("rank_secret_unreadable", error=str(error))
        return _EXIT_FAILED

    import torch

    from gpu_runtime.attention.backend import make_attention_backend
    from gpu_runtime.device import resolve_dtype
    from gpu_runtime.kv_cache.host_tier import HostPages
    from gpu_runtime.memory_profile import load_model_and_pool
    from gpu_runtime.model.config import load_capped_model_config
    from gpu_runtime.model_runner import ModelRunner
    from gpu_runtime.tp.group import join_group, leave_group, started_marker
    from gpu_runtime.tp.group_auth import GroupRefused
    from gpu_runtime.tp.step_channel import Stop

    started_marker(spec.rendezvous, spec.rank).touch()  # rank 0 waits for this before it joins
    torch.set_num_threads(spec.torch_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        tp, channel = join_group(spec.rank, spec.world_size, spec.rendezvous, device, spec.collective_timeout_s, auth)
    except GroupRefused as error:  # rank 0 refuses too: the group does not start
        log.error("rank_group_refused", error=str(error))
        leave_group()
        return _EXIT_FAILED
    try:
        config = spec.engine
        model_config = load_capped_model_config(spec.model_dir, config.max_model_len)
        backend = make_attention_backend(config.attention_backend, device)
        dtype = resolve_dtype(config.dtype, device, None)
        model, pool, memory = load_model_and_pool(
            spec.model_dir, model_config, config, backend, dtype, device, tp, channel
        )
        log.info("rank_ready", device=str(device), pages=memory.num_pages, weights_bytes=memory.weights_bytes)
        host_pages = None
        if config.kv_offload_bytes:  # this rank's heads of the host tier rank 0 keeps the books of
            host_pages = HostPages(pool, config.kv_offload_bytes // HostPages.page_bytes(pool))
        runner = ModelRunner(model, pool, device, host_pages=host_pages)
        while True:
            command = channel.receive()
            if isinstance(command, Stop):
                log.info("rank_stopped", reason=command.reason)
                return 0
            runner.execute(runner.prepare_plan(command.plan))
    except Exception as error:  # rank 0 sees the group fail at its next collective and restarts it
        log.exception("rank_failed", error=str(error))
        return _EXIT_FAILED
    finally:
        leave_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
