"""Communication: the only package that imports torch.distributed."""
