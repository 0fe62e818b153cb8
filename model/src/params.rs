//! GPT-2's parameter layout: every tensor under its Hugging Face name in one
//! flat buffer, with its placement on the tensor- and expert-parallel axes
//! — the one description of the model's parameters that the blocks, the
//! decoder, the checkpoints and every parallel layout read.

use std::ops::Range;

use weft_parallel::{Coords, LayoutBuilder, MuonMatrix, ParamLayout, Placement, Placements};

use crate::config::{GptConfig, Norm, Positions};
use crate::error::{Error, Result};
use crate::ffn::{FeedForward, Mlp};

/// How a rank's share of the model is cut: its coordinates on the
/// sharding axes, and whether tensor parallelism runs the layernorm
/// regions sequence-parallel (their gradients are then partial over `tp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sharding {
    /// Tensor- and expert-parallel coordinates.
    pub coords: Coords,
    /// Sequence parallelism (meaningful with `tp > 1`).
    pub sequence_parallel: bool,
}

impl Sharding {
    /// One rank holding the whole model.
    pub const SINGLE: Sharding = Sharding {
        coords: Coords::SINGLE,
        sequence_parallel: false,
    };

    /// `(index, size)` of the tensor-parallel axis.
    pub fn tp(&self) -> (usize, usize) {
        self.coords.tp
    }
}

