//! Muon over a layout of shards: each whole matrix gathered to one owner
//! rank, orthogonalised there, and its update scattered back.
//!
//! Muon's momentum and its weight step are element-wise, so every rank
//! runs them on whatever pieces of the matrices it holds — a
//! tensor-parallel slice, an FSDP shard, a replica. Newton–Schulz needs
//! the whole matrix. [`MuonPlan`] gives every matrix of a group's
//! layout one owner (the group's ranks share the work, balanced by its
//! cost), and each step moves the pieces' Nesterov inputs to their
//! owners with one all-to-all, orthogonalises, and moves the result back
//! to every rank holding a piece with another:
//!
//! * gathered: each piece the owner does not hold itself, once (a piece
//!   several replicas hold comes from the first of them);
//! * scattered: every piece of every rank except the owner's own.
//!
//! So a matrix of `M` elements cut into `s` pieces over a group of `g`
//! ranks each holding one piece of it (FSDP, tensor parallelism) moves
//! `4·M·(s − 1)/s` bytes in and `4·M·(g − 1)/s` out per step; pure
//! replicas (`s = 1`) send only the result, `4·M·(g − 1)/g` per rank on
//! average. [`MuonPlan::traffic`] counts this rank's exactly.
//!
//! The matrix an owner assembles is, element for element, the one a
//! single rank computes, and Newton–Schulz is deterministic: every
//! layout updates the same bits as one rank.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::{Muon, Precision, WeightShape, muon_apply, muon_momentum, newton_schulz};

use crate::error::{Result, layout_err};
use crate::layout::ParamLayout;

/// One matrix Muon orthogonalises: the columns `cols` of slab `slab` of
/// a tensor of shape `[.., rows, width]` (weft's `[in, out]` layout of a
/// linear's weight: `rows` is fan-in). A fused tensor (`c_attn`'s Q, K
/// and V side by side) is several matrices, one per block of columns;
/// an expert tensor `[experts, in, out]` one per slab.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MuonMatrix {
    /// The tensor (as the layout names it).
    pub tensor: String,
    /// Which `rows × width` slab of the tensor (0 for a 2-D tensor).
    pub slab: usize,
    /// Rows (fan-in).
    pub rows: usize,
    /// The tensor's last dimension.
    pub width: usize,
    /// The matrix's columns (fan-out: `cols.len()`).
    pub cols: Range<usize>,
}

impl MuonMatrix {
    /// The matrices of a tensor of shape `global_shape` (`[.., rows,
    /// width]`), its columns cut into blocks of `blocks` columns (their
    /// sum: the width; empty: one block), one set per slab.
    ///
    /// # Errors
    /// [`Error::Layout`](crate::Error::Layout) for a tensor of fewer than
    /// two dimensions or blocks that do not sum to its width.
    pub fn of_tensor(name: &str, global_shape: &[usize], blocks: &[usize]) -> Result<Vec<Self>> {
        let [lead @ .., rows, width] = global_shape else {
            return Err(layout_err(
                name,
                "Muon needs a matrix of two dimensions or more",
            ));
        };
        let blocks = if blocks.is_empty() {
            &[*width][..]
        } else {
            blocks
        };
        if blocks.iter().sum::<usize>() != *width || blocks.contains(&0) {
            return Err(layout_err(
                name,
                format!("column blocks {blocks:?} do not cut width {width}"),
            ));
        }
        let slabs: usize = lead.iter().product();
        let mut out = Vec::with_capacity(slabs * blocks.len());
        for slab in 0..slabs {
            let mut at = 0;
            for b in blocks {
                out.push(MuonMatrix {
                    tensor: name.to_owned(),
                    slab,
                    rows: *rows,
                    width: *width,
                    cols: at..at + b,
                });
                at += b;
            }
        }
        Ok(out)
    }

    /// Its shape for the Muon kernels: `[in, out]`.
    #[must_use]
    pub fn shape(&self) -> WeightShape {
        WeightShape::InOut {
            fan_in: self.rows,
            fan_out: self.cols.len(),
        }
    }

    /// Its elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.rows * self.cols.len()
    }

    /// Whether it has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Multiply-adds ×2 of one Newton–Schulz orthogonalisation of
    /// `steps` iterations: `4·m²·k + 2·m³` per iteration on the `m × k`
    /// orientation with `m ≤ k`.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn ns_flops(&self, steps: usize) -> f64 {
        let (m, k) = (
            self.rows.min(self.cols.len()) as f64,
            self.rows.max(self.cols.len()) as f64,
        );
        steps as f64 * (4.0 * m * m * k + 2.0 * m * m * m)
    }
}

