"""splash: live switching of MLA attention layouts for LLM serving."""

__version__ = "0.1.0"
