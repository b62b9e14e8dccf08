"""Elastic Model Units: the shard layout of a model-stage's state, and Split, Merge, Extend and
Destroy moving it between layouts on live slots."""
