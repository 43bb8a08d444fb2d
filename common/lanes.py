"""The lane layer's vocabulary, shared by the daemon, the frontend and the schedulers: one enum per concept.

A worker (../shared/DESIGN.md, "Workers") is one scheduler process serving one model at one generation, in one
role and one state. Every wire struct and every decision names these members, never a bare string, so a typo
("prefil") fails to decode instead of quietly meaning something else. Torch-free and grpc-free on purpose.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """Which part of a request a worker runs (disaggregated serving: the prefill and decode pools)."""

    MIXED = "mixed"  # the whole request: prompt and decode
    PREFILL = "prefill"  # the prompt and the first token; its pages wait under a lease for a decode worker
    DECODE = "decode"  # pulls a prompt's pages from a prefill worker, then generates

    @property
    def pool(self) -> Pool:
        return Pool.PREFILL if self is Role.PREFILL else Pool.ROUTED


class Pool(enum.StrEnum):
    """A model's workers are one or two pools, each scaled and rolled out on the groups of its own role."""

    ROUTED = "routed"  # the workers requests are routed to: mixed ones, or decode ones beside a prefill pool
    PREFILL = "prefill"  # the prefill workers long prompts go to first


class WorkerState(enum.StrEnum):
    """A worker's life: starting -> (standby ->) serving -> draining -> retired, or failed (then restarted)."""

    STARTING = "starting"  # the process is loading its model and warming up
    STANDBY = "standby"  # loaded and warm but not routed: a canary held back, or pre-warmed capacity
    SERVING = "serving"  # takes new requests (if its generation is the one new requests go to)
    DRAINING = "draining"  # takes no new requests; finishes its in-flight ones, then exits 0
    RETIRED = "retired"
    FAILED = "failed"  # crashed; restarted with backoff


class RolloutPhase(enum.StrEnum):
    """Where a model's latest rollout stands (Admin.GetRollout)."""

    NONE = "none"  # never rolled out: the configuration's own weights
    ROLLING = "rolling"  # moving the workers to the target weights
    CANARY = "canary"  # held at canary_percent of new requests on the new weights
    DONE = "done"
    ROLLING_BACK = "rolling-back"  # the new weights failed to serve: back to the earlier ones
    FAILED = "failed"  # back on the earlier ones; RolloutStatus.error says why

    @property
    def in_progress(self) -> bool:
        """Workers are being replaced: the autoscaler steps aside, health counts the model's old workers too."""
        return self in (RolloutPhase.ROLLING, RolloutPhase.ROLLING_BACK)

    @property
    def holds_target(self) -> bool:
        """The rollout's target decides the worker set (a canary keeps its split); otherwise the scaling counts
        do. A canary is not in progress (nothing is moving) but still holds its target."""
        return self.in_progress or self is RolloutPhase.CANARY

    @property
    def settled(self) -> bool:
        """An operator's `tokend rollout` may stop waiting."""
        return self in (RolloutPhase.DONE, RolloutPhase.CANARY, RolloutPhase.FAILED)


class RolloutStrategy(enum.StrEnum):
    SURGE = "surge"  # new workers on spare groups first, then the old ones drain (maxUnavailable 0)
    IN_PLACE = "in-place"  # one group at a time drains and restarts on the new weights (maxUnavailable 1)


class DrainAction(enum.StrEnum):
    """What happens to a draining worker's streams still running at the drain timeout."""

    ABORT = "abort"  # they end with finish_reason "abort"
    MIGRATE = "migrate"  # they are re-submitted (prompt + tokens so far) to a serving worker and go on there


class KVTransport(enum.StrEnum):
    """How a decode worker pulls a prompt's pages from a prefill worker."""

    ZMQ = "zmq"  # the pages come back as frames on the ZeroMQ socket
    NIXL = "nixl"  # a NIXL (UCX) READ out of the prefill worker's registered pool; the socket carries control


class KVLoadFailure(enum.StrEnum):
    """What a decode worker does when a pull fails."""

    RECOMPUTE = "recompute"  # compute the prompt here
    FAIL = "fail"  # end the request with an error
