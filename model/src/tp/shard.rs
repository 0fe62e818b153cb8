//! Which part of every Hugging Face tensor a tp rank holds.

use std::ops::Range;

use weft_collectives::shard_range;

use super::{Result, check_len, shape_err};
use crate::config::GptConfig;
use weft_parallel::ParamLayout;

/// How a tensor is split over the tp group (the global tensor's shape is
/// [`TpTensor::global_shape`]; a 1-D tensor is one row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// This rank holds these rows (first dimension) of the tensor.
    Rows(Range<usize>),
    /// This rank holds these column ranges of the last dimension, stored
    /// side by side in this order (`attn.c_attn` has three: its Q, K and V
    /// heads).
    Columns(Vec<Range<usize>>),
}

/// One tensor of a rank's shard buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpTensor {
    /// Hugging Face name, as in [`ParamLayout`].
    pub name: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// The shape of this rank's part (row-major in the shard buffer).
    pub shape: Vec<usize>,
    /// First element in the shard buffer.
    pub offset: usize,
    /// Whether AdamW decays it.
    pub decay: bool,
    /// Which part of the tensor this is.
    pub split: Split,
}

/// A rectangular region of a global tensor held by a rank — what a
/// distributed checkpoint stores as one shard entry (`offsets`, `shape`),
/// and where it sits in the rank's tensor (`local_cols`, all rows of the
/// local tensor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Start of the region in the global tensor, per dimension.
    pub offsets: Vec<usize>,
    /// Extent of the region, per dimension.
    pub shape: Vec<usize>,
    /// The columns (last dimension) of the rank's tensor holding it.
    pub local_cols: Range<usize>,
}

impl TpTensor {
    /// Number of elements on this rank.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The element range in the shard buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }

    fn rows_cols(shape: &[usize]) -> (usize, usize) {
        match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => (1, shape.iter().product()),
        }
    }

    /// The global regions this rank's part covers, for checkpoint shard
    /// entries: one for a replicated or row-split tensor, one per column
    /// range otherwise.
    pub fn pieces(&self) -> Vec<Piece> {
        let d = self.global_shape.len();
        let (_, lcols) = Self::rows_cols(&self.shape);
        match &self.split {
            Split::Replicated => vec![Piece {
                offsets: vec![0; d],
                shape: self.global_shape.clone(),
                local_cols: 0..lcols,
            }],
            Split::Rows(r) => {
                let mut offsets = vec![0; d];
                offsets[0] = r.start;
                vec![Piece {
                    offsets,
                    shape: self.shape.clone(),
                    local_cols: 0..lcols,
                }]
            }
            Split::Columns(ranges) => {
                let mut at = 0;
                ranges
                    .iter()
                    .map(|r| {
                        let mut offsets = vec![0; d];
                        offsets[d - 1] = r.start;
                        let mut shape = self.global_shape.clone();
                        shape[d - 1] = r.len();
                        let local_cols = at..at + r.len();
                        at += r.len();
                        Piece {
                            offsets,
                            shape,
                            local_cols,
                        }
                    })
                    .collect()
            }
        }
    }

    /// Copies this rank's part out of the whole tensor `full`.
    fn extract(&self, full: &[f32], out: &mut [f32]) {
        let (grows, gcols) = Self::rows_cols(&self.global_shape);
        match &self.split {
            Split::Replicated => out.copy_from_slice(full),
            Split::Rows(r) => out.copy_from_slice(&full[r.start * gcols..r.end * gcols]),
            Split::Columns(ranges) => {
                let lcols: usize = ranges.iter().map(Range::len).sum();
                for row in 0..grows {
                    let mut at = row * lcols;
                    for r in ranges {
                        out[at..at + r.len()]
                            .copy_from_slice(&full[row * gcols + r.start..row * gcols + r.end]);
                        at += r.len();
                    }
                }
            }
        }
    }

    /// Writes this rank's part `local` into the whole tensor `full`.
    fn place(&self, local: &[f32], full: &mut [f32]) {
        let (grows, gcols) = Self::rows_cols(&self.global_shape);
        match &self.split {
            Split::Replicated => full.copy_from_slice(local),
            Split::Rows(r) => full[r.start * gcols..r.end * gcols].copy_from_slice(local),
            Split::Columns(ranges) => {
                let lcols: usize = ranges.iter().map(Range::len).sum();
                for row in 0..grows {
                    let mut at = row * lcols;
                    for r in ranges {
                        full[row * gcols + r.start..row * gcols + r.end]
                            .copy_from_slice(&local[at..at + r.len()]);
                        at += r.len();
                    }
                }
            }
        }
    }

    /// This rank's data of `piece`, row-major (what a checkpoint shard
    /// entry stores), from the rank's tensor `local`.
    pub fn piece_data(&self, local: &[f32], piece: &Piece) -> Vec<f32> {
        let (_, lcols) = Self::rows_cols(&self.shape);
        local
            .chunks_exact(lcols.max(1))
            .flat_map(|row| row[piece.local_cols.clone()].iter().copied())
            .collect()
    }
}

/// The tensors one rank of a tp group holds, in [`ParamLayout`] order, in
/// one flat shard buffer (parameters, gradients and AdamW moments share
/// it). See the [module docs](super) for which part of each tensor a rank
/// holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpLayout {
    tensors: Vec<TpTensor>,
    len: usize,
    tp: usize,
    rank: usize,
}

