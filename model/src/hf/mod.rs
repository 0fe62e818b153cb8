//! Import and export of the Hugging Face formats: a folder with
//! `config.json` and `model.safetensors` (or shards listed by
//! `model.safetensors.index.json`), for GPT-2 (`GPT2LMHeadModel`)
//! and the Llama family (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`; names and layouts mapped as
//! the `llama` module's table shows), and Qwen3-MoE
//! (`Qwen3MoeForCausalLM`, the `qwen3_moe` module).

mod files;
mod llama;
mod qwen3_moe;

pub use files::MAX_SHARD_BYTES;
use files::Weights;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, tensor::TensorView};
use serde_json::{Value, json};

use std::sync::Arc;

use weft_parallel::ParamLayout;

use crate::config::GptConfig;
use crate::error::{Error, Result, io};
use crate::ffn::{FeedForward, SwiGlu};
use crate::gpt::Gpt;

fn fmt_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads a GPT-2 `config.json` (transformers' `GPT2Config`).
///
/// Required: `n_layer`, `n_head`, `n_embd`, `vocab_size`, `n_positions` (or
/// `n_ctx`). Optional: `layer_norm_epsilon` (1e-5), `tie_word_embeddings`
/// (true). Settings weft does not implement are rejected rather than
/// silently ignored: an activation other than the tanh GELU, `n_inner`
/// other than 4·n_embd, `scale_attn_by_inverse_layer_idx`.
///
/// # Errors
/// [`Error::Io`] if unreadable, [`Error::Format`] naming the field otherwise.
pub fn read_config(path: &Path) -> Result<GptConfig> {
    let text = weft_trace::input::read_to_string(path, weft_trace::input::CONFIG_BYTES)
        .map_err(io(path))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| fmt_err(path, format!("not valid JSON ({e}); expected a GPT2Config")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| fmt_err(path, "expected a JSON object"))?;
    let uint = |names: &[&str]| -> Result<usize> {
        for n in names {
            if let Some(x) = obj.get(*n) {
                return x
                    .as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| {
                        fmt_err(
                            path,
                            format!("field `{n}` = {x} is not a non-negative integer"),
                        )
                    });
            }
        }
        Err(fmt_err(
            path,
            format!(
                "missing field `{}` (is this a GPT-2 config.json?)",
                names[0]
            ),
        ))
    };
    if let Some(t) = obj.get("model_type").and_then(Value::as_str)
        && t != "gpt2"
    {
        return Err(fmt_err(
            path,
            format!("model_type is \"{t}\", expected \"gpt2\""),
        ));
    }
    let act = obj
        .get("activation_function")
        .and_then(Value::as_str)
        .unwrap_or("gelu_new");
    if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") {
        return Err(fmt_err(
            path,
            format!(
                "activation_function \"{act}\" is not supported; weft implements the tanh GELU (\"gelu_new\")"
            ),
        ));
    }
    let n_embd = uint(&["n_embd"])?;
    if let Some(inner) = obj.get("n_inner")
        && !inner.is_null()
        && inner.as_u64() != Some(4 * n_embd as u64)
    {
        return Err(fmt_err(
            path,
            format!(
                "n_inner = {inner}: only null or 4*n_embd = {} is supported",
                4 * n_embd
            ),
        ));
    }
    if obj
        .get("scale_attn_by_inverse_layer_idx")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(fmt_err(
            path,
            "scale_attn_by_inverse_layer_idx = true is not supported",
        ));
    }
    if obj.get("scale_attn_weights").and_then(Value::as_bool) == Some(false) {
        return Err(fmt_err(path, "scale_attn_weights = false is not supported"));
    }
    #[allow(clippy::cast_possible_truncation)]
    let eps = match obj.get("layer_norm_epsilon") {
        None => 1e-5,
        Some(x) => x.as_f64().ok_or_else(|| {
            fmt_err(
                path,
                format!("field `layer_norm_epsilon` = {x} is not a number"),
            )
        })? as f32,
    };
    let tied = match obj.get("tie_word_embeddings") {
        None => true,
        Some(x) => x.as_bool().ok_or_else(|| {
            fmt_err(
                path,
                format!("field `tie_word_embeddings` = {x} is not a boolean"),
            )
        })?,
    };
    let cfg = GptConfig {
        n_layer: uint(&["n_layer"])?,
        n_head: uint(&["n_head"])?,
        n_embd,
        vocab_size: uint(&["vocab_size"])?,
        block_size: uint(&["n_positions", "n_ctx"])?,
        tied_embeddings: tied,
        layer_norm_epsilon: eps,
        arch: crate::BlockArch::GPT2,
    };
    cfg.validate().map_err(|e| fmt_err(path, e.to_string()))?;
    Ok(cfg)
}

