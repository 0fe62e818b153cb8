//! The Llama family's Hugging Face format (`LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`): its
//! `config.json` read into a [`GptConfig`] with [`SwiGlu`], and its
//! tensors mapped to weft's layout.
//!
//! The names differ and so do some layouts. transformers keeps every
//! linear layer `[out, in]` (`nn.Linear`) and the query, key and value
//! projections apart; weft fuses them `[in, out]` (GPT-2's `Conv1D`
//! layout, which the block's kernels read):
//!
//! | weft | transformers |
//! |---|---|
//! | `transformer.wte.weight` | `model.embed_tokens.weight` |
//! | `transformer.h.{l}.ln_1.weight` | `model.layers.{l}.input_layernorm.weight` |
//! | `….attn.c_attn.weight (C, Cq+2·Ckv)` | `….self_attn.{q,k,v}_proj.weight`, stacked, transposed |
//! | `….attn.c_attn.bias` | `….self_attn.{q,k,v}_proj.bias`, concatenated (Qwen2) |
//! | `….attn.{q,k}_norm.weight` | `….self_attn.{q,k}_norm.weight` (Qwen3) |
//! | `….attn.c_proj.weight (Cq, C)` | `….self_attn.o_proj.weight`, transposed |
//! | `….ln_2.weight` | `….post_attention_layernorm.weight` |
//! | `….mlp.gate_up.weight (C, 2H)` | `….mlp.{gate,up}_proj.weight`, stacked, transposed |
//! | `….mlp.c_proj.weight (H, C)` | `….mlp.down_proj.weight`, transposed |
//! | `transformer.ln_f.weight` | `model.norm.weight` |
//! | `lm_head.weight` | `lm_head.weight` |

use serde_json::{Map, Value, json};
use weft_kernels::Llama3Scaling;

use super::fmt_err;
use crate::config::{BlockArch, GptConfig, Norm, Positions, Rotary, SlidingWindow};
use crate::error::{Error, Result};
use crate::ffn::SwiGlu;
use std::path::Path;

/// The transformers `model_type`s read here.
pub(super) const MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

/// Reads a Llama-family `config.json` object into the model's shape and
/// its gated feed-forward block. Settings weft does not implement are
/// rejected, naming the field.
pub(super) fn read_config(path: &Path, obj: &Map<String, Value>) -> Result<(GptConfig, SwiGlu)> {
    let kind = obj
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("llama");
    let bad = |field: &str, reason: String| fmt_err(path, format!("field `{field}` {reason}"));
    let uint = |name: &str| -> Result<Option<usize>> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| bad(name, format!("= {x} is not a non-negative integer"))),
        }
    };
    let need = |name: &str| -> Result<usize> {
        uint(name)?.ok_or_else(|| {
            fmt_err(
                path,
                format!("missing field `{name}` (is this a {kind} config.json?)"),
            )
        })
    };
    let float = |v: Option<&Value>, name: &str| -> Result<Option<f64>> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(name, format!("= {x} is not a number"))),
        }
    };
    let flag = |name: &str, default: bool| -> Result<bool> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| bad(name, format!("= {x} is not a boolean"))),
        }
    };
    let act = obj
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(bad(
            "hidden_act",
            format!("= \"{act}\" is not supported; weft implements SwiGLU (\"silu\")"),
        ));
    }
    if flag("mlp_bias", false)? {
        return Err(bad("mlp_bias", "= true is not supported".into()));
    }
    let n_head = need("num_attention_heads")?;
    let n_embd = need("hidden_size")?;
    // transformers 5 nests the rotary settings in `rope_parameters`;
    // version 4 has `rope_theta` and `rope_scaling` at the top.
    let rope = obj
        .get("rope_parameters")
        .and_then(Value::as_object)
        .or_else(|| obj.get("rope_scaling").and_then(Value::as_object));
    let theta = float(
        rope.and_then(|r| r.get("rope_theta"))
            .or_else(|| obj.get("rope_theta")),
        "rope_theta",
    )?
    .unwrap_or(10_000.0);
    let scaling = match rope {
        None => None,
        Some(r) => {
            let ty = r
                .get("rope_type")
                .or_else(|| r.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match ty {
                "default" => None,
                "llama3" => {
                    let f = |k: &str| -> Result<f64> {
                        float(r.get(k), k)?
                            .ok_or_else(|| bad("rope_parameters", format!("lacks `{k}`")))
                    };
                    let old = r
                        .get("original_max_position_embeddings")
                        .and_then(Value::as_u64)
                        .and_then(|x| usize::try_from(x).ok())
                        .ok_or_else(|| {
                            bad(
                                "rope_parameters",
                                "lacks `original_max_position_embeddings`".into(),
                            )
                        })?;
                    Some(Llama3Scaling {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position: old,
                    })
                }
                other => {
                    return Err(bad(
                        "rope_parameters",
                        format!(
                            "rope_type \"{other}\" is not supported (\"default\" and \"llama3\" are)"
                        ),
                    ));
                }
            }
        }
    };
    let partial = float(
        rope.and_then(|r| r.get("partial_rotary_factor"))
            .or_else(|| obj.get("partial_rotary_factor")),
        "partial_rotary_factor",
    )?;
    // `head_dim` is kept only where it differs from the width's share.
    let head_dim = uint("head_dim")?.filter(|&d| d * n_head != n_embd);
    let hs = head_dim.unwrap_or(n_embd / n_head.max(1));
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rotary_dim = partial.map(|f| (hs as f64 * f) as usize);
    let n_layer = need("num_hidden_layers")?;
    let sliding_window = read_window(path, obj, kind, n_layer)?;
    let (qkv_bias, qk_norm) = match kind {
        "qwen2" => (true, false),
        "qwen3" | "qwen3_moe" => (flag("attention_bias", false)?, true),
        _ => (flag("attention_bias", false)?, false),
    };
    // Llama's `attention_bias` puts a bias on o_proj too; Qwen's does not.
    let proj_bias = matches!(kind, "llama" | "mistral") && qkv_bias;
    let eps = float(obj.get("rms_norm_eps"), "rms_norm_eps")?.unwrap_or(1e-6);
    #[allow(clippy::cast_possible_truncation)]
    let cfg = GptConfig {
        n_layer,
        n_head,
        n_embd,
        vocab_size: need("vocab_size")?,
        block_size: need("max_position_embeddings")?,
        tied_embeddings: flag("tie_word_embeddings", false)?,
        layer_norm_epsilon: eps as f32,
        arch: BlockArch {
            n_kv_head: Some(uint("num_key_value_heads")?.unwrap_or(n_head)),
            head_dim,
            norm: Norm::RmsNorm,
            positions: Positions::Rotary(Rotary {
                theta,
                rotary_dim,
                scaling,
            }),
            qkv_bias,
            proj_bias,
            qk_norm,
            sliding_window,
        },
    };
    cfg.validate().map_err(|e| fmt_err(path, e.to_string()))?;
    let hidden = need("intermediate_size")?;
    Ok((cfg, SwiGlu { hidden }))
}