/// Checks a tp degree against a dense GPT-2 configuration.
pub(crate) fn check_config(cfg: &GptConfig, tp: usize, rank: usize) -> Result<()> {
    cfg.validate()?;
    if tp == 0 || rank >= tp {
        return Err(shape_err("tp rank", format!("rank {rank} of tp = {tp}")));
    }
    if !cfg.n_head.is_multiple_of(tp) {
        return Err(shape_err(
            "n_head",
            format!(
                "tp = {tp} must divide n_head = {} (heads stay whole on one rank)",
                cfg.n_head
            ),
        ));
    }
    if cfg.vocab_size < tp {
        return Err(shape_err(
            "vocab_size",
            format!("{} tokens cannot be split over tp = {tp}", cfg.vocab_size),
        ));
    }
    Ok(())
}

impl TpLayout {
    /// Rank `rank`'s layout for a dense GPT-2 split `tp` ways.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `tp` does not divide
    /// `n_head`, exceeds `vocab_size`, or `rank >= tp`;
    /// [`Error::Model`](super::Error::Model) for an invalid configuration.
    pub fn new(cfg: &GptConfig, tp: usize, rank: usize) -> Result<Self> {
        check_config(cfg, tp, rank)?;
        let full = crate::params::dense_layout(cfg)?;
        let (c, v) = (cfg.n_embd, cfg.vocab_size);
        let cl = c / tp;
        let fl = 4 * c / tp;
        let vr = shard_range(v, tp, rank);
        let mut tensors = Vec::with_capacity(full.specs().len());
        let mut offset = 0;
        for spec in full.specs() {
            let name = spec.name.as_str();
            let suffix = name
                .rsplit_once(".h.")
                .map_or(name, |(_, s)| s.split_once('.').map_or(s, |(_, rest)| rest));
            let split = if name == "transformer.wte.weight" || name == "lm_head.weight" {
                Split::Rows(vr.clone())
            } else {
                match suffix {
                    "attn.c_attn.weight" | "attn.c_attn.bias" => Split::Columns(
                        (0..3)
                            .map(|p| p * c + rank * cl..p * c + (rank + 1) * cl)
                            .collect(),
                    ),
                    "attn.c_proj.weight" => Split::Rows(rank * cl..(rank + 1) * cl),
                    "mlp.c_fc.weight" | "mlp.c_fc.bias" => {
                        Split::Columns(std::iter::once(rank * fl..(rank + 1) * fl).collect())
                    }
                    "mlp.c_proj.weight" => Split::Rows(rank * fl..(rank + 1) * fl),
                    _ => Split::Replicated,
                }
            };
            let mut shape = spec.shape.clone();
            match &split {
                Split::Replicated => {}
                Split::Rows(r) => shape[0] = r.len(),
                Split::Columns(rs) => {
                    let last = shape.len() - 1;
                    shape[last] = rs.iter().map(Range::len).sum();
                }
            }
            let t = TpTensor {
                name: spec.name.clone(),
                global_shape: spec.shape.clone(),
                shape,
                offset,
                decay: spec.decay,
                split,
            };
            offset += t.numel();
            tensors.push(t);
        }
        Ok(TpLayout {
            tensors,
            len: offset,
            tp,
            rank,
        })
    }

    /// Every tensor, in buffer order.
    pub fn tensors(&self) -> &[TpTensor] {
        &self.tensors
    }

    /// Looks a tensor up by its Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&TpTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Floats in the shard buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard buffer is empty (never, for a valid layout).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tp degree.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// This layout's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Floats of split tensors on this rank (those that shrink as `1/tp`).
    pub fn split_len(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| t.split != Split::Replicated)
            .map(TpTensor::numel)
            .sum()
    }

    /// Floats of replicated tensors (held whole by every rank).
    pub fn replicated_len(&self) -> usize {
        self.len - self.split_len()
    }

    /// This rank's shard buffer cut from a whole model's parameters (or
    /// gradients) in [`ParamLayout`] order for the same configuration.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `full` does not hold the
    /// layout's `full_layout.len()` floats or a tensor is missing (a model
    /// whose feed-forward block is not GPT-2's MLP).
    pub fn shard(&self, full_layout: &ParamLayout, full: &[f32]) -> Result<Vec<f32>> {
        check_len("full parameter buffer", full.len(), full_layout.len())?;
        let mut out = vec![0.0; self.len];
        for t in &self.tensors {
            let spec = full_layout
                .get(&t.name)
                .ok_or_else(|| shape_err("full model", format!("has no tensor `{}`", t.name)))?;
            if spec.shape != t.global_shape {
                return Err(shape_err(
                    "full model",
                    format!(
                        "tensor `{}` has shape {:?}, expected {:?}",
                        t.name, spec.shape, t.global_shape
                    ),
                ));
            }
            t.extract(&full[spec.range()], &mut out[t.range()]);
        }
        if full_layout.len()
            != self
                .tensors
                .iter()
                .map(|t| t.global_shape.iter().product::<usize>())
                .sum::<usize>()
        {
            return Err(shape_err(
                "full model",
                "holds tensors a dense GPT-2 does not have (a mixture-of-experts block?)".into(),
            ));
        }
        Ok(out)
    }

    /// Writes this rank's shard buffer `local` into a whole-model buffer
    /// (the inverse of [`shard`](Self::shard)); replicated tensors are
    /// written only when `replicated` is set.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) on a wrong buffer length.
    pub fn place(
        &self,
        local: &[f32],
        full_layout: &ParamLayout,
        full: &mut [f32],
        replicated: bool,
    ) -> Result<()> {
        check_len("shard buffer", local.len(), self.len)?;
        check_len("full parameter buffer", full.len(), full_layout.len())?;
        for t in &self.tensors {
            if t.split == Split::Replicated && !replicated {
                continue;
            }
            let spec = full_layout
                .get(&t.name)
                .ok_or_else(|| shape_err("full model", format!("has no tensor `{}`", t.name)))?;
            t.place(&local[t.range()], &mut full[spec.range()]);
        }
        Ok(())
    }
}
