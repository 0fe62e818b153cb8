//! Flat-parameter units and their shards (see [`UnitPlan`]).

use std::ops::Range;

use weft_model::{ParamLayout, ParamSpec};

use crate::error::{Error, Result};

/// What part of the model a unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnitKind {
    /// Token and position embeddings (`wte`, `wpe`).
    Embedding,
    /// Transformer block `l`.
    Block(usize),
    /// Final layernorm (and the untied `lm_head`).
    Head,
}

/// One flat-parameter unit: a contiguous range of the parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// `embed`, `h.{l}` or `head`.
    pub name: String,
    /// What it holds.
    pub kind: UnitKind,
    /// Its elements in the model's flat buffer.
    pub range: Range<usize>,
    /// Elements per rank: `ceil(len / n)`.
    pub shard_len: usize,
}

impl Unit {
    /// Elements of the unit (without padding).
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the unit is empty (never, for a valid model).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Elements of the padded unit buffer: `shard_len · n`.
    pub fn padded_len(&self, n: usize) -> usize {
        self.shard_len * n
    }

    /// Rank `r`'s shard as a range of the padded unit buffer.
    pub fn shard(&self, r: usize) -> Range<usize> {
        r * self.shard_len..(r + 1) * self.shard_len
    }

    /// The part of rank `r`'s shard that holds real parameters, as a range
    /// of the model's flat buffer (empty if the shard is all padding).
    pub fn shard_in_model(&self, r: usize) -> Range<usize> {
        let s = self.shard(r);
        let start = (self.range.start + s.start).min(self.range.end);
        let end = (self.range.start + s.end).min(self.range.end);
        start..end
    }
}

/// One rectangular piece of a named tensor held by a shard, in the form the
/// checkpoint crate's regions take: `rows × cols` of the tensor viewed as a
/// matrix of `shape[0]` rows (1-d tensors: one row of `shape[0]` columns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardBox {
    /// Row range.
    pub rows: Range<usize>,
    /// Column range (elements of a row; for tensors of more than 2 dims,
    /// the flattened trailing dims).
    pub cols: Range<usize>,
    /// Where the box's elements start in the shard (row-major inside the box).
    pub shard_offset: usize,
}

/// The part of one tensor a rank's shard holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPiece {
    /// Hugging Face name of the tensor.
    pub name: String,
    /// Shape of the whole tensor.
    pub shape: Vec<usize>,
    /// Element range within the tensor (row-major flat index).
    pub elements: Range<usize>,
    /// Offset of `elements.start` within the rank's shard of its unit.
    pub shard_offset: usize,
    /// The same elements as at most three boxes (a partial first row, whole
    /// rows, a partial last row).
    pub boxes: Vec<ShardBox>,
}

/// How the parameter buffer is cut into flat-parameter units and sharded
/// over `n` ranks.
///
/// A *unit* is a contiguous range of the model's single parameter buffer
/// ([`ParamLayout`]) that is gathered, computed with and freed as one piece.
/// The default plan ([`UnitPlan::per_block`]) has `L + 2` units:
///
/// | unit | tensors |
/// |---|---|
/// | 0 `embed` | `transformer.wte.weight (V,C)`, `transformer.wpe.weight (maxT,C)` |
/// | 1..=L `h.{l}` | every tensor of block `l` (`ln_1` … feed-forward) |
/// | L+1 `head` | `transformer.ln_f.{weight,bias}`, and `lm_head.weight (V,C)` when untied |
///
/// # Padding
/// Unit `u` of `len` elements is sharded over a group of `n` ranks as a
/// buffer of `padded = ceil(len / n) · n` elements: rank `r` owns elements
/// `r·s .. (r+1)·s` of it, `s = padded / n`. The padding (fewer than `n`
/// elements per unit, at the end of the last ranks' shards) is zero in the
/// parameters, the gradients and the AdamW moments, so it never changes a
/// norm or an update; it travels in the collectives (so every rank sends
/// equal shards), and is counted in memory and traffic. Shards are always
/// equal, so [`weft_collectives::shard_range`] of the padded length gives
/// the same ranges.
///
/// # Tied embeddings
/// With tied embeddings `lm_head` *is* `transformer.wte.weight`, which lives
/// in unit 0. The head unit then holds only `ln_f`, and the runner keeps
/// unit 0 gathered from its forward until its backward (the head's forward
/// and backward read the gathered `wte`; its gradient is accumulated into
/// unit 0's gradient buffer together with the embedding's). That costs one
/// extra resident unit (counted under gathered parameters) and saves one
/// all-gather of `wte` per micro-batch.
#[derive(Clone, Debug)]
pub struct UnitPlan {
    units: Vec<Unit>,
    n: usize,
    specs: Vec<ParamSpec>,
    total: usize,
    tied: bool,
}