/// The layout of a GPT with feed-forward block `ffn`, for a rank cut by
/// `sharding`.
///
/// Order: `transformer.wte.weight (V,C)`, `transformer.wpe.weight
/// (maxT,C)` (learned positions only), then each block contiguously
/// (`ln_1`, `attn.c_attn` weight `(C, Cq+2·Ckv)` and bias (if
/// `qkv_bias`), `attn.q_norm` and `attn.k_norm` (if `qk_norm`),
/// `attn.c_proj` weight `(Cq, C)` and bias (if `proj_bias`), `ln_2`, then
/// the feed-forward block's tensors), then `transformer.ln_f`, then
/// `lm_head.weight (V,C)` only when embeddings are untied. Norms have a
/// bias under LayerNorm only. The names are GPT-2's Hugging Face names
/// for every architecture ([`hf`](crate::hf) maps other families' names
/// and `[out, in]` layouts on import and export). A block's parameters are one contiguous range, which is what
/// FSDP units and pipeline stages cut along. Gradients, AdamW moments and
/// checkpoints use the same layout.
///
/// Placements on `tp` (Megatron-LM's split; the `tp` module docs explain
/// why): `wte` and `lm_head` by vocabulary rows; `attn.c_attn` by heads
/// (each of Q, K, V by columns: a strided shard, whose Q block is
/// `n_head / n_kv_head` times as wide as K's and V's under grouped-query
/// attention, so a rank holds its query heads and their key/value heads —
/// with more ranks than key/value heads a copy of the one they read,
/// [`Placement::with_copies`], whose gradient the copies sum); `attn.c_proj.weight` by
/// rows; the feed-forward block's own ([`Mlp`]: `c_fc` by columns,
/// `c_proj.weight` by rows); everything else replicated, the layernorms'
/// gradients partial under sequence parallelism.
///
/// # Errors
/// [`Error::Config`] if the configuration is inconsistent or does not
/// split over the coordinates (`tp` must divide `n_head`, and divide
/// `n_kv_head` or be a multiple of it: [`kv_copies`]; the vocabulary must
/// have at least `tp` tokens).
pub fn param_layout(
    cfg: &GptConfig,
    ffn: &dyn FeedForward,
    sharding: &Sharding,
) -> Result<ParamLayout> {
    cfg.validate()?;
    let (c, v) = (cfg.n_embd, cfg.vocab_size);
    let (_, tp) = sharding.tp();
    if !cfg.n_head.is_multiple_of(tp) {
        return Err(Error::Config {
            field: "n_head",
            reason: format!(
                "= {} is not divisible by tp = {tp} (heads stay whole on one rank)",
                cfg.n_head
            ),
        });
    }
    if v < tp {
        return Err(Error::Config {
            field: "vocab_size",
            reason: format!("= {v} tokens cannot be split over tp = {tp}"),
        });
    }
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    let copies = kv_copies(cfg.n_head, cfg.n_kv_head(), tp)?;
    let rep = Placements::REPLICATED;
    let tp_ = |p: Placement| Placements::tp(p);
    let ln_grad = if sharding.sequence_parallel && tp > 1 {
        Placements::tp(Placement::Partial)
    } else {
        rep
    };
    let layernorm = cfg.arch.norm == Norm::LayerNorm;
    let mut b = LayoutBuilder::new(sharding.coords);
    let ln = |b: &mut LayoutBuilder, name: String| -> Result<()> {
        b.push_with_grad(format!("{name}.weight"), &[c], false, rep, ln_grad)?;
        if layernorm {
            b.push_with_grad(format!("{name}.bias"), &[c], false, rep, ln_grad)?;
        }
        Ok(())
    };
    b.push(
        "transformer.wte.weight",
        &[v, c],
        true,
        tp_(Placement::shard(0)),
    )?;
    if cfg.arch.positions == Positions::Learned {
        b.push("transformer.wpe.weight", &[cfg.block_size, c], true, rep)?;
    }
    // Q, K and V side by side: three blocks of heads to shard, Q
    // `n_head / n_kv_head` times as wide as K or V
    let group = cfg.n_head / cfg.n_kv_head();
    // (with more ranks than key/value heads, each of K and V is cut into
    // its heads, each held by `copies` consecutive ranks)
    let qkv_split = Placement::strided_lead(1, 3, group).with_copies(copies);
    let qkv_bias_split = Placement::strided_lead(0, 3, group).with_copies(copies);
    for l in 0..cfg.n_layer {
        let p = format!("transformer.h.{l}.");
        ln(&mut b, format!("{p}ln_1"))?;
        b.push(
            format!("{p}attn.c_attn.weight"),
            &[c, q_dim + 2 * kv_dim],
            true,
            tp_(qkv_split),
        )?;
        if cfg.arch.qkv_bias {
            b.push(
                format!("{p}attn.c_attn.bias"),
                &[q_dim + 2 * kv_dim],
                false,
                tp_(qkv_bias_split),
            )?;
        }
        if cfg.arch.qk_norm {
            // Each rank normalises its own heads: the gains' gradients are
            // partial sums over the tensor-parallel group.
            let hs = cfg.head_dim();
            let grad = if tp > 1 {
                Placements::tp(Placement::Partial)
            } else {
                rep
            };
            b.push_with_grad(format!("{p}attn.q_norm.weight"), &[hs], false, rep, grad)?;
            b.push_with_grad(format!("{p}attn.k_norm.weight"), &[hs], false, rep, grad)?;
        }
        b.push(
            format!("{p}attn.c_proj.weight"),
            &[q_dim, c],
            true,
            tp_(Placement::shard(0)),
        )?;
        if cfg.arch.proj_bias {
            b.push(format!("{p}attn.c_proj.bias"), &[c], false, rep)?;
        }
        ln(&mut b, format!("{p}ln_2"))?;
        for s in ffn.layer_params(c, l) {
            b.push(format!("{p}{}", s.suffix), &s.shape, s.decay, s.placements)?;
        }
    }
    ln(&mut b, "transformer.ln_f".into())?;
    if !cfg.tied_embeddings {
        b.push("lm_head.weight", &[v, c], true, tp_(Placement::shard(0)))?;
    }
    Ok(b.finish()?)
}

/// Ranks holding a copy of each key/value head at tensor-parallel degree
/// `tp`: 1 when `tp` divides `n_kv_head` (each rank holds `n_kv_head / tp`
/// whole heads), `tp / n_kv_head` when `tp` is a multiple of it (each rank
/// a copy of the one head its query heads read, as Megatron and vLLM
/// replicate key/value heads).
///
/// # Errors
/// [`Error::Config`] naming `num_key_value_heads` if neither divides the
/// other, or `n_head` if `tp` does not divide `n_head`.
pub fn kv_copies(n_head: usize, n_kv_head: usize, tp: usize) -> Result<usize> {
    if tp == 0 || !n_head.is_multiple_of(tp) {
        return Err(Error::Config {
            field: "n_head",
            reason: format!(
                "= {n_head} is not divisible by tp = {tp} (heads stay whole on one rank)"
            ),
        });
    }
    if n_kv_head > 0 && n_kv_head.is_multiple_of(tp) {
        return Ok(1);
    }
    if n_kv_head > 0 && tp.is_multiple_of(n_kv_head) {
        return Ok(tp / n_kv_head);
    }
    Err(Error::Config {
        field: "num_key_value_heads",
        reason: format!(
            "= {n_kv_head} and tp = {tp} (n_head = {n_head}): tp must divide the key/value \
             heads (each rank holds whole ones with the query heads that read them) or be a \
             multiple of them (each rank holds a copy of the one its query heads read)"
        ),
    })
}

