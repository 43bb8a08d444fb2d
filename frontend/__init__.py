"""tokend's frontend process: the gRPC server (Generation, Admin, health) and its ZeroMQ link to the schedulers."""
