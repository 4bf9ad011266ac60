"""Wire contracts between nodes (.proto files) and their generated modules, committed next to them.

The generated `*_pb2*.py` files are checked in so that users need no build step;
tests/unit/connector/test_kv_proto_sync.py regenerates them and fails if they drift from the .proto.
"""