/// The sliding-window layers: Mistral's `sliding_window` (every layer),
/// or `layer_types` (Qwen, Gemma: "sliding_attention" or
/// "full_attention" per layer), which weft takes when every
/// `global_every`-th layer is the full one.
fn read_window(
    path: &Path,
    obj: &Map<String, Value>,
    kind: &str,
    n_layer: usize,
) -> Result<Option<SlidingWindow>> {
    let window = match obj.get("sliding_window") {
        None | Some(Value::Null) => return Ok(None),
        Some(x) => x
            .as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| fmt_err(path, format!("field `sliding_window` = {x} is not a count")))?,
    };
    if kind != "mistral" && obj.get("use_sliding_window").and_then(Value::as_bool) != Some(true) {
        return Ok(None);
    }
    let Some(types) = obj.get("layer_types").and_then(Value::as_array) else {
        return Ok(Some(SlidingWindow {
            window,
            global_every: None,
        }));
    };
    let global: Vec<bool> = types
        .iter()
        .map(|t| t.as_str() == Some("full_attention"))
        .collect();
    if global.len() != n_layer {
        return Err(fmt_err(
            path,
            format!(
                "field `layer_types` has {} entries for {n_layer} layers",
                global.len()
            ),
        ));
    }
    let every = global.iter().position(|&g| g).map(|first| first + 1);
    let fits = global
        .iter()
        .enumerate()
        .all(|(l, &g)| g == every.is_some_and(|e| (l + 1).is_multiple_of(e)));
    if !fits {
        return Err(fmt_err(
            path,
            "field `layer_types`: weft takes sliding layers with every k-th layer full \
             (e.g. 5 local : 1 global), not this pattern",
        ));
    }
    Ok(Some(SlidingWindow {
        window,
        global_every: every,
    }))
}

/// How one weft tensor is made from transformers' tensors: the
/// transformers names stacked along dimension 0 (each `[rows, cols]`, or
/// a vector), then transposed if `transpose`.
pub(super) struct Source {
    pub(super) names: Vec<String>,
    pub(super) transpose: bool,
}

