//! The parallel degrees of a job and the device mesh they build.

use std::fmt;
use std::sync::Arc;

use weft_collectives::{Communicator, Mesh, Traffic};

use crate::error::{Error, Result};
use crate::layout::ParamSpec;
use crate::placement::{Axis, Coords, Placement};

/// The degrees of a parallel layout: pipeline stages, data-parallel ranks
/// (of which `ep` consecutive ones share out the experts), context-parallel
/// ranks (each holding a slice of every sequence) and tensor-parallel
/// ranks. World size `pp · dp · cp · tp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParallelDims {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel ranks (replicas, or FSDP's sharding group).
    pub dp: usize,
    /// Tensor-parallel ranks (consecutive ranks: the fastest links).
    pub tp: usize,
    /// Expert-parallel ranks, a divisor of `dp`: groups of `ep`
    /// consecutive data-parallel ranks share out each layer's experts.
    pub ep: usize,
    /// Context-parallel ranks: each holds two of `2·cp` chunks of every
    /// sequence of the micro-batches its data-parallel rank runs, and
    /// the attention passes keys and values around them.
    pub cp: usize,
}

impl Default for ParallelDims {
    fn default() -> Self {
        ParallelDims::SINGLE
    }
}

impl ParallelDims {
    /// One rank.
    pub const SINGLE: ParallelDims = ParallelDims {
        pp: 1,
        dp: 1,
        tp: 1,
        ep: 1,
        cp: 1,
    };

