//! One writer per run folder: [`RunLock`], an exclusive lock on
//! `<run>/.lock` held for the life of a run, so that a second `weft train
//! --resume` of a run that is still training is refused instead of
//! deleting the first one's checkpoint in progress.
//!
//! The lock is the operating system's (`flock`), so it goes with the
//! process: a run that is killed leaves no stale lock, and its supervisor
//! can restart it at once. The file records who holds it (process id and
//! host) for the error a second writer gets.
//!
//! ```
//! use weft_supervise::lock::RunLock;
//!
//! let run = tempfile::tempdir()?;
//! let held = RunLock::acquire(run.path())?;
//! let err = RunLock::acquire(run.path()).unwrap_err();
//! assert!(err.to_string().contains("in use by process"), "{err}");
//! drop(held);
//! assert!(RunLock::acquire(run.path()).is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Why a run folder could not be locked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another process holds the lock: the run is being written.
    #[error(
        "run folder {} is in use by process {holder}: another weft is training it (wait for it to end, or stop it first)",
        run.display()
    )]
    Held {
        /// The run folder.
        run: PathBuf,
        /// Who holds it, as its lock file says (`pid 123 on host`).
        holder: String,
    },
    /// The lock file could not be opened or locked.
    #[error("locking run folder {}: {source}", run.display())]
    Io {
        /// The run folder.
        run: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// An exclusive lock on a run folder, released when dropped (or when the
/// process ends, however it ends).
#[derive(Debug)]
pub struct RunLock {
    // the open file holds the lock
    _file: fs::File,
}

impl RunLock {
    /// The lock file's name in a run folder.
    pub const FILE: &'static str = ".lock";

    /// Locks `run_dir` (which must exist) without waiting.
    ///
    /// # Errors
    /// [`LockError::Held`] when another process holds it (naming that
    /// process), [`LockError::Io`] when the lock file cannot be opened or
    /// locked.
    pub fn acquire(run_dir: &Path) -> Result<Self, LockError> {
        let io = |source| LockError::Io {
            run: run_dir.to_owned(),
            source,
        };
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(run_dir.join(Self::FILE))
            .map_err(io)?;
        // SAFETY: flock on a file descriptor this function owns
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io(e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(LockError::Held {
                run: run_dir.to_owned(),
                holder: if holder.is_empty() {
                    "(unknown)".into()
                } else {
                    holder.to_owned()
                },
            });
        }
        let me = format!("{} on {}\n", std::process::id(), crate::host_name());
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(me.as_bytes()))
            .map_err(io)?;
        Ok(Self { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let text = fs::read_to_string(dir.path().join(RunLock::FILE)).unwrap();
        assert!(text.starts_with(&std::process::id().to_string()), "{text}");
        match RunLock::acquire(dir.path()) {
            Err(LockError::Held { holder, .. }) => {
                assert!(holder.contains(&std::process::id().to_string()), "{holder}");
            }
            other => panic!("{other:?}"),
        }
        drop(first);
        let again = RunLock::acquire(dir.path());
        assert!(again.is_ok(), "{again:?}");
        let missing = RunLock::acquire(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(missing, LockError::Io { .. }), "{missing}");
    }
}
