"""A request that goes on on another worker: what that worker is sent, and its counts translated back to the request's.

Two moves continue a request elsewhere: a disaggregated request's handover from its prefill worker (after the
first token) to its decode worker, and a migration off a worker retired mid-stream (a rollout's drain timeout with
on_drain_timeout migrate). Either way the next worker gets the prompt plus every token generated so far as its
prompt, and the tokens still allowed as its max_tokens; greedy decoding goes on as if nothing happened (on that
worker's weights). Its deltas count from its own start, so they are translated back to the request's own: the
client and the ledger see the original prompt's size, and every token generated on any worker as completion
tokens, never the recomputed prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from frontend.metering import TokenCounts
from gpu_runtime.ipc.messages import AddRequest, KVTransferParams, RequestDelta


@dataclass(eq=False)
class Carryover:
    original: AddRequest  # the request as the client asked for it (all its max_tokens)
    generated: list[int] = field(default_factory=list)  # every token so far, on any worker
    carried: int = 0  # tokens generated before the current worker took over
    hops: int = 0  # moves so far, handovers included
    first: TokenCounts | None = None  # the first worker's latest counts: the prompt's size and cache hits

    def count(self, deltas: list[RequestDelta]) -> TokenCounts | None:
        """The request's counts after these deltas of its current worker (None: no worker said any yet)."""
        for delta in deltas:
            self.generated.extend(delta.new_token_ids)
        if not deltas:
            return self.counts_so_far()
        last = deltas[-1]
        if not self.hops:
            self.first = TokenCounts(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
            return self.first
        first = self.first or TokenCounts()  # set by the first worker's final delta, which came before any move
        return TokenCounts(first.prompt_tokens, self.carried + last.num_output_tokens, first.cached_tokens)

    def counts_so_far(self) -> TokenCounts | None:
        """What the request cost up to the latest move, before its current worker said anything."""
        if self.first is None:
            return None
        return TokenCounts(self.first.prompt_tokens, self.carried, self.first.cached_tokens)

    @property
    def tokens_left(self) -> int:
        return self.original.sampling.max_tokens - len(self.generated)

    def continuation(self, kv_transfer_params: KVTransferParams | None = None) -> AddRequest:
        """The request that goes on on the next worker: with `kv_transfer_params`, a handover's decode part, which
        pulls the prompt's pages from the prefill worker that holds them."""
        self.carried = len(self.generated)
        self.hops += 1
        sampling = msgspec.structs.replace(self.original.sampling, max_tokens=self.tokens_left)
        if self.generated:  # the prompt's logprobs came with the first token: the next worker scores nothing
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        prompt = [*self.original.prompt_token_ids, *self.generated]
        return msgspec.structs.replace(self.original, prompt_token_ids=prompt, sampling=sampling,
                                       do_remote_decode=False, kv_transfer_params=kv_transfer_params,
                                       num_generated=len(self.generated))  # fmt: skip
