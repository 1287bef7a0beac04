"""`shardforge eval`: prediction with generation scored with LLaMA-Factory's BLEU/ROUGE (predict.py,
similarity.py), and lm-evaluation-harness tasks run on our model (harness.py, the bundled tasks/)."""
