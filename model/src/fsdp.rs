//! weft's GPT under `weft-fsdp`: a chunk's units (the embedding, one per
//! block, the head) and the [`ParamStore`] whose hooks drive FSDP's
//! gathers and reduce-scatters from the one block loop.

use std::ops::Range;

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp, ReduceOptions};
use weft_fsdp::{Fsdp, UnitSpec};
use weft_parallel::{ParamLayout, ParamSpec, Placement};

use crate::chunk::{HeadView, Lm, ParamStore, Piece, PieceRanges, missing};
use crate::error::{Error, Result};
use crate::tp::TensorParallel;

/// Which FSDP unit holds each piece of a chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnitMap {
    embed: bool,
    first_layer: usize,
    blocks: usize,
    head: bool,
    /// `ln_f`'s floats in the head unit.
    lnf_len: usize,
    lm: Lm,
    /// `wte`'s floats, the start of the embedding unit (tied output head).
    wte_len: usize,
    /// Per unit, the ranges (from the unit's start) of the tensors whose
    /// gradients a rank's backward leaves partial over the tensor-parallel
    /// group (the layernorms under sequence parallelism).
    partial: Vec<Vec<Range<usize>>>,
    /// Per unit, the ranges (from the unit's start) of the key/value
    /// copies whose gradients are partial over their replica group (more
    /// tensor-parallel ranks than key/value heads).
    copied: Vec<Vec<Range<usize>>>,
    /// Per unit, with expert parallelism, the ranges of the tensors the
    /// expert group replicates (all but the experts): their gradients are
    /// summed over the expert group before FSDP reduces the unit over the
    /// group's replicas.
    ep_replicated: Vec<Vec<Range<usize>>>,
}

impl UnitMap {
    fn unit(&self, p: Piece) -> Result<usize> {
        let e = usize::from(self.embed);
        match p {
            Piece::Embed if self.embed => Ok(0),
            Piece::Block(l) if l >= self.first_layer && l < self.first_layer + self.blocks => {
                Ok(e + l - self.first_layer)
            }
            Piece::Head if self.head => Ok(e + self.blocks),
            _ => Err(missing(format!("{p:?}"))),
        }
    }

    /// Whether the output projection is `wte`, in the embedding unit.
    fn tied_here(&self) -> bool {
        self.embed && self.head && self.lm_in_embed()
    }

    fn lm_in_embed(&self) -> bool {
        matches!(&self.lm, Lm::At(r) if r.start == 0)
    }
}

