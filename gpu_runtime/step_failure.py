"""What an engine step that ran out of device memory did: the requests it failed, and the budget that follows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepOutOfMemory:
    """One step's forward or sampling ran out of memory: its requests failed, the others went on untouched."""

    device: str
    num_tokens: int  # what the failed step computed
    failed_request_ids: tuple[str, ...]
    token_budget: int  # max_num_batched_tokens for the steps that follow (halved, down to a floor)

    @property
    def message(self) -> str:
        """What each failed request's client reads."""
        return (
            f"out of memory on {self.device} in a step of {self.num_tokens} tokens; retry "
            f"(the scheduler now computes at most {self.token_budget} tokens a step)"
        )