    /// Ranks in the job: `pp · dp · cp · tp`.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp * self.cp * self.tp
    }

    /// Checks the degrees against each other.
    ///
    /// # Errors
    /// [`Error::Dims`] if a degree is 0 or `ep` does not divide `dp`.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("pp", self.pp),
            ("dp", self.dp),
            ("tp", self.tp),
            ("ep", self.ep),
            ("cp", self.cp),
        ] {
            if v == 0 {
                return Err(Error::Dims {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        if !self.dp.is_multiple_of(self.ep) {
            return Err(Error::Dims {
                field: "ep",
                reason: format!(
                    "= {} must divide dp = {} (experts are shared out over data-parallel ranks)",
                    self.ep, self.dp
                ),
            });
        }
        Ok(())
    }

    /// The tokens of each of the `2·cp` chunks a sequence of `seq` tokens
    /// is cut into under context parallelism (`seq` itself with `cp = 1`):
    /// each must be `64·2^k` tokens, a node of the attention's merge tree
    /// (`weft_kernels::Span`), so that the chunks' partial results merge
    /// into the one-rank bits.
    ///
    /// # Errors
    /// [`Error::Dims`] naming `cp` when `seq` does not cut so.
    pub fn context_chunk(&self, seq: usize) -> Result<usize> {
        if self.cp <= 1 {
            return Ok(seq);
        }
        let n = 2 * self.cp;
        let chunk = seq / n;
        if chunk * n == seq
            && chunk >= 64
            && chunk.is_multiple_of(64)
            && (chunk / 64).is_power_of_two()
        {
            return Ok(chunk);
        }
        let fit = n * 64 * (seq / (n * 64)).max(1).next_power_of_two();
        Err(Error::Dims {
            field: "cp",
            reason: format!(
                "= {} cuts each sequence into 2·cp = {n} chunks, which must be 64·2^k tokens each \
                 (the attention's merge tree); a sequence of {seq} tokens does not cut so: use \
                 2·cp·64·2^k tokens (e.g. {fit}) or another cp",
                self.cp
            ),
        })
    }

    /// The mesh dimensions, slowest first: `pp`, `edp` (the data-parallel
    /// replicas of one expert group, `dp / ep`), `ep`, `cp`, `tp`.
    pub fn mesh_dims(&self) -> [(&'static str, usize); 5] {
        [
            ("pp", self.pp),
            ("edp", self.dp / self.ep.max(1)),
            ("ep", self.ep),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
    }

    /// The coordinates of world rank `rank`: tensor parallel innermost
    /// (consecutive ranks), then context parallel, then the expert group,
    /// then its replicas, the pipeline outermost — Megatron's
    /// `tp-cp-ep-dp-pp` order.
    pub fn coords_of(&self, rank: usize) -> MeshCoords {
        let tp = rank % self.tp;
        let rest = rank / self.tp;
        let cp = rest % self.cp;
        let rest = rest / self.cp;
        let ep = rest % self.ep;
        let rest = rest / self.ep;
        let edp = rest % (self.dp / self.ep);
        let pp = rest / (self.dp / self.ep);
        MeshCoords {
            pp,
            edp,
            ep,
            cp,
            tp,
            dims: *self,
        }
    }

    /// Builds the mesh over `world` (collective: every rank calls it).
    ///
    /// # Errors
    /// [`Error::Dims`] if the degrees are invalid or do not multiply to the
    /// world's size; collective errors from the splits.
    pub fn build(&self, world: &dyn Communicator) -> Result<ParallelMesh> {
        self.validate()?;
        if self.world_size() != world.size() {
            return Err(Error::Dims {
                field: "dp",
                reason: format!(
                    "pp · dp · cp · tp = {} · {} · {} · {} = {} ranks, but the world has {}",
                    self.pp,
                    self.dp,
                    self.cp,
                    self.tp,
                    self.world_size(),
                    world.size()
                ),
            });
        }
        let dims = self.mesh_dims();
        let mesh = Mesh::new(world, &dims)?;
        let mut groups = Vec::with_capacity(32);
        for mask in 0..32u8 {
            let names: Vec<&str> = (0..5)
                .filter(|b| mask & (1 << b) != 0)
                .map(|b| dims[b].0)
                .collect();
            groups.push(Arc::from(mesh.group(&names)?));
        }
        let coords = self.coords_of(world.rank());
        let mut copies = Vec::new();
        for g in (2..self.tp).filter(|g| self.tp.is_multiple_of(*g)) {
            let with_cp = [DimSet::EDP, DimSet::DP].map(|d| d.with(DimSet::CP));
            let with_cp = if self.cp > 1 { &with_cp[..] } else { &[] };
            for &dims in [DimSet::NONE, DimSet::EDP, DimSet::DP]
                .iter()
                .chain(with_cp)
            {
                let (color, key) = copies_split(&coords, dims, g);
                copies.push((g, dims, Arc::from(world.split(color, key)?)));
            }
        }
        Ok(ParallelMesh {
            dims: *self,
            coords,
            mesh,
            groups,
            copies,
        })
    }
}

impl fmt::Display for ParallelDims {
    /// `pp=2 dp=4 (ep=2) tp=2`, with ` cp=2` before `tp` when it splits
    /// sequences.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pp={} dp={}", self.pp, self.dp)?;
        if self.ep > 1 {
            write!(f, " (ep={})", self.ep)?;
        }
        if self.cp > 1 {
            write!(f, " cp={}", self.cp)?;
        }
        write!(f, " tp={}", self.tp)
    }
}

/// The split of the group of [`ParallelMesh::copies_group`]: `(color,
/// key)`, the color the coordinates outside the group and the tp block,
/// the key the coordinates inside it, row-major in mesh order.
fn copies_split(c: &MeshCoords, dims: DimSet, g: usize) -> (u32, u32) {
    let d = c.dims;
    let (mut color, mut key) = (0usize, 0usize);
    for (set, at, size) in [
        (DimSet::PP, c.pp, d.pp),
        (DimSet::EDP, c.edp, d.dp / d.ep),
        (DimSet::EP, c.ep, d.ep),
        (DimSet::CP, c.cp, d.cp),
    ] {
        if dims.contains(set) {
            key = key * size + at;
        } else {
            color = color * size + at;
        }
    }
    color = color * (d.tp / g) + c.tp / g;
    key = key * g + c.tp % g;
    (
        u32::try_from(color).unwrap_or(u32::MAX),
        u32::try_from(key).unwrap_or(u32::MAX),
    )
}

/// A rank's place in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MeshCoords {
    /// Pipeline stage.
    pub pp: usize,
    /// Replica index of the expert group (`dp / ep` of them).
    pub edp: usize,
    /// Index in the expert group.
    pub ep: usize,
    /// Index in the context-parallel group (which chunks of each
    /// sequence this rank holds).
    pub cp: usize,
    /// Index in the tensor-parallel group.
    pub tp: usize,
    /// The degrees.
    pub dims: ParallelDims,
}

impl MeshCoords {
    /// Index in the data-parallel group: `edp · ep + ep`.
    pub fn dp(&self) -> usize {
        self.edp * self.dims.ep + self.ep
    }

    /// The coordinates on the sharding axes, for layouts and placements.
    pub fn sharding(&self) -> Coords {
        Coords {
            tp: (self.tp, self.dims.tp),
            ep: (self.ep, self.dims.ep),
        }
    }

    /// Whether this rank writes `spec`'s tensor when a whole model is
    /// assembled: it is the first of the ranks holding the same part of
    /// it (index 0 of every axis that replicates it — the data-parallel
    /// and context-parallel ranks and, unless it is sharded there, the tp
    /// and ep ranks).
    pub fn owns(&self, spec: &ParamSpec) -> bool {
        let first = |axis: Axis, idx: usize| idx == 0 || spec.placements.get(axis).is_shard();
        self.edp == 0 && self.cp == 0 && first(Axis::Ep, self.ep) && first(Axis::Tp, self.tp)
    }
}

impl fmt::Display for MeshCoords {
    /// `pp 0, dp 1 (edp 0, ep 1), tp 1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pp {}, dp {}", self.pp, self.dp())?;
        if self.dims.ep > 1 {
            write!(f, " (edp {}, ep {})", self.edp, self.ep)?;
        }
        if self.dims.cp > 1 {
            write!(f, ", cp {}", self.cp)?;
        }
        write!(f, ", tp {}", self.tp)
    }
}

/// A set of mesh dimensions, naming the group of ranks that differ only
/// along them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DimSet(u8);

impl DimSet {
    /// No dimension: this rank alone.
    pub const NONE: DimSet = DimSet(0);
    /// The pipeline stages.
    pub const PP: DimSet = DimSet(1);
    /// The replicas of an expert group.
    pub const EDP: DimSet = DimSet(2);
    /// The expert group.
    pub const EP: DimSet = DimSet(4);
    /// The context-parallel group (the ranks sharing each sequence).
    pub const CP: DimSet = DimSet(8);
    /// The tensor-parallel group.
    pub const TP: DimSet = DimSet(16);
    /// The data-parallel group (`edp` and `ep`): the ranks that run
    /// different micro-batches.
    pub const DP: DimSet = DimSet(2 | 4);
    /// Every rank.
    pub const ALL: DimSet = DimSet(31);

    /// Both sets together.
    #[must_use]
    pub const fn with(self, other: DimSet) -> DimSet {
        DimSet(self.0 | other.0)
    }

    /// This set less `other`'s dimensions.
    #[must_use]
    pub const fn without(self, other: DimSet) -> DimSet {
        DimSet(self.0 & !other.0)
    }

    /// Whether `other` is inside this set.
    pub const fn contains(self, other: DimSet) -> bool {
        self.0 & other.0 == other.0
    }

    /// The set of the sharding axis `axis`.
    pub const fn of(axis: Axis) -> DimSet {
        match axis {
            Axis::Tp => DimSet::TP,
            Axis::Ep => DimSet::EP,
        }
    }
}

/// The device mesh of a job: [`weft_collectives::Mesh`] over dimensions
/// `pp`, `edp`, `ep`, `cp`, `tp` (slowest first, so a tensor-parallel
/// group is `tp` consecutive ranks and a context-parallel group the next
/// nearest), with the communicator of every group of dimensions built
/// once.
pub struct ParallelMesh {
    dims: ParallelDims,
    coords: MeshCoords,
    mesh: Mesh,
    groups: Vec<Arc<dyn Communicator>>,
    /// `(copies, dims, group)` of every [`copies_group`](Self::copies_group)
    /// between one rank and the whole tensor-parallel group.
    copies: Vec<(usize, DimSet, Arc<dyn Communicator>)>,
}

impl fmt::Debug for ParallelMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParallelMesh")
            .field("dims", &self.dims)
            .field("coords", &self.coords)
            .finish_non_exhaustive()
    }
}