/// The transformers tensors that make weft's tensor `name`.
pub(super) fn source(name: &str) -> Option<Source> {
    let one = |n: String, transpose| {
        Some(Source {
            names: vec![n],
            transpose,
        })
    };
    match name {
        "transformer.wte.weight" => return one("model.embed_tokens.weight".into(), false),
        "transformer.ln_f.weight" => return one("model.norm.weight".into(), false),
        "lm_head.weight" => return one("lm_head.weight".into(), false),
        _ => {}
    }
    let rest = name.strip_prefix("transformer.h.")?;
    let (l, what) = rest.split_once('.')?;
    let p = format!("model.layers.{l}.");
    let stack = |parts: &[&str], transpose| {
        Some(Source {
            names: parts.iter().map(|s| format!("{p}{s}")).collect(),
            transpose,
        })
    };
    match what {
        "ln_1.weight" => one(format!("{p}input_layernorm.weight"), false),
        "ln_2.weight" => one(format!("{p}post_attention_layernorm.weight"), false),
        "attn.c_attn.weight" => stack(
            &[
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ],
            true,
        ),
        "attn.c_attn.bias" => stack(
            &[
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
            ],
            false,
        ),
        "attn.q_norm.weight" => one(format!("{p}self_attn.q_norm.weight"), false),
        "attn.k_norm.weight" => one(format!("{p}self_attn.k_norm.weight"), false),
        "attn.c_proj.weight" => one(format!("{p}self_attn.o_proj.weight"), true),
        "attn.c_proj.bias" => one(format!("{p}self_attn.o_proj.bias"), false),
        "mlp.gate_up.weight" => stack(&["mlp.gate_proj.weight", "mlp.up_proj.weight"], true),
        "mlp.c_proj.weight" => one(format!("{p}mlp.down_proj.weight"), true),
        _ => super::qwen3_moe::source(&p, what),
    }
}

/// `x (rows, cols)` transposed.
pub(super) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

/// The `config.json` weft writes for a Llama-family model
/// (`model_type` "qwen3" with QK-norm, "mistral" with a window on every
/// layer, "qwen2" with query/key/value biases, else "llama").
pub(super) fn config_json(cfg: &GptConfig, hidden: usize) -> Value {
    let a = &cfg.arch;
    let kind = if a.qk_norm {
        "qwen3"
    } else if a.sliding_window.is_some_and(|w| w.global_every.is_none()) {
        "mistral"
    } else if a.qkv_bias && !a.proj_bias {
        "qwen2"
    } else {
        "llama"
    };
    let arch = match kind {
        "qwen3" => "Qwen3ForCausalLM",
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut rope = Map::new();
    if let Positions::Rotary(r) = a.positions {
        rope.insert("rope_theta".into(), json!(r.theta));
        match r.scaling {
            None => {
                rope.insert("rope_type".into(), json!("default"));
            }
            Some(s) => {
                rope.insert("rope_type".into(), json!("llama3"));
                rope.insert("factor".into(), json!(s.factor));
                rope.insert("low_freq_factor".into(), json!(s.low_freq_factor));
                rope.insert("high_freq_factor".into(), json!(s.high_freq_factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    json!(s.original_max_position),
                );
            }
        }
        if let Some(rd) = r.rotary_dim {
            #[allow(clippy::cast_precision_loss)]
            rope.insert(
                "partial_rotary_factor".into(),
                json!(rd as f64 / cfg.head_dim() as f64),
            );
        }
    }
    let mut v = json!({
        "architectures": [arch],
        "model_type": kind,
        "hidden_act": "silu",
        "hidden_size": cfg.n_embd,
        "intermediate_size": hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head(),
        "head_dim": cfg.head_dim(),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": if kind == "qwen2" { false } else { a.qkv_bias },
        "mlp_bias": false,
        "attention_dropout": 0.0,
        "rope_parameters": Value::Object(rope.clone()),
        "rope_theta": rope.get("rope_theta").cloned().unwrap_or(json!(10000.0)),
        "torch_dtype": "float32",
        "use_cache": true,
    });
    if let (Some(w), Some(o)) = (a.sliding_window, v.as_object_mut()) {
        o.insert("sliding_window".into(), json!(w.window));
        if kind != "mistral" {
            o.insert("use_sliding_window".into(), json!(true));
            let types: Vec<&str> = (0..cfg.n_layer)
                .map(|l| {
                    if cfg.window(l).is_some() {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            o.insert("layer_types".into(), json!(types));
        }
    }
    v
}

/// An error for a tensor the mapping cannot build.
pub(super) fn shape_error(path: &Path, name: &str, reason: String) -> Error {
    Error::Tensor {
        path: path.to_path_buf(),
        tensor: name.into(),
        reason,
    }
}
