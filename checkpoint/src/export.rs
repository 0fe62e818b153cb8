//! Consolidated export to a Hugging Face GPT-2 folder.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::Path;

use serde_json::json;

use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::read::Checkpoint;
use crate::safetensors::build_header;

/// Options of [`export_hf_gpt2`].
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Export {
    /// Prefix of the model's tensors in the checkpoint (e.g. `"params."`);
    /// what follows it must be the Hugging Face GPT-2 name (`wte.weight`,
    /// `h.0.attn.c_attn.weight`, ...). Other tensors (optimizer state) are
    /// left out.
    pub prefix: String,
    /// Number of attention heads (not recoverable from shapes).
    pub n_head: u64,
    /// Layer-norm epsilon.
    pub layer_norm_epsilon: f64,
    /// GELU variant as transformers names it (`"gelu_new"` is the tanh
    /// approximation GPT-2 uses).
    pub activation_function: String,
}

impl Gpt2Export {
    /// GPT-2 defaults with `n_head` heads and tensors named with `prefix`.
    pub fn new(prefix: &str, n_head: u64) -> Self {
        Gpt2Export {
            prefix: prefix.to_owned(),
            n_head,
            layer_norm_epsilon: 1e-5,
            activation_function: "gelu_new".to_owned(),
        }
    }
}

/// What [`export_hf_gpt2`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportReport {
    /// Number of tensors in `model.safetensors`.
    pub tensors: usize,
    /// Size of `model.safetensors`.
    pub bytes: u64,
    /// The `config.json` written.
    pub config: serde_json::Value,
}

