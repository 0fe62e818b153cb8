//! Integration tests of weft-checkpoint, one binary.

mod corrupt;
mod faults;
mod fuzz;
mod kill;
mod lifecycle;
mod parallel;
mod props;
mod python;
mod roundtrip;
mod shared;
mod util;