fn to_f32(path: &Path, name: &str, dtype: Dtype, d: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        #[allow(clippy::cast_possible_truncation)]
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| weft_numerics::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|b| weft_numerics::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::Tensor {
                path: path.to_path_buf(),
                tensor: name.into(),
                reason: format!(
                    "dtype {other:?} is not a floating-point type weft reads (F32, F64, F16, BF16)"
                ),
            });
        }
    })
}

/// What a `config.json` describes.
pub(crate) enum Family {
    /// `GPT2LMHeadModel`.
    Gpt2(GptConfig),
    /// A Llama-family model and its gated feed-forward block.
    Llama(GptConfig, SwiGlu),
    /// A Qwen3-MoE model: its dense layers' gated block
    /// (`intermediate_size`, used only by the first dense layers) and its
    /// mixture of experts (a [`MoeFfn`](crate::MoeFfn)).
    Moe(GptConfig, SwiGlu, Arc<dyn FeedForward>),
}

fn read_family(path: &Path) -> Result<Family> {
    let text = weft_trace::input::read_to_string(path, weft_trace::input::CONFIG_BYTES)
        .map_err(io(path))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| {
        fmt_err(
            path,
            format!("not valid JSON ({e}); expected a config.json"),
        )
    })?;
    let kind = v.get("model_type").and_then(Value::as_str);
    match (kind, v.as_object()) {
        (Some(qwen3_moe::MODEL_TYPE), Some(obj)) => qwen3_moe::read_config(path, obj),
        (Some(k), Some(obj)) if llama::MODEL_TYPES.contains(&k) => {
            let (cfg, ffn) = llama::read_config(path, obj)?;
            Ok(Family::Llama(cfg, ffn))
        }
        _ => Ok(Family::Gpt2(read_config(path)?)),
    }
}

/// A Hugging Face folder's model (`config.json`): its shape and its
/// feed-forward blocks.
///
/// # Errors
/// As [`load`]'s reading of `config.json`.
pub(crate) fn read_folder_config(dir: &Path) -> Result<Family> {
    if !dir.is_dir() {
        return Err(fmt_err(
            dir,
            "not a directory; expected a Hugging Face folder with config.json and model.safetensors",
        ));
    }
    read_family(&dir.join("config.json"))
}

/// Reads a Llama-family (or Qwen3-MoE) folder's `config.json`: the
/// model's shape and its feed-forward block (transformers' field names;
/// unsupported settings are errors naming the field).
///
/// # Errors
/// [`Error::Io`] if unreadable, [`Error::Format`] naming the field, or if
/// the folder holds another family.
pub fn read_llama_config(path: &Path) -> Result<(GptConfig, Arc<dyn FeedForward>)> {
    match read_family(path)? {
        Family::Llama(cfg, ffn) => Ok((cfg, Arc::new(ffn))),
        Family::Moe(cfg, _, ffn) => Ok((cfg, ffn)),
        Family::Gpt2(_) => Err(fmt_err(
            path,
            format!(
                "not a Llama-family config.json (model_type one of {:?})",
                llama::MODEL_TYPES
            ),
        )),
    }
}

