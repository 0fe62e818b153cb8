//! The model being planned: a GPT-2-style decoder (dense, or with a
//! mixture of experts in every layer), described by its dimensions.
//!
//! Shape legend (as everywhere in weft): L layers, C channels (`hidden`),
//! NH heads, T tokens per sequence (`seq`), V vocabulary, F the
//! feed-forward width (4·C for GPT-2), E experts, k experts per token.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A GPT-2-style decoder, by its dimensions.
///
/// Parameters are laid out as weft lays them out (`weft_model::param_layout`):
/// token and position embeddings (V·C + T·C), per block two layernorms
/// (4·C), the attention's `c_attn` (3·C² + 3·C) and `c_proj` (C² + C), the
/// feed-forward block (dense: C·F + F + F·C + C; mixture of experts: a
/// router C·E plus its selection bias E, E experts of C·F + F + F·C + C,
/// optionally a shared expert of the same size), the final layernorm (2·C)
/// and, with untied embeddings, an output head V·C.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Transformer blocks, L.
    pub layers: usize,
    /// Channels, C.
    pub hidden: usize,
    /// Attention heads, NH (divides C).
    pub heads: usize,
    /// Tokens per training sequence, T (also the position table's length).
    pub seq: usize,
    /// Vocabulary, V.
    pub vocab: usize,
    /// Feed-forward width, F (4·C for GPT-2).
    pub ffn_hidden: usize,
    /// Experts per layer, E (0: a dense feed-forward block).
    pub experts: usize,
    /// Experts each token is routed to, k (mixture of experts only).
    pub top_k: usize,
    /// A shared expert that sees every token (mixture of experts only).
    pub shared_expert: bool,
    /// Whether the output head reuses the token embedding (weft's GPT: yes).
    pub tied_embeddings: bool,
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
            shared_expert: false,
            tied_embeddings: true,
        }
    }

    /// The same model with `experts` experts per layer, `top_k` per token.
    #[must_use]
    pub fn with_moe(mut self, experts: usize, top_k: usize) -> Self {
        self.experts = experts;
        self.top_k = top_k;
        self
    }

    /// Whether the feed-forward blocks are mixtures of experts.
    #[must_use]
    pub fn is_moe(&self) -> bool {
        self.experts > 0
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
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(
                "heads",
                self.heads,
                format!("a divisor of hidden = {}", self.hidden),
            );
        }
        if self.experts > 0 && (self.top_k == 0 || self.top_k > self.experts) {
            return bad(
                "top_k",
                self.top_k,
                format!("in 1..={} (the experts)", self.experts),
            );
        }
        // sizes well inside f64's exact integers and u64 byte counts
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

    /// Parameters of one feed-forward expert (or the dense MLP): C·F + F +
    /// F·C + C.
    #[must_use]
    pub fn expert_params(&self) -> f64 {
        let (c, f) = (self.hidden as f64, self.ffn_hidden as f64);
        2.0 * c * f + f + c
    }

    /// Parameters of one block's feed-forward part (all experts, the router
    /// and its selection bias, the shared expert).
    #[must_use]
    pub fn ffn_params(&self) -> f64 {
        if self.is_moe() {
            let (c, e) = (self.hidden as f64, self.experts as f64);
            let shared = if self.shared_expert {
                self.expert_params()
            } else {
                0.0
            };
            c * e + e + e * self.expert_params() + shared
        } else {
            self.expert_params()
        }
    }

    /// Parameters of one block: layernorms, attention, feed-forward.
    #[must_use]
    pub fn block_params(&self) -> f64 {
        let c = self.hidden as f64;
        4.0 * c + 4.0 * c * c + 4.0 * c + self.ffn_params()
    }

    /// Parameters of the embeddings (tokens and positions).
    #[must_use]
    pub fn embedding_params(&self) -> f64 {
        ((self.vocab + self.seq) * self.hidden) as f64
    }

    /// Parameters of the head: the final layernorm, and the output
    /// projection when untied.
    #[must_use]
    pub fn head_params(&self) -> f64 {
        let c = self.hidden as f64;
        2.0 * c
            + if self.tied_embeddings {
                0.0
            } else {
                (self.vocab * self.hidden) as f64
            }
    }

    /// Every parameter (a tied embedding counted once).
    #[must_use]
    pub fn params(&self) -> f64 {
        self.embedding_params() + self.layers as f64 * self.block_params() + self.head_params()
    }

    /// The parameters a token is multiplied by: all but the position table,
    /// and of the routed experts only k of E — the N of 6·N·D.
    #[must_use]
    pub fn active_params(&self) -> f64 {
        let routed = if self.is_moe() {
            self.experts as f64
                * self.expert_params()
                * (1.0 - self.top_k as f64 / self.experts as f64)
        } else {
            0.0
        };
        self.params() - (self.seq * self.hidden) as f64 - self.layers as f64 * routed
    }

    /// Training FLOPs per token as weft's trainer counts them (its MFU):
    /// 6·N for the matrix products (N: [`active_params`](Self::active_params),
    /// Kaplan et al. 2020's 6·N·D) plus 6·L·T·C for causal attention's two
    /// products, forward and backward (half of the T×T scores are masked).
    #[must_use]
    pub fn flops_per_token(&self) -> f64 {
        6.0 * self.active_params() + 6.0 * (self.layers * self.seq * self.hidden) as f64
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

    #[test]
    fn validation_names_the_field() {
        let mut m = ModelSpec::gpt(2, 64, 5, 16, 100);
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("heads"), "{e}");
        m.heads = 4;
        m.validate().unwrap();
        m = m.with_moe(4, 5);
        assert!(m.validate().unwrap_err().to_string().contains("top_k"));
    }
}
