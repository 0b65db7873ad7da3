"""openinfer."""
