"""Training on Pipeline: typed configs (config), data where it is read (data), the loop (loop), `conveyor train`'s launcher (launch), the demo trainer (demo)."""
