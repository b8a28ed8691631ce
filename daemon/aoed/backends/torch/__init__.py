"""PyTorch distributed: the rank processes and worlds GDAT jobs measure with."""
