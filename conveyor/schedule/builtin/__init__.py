"""Built-in schedules, one per module; importing this registers them all."""

from conveyor.schedule.builtin import gpipe, one_f_one_b  # noqa: F401
