//! A training job's `[model]` table ([`ModelOptions`]): the shape, the
//! family ([`Arch`]: GPT-2, Llama, Qwen3, Mistral) whose defaults the
//! other keys override, and the mixture of experts; it builds the
//! [`GptConfig`](crate::GptConfig) and the feed-forward block.
//!
//! ```
//! use weft_model::{Arch, ModelOptions};
//!
//! let m = ModelOptions { arch: Arch::Qwen3, n_kv_head: 2, ..ModelOptions::default() };
//! m.validate()?;
//! let cfg = m.gpt_config(256);
//! assert!(cfg.arch.qk_norm && cfg.n_kv_head() == 2 && !cfg.tied_embeddings);
//! assert_eq!(m.swiglu().unwrap().hidden, 352); // 8·128/3 rounded up to 32
//! # Ok::<(), weft_model::Error>(())
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use weft_moe::weft_collectives::Communicator;
use weft_moe::{Expert, MoeConfig, MoeOptions};

use crate::error::{Error, Result};
use crate::ffn::FeedForward;
use crate::moe_ffn::{MoeFfn, MoeStats};

/// `model.arch`: a named transformer family, a set of defaults that the
/// other `[model]` keys override.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: learned positions, LayerNorm with biases, GELU MLP (4·C),
    /// multi-head attention, tied embeddings.
    #[default]
    Gpt2,
    /// Llama 3: RMSNorm, rotary positions (θ = 500000), SwiGLU, no
    /// biases, untied embeddings.
    Llama,
    /// Qwen3: Llama's block with QK-norm, θ = 1000000.
    Qwen3,
    /// Mistral: Llama's block with a sliding window (4096) on every layer,
    /// θ = 10000.
    Mistral,
    /// Qwen3-MoE (`"qwen3-moe"`): Qwen3's block with a mixture of
    /// fine-grained SwiGLU experts (set `moe.experts`, `moe.top_k`,
    /// `moe.expert_hidden`; softmax gates over every expert, top-k,
    /// renormalised as `norm_topk_prob`), no shared expert; the first
    /// `first_dense` layers dense (`mlp_only_layers`). Exports to and
    /// imports from transformers' `Qwen3MoeForCausalLM`.
    #[serde(rename = "qwen3-moe")]
    Qwen3Moe,
}

impl Arch {
    /// The name `model.arch` takes (`"gpt2"`, `"qwen3-moe"`, ...).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
            Arch::Qwen3Moe => "qwen3-moe",
        }
    }
}

/// A training job's `[model]` table: a decoder-only transformer's shape,
/// its family ([`Arch`]) and the keys that override the family's
/// defaults; [`gpt_config`](Self::gpt_config) and
/// [`swiglu`](Self::swiglu) build the model it describes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelOptions {
    /// The family whose defaults the keys below override.
    pub arch: Arch,
    /// Transformer blocks (L).
    pub n_layer: usize,
    /// Attention heads (NH); must divide `n_embd` unless `head_dim` is set.
    pub n_head: usize,
    /// Channels (C).
    pub n_embd: usize,
    /// Context length (T): tokens per training sequence.
    pub block_size: usize,
    /// Key/value heads, dividing `n_head` (0: `n_head`, multi-head
    /// attention; fewer is grouped-query attention).
    pub n_kv_head: usize,
    /// Channels per head (0: `n_embd / n_head`).
    pub head_dim: usize,
    /// The gated MLP's hidden width for the Llama-like families (0:
    /// `8·C/3` rounded up to a multiple of 32); GPT-2's MLP is 4·C.
    pub ffn_hidden: usize,
    /// Rotary base θ (0: the family's).
    pub rope_theta: f64,
    /// Keys a sliding-window layer sees (0: the family's — 4096 for
    /// Mistral, none otherwise).
    pub sliding_window: usize,
    /// With a window, every this-many-th layer attends globally (0: every
    /// layer is windowed).
    pub global_every: usize,
    /// Whether the output head shares the embedding's weight (unset: the
    /// family's — tied for GPT-2, untied for the others).
    pub tied_embeddings: Option<bool>,
    /// The norms' epsilon (0: the family's — 1e-5 for GPT-2, 1e-6 for the
    /// others; Llama 3 uses 1e-5).
    pub norm_eps: f32,
    /// Token ids the model has (0: the data's vocabulary); larger than the
    /// data's pads the embedding, as published models do (Llama 3: 128256).
    pub vocab_size: usize,
    /// A Hugging Face folder (`config.json` and safetensors weights) to
    /// start from: its `config.json` sets the shape keys above
    /// ([`resolve_init_from`](Self::resolve_init_from)) and its weights are
    /// the initial parameters.
    pub init_from: Option<PathBuf>,
    /// With a mixture of experts: the first this-many layers are dense
    /// (the dense block of width `ffn_hidden`, or GPT-2's 4·C MLP), the
    /// rest mixtures of experts (DeepSeek-V3's `first_k_dense_replace`,
    /// Qwen3-MoE's `mlp_only_layers = [0, .., k-1]`); 0: none.
    pub first_dense: usize,
    /// Mixture-of-experts feed-forward blocks (`experts = 0`: dense).
    /// The Llama-like families' experts are SwiGLU (no biases), GPT-2's
    /// its GELU MLP (with biases).
    pub moe: MoeOptions,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            arch: Arch::Gpt2,
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            n_kv_head: 0,
            head_dim: 0,
            ffn_hidden: 0,
            rope_theta: 0.0,
            sliding_window: 0,
            global_every: 0,
            tied_embeddings: None,
            norm_eps: 0.0,
            vocab_size: 0,
            init_from: None,
            first_dense: 0,
            moe: MoeOptions::default(),
        }
    }
}

