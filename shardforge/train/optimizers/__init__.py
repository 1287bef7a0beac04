"""The optimizer menu of `train.optimizer.name` beyond AdamW (docs/optimizers.md): groups by LLaMA-Factory's
rules (groups.py), Muon + AdamW as one optimizer (muon.py), GaLore / APOLLO (projected.py), and the builders
of every choice from its reference package (menu.py). `train/optim.py: build_optimizer` dispatches here."""
