//! A job's parallel layout as one value: the `[parallel]` table of
//! `weft train` and the layouts `weft-plan` ranks are the same
//! [`ParallelLayout`], checked by one set of rules ([`ParallelLayout::check`])
//! that name the setting at fault.

use std::fmt;
use std::str::FromStr;

use weft_collectives::Backend;
use weft_numerics::Dtype;
use weft_pipeline::ScheduleKind;

use crate::error::{Error, Result};
use crate::mesh::ParallelDims;

/// What is sharded over the data-parallel group (ZeRO's stages and HSDP;
/// weft-fsdp runs them).
///
/// | strategy | parameters | gradients | optimizer state (master, m, v) |
/// |---|---|---|---|
/// | [`Optimizer`](Self::Optimizer) (ZeRO-1) | replicated | accumulated whole, reduce-scattered once per step | sharded |
/// | [`GradOp`](Self::GradOp) (ZeRO-2) | replicated | reduce-scattered per unit as soon as ready, shard kept | sharded |
/// | [`Full`](Self::Full) (ZeRO-3) | sharded, gathered per unit | as ZeRO-2 | sharded |
/// | [`Hybrid`](Self::Hybrid) (HSDP) | as ZeRO-3 within a shard group | intra-group reduce-scatter, then inter-group all-reduce of the shard | sharded within a group, replicated across groups |
///
/// ZeRO-1 and ZeRO-2 all-gather the updated parameter shards after the
/// optimizer step so every rank holds the full (compute-dtype) parameters
/// again. Plain data parallelism (replicas, all-reduced gradients) is not a
/// sharding strategy: [`GradReducer`](crate::GradReducer) does it for every
/// layout, and a [`ParallelLayout`] says so with `fsdp: None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Strategy {
    /// ZeRO-1: optimizer state sharded.
    Optimizer,
    /// ZeRO-2: optimizer state and gradients sharded.
    GradOp,
    /// ZeRO-3 / full shard: parameters too.
    #[default]
    Full,
    /// HSDP: full sharding within groups of `hybrid_shard` ranks,
    /// replication across groups.
    Hybrid,
}

impl Strategy {
    /// Every strategy.
    pub const ALL: [Strategy; 4] = [
        Strategy::Optimizer,
        Strategy::GradOp,
        Strategy::Full,
        Strategy::Hybrid,
    ];

    /// The name used in `parallel.fsdp`: `optimizer`, `grad_op`, `full`, `hybrid`.
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::Optimizer => "optimizer",
            Strategy::GradOp => "grad_op",
            Strategy::Full => "full",
            Strategy::Hybrid => "hybrid",
        }
    }

    /// Whether parameters are sharded (gathered per unit before use).
    pub const fn shards_params(self) -> bool {
        matches!(self, Strategy::Full | Strategy::Hybrid)
    }

    /// Whether gradients are reduce-scattered per unit and only the shard kept.
    pub const fn shards_grads(self) -> bool {
        matches!(self, Strategy::GradOp | Strategy::Full | Strategy::Hybrid)
    }

    /// Whether the optimizer state (f32 master, m, v) is sharded (every
    /// strategy shards it).
    pub const fn shards_optimizer(self) -> bool {
        true
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| Error::Dims {
                field: "fsdp",
                reason: format!(
                    "{s:?} is not a strategy; expected one of \"full\", \"grad_op\", \"optimizer\", \"hybrid\""
                ),
            })
    }
}

/// `parallel.fsdp` as a job file writes it: `"none"` (replicas) or a
/// [`Strategy`]'s name.
#[cfg(feature = "serde")]
mod fsdp_choice {
    use super::Strategy;

    const NAMES: &[&str] = &["none", "optimizer", "grad_op", "full", "hybrid"];

    pub(super) fn serialize<S: serde::Serializer>(
        v: &Option<Strategy>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.map_or("none", Strategy::name))
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Strategy>, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        if name == "none" {
            return Ok(None);
        }
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == name)
            .map(Some)
            .ok_or_else(|| serde::de::Error::unknown_variant(&name, NAMES))
    }
}

