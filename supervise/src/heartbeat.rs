//! Heartbeats: every rank of a supervised job writes
//! `<run>/heartbeats/rank-R` — the last step it finished, its process id
//! and its host — at the start and after every step; the supervisor reads
//! them to see which rank stopped.

use std::path::Path;

/// Writes world rank `rank`'s heartbeat: `step` is the last step it
/// finished. Errors are ignored: a heartbeat that cannot be written shows
/// as a stopped one.
pub fn heartbeat(run_dir: &Path, rank: usize, step: u64) {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let host = HOST.get_or_init(host_name);
    let dir = run_dir.join("heartbeats");
    let _ = std::fs::create_dir_all(&dir);
    let tmp = dir.join(format!("rank-{rank}.tmp"));
    if std::fs::write(&tmp, format!("{step} {} {host}\n", std::process::id())).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(format!("rank-{rank}")));
    }
}

/// The fields of world rank `rank`'s heartbeat.
fn read(run_dir: &Path, rank: usize) -> Option<String> {
    let path = run_dir.join("heartbeats").join(format!("rank-{rank}"));
    weft_trace::input::read_to_string(path, weft_trace::input::CONFIG_BYTES).ok()
}

/// The last step world rank `rank`'s heartbeat names, if any.
pub(crate) fn beat(run_dir: &Path, rank: usize) -> Option<u64> {
    read(run_dir, rank)?.split_whitespace().next()?.parse().ok()
}

/// The host world rank `rank`'s heartbeat names, if any.
pub(crate) fn beat_host(run_dir: &Path, rank: usize) -> Option<String> {
    read(run_dir, rank)?
        .split_whitespace()
        .nth(2)
        .map(str::to_owned)
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else
/// `$HOSTNAME`, else `localhost`).
#[must_use]
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(beat(dir.path(), 1), None);
        heartbeat(dir.path(), 1, 37);
        assert_eq!(beat(dir.path(), 1), Some(37));
        assert_eq!(beat_host(dir.path(), 1), Some(host_name()));
    }
}
