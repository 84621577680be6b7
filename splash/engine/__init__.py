"""Rank 0's request side: requests and their sequences (`request.py`), sampling parameters and the
sampler (`sampling.py`, `sampler.py`), detokenizing and stops (`detokenizer.py`), the scheduler
(`scheduler.py`), the synchronous engine and its asynchronous driver (`llm_engine.py`,
`async_engine.py`), the features around a step as stages (`stages/`: speculation, grammars, prompt
logprobs, routed experts, ...), what an RL trainer drives (`rl.py`, `weights.py`), the T ranks seen
from rank 0 (`group.py`, `group_runner.py`) and the builder that assembles it all from an EngineConfig
(`build.py`). It may import everything below it in docs/architecture.md's import order (the worker,
switch, model, kv, ...); only the offline API, the server and the commands import it."""
