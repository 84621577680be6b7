"""Training on CPU: not part of serving (the runtime never imports it, bar `trained-mtp` on first use)."""
