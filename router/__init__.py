"""The front door: gRPC (`pdcluster.v1`) and OpenAI HTTP, validation, admission, placement."""
