"""What every model family shares: the decoder config (common/config.py), attention over packed rows and a
KV cache's protocol (common/attention.py), the decoder cost model (common/costs.py) and the protocol a model
implements for the layouts, checkpoints and inference (common/protocol.py)."""