/// The layout of a dense GPT-2 on one rank.
///
/// # Errors
/// As [`param_layout`].
pub fn dense_layout(cfg: &GptConfig) -> Result<ParamLayout> {
    param_layout(cfg, &Mlp, &Sharding::SINGLE)
}

/// Offsets of one block's tensors relative to the block's first
/// parameter (a rank's local sizes). A tensor the architecture does not
/// have (a bias, an RMSNorm's bias, QK-norm) has an empty range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// `ln_1.weight (C)`.
    pub ln1_w: Range<usize>,
    /// `ln_1.bias (C)`.
    pub ln1_b: Range<usize>,
    /// `attn.c_attn.weight (C, (Cq+2·Ckv)/tp)`: the query, key and value
    /// projections side by side (`Cq = NH·HS`, `Ckv = NKV·HS`; `3C` for
    /// GPT-2).
    pub qkv_w: Range<usize>,
    /// `attn.c_attn.bias ((Cq+2·Ckv)/tp)`.
    pub qkv_b: Range<usize>,
    /// `attn.q_norm.weight (HS)` then `attn.k_norm.weight (HS)`.
    pub qk_norm: Range<usize>,
    /// `attn.c_proj.weight (Cq/tp, C)`.
    pub proj_w: Range<usize>,
    /// `attn.c_proj.bias (C)`.
    pub proj_b: Range<usize>,
    /// `ln_2.weight (C)`.
    pub ln2_w: Range<usize>,
    /// `ln_2.bias (C)`.
    pub ln2_b: Range<usize>,
    /// The feed-forward block's tensors, in its order.
    pub ffn: Range<usize>,
}

impl BlockLayout {
    /// Floats in the block.
    pub fn len(&self) -> usize {
        self.ffn.end
    }

    /// Whether the block holds nothing (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The layernorm parameters' ranges (`ln_1` weight and bias, `ln_2`
    /// weight and bias).
    pub fn layernorms(&self) -> [Range<usize>; 2] {
        [
            self.ln1_w.start..self.ln1_b.end,
            self.ln2_w.start..self.ln2_b.end,
        ]
    }
}

/// Where the model's pieces lie in a rank's buffer, read from its layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pieces {
    /// `wte` then `wpe` (`wte` alone with rotary positions).
    pub(crate) embed: Range<usize>,
    /// `wte` alone.
    pub(crate) wte: Range<usize>,
    /// Each block.
    pub(crate) blocks: Vec<Range<usize>>,
    /// `ln_f` weight then bias (weight alone for RMSNorm).
    pub(crate) lnf: Range<usize>,
    /// The head weight: `wte`'s range when tied, else `lm_head.weight`'s.
    pub(crate) lm_head: Range<usize>,
    /// Offsets inside every block (the same for each).
    pub(crate) block: BlockLayout,
}

impl Pieces {
    /// The pieces of a [`param_layout`].
    pub(crate) fn of(layout: &ParamLayout, cfg: &GptConfig) -> Result<Self> {
        let get = |name: &str| {
            layout.range(name).ok_or_else(|| Error::Config {
                field: "layout",
                reason: format!("has no tensor {name}"),
            })
        };
        let wte = get("transformer.wte.weight")?;
        let embed_end = match layout.range("transformer.wpe.weight") {
            Some(wpe) => wpe.end,
            None => wte.end,
        };
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let start = get(&format!("transformer.h.{l}.ln_1.weight"))?.start;
            let end = if l + 1 < cfg.n_layer {
                get(&format!("transformer.h.{}.ln_1.weight", l + 1))?.start
            } else {
                get("transformer.ln_f.weight")?.start
            };
            blocks.push(start..end);
        }
        let lnf_w = get("transformer.ln_f.weight")?;
        let lnf = lnf_w.start
            ..layout
                .range("transformer.ln_f.bias")
                .map_or(lnf_w.end, |r| r.end);
        let lm_head = if cfg.tied_embeddings {
            wte.clone()
        } else {
            get("lm_head.weight")?
        };
        let b0 = blocks[0].start;
        let rel = |name: &str| -> Result<Range<usize>> {
            let r = get(&format!("transformer.h.0.{name}"))?;
            Ok(r.start - b0..r.end - b0)
        };
        // An optional tensor: its range, or an empty one where it would
        // start (just after `after`).
        let opt = |name: &str, after: &Range<usize>| -> Range<usize> {
            layout
                .range(&format!("transformer.h.0.{name}"))
                .map_or(after.end..after.end, |r| r.start - b0..r.end - b0)
        };
        let ln1_w = rel("ln_1.weight")?;
        let ln1_b = opt("ln_1.bias", &ln1_w);
        let qkv_w = rel("attn.c_attn.weight")?;
        let qkv_b = opt("attn.c_attn.bias", &qkv_w);
        let q_norm = opt("attn.q_norm.weight", &qkv_b);
        let qk_norm = q_norm.start..opt("attn.k_norm.weight", &q_norm).end;
        let proj_w = rel("attn.c_proj.weight")?;
        let proj_b = opt("attn.c_proj.bias", &proj_w);
        let ln2_w = rel("ln_2.weight")?;
        let ln2_b = opt("ln_2.bias", &ln2_w);
        let block = BlockLayout {
            ln1_w,
            ln1_b,
            qkv_w,
            qkv_b,
            qk_norm,
            proj_w,
            proj_b,
            ln2_w,
            ffn: ln2_b.end..blocks[0].len(),
            ln2_b,
        };
        Ok(Pieces {
            embed: wte.start..embed_end,
            wte,
            blocks,
            lnf,
            lm_head,
            block,
        })
    }
}

