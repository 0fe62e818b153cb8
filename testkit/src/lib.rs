//! What weft's tests share (a dev-dependency only): finding the Python
//! whose packages — PyTorch, transformers, safetensors, numpy,
//! tensorboard — are the independent references the tests check weft
//! against.
//!
//! The test command (`scripts/test-all.sh`) installs them into
//! `~/.cache/weft-venv` and sets `WEFT_PYTHON` and `WEFT_REQUIRE_ALL`:
//! there a missing package fails the test that needs it. Elsewhere such a
//! test skips, saying why on stderr past the harness's capture (a line
//! `SKIPPED: …`, which the test command counts as a skip, not a pass).
//!
//! ```
//! if let Some(py) = weft_testkit::python("json") {
//!     let out = std::process::Command::new(py).args(["-c", "print(1 + 1)"]).output()?;
//!     assert_eq!(out.stdout, b"2\n");
//! }
//! # Ok::<(), std::io::Error>(())
//! ```

#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A Python that has every module of `modules` (comma-separated, as an
/// `import` statement lists them): `$WEFT_PYTHON`, else
/// `~/.cache/weft-venv/bin/python`, else `python3`; `None`, with the
/// reason on stderr, if none has them.
///
/// # Panics
/// If none has them and `WEFT_REQUIRE_ALL` is set (the test command
/// installed them: a missing one is a failure, never a pass).
#[must_use]
pub fn python(modules: &str) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(std::env::var_os("WEFT_PYTHON").map(PathBuf::from));
    if let Some(h) = std::env::var_os("HOME") {
        candidates.push(Path::new(&h).join(".cache/weft-venv/bin/python"));
    }
    candidates.push("python3".into());
    // found without importing them (torch takes seconds to import)
    let check = format!(
        "import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m.strip()) \
         for m in {modules:?}.split(',')) else 1)"
    );
    let found = candidates.into_iter().find(|c| {
        Command::new(c)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("WEFT_REQUIRE_ALL").is_none(),
            "no Python with `{modules}` (WEFT_PYTHON or ~/.cache/weft-venv), and WEFT_REQUIRE_ALL is set"
        );
        let msg = format!(
            "SKIPPED: no Python with `{modules}` (set WEFT_PYTHON or create ~/.cache/weft-venv)\n"
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), msg.as_bytes());
    }
    found
}