impl ModelOptions {
    /// The model's shape and block architecture, for a vocabulary of
    /// `vocab` tokens: the family's defaults with the keys that are set.
    #[must_use]
    pub fn gpt_config(&self, vocab: usize) -> crate::GptConfig {
        let arch = match self.arch {
            Arch::Gpt2 => crate::BlockArch::GPT2,
            family => {
                let theta = match (self.rope_theta, family) {
                    (t, _) if t > 0.0 => t,
                    (_, Arch::Qwen3 | Arch::Qwen3Moe) => 1_000_000.0,
                    (_, Arch::Mistral) => 10_000.0,
                    _ => 500_000.0,
                };
                let mut a = crate::BlockArch::llama(self.n_head, theta);
                a.qk_norm = matches!(family, Arch::Qwen3 | Arch::Qwen3Moe);
                let window = match (self.sliding_window, family) {
                    (0, Arch::Mistral) => 4096,
                    (w, _) => w,
                };
                a.sliding_window = (window > 0).then_some(crate::SlidingWindow {
                    window,
                    global_every: (self.global_every > 0).then_some(self.global_every),
                });
                a
            }
        };
        let arch = crate::BlockArch {
            n_kv_head: (self.n_kv_head > 0).then_some(self.n_kv_head),
            head_dim: (self.head_dim > 0).then_some(self.head_dim),
            ..arch
        };
        crate::GptConfig {
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            vocab_size: if self.vocab_size > 0 {
                self.vocab_size
            } else {
                vocab
            },
            block_size: self.block_size,
            tied_embeddings: self.tied_embeddings.unwrap_or(self.arch == Arch::Gpt2),
            layer_norm_epsilon: match (self.norm_eps, self.arch) {
                (e, _) if e > 0.0 => e,
                (_, Arch::Gpt2) => 1e-5,
                _ => 1e-6,
            },
            arch,
        }
    }

    /// The gated MLP of the Llama-like families (`None` for GPT-2, whose
    /// MLP is 4·C wide).
    #[must_use]
    pub fn swiglu(&self) -> Option<crate::SwiGlu> {
        if self.arch == Arch::Gpt2 {
            return None;
        }
        let hidden = if self.ffn_hidden > 0 {
            self.ffn_hidden
        } else {
            (8 * self.n_embd).div_ceil(3).div_ceil(32) * 32
        };
        Some(crate::SwiGlu { hidden })
    }