/// The units of a chunk laid out by `ranges` (in its own buffer, laid out
/// by `layout`): the embedding, each block, the head (ln_f and an untied
/// `lm_head`); the embedding stays gathered until its backward when the
/// head reads it (tied). `experts`: the experts are sharded over an expert
/// group. Returns the units and the piece-to-unit map.
pub(crate) fn units(
    ranges: &PieceRanges,
    layout: &ParamLayout,
    wte_len: usize,
    experts: bool,
) -> (Vec<UnitSpec>, UnitMap) {
    let len = layout.len();
    let mut out = Vec::new();
    let tied = matches!(&ranges.lm, Lm::At(r) if r.start == 0) && ranges.embed.is_some();
    if let Some(e) = &ranges.embed {
        out.push(UnitSpec {
            name: "embed".into(),
            range: e.clone(),
            keep_gathered: tied && ranges.lnf.is_some(),
            ..UnitSpec::default()
        });
    }
    for (i, r) in ranges.blocks.iter().enumerate() {
        out.push(UnitSpec {
            name: format!("h.{}", ranges.first_layer + i),
            range: r.clone(),
            ..UnitSpec::default()
        });
    }
    if let Some(l) = &ranges.lnf {
        out.push(UnitSpec {
            name: "head".into(),
            range: l.start..len,
            ..UnitSpec::default()
        });
    }
    let within = |out: &[UnitSpec], keep: &dyn Fn(&ParamSpec) -> bool| -> Vec<Vec<Range<usize>>> {
        out.iter()
            .map(|u| {
                layout
                    .specs()
                    .iter()
                    .filter(|s| keep(s))
                    .map(ParamSpec::range)
                    .filter(|r| r.start >= u.range.start && r.end <= u.range.end)
                    .map(|r| r.start - u.range.start..r.end - u.range.start)
                    .collect()
            })
            .collect()
    };
    // with bf16 parameters FSDP gathers the products' weights in bf16 (the
    // products round them to the same bits) and everything else in f32
    let kept = within(&out, &|s| !product_weight(&s.name));
    for (unit, kept) in out.iter_mut().zip(kept) {
        unit.keep_f32 = merged(kept);
    }
    let partial = within(&out, &|s| s.grad_placements.tp == Placement::Partial);
    let copied = out
        .iter()
        .map(|u| {
            let mut rs = Vec::new();
            for s in layout
                .specs()
                .iter()
                .filter(|s| s.grad_placements.tp_copies() > 1)
            {
                let r = s.range();
                if r.start < u.range.start || r.end > u.range.end {
                    continue;
                }
                // (the layout checked its placements: no error)
                for run in s.copied_runs(&layout.coords()).unwrap_or_default() {
                    let a = s.offset + run.local - u.range.start;
                    rs.push(a..a + run.len);
                }
            }
            merged(rs)
        })
        .collect();
    let ep_replicated = if experts {
        within(&out, &|s| s.placements.ep == Placement::Replicate)
    } else {
        vec![Vec::new(); out.len()]
    };
    let map = UnitMap {
        partial,
        copied,
        ep_replicated,
        embed: ranges.embed.is_some(),
        first_layer: ranges.first_layer,
        blocks: ranges.blocks.len(),
        head: ranges.lnf.is_some(),
        lnf_len: ranges.lnf.as_ref().map_or(0, Range::len),
        lm: ranges.lm.clone(),
        wte_len,
    };
    (out, map)
}

