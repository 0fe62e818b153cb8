//! Integration tests of weft-checkpoint, one binary.

mod corrupt;
mod faults;
mod props;
mod roundtrip;
mod util;
