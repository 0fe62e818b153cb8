//! Cross-crate integration tests for weft.
//!
//! The library is empty on purpose; the tests live in `tests/` and are
//! compiled into one binary so the workspace links them once. Tests that
//! exercise a single crate belong in that crate.