/// Reads the tensors of a Llama-family safetensors file under
/// transformers' names (weights, or gradients saved under the same names)
/// into a buffer of `layout` (a whole model's: one rank, no split),
/// fusing and transposing as the `llama` module's table shows. Every
/// stored tensor must be used.
///
/// # Errors
/// [`Error::Io`], [`Error::Format`] for an unreadable file,
/// [`Error::MissingTensor`], [`Error::TensorShape`], [`Error::Tensor`] for
/// an unsupported dtype or a tensor the model does not have.
pub fn read_params(layout: &ParamLayout, path: &Path) -> Result<Vec<f32>> {
    let weights = if path.is_dir() {
        Weights::folder(path)?
    } else {
        Weights::file(path)?
    };
    params_from(layout, &weights)
}

fn params_from(layout: &ParamLayout, stored: &Weights) -> Result<Vec<f32>> {
    let path = stored.path_of("");
    let mut used = std::collections::HashSet::new();
    let mut out = vec![0.0f32; layout.len()];
    for spec in layout.specs() {
        if let Some(data) = qwen3_moe::read_tensor(stored, &mut used, spec)? {
            out[spec.range()].copy_from_slice(&data);
            continue;
        }
        let src = llama::source(&spec.name).ok_or_else(|| {
            llama::shape_error(path, &spec.name, "has no transformers counterpart".into())
        })?;
        let mut rows = 0;
        let mut cols = None;
        for name in &src.names {
            let shape = stored.shape(name).ok_or_else(|| Error::MissingTensor {
                path: path.to_path_buf(),
                tensor: name.clone(),
            })?;
            let (r, c) = match shape {
                [r] => (*r, 1),
                [r, c] => (*r, *c),
                _ => (0, usize::MAX),
            };
            if c == usize::MAX || cols.is_some_and(|k| k != c) {
                return Err(llama::shape_error(
                    stored.path_of(name),
                    name,
                    format!("shape {shape:?} does not stack into {}", spec.name),
                ));
            }
            cols = Some(c);
            rows += r;
        }
        let cols = cols.unwrap_or(1);
        let want: Vec<usize> = if src.transpose {
            vec![cols, rows]
        } else if spec.shape.len() == 1 {
            vec![rows]
        } else {
            vec![rows, cols]
        };
        if want != spec.shape {
            return Err(Error::TensorShape {
                path: stored.path_of(&src.names[0]).to_path_buf(),
                tensor: src.names.join(" + "),
                expected: spec.shape.clone(),
                got: want,
            });
        }
        let mut data = Vec::with_capacity(spec.numel());
        for name in &src.names {
            data.extend(stored.read_f32(name)?);
            used.insert(name.clone());
        }
        if src.transpose {
            data = llama::transpose(&data, rows, cols);
        }
        out[spec.range()].copy_from_slice(&data);
    }
    let mut extra: Vec<&String> = stored.names().filter(|k| !used.contains(*k)).collect();
    extra.sort();
    if let Some(name) = extra.first() {
        let tied = *name == "lm_head.weight";
        return Err(llama::shape_error(
            stored.path_of(name),
            name,
            if tied {
                "config.json ties the embeddings, yet the file has its own lm_head.weight".into()
            } else {
                "not a parameter of the model config.json describes; config and weights do not match"
                    .into()
            },
        ));
    }
    Ok(out)
}

/// A Llama-family model's tensors (`buffer`: its parameters, or its
/// gradients) under transformers' names and layouts (the inverse of
/// [`read_params`]).
fn llama_tensors(model: &Gpt, buffer: &[f32]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let cfg = model.config();
    let mut out = Vec::new();
    for spec in model.layout().specs() {
        let p = &buffer[spec.range()];
        if let Some(tensors) = qwen3_moe::write_tensor(spec, p) {
            out.extend(tensors);
            continue;
        }
        let Some(src) = llama::source(&spec.name) else {
            continue;
        };
        let (rows, cols, data) = match spec.shape.as_slice() {
            [a, b] if src.transpose => (*b, *a, llama::transpose(p, *a, *b)),
            [a, b] => (*a, *b, p.to_vec()),
            _ => (spec.numel(), 1, p.to_vec()),
        };
        let parts: Vec<usize> = match src.names.len() {
            3 => vec![cfg.q_dim(), cfg.kv_dim(), cfg.kv_dim()],
            2 => vec![rows / 2, rows / 2],
            _ => vec![rows],
        };
        let mut at = 0;
        for (name, r) in src.names.iter().zip(parts) {
            let shape = if spec.shape.len() == 1 {
                vec![r]
            } else {
                vec![r, cols]
            };
            out.push((
                name.clone(),
                shape,
                data[at * cols..(at + r) * cols].to_vec(),
            ));
            at += r;
        }
    }
    out
}