/// A contiguous piece of one matrix a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    matrix: usize,
    /// First element in the matrix (row-major `rows × cols`).
    at: usize,
    len: usize,
    /// Which of the rank's buffers, and where in it.
    shard: usize,
    local: usize,
}

/// What a rank sends and receives for Muon in one step, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MuonTraffic {
    /// Matrices in the group's layout.
    pub matrices: usize,
    /// Matrices this rank orthogonalises.
    pub owned: usize,
    /// Newton–Schulz FLOPs this rank spends per step.
    pub flops: u64,
    /// Bytes this rank sends per step (its pieces to their owners, the
    /// results of its matrices to their other holders).
    pub sent: u64,
    /// Bytes this rank receives per step.
    pub received: u64,
}

/// What Muon costs a step over every rank of a job: the most of any
/// rank where ranks differ ([`MuonCost::over`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MuonCost {
    /// The matrices Muon takes (on the first rank's stages).
    pub matrices: usize,
    /// Newton–Schulz FLOPs of the busiest rank.
    pub flops: f64,
    /// Bytes the busiest sender sends to gather matrices to their owners
    /// and scatter the updates back.
    pub sent: f64,
    /// Bytes the busiest receiver receives.
    pub received: f64,
    /// Bytes sent over all ranks.
    pub total: f64,
    /// Ranks.
    pub ranks: usize,
}

impl MuonCost {
    /// The cost over `world` of each rank's `mine`. Collective over
    /// `world`.
    ///
    /// # Errors
    /// A collective error.
    #[allow(clippy::cast_precision_loss)]
    pub fn over(world: &dyn Communicator, mine: MuonTraffic) -> Result<Self> {
        let me = [mine.flops as f64, mine.sent as f64, mine.received as f64];
        let mut all = vec![0.0f64; 3 * world.size()];
        world.all_gather(&me, &mut all)?;
        let most = |i: usize| all.iter().skip(i).step_by(3).fold(0.0f64, |a, &b| a.max(b));
        Ok(MuonCost {
            matrices: mine.matrices,
            flops: most(0),
            sent: most(1),
            received: most(2),
            total: all.iter().skip(1).step_by(3).sum(),
            ranks: world.size(),
        })
    }
}

/// Muon over the buffers of one rank of a group (see the module docs):
/// which elements are Muon's, the element-wise steps on them, and the
/// collective orthogonalisation.
///
/// A rank's buffers ("shards") each hold a contiguous range of its
/// layout: one buffer of the whole layout for resident parameters, one
/// per FSDP unit for a sharded model.
pub struct MuonPlan {
    comm: Arc<dyn Communicator>,
    matrices: Vec<MuonMatrix>,
    /// Which rank orthogonalises each matrix.
    owner: Vec<usize>,
    /// This rank's pieces, by buffer then position.
    pieces: Vec<Piece>,
    /// Per buffer: runs of Muon elements (buffer positions), for the
    /// momentum; and runs of one shape, for the weight step.
    momentum_runs: Vec<Vec<Range<usize>>>,
    apply_runs: Vec<Vec<(Range<usize>, WeightShape)>>,
    /// Layout ranges of the tensors Muon takes, sorted.
    tensors: Vec<Range<usize>>,
    /// Per peer: indices of my pieces its matrices need from me.
    gather_send: Vec<Vec<usize>>,
    /// Per peer: (matrix, at, len) of what it sends me, in order.
    gather_recv: Vec<Vec<(usize, usize, usize)>>,
    /// My pieces that fill my own matrices.
    gather_self: Vec<usize>,
    /// Per peer: (matrix, at, len) of its pieces of my matrices.
    scatter_send: Vec<Vec<(usize, usize, usize)>>,
    /// Per peer: indices of my pieces it orthogonalises.
    scatter_recv: Vec<Vec<usize>>,
    /// My pieces of my own matrices.
    scatter_self: Vec<usize>,
    traffic: MuonTraffic,
}

impl std::fmt::Debug for MuonPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuonPlan")
            .field("group", &self.comm.size())
            .field("matrices", &self.matrices.len())
            .field("pieces", &self.pieces.len())
            .field("traffic", &self.traffic)
            .finish_non_exhaustive()
    }
}

