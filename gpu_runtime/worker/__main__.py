"""Entry point of a scheduler process: `python -m gpu_runtime.worker '<WorkerSpec JSON>'` (spawned by the daemon)."""

from __future__ import annotations

import os
import queue
import signal
import sys
import uuid
from pathlib import Path

import zmq

from common.child_process import become_child
from common.exit_codes import EXIT_CONFIG_ERROR
from common.lanes import Role
from common.logs import configure_logging
from gpu_runtime.ipc.peer_auth import PeerAuth, read_secret
from gpu_runtime.worker.spec import WorkerSpec

_EXIT_FAILED = 1  # restarted with backoff; the daemon gives up after a few in a row


def main(argv: list[str]) -> int:
    spec = WorkerSpec.from_json(argv[1])
    become_child(f"tokend: scheduler {spec.engine.served_model_name} {spec.group}")
    log = configure_logging("scheduler", spec.log_level).bind(worker=spec.worker_id)
    try:  # before the model loads: without it no frontend would ever take this scheduler's ready
        auth = PeerAuth(read_secret(spec.secret_path))
    except (OSError, ValueError) as error:
        log.error("secret_unreadable", error=str(error))
        return _EXIT_FAILED

    if spec.cpu_cores:  # before torch starts its thread pool, so every thread it makes inherits the binding
        os.sched_setaffinity(0, spec.cpu_cores)
    import torch  # loads here, after the title is set

    from gpu_runtime.engine import LLMEngine
    from gpu_runtime.tp.rank_group import RankLost
    from gpu_runtime.worker.engine_start import DEVICE_START_ERRORS, engine_config_on_device, start_failure
    from gpu_runtime.worker.handover import Handover
    from gpu_runtime.worker.io_threads import FrontendDisconnected, InputReader, OutputWriter
    from gpu_runtime.worker.scheduler_loop import SchedulerLoop
    from gpu_runtime.worker.warm_up import warm_up

    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    try:
        engine = LLMEngine(engine_config_on_device(spec), collective_timeout_s=spec.collective_timeout_s)
        warm_up(engine)
        if engine.step_failure is not None:  # warm-up ran out of memory: serving would too
            raise torch.OutOfMemoryError(engine.step_failure.message)
    except (ValueError, TypeError, OSError) as error:
        log.error("engine_failed_to_start", error=str(error))
        return EXIT_CONFIG_ERROR
    except DEVICE_START_ERRORS as error:  # the same on every retry: restarting cannot help
        log.error("engine_failed_to_start", **start_failure(spec, error))
        return EXIT_CONFIG_ERROR
    log.info("engine_ready", model=engine.model_name, device=str(engine.device), dtype=str(engine.dtype),
             attention_backend=engine.attention_backend, torch_threads=torch.get_num_threads(),
             cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), devices=spec.devices,
             cpu_cores=sorted(os.sched_getaffinity(0)) if spec.cpu_cores else None,
             **engine.memory.as_log_fields())  # fmt: skip

    context = zmq.Context()
    inbox: queue.Queue = queue.Queue()
    incarnation = uuid.uuid4().hex
    reader = InputReader(context, spec.input_address, inbox, auth, log, worker_id=spec.worker_id,
                         incarnation=incarnation)  # fmt: skip
    # The output thread tells the engine thread through the inbox: only the engine thread touches the engine. It
    # seals what it sends with the session the input thread opened at the latest hello.
    writer = OutputWriter(context, spec.output_address, log, on_disconnect=lambda: inbox.put(FrontendDisconnected()),
                          session=lambda: reader.session)  # fmt: skip
    handover = Handover(engine, context, inbox, log, worker_id=spec.worker_id, kv_address=spec.kv_address,
                        lease_seconds=spec.kv_lease_seconds, load_failure=spec.kv_load_failure,
                        transport=spec.kv_transfer_transport)  # fmt: skip
    if spec.role == Role.PREFILL:
        handover.start_server()
    loop = SchedulerLoop(spec, engine, inbox, writer, auth, log, handover, incarnation=incarnation,
                         rejected=reader.rejected)  # fmt: skip
    Path(spec.heartbeat_path).touch()  # from here on the loop keeps it fresh
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: loop.stop())
    reader.start()
    writer.start()
    exit_code = 0
    try:
        loop.run()
    except RankLost as error:  # the group cannot step again: exiting makes the daemon restart all of it
        log.error("tensor_parallel_rank_lost", error=str(error))
        exit_code = _EXIT_FAILED
    except RuntimeError as error:  # a collective failed mid-step: a rank died or hung; the same, found later
        if engine.ranks is None:
            raise
        log.error("tensor_parallel_rank_lost", error=str(error)[:500])
        exit_code = _EXIT_FAILED
    finally:
        engine.close()  # its other tensor-parallel ranks, if any
    reader.stop()
    handover.close()
    writer.close()
    reader.join(timeout=2)
    context.destroy(linger=0)  # the KV threads' sockets too, wherever they are
    log.info("scheduler_stopped", exit_code=exit_code)
    return exit_code


if __name__ == "__main__":
    code = main(sys.argv)
    # The work is done and every socket closed: skip the interpreter's teardown, which would only cost time (torch's
    # alone takes about 0.4 s, a rollout's retired worker or a stop waits on it) and can crash under NIXL's agents.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
