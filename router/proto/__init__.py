"""Generated gRPC stubs for pdcluster.v1 (see scripts/generate_proto.sh)."""
