//! The parameter layout: one contiguous buffer, named views.

use std::collections::HashMap;
use std::ops::Range;

use crate::config::GptConfig;
use crate::ffn::{Mlp, ParamShape};

/// One named tensor inside the flat parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Hugging Face GPT-2 name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape in Hugging Face's layout (`Conv1D` weights are `[in, out]`).
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Whether AdamW's weight decay applies (matrices and embeddings yes;
    /// biases and layernorm parameters no).
    pub decay: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Where every parameter lives in the single flat buffer.
///
/// Order: `transformer.wte.weight (V,C)`, `transformer.wpe.weight
/// (maxT,C)`, then each block contiguously (`ln_1`, `attn.c_attn`,
/// `attn.c_proj`, `ln_2`, then the feed-forward block's tensors), then
/// `transformer.ln_f`, then `lm_head.weight (V,C)` only when embeddings are
/// untied. A block's parameters are one contiguous range, which is what
/// FSDP units and pipeline stages cut along. Gradients, AdamW moments and
/// checkpoints use the same layout.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    specs: Vec<ParamSpec>,
    index: HashMap<String, usize>,
    len: usize,
}

impl ParamLayout {
    /// The layout of a dense GPT-2 with this configuration.
    pub fn new(cfg: &GptConfig) -> Self {
        Self::with_ffn(cfg, &Mlp)
    }

    /// The layout with a custom feed-forward block (its tensors are named
    /// `transformer.h.{l}.{suffix}`).
    pub fn with_ffn(cfg: &GptConfig, ffn: &dyn crate::ffn::FeedForward) -> Self {
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        let mut specs = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, decay: bool| {
            let n: usize = shape.iter().product();
            specs.push(ParamSpec {
                name,
                shape,
                offset,
                decay,
            });
            offset += n;
        };
        push("transformer.wte.weight".into(), vec![v, c], true);
        push(
            "transformer.wpe.weight".into(),
            vec![cfg.block_size, c],
            true,
        );
        for l in 0..cfg.n_layer {
            let p = format!("transformer.h.{l}.");
            push(format!("{p}ln_1.weight"), vec![c], false);
            push(format!("{p}ln_1.bias"), vec![c], false);
            push(format!("{p}attn.c_attn.weight"), vec![c, 3 * c], true);
            push(format!("{p}attn.c_attn.bias"), vec![3 * c], false);
            push(format!("{p}attn.c_proj.weight"), vec![c, c], true);
            push(format!("{p}attn.c_proj.bias"), vec![c], false);
            push(format!("{p}ln_2.weight"), vec![c], false);
            push(format!("{p}ln_2.bias"), vec![c], false);
            for ParamShape {
                suffix,
                shape,
                decay,
            } in ffn.params(c)
            {
                push(format!("{p}{suffix}"), shape, decay);
            }
        }
        push("transformer.ln_f.weight".into(), vec![c], false);
        push("transformer.ln_f.bias".into(), vec![c], false);
        if !cfg.tied_embeddings {
            push("lm_head.weight".into(), vec![v, c], true);
        }
        let index = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        ParamLayout {
            specs,
            index,
            len: offset,
        }
    }

    /// Every tensor, in buffer order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no elements (never, for a valid config).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Looks a tensor up by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.index.get(name).map(|&i| &self.specs[i])
    }

    /// The element range of a tensor.
    ///
    /// # Panics
    /// If `name` is not in the layout (a bug in the caller).
    pub(crate) fn range(&self, name: &str) -> Range<usize> {
        self.get(name)
            .unwrap_or_else(|| panic!("no parameter named {name}"))
            .range()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_parameters() {
        // 124,439,808 is GPT-2 small's well-known count (tied lm_head).
        assert_eq!(GptConfig::gpt2_small().num_params(), 124_439_808);
    }

    #[test]
    fn layout_is_contiguous_and_named_like_hf() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            vocab_size: 11,
            block_size: 5,
            tied_embeddings: false,
            layer_norm_epsilon: 1e-5,
        };
        let l = ParamLayout::new(&cfg);
        let mut end = 0;
        for s in l.specs() {
            assert_eq!(s.offset, end);
            end += s.numel();
        }
        assert_eq!(end, l.len());
        assert_eq!(
            l.get("transformer.h.1.attn.c_attn.weight").unwrap().shape,
            vec![8, 24]
        );
        assert_eq!(
            l.get("transformer.h.0.mlp.c_proj.weight").unwrap().shape,
            vec![32, 8]
        );
        assert_eq!(l.specs().last().unwrap().name, "lm_head.weight");
    }
}
