"""The step message: what rank 0 tells every rank each step (`plan.py`: StepPlan, SeqSlice), its compact
binary form on the wire (`wire.py`) and the page tables each rank keeps from those messages
(`tables.py`). Plain data shared by rank 0's engine, the per-rank worker and the switch; it may import
only the analytical core and the config (docs/architecture.md, "Import order")."""