impl UnitPlan {
    /// The default plan: `embed`, one unit per transformer block, `head`
    /// (see [`UnitPlan`]), sharded over `n` ranks.
    ///
    /// # Errors
    /// [`Error::Config`] if `n` is 0 or the layout does not have the GPT-2
    /// tensor names of `n_layer` blocks in order.
    pub fn per_block(layout: &ParamLayout, n_layer: usize, n: usize) -> Result<Self> {
        let get = |name: &str| {
            layout.get(name).ok_or_else(|| Error::Config {
                field: "layout",
                reason: format!("the parameter layout has no tensor {name:?}"),
            })
        };
        let mut cuts = vec![(String::from("embed"), UnitKind::Embedding, 0)];
        for l in 0..n_layer {
            let first = get(&format!("transformer.h.{l}.ln_1.weight"))?;
            cuts.push((format!("h.{l}"), UnitKind::Block(l), first.offset));
        }
        let lnf = get("transformer.ln_f.weight")?;
        cuts.push(("head".into(), UnitKind::Head, lnf.offset));
        let mut ranges = Vec::new();
        for (i, (name, kind, start)) in cuts.iter().enumerate() {
            let end = cuts.get(i + 1).map_or(layout.len(), |c| c.2);
            ranges.push((name.clone(), *kind, *start..end));
        }
        let tied = layout.get("lm_head.weight").is_none();
        Self::from_ranges(layout, ranges, n, tied)
    }

    /// A plan from explicit unit ranges, which must tile the buffer in order.
    ///
    /// # Errors
    /// [`Error::Config`] if `n` is 0, a range is empty, or the ranges do not
    /// tile `0..layout.len()` in order.
    pub fn from_ranges(
        layout: &ParamLayout,
        ranges: Vec<(String, UnitKind, Range<usize>)>,
        n: usize,
        tied: bool,
    ) -> Result<Self> {
        if n == 0 {
            return Err(Error::Config {
                field: "dp",
                reason: "the data-parallel group needs at least one rank".into(),
            });
        }
        let mut end = 0;
        let mut units = Vec::new();
        for (name, kind, r) in ranges {
            if r.start != end || r.is_empty() {
                return Err(Error::Config {
                    field: "units",
                    reason: format!(
                        "unit {name:?} covers {r:?}; units must be non-empty and tile the buffer in order (expected a start of {end})"
                    ),
                });
            }
            end = r.end;
            units.push(Unit {
                name,
                kind,
                shard_len: r.len().div_ceil(n),
                range: r,
            });
        }
        if end != layout.len() {
            return Err(Error::Config {
                field: "units",
                reason: format!(
                    "units end at element {end}, the buffer has {}",
                    layout.len()
                ),
            });
        }
        Ok(Self {
            units,
            n,
            specs: layout.specs().to_vec(),
            total: layout.len(),
            tied,
        })
    }

    /// The units, in buffer (and forward) order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Ranks the units are sharded over.
    pub fn group_size(&self) -> usize {
        self.n
    }

    /// Parameters of the model (without padding).
    pub fn num_params(&self) -> usize {
        self.total
    }

    /// Elements of every padded unit together.
    pub fn padded_params(&self) -> usize {
        self.units.iter().map(|u| u.padded_len(self.n)).sum()
    }

    /// Elements of one rank's shards together: `padded_params / n`.
    pub fn shard_params(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }

    /// Whether `lm_head` is tied to `wte` (then the head uses unit 0).
    pub fn tied(&self) -> bool {
        self.tied
    }

