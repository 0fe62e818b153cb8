//! Model configuration: the shape ([`GptConfig`]) and the block's
//! architecture options ([`BlockArch`]: GPT-2's, or Llama-, Qwen- and
//! Mistral-shaped blocks).

use weft_kernels::{Llama3Scaling, Rope};

use crate::error::{Error, Result};

/// How the block normalises: GPT-2's LayerNorm (weight and bias) or
/// RMSNorm (weight only; Llama, Qwen, Mistral).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Norm {
    /// LayerNorm with a bias.
    #[default]
    LayerNorm,
    /// RMSNorm, no bias.
    RmsNorm,
}

/// How positions enter the model.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Positions {
    /// A learned table `wpe (maxT, C)` added to the token embedding (GPT-2).
    #[default]
    Learned,
    /// Rotary embedding of queries and keys (no position table).
    Rotary(Rotary),
}

/// Rotary positions' settings (transformers' `rope_theta`,
/// `partial_rotary_factor`, `rope_scaling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotary {
    /// Base θ (10000 for Llama 2, 500000 for Llama 3, 1000000 for Qwen3).
    pub theta: f64,
    /// Channels of each head that rotate; `None` is the whole head.
    pub rotary_dim: Option<usize>,
    /// Llama-3 frequency scaling, if any.
    pub scaling: Option<Llama3Scaling>,
}

/// Which layers attend through a sliding window (Mistral; Gemma's and
/// Qwen's local layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Keys a query sees: itself and the `window - 1` before it.
    pub window: usize,
    /// Every `global_every`-th layer (layers `global_every-1`,
    /// `2·global_every-1`, …) attends to the whole context instead, e.g. 6
    /// for 5 local : 1 global; `None` windows every layer (Mistral).
    pub global_every: Option<usize>,
}

/// The block's architecture beyond its shape: GPT-2's
/// ([`BlockArch::GPT2`], the default) or the options of the transformer
/// families pretrained today, all in the one block code path. The
/// feed-forward block ([`Mlp`](crate::Mlp), [`SwiGlu`](crate::SwiGlu), a
/// mixture of experts) is chosen separately, as a
/// [`FeedForward`](crate::FeedForward).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockArch {
    /// Key/value heads (`num_key_value_heads`); `None` is `n_head`
    /// (multi-head attention), fewer is grouped-query attention.
    pub n_kv_head: Option<usize>,
    /// Channels per head (`head_dim`); `None` is `n_embd / n_head`. Qwen3
    /// sets it independently of the width.
    pub head_dim: Option<usize>,
    /// The block's and the final norm.
    pub norm: Norm,
    /// Learned or rotary positions.
    pub positions: Positions,
    /// Biases on the query, key and value projections (GPT-2, Qwen2).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (GPT-2).
    pub proj_bias: bool,
    /// RMSNorm over each query and key head before the rotation (Qwen3's
    /// `q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// Sliding-window layers, if any.
    pub sliding_window: Option<SlidingWindow>,
}

impl BlockArch {
    /// GPT-2: learned positions, LayerNorm with biases, biases on every
    /// attention projection, multi-head attention over the whole context.
    pub const GPT2: BlockArch = BlockArch {
        n_kv_head: None,
        head_dim: None,
        norm: Norm::LayerNorm,
        positions: Positions::Learned,
        qkv_bias: true,
        proj_bias: true,
        qk_norm: false,
        sliding_window: None,
    };

    /// Llama (2 and 3) with `n_kv_head` key/value heads and rotary base
    /// `theta`: RMSNorm, rotary positions, no biases (pair it with
    /// [`SwiGlu`](crate::SwiGlu)).
    pub fn llama(n_kv_head: usize, theta: f64) -> BlockArch {
        BlockArch {
            n_kv_head: Some(n_kv_head),
            norm: Norm::RmsNorm,
            positions: Positions::Rotary(Rotary {
                theta,
                rotary_dim: None,
                scaling: None,
            }),
            qkv_bias: false,
            proj_bias: false,
            ..BlockArch::GPT2
        }
    }
}

impl Default for BlockArch {
    fn default() -> Self {
        BlockArch::GPT2
    }
}

