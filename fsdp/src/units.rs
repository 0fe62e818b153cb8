//! Flat-parameter units and their shards (see [`UnitPlan`]).

use std::ops::Range;

use weft_parallel::{Coords, ParamLayout, ParamSpec};

use crate::error::{Error, Result};

/// A unit as the model declares it: a name, a contiguous range of its
/// parameter buffer, and whether it stays gathered from its forward until
/// its backward (FSDP2's per-module `reshard_after_forward = false`: a
/// unit whose parameters another unit reads, like a tied embedding the
/// output head uses), and which of its tensors stay f32 when parameters
/// are gathered in bf16.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitSpec {
    /// A name for errors and traces (`embed`, `h.3`, `head`, …).
    pub name: String,
    /// Its elements in the model's flat buffer.
    pub range: Range<usize>,
    /// Keep it gathered between its forward and its backward.
    pub keep_gathered: bool,
    /// With bf16 parameters ([`Precision::param`](crate::Precision::param)
    /// `= BF16`), the elements (offsets from `range.start`; sorted,
    /// disjoint) that are gathered and computed in f32 all the same: the
    /// tensors something other than a bf16 product reads — layernorms,
    /// biases, embeddings that are looked up, a router — as PyTorch's FSDP2
    /// keeps them f32 by giving their modules an f32 policy. They travel
    /// beside the bf16 values, 4 bytes each (a unit that keeps everything
    /// moves as many bytes as in f32, and travels as f32). Ignored with f32
    /// parameters.
    pub keep_f32: Vec<Range<usize>>,
}