    /// The decay mask of unit `u`'s padded buffer as runs of
    /// `(range in the padded unit buffer, decay)`, from each tensor's
    /// [`ParamSpec::decay`] — the same mask [`weft_model::Gpt::adamw_step`]
    /// uses. Padding is reported as a run without decay.
    ///
    /// # Panics
    /// If `u` is out of range.
    pub fn decay_runs(&self, u: usize) -> Vec<(Range<usize>, bool)> {
        let unit = &self.units[u];
        let mut runs = Vec::new();
        for s in &self.specs {
            let r = s.range();
            if r.start >= unit.range.start && r.end <= unit.range.end {
                let a = r.start - unit.range.start;
                runs.push((a..a + r.len(), s.decay));
            }
        }
        let len = unit.len();
        let padded = unit.padded_len(self.n);
        if padded > len {
            runs.push((len..padded, false));
        }
        runs
    }

    /// The tensors (whole or partial) that rank `r`'s shard of unit `u`
    /// holds, with the boxes a checkpoint region needs.
    ///
    /// # Panics
    /// If `u` or `r` is out of range.
    pub fn shard_pieces(&self, u: usize, r: usize) -> Vec<ShardPiece> {
        assert!(r < self.n, "shard_pieces: rank {r} of {}", self.n);
        let unit = &self.units[u];
        let held = unit.shard_in_model(r);
        let shard_start = unit.range.start + unit.shard(r).start;
        let mut out = Vec::new();
        for s in &self.specs {
            let t = s.range();
            let a = t.start.max(held.start);
            let b = t.end.min(held.end);
            if a >= b {
                continue;
            }
            let elements = a - t.start..b - t.start;
            let cols = if s.shape.len() <= 1 {
                s.numel()
            } else {
                s.shape[1..].iter().product()
            };
            out.push(ShardPiece {
                name: s.name.clone(),
                shape: s.shape.clone(),
                boxes: boxes(&elements, cols, s.shape.len() <= 1),
                shard_offset: a - shard_start,
                elements,
            });
        }
        out
    }
}

