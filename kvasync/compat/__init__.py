"""Drop-in facades for other projects' interfaces (`kvasync.compat.vllm`)."""
