"""Generated protobuf/gRPC code for proto/openinfer/v1/engine.proto (do not edit)."""