/// Whether Muon takes tensor `spec` ([`muon_matrices`]): a weight of
/// two or more dimensions in the transformer blocks, not a router.
#[must_use]
pub fn is_muon_tensor(spec: &weft_parallel::ParamSpec) -> bool {
    let n = spec.name.as_str();
    n.starts_with("transformer.h.")
        && n.ends_with(".weight")
        && spec.global_shape.len() >= 2
        && !n.contains(".router.")
}

/// The matrices Muon takes among `layout`'s tensors (their whole
/// shapes): every weight of two or more dimensions in the transformer
/// blocks — `c_attn`'s Q, K and V one by one (as separate projections
/// are in Llama-style models and in Megatron's split of its fused QKV),
/// a SwiGLU `gate_up`'s gate and up halves one by one, an expert
/// tensor's experts one by one — and not the routers, embeddings, head,
/// norms or biases, which AdamW keeps.
///
/// # Errors
/// [`Error::Config`] if a tensor's shape does not fit its split.
pub fn muon_matrices(cfg: &GptConfig, layout: &ParamLayout) -> Result<Vec<MuonMatrix>> {
    let hd = cfg.head_dim();
    let (q, kv) = (cfg.n_head * hd, cfg.n_kv_head() * hd);
    let mut out = Vec::new();
    for spec in layout.specs().iter().filter(|s| is_muon_tensor(s)) {
        let (n, shape) = (spec.name.as_str(), &spec.global_shape);
        let width = shape[shape.len() - 1];
        let blocks = if n.ends_with(".attn.c_attn.weight") {
            vec![q, kv, kv]
        } else if n.ends_with(".gate_up.weight") {
            vec![width / 2, width / 2]
        } else {
            Vec::new()
        };
        out.extend(
            MuonMatrix::of_tensor(n, shape, &blocks).map_err(|e| Error::Config {
                field: "optim.name",
                reason: format!("Muon: {e}"),
            })?,
        );
    }
    Ok(out)
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
            arch: crate::BlockArch::GPT2,
        };
        let l = dense_layout(&cfg).unwrap();
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
        let p = Pieces::of(&l, &cfg).unwrap();
        assert_eq!(p.block.len(), p.blocks[0].len());
        assert_eq!(p.embed, 0..(11 + 5) * 8);
    }

    #[test]
    fn a_tensor_parallel_rank_holds_its_heads_and_vocabulary_rows() {
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 4,
            n_embd: 8,
            vocab_size: 11,
            block_size: 5,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: crate::BlockArch::GPT2,
        };
        let sharding = Sharding {
            coords: Coords {
                tp: (1, 2),
                ..Coords::SINGLE
            },
            sequence_parallel: true,
        };
        let l = param_layout(&cfg, &Mlp, &sharding).unwrap();
        let shape = |n: &str| l.get(n).unwrap().shape.clone();
        assert_eq!(shape("transformer.wte.weight"), [5, 8]); // 11 = 6 + 5
        assert_eq!(shape("transformer.h.0.attn.c_attn.weight"), [8, 12]);
        assert_eq!(shape("transformer.h.0.attn.c_proj.weight"), [4, 8]);
        assert_eq!(shape("transformer.h.0.mlp.c_fc.weight"), [8, 16]);
        assert_eq!(shape("transformer.h.0.mlp.c_proj.weight"), [16, 8]);
        assert_eq!(shape("transformer.h.0.mlp.c_proj.bias"), [8]);
        let ln = l.get("transformer.h.0.ln_2.bias").unwrap();
        assert_eq!(ln.grad_placements.tp, Placement::Partial);
        let e = param_layout(
            &cfg,
            &Mlp,
            &Sharding {
                coords: Coords {
                    tp: (0, 3),
                    ..Coords::SINGLE
                },
                sequence_parallel: false,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("n_head"), "{e}");
    }

    /// Llama 3 8B's published size: 8,030,261,248 parameters (32 layers,
    /// 4096 channels, 32 heads over 8 key/value heads, SwiGLU 14336,
    /// vocabulary 128256, untied).
    #[test]
    fn llama3_8b_has_its_published_parameter_count() {
        let cfg = GptConfig {
            n_layer: 32,
            n_head: 32,
            n_embd: 4096,
            vocab_size: 128_256,
            block_size: 8192,
            tied_embeddings: false,
            layer_norm_epsilon: 1e-5,
            arch: crate::BlockArch::llama(8, 500_000.0),
        };
        let l = param_layout(&cfg, &crate::SwiGlu { hidden: 14_336 }, &Sharding::SINGLE).unwrap();
        assert_eq!(l.len(), 8_030_261_248);
        assert!(l.get("transformer.wpe.weight").is_none());
        assert!(l.get("transformer.h.0.ln_1.bias").is_none());
        assert_eq!(
            l.get("transformer.h.0.attn.c_attn.weight").unwrap().shape,
            vec![4096, 4096 + 2 * 1024]
        );
    }

    #[test]
    fn grouped_query_attention_splits_whole_kv_heads_over_tensor_parallelism() {
        // 4 query heads of 4 channels sharing 2 key/value heads
        let cfg = GptConfig {
            n_layer: 1,
            n_head: 4,
            n_embd: 16,
            vocab_size: 11,
            block_size: 5,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: crate::BlockArch::llama(2, 1e4),
        };
        let sharding = |rank, tp| Sharding {
            coords: Coords {
                tp: (rank, tp),
                ..Coords::SINGLE
            },
            sequence_parallel: false,
        };
        // Q = columns 0..16, K = 16..24, V = 24..32: rank 1 of 2 holds query
        // heads 2 and 3 (columns 8..16) and their key/value head 1
        let l = param_layout(&cfg, &Mlp, &sharding(1, 2)).unwrap();
        let t = l.get("transformer.h.0.attn.c_attn.weight").unwrap();
        assert_eq!(t.shape, vec![16, 16]);
        let runs = t.runs(&sharding(1, 2).coords).unwrap();
        let whole: Vec<_> = runs.iter().take(3).map(|r| r.whole).collect();
        assert_eq!(whole, [8, 20, 28], "{runs:?}");
        // more ranks than key/value heads: each holds its query head and a
        // copy of the key/value head it reads (rank 3: query head 3, columns
        // 12..16; key/value head 1, columns 20..24 and 28..32)
        let l = param_layout(&cfg, &Mlp, &sharding(3, 4)).unwrap();
        let t = l.get("transformer.h.0.attn.c_attn.weight").unwrap();
        assert_eq!(t.shape, vec![16, 12]);
        assert_eq!(t.placements.tp_copies(), 2);
        let runs = t.runs(&sharding(3, 4).coords).unwrap();
        let whole: Vec<_> = runs.iter().take(3).map(|r| r.whole).collect();
        assert_eq!(whole, [12, 20, 28], "{runs:?}");
        // neither dividing the other: refused, naming the field and counts
        let cfg3 = GptConfig {
            n_head: 6,
            n_embd: 24,
            arch: crate::BlockArch::llama(3, 1e4),
            ..cfg
        };
        let e = param_layout(&cfg3, &Mlp, &sharding(0, 2)).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads"), "{e}");
        assert!(e.to_string().contains("= 3 and tp = 2 (n_head = 6)"), "{e}");
        assert_eq!(kv_copies(8, 1, 4).unwrap(), 4);
        assert_eq!(kv_copies(8, 4, 2).unwrap(), 1);
    }
}