    /// The dense feed-forward block: the gated MLP of the Llama-like
    /// families, GPT-2's MLP.
    #[must_use]
    pub fn dense_ffn(&self) -> Arc<dyn FeedForward> {
        match self.swiglu() {
            Some(s) => Arc::new(s),
            None => Arc::new(crate::Mlp),
        }
    }

    /// The mixture-of-experts block of the expert layers (`None` for a
    /// dense model): `[model.moe]`'s router and balance, experts
    /// `moe.expert_hidden` wide (or the dense block's width), SwiGLU for
    /// the Llama-like families and GPT-2's MLP for GPT-2.
    ///
    /// # Errors
    /// [`Error::Config`] naming the `moe.*` field the block refuses.
    pub fn moe_config(&self) -> Result<Option<MoeConfig>> {
        let c = self.n_embd;
        let dense = self.swiglu().map_or(4 * c, |s| s.hidden);
        let Some(mut cfg) = self.moe.config(c, dense).map_err(crate::moe_ffn::moe_err)? else {
            return Ok(None);
        };
        if self.arch != Arch::Gpt2 {
            cfg.expert = Expert::SwiGlu;
        }
        Ok(Some(cfg))
    }

    /// The model's feed-forward block: dense, or a mixture of experts
    /// ([`MoeFfn`]: its experts shared out over `ep_group` if given, its
    /// first `first_dense` layers dense) with the handle on its load
    /// statistics.
    ///
    /// # Errors
    /// As [`moe_config`](Self::moe_config); [`Error::Config`] if the
    /// group's size does not divide the number of experts.
    pub fn ffn(
        &self,
        ep_group: Option<Arc<dyn Communicator>>,
    ) -> Result<(Arc<dyn FeedForward>, Option<MoeStats>)> {
        let Some(cfg) = self.moe_config()? else {
            return Ok((self.dense_ffn(), None));
        };
        let (ffn, stats) = match ep_group {
            Some(g) => MoeFfn::with_expert_parallel(cfg, g)?,
            None => MoeFfn::new(cfg)?,
        };
        let ffn = ffn.with_first_dense(self.first_dense, self.dense_ffn());
        Ok((Arc::new(ffn), Some(stats)))
    }

    /// Checks that the model runs with its sequences split over `cp`
    /// context-parallel ranks: a mixture of experts must route each token
    /// on its own (dropless, balanced by the selection bias).
    ///
    /// # Errors
    /// [`Error::Config`] naming `cp` with what composes.
    pub fn check_context_parallel(&self, cp: usize) -> Result<()> {
        let moe = &self.moe;
        if cp > 1
            && moe.experts > 0
            && (moe.balance != weft_moe::Balance::Bias || moe.capacity_factor > 0.0)
        {
            return Err(Error::Config {
                field: "cp",
                reason: format!(
                    "= {cp} splits every sequence over ranks, which composes with per-token \
                     routing only: model.moe.balance = \"bias\" and capacity_factor = 0 (a \
                     capacity and the auxiliary loss are functions of whole sequences)"
                ),
            });
        }
        Ok(())
    }

