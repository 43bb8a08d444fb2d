"""Background load: a few threads that each keep one real streaming request in flight (gRPC or HTTP), recording
what every request's client saw, until told to stop."""

from __future__ import annotations

import random
import threading
import time

import grpc
import httpx

from chaos.clients import REFUSED, ClientRecord, grpc_generate, http_generate
from chaos.daemon_setup import GRPC_TENANT, HTTP_TENANT, Tenants
from chaos.grpc_fuzz import CHANNEL_OPTIONS
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 60.0  # a load request is 8..64 tokens: far less than a second when served
_PAUSE_AFTER_REFUSAL_S = 0.2


class Load:
    def __init__(self, grpc_address: str, http_url: str, tenants: Tenants, streams: int, seed: int):
        self.grpc_address = grpc_address
        self.http_url = http_url
        self.tenants = tenants
        self.seed = seed
        self.records: list[ClientRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        kinds = ["grpc" if i % 2 == 0 else "http" for i in range(streams)]
        self._threads = [
            threading.Thread(target=self._run, args=(kind, index), name=f"load-{kind}-{index}", daemon=True)
            for index, kind in enumerate(kinds)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Lets each thread finish its request in flight (bounded by its timeout), then returns."""
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)

    def _run(self, kind: str, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        channel = grpc.insecure_channel(self.grpc_address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.GenerationStub(channel)
        http = httpx.Client()
        try:
            for number in range(1_000_000):
                if self._stop.is_set():
                    break
                prompt = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(1, 40)))
                max_tokens = rng.randint(8, 64)
                if kind == "grpc":
                    record = self._grpc_request(stub, f"chaos-load-{index}-{number}", prompt, max_tokens)
                else:
                    record = self._http_request(http, rng.random() < 0.5, prompt, max_tokens)
                with self._lock:
                    self.records.append(record)
                if record.end == REFUSED:
                    time.sleep(_PAUSE_AFTER_REFUSAL_S)
        finally:
            http.close()
            channel.close()

    def _grpc_request(self, stub, request_id: str, prompt: str, max_tokens: int) -> ClientRecord:
        request = pb.GenerateRequest(
            prompt=prompt, request_id=request_id, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        metadata = self.tenants.metadata(GRPC_TENANT)
        return grpc_generate(stub, request, metadata, GRPC_TENANT, REQUEST_TIMEOUT_S)

    def _http_request(self, http: httpx.Client, chat: bool, prompt: str, max_tokens: int) -> ClientRecord:
        if chat:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        else:
            url, body = "/v1/completions", {"prompt": prompt}
        body.update(max_tokens=max_tokens, ignore_eos=True)
        bearer = self.tenants.bearer(HTTP_TENANT)
        return http_generate(http, self.http_url + url, body, bearer, HTTP_TENANT, REQUEST_TIMEOUT_S)
