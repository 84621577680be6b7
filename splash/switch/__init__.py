"""Live attention-layout switching (SPEC §4), both sides of it: rank 0 decides (`controller.py`: the
schedule, a request, the regret guard or `--layout auto`'s policy in `auto.py` fed by `feedback.py`),
plans (`planner.py`, `columns.py`) and keeps the replicas' pages (`replicas.py`); every rank executes
the plan during one step (`executor.py` through `layout.py`, run by `step.py`). It may import the core,
the config, the step message, kv, model and attention; the worker and rank 0's engine import it, never
the reverse (the controller sees the engine only through the object it is attached to). See
docs/runtime.md, "Switching"."""

from splash.switch.executor import SwitchExecutor, SwitchResult, switch_tag
from splash.switch.layout import SwitchLayout
from splash.switch.plan import Headroom, LiveRequest, SwitchPlan, SwitchRefusal
from splash.switch.planner import SwitchPlanner

__all__ = ["Headroom", "LiveRequest", "SwitchExecutor", "SwitchLayout", "SwitchPlan", "SwitchPlanner",
           "SwitchRefusal", "SwitchResult", "switch_tag"]
