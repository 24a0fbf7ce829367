"""Generated protobuf/gRPC modules (``make protos`` regenerates them from the ``.proto`` files here)."""