/// Splits a flat element range of a row-major matrix with `cols` columns
/// into at most three boxes; `flat` tensors (1-d) are one row.
fn boxes(e: &Range<usize>, cols: usize, flat: bool) -> Vec<ShardBox> {
    if flat {
        return vec![ShardBox {
            rows: 0..1,
            cols: e.clone(),
            shard_offset: 0,
        }];
    }
    let mut out = Vec::new();
    let mut at = e.start;
    let mut off = 0;
    // partial first row
    if !at.is_multiple_of(cols) {
        let row = at / cols;
        let end = e.end.min((row + 1) * cols);
        out.push(ShardBox {
            rows: row..row + 1,
            cols: at % cols..at % cols + (end - at),
            shard_offset: off,
        });
        off += end - at;
        at = end;
    }
    // whole rows
    let full_end = e.end / cols * cols;
    if full_end > at {
        out.push(ShardBox {
            rows: at / cols..full_end / cols,
            cols: 0..cols,
            shard_offset: off,
        });
        off += full_end - at;
        at = full_end;
    }
    // partial last row
    if e.end > at {
        let row = at / cols;
        out.push(ShardBox {
            rows: row..row + 1,
            cols: 0..e.end - at,
            shard_offset: off,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_model::GptConfig;

    fn cfg(tied: bool) -> GptConfig {
        GptConfig {
            n_layer: 3,
            n_head: 2,
            n_embd: 8,
            vocab_size: 13,
            block_size: 6,
            tied_embeddings: tied,
            layer_norm_epsilon: 1e-5,
        }
    }

    #[test]
    fn units_tile_the_buffer_and_shards_are_even() {
        for tied in [true, false] {
            let layout = weft_model::dense_layout(&cfg(tied)).unwrap();
            for n in [1, 2, 3, 4, 7] {
                let plan = UnitPlan::per_block(&layout, 3, n).unwrap();
                assert_eq!(plan.units().len(), 5);
                assert_eq!(plan.tied(), tied);
                let mut end = 0;
                for u in plan.units() {
                    assert_eq!(u.range.start, end);
                    end = u.range.end;
                    let padded = u.padded_len(n);
                    assert!(padded >= u.len() && padded - u.len() < n);
                    // the collectives' shard ranges agree with ours
                    for r in 0..n {
                        assert_eq!(weft_collectives::shard_range(padded, n, r), u.shard(r));
                    }
                    // real parts of the shards tile the unit
                    let mut at = u.range.start;
                    for r in 0..n {
                        let h = u.shard_in_model(r);
                        assert_eq!(h.start, at);
                        at = h.end;
                    }
                    assert_eq!(at, u.range.end);
                }
                assert_eq!(end, layout.len());
                assert_eq!(plan.shard_params() * n, plan.padded_params());
            }
        }
    }

    #[test]
    fn block_units_hold_exactly_their_block() {
        let layout = weft_model::dense_layout(&cfg(false)).unwrap();
        let plan = UnitPlan::per_block(&layout, 3, 2).unwrap();
        let u = &plan.units()[2];
        assert_eq!(u.kind, UnitKind::Block(1));
        for s in layout.specs() {
            let inside = s.range().start >= u.range.start && s.range().end <= u.range.end;
            assert_eq!(inside, s.name.starts_with("transformer.h.1."), "{}", s.name);
        }
        let head = plan.units().last().unwrap();
        assert_eq!(
            head.range.end - head.range.start,
            8 + 8 + 13 * 8,
            "ln_f + untied lm_head"
        );
    }

    #[test]
    fn decay_runs_follow_the_layout_mask() {
        let layout = weft_model::dense_layout(&cfg(true)).unwrap();
        let plan = UnitPlan::per_block(&layout, 3, 4).unwrap();
        for (u, unit) in plan.units().iter().enumerate() {
            let runs = plan.decay_runs(u);
            let mut at = 0;
            for (r, decay) in &runs {
                assert_eq!(r.start, at);
                at = r.end;
                if r.end <= unit.len() {
                    let spec = layout
                        .specs()
                        .iter()
                        .find(|s| s.offset == unit.range.start + r.start)
                        .unwrap();
                    assert_eq!(spec.decay, *decay);
                    assert_eq!(
                        *decay,
                        !(spec.name.contains("ln_") || spec.name.ends_with("bias"))
                    );
                } else {
                    assert!(!decay);
                }
            }
            assert_eq!(at, unit.padded_len(4));
        }
    }

    #[test]
    fn shard_pieces_cover_every_tensor_once_as_boxes() {
        let layout = weft_model::dense_layout(&cfg(false)).unwrap();
        for n in [1, 2, 3, 5] {
            let plan = UnitPlan::per_block(&layout, 3, n).unwrap();
            // mark every element of every tensor covered by some box
            let mut seen: Vec<Vec<u8>> =
                layout.specs().iter().map(|s| vec![0; s.numel()]).collect();
            for u in 0..plan.units().len() {
                for r in 0..n {
                    for p in plan.shard_pieces(u, r) {
                        let i = layout
                            .specs()
                            .iter()
                            .position(|s| s.name == p.name)
                            .unwrap();
                        let cols = if p.shape.len() <= 1 {
                            p.shape[0]
                        } else {
                            p.shape[1..].iter().product()
                        };
                        let mut off = p.shard_offset;
                        let mut total = 0;
                        for b in &p.boxes {
                            assert_eq!(b.shard_offset, off - p.shard_offset);
                            for row in b.rows.clone() {
                                for col in b.cols.clone() {
                                    let e = if p.shape.len() <= 1 {
                                        col
                                    } else {
                                        row * cols + col
                                    };
                                    assert!(p.elements.contains(&e));
                                    seen[i][e] += 1;
                                    total += 1;
                                }
                            }
                            off += b.rows.len() * b.cols.len();
                        }
                        assert_eq!(total, p.elements.len());
                        assert!(p.boxes.len() <= 3);
                    }
                }
            }
            assert!(seen.iter().flatten().all(|&c| c == 1), "n = {n}");
        }
    }

    #[test]
    fn bad_plans_are_typed_errors() {
        let layout = weft_model::dense_layout(&cfg(true)).unwrap();
        assert!(matches!(
            UnitPlan::per_block(&layout, 3, 0),
            Err(Error::Config { field: "dp", .. })
        ));
        assert!(matches!(
            UnitPlan::per_block(&layout, 4, 2),
            Err(Error::Config {
                field: "layout",
                ..
            })
        ));
        let bad = vec![("a".to_string(), UnitKind::Head, 0..5)];
        assert!(matches!(
            UnitPlan::from_ranges(&layout, bad, 2, true),
            Err(Error::Config { field: "units", .. })
        ));
    }
}