/// Elements of a tensor's whole run `whole..whole + len` in `m`'s
/// matrices: `(matrix index, first element in it, elements, offset into
/// the run)`, in run order. `ms` are the tensor's matrices (slab-major,
/// then by columns), `first` the index of `ms[0]`.
fn split_run(
    ms: &[MuonMatrix],
    first: usize,
    whole: usize,
    len: usize,
    out: &mut Vec<(usize, usize, usize, usize)>,
) {
    let (rows, width) = (ms[0].rows, ms[0].width);
    let per_slab = ms.len() / (ms.iter().map(|m| m.slab).max().unwrap_or(0) + 1);
    let slab_len = rows * width;
    let mut e = whole;
    while e < whole + len {
        let (slab, rem) = (e / slab_len, e % slab_len);
        let (r, c) = (rem / width, rem % width);
        let k = ms[slab * per_slab..(slab + 1) * per_slab]
            .iter()
            .position(|m| m.cols.contains(&c))
            .unwrap_or(0);
        let m = &ms[slab * per_slab + k];
        // a block as wide as the tensor runs on to the slab's end
        let end = if m.cols.len() == width {
            (slab + 1) * slab_len
        } else {
            slab * slab_len + r * width + m.cols.end
        };
        let n = end.min(whole + len) - e;
        let at = r * m.cols.len() + (c - m.cols.start);
        out.push((first + slab * per_slab + k, at, n, e - whole));
        e += n;
    }
}

impl MuonPlan {
    /// The plan for a rank of `comm` holding the layout `layout` in
    /// buffers `shards` (each: the layout range it holds, and the layout
    /// element at its position 0), Muon taking `matrices` (every rank of
    /// the group passes the same list, in the same order: the matrices
    /// of the tensors of the group's layout). Collective over `comm`.
    ///
    /// # Errors
    /// [`Error::Layout`](crate::Error::Layout) if the ranks' matrix lists
    /// differ, a matrix's tensor is not in the layout, or the ranks'
    /// pieces do not cover a matrix exactly once; a collective error.
    pub fn new(
        comm: Arc<dyn Communicator>,
        layout: &ParamLayout,
        shards: &[(Range<usize>, usize)],
        matrices: Vec<MuonMatrix>,
    ) -> Result<Self> {
        let (rank, n) = (comm.rank(), comm.size());
        // (u64s travel as f64s, exact below 2⁵³: the hash in halves)
        let h = fingerprint(&matrices);
        #[allow(clippy::cast_precision_loss)]
        let check = [(h >> 32) as f64, (h & 0xffff_ffff) as f64];
        let mut all = vec![0f64; 2 * n];
        (*comm).all_gather(&check, &mut all)?;
        if let Some(r) = all.chunks(2).position(|c| c != check) {
            return Err(layout_err(
                "Muon's matrices",
                format!("rank {r} of the group lists other matrices than rank {rank}"),
            ));
        }
        let (pieces, tensors) = own_pieces(layout, shards, &matrices)?;
        // every rank's pieces, as (matrix, at, len)
        let table = all_pieces(&*comm, &pieces)?;
        let owner = assign_owners(&matrices, &table, n);
        let chosen = choose_sources(&matrices, &owner, &table)?;
        let mut plan = MuonPlan {
            momentum_runs: merged_runs(&pieces, shards.len(), |_| ())
                .into_iter()
                .map(|runs| runs.into_iter().map(|(r, ())| r).collect())
                .collect(),
            apply_runs: merged_runs(&pieces, shards.len(), |p| matrices[p.matrix].shape()),
            comm,
            owner,
            pieces,
            tensors,
            gather_send: vec![Vec::new(); n],
            gather_recv: vec![Vec::new(); n],
            gather_self: Vec::new(),
            scatter_send: vec![Vec::new(); n],
            scatter_recv: vec![Vec::new(); n],
            scatter_self: Vec::new(),
            traffic: MuonTraffic::default(),
            matrices,
        };
        plan.schedule(&table, &chosen);
        Ok(plan)
    }

    /// Fills the exchange lists from every rank's pieces and the pieces
    /// chosen to build each matrix.
    fn schedule(&mut self, table: &[Vec<(usize, usize, usize)>], chosen: &[Vec<bool>]) {
        let me = self.comm.rank();
        for (src, pieces) in table.iter().enumerate() {
            for (i, &(m, at, len)) in pieces.iter().enumerate() {
                let own = self.owner[m];
                if chosen[src][i] {
                    match (src == me, own == me) {
                        (true, true) => self.gather_self.push(i),
                        (true, false) => self.gather_send[own].push(i),
                        (false, true) => self.gather_recv[src].push((m, at, len)),
                        (false, false) => {}
                    }
                }
                match (src == me, own == me) {
                    (true, true) => self.scatter_self.push(i),
                    (true, false) => self.scatter_recv[own].push(i),
                    (false, true) => self.scatter_send[src].push((m, at, len)),
                    (false, false) => {}
                }
            }
        }
        let my = |v: &[usize]| -> u64 { v.iter().map(|&i| 4 * self.pieces[i].len as u64).sum() };
        let their = |v: &[(usize, usize, usize)]| -> u64 { v.iter().map(|x| 4 * x.2 as u64).sum() };
        let owned = (0..self.matrices.len()).filter(|&m| self.owner[m] == me);
        self.traffic = MuonTraffic {
            matrices: self.matrices.len(),
            owned: owned.count(),
            flops: 0,
            sent: self.gather_send.iter().map(|v| my(v)).sum::<u64>()
                + self.scatter_send.iter().map(|v| their(v)).sum::<u64>(),
            received: self.gather_recv.iter().map(|v| their(v)).sum::<u64>()
                + self.scatter_recv.iter().map(|v| my(v)).sum::<u64>(),
        };
    }

