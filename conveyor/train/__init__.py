"""Training entry points built on Pipeline (the demo trainer)."""