impl ParallelMesh {
    /// The degrees.
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }

    /// This rank's coordinates.
    pub fn coords(&self) -> MeshCoords {
        self.coords
    }

    /// The underlying named mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The group of ranks that differ from this one only along `dims`
    /// (ordered by their coordinates, row-major in mesh order).
    pub fn group(&self, dims: DimSet) -> &dyn Communicator {
        &*self.groups[usize::from(dims.0)]
    }

    /// The group of ranks that differ from this one along `dims` (without
    /// [`DimSet::TP`]) and along the tensor-parallel axis within this
    /// rank's block of `copies` consecutive tp ranks: the ranks holding
    /// the same copied key/value part (a [`Placement::Shard`] with
    /// `copies`), over which its partial gradients are summed. `copies =
    /// 1` is [`group`](Self::group)`(dims)`, `copies = tp` is `dims` with
    /// the whole tp group.
    ///
    /// # Errors
    /// [`Error::Dims`] if `copies` does not divide `tp` or `dims` holds
    /// the tp axis or the pipeline.
    pub fn copies_group(&self, dims: DimSet, copies: usize) -> Result<&dyn Communicator> {
        Ok(&**self.copies_handle(dims, copies)?)
    }

    /// [`copies_group`](Self::copies_group) as a shared handle.
    ///
    /// # Errors
    /// As [`copies_group`](Self::copies_group).
    pub fn copies_group_arc(&self, dims: DimSet, copies: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::clone(self.copies_handle(dims, copies)?))
    }

    fn copies_handle(&self, dims: DimSet, copies: usize) -> Result<&Arc<dyn Communicator>> {
        let tp = self.dims.tp;
        // a context-parallel axis of one rank is no dimension
        let dims = if self.dims.cp <= 1 {
            dims.without(DimSet::CP)
        } else {
            dims
        };
        if copies == 0 || !tp.is_multiple_of(copies) {
            return Err(Error::Dims {
                field: "tp",
                reason: format!("= {tp} is not a multiple of {copies} copies of a key/value head"),
            });
        }
        if copies == 1 {
            return Ok(&self.groups[usize::from(dims.0)]);
        }
        if copies == tp {
            return Ok(&self.groups[usize::from(dims.with(DimSet::TP).0)]);
        }
        self.copies
            .iter()
            .find(|(g, d, _)| *g == copies && *d == dims)
            .map(|(_, _, c)| c)
            .ok_or_else(|| Error::Dims {
                field: "tp",
                reason: format!("no group of {copies} copies over {dims:?}"),
            })
    }

    /// [`group`](Self::group) as a shared handle (for layers that keep
    /// their group, like the expert-parallel feed-forward block).
    pub fn group_arc(&self, dims: DimSet) -> Arc<dyn Communicator> {
        Arc::clone(&self.groups[usize::from(dims.0)])
    }

    /// Every rank of the job, in mesh order.
    pub fn world(&self) -> &dyn Communicator {
        self.group(DimSet::ALL)
    }

    /// The data-parallel group.
    pub fn dp(&self) -> &dyn Communicator {
        self.group(DimSet::DP)
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &dyn Communicator {
        self.group(DimSet::TP)
    }

    /// The pipeline group (rank `i` holds stage `i`).
    pub fn pp(&self) -> &dyn Communicator {
        self.group(DimSet::PP)
    }

    /// The expert group.
    pub fn ep(&self) -> &dyn Communicator {
        self.group(DimSet::EP)
    }

    /// The context-parallel group: the ranks holding the chunks of the
    /// same sequences.
    pub fn cp(&self) -> &dyn Communicator {
        self.group(DimSet::CP)
    }

    /// The group whose ranks see different tokens and hold the same
    /// elements of a tensor placed `ep` on the expert axis: the whole
    /// data-parallel group, or (for an expert shard) the replicas of the
    /// expert group, each with the context-parallel ranks, which hold the
    /// same parameters and compute on other tokens of the same sequences.
    pub fn data_group_of(&self, ep: Placement) -> DimSet {
        if ep.is_shard() {
            DimSet::EDP.with(DimSet::CP)
        } else {
            DimSet::DP.with(DimSet::CP)
        }
    }

    /// This rank's traffic through each group of the mesh so far (take two
    /// and [`since`](MeshTraffic::since) them to measure a step): the bytes
    /// of each parallel axis apart, as the collectives counted them.
    pub fn traffic(&self) -> MeshTraffic {
        let mut t = MeshTraffic::default();
        for (i, g) in self.groups.iter().enumerate() {
            #[allow(clippy::cast_possible_truncation)]
            t.add(TrafficAxis::of(DimSet(i as u8)), &g.group_traffic());
        }
        for (_, dims, g) in &self.copies {
            t.add(TrafficAxis::of(dims.with(DimSet::TP)), &g.group_traffic());
        }
        t
    }

    /// One line per dimension and this rank's coordinates, for a start-up
    /// report: `mesh pp=1 × edp=2 × ep=1 × tp=2 (tp innermost); rank 3:
    /// pp 0, dp 1, tp 1`.
    pub fn describe(&self) -> String {
        let dims = self.dims.mesh_dims();
        let shape: Vec<String> = dims.iter().map(|(n, s)| format!("{n}={s}")).collect();
        format!(
            "mesh {} (tp innermost); rank {}: {}",
            shape.join(" × "),
            self.world().rank(),
            self.coords
        )
    }
}

