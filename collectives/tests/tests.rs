//! Integration tests of weft-collectives, in one binary (one link on 2 cores).

mod exact;
mod failures;
mod ops;
mod repro;
mod traffic;