/// How a job is split over its ranks: the degrees of the mesh, the
/// sharding of the data-parallel group, the pipeline schedule, and how
/// the ranks sum and run. `weft train`'s `[parallel]` table is this value
/// (with the `serde` feature, key for key); `weft-plan` ranks candidates
/// of it. The world is `dp · tp · pp` ranks.
///
/// The global batch is the same whatever the split: a job's batch of
/// sequences per optimizer step in micro-batches ([`BatchSplit`]); each
/// data-parallel rank computes `1/dp` of the micro-batches (gradient
/// accumulation over them), and with `pp` stages they flow through the
/// pipeline.
///
/// ```
/// use weft_parallel::{ModelShape, ParallelLayout, Strategy};
///
/// let layout = ParallelLayout { dp: 2, tp: 2, fsdp: Some(Strategy::Full), ..ParallelLayout::default() };
/// let shape = ModelShape { layers: 4, heads: 4, kv_heads: 4, experts: 0, seq: 64 };
/// // 32 sequences of 64 tokens per step, micro-batches chosen: 512 tokens
/// let split = layout.check(&shape, 32, 0)?;
/// assert_eq!((split.micro, split.per_rank), (8, 2));
/// assert_eq!(layout.world_size(), 4);
/// let e = ParallelLayout { tp: 3, ..layout }.check(&shape, 32, 0).unwrap_err();
/// assert!(e.to_string().starts_with("parallel.tp:"));
/// # Ok::<(), weft_parallel::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields, default)
)]
pub struct ParallelLayout {
    /// Data-parallel degree: ranks that each compute a share of the
    /// micro-batches.
    pub dp: usize,
    /// Sharding over the data-parallel group: `None` for replicas with
    /// all-reduced gradients (`"none"` in a job file), else the
    /// [`Strategy`].
    #[cfg_attr(feature = "serde", serde(with = "fsdp_choice"))]
    pub fsdp: Option<Strategy>,
    /// Ranks per sharding domain with [`Strategy::Hybrid`]; must divide
    /// the sharded group, `dp / ep`.
    pub hybrid_shard: usize,
    /// Tensor-parallel degree: each layer's matrices split over `tp`
    /// consecutive ranks (Megatron-LM style); must divide the heads.
    pub tp: usize,
    /// With `tp > 1`: sequence parallelism (layernorm regions sharded along
    /// the tokens; reduce-scatter and all-gather instead of all-reduce).
    pub sequence_parallel: bool,
    /// Pipeline stages.
    pub pp: usize,
    /// Pipeline schedule.
    pub pp_schedule: ScheduleKind,
    /// Model chunks per stage for the interleaved schedule (v); the other
    /// schedules run theirs ([`ScheduleKind::chunks`]).
    pub pp_chunks: usize,
    /// Expert-parallel degree (mixture-of-experts models): experts are
    /// sharded over groups of `ep` data-parallel ranks.
    pub ep: usize,
    /// Context-parallel degree: every sequence is cut into `2·cp` chunks
    /// and each of `cp` ranks holds two of them (`r` and `2·cp − 1 − r`,
    /// the same attention work on each); attention passes keys and values
    /// around the ranks (ring attention). The sequence length must be
    /// `2·cp` chunks of `64·2^k` tokens.
    pub cp: usize,
    /// Reproducible reductions: micro-batch gradients are summed exactly
    /// and rounded once, so every split of the global batch over ranks
    /// gives bitwise the same result. Off: plain f32 accumulation (faster).
    pub reproducible: bool,
    /// The dtype gradients travel in between data-parallel ranks: `F32`,
    /// or `BF16` (half the bytes; every addition is still computed in f32
    /// and rounded once, and the reproducible sums stay exact before their
    /// one rounding): FSDP's reduce-scatter, or the replicas' all-reduce.
    pub grad_wire: Dtype,
    /// How the ranks run: MPI processes when started by a launcher, else
    /// threads (`Auto`), or as named.
    pub backend: Backend,
    /// Seconds a rank waits for a peer in any collective before the run
    /// fails with an error naming the missing ranks and the operation.
    pub timeout_s: f64,
    /// Kernel threads of each rank (its pool): 0 shares the host's cores
    /// out over the ranks on it, at least one each; more than the cores
    /// is refused. Like `OMP_NUM_THREADS`, it changes the speed, not the
    /// results.
    pub threads: usize,
}

