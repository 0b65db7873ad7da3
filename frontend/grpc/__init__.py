"""gRPC frontend: the ``openinfer.v1.Engine`` server over any ``EngineHandle`` and the
``GrpcEngineClient`` that turns a remote server back into an ``EngineHandle``."""

from openinfer.frontend.grpc.client import GrpcEngineClient
from openinfer.frontend.grpc.server import EngineServicer, GrpcServer, start_grpc_server

__all__ = ["EngineServicer", "GrpcEngineClient", "GrpcServer", "start_grpc_server"]
