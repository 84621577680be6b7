"""splash: live switching of MLA attention layouts for LLM serving.

`from splash import LLM, SamplingParams` (vLLM's shape) and `from splash import Engine` (SGLang's) work,
but importing `splash` alone stays light (no torch): the names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splash.version import __version__

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from splash.engine.outputs import CompletionOutput, RequestOutput
    from splash.engine.sampling import SamplingParams
    from splash.engine_api import Engine
    from splash.llm import LLM

_LAZY = {
    "LLM": "splash.llm",
    "Engine": "splash.engine_api",
    "SamplingParams": "splash.engine.sampling",
    "RequestOutput": "splash.engine.outputs",
    "CompletionOutput": "splash.engine.outputs",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'splash' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
