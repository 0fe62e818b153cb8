//! Integration tests of weft-checkpoint, one binary.

mod corrupt;
mod faults;
mod roundtrip;
mod util;
