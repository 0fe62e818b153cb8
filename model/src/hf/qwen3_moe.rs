//! Qwen3-MoE's Hugging Face format (`Qwen3MoeForCausalLM`): Qwen3's
//! block (the `llama` module reads it) with a mixture of fine-grained
//! SwiGLU experts in every layer but the dense ones (`mlp_only_layers`).
//!
//! | weft | transformers (as saved) |
//! |---|---|
//! | `….mlp.router.weight (C, E)` | `….mlp.gate.weight [E, C]`, transposed |
//! | `….mlp.router.selection_bias (E)` | (none: Qwen3-MoE has no selection bias; read as 0, must be 0 to export) |
//! | `….mlp.experts.gate_up.weight (E, C, 2H)` | `….mlp.experts.{e}.{gate,up}_proj.weight [H, C]`, stacked, transposed, per expert |
//! | `….mlp.experts.c_proj.weight (E, H, C)` | `….mlp.experts.{e}.down_proj.weight [C, H]`, transposed, per expert |
//! | dense layers' `….mlp.gate_up.weight`, `….mlp.c_proj.weight` | as the Llama family's |
//!
//! The routing is transformers': softmax over every expert's logit, the
//! top `num_experts_per_tok`, renormalised over them if `norm_topk_prob`
//! (weft's [`Router`] with [`Gate::Softmax`]).
//! `router_aux_loss_coef` is not read: transformers adds that loss only
//! when asked for the router logits (`output_router_logits`), and a weft
//! run sets its own balancing (`[model.moe]`). `decoder_sparse_step`
//! must be 1 and `mlp_only_layers` the first `k` layers (weft's
//! `first_dense`); other layer patterns are refused, naming the field.
//!
//! DeepSeek-V3 (`DeepseekV3ForCausalLM`) is not read: its attention is
//! multi-head latent attention (compressed key/value projections), which
//! weft's blocks do not have. Its routing — sigmoid scores, a
//! selection-only bias, normalised and scaled top-k weights, shared
//! experts, the first layers dense — is weft's own (`[model.moe]`
//! `gate = "sigmoid"`, `balance = "bias"`, `routed_scale`,
//! `shared_experts`, `model.first_dense`) with group-limited routing
//! left out (`n_group = 1`).

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value, json};
use weft_moe::{Expert, Gate, MoeConfig, Router, RouterKind};

use super::{fmt_err, llama};
use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::gpt::Gpt;
use crate::moe_ffn::MoeFfn;

/// The transformers `model_type` read here.
pub(super) const MODEL_TYPE: &str = "qwen3_moe";

/// Reads a Qwen3-MoE `config.json` object: the model's shape and its
/// feed-forward block (a [`MoeFfn`] whose first layers are dense, or,
/// with no experts, the dense Llama family's).
pub(super) fn read_config(path: &Path, obj: &Map<String, Value>) -> Result<super::Family> {
    let (cfg, dense) = llama::read_config(path, obj)?;
    let bad = |field: &str, reason: String| fmt_err(path, format!("field `{field}` {reason}"));
    let uint = |names: &[&str], default: Option<usize>| -> Result<usize> {
        for n in names {
            match obj.get(*n) {
                None | Some(Value::Null) => {}
                Some(x) => {
                    return x
                        .as_u64()
                        .and_then(|x| usize::try_from(x).ok())
                        .ok_or_else(|| bad(n, format!("= {x} is not a non-negative integer")));
                }
            }
        }
        default.ok_or_else(|| {
            fmt_err(
                path,
                format!(
                    "missing field `{}` (is this a Qwen3-MoE config.json?)",
                    names[0]
                ),
            )
        })
    };
    let experts = uint(&["num_experts", "num_local_experts"], None)?;
    if experts == 0 {
        return Ok(super::Family::Llama(cfg, dense));
    }
    // Qwen2-MoE's and DeepSeek's shared experts are no Qwen3-MoE keys;
    // a config.json that sets them describes another model.
    for key in ["shared_expert_intermediate_size", "n_shared_experts"] {
        if obj
            .get(key)
            .is_some_and(|x| !x.is_null() && x.as_u64() != Some(0))
        {
            return Err(bad(
                key,
                "is set: Qwen3-MoE has no shared experts, and weft reads none from a \
                 qwen3_moe config.json"
                    .into(),
            ));
        }
    }
    let top_k = uint(&["num_experts_per_tok"], None)?;
    let hidden = uint(&["moe_intermediate_size"], None)?;
    let normalize = match obj.get("norm_topk_prob") {
        None | Some(Value::Null) => false,
        Some(x) => x
            .as_bool()
            .ok_or_else(|| bad("norm_topk_prob", format!("= {x} is not a boolean")))?,
    };
    let step = uint(&["decoder_sparse_step"], Some(1))?;
    if step != 1 {
        return Err(bad(
            "decoder_sparse_step",
            format!(
                "= {step}: weft's mixtures of experts fill every layer after the first dense \
                 ones (decoder_sparse_step = 1)"
            ),
        ));
    }
    let dense_layers: Vec<u64> = match obj.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| bad("mlp_only_layers", format!("holds {x}, not a layer index")))
            })
            .collect::<Result<_>>()?,
        Some(x) => return Err(bad("mlp_only_layers", format!("= {x} is not a list"))),
    };
    let mut sorted = dense_layers.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let first_dense = sorted.len();
    if sorted.iter().enumerate().any(|(i, &l)| l != i as u64) || first_dense >= cfg.n_layer {
        return Err(bad(
            "mlp_only_layers",
            format!(
                "= {dense_layers:?}: weft makes the first k layers dense ([0, .., k-1], k < \
                 num_hidden_layers = {}), not this pattern",
                cfg.n_layer
            ),
        ));
    }
    let moe = MoeConfig {
        channels: cfg.n_embd,
        hidden,
        router: Router::top_k(experts, top_k).with_normalize(normalize),
        expert: Expert::SwiGlu,
        shared_experts: 0,
        aux: None,
    };
    let (ffn, _stats) = MoeFfn::new(moe).map_err(|e| {
        fmt_err(
            path,
            format!(
                "fields `num_experts` = {experts}, `num_experts_per_tok` = {top_k}, \
                 `moe_intermediate_size` = {hidden}: {e}"
            ),
        )
    })?;
    let ffn = ffn.with_first_dense(first_dense, Arc::new(dense));
    Ok(super::Family::Moe(cfg, dense, Arc::new(ffn)))
}

