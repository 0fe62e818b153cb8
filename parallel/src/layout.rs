//! The parameter layout: one contiguous buffer, named views, each with its
//! placement.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{Result, layout_err};
use crate::placement::{Coords, Placements, Run, copied_runs, first_runs, local_shape, runs};

/// One named tensor inside a rank's flat parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// The tensor's name (weft's GPT uses Hugging Face GPT-2 names, e.g.
    /// `transformer.h.0.attn.c_attn.weight`).
    pub name: String,
    /// Shape of this rank's part, row-major in the buffer.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Whether AdamW's weight decay applies (matrices and embeddings yes;
    /// biases and layernorm parameters no).
    pub decay: bool,
    /// Shape of the whole tensor (equal to `shape` when nothing shards it).
    pub global_shape: Vec<usize>,
    /// Where the parameter sits on each sharding axis.
    pub placements: Placements,
    /// Where its gradient sits after a backward: as the parameter, except
    /// where a backward leaves partial sums over an axis
    /// ([`Placement::Partial`](crate::Placement::Partial)) for the reduction to finish.
    pub grad_placements: Placements,
}

impl ParamSpec {
    /// Number of elements on this rank.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// Number of elements of the whole tensor.
    pub fn global_numel(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// Where this rank's elements sit in the whole tensor, at coordinates
    /// `c` (the coordinates the layout was built for).
    ///
    /// # Errors
    /// As [`runs`].
    pub fn runs(&self, c: &Coords) -> Result<Vec<Run>> {
        runs(&self.global_shape, &self.placements, c)
    }

    /// [`runs`](Self::runs) less the copies a lower tensor-parallel rank
    /// holds first ([`first_runs`]): the elements this rank writes to a
    /// checkpoint and counts in the gradient norm.
    ///
    /// # Errors
    /// As [`runs`].
    pub fn first_runs(&self, c: &Coords) -> Result<Vec<Run>> {
        first_runs(&self.global_shape, &self.placements, c)
    }

    /// The runs other tensor-parallel ranks hold copies of
    /// ([`copied_runs`]): where the gradient is partial over the replica
    /// group. Empty for a tensor without copies.
    ///
    /// # Errors
    /// As [`runs`].
    pub fn copied_runs(&self, c: &Coords) -> Result<Vec<Run>> {
        copied_runs(&self.global_shape, &self.placements, c)
    }
}

/// Where every parameter of one rank lives in its single flat buffer.
///
/// Gradients, AdamW moments and checkpoints use the same layout. A model
/// builds it with a [`LayoutBuilder`] (which computes each tensor's local
/// shape from its placements and the rank's coordinates); a pipeline stage
/// or an FSDP unit takes a [`sub`](Self::sub)-layout of a contiguous range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    specs: Vec<ParamSpec>,
    index: HashMap<String, usize>,
    len: usize,
    coords: Coords,
}

impl ParamLayout {
    /// A layout from specs in buffer order, for a rank at `coords`.
    ///
    /// # Errors
    /// [`Error::Layout`](crate::Error::Layout) if the specs overlap or are
    /// out of order, a name repeats, or a local shape does not follow from
    /// the global shape and the placements at `coords`.
    pub fn new(specs: Vec<ParamSpec>, coords: Coords) -> Result<Self> {
        let mut end = 0;
        let mut index = HashMap::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            if s.offset < end {
                return Err(layout_err(
                    &s.name,
                    format!(
                        "starts at {} inside the previous tensor (ends at {end})",
                        s.offset
                    ),
                ));
            }
            let want = local_shape(&s.global_shape, &s.placements, &coords)?;
            if want != s.shape {
                return Err(layout_err(
                    &s.name,
                    format!(
                        "local shape {:?}, but {:?} placed {:?} at {coords:?} gives {want:?}",
                        s.shape, s.global_shape, s.placements
                    ),
                ));
            }
            if index.insert(s.name.clone(), i).is_some() {
                return Err(layout_err(&s.name, "appears twice"));
            }
            end = s.range().end;
        }
        Ok(ParamLayout {
            specs,
            index,
            len: end,
            coords,
        })
    }

    /// Every tensor, in buffer order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Total number of elements (the end of the last tensor).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The coordinates the local shapes were computed for.
    pub fn coords(&self) -> Coords {
        self.coords
    }

    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.index.get(name).map(|&i| &self.specs[i])
    }

    /// The element range of a tensor, if the layout has it.
    pub fn range(&self, name: &str) -> Option<Range<usize>> {
        self.get(name).map(ParamSpec::range)
    }

    /// The tensors lying wholly inside `range` of this buffer, re-based to
    /// a buffer that starts at `range.start` (a pipeline stage's or an
    /// FSDP unit's own layout).
    pub fn sub(&self, range: Range<usize>) -> ParamLayout {
        self.gather(&[range])
    }

    /// The tensors lying wholly inside any of `ranges` (in order, not
    /// overlapping), packed one range after the other into a new buffer:
    /// the layout of a rank holding these pieces of this buffer.
    pub fn gather(&self, ranges: &[Range<usize>]) -> ParamLayout {
        let mut specs = Vec::new();
        let mut base = 0;
        for range in ranges {
            for s in &self.specs {
                let r = s.range();
                if r.start >= range.start && r.end <= range.end {
                    specs.push(ParamSpec {
                        offset: base + r.start - range.start,
                        ..s.clone()
                    });
                }
            }
            base += range.len();
        }
        let index = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        ParamLayout {
            specs,
            index,
            len: base,
            coords: self.coords,
        }
    }

    /// The decay mask as `(range, decay)` per tensor, in buffer order (the
    /// runs AdamW steps over).
    pub fn decay_runs(&self) -> impl Iterator<Item = (Range<usize>, bool)> + Clone + '_ {
        self.specs.iter().map(|s| (s.range(), s.decay))
    }
}