impl Default for ParallelLayout {
    fn default() -> Self {
        Self {
            dp: 1,
            fsdp: None,
            hybrid_shard: 1,
            tp: 1,
            sequence_parallel: false,
            pp: 1,
            pp_schedule: ScheduleKind::OneFOneB,
            pp_chunks: 2,
            ep: 1,
            cp: 1,
            reproducible: true,
            grad_wire: Dtype::F32,
            backend: Backend::Auto,
            timeout_s: 300.0,
            threads: 0,
        }
    }
}

/// The dimensions of a model that decide which layouts can split it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer blocks, L.
    pub layers: usize,
    /// Attention (query) heads (a tensor-parallel rank holds whole heads).
    pub heads: usize,
    /// Key/value heads: `heads` for multi-head attention, fewer for
    /// grouped-query attention (a rank holds whole ones too, or with `tp`
    /// a multiple of them a copy of one).
    pub kv_heads: usize,
    /// Routed experts per layer (0: dense).
    pub experts: usize,
    /// Tokens per sequence, T.
    pub seq: usize,
}

/// How a step's global batch is cut ([`ParallelLayout::batch_split`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSplit {
    /// Sequences per micro-batch.
    pub micro: usize,
    /// Micro-batches of the global batch.
    pub global: usize,
    /// Micro-batches each data-parallel rank runs (and accumulates).
    pub per_rank: usize,
    /// The micro-batch size was chosen (`micro_batch_size = 0`) from this
    /// layout, because the layout-free default
    /// ([`DEFAULT_MICRO_TOKENS`]) could not be shared by its
    /// data-parallel ranks: a run of another layout is bitwise this one
    /// only with `micro_batch_size` set to [`micro`](Self::micro).
    pub by_layout: bool,
}

/// Tokens of a default micro-batch (`micro_batch_size = 0`): the largest
/// divisor of the batch whose sequences hold at most this many tokens (at
/// least one sequence), whatever the layout. A micro-batch's weight
/// gradients sum over its tokens inside the products, so its size is
/// part of a run's bits (the exact sums make every split of the batch
/// over ranks bitwise equal only for one micro-batch size); a default
/// that does not depend on the layout keeps runs that change only the
/// layout bitwise equal. 512 tokens keep the products large enough on
/// CPU ranks (the default job's step costs the same at 8 sequences of 64
/// tokens as at 32).
pub const DEFAULT_MICRO_TOKENS: usize = 512;

impl BatchSplit {
    /// The split for the start-up report: `4 micro-batches of 8
    /// sequences (2 per data-parallel rank)`, and, chosen from the layout,
    /// which setting makes another layout's run bitwise this one.
    #[must_use]
    pub fn describe(&self) -> String {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        let mut d = format!(
            "{} micro-batch{} of {} sequence{} ({} per data-parallel rank)",
            self.global,
            if self.global == 1 { "" } else { "es" },
            self.micro,
            s(self.micro),
            self.per_rank
        );
        if self.by_layout {
            d.push_str(&format!(
                "; chosen from this layout, whose data-parallel ranks cannot share the default \
                 micro-batches: another layout's run is bitwise this one with \
                 train.micro_batch_size = {}",
                self.micro
            ));
        }
        d
    }
}

/// The most micro-batches a step's batch may be cut into (a pipeline
/// schedule holds an action per micro-batch and stage).
pub const MAX_MICRO_BATCHES: usize = 1 << 20;

/// The largest degree a layout takes on any axis, and the largest world
/// (`dp · tp · pp`) it may make.
pub const MAX_DEGREE: usize = 1 << 20;

