#!/bin/sh
# gen_stubs.sh OUT: the Python modules of the delivery protocol
# (outbox/v1/event_pb2.py, sink_pb2.py, sink_pb2_grpc.py), generated from
# proto/ into OUT, and of grpc.health.v1 (health_pb2.py, health_pb2_grpc.py:
# top-level, as a grpc/ folder would hide the grpc package); run the
# consumer with PYTHONPATH=OUT. Needs protoc, grpc_python_plugin and
# health.proto (Debian 12: protobuf-compiler, protobuf-compiler-grpc,
# grpc-proto).
set -eu
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
plugin=$(command -v grpc_python_plugin) ||
  { echo "$0: grpc_python_plugin is missing (apt-get install protobuf-compiler-grpc)" >&2; exit 1; }
mkdir -p "$1"
protoc -I "$root/proto" -I /usr/include --python_out="$1" --grpc_out="$1" \
  --plugin=protoc-gen-grpc="$plugin" \
  "$root/proto/outbox/v1/event.proto" "$root/proto/outbox/v1/sink.proto"
cp /usr/share/grpc-proto/grpc/health/v1/health.proto "$1/health.proto"
protoc -I "$1" --python_out="$1" --grpc_out="$1" --plugin=protoc-gen-grpc="$plugin" \
  "$1/health.proto"
rm "$1/health.proto"
