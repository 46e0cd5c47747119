"""The rows of the GPU check (``tools/gpu_check.py``), one module per kind of run.

Each module imports conveyor and ``conveyor.testing`` as a user's tests would and drives only the
public API (``conveyor.Pipeline``, ``conveyor.pipeline``, ``conveyor train``), always with the
layout's ``device=`` given, so every row runs the same on ``cuda:0`` and on the CPU.
"""
