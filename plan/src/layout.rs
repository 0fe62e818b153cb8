//! Layouts: how a job is split over the GPUs — the same axes and settings
//! as `weft train`'s `[parallel]` section (`dp`, `fsdp`, `hybrid_shard`,
//! `tp`, `sequence_parallel`, `pp`, `pp_schedule`, `pp_chunks`, `ep`,
//! `train.micro_batch_size`), plus activation recomputation, which weft
//! does not run (the planner models it for other frameworks' runs, such as
//! the published Megatron-LM ones).

use std::fmt;

use serde::{Deserialize, Serialize};
use weft_pipeline::ScheduleKind;

use crate::error::{Error, Result};
use crate::model::ModelSpec;

/// How the data-parallel group shares the model state (`parallel.fsdp`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "strategy")]
pub enum Sharding {
    /// Replicas: every rank holds the whole state; gradients all-reduced.
    #[default]
    None,
    /// ZeRO-1: optimizer state sharded.
    Optimizer,
    /// ZeRO-2: optimizer state and gradients sharded.
    GradOp,
    /// ZeRO-3 (FSDP): parameters too, gathered unit by unit.
    Full,
    /// HSDP: full sharding within groups of `shard` ranks, replicas across.
    Hybrid {
        /// Ranks per sharding group (`parallel.hybrid_shard`).
        shard: usize,
    },
}

impl Sharding {
    /// The name `weft train` uses (`parallel.fsdp`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Optimizer => "optimizer",
            Sharding::GradOp => "grad_op",
            Sharding::Full => "full",
            Sharding::Hybrid { .. } => "hybrid",
        }
    }

    /// Whether the parameters are sharded (gathered for compute).
    #[must_use]
    pub fn shards_params(self) -> bool {
        matches!(self, Sharding::Full | Sharding::Hybrid { .. })
    }

    /// Whether the gradients are sharded (reduce-scattered per micro-batch).
    #[must_use]
    pub fn shards_grads(self) -> bool {
        !matches!(self, Sharding::None | Sharding::Optimizer)
    }
}

/// The pipeline schedule (`parallel.pp_schedule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Schedule {
    /// GPipe: all forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// 1F1B (PipeDream-Flush).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B over several model chunks per stage.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero-bubble ZB-H2.
    #[serde(rename = "zb-h2")]
    ZbH2,
    /// Zero-bubble ZB-V (two chunks per stage in a V).
    #[serde(rename = "zb-v")]
    ZbV,
}

impl Schedule {
    /// Every schedule.
    pub const ALL: [Schedule; 6] = [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved,
        Schedule::ZbH1,
        Schedule::ZbH2,
        Schedule::ZbV,
    ];

    /// The pipeline crate's generator.
    #[must_use]
    pub fn kind(self) -> ScheduleKind {
        match self {
            Schedule::GPipe => ScheduleKind::GPipe,
            Schedule::OneFOneB => ScheduleKind::OneFOneB,
            Schedule::Interleaved => ScheduleKind::Interleaved,
            Schedule::ZbH1 => ScheduleKind::ZbH1,
            Schedule::ZbH2 => ScheduleKind::ZbH2,
            Schedule::ZbV => ScheduleKind::ZbV,
        }
    }

    /// The name `weft train` uses.
    #[must_use]
    pub fn name(self) -> &'static str {
        self.kind().name()
    }

    /// Parses a schedule name.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] listing the names.
    pub fn parse(s: &str) -> Result<Self> {
        Schedule::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::InvalidRequest {
                field: "pp_schedule",
                reason: format!("`{s}` is not one of gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v"),
            })
    }

    /// Whether the backward is split into input (B) and weight (W) halves.
    #[must_use]
    pub fn splits_backward(self) -> bool {
        matches!(self, Schedule::ZbH1 | Schedule::ZbH2 | Schedule::ZbV)
    }
}

/// One way to run the job: every degree and setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel degree (`parallel.dp`; includes the expert axis).
    pub dp: usize,
    /// Tensor-parallel degree (`parallel.tp`).
    pub tp: usize,
    /// Pipeline stages (`parallel.pp`).
    pub pp: usize,
    /// Expert-parallel degree (`parallel.ep`, dividing `dp`).
    pub ep: usize,
    /// Sharding of the data-parallel group (`parallel.fsdp`,
    /// `parallel.hybrid_shard`).
    pub sharding: Sharding,
    /// Pipeline schedule (with `pp > 1`).
    pub schedule: Schedule,
    /// Model chunks per stage: 1, `parallel.pp_chunks` for the interleaved
    /// schedule, 2 for ZB-V.
    pub chunks: usize,
    /// Sequences per micro-batch (`train.micro_batch_size`).
    pub micro_batch_size: usize,
    /// Sequence parallelism with `tp > 1` (`parallel.sequence_parallel`).
    pub sequence_parallel: bool,
    /// Full activation recomputation (each layer's forward run again in its
    /// backward, keeping only its input). Not in weft.
    pub recompute: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            pp: 1,
            ep: 1,
            sharding: Sharding::None,
            schedule: Schedule::OneFOneB,
            chunks: 1,
            micro_batch_size: 1,
            sequence_parallel: false,
            recompute: false,
        }
    }
}

