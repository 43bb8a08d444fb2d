"""A stream moved to another worker mid-request: a rollout's drain timeout with on_drain_timeout = "migrate", or a
disaggregated request's handover from its prefill worker (after the first token) to its decode worker.

The new worker gets the prompt plus every token generated so far as its prompt, and the tokens still allowed as
its max_tokens; greedy decoding goes on as if nothing happened (on the new worker's weights). Its deltas count from
its own start, so they are translated back to the request's own: the client and the ledger see the original
prompt's size, and every token generated on any worker as completion tokens, never the recomputed prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gpu_runtime.ipc.messages import AddRequest, KVTransferParams, RequestDelta


@dataclass(eq=False)
class Migration:
    original: AddRequest
    generations: list[str]  # the weights that produced its tokens, in order (one unless it moved)
    generated: list[int] = field(default_factory=list)  # every token so far, on any worker
    carried: int = 0  # tokens generated before the latest move
    prompt_tokens: int = 0  # as the first worker counted them
    cached_tokens: int = 0
    hops: int = 0  # moves so far, handovers included
    migrated: bool = False  # moved for a retiring worker (the final chunk says so); a handover is not that
    disaggregated: bool = False  # it started on a prefill worker: its first move is the handover

    @property
    def moved(self) -> bool:
        return len(self.generations) > 1

    def counted(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """The deltas with counts of the original request (and its tokens noted, for a later move)."""
        for delta in deltas:
            self.generated.extend(delta.new_token_ids)
        if not self.hops:
            self.prompt_tokens, self.cached_tokens = deltas[-1].num_prompt_tokens, deltas[-1].num_cached_tokens
            return deltas
        return [
            msgspec.structs.replace(
                delta,
                num_prompt_tokens=self.prompt_tokens,
                num_output_tokens=self.carried + delta.num_output_tokens,
                num_cached_tokens=self.cached_tokens,
            )
            for delta in deltas
        ]

    @property
    def tokens_left(self) -> int:
        return self.original.sampling.max_tokens - len(self.generated)

    def continuation(self, generation: str, kv_transfer_params: KVTransferParams | None = None) -> AddRequest:
        """The request that goes on, on a worker serving `generation`: a migration, or with `kv_transfer_params` (or
        None for a prompt that filled no page) a handover from the prefill worker whose pages those are."""
        handover = not self.hops and self.disaggregated
        self.carried = len(self.generated)
        self.hops += 1
        if not handover:
            self.migrated = True
        if generation != self.generations[-1] or not handover:
            self.generations.append(generation)
        sampling = msgspec.structs.replace(self.original.sampling, max_tokens=self.tokens_left)
        prompt = [*self.original.prompt_token_ids, *self.generated]
        return msgspec.structs.replace(self.original, prompt_token_ids=prompt, sampling=sampling,
                                       do_remote_decode=False, kv_transfer_params=kv_transfer_params)  # fmt: skip
