"""Training on Pipeline: typed configs (config, config_checks), data where it is read (data,
sources, data_check), the models (models), the loop (loop), end-of-run sampling (sample), progress
and pictures (report), `conveyor train`'s launcher, what it checks before any rank starts and how a
failure reads (launch, preflight, failures), restarts (restarts), rank 0's single-device check of
every step (parity: `conveyor demo`).
"""