/// One rank's traffic through each group of a [`ParallelMesh`]
/// ([`ParallelMesh::traffic`]), by the axis it serves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshTraffic {
    axes: [Traffic; 6],
}

/// The parallel axes whose traffic [`MeshTraffic`] tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrafficAxis {
    /// The tensor-parallel group.
    Tp,
    /// The data-parallel groups: the whole group and the replicas of an
    /// expert group (gradient sums, FSDP's gathers and reduce-scatters,
    /// the losses).
    Dp,
    /// The pipeline group (activations and their gradients between
    /// stages, the tied embedding, the losses).
    Pp,
    /// The context-parallel group (ring attention's keys, values and
    /// their gradients).
    Cp,
    /// The expert group (tokens to their experts and back).
    Ep,
    /// Groups of several axes together (the gradient norm's merges,
    /// assembling a whole model).
    Other,
}

impl TrafficAxis {
    /// Every axis, in report order.
    pub const ALL: [TrafficAxis; 6] = [
        TrafficAxis::Tp,
        TrafficAxis::Dp,
        TrafficAxis::Pp,
        TrafficAxis::Cp,
        TrafficAxis::Ep,
        TrafficAxis::Other,
    ];

    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            TrafficAxis::Tp => "tp",
            TrafficAxis::Dp => "dp",
            TrafficAxis::Pp => "pp",
            TrafficAxis::Cp => "cp",
            TrafficAxis::Ep => "ep",
            TrafficAxis::Other => "other",
        }
    }

    fn of(dims: DimSet) -> TrafficAxis {
        const DP_CP: DimSet = DimSet::DP.with(DimSet::CP);
        const EDP_CP: DimSet = DimSet::EDP.with(DimSet::CP);
        match dims {
            DimSet::TP => TrafficAxis::Tp,
            DimSet::DP | DimSet::EDP | DP_CP | EDP_CP => TrafficAxis::Dp,
            DimSet::PP => TrafficAxis::Pp,
            DimSet::CP => TrafficAxis::Cp,
            DimSet::EP => TrafficAxis::Ep,
            _ => TrafficAxis::Other,
        }
    }
}

