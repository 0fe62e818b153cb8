"""An independent reader of the weft checkpoint format, used by the Rust tests.

It uses only the format as documented in the weft-checkpoint crate docs:
manifest.json (global shapes, shard offsets, byte offsets) and standard
safetensors files read by the `safetensors` package. It shares no code with
the Rust implementation.

    python weft_ckpt_check.py read CKPT_DIR EXPECTED_DIR
        Reassembles every tensor and compares it byte for byte with
        EXPECTED_DIR/<name>.bin (raw little-endian, row-major).
    python weft_ckpt_check.py hf HF_DIR CKPT_DIR PREFIX
        Loads HF_DIR with transformers' GPT2LMHeadModel, checks every
        parameter equals the checkpoint's PREFIX-named tensor, runs a
        forward pass.
"""

import json
import os
import sys

import numpy as np
from safetensors import safe_open

try:
    import torch

    FRAMEWORK = "pt"
except ImportError:  # numpy only: bf16 cannot be represented
    torch = None
    FRAMEWORK = "np"

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
         "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def raw_bytes(t):
    """Row-major little-endian bytes of a tensor/array as a flat uint8 array."""
    if torch is not None and isinstance(t, torch.Tensor):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def reassemble(ckpt_dir):
    """Yields (name, dtype, global shape, raw bytes of the whole tensor)."""
    with open(os.path.join(ckpt_dir, "manifest.json")) as f:
        m = json.load(f)
    assert m["format"] == "weft-checkpoint" and m["version"] == 1, m["format"]
    handles = {}
    for name, t in m["tensors"].items():
        es = SIZES[t["dtype"]]
        if FRAMEWORK == "np" and t["dtype"] == "BF16":
            print(f"skip {name}: bf16 needs torch")
            continue
        out = np.zeros(tuple(t["shape"]) + (es,), dtype=np.uint8)
        for s in t["shards"]:
            path = os.path.join(ckpt_dir, s["file"])
            if path not in handles:
                handles[path] = safe_open(path, framework=FRAMEWORK)
            piece = handles[path].get_tensor(name)
            assert list(piece.shape) == s["shape"], (name, piece.shape, s["shape"])
            b = raw_bytes(piece)
            assert len(b) == s["byte_len"], (name, len(b), s["byte_len"])
            # byte_offset is absolute in the file.
            with open(path, "rb") as f:
                f.seek(s["byte_offset"])
                assert f.read(s["byte_len"]) == b.tobytes(), f"{name}: byte_offset"
            idx = tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["shape"]))
            out[idx] = b.reshape(tuple(s["shape"]) + (es,))
        yield name, t["dtype"], t["shape"], out.reshape(-1)


def cmd_read(ckpt_dir, expected_dir):
    n = 0
    for name, _, _, got in reassemble(ckpt_dir):
        with open(os.path.join(expected_dir, name + ".bin"), "rb") as f:
            want = f.read()
        assert got.tobytes() == want, f"{name}: differs"
        n += 1
    print(f"ok {n} tensors")


def cmd_hf(hf_dir, ckpt_dir, prefix):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir)
    sd = model.state_dict()
    tensors = {name: raw for name, _, _, raw in reassemble(ckpt_dir)}
    checked = 0
    for key, value in sd.items():
        if key == "lm_head.weight":
            assert torch.equal(value, sd["transformer.wte.weight"]), "lm_head not tied"
            continue
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers in older transformers
        src = prefix + key[len("transformer."):]
        assert src in tensors, f"{src} missing"
        assert raw_bytes(value).tobytes() == tensors[src].tobytes(), f"{key} differs"
        checked += 1
    cfg = model.config
    ids = torch.arange(min(8, cfg.n_positions)).unsqueeze(0) % cfg.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    assert tuple(logits.shape) == (1, ids.shape[1], cfg.vocab_size), logits.shape
    assert torch.isfinite(logits).all()
    print(f"ok {checked} parameters, logits {tuple(logits.shape)}")


if __name__ == "__main__":
    if sys.argv[1] == "read":
        cmd_read(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "hf":
        cmd_hf(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