/// Builds a [`ParamLayout`] tensor by tensor for a rank at given
/// coordinates: each tensor is declared with its whole shape and
/// placements, and gets its local shape and the next offset.
///
/// ```
/// use weft_parallel::{Coords, LayoutBuilder, Placement, Placements};
///
/// // rank 1 of a tp = 2 group
/// let c = Coords { tp: (1, 2), ..Coords::SINGLE };
/// let mut b = LayoutBuilder::new(c);
/// b.push("wte", &[50, 8], true, Placements::tp(Placement::shard(0)))?;
/// b.push("ln.weight", &[8], false, Placements::REPLICATED)?;
/// let layout = b.finish()?;
/// assert_eq!(layout.get("wte").unwrap().shape, [25, 8]);
/// assert_eq!(layout.get("ln.weight").unwrap().offset, 200);
/// assert_eq!(layout.len(), 208);
/// # Ok::<(), weft_parallel::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LayoutBuilder {
    coords: Coords,
    specs: Vec<ParamSpec>,
    at: usize,
}

impl LayoutBuilder {
    /// An empty layout for a rank at `coords`.
    pub fn new(coords: Coords) -> Self {
        LayoutBuilder {
            coords,
            specs: Vec::new(),
            at: 0,
        }
    }

    /// Appends tensor `name` of whole shape `global` placed by
    /// `placements` (its gradient placed the same way); returns its range.
    ///
    /// # Errors
    /// As [`local_shape`]; [`Error::Layout`](crate::Error::Layout) if the
    /// layout's size overflows.
    pub fn push(
        &mut self,
        name: impl Into<String>,
        global: &[usize],
        decay: bool,
        placements: Placements,
    ) -> Result<Range<usize>> {
        self.push_with_grad(name, global, decay, placements, placements)
    }

    /// [`push`](Self::push) with a gradient placement of its own (e.g.
    /// [`Placement::Partial`](crate::Placement::Partial) on `tp` for a layernorm under sequence
    /// parallelism).
    ///
    /// # Errors
    /// As [`local_shape`].
    pub fn push_with_grad(
        &mut self,
        name: impl Into<String>,
        global: &[usize],
        decay: bool,
        placements: Placements,
        grad_placements: Placements,
    ) -> Result<Range<usize>> {
        let name = name.into();
        let numel = global
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| self.at.checked_add(n));
        if numel.is_none() {
            return Err(layout_err(
                name,
                format!(
                    "a tensor of shape {global:?} after {} elements overflows this machine's address space",
                    self.at
                ),
            ));
        }
        let shape = local_shape(global, &placements, &self.coords)?;
        let spec = ParamSpec {
            name,
            shape,
            offset: self.at,
            decay,
            global_shape: global.to_vec(),
            placements,
            grad_placements,
        };
        let r = spec.range();
        self.at = r.end;
        self.specs.push(spec);
        Ok(r)
    }

    /// The layout.
    ///
    /// # Errors
    /// [`Error::Layout`](crate::Error::Layout) if a name repeats.
    pub fn finish(self) -> Result<ParamLayout> {
        ParamLayout::new(self.specs, self.coords)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> ParamLayout {
        let mut b = LayoutBuilder::new(Coords::SINGLE);
        b.push("a", &[2, 3], true, Placements::REPLICATED).unwrap();
        b.push("b", &[4], false, Placements::REPLICATED).unwrap();
        b.push("c", &[5], true, Placements::REPLICATED).unwrap();
        b.finish().unwrap()
    }

    #[test]
    fn offsets_follow_in_order_and_sub_layouts_rebase() {
        let l = layout();
        assert_eq!(l.len(), 15);
        assert_eq!(l.range("b"), Some(6..10));
        let s = l.sub(6..15);
        assert_eq!(s.len(), 9);
        assert_eq!(s.range("c"), Some(4..9));
        assert!(s.get("a").is_none());
        let g = l.gather(&[10..15, 0..6]);
        assert_eq!(g.range("c"), Some(0..5));
        assert_eq!(g.range("a"), Some(5..11));
        let runs: Vec<_> = l.decay_runs().collect();
        assert_eq!(runs, [(0..6, true), (6..10, false), (10..15, true)]);
    }

    #[test]
    fn inconsistent_specs_are_errors() {
        let mut specs = layout().specs().to_vec();
        specs[1].offset = 3;
        assert!(ParamLayout::new(specs, Coords::SINGLE).is_err());
        let mut specs = layout().specs().to_vec();
        specs[2].name = "a".into();
        let e = ParamLayout::new(specs, Coords::SINGLE).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let mut specs = layout().specs().to_vec();
        specs[0].shape = vec![3, 2];
        assert!(ParamLayout::new(specs, Coords::SINGLE).is_err());
    }
}
