"""User state <-> flat tensors and typed values."""