/// Writes `out/model.safetensors` (every GPT-2 parameter consolidated into
/// one tensor, named as `GPT2LMHeadModel`'s state dict: `transformer.wte.weight`,
/// `transformer.h.0.attn.c_attn.weight`, ...; Conv1D weights as `(in, out)`;
/// the LM head is tied to `wte`) and `out/config.json`, so that
/// `transformers.GPT2LMHeadModel.from_pretrained(out)` loads it. Dimensions
/// (vocab, positions, width, layers, MLP width) are read from the shapes
/// and cross-checked; each file is written to a temporary name, fsynced and
/// renamed.
///
/// # Errors
/// [`Error::Export`] naming a missing tensor or a shape that does not fit;
/// read errors of the checkpoint; [`Error::Io`].
pub fn export_hf_gpt2(ckpt: &Checkpoint, out: &Path, opts: &Gpt2Export) -> Result<ExportReport> {
    let tensors = &ckpt.manifest().tensors;
    let get = |name: &str| {
        let full = format!("{}{name}", opts.prefix);
        tensors
            .get(&full)
            .map(|t| (full, t))
            .ok_or_else(|| Error::Export {
                reason: format!(
                    "tensor `{}{name}` is missing from {}",
                    opts.prefix,
                    ckpt.dir().display()
                ),
            })
    };
    let (_, wte) = get("wte.weight")?;
    let (_, wpe) = get("wpe.weight")?;
    let (&[vocab, c], &[n_pos, c2]) = (wte.shape.as_slice(), wpe.shape.as_slice()) else {
        return Err(Error::Export {
            reason: format!(
                "wte {:?} and wpe {:?} must be matrices",
                wte.shape, wpe.shape
            ),
        });
    };
    if c != c2 || opts.n_head == 0 || c % opts.n_head != 0 {
        return Err(Error::Export {
            reason: format!(
                "width {c} (wte) vs {c2} (wpe) must agree and divide by n_head {}",
                opts.n_head
            ),
        });
    }
    let n_layer = (0..)
        .take_while(|i| tensors.contains_key(&format!("{}h.{i}.ln_1.weight", opts.prefix)))
        .count() as u64;
    let inner = get("h.0.mlp.c_fc.weight")
        .ok()
        .and_then(|(_, t)| t.shape.get(1).copied())
        .unwrap_or(4 * c);
    let mut want: Vec<(String, Vec<u64>)> = vec![
        ("wte.weight".into(), vec![vocab, c]),
        ("wpe.weight".into(), vec![n_pos, c]),
    ];
    for i in 0..n_layer {
        let h = |s: &str| format!("h.{i}.{s}");
        want.extend([
            (h("ln_1.weight"), vec![c]),
            (h("ln_1.bias"), vec![c]),
            (h("attn.c_attn.weight"), vec![c, 3 * c]),
            (h("attn.c_attn.bias"), vec![3 * c]),
            (h("attn.c_proj.weight"), vec![c, c]),
            (h("attn.c_proj.bias"), vec![c]),
            (h("ln_2.weight"), vec![c]),
            (h("ln_2.bias"), vec![c]),
            (h("mlp.c_fc.weight"), vec![c, inner]),
            (h("mlp.c_fc.bias"), vec![inner]),
            (h("mlp.c_proj.weight"), vec![inner, c]),
            (h("mlp.c_proj.bias"), vec![c]),
        ]);
    }
    want.extend([
        ("ln_f.weight".into(), vec![c]),
        ("ln_f.bias".into(), vec![c]),
    ]);
    let mut table = Vec::with_capacity(want.len());
    let mut dtypes = BTreeMap::new();
    for (name, shape) in &want {
        let (full, t) = get(name)?;
        if &t.shape != shape {
            return Err(Error::Export {
                reason: format!(
                    "`{full}` has shape {:?}, GPT-2 with these dimensions needs {shape:?}",
                    t.shape
                ),
            });
        }
        if !matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(Error::Export {
                reason: format!("`{full}` is {}, expected F32, F16 or BF16", t.dtype),
            });
        }
        *dtypes.entry(t.dtype).or_insert(0usize) += 1;
        let bytes = shape.iter().product::<u64>() * t.dtype.size_bytes() as u64;
        table.push((
            format!("transformer.{name}"),
            full,
            t.dtype,
            shape.clone(),
            bytes,
        ));
    }
    let dtype = dtypes
        .iter()
        .max_by_key(|d| d.1)
        .map(|d| *d.0)
        .unwrap_or(Dtype::F32);
    let torch_dtype = match dtype {
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        _ => "float32",
    };
    fs::create_dir_all(out).ctx("create folder", out)?;
    let header_rows: Vec<(&str, Dtype, &[u64], u64)> = table
        .iter()
        .map(|(n, _, d, s, b)| (n.as_str(), *d, s.as_slice(), *b))
        .collect();
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let (header, _) = build_header(&header_rows, &metadata);
    let tmp = out.join("model.safetensors.tmp");
    let mut f = File::create(&tmp).ctx("create", &tmp)?;
    let mut pos = 0u64;
    write_all(&mut f, &tmp, &header, &mut pos)?;
    for (_, full, _, _, _) in &table {
        let data = ckpt.read_tensor(full)?;
        write_all(&mut f, &tmp, &data, &mut pos)?;
    }
    f.sync_all().ctx("fsync", &tmp)?;
    drop(f);
    fs::rename(&tmp, out.join("model.safetensors"))
        .ctx("rename to", out.join("model.safetensors"))?;
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": n_pos,
        "n_ctx": n_pos,
        "n_embd": c,
        "n_layer": n_layer,
        "n_head": opts.n_head,
        "n_inner": inner,
        "activation_function": opts.activation_function,
        "layer_norm_epsilon": opts.layer_norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "tie_word_embeddings": true,
        "torch_dtype": torch_dtype,
        "weft_step": ckpt.step(),
    });
    let ctmp = out.join("config.json.tmp");
    let mut text = serde_json::to_vec_pretty(&config).unwrap_or_default();
    text.push(b'\n');
    fs::write(&ctmp, &text).ctx("write", &ctmp)?;
    File::open(&ctmp)
        .and_then(|f| f.sync_all())
        .ctx("fsync", &ctmp)?;
    fs::rename(&ctmp, out.join("config.json")).ctx("rename to", out.join("config.json"))?;
    File::open(out)
        .and_then(|d| d.sync_all())
        .ctx("fsync folder", out)?;
    Ok(ExportReport {
        tensors: table.len(),
        bytes: pos,
        config,
    })
}

fn write_all(f: &mut File, path: &Path, buf: &[u8], pos: &mut u64) -> Result<()> {
    use std::io::Write;
    f.write_all(buf).ctx("write", path)?;
    *pos += buf.len() as u64;
    Ok(())
}