/// Whether only the linear layers' products read the tensor `name` — the
/// attention and feed-forward projections (experts included) and an
/// untied output head — so that under bf16 mixed precision, whose
/// products round their operands to bf16, FSDP may gather it in bf16
/// without changing a bit. The embeddings (looked up; a tied `wte` is
/// looked up too), layernorms, biases and a router (routing stays f32)
/// are read in f32.
fn product_weight(name: &str) -> bool {
    [
        "c_attn.weight",
        "c_proj.weight",
        "c_fc.weight",
        "gate_up.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
        || name == "lm_head.weight"
}

/// Sorted ranges with the adjacent ones joined.
fn merged(ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Sums `ranges` of `g` (gathered into one buffer) with `reduce`.
fn reduce_ranges(
    g: &mut [f32],
    ranges: &[Range<usize>],
    reduce: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    let mut buf: Vec<f32> = Vec::with_capacity(ranges.iter().map(Range::len).sum());
    for r in ranges {
        buf.extend_from_slice(&g[r.clone()]);
    }
    reduce(&mut buf)?;
    let mut at = 0;
    for r in ranges {
        g[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
        at += r.len();
    }
    Ok(())
}

/// A [`ParamStore`] over a chunk's FSDP state: each hook is FSDP's hook of
/// the piece's unit; a tied head reads the embedding unit (kept gathered)
/// and adds its part of `wte`'s gradient into that unit's buffer. Under
/// sequence parallelism a unit's partial gradients are summed over the
/// tensor-parallel group before FSDP reduces the unit over its
/// data-parallel group, and copied key/value heads' gradients over their
/// replica group.
pub(crate) struct Sharded<'a> {
    pub(crate) fsdp: &'a mut Fsdp,
    pub(crate) map: &'a UnitMap,
    pub(crate) tp: Option<&'a TensorParallel>,
    /// The expert group and whether its sums are exact, with expert
    /// parallelism.
    pub(crate) ep: Option<(&'a dyn Communicator, bool)>,
    /// The micro-batch whose backward the hooks serve.
    pub(crate) mb: usize,
    /// The copy of `wte` and its gradient, on a head-only stage of a tied
    /// model.
    pub(crate) copy: Option<(&'a [f32], Option<&'a mut [f32]>)>,
}

impl ParamStore for Sharded<'_> {
    fn pre_forward(&mut self, p: Piece) -> Result<()> {
        Ok(self.fsdp.pre_forward(self.map.unit(p)?)?)
    }

    fn post_forward(&mut self, p: Piece) -> Result<()> {
        Ok(self.fsdp.post_forward(self.map.unit(p)?)?)
    }

    fn pre_backward(&mut self, p: Piece) -> Result<()> {
        self.fsdp.pre_backward(self.map.unit(p)?, self.mb)?;
        if p == Piece::Head && self.map.tied_here() {
            // the head's backward also writes wte's gradient
            self.fsdp.pre_backward(0, self.mb)?;
        }
        Ok(())
    }

    fn post_backward(&mut self, p: Piece) -> Result<()> {
        let u = self.map.unit(p)?;
        if let Some(tp) = self.tp
            && !self.map.partial[u].is_empty()
        {
            let g = self.fsdp.grads_mut(u, self.mb)?;
            reduce_ranges(g, &self.map.partial[u], |buf| tp.all_reduce(buf))?;
        }
        if let Some(tp) = self.tp
            && !self.map.copied[u].is_empty()
        {
            let g = self.fsdp.grads_mut(u, self.mb)?;
            reduce_ranges(g, &self.map.copied[u], |buf| tp.kv_all_reduce(buf))?;
        }
        if let Some((ep, exact)) = self.ep
            && !self.map.ep_replicated[u].is_empty()
        {
            let g = self.fsdp.grads_mut(u, self.mb)?;
            let opts = ReduceOptions::new(ReduceOp::Sum).reproducible(exact);
            reduce_ranges(g, &self.map.ep_replicated[u], |buf| {
                Ok(ep.all_reduce_with(buf, &opts)?)
            })?;
        }
        Ok(self.fsdp.post_backward(u, self.mb)?)
    }

    fn params(&self, p: Piece) -> Result<&[f32]> {
        let u = self.map.unit(p)?;
        let x = self.fsdp.params(u)?;
        Ok(if p == Piece::Head {
            &x[..self.map.lnf_len]
        } else {
            x
        })
    }

    fn lm_head(&self) -> Result<&[f32]> {
        match (&self.map.lm, &self.copy) {
            (Lm::At(_), _) if self.map.lm_in_embed() => {
                Ok(&self.fsdp.params(0)?[..self.map.wte_len])
            }
            (Lm::At(_), _) => {
                let u = self.map.unit(Piece::Head)?;
                Ok(&self.fsdp.params(u)?[self.map.lnf_len..])
            }
            (Lm::Copy, Some((c, _))) => Ok(c),
            _ => Err(missing("output projection")),
        }
    }

    fn view(&mut self, p: Piece) -> Result<(&[f32], &mut [f32])> {
        let u = self.map.unit(p)?;
        Ok(self.fsdp.view(u, self.mb)?)
    }

    fn head(&mut self) -> Result<HeadView<'_>> {
        let h = self.map.unit(Piece::Head)?;
        let lnf_len = self.map.lnf_len;
        if self.map.tied_here() {
            let ((ph, gh), (p0, g0)) = self.fsdp.views2(h, 0, self.mb)?;
            let w = self.map.wte_len;
            return Ok(HeadView {
                lnf: ph,
                lm: &p0[..w],
                dlnf: gh,
                dlm: &mut g0[..w],
            });
        }
        match &mut self.copy {
            Some((c, Some(dc))) => {
                let (p, g) = self.fsdp.view(h, self.mb)?;
                Ok(HeadView {
                    lnf: p,
                    lm: c,
                    dlnf: g,
                    dlm: dc,
                })
            }
            _ => {
                let (p, g) = self.fsdp.view(h, self.mb)?;
                let (lnf, lm) = p.split_at(lnf_len);
                let (dlnf, dlm) = g.split_at_mut(lnf_len);
                if lm.is_empty() {
                    return Err(Error::Batch {
                        reason: "the head unit holds no output projection".into(),
                    });
                }
                Ok(HeadView { lnf, lm, dlnf, dlm })
            }
        }
    }
}
