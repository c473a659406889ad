"""Generated gRPC stubs for pdcluster.v1 (see router/proto/generate.sh)."""
