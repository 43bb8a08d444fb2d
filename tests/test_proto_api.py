"""The public API's contract: protos/ documents every field, and the generated stubs match it."""

from __future__ import annotations

import re
from pathlib import Path

from tokend.v1 import tokend_pb2 as pb

PROTO = Path(__file__).resolve().parent.parent / "protos" / "tokend" / "v1" / "tokend.proto"
_DECLARATION = re.compile(r"^\s*((optional|repeated)\s+)?[\w.]+\s+\w+\s*=\s*\d+;|^\s*(message|enum|service|rpc)\s")


def test_every_field_message_enum_and_rpc_carries_a_comment():
    lines = PROTO.read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        if _DECLARATION.match(line):
            previous = lines[index - 1].strip()
            if not previous.startswith("//"):
                undocumented.append(line.strip())
    assert not undocumented, undocumented


def test_the_stubs_are_generated_from_this_proto():
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "tokend.v1"
    generation = {"Generate", "Abort", "ListModels", "Tokenize", "Detokenize", "Embed"}
    assert set(services["Generation"].methods_by_name) == generation
    assert set(services["Admin"].methods_by_name) == {"Drain", "GetLoad", "GetUsage", "Rollout", "GetRollout"}
    assert services["Generation"].methods_by_name["Generate"].server_streaming
    declared = set(re.findall(r"^message (\w+)", PROTO.read_text(), re.MULTILINE))
    assert declared == set(pb.DESCRIPTOR.message_types_by_name)