    /// This rank's traffic and work per step, with `ns_steps`
    /// Newton–Schulz iterations.
    #[must_use]
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    pub fn traffic(&self, ns_steps: usize) -> MuonTraffic {
        let me = self.comm.rank();
        let flops: f64 = (0..self.matrices.len())
            .filter(|&m| self.owner[m] == me)
            .map(|m| self.matrices[m].ns_flops(ns_steps))
            .sum();
        MuonTraffic {
            flops: flops as u64,
            ..self.traffic
        }
    }

    /// The matrices Muon takes.
    #[must_use]
    pub fn matrices(&self) -> &[MuonMatrix] {
        &self.matrices
    }

    /// Whether the layout range `r` (one tensor's) is Muon's.
    #[must_use]
    pub fn is_muon(&self, r: &Range<usize>) -> bool {
        let i = self.tensors.partition_point(|t| t.end <= r.start);
        self.tensors
            .get(i)
            .is_some_and(|t| t.start <= r.start && r.end <= t.end)
    }

    /// The momentum step on this rank's Muon elements of buffer `shard`:
    /// `momentum` and, in `update`, the Newton–Schulz input
    /// ([`muon_momentum`]); the buffers are laid out as the shard.
    ///
    /// # Errors
    /// A kernel error (a buffer too short, `hp` out of range).
    pub fn momentum(
        &self,
        shard: usize,
        grads: &[f32],
        momentum: &mut [f32],
        update: &mut [f32],
        hp: &Muon,
    ) -> Result<()> {
        for r in &self.momentum_runs[shard] {
            let (Some(g), Some(b), Some(u)) = (
                grads.get(r.clone()),
                momentum.get_mut(r.clone()),
                update.get_mut(r.clone()),
            ) else {
                return Err(layout_err(
                    "Muon's buffers",
                    format!("run {r:?} outside buffer {shard}"),
                ));
            };
            muon_momentum(u, g, b, hp)?;
        }
        Ok(())
    }

