"""End-to-end check of weft's Hugging Face import and export against
transformers, for every fixture folder:

1. weft loads the folder transformers wrote, computes the loss and dumps all
   gradients (`--dump-grads`); they are compared with float64 PyTorch.
2. weft writes the model back out (`--save-to`); transformers'
   GPT2LMHeadModel.from_pretrained loads that folder and must reproduce
   the original model's logits exactly (same float32 weights).

    .venv/bin/python model/reference/check_export.py [path/to/eval-binary]

The eval binary defaults to `cargo run --release -p weft-model --example eval --`.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


def main():
    runner = sys.argv[1:] or ["cargo", "run", "-q", "--release", "-p", "weft-model", "--example", "eval", "--"]
    worst = 0.0
    for name in sorted(os.listdir(ROOT)):
        d = os.path.join(ROOT, name)
        with tempfile.TemporaryDirectory() as tmp:
            grads_path = os.path.join(tmp, "grads.safetensors")
            out_dir = os.path.join(tmp, "exported")
            res = subprocess.run(runner + ["--hf-model", d, "--tokens", os.path.join(d, "tokens.json"),
                                           "--dump-grads", grads_path, "--save-to", out_dir],
                                 check=True, capture_output=True, text=True)
            loss = json.loads(res.stdout)["loss"]
            tok = json.load(open(os.path.join(d, "tokens.json")))
            rel = abs(loss - tok["loss"]) / tok["loss"]
            ref = load_file(os.path.join(d, "grads.safetensors"))
            ours = load_file(grads_path)
            assert set(ref) == set(ours), (set(ref) ^ set(ours))
            g = max(((ours[k].double() - ref[k].double()).abs().max() / ref[k].double().abs().max()).item() for k in ref)
            worst = max(worst, g)
            orig = GPT2LMHeadModel.from_pretrained(d).eval()
            back = GPT2LMHeadModel.from_pretrained(out_dir).eval()
            x = torch.tensor(tok["inputs"])
            with torch.no_grad():
                same = torch.equal(orig(x).logits, back(x).logits)
            print(f"{name}: loss rel err {rel:.2e}, worst grad rel err {g:.2e}, "
                  f"transformers loads weft's export with identical logits: {same}")
            assert rel < 1e-5 and g < 1e-4 and same
    print(f"all fixtures OK (worst gradient rel err {worst:.2e})")


if __name__ == "__main__":
    main()
