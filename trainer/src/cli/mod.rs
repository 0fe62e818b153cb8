//! The `weft` binary's commands, one module per family, and what they
//! share: errors already reported, error text, TOML strings, output
//! files that must not clobber inputs.

pub(crate) mod runs;
pub(crate) mod tools;
pub(crate) mod train;

use anyhow::Result;

/// An error already printed (or left to rank 0 to print).
#[derive(Debug)]
pub(crate) struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reported")
    }
}

impl std::error::Error for Reported {}

/// Refuses an output path that is one of the `inputs` (the same file, by
/// any path), or that exists unless `overwrite`.
pub(crate) fn check_output(
    out: &std::path::Path,
    inputs: &[&std::path::Path],
    overwrite: bool,
) -> Result<()> {
    if let Ok(resolved) = out.canonicalize() {
        for input in inputs {
            if input.canonicalize().is_ok_and(|i| i == resolved) {
                anyhow::bail!(
                    "{}: the output is an input of this command ({}); write it elsewhere",
                    out.display(),
                    input.display()
                );
            }
        }
        if !overwrite {
            anyhow::bail!(
                "{} exists: refusing to overwrite it (pass --overwrite to replace it)",
                out.display()
            );
        }
    }
    Ok(())
}

/// The error and its causes, `: `-separated, each cause said once (an error
/// that already quotes its source, as many I/O errors do, is not followed
/// by it again).
pub(crate) fn chain_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if text.contains(&msg) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&msg);
    }
    text
}

/// Writes `line` to stderr in one write, so that the lines of several
/// processes sharing a terminal do not interleave.
pub(crate) fn say_error(line: &str) {
    use std::io::Write as _;
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("{line}\n").as_bytes());
}

/// `s` as a TOML basic string.
pub(crate) fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
