"""Tensor parallelism inside a model: weight slices and collectives."""
