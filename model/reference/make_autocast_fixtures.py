"""PyTorch's mixed precision on weft-model's reference fixtures.

For each fixture under model/tests/fixtures/ (GPT-2, made by
make_fixtures.py) and model/tests/fixtures-llama/ (the Llama family, made
by make_llama_fixtures.py) it loads the float32 model and runs the same loss under
`torch.autocast("cpu", dtype=D)` for D in bfloat16 and float16 —
PyTorch's CPU mixed precision: 16-bit matrix products, f32 master
weights; one forward and backward, no loss scaling — and writes
  autocast_{bf16,fp16}.json               -- {"loss": ...}
  grads_autocast_{bf16,fp16}.safetensors  -- d loss / d parameter (float32)
beside the float64 reference. weft's mixed-precision test
(tests/it/reference.rs, tests/it/llama_reference.rs) holds its own error against the float64 answer
to PyTorch's, precision by precision.

    .venv/bin/python model/reference/make_autocast_fixtures.py
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOTS = [os.path.join(HERE, "..", "tests", r) for r in ("fixtures", "fixtures-llama")]


def main():
    for d in sorted(os.path.join(r, n) for r in ROOTS for n in os.listdir(r)):
        name = os.path.basename(d)
        if not os.path.exists(os.path.join(d, "grads.safetensors")):
            continue
        with open(os.path.join(d, "tokens.json")) as f:
            tok = json.load(f)
        inputs, targets = torch.tensor(tok["inputs"]), torch.tensor(tok["targets"])
        for tag, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16)]:
            model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
            vocab = model.config.vocab_size
            model.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                logits = model(inputs).logits
                loss = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1))
            loss.backward()
            grads = {n: p.grad.detach().float().contiguous() for n, p in model.named_parameters()}
            save_file(grads, os.path.join(d, f"grads_autocast_{tag}.safetensors"))
            with open(os.path.join(d, f"autocast_{tag}.json"), "w") as f:
                json.dump({"loss": loss.item(), "torch": torch.__version__}, f)
            print(f"{name}: autocast {tag} loss {loss.item():.8f} (f64 {tok['loss']:.8f})")


if __name__ == "__main__":
    main()