impl Layout {
    /// GPUs the layout needs: `dp · tp · pp`.
    #[must_use]
    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// Micro-batches each data-parallel rank runs per step for a global
    /// batch of `batch` sequences.
    #[must_use]
    pub fn micro_batches(&self, batch: usize) -> usize {
        batch / (self.dp * self.micro_batch_size).max(1)
    }

    /// The size of the group the sharding shards over: `dp / ep` (the
    /// expert group's replicas), or `hybrid_shard`.
    #[must_use]
    pub fn shard_group(&self) -> usize {
        match self.sharding {
            Sharding::None => 1,
            Sharding::Hybrid { shard } => shard,
            _ => self.dp / self.ep.max(1),
        }
    }

    /// Whether weft runs it (no activation recomputation).
    #[must_use]
    pub fn weft_runs(&self) -> bool {
        !self.recompute
    }

    /// `[parallel]` and `[train]` settings of `weft train` for this layout,
    /// as `--set` arguments (recomputation has none).
    #[must_use]
    pub fn train_sets(&self) -> Vec<String> {
        let mut v = vec![
            format!("parallel.dp={}", self.dp),
            format!("parallel.tp={}", self.tp),
            format!("parallel.pp={}", self.pp),
            format!("parallel.ep={}", self.ep),
            format!("parallel.fsdp=\"{}\"", self.sharding.name()),
            format!("train.micro_batch_size={}", self.micro_batch_size),
        ];
        if let Sharding::Hybrid { shard } = self.sharding {
            v.push(format!("parallel.hybrid_shard={shard}"));
        }
        if self.pp > 1 {
            v.push(format!("parallel.pp_schedule=\"{}\"", self.schedule.name()));
            if self.schedule == Schedule::Interleaved {
                v.push(format!("parallel.pp_chunks={}", self.chunks));
            }
        }
        if self.sequence_parallel {
            v.push("parallel.sequence_parallel=true".into());
        }
        v
    }

    /// Checks that the layout splits `model` and a global batch of `batch`
    /// sequences over `gpus` GPUs as `weft train` requires.
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] naming the degree at fault and why.
    pub fn validate(&self, model: &ModelSpec, batch: usize, gpus: usize) -> Result<()> {
        let bad = |field: &'static str, reason: String| {
            Err(Error::InvalidLayout {
                layout: self.to_string(),
                field,
                reason,
            })
        };
        for (field, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("ep", self.ep),
            ("chunks", self.chunks),
            ("micro_batch_size", self.micro_batch_size),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.world() != gpus {
            return bad(
                "dp",
                format!(
                    "dp·tp·pp = {}·{}·{} = {} ranks, but the cluster has {gpus}",
                    self.dp,
                    self.tp,
                    self.pp,
                    self.world()
                ),
            );
        }
        if !model.heads.is_multiple_of(self.tp) {
            return bad(
                "tp",
                format!("must divide the heads ({}): heads stay whole", model.heads),
            );
        }
        if model.vocab < self.tp {
            return bad(
                "tp",
                format!("the vocabulary ({}) cannot be split over tp", model.vocab),
            );
        }
        if self.ep > 1 {
            if !model.is_moe() || !model.experts.is_multiple_of(self.ep) {
                return bad(
                    "ep",
                    format!(
                        "needs a mixture of experts whose expert count ({}) it divides",
                        model.experts
                    ),
                );
            }
            if !self.dp.is_multiple_of(self.ep) {
                return bad("ep", format!("must divide dp = {}", self.dp));
            }
        }
        if let Sharding::Hybrid { shard } = self.sharding {
            let group = self.dp / self.ep;
            if shard == 0 || !group.is_multiple_of(shard) {
                return bad(
                    "hybrid_shard",
                    format!("must divide the sharded group dp/ep = {group} (got {shard})"),
                );
            }
        }
        if self.sequence_parallel {
            if self.tp == 1 {
                return bad("sequence_parallel", "needs tp > 1".into());
            }
            if !(self.micro_batch_size * model.seq).is_multiple_of(self.tp) {
                return bad(
                    "sequence_parallel",
                    format!(
                        "tp = {} must divide a micro-batch's tokens ({}·{})",
                        self.tp, self.micro_batch_size, model.seq
                    ),
                );
            }
        }
        if batch == 0 || !batch.is_multiple_of(self.dp * self.micro_batch_size) {
            return bad(
                "micro_batch_size",
                format!(
                    "dp·micro_batch_size = {}·{} must divide the global batch ({batch})",
                    self.dp, self.micro_batch_size
                ),
            );
        }
        let want_chunks = match self.schedule {
            Schedule::Interleaved => None,
            Schedule::ZbV => Some(2),
            _ => Some(1),
        };
        if self.pp == 1 {
            if self.chunks != 1 {
                return bad("chunks", "more than one chunk needs pp > 1".into());
            }
        } else {
            if let Some(v) = want_chunks
                && v != self.chunks
            {
                return bad(
                    "chunks",
                    format!(
                        "schedule {} runs {v} chunk(s) per stage",
                        self.schedule.name()
                    ),
                );
            }
            let m = self.micro_batches(batch);
            if self.schedule == Schedule::Interleaved && !m.is_multiple_of(self.pp) {
                return bad(
                    "schedule",
                    format!(
                        "interleaved needs the micro-batches per rank ({m}) to be a multiple of pp = {}",
                        self.pp
                    ),
                );
            }
            if model.layers < self.pp * self.chunks {
                return bad(
                    "pp",
                    format!(
                        "{} stage(s) × {} chunk(s) need at least as many layers (the model has {})",
                        self.pp, self.chunks, model.layers
                    ),
                );
            }
        }
        Ok(())
    }
}

