"""Layers the model families are built from: norms, RoPE, linear, attention, MoE, the fused CPU step."""
