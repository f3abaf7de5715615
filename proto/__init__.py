"""Protobuf / gRPC contracts (no torch)."""