impl ParallelLayout {
    /// Ranks in the job: `dp · cp · tp · pp`.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.dp * self.cp * self.tp * self.pp
    }

    /// The mesh's degrees.
    #[must_use]
    pub fn dims(&self) -> ParallelDims {
        ParallelDims {
            pp: self.pp,
            dp: self.dp,
            tp: self.tp,
            ep: self.ep,
            cp: self.cp,
        }
    }

    /// Model chunks per pipeline stage: 1 without a pipeline, else what
    /// the schedule runs ([`ScheduleKind::chunks`] of `pp_chunks`).
    #[must_use]
    pub fn chunks(&self) -> usize {
        if self.pp > 1 {
            self.pp_schedule.chunks(self.pp_chunks)
        } else {
            1
        }
    }

    /// The size of the group the sharding shards over: `dp / ep · cp`
    /// (the expert group's replicas with the context-parallel ranks,
    /// which hold the same parameters), `hybrid_shard` for HSDP, 1 for
    /// replicas.
    #[must_use]
    pub fn shard_group(&self) -> usize {
        match self.fsdp {
            None => 1,
            Some(Strategy::Hybrid) => self.hybrid_shard,
            Some(_) => self.dp / self.ep.max(1) * self.cp,
        }
    }

    /// How a global batch of `batch` sequences of `seq` tokens is cut: in
    /// micro-batches of `micro_batch_size` sequences, or with 0 the
    /// layout-free default ([`DEFAULT_MICRO_TOKENS`]); where its
    /// micro-batches cannot be shared equally by the data-parallel ranks
    /// (or, for the interleaved schedule, in multiples of `pp`), one chosen
    /// for the layout ([`BatchSplit::by_layout`]: as many per data-parallel
    /// rank as there are pipeline stages, else one per rank).
    ///
    /// # Errors
    /// [`Error::Batch`] naming `batch_size` or `micro_batch_size` and the
    /// sizes and degrees that conflict, when the batch does not split.
    pub fn batch_split(
        &self,
        batch: usize,
        micro_batch_size: usize,
        seq: usize,
    ) -> Result<BatchSplit> {
        let (dp, pp) = (self.dp.max(1), self.pp.max(1));
        let bad = |field, reason| Err(Error::Batch { field, reason });
        if batch == 0 {
            return bad("batch_size", "must be at least 1".into());
        }
        let cap = (DEFAULT_MICRO_TOKENS / seq.max(1)).max(1);
        let free = (1..=cap.min(batch))
            .rev()
            .find(|&d| batch.is_multiple_of(d))
            .unwrap_or(1);
        // shared equally by the data-parallel ranks, and for the
        // interleaved schedule a multiple of pp on each
        let per_rank = batch / free / dp;
        let fits = (batch / free).is_multiple_of(dp)
            && (pp == 1
                || self.pp_schedule != ScheduleKind::Interleaved
                || per_rank.is_multiple_of(pp) && per_rank > 0);
        let by_layout = micro_batch_size == 0 && !fits;
        let micro = match micro_batch_size {
            0 if !by_layout => free,
            0 if batch.is_multiple_of(dp * pp) => batch / (dp * pp),
            0 if batch.is_multiple_of(dp) => batch / dp,
            0 => {
                return bad(
                    "batch_size",
                    format!(
                        "= {batch} sequences cannot be shared by dp = {dp} data-parallel ranks; use a multiple of {dp}"
                    ),
                );
            }
            m => m,
        };
        if !batch.is_multiple_of(micro) {
            return bad(
                "micro_batch_size",
                format!("= {micro} does not divide batch_size = {batch}; use a divisor of {batch}"),
            );
        }
        let global = batch / micro;
        if global > MAX_MICRO_BATCHES {
            return bad(
                "batch_size",
                format!(
                    "= {batch} sequences make {global} micro-batches of {micro} per step, more than \
                     {MAX_MICRO_BATCHES}; use a smaller batch_size or a larger micro_batch_size"
                ),
            );
        }
        if !global.is_multiple_of(dp) {
            return bad(
                "micro_batch_size",
                format!(
                    "= {micro} cuts batch_size = {batch} into {global} micro-batches, which dp = {dp} ranks cannot share equally; use a micro-batch size that divides {}",
                    batch / dp
                ),
            );
        }
        Ok(BatchSplit {
            micro,
            global,
            per_rank: global / dp,
            by_layout,
        })
    }

    /// Checks the layout against itself, the machine, a model of `shape`
    /// and a global batch of `batch` sequences in micro-batches of
    /// `micro_batch_size` (0: chosen, see [`batch_split`](Self::batch_split)):
    /// every rule a run on it needs, so nothing is refused once ranks
    /// have started. Returns the batch's split.
    ///
    /// # Errors
    /// [`Error::Dims`] naming the setting at fault (`dp`, `tp`, `pp`,
    /// `ep`, `pp_chunks`, `pp_schedule`, `hybrid_shard`,
    /// `sequence_parallel`, `timeout_s`, `threads`, `grad_wire`) with the
    /// numbers; [`Error::Batch`] as [`batch_split`](Self::batch_split).
    pub fn check(
        &self,
        shape: &ModelShape,
        batch: usize,
        micro_batch_size: usize,
    ) -> Result<BatchSplit> {
        let bad = |field, reason| Err(Error::Dims { field, reason });
        for (field, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("ep", self.ep),
            ("cp", self.cp),
            ("pp_chunks", self.pp_chunks),
            ("hybrid_shard", self.hybrid_shard),
        ] {
            if v == 0 || v > MAX_DEGREE {
                return bad(field, format!("must be in 1..={MAX_DEGREE} (got {v})"));
            }
        }
        let world = self
            .dp
            .checked_mul(self.tp)
            .and_then(|w| w.checked_mul(self.pp))
            .and_then(|w| w.checked_mul(self.cp))
            .filter(|&w| w <= MAX_DEGREE);
        if world.is_none() {
            return bad(
                "dp",
                format!(
                    "dp · cp · tp · pp = {} · {} · {} · {} ranks is more than {MAX_DEGREE}",
                    self.dp, self.cp, self.tp, self.pp
                ),
            );
        }
        self.dims().context_chunk(shape.seq)?;
        let split = self.batch_split(batch, micro_batch_size, shape.seq)?;
        if !shape.heads.is_multiple_of(self.tp) {
            return bad(
                "tp",
                format!(
                    "must divide the model's heads ({}; heads stay whole on a rank), got {}",
                    shape.heads, self.tp
                ),
            );
        }
        if !(shape.kv_heads.is_multiple_of(self.tp) || self.tp.is_multiple_of(shape.kv_heads)) {
            return bad(
                "tp",
                format!(
                    "must divide the model's key/value heads ({}) or be a multiple of them \
                     (each rank holds whole key/value heads with the query heads that read \
                     them, or a copy of the one its query heads read), got {}",
                    shape.kv_heads, self.tp
                ),
            );
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0 && self.timeout_s <= 1e9) {
            return bad(
                "timeout_s",
                format!("must be a number of seconds > 0 (got {})", self.timeout_s),
            );
        }
        // (asked only for a pinned count: the question reads cgroup files,
        // and a planner checks many layouts)
        if self.threads > 1
            && let cores =
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            && self.threads > cores
        {
            return bad(
                "threads",
                format!(
                    "must be at most this machine's {cores} cores (got {}); 0 shares them out over the ranks",
                    self.threads
                ),
            );
        }
        if !matches!(self.grad_wire, Dtype::F32 | Dtype::BF16) {
            return bad(
                "grad_wire",
                format!("= {:?}: gradients travel as f32 or bf16", self.grad_wire),
            );
        }
        if self.sequence_parallel && self.tp == 1 {
            return bad(
                "sequence_parallel",
                "splits the tensor-parallel group's tokens: it needs tp > 1 (got tp = 1), or leave it false".into(),
            );
        }
        if self.sequence_parallel && !(split.micro * shape.seq).is_multiple_of(self.tp) {
            return bad(
                "sequence_parallel",
                format!(
                    "needs tp = {} to divide the tokens of a micro-batch ({} sequences of {})",
                    self.tp, split.micro, shape.seq
                ),
            );
        }
        if self.ep > 1 && (shape.experts == 0 || !shape.experts.is_multiple_of(self.ep)) {
            return bad(
                "ep",
                format!(
                    "needs a mixture-of-experts model whose expert count (= {}) it divides (got {})",
                    shape.experts, self.ep
                ),
            );
        }
        self.dims().validate()?;
        let group = self.dp / self.ep * self.cp;
        if self.fsdp == Some(Strategy::Hybrid) && !group.is_multiple_of(self.hybrid_shard) {
            return bad(
                "hybrid_shard",
                format!(
                    "must divide the sharded group, dp / ep · cp = {} / {} · {} = {group} (got {})",
                    self.dp, self.ep, self.cp, self.hybrid_shard
                ),
            );
        }
        if self.pp > 1 {
            let chunks = self.chunks();
            if self.pp_schedule == ScheduleKind::Interleaved
                && !split.per_rank.is_multiple_of(self.pp)
            {
                return bad(
                    "pp_schedule",
                    format!(
                        "\"interleaved\" needs the micro-batches per data-parallel rank ({}) to be a multiple of pp = {}",
                        split.per_rank, self.pp
                    ),
                );
            }
            if shape.layers < self.pp * chunks {
                return bad(
                    "pp",
                    format!(
                        "{} stage(s) × {chunks} chunk(s) of schedule {} need at least as many layers (the model has {})",
                        self.pp, self.pp_schedule, shape.layers
                    ),
                );
            }
        }
        Ok(split)
    }
}

