//! Appending to and reading a run's `events.jsonl` ([`weft_trace::RunEvent`]).

use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use weft_trace::{EventKind, RunEvent};

/// Seconds since the Unix epoch.
#[must_use]
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `kind` happening now.
#[must_use]
pub fn stamped(kind: EventKind) -> RunEvent {
    RunEvent {
        time: unix_now(),
        kind,
    }
}

/// Appends `event` as one line of `run_dir/events.jsonl`, in one write:
/// appends of one write each never interleave, whereas formatting
/// straight into the file writes a line in pieces, which a rank's
/// checkpoint thread and its training thread (or the supervisor) could
/// interleave into lines no reader can parse.
///
/// # Errors
/// The file's I/O error.
pub fn append_event(run_dir: &Path, event: &RunEvent) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(event).map_err(std::io::Error::other)?;
    line.push(b'\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join("events.jsonl"))?
        .write_all(&line)
}

/// The events of `run_dir/events.jsonl` that parse (none without the
/// file): what a drill or a restart reads back; the visualizer and `weft
/// compare` read the file with errors naming its lines instead.
#[must_use]
pub fn read_events(run_dir: &Path) -> Vec<RunEvent> {
    weft_trace::input::read_to_string(run_dir.join("events.jsonl"), weft_trace::input::LOG_BYTES)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events appended at once from several threads stay whole lines.
    #[test]
    fn concurrent_events_stay_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let dir = dir.path();
                s.spawn(move || {
                    for i in 0..200 {
                        let e = stamped(EventKind::Rewind {
                            step: t,
                            reason: "y".repeat(200),
                            to_step: i,
                            skipped_batches: vec![t, i],
                            rewinds: 1,
                        });
                        append_event(dir, &e).unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(dir.path().join("events.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 800);
        assert_eq!(read_events(dir.path()).len(), 800);
    }
}
