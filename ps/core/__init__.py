"""The server's transport-free core: state, exactly-once, validation, updates, paging, checkpoints.
Imports hybridps and itself only: no grpc, protobuf, hybridps.v1, ps.edge or ps's entry points."""