    /// Replaces the Nesterov inputs in `updates` (one per buffer) with
    /// the orthogonalised matrices' elements: pieces to their owners,
    /// Newton–Schulz in `precision`, results back. Collective over the
    /// group.
    ///
    /// # Errors
    /// A collective or kernel error.
    pub fn orthogonalize(
        &self,
        updates: &mut [&mut [f32]],
        hp: &Muon,
        precision: Precision,
    ) -> Result<()> {
        let n = self.comm.size();
        let me = self.comm.rank();
        if let Some(i) = self.pieces.iter().position(|p| {
            updates
                .get(p.shard)
                .is_none_or(|u| u.len() < p.local + p.len)
        }) {
            return Err(layout_err(
                "Muon's buffers",
                format!("piece {i} of buffer {} outside them", self.pieces[i].shard),
            ));
        }
        fn held<'a>(updates: &'a [&mut [f32]], p: &Piece) -> &'a [f32] {
            &updates[p.shard][p.local..p.local + p.len]
        }
        let piece = |updates, i: usize| held(updates, &self.pieces[i]);
        // the owned matrices, whole
        let mut whole: BTreeMap<usize, Vec<f32>> = (0..self.matrices.len())
            .filter(|&m| self.owner[m] == me)
            .map(|m| (m, vec![0.0f32; self.matrices[m].len()]))
            .collect();
        let unowned =
            |m: usize| layout_err("Muon's exchange", format!("matrix {m} is not this rank's"));
        for &i in &self.gather_self {
            let p = self.pieces[i];
            let w = whole.get_mut(&p.matrix).ok_or_else(|| unowned(p.matrix))?;
            w[p.at..p.at + p.len].copy_from_slice(piece(updates, i));
        }
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; n];
        for (d, list) in self.gather_send.iter().enumerate() {
            for &i in list {
                send.extend_from_slice(piece(updates, i));
                send_counts[d] += self.pieces[i].len;
            }
        }
        let recv_counts: Vec<usize> = self
            .gather_recv
            .iter()
            .map(|l| l.iter().map(|x| x.2).sum())
            .collect();
        let mut recv = vec![0.0f32; recv_counts.iter().sum()];
        if n > 1 {
            self.comm
                .all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
        }
        let mut at = 0;
        for list in &self.gather_recv {
            for &(m, off, len) in list {
                let w = whole.get_mut(&m).ok_or_else(|| unowned(m))?;
                w[off..off + len].copy_from_slice(&recv[at..at + len]);
                at += len;
            }
        }
        // orthogonalise
        let mut ortho: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        for (m, g) in whole {
            let mut o = vec![0.0f32; g.len()];
            newton_schulz(&mut o, &g, self.matrices[m].shape(), hp, precision)?;
            ortho.insert(m, o);
        }
        // back to every holder
        let mut send = Vec::new();
        let mut send_counts = vec![0usize; n];
        for (d, list) in self.scatter_send.iter().enumerate() {
            for &(m, off, len) in list {
                let o = ortho.get(&m).ok_or_else(|| unowned(m))?;
                send.extend_from_slice(&o[off..off + len]);
                send_counts[d] += len;
            }
        }
        let recv_counts: Vec<usize> = self
            .scatter_recv
            .iter()
            .map(|l| l.iter().map(|&i| self.pieces[i].len).sum())
            .collect();
        let mut recv = vec![0.0f32; recv_counts.iter().sum()];
        if n > 1 {
            self.comm
                .all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
        }
        let mut put = |i: usize, v: &[f32]| {
            let p = self.pieces[i];
            updates[p.shard][p.local..p.local + p.len].copy_from_slice(v);
        };
        for &i in &self.scatter_self {
            let p = self.pieces[i];
            let o = ortho.get(&p.matrix).ok_or_else(|| unowned(p.matrix))?;
            put(i, &o[p.at..p.at + p.len]);
        }
        let mut at = 0;
        for list in &self.scatter_recv {
            for &i in list {
                let len = self.pieces[i].len;
                put(i, &recv[at..at + len]);
                at += len;
            }
        }
        Ok(())
    }

    /// The weight step on this rank's Muon elements of buffer `shard`,
    /// `ortho` holding the orthogonalised update as
    /// [`orthogonalize`](Self::orthogonalize) left it ([`muon_apply`]).
    ///
    /// # Errors
    /// A kernel error.
    pub fn apply(&self, shard: usize, params: &mut [f32], ortho: &[f32], hp: &Muon) -> Result<()> {
        for (r, shape) in &self.apply_runs[shard] {
            let (Some(p), Some(o)) = (params.get_mut(r.clone()), ortho.get(r.clone())) else {
                return Err(layout_err(
                    "Muon's buffers",
                    format!("run {r:?} outside buffer {shard}"),
                ));
            };
            muon_apply(p, o, hp, *shape)?;
        }
        Ok(())
    }

    /// The AdamW runs of `runs` (`(range, decay)` in a buffer whose
    /// position 0 is layout element `base`, one run per tensor as
    /// [`ParamLayout::decay_runs`] gives them): those not Muon's.
    pub fn adamw_runs<I>(&self, runs: I, base: usize) -> Vec<(Range<usize>, bool)>
    where
        I: IntoIterator<Item = (Range<usize>, bool)>,
    {
        runs.into_iter()
            .filter(|(r, _)| !self.is_muon(&(r.start + base..r.end + base)))
            .collect()
    }
}

/// A hash of the matrix list, equal on ranks that list the same.
fn fingerprint(matrices: &[MuonMatrix]) -> u64 {
    use std::hash::{Hash, Hasher};
    // FNV-1a over the Debug text: stable across processes (unlike
    // `DefaultHasher`'s keys)
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    matrices.len().hash(&mut h);
    for m in matrices {
        m.hash(&mut h);
    }
    h.finish()
}