impl fmt::Display for ParallelLayout {
    /// The degrees above 1 and the settings that go with them, as the
    /// start-up report names a layout: `dp=2 tp=2 fsdp full
    /// sequence-parallel reproducible sums`, or `single rank`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("ep", self.ep),
            ("cp", self.cp),
        ]
        .iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
        if let Some(s) = self.fsdp {
            parts.push(format!("fsdp {s}"));
        }
        if self.tp > 1 && self.sequence_parallel {
            parts.push("sequence-parallel".into());
        }
        if self.pp > 1 {
            parts.push(format!("schedule {}", self.pp_schedule));
        }
        if self.grad_wire != Dtype::F32 && self.dp > 1 {
            parts.push(format!("{} gradients on the wire", self.grad_wire));
        }
        if self.world_size() > 1 {
            parts.push(if self.reproducible {
                "reproducible sums".into()
            } else {
                "plain f32 sums".into()
            });
        }
        if parts.is_empty() {
            f.write_str("single rank")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            layers: 8,
            heads: 8,
            kv_heads: 8,
            experts: 0,
            seq: 64,
        }
    }

    fn field(l: ParallelLayout, batch: usize, micro: usize) -> &'static str {
        match l.check(&shape(), batch, micro) {
            Err(Error::Dims { field, .. } | Error::Batch { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_global_batch_splits_over_any_layout_by_default() {
        // 32 sequences of 64 tokens: micro-batches of 8 (512 tokens)
        let split = |l: ParallelLayout, micro| l.batch_split(32, micro, 64).unwrap();
        let s = |micro, global, per_rank, by_layout| BatchSplit {
            micro,
            global,
            per_rank,
            by_layout,
        };
        let one = ParallelLayout::default();
        assert_eq!(split(one, 0), s(8, 4, 4, false));
        // the same micro-batches on every layout they can be shared by
        assert_eq!(split(ParallelLayout { dp: 2, ..one }, 0), s(8, 4, 2, false));
        assert_eq!(split(ParallelLayout { pp: 2, ..one }, 0), s(8, 4, 4, false));
        let three = ParallelLayout {
            pp: 2,
            tp: 2,
            dp: 2,
            ..one
        };
        assert_eq!(split(three, 0), s(8, 4, 2, false));
        assert_eq!(split(ParallelLayout { dp: 4, ..one }, 0), s(8, 4, 1, false));
        // 8 ranks cannot share 4 micro-batches: chosen from the layout
        assert_eq!(split(ParallelLayout { dp: 8, ..one }, 0), s(4, 8, 1, true));
        assert_eq!(split(ParallelLayout { dp: 2, ..one }, 4), s(4, 8, 4, false));
        // long sequences: one per micro-batch; short ones: the divisor
        let b = |batch, seq| one.batch_split(batch, 0, seq).unwrap().micro;
        assert_eq!((b(32, 1024), b(32, 256), b(12, 64), b(7, 64)), (1, 2, 6, 7));
        assert_eq!(field(ParallelLayout { dp: 3, ..one }, 32, 0), "batch_size");
        assert_eq!(
            field(ParallelLayout { dp: 4, ..one }, 32, 16),
            "micro_batch_size"
        );
    }

    #[test]
    fn each_rule_names_its_setting() {
        let one = ParallelLayout::default();
        assert_eq!(field(ParallelLayout { tp: 3, ..one }, 32, 0), "tp");
        // more tensor-parallel ranks than key/value heads: copies of them
        // when tp is a multiple of them, refused when neither divides
        let gqa = |kv_heads| ModelShape {
            kv_heads,
            ..shape()
        };
        assert!(
            ParallelLayout { tp: 4, ..one }
                .check(&gqa(2), 32, 0)
                .is_ok()
        );
        assert!(
            ParallelLayout { tp: 8, ..one }
                .check(&gqa(1), 32, 0)
                .is_ok()
        );
        let e = ParallelLayout { tp: 4, ..one }
            .check(&gqa(3), 32, 0)
            .unwrap_err();
        assert!(e.to_string().contains("key/value heads (3)"), "{e}");
        assert_eq!(field(ParallelLayout { dp: 0, ..one }, 32, 0), "dp");
        assert_eq!(
            field(
                ParallelLayout {
                    pp: MAX_DEGREE + 1,
                    ..one
                },
                32,
                0
            ),
            "pp"
        );
        assert_eq!(
            field(
                ParallelLayout {
                    sequence_parallel: true,
                    ..one
                },
                32,
                0
            ),
            "sequence_parallel"
        );
        assert_eq!(
            field(
                ParallelLayout {
                    ep: 2,
                    dp: 2,
                    ..one
                },
                32,
                0
            ),
            "ep"
        );
        let hybrid = ParallelLayout {
            dp: 4,
            fsdp: Some(Strategy::Hybrid),
            hybrid_shard: 3,
            ..one
        };
        assert_eq!(field(hybrid, 32, 0), "hybrid_shard");
        let interleaved = ParallelLayout {
            pp: 2,
            pp_schedule: ScheduleKind::Interleaved,
            ..one
        };
        assert_eq!(field(interleaved, 24, 8), "pp_schedule");
        assert_eq!(
            field(
                ParallelLayout {
                    pp: 8,
                    pp_schedule: ScheduleKind::ZbV,
                    ..one
                },
                32,
                0
            ),
            "pp"
        );
        assert_eq!(
            field(
                ParallelLayout {
                    timeout_s: f64::NAN,
                    ..one
                },
                32,
                0
            ),
            "timeout_s"
        );
        assert_eq!(
            field(
                ParallelLayout {
                    grad_wire: Dtype::F16,
                    ..one
                },
                32,
                0
            ),
            "grad_wire"
        );
    }

    #[test]
    fn strategy_names_round_trip() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
        }
        let e = "zero3".parse::<Strategy>().unwrap_err();
        assert!(e.to_string().contains("zero3"), "{e}");
    }

    #[test]
    fn chunks_are_the_schedule_s() {
        let l = |pp_schedule| ParallelLayout {
            pp: 2,
            pp_schedule,
            pp_chunks: 3,
            ..ParallelLayout::default()
        };
        assert_eq!(l(ScheduleKind::ZbV).chunks(), 2);
        assert_eq!(l(ScheduleKind::Interleaved).chunks(), 3);
        assert_eq!(l(ScheduleKind::ZbH1).chunks(), 1);
        assert_eq!(
            ParallelLayout {
                pp: 1,
                ..l(ScheduleKind::ZbV)
            }
            .chunks(),
            1
        );
    }

    #[test]
    fn layouts_name_themselves() {
        let one = ParallelLayout::default();
        assert_eq!(one.to_string(), "single rank");
        let l = ParallelLayout {
            dp: 2,
            tp: 2,
            fsdp: Some(Strategy::Full),
            sequence_parallel: true,
            ..one
        };
        assert_eq!(
            l.to_string(),
            "dp=2 tp=2 fsdp full sequence-parallel reproducible sums"
        );
    }
}
