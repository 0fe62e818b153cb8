//! The error type of this crate.

use crate::schedule::Action;

/// Errors of this crate: bad parameters, unparsable schedule text, and
/// schedules that the validator rejects.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A parameter outside its valid range.
    #[error("invalid {name} = {value}: expected {expected}")]
    InvalidParameter {
        /// The parameter (`stages`, `microbatches`, `chunks`, a cost, ...).
        name: &'static str,
        /// Its value, as given.
        value: String,
        /// What would have been valid.
        expected: String,
    },
    /// A schedule name that no generator answers to.
    #[error("unknown schedule {name:?}: expected one of {expected}")]
    UnknownSchedule {
        /// The name given.
        name: String,
        /// The names accepted.
        expected: &'static str,
    },
    /// Schedule text that does not parse.
    #[error("schedule text, line {line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong and what was expected.
        message: String,
    },
    /// An action that names a micro-batch or chunk outside the schedule.
    #[error("stage {stage}, step {step} ({action}): {reason}")]
    InvalidAction {
        /// The stage (0-based).
        stage: usize,
        /// The position in the stage's list (0-based).
        step: usize,
        /// The offending action.
        action: Action,
        /// What is out of range.
        reason: String,
    },
    /// An action listed twice, or a backward both whole and split.
    #[error("stage {stage}, step {step} ({action}): duplicates step {first_step} ({first})")]
    Duplicate {
        /// The stage.
        stage: usize,
        /// Position of the second occurrence.
        step: usize,
        /// The second occurrence.
        action: Action,
        /// Position of the first occurrence.
        first_step: usize,
        /// The first occurrence.
        first: Action,
    },
    /// A (micro-batch, chunk) pair whose forward or backward never runs.
    #[error(
        "stage {stage}: {action} is missing (every micro-batch must pass every chunk forward and backward exactly once)"
    )]
    Missing {
        /// The stage that should run it.
        stage: usize,
        /// The action that is not there.
        action: Action,
    },
    /// An action listed before another action of the same stage it needs.
    #[error(
        "stage {stage}, step {step} ({action}): runs before {needs}, which it needs, on the same stage"
    )]
    OutOfOrder {
        /// The stage.
        stage: usize,
        /// Position of the action.
        step: usize,
        /// The action.
        action: Action,
        /// What must come earlier in the list.
        needs: Action,
    },
    /// Stages that wait on each other forever under send-buffered,
    /// receive-blocking communication.
    #[error("deadlock: {}", fmt_cycle(.cycle))]
    Deadlock {
        /// The cycle of waits: each stage, the step it is stuck at, and the
        /// action of the next stage it waits for.
        cycle: Vec<Wait>,
    },
    /// More activations alive on a stage than allowed.
    #[error(
        "stage {stage}, step {step} ({action}): {in_flight} activation chunks in flight, above the limit of {limit}"
    )]
    MemoryLimit {
        /// The stage.
        stage: usize,
        /// The step that goes over.
        step: usize,
        /// The action that goes over.
        action: Action,
        /// Activation chunks alive after it.
        in_flight: usize,
        /// The limit.
        limit: usize,
    },
    /// No stage split fits in the memory limit.
    #[error(
        "no split of {layers} layers into {chunks} chunks fits in {limit} per stage (the best found needs {needed})"
    )]
    Infeasible {
        /// Number of layers.
        layers: usize,
        /// Number of model chunks (stages × chunks per stage).
        chunks: usize,
        /// The memory limit per stage.
        limit: f64,
        /// The smallest peak memory over stages found.
        needed: f64,
    },
}

/// One link of a deadlock cycle: `stage` is stuck at `step` running
/// `action`, which waits for `waits_for` on stage `on_stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// The stuck stage.
    pub stage: usize,
    /// Its position in its list.
    pub step: usize,
    /// The action it cannot start.
    pub action: Action,
    /// The action whose output it needs.
    pub waits_for: Action,
    /// The stage that runs `waits_for`.
    pub on_stage: usize,
}

fn fmt_cycle(cycle: &[Wait]) -> String {
    cycle
        .iter()
        .map(|w| {
            format!(
                "stage {} step {} ({}) waits for {} on stage {}",
                w.stage, w.step, w.action, w.waits_for, w.on_stage
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