/// This rank's pieces of `matrices`, by buffer and position, and the
/// layout ranges of the tensors they come from.
fn own_pieces(
    layout: &ParamLayout,
    shards: &[(Range<usize>, usize)],
    matrices: &[MuonMatrix],
) -> Result<(Vec<Piece>, Vec<Range<usize>>)> {
    let mut by_tensor: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (i, m) in matrices.iter().enumerate() {
        let e = by_tensor.entry(m.tensor.as_str()).or_insert((i, i));
        if e.1 + 1 < i {
            return Err(layout_err(
                &m.tensor,
                "its Muon matrices are not listed together",
            ));
        }
        e.1 = i;
    }
    let coords = layout.coords();
    let mut pieces = Vec::new();
    let mut tensors = Vec::new();
    let mut split = Vec::new();
    for (name, &(first, last)) in &by_tensor {
        let spec = layout
            .get(name)
            .ok_or_else(|| layout_err(*name, "Muon's matrix is not a tensor of the layout"))?;
        let ms = &matrices[first..=last];
        let slabs: usize = spec.global_shape[..spec.global_shape.len().saturating_sub(2)]
            .iter()
            .product();
        let covered: usize = ms.iter().map(MuonMatrix::len).sum();
        if covered != spec.global_numel() || !ms.len().is_multiple_of(slabs.max(1)) {
            return Err(layout_err(
                *name,
                format!(
                    "Muon's matrices cover {covered} of its {} elements",
                    spec.global_numel()
                ),
            ));
        }
        tensors.push(spec.range());
        for run in spec.runs(&coords)? {
            let l0 = spec.offset + run.local;
            for (s, (held, base)) in shards.iter().enumerate() {
                let (a, b) = (l0.max(held.start), (l0 + run.len).min(held.end));
                if a >= b {
                    continue;
                }
                split.clear();
                split_run(ms, first, run.whole + (a - l0), b - a, &mut split);
                for &(matrix, at, len, off) in &split {
                    pieces.push(Piece {
                        matrix,
                        at,
                        len,
                        shard: s,
                        local: a - base + off,
                    });
                }
            }
        }
    }
    pieces.sort_by_key(|p| (p.shard, p.local));
    tensors.sort_by_key(|r| r.start);
    Ok((pieces, tensors))
}

/// Every rank's pieces as (matrix, at, len), by rank.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss
)]
fn all_pieces(
    comm: &dyn Communicator,
    pieces: &[Piece],
) -> Result<Vec<Vec<(usize, usize, usize)>>> {
    let n = comm.size();
    // (indices travel as f64s, exact below 2⁵³)
    let mut counts = vec![0f64; n];
    comm.all_gather(&[pieces.len() as f64], &mut counts)?;
    let most = counts.iter().map(|&c| c as usize).max().unwrap_or(0);
    let mut mine = vec![0f64; 3 * most];
    for (i, p) in pieces.iter().enumerate() {
        mine[3 * i..3 * i + 3].copy_from_slice(&[p.matrix as f64, p.at as f64, p.len as f64]);
    }
    let mut all = vec![0f64; 3 * most * n];
    comm.all_gather(&mine, &mut all)?;
    Ok((0..n)
        .map(|r| {
            (0..counts[r] as usize)
                .map(|i| {
                    let x = &all[3 * (r * most + i)..3 * (r * most + i) + 3];
                    (x[0] as usize, x[1] as usize, x[2] as usize)
                })
                .collect()
        })
        .collect())
}

/// Owners: the costliest matrix first, each to the rank holding most of
/// it (what it holds moves neither way), ties — every rank of a
/// tensor-parallel slice or a replica holds as much — to the rank with
/// the least Newton–Schulz work so far, then the lowest.
fn assign_owners(
    matrices: &[MuonMatrix],
    table: &[Vec<(usize, usize, usize)>],
    n: usize,
) -> Vec<usize> {
    let mut held = vec![vec![0usize; n]; matrices.len()];
    for (r, pieces) in table.iter().enumerate() {
        for &(m, _, len) in pieces {
            held[m][r] += len;
        }
    }
    let mut order: Vec<usize> = (0..matrices.len()).collect();
    let cost = |m: usize| matrices[m].ns_flops(1);
    order.sort_by(|&a, &b| cost(b).total_cmp(&cost(a)).then(a.cmp(&b)));
    let mut load = vec![0.0f64; n];
    let mut owner = vec![0usize; matrices.len()];
    for m in order {
        let r = (0..n)
            .min_by(|&a, &b| {
                held[m][b]
                    .cmp(&held[m][a])
                    .then(load[a].total_cmp(&load[b]))
                    .then(a.cmp(&b))
            })
            .unwrap_or(0);
        owner[m] = r;
        load[r] += cost(m);
    }
    owner
}

