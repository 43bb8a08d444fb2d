"""The gateway's SSE keep-alive, in process over a fake Generate call that stays quiet until the test says: a quiet
spell (a long prefill, a queue) sends comments, and none goes out once tokens flow faster than the interval. The
daemon-level tests (test_gateway_openai, test_openai_surface) show the flag and the stream's order through real
processes, where how long a prefill stays quiet is the machine's to say."""

from __future__ import annotations

import asyncio

from frontend.gateway.calls import GenerateCalls
from tokend.v1 import tokend_pb2 as pb


class QuietCall:
    """A server-streaming call that yields its responses only once `release` is set."""

    def __init__(self, responses: list[pb.GenerateResponse], release: asyncio.Event):
        self._responses = responses
        self._release = release

    async def __aiter__(self):
        await self._release.wait()
        for response in self._responses:
            yield response

    def cancel(self) -> bool:
        return True


class QuietStub:
    def __init__(self, responses: list[pb.GenerateResponse], release: asyncio.Event):
        self.Generate = lambda request, metadata=None: QuietCall(responses, release)


def stream(keepalive_s: float, release_after_keepalives: int | None) -> list[pb.GenerateResponse | None]:
    """What GenerateCalls.responses yields for a call of three responses that starts flowing after that many keep-alives
    (None: at once)."""

    async def scenario():
        release = asyncio.Event()
        if release_after_keepalives is None:
            release.set()
        responses = [pb.GenerateResponse(request_id=f"r{i}") for i in range(3)]
        calls = GenerateCalls(QuietStub(responses, release), [pb.GenerateRequest()], metadata=(), chat=True)
        seen = []
        async for _, response in calls.responses(keepalive_s):
            seen.append(response)
            if response is None and seen.count(None) == release_after_keepalives:
                release.set()
        calls.cancel()
        return seen

    return asyncio.run(asyncio.wait_for(scenario(), 30))  # a guard: without keep-alives the call never flows


def test_a_quiet_spell_sends_keepalives_then_the_tokens_in_order():
    seen = stream(keepalive_s=0.001, release_after_keepalives=3)
    assert seen[:3] == [None, None, None]
    assert [r.request_id for r in seen if r is not None] == ["r0", "r1", "r2"]


def test_no_keepalive_while_tokens_flow():
    seen = stream(keepalive_s=60.0, release_after_keepalives=None)
    assert [r.request_id for r in seen] == ["r0", "r1", "r2"]