/// The shape of a GPT-2-style model (Hugging Face `GPT2Config` names in
/// comments) and its block's architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Transformer blocks, L (`n_layer`).
    pub n_layer: usize,
    /// Attention heads, NH (`n_head`).
    pub n_head: usize,
    /// Channels, C (`n_embd`).
    pub n_embd: usize,
    /// Vocabulary size, V (`vocab_size`).
    pub vocab_size: usize,
    /// Longest sequence, maxT (`n_positions`).
    pub block_size: usize,
    /// Whether `lm_head` shares `transformer.wte`'s weight (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// Layernorm epsilon (`layer_norm_epsilon`; `rms_norm_eps` for RMSNorm).
    pub layer_norm_epsilon: f32,
    /// The block's architecture options ([`BlockArch::GPT2`] for GPT-2).
    pub arch: BlockArch,
}

impl GptConfig {
    /// GPT-2 small: 12 layers, 12 heads, 768 channels, 50257 tokens, 1024 positions.
    pub fn gpt2_small() -> Self {
        GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            vocab_size: 50257,
            block_size: 1024,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: BlockArch::GPT2,
        }
    }

    /// Key/value heads.
    pub fn n_kv_head(&self) -> usize {
        self.arch.n_kv_head.unwrap_or(self.n_head)
    }

    /// Channels per head, HS.
    pub fn head_dim(&self) -> usize {
        self.arch
            .head_dim
            .unwrap_or(self.n_embd / self.n_head.max(1))
    }

    /// The query projection's width, `n_head · HS` (`n_embd` unless
    /// `head_dim` is set apart).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim()
    }

    /// The key (and value) projection's width, `n_kv_head · HS`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head() * self.head_dim()
    }

    /// The rotary embedding of the queries and keys, if positions are
    /// rotary.
    pub fn rope(&self) -> Option<Rope> {
        match self.arch.positions {
            Positions::Learned => None,
            Positions::Rotary(r) => Some(Rope {
                head_dim: self.head_dim(),
                rotary_dim: r.rotary_dim.unwrap_or(self.head_dim()),
                theta: r.theta,
                scaling: r.scaling,
            }),
        }
    }

    /// The attention window of layer `layer`: `Some(W)` for a
    /// sliding-window layer, `None` for one that sees its whole context.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let w = self.arch.sliding_window?;
        match w.global_every {
            Some(g) if (layer + 1).is_multiple_of(g.max(1)) => None,
            _ => Some(w.window),
        }
    }

    /// Checks the fields are consistent.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(Error::Config { field, reason });
        if self.n_layer == 0 {
            return bad("n_layer", "must be at least 1".into());
        }
        if self.n_embd == 0 {
            return bad("n_embd", "must be at least 1".into());
        }
        if self.n_head == 0
            || (self.arch.head_dim.is_none() && !self.n_embd.is_multiple_of(self.n_head))
        {
            return bad(
                "n_head",
                format!(
                    "= {} must be at least 1 and divide n_embd = {}",
                    self.n_head, self.n_embd
                ),
            );
        }
        if self.head_dim() == 0 {
            return bad("head_dim", "must be at least 1".into());
        }
        let kv = self.n_kv_head();
        if kv == 0 || !self.n_head.is_multiple_of(kv) {
            return bad(
                "num_key_value_heads",
                format!(
                    "= {kv} must be at least 1 and divide n_head = {}",
                    self.n_head
                ),
            );
        }
        if let Some(rope) = self.rope() {
            rope.validate().map_err(|e| Error::Config {
                field: "rope",
                reason: e.to_string(),
            })?;
        }
        if let Some(w) = self.arch.sliding_window {
            if w.window == 0 {
                return bad("sliding_window", "must be at least 1".into());
            }
            if w.global_every == Some(0) {
                return bad("sliding_window_pattern", "must be at least 1".into());
            }
        }
        if self.vocab_size == 0 || u32::try_from(self.vocab_size).is_err() {
            return bad(
                "vocab_size",
                format!("= {} must be in 1..=2^32-1", self.vocab_size),
            );
        }
        if self.block_size == 0 {
            return bad("n_positions", "must be at least 1".into());
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            return bad(
                "layer_norm_epsilon",
                format!("= {} must be positive", self.layer_norm_epsilon),
            );
        }
        Ok(())
    }

    /// Number of parameters (the tied `lm_head` counted once).
    pub fn num_params(&self) -> usize {
        crate::params::dense_layout(self).map_or(0, |l| l.len())
    }
}
