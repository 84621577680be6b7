"""What every rank runs, rank 0 included: the plan loop a worker rank follows for life (`loop.py`), the
model runner (`runner.py`) and the step context it builds (`context.py`), loading a rank's share from
the engine config (`load.py`, `sizing.py`), weight updates and memory release as a rank does them
(`weights.py`), CUDA graphs (`cuda_graph.py`) and the host allocator's tuning (`host_malloc.py`). It may
import the step message, kv, model, attention and switch (the executor), never rank 0's engine."""