/// Refuses a `config.json` whose dimensions ask for far more parameters
/// than the weight files hold — before the model is allocated from them
/// (`n_embd = 65536` or `n_layer = 2^40` would abort the process). Every
/// family's layer holds at least its attention's query and output
/// projections (about `2·n_embd²` values, at least a quarter of that with
/// a narrow `head_dim`), and the embedding `vocab_size·n_embd`; the bound
/// leaves that factor of 4 as margin, so the shape checks that follow stay
/// the ones that name a wrong tensor.
fn fits_the_files(path: &Path, c: &GptConfig, stored: u64) -> Result<()> {
    #[allow(clippy::cast_precision_loss)]
    let (layers, embd, vocab, have) = (
        c.n_layer as f64,
        c.n_embd as f64,
        c.vocab_size as f64,
        stored as f64,
    );
    let floor = (layers * embd * embd / 2.0).max(vocab * embd);
    if floor > 4.0 * have {
        return Err(fmt_err(
            path,
            format!(
                "n_layer = {}, n_embd = {} and vocab_size = {} need at least {floor:.3e} parameters, but the folder's weight files hold {stored}: the config does not describe these weights",
                c.n_layer, c.n_embd, c.vocab_size
            ),
        ));
    }
    Ok(())
}

/// Loads a Hugging Face GPT-2 folder (`config.json` + `model.safetensors`).
///
/// Tensor names may carry the `transformer.` prefix or not (both
/// conventions exist); the causal-mask buffers `attn.bias` /
/// `attn.masked_bias` of old checkpoints are ignored; with tied
/// embeddings a stored `lm_head.weight` must equal `wte`.
///
/// # Errors
/// [`Error::Io`], [`Error::Format`] for a malformed folder or file,
/// [`Error::MissingTensor`], [`Error::TensorShape`] (which tensor, which
/// shape expected, which found), [`Error::Tensor`] for an unsupported dtype
/// or a tensor that does not belong to the configured model.
pub fn load(dir: &Path) -> Result<Gpt> {
    if !dir.is_dir() {
        return Err(fmt_err(
            dir,
            "not a directory; expected a Hugging Face folder with config.json and model.safetensors",
        ));
    }
    let family = read_family(&dir.join("config.json"))?;
    let stored = Weights::folder(dir)?;
    let (Family::Gpt2(c) | Family::Llama(c, _) | Family::Moe(c, _, _)) = &family;
    fits_the_files(&dir.join("config.json"), c, stored.elements())?;
    let cfg = match family {
        Family::Gpt2(cfg) => cfg,
        Family::Llama(cfg, ffn) => {
            let mut model = Gpt::with_ffn(cfg, Box::new(ffn))?;
            model.params = params_from(model.layout(), &stored)?;
            return Ok(model);
        }
        Family::Moe(cfg, _, ffn) => {
            let mut model = Gpt::from_blocks(crate::GptBlocks::new(cfg, ffn)?);
            model.params = params_from(model.layout(), &stored)?;
            return Ok(model);
        }
    };
    let mut model = Gpt::new(cfg)?;
    let mut used = std::collections::HashSet::new();
    for spec in model.layout().specs().to_vec() {
        let short = spec
            .name
            .strip_prefix("transformer.")
            .unwrap_or(&spec.name)
            .to_string();
        let (name, shape) = match (stored.shape(&spec.name), stored.shape(&short)) {
            (Some(v), _) => (spec.name.clone(), v),
            (None, Some(v)) => (short, v),
            (None, None) => {
                return Err(Error::MissingTensor {
                    path: stored.path_of("").to_path_buf(),
                    tensor: spec.name.clone(),
                });
            }
        };
        if shape != spec.shape.as_slice() {
            return Err(Error::TensorShape {
                path: stored.path_of(&name).to_path_buf(),
                tensor: name,
                expected: spec.shape.clone(),
                got: shape.to_vec(),
            });
        }
        let data = stored.read_f32(&name)?;
        model.params[spec.range()].copy_from_slice(&data);
        used.insert(name);
    }
    let mut extra: Vec<&String> = stored.names().filter(|k| !used.contains(*k)).collect();
    extra.sort();
    for name in extra {
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            continue;
        }
        let path = stored.path_of(name).to_path_buf();
        if name == "lm_head.weight" && model.config().tied_embeddings {
            let data = stored.read_f32(name)?;
            if model
                .param("transformer.wte.weight")
                .is_some_and(|w| w == data.as_slice())
            {
                continue;
            }
            return Err(Error::Tensor {
                path,
                tensor: name.clone(),
                reason: "config.json ties embeddings (tie_word_embeddings = true) but lm_head.weight differs from transformer.wte.weight".into(),
            });
        }
        return Err(Error::Tensor {
            path,
            tensor: name.clone(),
            reason: format!(
                "not a parameter of the model config.json describes (n_layer = {}); config and weights do not match",
                model.config().n_layer
            ),
        });
    }
    Ok(model)
}

