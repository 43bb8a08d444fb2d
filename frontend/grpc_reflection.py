"""gRPC server reflection under both of its names: grpc.reflection.v1, which current grpcurl, grpcui and Postman ask
for first, and the older grpc.reflection.v1alpha, which older clients know only.

grpcio-reflection implements v1alpha only. v1 is the same protocol: gRPC published it as v1alpha's proto under a new
package, message for message and field for field, so the two are identical on the wire. v1 is therefore served by
the same servicer, and described by v1alpha's descriptor with the package renamed, so that reflection describes the
v1 service as it does every other one.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"  # the name gRPC's own proto has


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection, v1 and v1alpha, listing service_names and the reflection services themselves."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)  # a library in this process brought gRPC's own
    except KeyError:
        pool.Add(_v1_file())
    servicer = reflection.aio.ReflectionServicer([*service_names, *SERVICE_NAMES], pool=pool)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1_method}),)
    )


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor, renamed to v1's file and package (its types' references included)."""
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old_prefix, new_prefix = f".{file.package}.", f".{_V1_PACKAGE}."

    def renamed(type_name: str) -> str:
        return new_prefix + type_name.removeprefix(old_prefix) if type_name.startswith(old_prefix) else type_name

    file.name, file.package = _V1_FILE, _V1_PACKAGE
    file.options.Clear()  # v1alpha's say "deprecated" and name v1alpha's Java and Go packages
    for message in file.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message and enum fields only
                field.type_name = renamed(field.type_name)
    for service in file.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    return file