impl MeshTraffic {
    /// The traffic for `axis`.
    pub fn axis(&self, axis: TrafficAxis) -> &Traffic {
        &self.axes[axis as usize]
    }

    /// Adds `t` to `axis` (a layer's own groups, like FSDP's shard groups
    /// under [`TrafficAxis::Dp`]).
    pub fn add(&mut self, axis: TrafficAxis, t: &Traffic) {
        self.axes[axis as usize] += t;
    }

    /// Bytes sent for `axis`.
    pub fn sent(&self, axis: TrafficAxis) -> u64 {
        self.axis(axis).total_sent()
    }

    /// Bytes sent for every axis.
    pub fn total_sent(&self) -> u64 {
        self.axes.iter().map(Traffic::total_sent).sum()
    }

    /// `self − earlier`, axis by axis.
    #[must_use]
    pub fn since(&self, earlier: &MeshTraffic) -> MeshTraffic {
        MeshTraffic {
            axes: std::array::from_fn(|i| self.axes[i].since(&earlier.axes[i])),
        }
    }
}

impl std::ops::AddAssign<&MeshTraffic> for MeshTraffic {
    /// Adds `other` axis by axis (e.g. several ranks' traffic).
    fn add_assign(&mut self, other: &MeshTraffic) {
        for (a, b) in self.axes.iter_mut().zip(&other.axes) {
            *a += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_collectives::{CommunicatorExt, LocalCluster, ReduceOp};

    #[test]
    fn ranks_are_laid_out_tp_innermost() {
        let d = ParallelDims {
            pp: 2,
            dp: 4,
            tp: 2,
            ep: 2,
            cp: 1,
        };
        assert_eq!(d.world_size(), 16);
        let c = d.coords_of(0b1011);
        assert_eq!((c.pp, c.edp, c.ep, c.tp), (1, 0, 1, 1));
        assert_eq!(c.dp(), 1);
        for r in 0..16 {
            let c = d.coords_of(r);
            let back = ((c.pp * 2 + c.edp) * 2 + c.ep) * 2 + c.tp;
            assert_eq!(back, r);
        }
        let bad = ParallelDims { ep: 3, ..d };
        assert!(bad.validate().unwrap_err().to_string().contains("ep"));
    }

    #[test]
    fn groups_hold_the_ranks_that_differ_along_their_dims() {
        let d = ParallelDims {
            pp: 2,
            dp: 2,
            tp: 2,
            ep: 1,
            cp: 1,
        };
        let out = LocalCluster::run(8, |comm| {
            let mesh = d.build(&comm)?;
            let me = mesh.world().rank() as f64;
            let sum = |g: DimSet| -> weft_collectives::Result<f64> {
                let mut x = [me];
                mesh.group(g).all_reduce(&mut x, ReduceOp::Sum)?;
                Ok(x[0])
            };
            Ok::<_, Error>((
                sum(DimSet::TP)?,
                sum(DimSet::DP)?,
                sum(DimSet::PP)?,
                sum(DimSet::ALL)?,
            ))
        })
        .unwrap();
        for (r, o) in out.into_iter().enumerate() {
            let (tp, dp, pp, all) = o.unwrap();
            let r = r as f64;
            let t = (r as usize % 2) as f64;
            assert_eq!(tp, 2.0 * (r - t) + 1.0, "tp group of rank {r}");
            let dpi = ((r as usize / 2) % 2) as f64;
            assert_eq!(dp, 2.0 * (r - 2.0 * dpi) + 2.0);
            let ppi = (r as usize / 4) as f64;
            assert_eq!(pp, 2.0 * (r - 4.0 * ppi) + 4.0);
            assert_eq!(all, 28.0);
        }
    }
}
