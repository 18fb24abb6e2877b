"""Pipeline parallelism: stages, schedules as data, one executor, simulated and measured timelines."""
from .actions import B, BW, F, W, Action, Event, Schedule, Timeline  # noqa: F401
from .schedules import SCHEDULES, make_schedule  # noqa: F401
from .check import CheckReport, ScheduleError, check  # noqa: F401
from .simulate import Costs, simulate  # noqa: F401
