//! What a rank holds, by category: counted from the buffers it allocated
//! ([`ParallelGpt::memory`](crate::ParallelGpt::memory)), and predicted
//! from the layout before anything is allocated
//! ([`ParallelGpt::predict_memory`](crate::ParallelGpt::predict_memory)) —
//! so a run too large for its machine is refused before it starts, and
//! the two are checked equal, category by category, layout by layout
//! (`tests/measured.rs`).
//!
//! Both count what a rank holds between steps: every buffer whose size
//! the layout fixes. The transient buffers of a step — FSDP's gathered
//! units and whole-unit gradients (FSDP's own report has their peaks),
//! the pipeline's messages, tensor and expert parallelism's gathers and
//! all-to-alls, the reproducible mode's exact partial sums (whose size
//! depends on the values) — come on top.

use std::fmt;
use std::ops::AddAssign;

/// Bytes one rank holds, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankMemory {
    /// Parameters: the resident ones (and a head stage's copy of a tied
    /// `wte`), or FSDP's compute shards (bf16) or replicas (ZeRO-1/2).
    pub params: usize,
    /// Gradients (resident; FSDP allocates its gradient buffers in the
    /// step).
    pub grads: usize,
    /// AdamW moments (and FSDP's f32 master weights).
    pub optimizer: usize,
    /// The activations planned for the micro-batches in flight, and the
    /// shared working buffers.
    pub activations: usize,
    /// Buffers kept for communication: the gradient reducer's buckets,
    /// the tied-embedding exchange between the embedding and head stages.
    pub comm: usize,
}

impl From<RankMemory> for weft_trace::MemoryBytes {
    fn from(m: RankMemory) -> Self {
        Self {
            params: m.params as u64,
            grads: m.grads as u64,
            optimizer: m.optimizer as u64,
            activations: m.activations as u64,
            comm: m.comm as u64,
        }
    }
}

impl RankMemory {
    /// All categories together.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer + self.activations + self.comm
    }

    /// The largest category, with its name (the first of equals).
    pub fn largest(&self) -> (&'static str, usize) {
        self.categories()
            .into_iter()
            .reduce(|a, b| if b.1 > a.1 { b } else { a })
            .unwrap_or(("params", 0))
    }

    /// The categories with their names, in report order.
    pub fn categories(&self) -> [(&'static str, usize); 5] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("comm", self.comm),
        ]
    }
}

impl AddAssign for RankMemory {
    fn add_assign(&mut self, o: RankMemory) {
        self.params += o.params;
        self.grads += o.grads;
        self.optimizer += o.optimizer;
        self.activations += o.activations;
        self.comm += o.comm;
    }
}

impl fmt::Display for RankMemory {
    /// `params 1.2 MB, grads …, total …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, b) in self.categories() {
            write!(f, "{name} {}, ", mib(b))?;
        }
        write!(f, "total {}", mib(self.total()))
    }
}

/// `b` bytes in MiB (or KiB below one).
fn mib(b: usize) -> String {
    #[allow(clippy::cast_precision_loss)]
    let x = b as f64;
    if x >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", x / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", x / 1024.0)
    }
}
