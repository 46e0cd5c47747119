"""Training on Pipeline: typed configs (config), data where it is read (data), the demo trainer (demo)."""