/// The `config.json` weft writes for a configuration (a complete
/// `GPT2Config` with dropout 0).
pub fn config_json(cfg: &GptConfig) -> Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "initializer_range": 0.02,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_inner": null,
        "n_layer": cfg.n_layer,
        "n_positions": cfg.block_size,
        "reorder_and_upcast_attn": false,
        "scale_attn_by_inverse_layer_idx": false,
        "scale_attn_weights": true,
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": "float32",
        "use_cache": true,
        "vocab_size": cfg.vocab_size,
    })
}

/// Writes named f32 tensors to a safetensors file atomically (a temporary
/// file in the same folder, then a rename), with `{"format": "pt"}`
/// metadata as transformers expects.
///
/// # Errors
/// [`Error::Io`] or [`Error::Format`] if writing fails.
pub fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (String, Vec<usize>, &'a [f32])>,
) -> Result<()> {
    let owned: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let mut views = Vec::with_capacity(owned.len());
    for (n, s, b) in &owned {
        let v = TensorView::new(Dtype::F32, s.clone(), b)
            .map_err(|e| fmt_err(path, format!("tensor `{n}`: {e}")))?;
        views.push((n.clone(), v));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes =
        safetensors::serialize(views, Some(meta)).map_err(|e| fmt_err(path, e.to_string()))?;
    write_atomic(path, &bytes)
}

/// Writes `bytes` to a temporary file beside `path`, then renames it into
/// place; a failed write leaves no temporary file behind.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = PathBuf::from(path);
    tmp.set_extension("tmp-weft");
    let written = std::fs::write(&tmp, bytes)
        .map_err(io(&tmp))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(io(path)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Saves `model` as a Hugging Face folder that transformers'
/// `from_pretrained(dir)` loads: a GPT-2 as `GPT2LMHeadModel` (names with
/// the `transformer.` prefix, `lm_head.weight` only when untied), a
/// Llama-family model under its family's names and `[out, in]` layouts;
/// f32, in one `model.safetensors` up to [`MAX_SHARD_BYTES`] and sharded
/// with `model.safetensors.index.json` above it ([`save_sharded`]).
/// Creates `dir` if needed.
///
/// # Errors
/// [`Error::Io`] if the folder or files cannot be written;
/// [`Error::Format`] for a model of neither family.
pub fn save(model: &Gpt, dir: &Path) -> Result<()> {
    save_sharded(model, dir, MAX_SHARD_BYTES)
}

/// [`save`] with shards of at most `max_shard_bytes` (a tensor larger than
/// that gets a shard of its own), as transformers' `save_pretrained(dir,
/// max_shard_size=...)` writes them: `model-0000i-of-0000n.safetensors`
/// and `model.safetensors.index.json`, or one `model.safetensors` when
/// everything fits in one shard.
///
/// # Errors
/// As [`save`].
pub fn save_sharded(model: &Gpt, dir: &Path, max_shard_bytes: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (tensors, config) = if model.config().arch == crate::BlockArch::GPT2 {
        let tensors: Vec<_> = model
            .layout()
            .specs()
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    s.shape.clone(),
                    model.params[s.range()].to_vec(),
                )
            })
            .collect();
        (tensors, config_json(model.config()))
    } else if let Some(moe) = model.blocks().ffn().moe() {
        qwen3_moe::check_exportable(model, moe, dir)?;
        (
            llama_tensors(model, &model.params),
            qwen3_moe::config_json(model.config(), moe),
        )
    } else {
        let hidden = model
            .layout()
            .get("transformer.h.0.mlp.gate_up.weight")
            .map(|s| s.shape[1] / 2)
            .ok_or_else(|| {
                fmt_err(
                    dir,
                    "only GPT-2 blocks and Llama-family blocks with a gated MLP (SwiGlu) \
                     export to a Hugging Face folder",
                )
            })?;
        (
            llama_tensors(model, &model.params),
            llama::config_json(model.config(), hidden),
        )
    };
    files::save_weights(dir, &tensors, max_shard_bytes)?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| fmt_err(dir, e.to_string()))?;
    write_atomic(&dir.join("config.json"), text.as_bytes())
}

