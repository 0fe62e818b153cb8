//! Pipeline parallelism: schedules, their validation, and their bubble.
//!
//! (crate docs are completed below)

#![deny(missing_docs)]

mod error;
mod generate;
mod schedule;
mod simulate;
mod validate;

pub use error::{Error, Result, Wait};
pub use generate::{
    ScheduleKind, gpipe, interleaved, list_schedule, one_f_one_b, zb_h1, zb_h2, zb_v,
};
pub use schedule::{Action, ActionKind, Placement, Schedule};
pub use simulate::{ChunkCost, Costs, Slot, Timeline, simulate, steady_state_period};
pub use validate::{validate, validate_with_limit};
