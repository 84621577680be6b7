"""Live attention-layout switching (SPEC §4): rank 0 plans (`SwitchPlanner`), every rank executes
(`SwitchExecutor` through `SwitchLayout`) during one step. See docs/runtime.md, "Switching"."""

from splash.switch.executor import SwitchExecutor, SwitchResult, switch_tag
from splash.switch.layout import SwitchLayout
from splash.switch.plan import Headroom, LiveRequest, SwitchPlan, SwitchRefusal
from splash.switch.planner import SwitchPlanner

__all__ = ["Headroom", "LiveRequest", "SwitchExecutor", "SwitchLayout", "SwitchPlan", "SwitchPlanner",
           "SwitchRefusal", "SwitchResult", "switch_tag"]
