"""Messages (msgspec Structs) and ZMQ plumbing between API servers, the engine
core and workers. Nothing on any socket is pickled."""
