"""transformers' sharded Hugging Face folders, both ways (run by
model/tests/it/hf_python.rs):

    python hf_sharded_check.py make DIR
        a random small LlamaForCausalLM (grouped-query, untied) saved by
        `save_pretrained(DIR, max_shard_size="64KB")`: several
        model-0000i-of-0000n.safetensors files and model.safetensors.index.json;
        tokens.json holds a batch and its loss in float64, and a prompt
        with transformers' greedy `generate` continuation (float32).

    python hf_sharded_check.py check DIR EXPORT
        transformers loads EXPORT (weft's sharded save of DIR) and computes
        logits identical to DIR's (the same float32 weights); prints the loss.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def make(out):
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.dim() == 1 else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True, max_shard_size="64KB")
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    inputs = torch.randint(0, cfg.vocab_size, (2, 11))
    targets = torch.randint(0, cfg.vocab_size, (2, 11))
    m64 = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").double().eval()
    with torch.no_grad():
        logits = m64(inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)).item()
    # greedy decoding in float32 with transformers' own KV cache
    m32 = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    prompt = inputs[:1, :5]
    with torch.no_grad():
        # every prompt position attended (a token equal to pad_token_id
        # would otherwise be masked out)
        gen = m32.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                           do_sample=False, pad_token_id=0)
    greedy = gen[0, prompt.shape[1]:].tolist()
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump({"inputs": inputs.tolist(), "targets": targets.tolist(), "loss": loss,
                   "prompt": prompt[0].tolist(), "greedy": greedy}, f)
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"made {len(shards)} shards, loss {loss:.10f}")


def check(orig_dir, export_dir):
    tok = json.load(open(os.path.join(orig_dir, "tokens.json")))
    x = torch.tensor(tok["inputs"])
    a = LlamaForCausalLM.from_pretrained(orig_dir, attn_implementation="eager").eval()
    b = LlamaForCausalLM.from_pretrained(export_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
    same = torch.equal(la, lb)
    loss = F.cross_entropy(lb.reshape(-1, lb.shape[-1]).double(), torch.tensor(tok["targets"]).reshape(-1)).item()
    print(json.dumps({"identical_logits": same, "loss": loss}))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3])