impl fmt::Display for Layout {
    /// `dp=4 tp=2 pp=2 fsdp=full 1f1b mbs=2 sp`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={} tp={} pp={}", self.dp, self.tp, self.pp)?;
        if self.ep > 1 {
            write!(f, " ep={}", self.ep)?;
        }
        match self.sharding {
            Sharding::None => {}
            Sharding::Hybrid { shard } => write!(f, " fsdp=hybrid/{shard}")?,
            s => write!(f, " fsdp={}", s.name())?,
        }
        if self.pp > 1 {
            write!(f, " {}", self.schedule.name())?;
            if self.schedule == Schedule::Interleaved {
                write!(f, "/v{}", self.chunks)?;
            }
        }
        write!(f, " mbs={}", self.micro_batch_size)?;
        if self.sequence_parallel {
            f.write_str(" sp")?;
        }
        if self.recompute {
            f.write_str(" recompute")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelSpec {
        ModelSpec::gpt(8, 256, 8, 64, 1000)
    }

    #[test]
    fn valid_layouts_pass_and_bad_degrees_name_their_field() {
        let l = Layout {
            dp: 2,
            tp: 2,
            pp: 2,
            micro_batch_size: 2,
            ..Layout::default()
        };
        l.validate(&model(), 16, 8).unwrap();
        let field = |l: Layout, batch: usize, gpus: usize| match l.validate(&model(), batch, gpus) {
            Err(Error::InvalidLayout { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(l, 16, 4), "dp");
        assert_eq!(
            field(
                Layout {
                    tp: 3,
                    dp: 1,
                    pp: 1,
                    ..l
                },
                16,
                3
            ),
            "tp"
        );
        assert_eq!(field(l, 6, 8), "micro_batch_size");
        assert_eq!(
            field(
                Layout {
                    schedule: Schedule::Interleaved,
                    chunks: 2,
                    micro_batch_size: 8,
                    ..l
                },
                16,
                8
            ),
            "schedule"
        );
        assert_eq!(field(Layout { ep: 2, ..l }, 16, 8), "ep");
        assert_eq!(
            field(
                Layout {
                    sharding: Sharding::Hybrid { shard: 3 },
                    ..l
                },
                16,
                8
            ),
            "hybrid_shard"
        );
    }

    #[test]
    fn train_sets_name_weft_keys() {
        let l = Layout {
            dp: 2,
            pp: 2,
            sharding: Sharding::Full,
            schedule: Schedule::ZbH1,
            ..Layout::default()
        };
        let s = l.train_sets().join(" ");
        assert!(s.contains("parallel.fsdp=\"full\""), "{s}");
        assert!(s.contains("parallel.pp_schedule=\"zb-h1\""), "{s}");
        assert_eq!(l.to_string(), "dp=2 tp=1 pp=2 fsdp=full zb-h1 mbs=1");
    }
}
