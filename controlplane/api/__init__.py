"""The tenant gRPC API: interceptor, conversions and thin servicers."""
