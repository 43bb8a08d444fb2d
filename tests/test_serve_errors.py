"""Bad input over gRPC gets the right status and a message naming the field; the frontend keeps serving."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from daemon_harness import ROOT, Daemon, free_port

from tokend.v1 import tokend_pb2 as pb

KV_PAGES = 64  # a small cache: 64 pages of 16 tokens
PAGE_BYTES = 2 * 4 * 16 * 2 * 32 * 4  # K and V x 4 layers x 16 tokens x 2 kv heads x 32 dims x float32


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--kv-cache-bytes", str(KV_PAGES * PAGE_BYTES)) as running:
        yield running


def _error(daemon: Daemon, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(daemon.generation.Generate(request, timeout=30))
    return caught.value


def _sampling(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(**fields))


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (pb.GenerateRequest(model="no-such-model", prompt="Hi"), grpc.StatusCode.NOT_FOUND, "model"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 2048)), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        # Longer than the context could hold at 32 characters a token: refused before it is tokenized.
        (pb.GenerateRequest(prompt="x" * 70_000), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (pb.GenerateRequest(prompt="Hi", request_id="\u00e9t\u00e9"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (_sampling(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (_sampling(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        (_sampling(top_p=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        (_sampling(min_p=2), grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
        (_sampling(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        (_sampling(max_tokens=1500), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        (_sampling(max_tokens=2047), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        (_sampling(logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs"),
        (_sampling(stop=["x"] * 9), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
        (_sampling(stop=["x" * 300]), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
        (pb.GenerateRequest(prompt="Hi", priority=7), grpc.StatusCode.INVALID_ARGUMENT, "priority"),
        (pb.GenerateRequest(prompt="Hi", request_id="x" * 200), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (pb.GenerateRequest(prompt="x" * (5 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
    ids=lambda value: value.name if isinstance(value, grpc.StatusCode) else None,
)
def test_bad_input_gets_its_status_and_names_the_field(daemon, request_, code, field):
    error = _error(daemon, request_)
    assert error.code() == code, error.details()
    assert error.details().startswith(field), error.details()
    # ... and everyone else is still served.
    assert daemon.generate("still here?", max_tokens=3, ignore_eos=True)[-1].finish_reason == "length"


def test_a_request_id_already_in_flight_is_refused(daemon):
    long_request = pb.GenerateRequest(
        prompt="Hi", request_id="twice", sampling=pb.SamplingParams(max_tokens=800, ignore_eos=True)
    )
    first = daemon.generation.Generate(long_request, timeout=60)
    next(first)
    error = _error(daemon, long_request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("request_id")
    first.cancel()


def test_abort_needs_a_request_id(daemon):
    with pytest.raises(grpc.RpcError) as caught:
        daemon.generation.Abort(pb.AbortRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not daemon.generation.Abort(pb.AbortRequest(request_id="never-seen"), timeout=10).aborted


@pytest.mark.parametrize(
    ("chat", "field"),
    [
        (pb.ChatMessages(), "chat.messages"),
        (pb.ChatMessages(messages=[pb.ChatMessage(role="", content="x")]), "chat.messages[0].role"),
        (pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")] * 257), "chat.messages"),
    ],
)
def test_a_bad_conversation_names_the_message(daemon, chat, field):
    error = _error(daemon, pb.GenerateRequest(chat=chat))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field), error.details()


def test_fill_context_generates_past_the_default_up_to_what_the_cache_holds(daemon):
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(fill_context=True, ignore_eos=True))
    call = daemon.generation.Generate(request, timeout=60)
    for chunk in call:
        if chunk.usage.completion_tokens > 16:
            break
    call.cancel()
    assert chunk.usage.completion_tokens > 16


@pytest.mark.parametrize("method", ["Generate", "Abort"])
def test_bytes_that_are_no_message_are_refused_as_invalid(daemon, method):
    """Not grpc's UNKNOWN with a traceback in the log: the client sent bad bytes and is told so."""
    call = (daemon.channel.unary_stream if method == "Generate" else daemon.channel.unary_unary)(
        f"/tokend.v1.Generation/{method}"
    )  # no serializers: the bytes go out as they are
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(b"\n\x01\xff", timeout=30)  # field 1, a string of one byte that is not UTF-8
        list(reply) if method == "Generate" else None
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request: not a valid message")
    assert "Traceback" not in daemon.log()
    assert len(daemon.generate("still serving", max_tokens=2)) >= 1


def test_a_malformed_gguf_model_stops_the_start_with_exit_78_naming_the_field(tmp_path):
    """The 69 bytes that made gguf's reader spin and grow: the scheduler refuses them at once, and the daemon exits
    with the configuration error's code instead of holding its group for ever."""
    from test_gguf_malformed import MUTANTS

    model = tmp_path / "spin.gguf"
    model.write_bytes(MUTANTS["69-byte spin"])
    command = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--device", "cpu",
               "--state-dir", str(tmp_path / "state"), "--grpc-port", str(free_port()),
               "--http-port", str(free_port())]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr[-2000:]
    assert "not a well-formed GGUF file: metadata 'k': claims" in result.stdout + result.stderr
