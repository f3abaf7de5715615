"""The contracts that cross process boundaries (:mod:`hearth.proto.contracts`) and their gRPC form:
``hearth.proto``, compiled into ``hearth_pb2*`` by ``tools/gen_proto.py``. No torch here."""