/// Which pieces build each matrix: the owner's own first, then by rank;
/// a piece another already covers is a replica and left out. Every
/// matrix must be covered exactly.
fn choose_sources(
    matrices: &[MuonMatrix],
    owner: &[usize],
    table: &[Vec<(usize, usize, usize)>],
) -> Result<Vec<Vec<bool>>> {
    let mut chosen: Vec<Vec<bool>> = table.iter().map(|p| vec![false; p.len()]).collect();
    // per matrix: chosen intervals, start → end
    let mut covered: Vec<BTreeMap<usize, usize>> = vec![BTreeMap::new(); matrices.len()];
    let ranks = table.len();
    for pass in 0..2 {
        for r in 0..ranks {
            for (i, &(m, at, len)) in table[r].iter().enumerate() {
                if (owner[m] == r) != (pass == 0) {
                    continue;
                }
                let set = &mut covered[m];
                let end = at + len;
                let before = set.range(..=at).next_back().map(|(&s, &e)| (s, e));
                let after = set.range(at + 1..).next().map(|(&s, &e)| (s, e));
                match (before, after) {
                    (Some((s, e)), _) if s <= at && end <= e => {} // a replica's
                    (Some((_, e)), _) if e > at => {
                        return Err(layout_err(
                            &matrices[m].tensor,
                            format!("pieces of a Muon matrix overlap in part at {at}..{end}"),
                        ));
                    }
                    (_, Some((s, _))) if s < end => {
                        return Err(layout_err(
                            &matrices[m].tensor,
                            format!("pieces of a Muon matrix overlap in part at {at}..{end}"),
                        ));
                    }
                    _ => {
                        set.insert(at, end);
                        chosen[r][i] = true;
                    }
                }
            }
        }
    }
    for (m, set) in covered.iter().enumerate() {
        let got: usize = set.iter().map(|(s, e)| e - s).sum();
        if got != matrices[m].len() {
            return Err(layout_err(
                &matrices[m].tensor,
                format!(
                    "the group holds {got} of the {} elements of its Muon matrix {m}",
                    matrices[m].len()
                ),
            ));
        }
    }
    Ok(chosen)
}

