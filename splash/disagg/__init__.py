"""Prefill/decode disaggregation (SGLang's `--disaggregation-mode`): the KV transfer between a prefill
engine and a decode engine (`transfer.py`). The engine's side of the protocol is a stage
(`splash/engine/stages/pd.py`); the HTTP side (bootstrap server, room mailbox) is the server's."""