/// One flat-parameter unit: a contiguous range of the parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Its name (see [`UnitSpec`]).
    pub name: String,
    /// Its elements in the model's flat buffer.
    pub range: Range<usize>,
    /// Elements per rank: `ceil(len / n)`.
    pub shard_len: usize,
    /// Kept gathered from its forward until its backward.
    pub keep_gathered: bool,
    /// Offsets (from `range.start`) kept in f32 under bf16 parameters
    /// (see [`UnitSpec::keep_f32`]).
    pub keep_f32: Vec<Range<usize>>,
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

    /// Words (2 bytes each) of the unit gathered with bf16 parameters:
    /// each of the `n` ranks sends its shard, one bf16 word per element and
    /// two per element kept in f32 ([`keep_f32`](Self::keep_f32)), padded
    /// to the longest rank's.
    pub fn bf16_words(&self, n: usize) -> usize {
        let kept = |r: usize| -> usize {
            let s = self.shard(r);
            self.keep_f32
                .iter()
                .map(|k| k.end.min(s.end).saturating_sub(k.start.max(s.start)))
                .sum()
        };
        n * (self.shard_len + (0..n).map(kept).max().unwrap_or(0))
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
/// ([`ParamLayout`]) that is gathered, computed with and freed as one
/// piece; the model declares them ([`UnitSpec`]) in forward order, tiling
/// the buffer — weft's GPT cuts `embed`, one unit per transformer block,
/// `head` (weft-model's FSDP adapter).
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
/// # Units another unit reads
/// A unit read by a later one (GPT-2's tied `wte`, in the `embed` unit, is
/// also the output head's weight) is declared `keep_gathered`: it stays
/// gathered from its forward until its own backward, and the later unit's
/// backward adds into its gradient buffer. That costs one resident unit
/// (counted under gathered parameters) and saves one all-gather of it per
/// micro-batch.
#[derive(Clone, Debug)]
pub struct UnitPlan {
    units: Vec<Unit>,
    n: usize,
    specs: Vec<ParamSpec>,
    coords: Coords,
    total: usize,
}

impl UnitPlan {
    /// A plan from units that tile the buffer of `layout` in order, sharded
    /// over `n` ranks.
    ///
    /// # Errors
    /// [`Error::Config`] if `n` is 0, a unit is empty, the units do not
    /// tile `0..layout.len()` in order, or a unit's `keep_f32` ranges are
    /// empty, unsorted, overlapping or outside the unit.
    pub fn new(layout: &ParamLayout, units: Vec<UnitSpec>, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::Config {
                field: "dp",
                reason: "the data-parallel group needs at least one rank".into(),
            });
        }
        let mut end = 0;
        let mut out = Vec::new();
        for UnitSpec {
            name,
            range: r,
            keep_gathered,
            keep_f32,
        } in units
        {
            if r.start != end || r.is_empty() {
                return Err(Error::Config {
                    field: "units",
                    reason: format!(
                        "unit {name:?} covers {r:?}; units must be non-empty and tile the buffer in order (expected a start of {end})"
                    ),
                });
            }
            let mut kept_end = 0;
            for k in &keep_f32 {
                if k.is_empty() || k.start < kept_end || k.end > r.len() {
                    return Err(Error::Config {
                        field: "units",
                        reason: format!(
                            "unit {name:?} keeps {k:?} in f32; ranges kept in f32 must be non-empty, sorted, disjoint and inside the unit's {} elements",
                            r.len()
                        ),
                    });
                }
                kept_end = k.end;
            }
            end = r.end;
            out.push(Unit {
                name,
                shard_len: r.len().div_ceil(n),
                range: r,
                keep_gathered,
                keep_f32,
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
            units: out,
            n,
            specs: layout.specs().to_vec(),
            coords: layout.coords(),
            total: layout.len(),
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

    /// The tensors of the buffer, in order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The sharding coordinates of the layout the plan was made from.
    pub fn coords(&self) -> Coords {
        self.coords
    }

    /// The decay mask of unit `u`'s padded buffer as runs of
    /// `(range in the padded unit buffer, decay)`, from each tensor's
    /// [`ParamSpec::decay`] — the same mask a model's own AdamW step over
    /// its layout uses. Padding is reported as a run without decay.
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
    use weft_parallel::{Coords, LayoutBuilder, Placements};

    /// A GPT-like layout: `embed` (two tensors), three blocks, `head`.
    fn layout(untied: bool) -> (ParamLayout, Vec<UnitSpec>) {
        let mut b = LayoutBuilder::new(Coords::SINGLE);
        let rep = Placements::REPLICATED;
        let mut units = Vec::new();
        let e = b.push("wte", &[13, 8], true, rep).unwrap();
        let e2 = b.push("wpe", &[6, 8], true, rep).unwrap();
        units.push(UnitSpec {
            name: "embed".into(),
            range: e.start..e2.end,
            keep_gathered: !untied,
            ..UnitSpec::default()
        });
        for l in 0..3 {
            let a = b
                .push(format!("h.{l}.ln.weight"), &[8], false, rep)
                .unwrap();
            let w = b.push(format!("h.{l}.w"), &[8, 24], true, rep).unwrap();
            let c = b.push(format!("h.{l}.bias"), &[24], false, rep).unwrap();
            let _ = w;
            units.push(UnitSpec {
                name: format!("h.{l}"),
                range: a.start..c.end,
                ..UnitSpec::default()
            });
        }
        let h = b.push("ln_f.weight", &[8], false, rep).unwrap();
        let mut end = h.end;
        if untied {
            end = b.push("lm_head", &[13, 8], true, rep).unwrap().end;
        }
        units.push(UnitSpec {
            name: "head".into(),
            range: h.start..end,
            ..UnitSpec::default()
        });
        (b.finish().unwrap(), units)
    }

    #[test]
    fn units_tile_the_buffer_and_shards_are_even() {
        for untied in [false, true] {
            let (layout, specs) = layout(untied);
            for n in [1, 2, 3, 4, 7] {
                let plan = UnitPlan::new(&layout, specs.clone(), n).unwrap();
                assert_eq!(plan.units().len(), 5);
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
    fn decay_runs_follow_the_layout_mask() {
        let (layout, specs) = layout(false);
        let plan = UnitPlan::new(&layout, specs, 4).unwrap();
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
                } else {
                    assert!(!decay);
                }
            }
            assert_eq!(at, unit.padded_len(4));
        }
    }

    #[test]
    fn shard_pieces_cover_every_tensor_once_as_boxes() {
        let (layout, specs) = layout(true);
        for n in [1, 2, 3, 5] {
            let plan = UnitPlan::new(&layout, specs.clone(), n).unwrap();
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
        let (layout, specs) = layout(false);
        assert!(matches!(
            UnitPlan::new(&layout, specs.clone(), 0),
            Err(Error::Config { field: "dp", .. })
        ));
        assert!(matches!(
            UnitPlan::new(&layout, specs[1..].to_vec(), 2),
            Err(Error::Config { field: "units", .. })
        ));
        let bad = vec![UnitSpec {
            name: "a".into(),
            range: 0..5,
            ..UnitSpec::default()
        }];
        assert!(matches!(
            UnitPlan::new(&layout, bad, 2),
            Err(Error::Config { field: "units", .. })
        ));
    }
}
