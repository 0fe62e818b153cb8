//! Model configuration.

use crate::error::{Error, Result};

/// The shape of a GPT-2-style model (Hugging Face `GPT2Config` names in
/// comments).
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
    /// Layernorm epsilon (`layer_norm_epsilon`).
    pub layer_norm_epsilon: f32,
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
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return bad(
                "n_head",
                format!(
                    "= {} must be at least 1 and divide n_embd = {}",
                    self.n_head, self.n_embd
                ),
            );
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
