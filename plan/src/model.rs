//! The model being planned: a decoder-only transformer described by its
//! dimensions — GPT-2's block, or the Llama family's (grouped-query
//! attention, SwiGLU, sliding-window layers), dense or with a mixture of
//! experts (fine-grained, shared experts, leading dense layers).
//!
//! Shape legend (as everywhere in weft): L layers, C channels (`hidden`),
//! NH heads, NKV key/value heads, HS channels per head, Cq = NH·HS the
//! query width, Ckv = NKV·HS the key/value width, T tokens per sequence
//! (`seq`), W a sliding window, V vocabulary, F the dense feed-forward
//! width (4·C for GPT-2), Fe an expert's width, E experts, k experts per
//! token.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The block's family: what it normalises with, where positions enter,
/// which projections carry biases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Block {
    /// GPT-2: LayerNorm (weight and bias), a learned position table
    /// (T·C), biases on the attention's output projection (and, with
    /// [`ModelSpec::qkv_bias`], on Q, K and V).
    #[default]
    Gpt2,
    /// Llama, Qwen, Mistral: RMSNorm (weight only), rotary positions (no
    /// table), no bias on the output projection.
    Llama,
}

/// A decoder-only transformer, by its dimensions.
///
/// Parameters are laid out as weft lays them out (`weft_model::param_layout`):
/// the token embedding V·C (and GPT-2's position table T·C); per block
/// two norms (2·C each under LayerNorm, C under RMSNorm), the attention's
/// `c_attn` C·(Cq + 2·Ckv) (plus Cq + 2·Ckv with `qkv_bias`), QK-norm's
/// 2·HS, `c_proj` Cq·C (plus C for GPT-2), and the feed-forward block —
/// dense: GELU `C·F + F + F·C + C` or SwiGLU `3·C·F`; a mixture of
/// experts: a router C·E plus its selection bias E, E experts of width Fe
/// (GELU `2·C·Fe + Fe + C`, SwiGLU `3·C·Fe`) and the shared experts of
/// the same width; the first `first_dense` blocks keep the dense block —
/// then the final norm and, with untied embeddings, an output head V·C.
///
/// Fields added after the GPT-2 shape default (in JSON too) to GPT-2's:
/// a 0 width or head count means "as the attention's heads" (see the
/// accessors).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Transformer blocks, L.
    pub layers: usize,
    /// Channels, C.
    pub hidden: usize,
    /// Attention (query) heads, NH (divides C unless `head_dim` is set).
    pub heads: usize,
    /// Tokens per training sequence, T (also the position table's length).
    pub seq: usize,
    /// Vocabulary, V.
    pub vocab: usize,
    /// Dense feed-forward width, F (4·C for GPT-2).
    pub ffn_hidden: usize,
    /// Routed experts per mixture-of-experts layer, E (0: every
    /// feed-forward block dense).
    pub experts: usize,
    /// Routed experts each token is sent to, k (mixture of experts only).
    pub top_k: usize,
    /// Shared experts every token runs through (mixture of experts only;
    /// DeepSeek-V2/V3: 2 and 1).
    #[serde(default)]
    pub shared_experts: usize,
    /// Whether the output head reuses the token embedding (weft's GPT: yes).
    pub tied_embeddings: bool,
    /// Key/value heads, NKV (0: `heads`, multi-head attention; fewer:
    /// grouped-query attention).
    #[serde(default)]
    pub kv_heads: usize,
    /// Channels per head, HS (0: C / NH).
    #[serde(default)]
    pub head_dim: usize,
    /// The block's family (norms, positions, biases).
    #[serde(default)]
    pub block: Block,
    /// Biases on the Q, K and V projections (GPT-2 and Qwen2: yes).
    #[serde(default)]
    pub qkv_bias: bool,
    /// RMSNorm over each query and key head (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Gated feed-forward blocks (SwiGLU: gate, up and down, no biases),
    /// dense and experts alike; otherwise GPT-2's GELU MLP.
    #[serde(default)]
    pub swiglu: bool,
    /// Keys a sliding-window layer's queries see, W (0: every layer
    /// attends to its whole context).
    #[serde(default)]
    pub window: usize,
    /// With a window, every `global_every`-th layer (layers
    /// `global_every − 1`, `2·global_every − 1`, …) attends globally (0:
    /// every layer is windowed) — weft's `model.global_every`.
    #[serde(default)]
    pub global_every: usize,
    /// An expert's width, Fe (0: F; fine-grained experts are narrower).
    #[serde(default)]
    pub expert_hidden: usize,
    /// Leading blocks that keep the dense feed-forward block under a
    /// mixture of experts (DeepSeek's `first_k_dense_replace`).
    #[serde(default)]
    pub first_dense: usize,
}