/// The transformers tensors of weft's router weight (`transformer.h.{l}.`
/// prefix removed: `what`, under transformers' layer prefix `p`).
pub(super) fn source(p: &str, what: &str) -> Option<llama::Source> {
    (what == "mlp.router.weight").then(|| llama::Source {
        names: vec![format!("{p}mlp.gate.weight")],
        transpose: true,
    })
}

/// For an expert tensor of weft's layout (`(E, rows, cols)`): each
/// expert's transformers names (stacked along their first dimension, then
/// transposed into `(rows, cols)`).
fn expert_names(name: &str, experts: usize) -> Option<Vec<Vec<String>>> {
    let rest = name.strip_prefix("transformer.h.")?;
    let (l, what) = rest.split_once('.')?;
    let parts: &[&str] = match what {
        "mlp.experts.gate_up.weight" => &["gate_proj", "up_proj"],
        "mlp.experts.c_proj.weight" => &["down_proj"],
        _ => return None,
    };
    Some(
        (0..experts)
            .map(|e| {
                parts
                    .iter()
                    .map(|w| format!("model.layers.{l}.mlp.experts.{e}.{w}.weight"))
                    .collect()
            })
            .collect(),
    )
}

/// Whether weft's tensor `name` is a router's selection bias, which
/// Qwen3-MoE does not store.
fn is_selection_bias(name: &str) -> bool {
    name.ends_with(".mlp.router.selection_bias")
}

/// Reads weft's tensor `spec` from `stored` if it is one of the mixture
/// of experts' tensors this module maps (the experts, per expert; the
/// selection bias, 0), marking the names it used; `None` for any other
/// tensor.
pub(super) fn read_tensor(
    stored: &super::Weights,
    used: &mut HashSet<String>,
    spec: &weft_parallel::ParamSpec,
) -> Result<Option<Vec<f32>>> {
    if is_selection_bias(&spec.name) {
        return Ok(Some(vec![0.0; spec.numel()]));
    }
    let (experts, rows, cols) = match spec.shape.as_slice() {
        [e, r, c] => (*e, *r, *c),
        _ => return Ok(None),
    };
    let Some(per_expert) = expert_names(&spec.name, experts) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(spec.numel());
    for names in per_expert {
        // Each transformers tensor is [out, in] = [cols / parts, rows].
        let mut data = Vec::with_capacity(rows * cols);
        for name in &names {
            let shape = stored.shape(name).ok_or_else(|| Error::MissingTensor {
                path: stored.path_of("").to_path_buf(),
                tensor: name.clone(),
            })?;
            let want = [cols / names.len(), rows];
            if shape != want {
                return Err(Error::TensorShape {
                    path: stored.path_of(name).to_path_buf(),
                    tensor: name.clone(),
                    expected: want.to_vec(),
                    got: shape.to_vec(),
                });
            }
            data.extend(stored.read_f32(name)?);
            used.insert(name.clone());
        }
        out.extend(llama::transpose(&data, cols, rows));
    }
    Ok(Some(out))
}

