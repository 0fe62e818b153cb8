//! Loading onto another layout, and rewriting a checkpoint for one.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::manifest::{Layout, TensorEntry};
use crate::read::{Checkpoint, ReadRequest};
use crate::region::Region;
use crate::write::{Committed, OwnedShard, SaveOptions, commit, prepare, write_rank_file};

type RegionFn = dyn Fn(&str, &TensorEntry, u32) -> Option<Region> + Send + Sync;

/// A layout to load into or reshard to: the mesh, and which region of each
/// tensor each rank holds. The regions of one tensor over all ranks must
/// tile it exactly once (so a replicated tensor is given to one rank only;
/// other replicas load it with [`Checkpoint::read_tensor`]).
#[derive(Clone)]
pub struct TargetLayout {
    /// The mesh.
    pub layout: Layout,
    rule: Rule,
}

#[derive(Clone)]
enum Rule {
    SplitDim(usize),
    Custom(Arc<RegionFn>),
}

impl fmt::Debug for TargetLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rule = match &self.rule {
            Rule::SplitDim(d) => format!("split dim {d}"),
            Rule::Custom(_) => "custom".to_owned(),
        };
        f.debug_struct("TargetLayout")
            .field("layout", &self.layout)
            .field("rule", &rule)
            .finish()
    }
}

impl TargetLayout {
    /// FSDP-style: `world_size` ranks, every tensor split into near-equal
    /// row ranges (dimension 0); scalars on rank 0.
    pub fn split_rows(world_size: u32) -> Self {
        Self::split_dim("dp", world_size, 0)
    }

    /// `world_size` ranks along mesh dimension `mesh_name`; tensors with
    /// more than `dim` dimensions are split along `dim` (`dim = 1` is
    /// column-parallel for matrices); smaller ones are held whole by rank 0.
    pub fn split_dim(mesh_name: &str, world_size: u32, dim: usize) -> Self {
        TargetLayout {
            layout: Layout::flat(mesh_name, world_size),
            rule: Rule::SplitDim(dim),
        }
    }

    /// Any layout: `f(name, tensor, rank)` gives the region rank `rank`
    /// holds, or `None`.
    pub fn custom(
        layout: Layout,
        f: impl Fn(&str, &TensorEntry, u32) -> Option<Region> + Send + Sync + 'static,
    ) -> Self {
        TargetLayout {
            layout,
            rule: Rule::Custom(Arc::new(f)),
        }
    }

    /// Parses `N` (N ranks, rows split) or `N:dimD` (split along dim D) —
    /// the `weft ckpt reshard --to` syntax.
    ///
    /// # Errors
    /// [`Error::BadName`] describing the expected syntax.
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = || Error::BadName {
            path: spec.into(),
            reason: "expected a layout `N` or `N:dimD` (N ranks, split along dimension D)".into(),
        };
        let (n, dim) = match spec.split_once(':') {
            None => (spec, 0),
            Some((n, d)) => (
                n,
                d.strip_prefix("dim")
                    .and_then(|d| d.parse().ok())
                    .filter(|&d: &usize| d < crate::safetensors::MAX_DIMS)
                    .ok_or_else(bad)?,
            ),
        };
        let n: u32 = n
            .parse()
            .ok()
            .filter(|n| (1..=crate::manifest::MAX_WORLD_SIZE).contains(n))
            .ok_or_else(bad)?;
        Ok(Self::split_dim(if dim == 0 { "dp" } else { "tp" }, n, dim))
    }

    /// Checks that a split of `src` gives every target rank something: no
    /// more ranks than `src`'s longest tensor has elements along the split
    /// dimension (`weft ckpt reshard` writes a file per rank, so a number
    /// past that only writes empty files). A custom rule passes.
    ///
    /// # Errors
    /// [`Error::BadName`] naming the layout and the longest extent.
    pub fn check_against(&self, src: &Checkpoint) -> Result<()> {
        let Rule::SplitDim(d) = &self.rule else {
            return Ok(());
        };
        let widest = src
            .manifest()
            .tensors
            .values()
            .filter_map(|t| t.shape.get(*d).copied())
            .max()
            .unwrap_or(1);
        let n = u64::from(self.layout.world_size);
        if n > widest {
            return Err(Error::BadName {
                path: format!("--to {n}:dim{d}").into(),
                reason: format!(
                    "{n} ranks, but no tensor of {} is longer than {widest} along dimension \
                     {d}: ranks beyond that would hold nothing",
                    src.dir().display()
                ),
            });
        }
        Ok(())
    }

    /// The region of tensor `name` that `rank` holds, if any.
    pub fn region(&self, name: &str, t: &TensorEntry, rank: u32) -> Option<Region> {
        let r = match &self.rule {
            Rule::SplitDim(d) if t.shape.len() > *d => {
                Region::split(&t.shape, *d, self.layout.world_size as usize, rank as usize)
            }
            Rule::SplitDim(_) => (rank == 0).then(|| Region::full(&t.shape))?,
            Rule::Custom(f) => f(name, t, rank)?,
        };
        (r.volume() != Some(0)).then_some(r)
    }
}

/// Reads what rank `rank` of `target` holds from `src`: for each tensor, the
/// region the target assigns it, read from just the overlapping byte
/// ranges of the source shards, checksums verified.
///
/// # Errors
/// [`Error::RegionOutOfBounds`] if the target assigns a region outside a
/// tensor; read errors as [`Checkpoint::read_region`].
pub fn load_shards(src: &Checkpoint, target: &TargetLayout, rank: u32) -> Result<Vec<OwnedShard>> {
    let mut out = Vec::new();
    for (name, t) in &src.manifest().tensors {
        let region = if t.shape.contains(&0) {
            // Zero elements: listed once, by rank 0, so the tensor survives.
            if rank != 0 {
                continue;
            }
            Region::full(&t.shape)
        } else {
            let Some(region) = target.region(name, t, rank) else {
                continue;
            };
            region
        };
        let n = src.region_bytes(name, &region)?;
        out.push(OwnedShard {
            name: name.clone(),
            dtype: t.dtype,
            global_shape: t.shape.clone(),
            region,
            data: vec![0; n],
        });
    }
    // One batch: the reads of all tensors are shared among the threads.
    let mut requests: Vec<ReadRequest<'_>> = out
        .iter_mut()
        .map(|s| ReadRequest {
            name: &s.name,
            region: s.region.clone(),
            out: &mut s.data,
        })
        .collect();
    src.read_many(&mut requests)?;
    Ok(out)
}

/// Writes `src` resharded for `target` as a new checkpoint of the same step
/// and trainer state under `out_root`, committed atomically like any save.
/// Works one target rank at a time, so memory holds one rank's shards.
///
/// # Errors
/// Read errors of the source; [`Error::InvalidShard`] if the target's
/// regions do not tile every tensor; [`Error::Io`] when writing.
pub fn reshard(
    src: &Checkpoint,
    target: &TargetLayout,
    out_root: &Path,
    opts: &SaveOptions,
) -> Result<Committed> {
    let step = src.step();
    let staging = prepare(out_root, step, opts)?;
    // grown as ranks are written: the target's world size is the user's
    let mut reports = Vec::new();
    for rank in 0..target.layout.world_size {
        let shards = load_shards(src, target, rank)?;
        let data: Vec<_> = shards.iter().map(OwnedShard::as_data).collect();
        reports.push(write_rank_file(&staging, rank, &data, opts)?);
    }
    commit(out_root, step, &target.layout, &reports, src.state(), opts)
}
