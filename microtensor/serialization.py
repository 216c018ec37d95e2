"""Checkpoints in the safetensors format (placeholder until the nn issue lands)."""


def save(tensors, path, metadata=None):
    raise NotImplementedError


def load(path, with_metadata=False):
    raise NotImplementedError
