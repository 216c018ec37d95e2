"""mt.nn.functional (placeholder: filled in by the nn work)."""
