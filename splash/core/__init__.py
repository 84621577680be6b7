"""The analytical core (pure Python + numpy, no torch): which layout, how much memory, what a switch
costs. The runtime asks it for every decision and manifest; it never imports the runtime
(tests/test_imports.py checks). Its API: docs/analytics.md."""
