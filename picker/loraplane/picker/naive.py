"""The benchmark's naive baseline: a minimal grpcio asyncio ext_proc servicer (not for production).

It answers CONTINUE on the request headers, ``json.loads`` the buffered body and sets the destination header by
a hash of the model: what a first ext_proc endpoint picker in Python looks like. ``loraplane bench picker`` runs it
side by side with the real picker.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from collections.abc import Sequence

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from loraplane.picker.wire import DESTINATION_HEADER


class NaiveServicer(pb_grpc.ExternalProcessorServicer):
    """Hash-of-model routing, nothing else."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        """Route over ``endpoints`` (ip:port)."""
        self.endpoints = list(endpoints)

    async def Process(self, request_iterator, context):
        """CONTINUE headers; route the body by hash(model)."""
        async for request in request_iterator:
            if request.HasField("request_body"):
                model = json.loads(request.request_body.body)["model"]
                endpoint = self.endpoints[int(hashlib.md5(model.encode()).hexdigest(), 16) % len(self.endpoints)]
                header = core.HeaderValueOption(header=core.HeaderValue(key=DESTINATION_HEADER, raw_value=endpoint.encode()))
                common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
            elif request.HasField("request_headers"):
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            else:
                yield pb.ProcessingResponse()


async def _serve(address: str, endpoints: Sequence[str]) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NaiveServicer(endpoints), server)
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loraplane.picker.naive --address 127.0.0.1:PORT --endpoint ip:port ...``"""
    parser = argparse.ArgumentParser(prog="loraplane-picker-naive")
    parser.add_argument("--address", required=True)
    parser.add_argument("--endpoint", action="append", required=True)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.address, args.endpoint))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
