//! Per-rank memory accounting by category.
//!
//! Every buffer FSDP allocates is registered here with its category
//! and its exact size (`capacity · size_of::<T>()`), and unregistered when
//! it is freed; the report gives the current and the peak bytes of each
//! category and the peak of their total. Nothing is estimated: a number in
//! the report is the size of buffers that existed.

use std::fmt;

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    /// This rank's parameter shards in the compute dtype (bf16 copies), or
    /// the replicated compute parameters when parameters are not sharded
    /// (f32 master weights count under [`OptimizerState`](Self::OptimizerState)).
    ParamShards,
    /// Gathered (unsharded) units in flight or in use, and the f32
    /// working copy of a bf16 unit.
    GatheredParams,
    /// Gradients: the kept shard, whole-unit gradients before their
    /// reduce-scatter, and exact accumulators of reproducible mode.
    Gradients,
    /// f32 master weights and AdamW moments.
    OptimizerState,
    /// The model's activation and backward buffers.
    Activations,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 5] = [
        Category::ParamShards,
        Category::GatheredParams,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
    ];

    /// A short snake-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Category::ParamShards => "param_shards",
            Category::GatheredParams => "gathered_params",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer_state",
            Category::Activations => "activations",
        }
    }
}

/// Current and peak bytes per category.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    current: [usize; 5],
    peak: [usize; 5],
    peak_total: usize,
}

impl MemoryReport {
    /// Bytes of `cat` allocated now.
    pub fn current(&self, cat: Category) -> usize {
        self.current[cat as usize]
    }

    /// Most bytes of `cat` allocated at any time.
    pub fn peak(&self, cat: Category) -> usize {
        self.peak[cat as usize]
    }

    /// Bytes allocated now, all categories.
    pub fn current_total(&self) -> usize {
        self.current.iter().sum()
    }

    /// Most bytes allocated at any one time, all categories together.
    pub fn peak_total(&self) -> usize {
        self.peak_total
    }

    pub(crate) fn alloc(&mut self, cat: Category, bytes: usize) {
        let c = &mut self.current[cat as usize];
        *c += bytes;
        let p = &mut self.peak[cat as usize];
        *p = (*p).max(*c);
        self.peak_total = self.peak_total.max(self.current_total());
    }

    pub(crate) fn free(&mut self, cat: Category, bytes: usize) {
        let c = &mut self.current[cat as usize];
        debug_assert!(*c >= bytes, "freeing more {} than allocated", cat.name());
        *c = c.saturating_sub(bytes);
    }

    /// Resets the peaks to the current values (e.g. after start-up).
    pub fn reset_peaks(&mut self) {
        self.peak = self.current;
        self.peak_total = self.current_total();
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<16} {:>14} {:>14}", "category", "now (B)", "peak (B)")?;
        for c in Category::ALL {
            writeln!(
                f,
                "{:<16} {:>14} {:>14}",
                c.name(),
                self.current(c),
                self.peak(c)
            )?;
        }
        write!(
            f,
            "{:<16} {:>14} {:>14}",
            "total",
            self.current_total(),
            self.peak_total
        )
    }
}

/// Bytes of a vector's allocation.
pub(crate) fn bytes_of<T>(v: &Vec<T>) -> usize {
    v.capacity() * size_of::<T>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_follow_allocations() {
        let mut m = MemoryReport::default();
        m.alloc(Category::GatheredParams, 100);
        m.alloc(Category::Gradients, 50);
        m.free(Category::GatheredParams, 100);
        m.alloc(Category::GatheredParams, 30);
        assert_eq!(m.current(Category::GatheredParams), 30);
        assert_eq!(m.peak(Category::GatheredParams), 100);
        assert_eq!(m.peak_total(), 150);
        assert_eq!(m.current_total(), 80);
        m.reset_peaks();
        assert_eq!(m.peak_total(), 80);
        assert!(m.to_string().contains("gathered_params"));
    }
}