/// Reads a tensor by weft's name and shape (the reason on failure).
pub type TensorReader<'a> = dyn FnMut(&str, &[usize]) -> std::result::Result<Vec<f32>, String> + 'a;

/// Saves the model `opts` describes (vocabulary `vocab`) as a Hugging
/// Face folder ([`save`]), each parameter read by `read(name, shape)` in
/// weft's names and layouts (a checkpoint's tensors, say): what
/// `weft ckpt export --hf` writes for the Llama family.
///
/// # Errors
/// [`Error::Format`] naming the tensor `read` could not give (its reason)
/// or that has the wrong size; [`save`]'s.
pub fn export_with(
    opts: &crate::ModelOptions,
    vocab: usize,
    read: &mut TensorReader<'_>,
    dir: &Path,
) -> Result<()> {
    let (ffn, _) = opts.ffn(None)?;
    let mut model = Gpt::from_blocks(crate::GptBlocks::new(opts.gpt_config(vocab), ffn)?);
    for spec in model.layout().specs().to_vec() {
        let data = read(&spec.name, &spec.shape)
            .map_err(|e| fmt_err(dir, format!("tensor `{}`: {e}", spec.name)))?;
        if data.len() != spec.numel() {
            return Err(fmt_err(
                dir,
                format!(
                    "tensor `{}` has {} values, the model's {:?} needs {}",
                    spec.name,
                    data.len(),
                    spec.shape,
                    spec.numel()
                ),
            ));
        }
        model.params[spec.range()].copy_from_slice(&data);
    }
    save(&model, dir)
}

/// Writes every parameter's gradient under its Hugging Face name and
/// layout, as [`save`] writes the parameters (with tied embeddings, the
/// embedding's single gradient includes the `lm_head` contribution).
///
/// # Errors
/// [`Error::Io`] if the file cannot be written.
pub fn save_grads(model: &Gpt, path: &Path) -> Result<()> {
    if model.config().arch != crate::BlockArch::GPT2 {
        let owned = llama_tensors(model, &model.grads);
        return write_safetensors(
            path,
            owned
                .iter()
                .map(|(n, s, d)| (n.clone(), s.clone(), d.as_slice())),
        );
    }
    let tensors = model
        .layout()
        .specs()
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), &model.grads[s.range()]));
    write_safetensors(path, tensors)
}