/// Per buffer: the pieces' positions merged where they touch and `key`
/// agrees.
fn merged_runs<K: PartialEq + Copy>(
    pieces: &[Piece],
    shards: usize,
    key: impl Fn(&Piece) -> K,
) -> Vec<Vec<(Range<usize>, K)>> {
    let mut out: Vec<Vec<(Range<usize>, K)>> = vec![Vec::new(); shards];
    for p in pieces {
        let k = key(p);
        let runs = &mut out[p.shard];
        match runs.last_mut() {
            Some((r, last)) if r.end == p.local && *last == k => r.end += p.len,
            _ => runs.push((p.local..p.local + p.len, k)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LayoutBuilder, ParallelDims, Placement, Placements, extract};
    use weft_collectives::LocalCluster;
    use weft_kernels::muon_update;

    /// Two blocks' worth of matrices: a fused Q|K|V by columns (cut into
    /// its three matrices), a row-sharded projection, an expert tensor
    /// (two experts, each its matrix), and a gain AdamW keeps.
    fn build(c: crate::Coords) -> Result<ParamLayout> {
        let mut b = LayoutBuilder::new(c);
        b.push("qkv", &[8, 12], true, Placements::tp(Placement::shard(1)))?;
        b.push("gain", &[3], false, Placements::REPLICATED)?;
        b.push("proj", &[10, 8], true, Placements::tp(Placement::shard(0)))?;
        b.push("experts", &[2, 4, 6], true, Placements::REPLICATED)?;
        b.finish()
    }

    fn matrices() -> Vec<MuonMatrix> {
        let mut m = MuonMatrix::of_tensor("qkv", &[8, 12], &[4, 4, 4]).unwrap();
        m.extend(MuonMatrix::of_tensor("proj", &[10, 8], &[]).unwrap());
        m.extend(MuonMatrix::of_tensor("experts", &[2, 4, 6], &[]).unwrap());
        m
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                #[allow(clippy::cast_precision_loss)]
                let v = (x % 1000) as f32 / 500.0 - 1.0;
                v
            })
            .collect()
    }

    /// The serial step: every matrix whole, by `muon_update`.
    fn serial(whole: &ParamLayout, params: &mut [f32], grads: &[f32], hp: &Muon) {
        for m in matrices() {
            let spec = whole.get(&m.tensor).unwrap();
            let at = |r: usize, c: usize| spec.offset + m.slab * m.rows * m.width + r * m.width + c;
            let (mut p, mut g) = (Vec::new(), Vec::new());
            for r in 0..m.rows {
                for c in m.cols.clone() {
                    p.push(params[at(r, c)]);
                    g.push(grads[at(r, c)]);
                }
            }
            let mut buf = vec![0.0; p.len()];
            muon_update(&mut p, &g, &mut buf, m.shape(), hp, Precision::F32).unwrap();
            let mut i = 0;
            for r in 0..m.rows {
                for c in m.cols.clone() {
                    params[at(r, c)] = p[i];
                    i += 1;
                }
            }
        }
    }

    /// Every rank of `tp × dp`, its layout cut into `cuts` buffers (with
    /// `fsdp`, data-parallel rank `d` holding only the `d`-th part of the
    /// layout, as an FSDP shard does; else replicas), steps Muon and ends
    /// with the serial step's bits where it holds them.
    fn matches_serial(tp: usize, dp: usize, fsdp: bool) {
        let whole = build(crate::Coords::default()).unwrap();
        let grads = values(whole.len(), 7);
        let mut want = values(whole.len(), 3);
        let start = want.clone();
        let hp = Muon {
            lr: 0.05,
            ..Muon::default()
        };
        serial(&whole, &mut want, &grads, &hp);
        let dims = ParallelDims {
            tp,
            dp,
            ..ParallelDims::SINGLE
        };
        let out = LocalCluster::run(tp * dp, |comm| -> Result<()> {
            let mesh = dims.build(&comm)?;
            let local = build(mesh.coords().sharding())?;
            let (mut p, mut g) = (vec![0.0; local.len()], vec![0.0; local.len()]);
            extract(&local, &whole, &start, &mut p)?;
            extract(&local, &whole, &grads, &mut g)?;
            let n = local.len();
            let d = mesh.coords().dp();
            // buffers: thirds of the layout (or, under FSDP, this rank's
            // half cut in two)
            let cuts: Vec<Range<usize>> = if fsdp {
                let (a, b) = (d * n / dp, (d + 1) * n / dp);
                vec![a..(a + b) / 2, (a + b) / 2..b]
            } else {
                vec![0..n / 3, n / 3..2 * n / 3, 2 * n / 3..n]
            };
            let shards: Vec<(Range<usize>, usize)> =
                cuts.iter().map(|r| (r.clone(), r.start)).collect();
            let group = mesh.group_arc(crate::DimSet::ALL.without(crate::DimSet::PP));
            let plan = MuonPlan::new(group, &local, &shards, matrices())?;
            // per buffer: parameters, gradients, momentum, update
            type Bufs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
            let mut bufs: Vec<Bufs> = cuts
                .iter()
                .map(|r| {
                    let z = vec![0.0; r.len()];
                    (p[r.clone()].to_vec(), g[r.clone()].to_vec(), z.clone(), z)
                })
                .collect();
            for (s, (_, g, m, v)) in bufs.iter_mut().enumerate() {
                plan.momentum(s, g, m, v, &hp)?;
            }
            let mut ups: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b.3[..]).collect();
            plan.orthogonalize(&mut ups, &hp, Precision::F32)?;
            for (s, (p, _, _, v)) in bufs.iter_mut().enumerate() {
                plan.apply(s, p, v, &hp)?;
            }
            // every element this rank updated is the serial step's
            let coords = local.coords();
            for spec in local.specs() {
                let muon = plan.is_muon(&spec.range());
                assert_eq!(muon, spec.name != "gain", "{}", spec.name);
                for run in spec.runs(&coords)? {
                    for i in 0..run.len {
                        let l = spec.offset + run.local + i;
                        let Some(s) = cuts.iter().position(|c| c.contains(&l)) else {
                            continue;
                        };
                        let got = bufs[s].0[l - cuts[s].start];
                        let w = whole.get(&spec.name).unwrap().offset + run.whole + i;
                        let want = if muon { want[w] } else { start[w] };
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{} element {}",
                            spec.name,
                            run.whole + i
                        );
                    }
                }
            }
            let t = plan.traffic(5);
            assert_eq!(t.matrices, 3 + 1 + 2);
            if tp * dp == 1 {
                assert_eq!((t.sent, t.received), (0, 0));
            }
            Ok(())
        })
        .unwrap();
        for r in out {
            r.unwrap();
        }
    }

    #[test]
    fn one_rank_is_the_serial_step() {
        matches_serial(1, 1, false);
    }

    #[test]
    fn tensor_parallel_slices_and_replicas_are_the_serial_step() {
        matches_serial(2, 2, false);
    }

    #[test]
    fn fsdp_shards_under_tensor_parallelism_are_the_serial_step() {
        matches_serial(2, 2, true);
        matches_serial(1, 3, true);
    }

    #[test]
    fn a_tensor_cut_badly_is_an_error() {
        let e = MuonMatrix::of_tensor("w", &[4, 6], &[4, 3]).unwrap_err();
        assert!(e.to_string().contains("do not cut width 6"), "{e}");
        assert!(MuonMatrix::of_tensor("b", &[6], &[]).is_err());
    }

    #[test]
    fn split_runs_follow_column_blocks() {
        let ms = MuonMatrix::of_tensor("t", &[2, 3, 4], &[1, 3]).unwrap();
        let mut out = Vec::new();
        // slab 0 row 2 col 3 .. slab 1 row 0 col 2
        split_run(&ms, 10, 11, 4, &mut out);
        assert_eq!(
            out,
            vec![(11, 2 * 3 + 2, 1, 0), (12, 0, 1, 1), (13, 0, 2, 2)]
        );
    }
}
