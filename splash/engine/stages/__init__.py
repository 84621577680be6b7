"""The stages of a step, registered once per engine (`build_stages`), in the order their hooks run.

Order matters where two stages meet the same point: the switcher plans a switch into the step before
routing and prompt logprobs read its slices; stop strings are checked before a grammar's end (vLLM's
order). A new feature is a new file here with a `Stage` (splash/engine/stages/base.py) and one line
below; its per-request state lives in its own table, not on `Sequence`.
"""

from __future__ import annotations

from typing import Any

from splash.engine.stages.base import Delegate, Hooks, Stage
from splash.engine.stages.detok import Detokenize
from splash.engine.stages.grammar import Grammar
from splash.engine.stages.logprobs import Logprobs
from splash.engine.stages.metrics import Metrics
from splash.engine.stages.pd import PD
from splash.engine.stages.prompt_logprobs import PromptLogprobsStage
from splash.engine.stages.routing import Routing
from splash.engine.stages.snapshots import Snapshots
from splash.engine.stages.speculation import Speculation
from splash.engine.stages.switch import Switching

__all__ = ["PARTS", "Delegate", "Hooks", "Stage", "build_stages"]

# the stages whose names the engine answers (its attribute: their NAMES)
PARTS = {"metrics": Metrics.NAMES, "guided": Grammar.NAMES, "speculation": Speculation.NAMES}


def build_stages(engine: Any) -> Hooks:
    """Every stage of `engine`, each also an attribute of it (`metrics`, `guided`, `speculation`, ...)."""
    engine.metrics = Metrics()
    engine.guided = Grammar(engine)
    engine.speculation = Speculation(engine)
    engine.pd = PD(engine)  # prefill/decode disaggregation: its two stages
    return Hooks([engine.metrics, Snapshots(engine), Switching(engine), Routing(engine),
                  PromptLogprobsStage(), Logprobs(), Detokenize(engine), engine.guided, engine.speculation,
                  *engine.pd.stages])