/// A tensor under its transformers name: name, shape, values.
pub(super) type Named = (String, Vec<usize>, Vec<f32>);

/// weft's tensor `spec` (values `p`) under transformers' names if it is
/// one of the experts' tensors (`None` otherwise; the selection bias
/// gives no tensor).
pub(super) fn write_tensor(spec: &weft_parallel::ParamSpec, p: &[f32]) -> Option<Vec<Named>> {
    if is_selection_bias(&spec.name) {
        return Some(Vec::new());
    }
    let [experts, rows, cols] = spec.shape.as_slice() else {
        return None;
    };
    let (experts, rows, cols) = (*experts, *rows, *cols);
    let per_expert = expert_names(&spec.name, experts)?;
    let mut out = Vec::new();
    for (e, names) in per_expert.into_iter().enumerate() {
        let t = llama::transpose(&p[e * rows * cols..(e + 1) * rows * cols], rows, cols);
        let part = cols / names.len();
        for (i, name) in names.into_iter().enumerate() {
            out.push((
                name,
                vec![part, rows],
                t[i * part * rows..(i + 1) * part * rows].to_vec(),
            ));
        }
    }
    Some(out)
}

/// Checks that `model`'s mixture of experts is one transformers'
/// `Qwen3MoeForCausalLM` computes: Qwen3's block (RMSNorm, rotary,
/// QK-norm), SwiGLU experts, dropless softmax top-k unscaled, no shared
/// experts, and a zero selection bias (Qwen3-MoE has none: a bias set by
/// the balancer would change which experts are chosen).
pub(super) fn check_exportable(model: &Gpt, moe: &MoeFfn, dir: &Path) -> Result<()> {
    let cfg = moe.config();
    let refuse = |what: String| {
        Err(fmt_err(
            dir,
            format!("this mixture of experts does not export to Qwen3MoeForCausalLM: {what}"),
        ))
    };
    if !model.config().arch.qk_norm {
        return refuse(
            "Qwen3-MoE's block has QK-norm (model.arch = \"qwen3-moe\" or \"qwen3\")".into(),
        );
    }
    if cfg.expert != Expert::SwiGlu {
        return refuse("its experts are GPT-2 MLPs, Qwen3-MoE's are SwiGLU".into());
    }
    if cfg.shared_experts > 0 {
        return refuse(format!(
            "moe.shared_experts = {}; Qwen3-MoE has none",
            cfg.shared_experts
        ));
    }
    let r = &cfg.router;
    if r.gate != Gate::Softmax || r.scale != 1.0 || r.kind != RouterKind::Dropless {
        return refuse(format!(
            "router {}; Qwen3-MoE routes dropless top-k of a softmax, unscaled",
            r.name()
        ));
    }
    for spec in model.layout().specs() {
        if is_selection_bias(&spec.name) && model.params[spec.range()].iter().any(|&b| b != 0.0) {
            return refuse(format!(
                "{} is not 0 (balance = \"bias\" set it); Qwen3-MoE has no selection bias \
                 (train with moe.balance = \"aux\" or \"none\" to export)",
                spec.name
            ));
        }
    }
    Ok(())
}

/// The `config.json` of a Qwen3-MoE model: the Llama family's keys (with
/// `intermediate_size` the dense layers' width) and the experts'.
pub(super) fn config_json(cfg: &GptConfig, moe: &MoeFfn) -> Value {
    let m = moe.config();
    // The dense block's width: its gated MLP's, or (no dense layer) the
    // experts' own, which transformers then never uses.
    let dense_hidden = moe
        .dense()
        .and_then(|d| {
            d.params(cfg.n_embd)
                .into_iter()
                .find(|p| p.suffix == "mlp.c_proj.weight")
                .map(|p| p.shape[0])
        })
        .unwrap_or(m.hidden);
    let mut v = llama::config_json(cfg, dense_hidden);
    if let Some(o) = v.as_object_mut() {
        o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
        o.insert("model_type".into(), json!(MODEL_TYPE));
        o.insert("num_experts".into(), json!(m.router.experts));
        o.insert("num_experts_per_tok".into(), json!(m.router.top_k));
        o.insert("moe_intermediate_size".into(), json!(m.hidden));
        o.insert("norm_topk_prob".into(), json!(m.router.normalize));
        o.insert("decoder_sparse_step".into(), json!(1));
        o.insert(
            "mlp_only_layers".into(),
            json!((0..moe.first_dense()).collect::<Vec<_>>()),
        );
        o.insert("output_router_logits".into(), json!(false));
        o.insert("router_aux_loss_coef".into(), json!(0.0));
    }
    v
}
