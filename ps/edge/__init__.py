"""The server's gRPC edge: aio server, servicers, codec, the one error-to-status map, auth, metrics.
Imports ps.core, ps.config, hybridps, grpc and protobuf; never ps.__main__ or ps.admin."""