    /// Checks the table: the model's own checks (heads, key/value heads,
    /// rotary settings, windows), the Llama-like families' keys left unset
    /// on GPT-2, `model.arch = "qwen3-moe"` with experts, `first_dense`
    /// leaving expert layers.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key under `[model]`.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(Error::Config { field, reason });
        self.gpt_config(1).validate()?;
        if self.arch == Arch::Gpt2 {
            for (field, set) in [
                ("n_kv_head", self.n_kv_head > 0),
                ("head_dim", self.head_dim > 0),
                ("ffn_hidden", self.ffn_hidden > 0),
                ("rope_theta", self.rope_theta != 0.0),
                ("sliding_window", self.sliding_window > 0),
            ] {
                if set {
                    return bad(
                        field,
                        "is a setting of the Llama-like families; set model.arch = \"llama\", \
                         \"qwen3\" or \"mistral\" (model.arch = \"gpt2\" has none)"
                            .into(),
                    );
                }
            }
        }
        if self.arch == Arch::Qwen3Moe && self.moe.experts == 0 {
            return bad(
                "moe.experts",
                "= 0: model.arch = \"qwen3-moe\" is a mixture of experts; set the number of \
                 experts (e.g. 8, with moe.top_k and moe.expert_hidden), or use \"qwen3\""
                    .into(),
            );
        }
        if self.first_dense > 0 && (self.moe.experts == 0 || self.first_dense >= self.n_layer) {
            return bad(
                "first_dense",
                format!(
                    "= {} must be less than n_layer = {} and needs moe.experts > 0 (it makes \
                     the first layers of a mixture of experts dense)",
                    self.first_dense, self.n_layer
                ),
            );
        }
        if !(self.norm_eps >= 0.0 && self.norm_eps < 1.0) {
            return bad(
                "norm_eps",
                format!("= {} must be in [0, 1) (0: the family's)", self.norm_eps),
            );
        }
        if self.arch == Arch::Qwen3Moe && self.moe.shared_experts > 0 {
            return bad(
                "moe.shared_experts",
                "Qwen3-MoE has no shared experts; use model.arch = \"qwen3\" with \
                 moe.experts for a Qwen3 block with shared experts"
                    .into(),
            );
        }
        if !(self.rope_theta >= 0.0 && self.rope_theta.is_finite()) {
            return bad(
                "rope_theta",
                format!("= {} must be positive", self.rope_theta),
            );
        }
        if self.global_every > 0 && self.sliding_window == 0 && self.arch != Arch::Mistral {
            return bad(
                "global_every",
                "needs model.sliding_window (the window of the other layers)".into(),
            );
        }
        Ok(())
    }

    /// The initial parameters from [`init_from`](Self::init_from) (read
    /// once; `None` without it) for data of `data_vocab` token ids: the
    /// whole model's, in the unsharded layout of
    /// [`gpt_config`](Self::gpt_config)'s model, after checking the data's
    /// ids fit the model's vocabulary and the folder holds exactly that
    /// model (resolve the table first:
    /// [`resolve_init_from`](Self::resolve_init_from)).
    ///
    /// # Errors
    /// [`Error::Config`] naming `vocab_size` or `init_from`; the folder's
    /// errors ([`crate::hf::load`]).
    pub fn initial_params(&self, data_vocab: usize) -> Result<Option<Vec<f32>>> {
        if self.vocab_size > 0 && data_vocab > self.vocab_size {
            return Err(Error::Config {
                field: "vocab_size",
                reason: format!(
                    "= {} is smaller than the data's vocabulary ({data_vocab} token ids)",
                    self.vocab_size
                ),
            });
        }
        let Some(dir) = &self.init_from else {
            return Ok(None);
        };
        let model = crate::hf::load(dir)?;
        let want = self.gpt_config(data_vocab);
        let got = crate::GptConfig {
            block_size: want.block_size,
            ..model.config().clone()
        };
        let (ffn, _) = self.ffn(None)?;
        let ours = crate::param_layout(&want, ffn.as_ref(), &crate::Sharding::SINGLE)?;
        let shapes = |l: &crate::ParamLayout| -> Vec<(String, Vec<usize>)> {
            l.specs()
                .iter()
                .map(|s| (s.name.clone(), s.shape.clone()))
                .collect()
        };
        if got != want
            || model.config().block_size < want.block_size
            || shapes(&ours) != shapes(model.layout())
        {
            return Err(Error::Config {
                field: "init_from",
                reason: format!(
                    "{} holds {:?} ({} parameters), but the run trains {want:?} ({} parameters)",
                    dir.display(),
                    model.config(),
                    model.layout().len(),
                    ours.len()
                ),
            });
        }
        Ok(Some(model.params))
    }

    /// With [`init_from`](Self::init_from) set, the table with the
    /// folder's shape: family, layers, heads, channels, key/value heads,
    /// head size, gated width, rotary base, window, tied embeddings, norm
    /// epsilon and vocabulary from its `config.json` (for GPT-2 also the
    /// context length, its position table's size; the Llama-like families
    /// keep `block_size`, the training context); for Qwen3-MoE also the
    /// mixture of experts: `moe.experts` (`num_experts`), `moe.top_k`
    /// (`num_experts_per_tok`), `moe.expert_hidden`
    /// (`moe_intermediate_size`), `moe.normalize` (`norm_topk_prob`),
    /// softmax gates, no shared experts, dropless, unscaled, and
    /// `first_dense` (`mlp_only_layers`); how the run balances its
    /// experts (`moe.balance`, `moe.aux_coef`, `moe.bias_rate`) stays the
    /// table's. A key set to something other than its default and other
    /// than the folder's is an error naming it, and so is a `config.json`
    /// setting no key expresses (rope scaling, q/k/v biases, layer
    /// patterns other than the first layers dense): the model built is
    /// exactly the folder's. Without `init_from`, the table unchanged.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key; the folder's [`Error::Io`] or
    /// [`Error::Format`].
    pub fn resolve_init_from(&self) -> Result<Self> {
        let Some(dir) = &self.init_from else {
            return Ok(self.clone());
        };
        let family = crate::hf::read_folder_config(dir)?;
        let theirs = self.folder_options(&family);
        let d = Self::default();
        let conflict = |key: &'static str, ours: String, folder: String| {
            Err(Error::Config {
                field: key,
                reason: format!(
                    "= {ours}, but {} sets {folder}; leave the key unset with \
                     model.init_from (the folder's config.json decides the model's shape)",
                    dir.join("config.json").display()
                ),
            })
        };
        macro_rules! agree {
            ($($($key:ident).+),*) => {$(
                if self.$($key).+ != d.$($key).+ && self.$($key).+ != theirs.$($key).+ {
                    return conflict(
                        stringify!($($key).+),
                        format!("{:?}", self.$($key).+),
                        format!("{:?}", theirs.$($key).+),
                    );
                }
            )*};
        }
        agree!(
            arch,
            n_layer,
            n_head,
            n_embd,
            n_kv_head,
            head_dim,
            ffn_hidden,
            rope_theta,
            sliding_window,
            global_every,
            tied_embeddings,
            norm_eps,
            vocab_size,
            first_dense,
            moe.experts,
            moe.top_k,
            moe.gate,
            moe.normalize,
            moe.expert_hidden,
            moe.shared_experts,
            moe.routed_scale,
            moe.capacity_factor
        );
        let (cfg, folder_moe) = match &family {
            crate::hf::Family::Gpt2(cfg) => {
                agree!(block_size);
                (cfg.clone(), None)
            }
            crate::hf::Family::Llama(cfg, _) => (cfg.clone(), None),
            crate::hf::Family::Moe(cfg, _, ffn) => (cfg.clone(), ffn.moe()),
        };
        // what the keys express must be the whole folder's model
        let built = theirs.gpt_config(cfg.vocab_size);
        let want = crate::GptConfig {
            block_size: built.block_size,
            ..cfg
        };
        let built_moe = theirs.moe_config()?.map(|c| MoeConfig { aux: None, ..c });
        let same_moe = match (folder_moe, &built_moe) {
            (None, None) => true,
            (Some(f), Some(b)) => f.config() == b && f.first_dense() == theirs.first_dense,
            _ => false,
        };
        if built != want || !same_moe {
            return Err(Error::Config {
                field: "init_from",
                reason: format!(
                    "{} sets something the [model] table cannot express yet (rope \
                     scaling, q/k/v or output biases, or another block setting): \
                     {:?} against {:?}",
                    dir.join("config.json").display(),
                    (want.arch, folder_moe.map(|m| m.config())),
                    (built.arch, built_moe)
                ),
            });
        }
        Ok(theirs)
    }

    /// The table with the shape of the folder `family` describes (the
    /// keys [`resolve_init_from`](Self::resolve_init_from) takes from
    /// it); the others stay this table's.
    fn folder_options(&self, family: &crate::hf::Family) -> Self {
        use crate::hf::Family;
        let (cfg, gated, moe) = match family {
            Family::Gpt2(cfg) => (cfg, None, None),
            Family::Llama(cfg, s) => (cfg, Some(s), None),
            Family::Moe(cfg, s, ffn) => (cfg, Some(s), ffn.moe()),
        };
        let a = &cfg.arch;
        let arch = match (gated, moe) {
            (None, _) => Arch::Gpt2,
            (Some(_), Some(_)) => Arch::Qwen3Moe,
            (Some(_), None) if a.qk_norm => Arch::Qwen3,
            (Some(_), None) => Arch::Llama,
        };
        let gpt2 = arch == Arch::Gpt2;
        let mut theirs = Self {
            arch,
            n_layer: cfg.n_layer,
            n_head: cfg.n_head,
            n_embd: cfg.n_embd,
            block_size: if gpt2 {
                cfg.block_size
            } else {
                self.block_size
            },
            n_kv_head: if gpt2 { 0 } else { cfg.n_kv_head() },
            head_dim: a.head_dim.unwrap_or(0),
            ffn_hidden: gated.map_or(0, |f| f.hidden),
            rope_theta: match a.positions {
                crate::Positions::Rotary(r) => r.theta,
                crate::Positions::Learned => 0.0,
            },
            sliding_window: a.sliding_window.map_or(0, |w| w.window),
            global_every: a.sliding_window.and_then(|w| w.global_every).unwrap_or(0),
            tied_embeddings: Some(cfg.tied_embeddings),
            norm_eps: cfg.layer_norm_epsilon,
            vocab_size: cfg.vocab_size,
            init_from: self.init_from.clone(),
            first_dense: 0,
            moe: MoeOptions {
                experts: 0,
                ..self.moe.clone()
            },
        };
        if let Some(m) = moe {
            let (c, r) = (m.config(), &m.config().router);
            theirs.first_dense = m.first_dense();
            theirs.moe = MoeOptions {
                experts: r.experts,
                top_k: r.top_k,
                gate: r.gate,
                normalize: r.normalize,
                expert_hidden: c.hidden,
                shared_experts: c.shared_experts,
                routed_scale: r.scale,
                capacity_factor: 0.0,
                ..self.moe.clone()
            };
        }
        theirs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(m: &ModelOptions) -> &'static str {
        match m.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn qwen3_moe_builds_swiglu_experts_after_its_dense_layers() {
        let m = ModelOptions {
            arch: Arch::Qwen3Moe,
            n_layer: 3,
            first_dense: 1,
            moe: MoeOptions {
                experts: 4,
                expert_hidden: 16,
                ..MoeOptions::default()
            },
            ..ModelOptions::default()
        };
        m.validate().unwrap();
        let (ffn, stats) = m.ffn(None).unwrap();
        assert!(stats.is_some());
        let moe = ffn.moe().unwrap();
        assert_eq!(moe.config().expert, Expert::SwiGlu);
        assert_eq!((moe.config().hidden, moe.first_dense()), (16, 1));
        let layout =
            crate::param_layout(&m.gpt_config(50), ffn.as_ref(), &crate::Sharding::SINGLE).unwrap();
        assert!(layout.get("transformer.h.0.mlp.gate_up.weight").is_some());
        assert!(layout.get("transformer.h.0.mlp.router.weight").is_none());
        let experts = layout
            .get("transformer.h.1.mlp.experts.gate_up.weight")
            .unwrap();
        assert_eq!(experts.shape, [4, 128, 32]);
        assert_eq!(
            serde_json::from_str::<Arch>("\"qwen3-moe\"").unwrap(),
            Arch::Qwen3Moe
        );
    }

    #[test]
    fn bad_mixture_settings_name_their_key() {
        let moe = MoeOptions {
            experts: 4,
            ..MoeOptions::default()
        };
        let base = ModelOptions {
            arch: Arch::Qwen3Moe,
            moe: moe.clone(),
            ..ModelOptions::default()
        };
        let no_experts = ModelOptions {
            moe: MoeOptions::default(),
            ..base.clone()
        };
        assert_eq!(field(&no_experts), "moe.experts");
        let all_dense = ModelOptions {
            first_dense: 2,
            ..base.clone()
        };
        assert_eq!(field(&all_dense), "first_dense");
        let dense_only = ModelOptions {
            arch: Arch::Llama,
            first_dense: 1,
            moe: MoeOptions::default(),
            ..base.clone()
        };
        assert_eq!(field(&dense_only), "first_dense");
        let shared = ModelOptions {
            moe: MoeOptions {
                shared_experts: 1,
                ..moe
            },
            ..base
        };
        assert_eq!(field(&shared), "moe.shared_experts");
    }
}