/// One block's parameters by kind.
fn mlp_params(c: f64, f: f64, swiglu: bool) -> f64 {
    if swiglu {
        3.0 * c * f
    } else {
        2.0 * c * f + f + c
    }
}

impl ModelSpec {
    /// A dense GPT-2-style model: F = 4·C, tied embeddings.
    #[must_use]
    pub fn gpt(layers: usize, hidden: usize, heads: usize, seq: usize, vocab: usize) -> Self {
        Self {
            layers,
            hidden,
            heads,
            seq,
            vocab,
            ffn_hidden: 4 * hidden,
            experts: 0,
            top_k: 0,
            shared_experts: 0,
            tied_embeddings: true,
            kv_heads: 0,
            head_dim: 0,
            block: Block::Gpt2,
            qkv_bias: true,
            qk_norm: false,
            swiglu: false,
            window: 0,
            global_every: 0,
            expert_hidden: 0,
            first_dense: 0,
        }
    }

    /// A dense Llama-style model: `kv_heads` key/value heads, SwiGLU of
    /// width `ffn_hidden`, RMSNorm, rotary positions, no biases, untied
    /// embeddings (Llama 2 and 3; Qwen3 adds [`qk_norm`](Self::qk_norm),
    /// Mistral a [`window`](Self::window)).
    #[must_use]
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        ffn_hidden: usize,
        seq: usize,
        vocab: usize,
    ) -> Self {
        Self::gpt(layers, hidden, heads, seq, vocab).with_llama_block(kv_heads, ffn_hidden)
    }

    /// The same dimensions in Llama's block: `kv_heads` key/value heads,
    /// SwiGLU of width `ffn_hidden`, RMSNorm, rotary positions, no biases,
    /// untied embeddings.
    #[must_use]
    pub fn with_llama_block(self, kv_heads: usize, ffn_hidden: usize) -> Self {
        Self {
            ffn_hidden,
            tied_embeddings: false,
            kv_heads,
            block: Block::Llama,
            qkv_bias: false,
            swiglu: true,
            ..self
        }
    }

    /// The same model with `experts` experts per layer, `top_k` per token.
    #[must_use]
    pub fn with_moe(mut self, experts: usize, top_k: usize) -> Self {
        self.experts = experts;
        self.top_k = top_k;
        self
    }

    /// The same model with sliding windows of `window` keys, every
    /// `global_every`-th layer global (0: none).
    #[must_use]
    pub fn with_window(mut self, window: usize, global_every: usize) -> Self {
        self.window = window;
        self.global_every = global_every;
        self
    }

    /// Whether some feed-forward blocks are mixtures of experts.
    #[must_use]
    pub fn is_moe(&self) -> bool {
        self.experts > 0 && self.first_dense < self.layers
    }

    /// Whether block `layer` runs the mixture of experts.
    #[must_use]
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.experts > 0 && layer >= self.first_dense
    }

    /// Blocks that run the mixture of experts.
    #[must_use]
    pub fn moe_layers(&self) -> usize {
        if self.experts > 0 {
            self.layers.saturating_sub(self.first_dense)
        } else {
            0
        }
    }

    /// Key/value heads, NKV.
    #[must_use]
    pub fn kv_heads(&self) -> usize {
        if self.kv_heads == 0 {
            self.heads
        } else {
            self.kv_heads
        }
    }

    /// Channels per head, HS.
    #[must_use]
    pub fn head_dim(&self) -> usize {
        if self.head_dim == 0 {
            self.hidden / self.heads.max(1)
        } else {
            self.head_dim
        }
    }

    /// The query width, Cq = NH·HS.
    #[must_use]
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim()
    }

    /// The key (and value) width, Ckv = NKV·HS.
    #[must_use]
    pub fn kv_dim(&self) -> usize {
        self.kv_heads() * self.head_dim()
    }

    /// The key (and value) width one of `tp` tensor-parallel ranks holds:
    /// `Ckv / tp` when `tp` divides the key/value heads, one head's `HS`
    /// when `tp` is a multiple of them (each rank a copy of the head its
    /// query heads read: the copies cost memory and their gradients a sum
    /// over the copies).
    #[must_use]
    pub fn kv_dim_per_rank(&self, tp: usize) -> usize {
        let tp = tp.max(1);
        if self.kv_heads() >= tp {
            self.kv_dim() / tp
        } else {
            self.head_dim()
        }
    }

    /// An expert's width, Fe.
    #[must_use]
    pub fn expert_width(&self) -> usize {
        if self.expert_hidden == 0 {
            self.ffn_hidden
        } else {
            self.expert_hidden
        }
    }

    /// The window of block `layer`: `Some(W)` for a sliding-window layer,
    /// `None` for one that sees its whole context (as
    /// `weft_model::GptConfig::window`).
    #[must_use]
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        if self.window == 0 {
            return None;
        }
        match self.global_every {
            g if g > 0 && (layer + 1).is_multiple_of(g) => None,
            _ => Some(self.window),
        }
    }

    /// Weight matrices of the dense block or an expert: 3 for SwiGLU, 2
    /// for the GELU MLP.
    #[must_use]
    pub fn ffn_matrices(&self) -> usize {
        if self.swiglu { 3 } else { 2 }
    }

    /// The model layer by layer as `weft-pipeline` costs it
    /// ([`weft_pipeline::transformer_profiles`]) — the shape
    /// `weft_model::partition_layers` builds from the trainer's
    /// configuration, so that `weft plan` predicts the stages `weft train`
    /// cuts.
    #[must_use]
    pub fn transformer_shape(&self) -> weft_pipeline::TransformerShape {
        let k = self.ffn_matrices();
        let dense = weft_pipeline::FfnShape {
            matrices: k,
            ..weft_pipeline::FfnShape::mlp(self.ffn_hidden)
        };
        let ffn = weft_pipeline::FeedForwards {
            dense: Some(dense),
            moe: (self.experts > 0).then(|| {
                weft_pipeline::FfnShape {
                    matrices: k,
                    ..weft_pipeline::FfnShape::mlp(self.expert_width())
                }
                .experts(self.experts, self.top_k + self.shared_experts)
            }),
            first_dense: self.first_dense,
        };
        let windows: Vec<Option<usize>> = (0..self.layers).map(|l| self.window_of(l)).collect();
        weft_pipeline::TransformerShape::decoder(
            self.hidden,
            self.seq,
            self.vocab,
            (self.q_dim(), self.kv_dim()),
            &windows,
            &ffn,
        )
    }

    /// Checks the dimensions.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming the first dimension out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, value: usize, expected: String| {
            Err(Error::InvalidModel {
                field,
                value: value.to_string(),
                expected,
            })
        };
        for (field, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("seq", self.seq),
            ("vocab", self.vocab),
            ("ffn_hidden", self.ffn_hidden),
        ] {
            if v == 0 {
                return bad(field, v, "at least 1".into());
            }
        }
        if self.head_dim == 0 && !self.hidden.is_multiple_of(self.heads) {
            return bad(
                "heads",
                self.heads,
                format!(
                    "a divisor of hidden = {} (or set head_dim apart)",
                    self.hidden
                ),
            );
        }
        if !self.heads.is_multiple_of(self.kv_heads()) {
            return bad(
                "kv_heads",
                self.kv_heads,
                format!("a divisor of heads = {}", self.heads),
            );
        }
        if self.experts > 0 && (self.top_k == 0 || self.top_k > self.experts) {
            return bad(
                "top_k",
                self.top_k,
                format!("in 1..={} (the experts)", self.experts),
            );
        }
        if self.experts == 0 {
            for (field, v) in [
                ("shared_experts", self.shared_experts),
                ("expert_hidden", self.expert_hidden),
                ("first_dense", self.first_dense),
            ] {
                if v > 0 {
                    return bad(field, v, "0 without experts (a dense model)".into());
                }
            }
        }
        if self.global_every > 0 && self.window == 0 {
            return bad(
                "global_every",
                self.global_every,
                "0 without a window (set window)".into(),
            );
        }
        if self.experts > 0 && self.first_dense > self.layers {
            return bad(
                "first_dense",
                self.first_dense,
                format!("at most the layers ({})", self.layers),
            );
        }
        // sizes well inside f64's exact integers and u64 byte counts
        // (products of two dimensions; the T×T scores)
        for (field, v, most) in [
            ("layers", self.layers, 1 << 31),
            ("hidden", self.hidden, 1 << 31),
            ("heads", self.heads, 1 << 31),
            ("kv_heads", self.kv_heads, 1 << 31),
            ("head_dim", self.head_dim, 1 << 31),
            ("vocab", self.vocab, 1 << 31),
            ("ffn_hidden", self.ffn_hidden, 1 << 31),
            ("experts", self.experts, 1 << 31),
            ("expert_hidden", self.expert_hidden, 1 << 31),
            ("shared_experts", self.shared_experts, 1 << 31),
            ("seq", self.seq, 1 << 22),
        ] {
            if v > most {
                return bad(field, v, format!("at most {most}"));
            }
        }
        let p = self.params();
        if !(p.is_finite() && p < 1e16) {
            return Err(Error::InvalidModel {
                field: "dimensions",
                value: format!("{p:.3e} parameters"),
                expected: "fewer than 1e16 parameters".into(),
            });
        }
        Ok(())
    }

    /// Parameters of one expert of width Fe: GELU `2·C·Fe + Fe + C`,
    /// SwiGLU `3·C·Fe`.
    #[must_use]
    pub fn expert_params(&self) -> f64 {
        mlp_params(self.hidden as f64, self.expert_width() as f64, self.swiglu)
    }

    /// Parameters of the dense feed-forward block: GELU `C·F + F + F·C +
    /// C`, SwiGLU `3·C·F`.
    #[must_use]
    pub fn dense_ffn_params(&self) -> f64 {
        mlp_params(self.hidden as f64, self.ffn_hidden as f64, self.swiglu)
    }

    /// Parameters of block `layer`'s feed-forward part: the dense block,
    /// or all experts, the router and its selection bias, and the shared
    /// experts.
    #[must_use]
    pub fn ffn_params_of(&self, layer: usize) -> f64 {
        if self.is_moe_layer(layer) {
            let (c, e) = (self.hidden as f64, self.experts as f64);
            c * e + e + (e + self.shared_experts as f64) * self.expert_params()
        } else {
            self.dense_ffn_params()
        }
    }

    /// Parameters of a block's attention and norms (the same in every
    /// block).
    #[must_use]
    pub fn attention_params(&self) -> f64 {
        let c = self.hidden as f64;
        let (q, kv) = (self.q_dim() as f64, self.kv_dim() as f64);
        let norms = match self.block {
            Block::Gpt2 => 4.0 * c,
            Block::Llama => 2.0 * c,
        };
        let qkv_bias = if self.qkv_bias { q + 2.0 * kv } else { 0.0 };
        let qk_norm = if self.qk_norm {
            2.0 * self.head_dim() as f64
        } else {
            0.0
        };
        let proj_bias = if self.block == Block::Gpt2 { c } else { 0.0 };
        norms + c * (q + 2.0 * kv) + qkv_bias + qk_norm + q * c + proj_bias
    }

    /// Parameters of block `layer`: norms, attention, feed-forward.
    #[must_use]
    pub fn params_of(&self, layer: usize) -> f64 {
        self.attention_params() + self.ffn_params_of(layer)
    }

    /// Parameters of every block.
    #[must_use]
    pub fn blocks_params(&self) -> f64 {
        let moe = self.moe_layers();
        self.attention_params() * self.layers as f64
            + (self.layers - moe) as f64 * self.dense_ffn_params()
            + moe as f64 * self.ffn_params_of(self.layers.saturating_sub(1))
    }

    /// Parameters of the average block (all blocks alike but with leading
    /// dense layers under a mixture of experts).
    #[must_use]
    pub fn block_params(&self) -> f64 {
        self.blocks_params() / self.layers.max(1) as f64
    }

    /// Parameters of the position table (GPT-2's learned positions; none
    /// with rotary positions).
    #[must_use]
    pub fn position_params(&self) -> f64 {
        match self.block {
            Block::Gpt2 => (self.seq * self.hidden) as f64,
            Block::Llama => 0.0,
        }
    }

    /// Parameters of the embeddings (tokens and positions).
    #[must_use]
    pub fn embedding_params(&self) -> f64 {
        (self.vocab * self.hidden) as f64 + self.position_params()
    }

    /// Parameters of one norm: weight and bias (LayerNorm) or weight
    /// (RMSNorm).
    #[must_use]
    pub fn norm_params(&self) -> f64 {
        let c = self.hidden as f64;
        match self.block {
            Block::Gpt2 => 2.0 * c,
            Block::Llama => c,
        }
    }

    /// Parameters of the head: the final norm, and the output projection
    /// when untied.
    #[must_use]
    pub fn head_params(&self) -> f64 {
        self.norm_params()
            + if self.tied_embeddings {
                0.0
            } else {
                (self.vocab * self.hidden) as f64
            }
    }

    /// Every parameter (a tied embedding counted once).
    #[must_use]
    pub fn params(&self) -> f64 {
        self.embedding_params() + self.blocks_params() + self.head_params()
    }

    /// The parameters a token is multiplied by, the N of 6·N·D, counted
    /// as weft's trainer counts them for its MFU: every parameter but the
    /// position table (the token embedding included, tied or not) and, of
    /// the routed experts, only k of E (the router and shared experts
    /// whole).
    #[must_use]
    pub fn active_params(&self) -> f64 {
        let routed = if self.experts > 0 {
            self.experts as f64
                * self.expert_params()
                * (1.0 - self.top_k as f64 / self.experts as f64)
        } else {
            0.0
        };
        self.params() - self.position_params() - self.moe_layers() as f64 * routed
    }

    /// Forward FLOPs per token of the attention's two products with the
    /// scores, every block: `4·Cq` per attended key
    /// ([`weft_pipeline::attended_keys`]: T/2 for a causal global layer,
    /// `W − W²/(2T)` through a window of W).
    #[must_use]
    pub fn attention_score_flops(&self) -> f64 {
        let q = self.q_dim() as f64;
        (0..self.layers)
            .map(|l| 4.0 * q * weft_pipeline::attended_keys(self.seq, self.window_of(l)))
            .sum()
    }

    /// Training FLOPs per token as weft's trainer counts them (its MFU):
    /// 6·N for the matrix products (N: [`active_params`](Self::active_params),
    /// Kaplan et al. 2020's 6·N·D) plus three times the forward's
    /// attention-score products ([`attention_score_flops`](Self::attention_score_flops)):
    /// `6·L·T·Cq` without windows — PaLM's `12·L·H·Q·T` (Chowdhery et al.
    /// 2022, appendix B; H·Q = Cq) halved for the causal mask.
    #[must_use]
    pub fn flops_per_token(&self) -> f64 {
        6.0 * self.active_params() + 3.0 * self.attention_score_flops()
    }

    /// FLOPs per iteration of a batch of `batch` sequences as Narayanan et
    /// al. (2021, eq. 3) count them for Megatron-LM's throughput figures:
    /// `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))` — matrix products only, the
    /// full T×T attention, the transformer's forward counted four times
    /// (forward, backward twice, and the recomputed forward of activation
    /// recomputation). Dense models with F = 4·C only.
    #[must_use]
    pub fn megatron_flops(&self, batch: usize) -> f64 {
        let (b, s, l, h, v) = (
            batch as f64,
            self.seq as f64,
            self.layers as f64,
            self.hidden as f64,
            self.vocab as f64,
        );
        96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_its_124m_parameters() {
        // GPT-2 small: 124,439,808 parameters (Hugging Face's count, tied).
        let m = ModelSpec::gpt(12, 768, 12, 1024, 50257);
        assert_eq!(m.params(), 124_439_808.0);
    }

    #[test]
    fn megatron_table_sizes_follow_their_equation_2() {
        // Narayanan et al. eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)).
        for (l, h, published) in [(24, 2304, 1.7e9), (128, 25600, 1008.0e9)] {
            let m = ModelSpec::gpt(l, h, 16, 2048, 51200);
            let (lf, hf) = (l as f64, h as f64);
            let eq2 = 12.0
                * lf
                * hf
                * hf
                * (1.0 + 13.0 / (12.0 * hf) + (51200.0 + 2048.0) / (12.0 * lf * hf));
            assert!(
                (m.params() - eq2).abs() / eq2 < 1e-3,
                "{} vs {eq2}",
                m.params()
            );
            assert!((m.params() - published).abs() / published < 0.03);
        }
    }

    #[test]
    fn moe_counts_only_routed_experts_as_active() {
        let dense = ModelSpec::gpt(2, 64, 4, 16, 100);
        let moe = dense.clone().with_moe(8, 2);
        let per_expert = dense.expert_params();
        let extra = 2.0 * (64.0 * 8.0 + 8.0 + 7.0 * per_expert);
        assert_eq!(moe.params(), dense.params() + extra);
        // active: 2 of 8 experts, plus the router (and its bias)
        let active_extra = 2.0 * (64.0 * 8.0 + 8.0 + per_expert);
        assert!((moe.active_params() - (dense.active_params() + active_extra)).abs() < 1e-6);
    }

    /// Published parameter counts from [`ModelSpec`]'s own count: Llama 3
    /// 8B and 70B (Meta's model cards; `params.rs` in weft-model lays
    /// out the same 8,030,261,248 for 8B) and Mistral 7B (7,241,732,096,
    /// Hugging Face's count of `mistralai/Mistral-7B-v0.1`).
    #[test]
    fn llama_3_and_mistral_have_their_published_parameter_counts() {
        let l8 = ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 128_256);
        assert_eq!(l8.params(), 8_030_261_248.0);
        let l70 = ModelSpec::llama(80, 8192, 64, 8, 28672, 8192, 128_256);
        assert_eq!(l70.params(), 70_553_706_496.0);
        let m7 = ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 32000).with_window(4096, 0);
        assert_eq!(m7.params(), 7_241_732_096.0);
        for m in [&l8, &l70, &m7] {
            m.validate().unwrap();
            // rotary positions: no table, so every parameter is active
            assert_eq!(m.active_params(), m.params());
        }
    }

    /// FLOPs per token against PaLM's formula (Chowdhery et al. 2022,
    /// "PaLM: Scaling Language Modeling with Pathways", appendix B:
    /// `6·N + 12·L·H·Q·T` with H heads of Q channels), the attention term
    /// halved for the causal mask as weft's trainer counts it, for GPT-2
    /// small (N without the position table) and Llama 3 8B (H·Q = 4096,
    /// the key/value heads do not enter the score products).
    #[test]
    fn flops_per_token_follow_palm_s_formula() {
        let palm = |n: f64, l: f64, h: f64, q: f64, t: f64| 6.0 * n + 12.0 * l * h * q * t / 2.0;
        let g = ModelSpec::gpt(12, 768, 12, 1024, 50257);
        let n = 124_439_808.0 - 1024.0 * 768.0;
        assert_eq!(g.flops_per_token(), palm(n, 12.0, 12.0, 64.0, 1024.0));
        let l8 = ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 128_256);
        assert_eq!(
            l8.flops_per_token(),
            palm(8_030_261_248.0, 32.0, 32.0, 128.0, 8192.0)
        );
        // a head size set apart (Qwen3): the query width, not C
        let mut q = l8.clone();
        q.head_dim = 256;
        let extra = 6.0 * 32.0 * (2.0 * 4096.0 * 4096.0 + 2.0 * 4096.0 * 1024.0);
        assert!(
            (q.flops_per_token() - palm(q.params(), 32.0, 32.0, 256.0, 8192.0)).abs() < 1.0
                && q.params() - l8.params() == extra / 6.0,
            "{}",
            q.flops_per_token()
        );
    }

    /// Sliding windows: 5 local layers of T/8 for each global one cut the
    /// score products of a local layer to `(W − W²/2T)/(T/2)` = 15/64 of a
    /// global one's; GQA narrows K and V (parameters) but not the scores.
    #[test]
    fn windows_and_grouped_queries_cost_what_they_should() {
        let (l, c, t) = (12, 512, 4096);
        let global = ModelSpec::llama(l, c, 8, 2, 1376, t, 1000);
        let local = global.clone().with_window(t / 8, 6);
        assert_eq!(local.window_of(4), Some(512));
        assert_eq!(local.window_of(5), None);
        let per_global = global.attention_score_flops() / l as f64;
        let ratio = 2.0 / 8.0 - 1.0 / 64.0;
        let expected = per_global * (2.0 + 10.0 * ratio);
        assert!((local.attention_score_flops() - expected).abs() < 1e-6 * expected);
        assert_eq!(local.params(), global.params());
        // multi-head attention against 2 key/value heads: K and V are
        // 4× narrower
        let mha = ModelSpec {
            kv_heads: 0,
            ..global.clone()
        };
        let kv = (c * 2 * (c - c / 4)) as f64;
        assert_eq!(mha.params() - global.params(), l as f64 * kv);
        assert_eq!(mha.attention_score_flops(), global.attention_score_flops());
    }

    /// Fine-grained experts (DeepSeek-style): narrow experts, shared ones,
    /// dense leading layers.
    #[test]
    fn fine_grained_experts_with_shared_ones_and_dense_leading_layers() {
        let mut m = ModelSpec::llama(4, 64, 4, 4, 176, 16, 100).with_moe(16, 4);
        m.expert_hidden = 32;
        m.shared_experts = 2;
        m.first_dense = 1;
        m.validate().unwrap();
        let (c, fe) = (64.0, 32.0);
        let expert = 3.0 * c * fe;
        assert_eq!(m.ffn_params_of(0), 3.0 * c * 176.0);
        assert_eq!(m.ffn_params_of(1), c * 16.0 + 16.0 + 18.0 * expert);
        let dense = ModelSpec {
            experts: 0,
            top_k: 0,
            shared_experts: 0,
            expert_hidden: 0,
            first_dense: 0,
            ..m.clone()
        };
        assert_eq!(
            m.params() - dense.params(),
            3.0 * (m.ffn_params_of(1) - m.ffn_params_of(0))
        );
        // active: of the routed experts 4 of 16, on the 3 MoE layers
        assert_eq!(m.params() - m.active_params(), 3.0 * 12.0 * expert);
        let shape = m.transformer_shape();
        assert_eq!(shape.blocks[0].ffn, weft_pipeline::FfnShape::swiglu(176));
        assert_eq!(
            shape.blocks[1].ffn,
            weft_pipeline::FfnShape::swiglu(32).experts(16, 6)
        );
        m.first_dense = 0;
        m.experts = 0;
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("shared_experts"), "{e}");
    }

    #[test]
    fn validation_names_the_field() {
        let mut m = ModelSpec::gpt(2, 64, 5, 16, 100);
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("heads"), "{e}");
        m.heads = 4;
        m.validate().unwrap();
        m.kv_heads = 3;
        assert!(m.validate().unwrap_err().to_string().contains("kv_heads"));
        m.kv_heads = 2;
        // a tp rank's key/value width: its share, or one copied head
        assert_eq!(m.kv_dim_per_rank(2), m.kv_dim() / 2);
        assert_eq!(m.kv_dim_per_rank(4), m.head_dim());
        m.validate().unwrap();
        m.global_every = 2;
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("global_every")
        );
        m.global_every = 0;
        m = m.with_moe(4, 5);
        assert!(m.validate().unwrap_err().to_string().contains("top_k"));
    }
}
