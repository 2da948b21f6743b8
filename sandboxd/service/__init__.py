"""The gRPC daemon: the service, and the front door that tells it who each caller is."""
