//! Reading files a user named, bounded: the one way weft's readers open
//! untrusted input.
//!
//! A file a user names (a config, a data file, a run folder's logs) may be
//! anything: a FIFO that blocks the first `open` until a writer comes, a
//! device such as `/dev/zero` that never ends, a link to either, a 3 MB
//! gzip file that inflates to gigabytes, or a `.jsonl` whose one line is
//! gigabytes long. Every reader of user files in weft goes through this
//! module, so each of those is refused with the same error, before memory
//! grows or the process hangs:
//!
//! * [`open`] refuses what is not a regular file (looked up before the
//!   open, so a FIFO never blocks it, and checked again on the opened file).
//! * [`read`] and [`read_to_string`] read a whole file up to a bound.
//! * [`Limited`] bounds any reader — a decompressor's output included.
//! * [`read_line`] reads one line up to a bound.
//!
//! The errors are [`std::io::Error`]s of kind
//! [`InvalidData`](std::io::ErrorKind::InvalidData) (too large) or
//! [`InvalidInput`](std::io::ErrorKind::InvalidInput) (not a regular file),
//! whose message names the bound and what to do; callers wrap them with
//! the file's path as they wrap every other I/O error.
//!
//! What cannot be prevented here: a file swapped for a FIFO between the
//! look-up and the open still blocks that open (the look-up narrows the
//! window to a rename by someone racing the reader on purpose).
//!
//! # Example
//! ```
//! use weft_trace::input;
//! let err = input::read("/nonexistent/config.toml", input::CONFIG_BYTES).unwrap_err();
//! assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
//! # #[cfg(unix)]
//! # {
//! let err = input::read("/dev/zero", input::CONFIG_BYTES).unwrap_err();
//! assert!(err.to_string().contains("not a regular file"));
//! # }
//! ```

use std::fs::File;
use std::io::{self, BufRead, Read};
use std::path::Path;

/// Bound of a configuration file (TOML or JSON config, hostfile,
/// `tokenizer.json` excepted): 16 MiB.
pub const CONFIG_BYTES: u64 = 16 << 20;

/// Bound of a run folder's log (`metrics.jsonl`, `events.jsonl`,
/// `expert_load.jsonl`) read whole by a tool: 1 GiB.
pub const LOG_BYTES: u64 = 1 << 30;

/// Bound of a `tokenizer.json` or a prepared folder's index: 256 MiB.
pub const INDEX_BYTES: u64 = 256 << 20;

/// Bound of one document of text: a whole `.txt` file (after
/// decompression) or one `.jsonl` line: 256 MiB.
pub const DOCUMENT_BYTES: u64 = 256 << 20;

/// Bound of a text file read whole as a corpus (`--data file.txt`): 4 GiB.
pub const CORPUS_BYTES: u64 = 4 << 30;

fn mib(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

/// The error for a file of more than `limit` bytes.
pub fn too_large(limit: u64, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{what} is larger than weft's bound of {}", mib(limit)),
    )
}

/// The kind of a file that is not regular, in words.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a folder";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "not a file"
}

fn check_regular(meta: &std::fs::Metadata) -> io::Result<()> {
    if meta.is_file() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "not a regular file ({}); weft reads only regular files",
                kind_of(meta)
            ),
        ))
    }
}

/// Opens `path` for reading if it is a regular file (links followed).
///
/// # Errors
/// The look-up's or open's error, or [`InvalidInput`](io::ErrorKind::InvalidInput)
/// for a folder, FIFO, device or socket.
pub fn open(path: impl AsRef<Path>) -> io::Result<File> {
    let path = path.as_ref();
    check_regular(&std::fs::metadata(path)?)?;
    let f = File::open(path)?;
    check_regular(&f.metadata()?)?;
    Ok(f)
}

/// The whole of regular file `path`, refused if it holds more than
/// `limit` bytes.
///
/// # Errors
/// As [`open`], or [`InvalidData`](io::ErrorKind::InvalidData) naming the
/// bound.
pub fn read(path: impl AsRef<Path>, limit: u64) -> io::Result<Vec<u8>> {
    let f = open(path)?;
    let len = f.metadata()?.len();
    if len > limit {
        return Err(too_large(limit, "the file"));
    }
    let mut out = Vec::with_capacity(len as usize);
    Limited::new(f, limit, "the file").read_to_end(&mut out)?;
    Ok(out)
}

/// As [`read`], as UTF-8 text.
///
/// # Errors
/// As [`read`], or [`InvalidData`](io::ErrorKind::InvalidData) for text
/// that is not UTF-8.
pub fn read_to_string(path: impl AsRef<Path>, limit: u64) -> io::Result<String> {
    String::from_utf8(read(path, limit)?).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// A reader that fails, rather than ending, once more than `limit` bytes
/// come through it: the bound of a decompressor's output, or of a file
/// that grows while it is read.
pub struct Limited<R> {
    inner: R,
    left: u64,
    limit: u64,
    what: &'static str,
}

impl<R: Read> Limited<R> {
    /// Bounds `inner` to `limit` bytes; `what` names the stream in the
    /// error ("the decompressed text").
    pub fn new(inner: R, limit: u64, what: &'static str) -> Self {
        Self {
            inner,
            left: limit,
            limit,
            what,
        }
    }
}

impl<R: Read> Read for Limited<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more than the bound is an error; none is the end.
            let mut one = [0u8; 1];
            return match self.inner.read(&mut one)? {
                0 => Ok(0),
                _ => Err(too_large(self.limit, self.what)),
            };
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// Reads one line (through its `\n`, if any) into `line`, refusing a line
/// of more than `limit` bytes; returns the bytes read (0 at the end).
///
/// # Errors
/// The reader's error, or [`InvalidData`](io::ErrorKind::InvalidData)
/// naming the bound.
pub fn read_line(reader: &mut dyn BufRead, line: &mut Vec<u8>, limit: u64) -> io::Result<usize> {
    line.clear();
    let n = reader
        .take(limit.saturating_add(1))
        .read_until(b'\n', line)?;
    if n as u64 > limit {
        return Err(too_large(limit, "a line"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limited_allows_the_bound_and_refuses_one_byte_more() {
        let mut out = Vec::new();
        Limited::new(&[7u8; 10][..], 10, "x")
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out.len(), 10);
        let err = Limited::new(&[7u8; 11][..], 10, "the decompressed text")
            .read_to_end(&mut Vec::new())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the decompressed text is larger than weft's bound of 10 bytes"
        );
    }

    #[test]
    fn lines_are_bounded() {
        let mut r = &b"short\nmuch too long\n"[..];
        let mut line = Vec::new();
        assert_eq!(read_line(&mut r, &mut line, 8).unwrap(), 6);
        assert_eq!(line, b"short\n");
        let err = read_line(&mut r, &mut line, 8).unwrap_err();
        assert!(
            err.to_string()
                .contains("a line is larger than weft's bound of 8 bytes")
        );
        let mut r = &b"exact\n"[..];
        assert_eq!(read_line(&mut r, &mut line, 6).unwrap(), 6);
        assert_eq!(read_line(&mut r, &mut line, 6).unwrap(), 0);
    }

    #[cfg(unix)]
    #[test]
    fn devices_folders_and_fifos_are_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("weft-input-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        for (path, kind) in [
            (Path::new("/dev/zero"), "character device"),
            (dir.as_path(), "a folder"),
            (fifo.as_path(), "FIFO"),
        ] {
            let err = read(path, CONFIG_BYTES).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
            assert!(err.to_string().contains(kind), "{err}");
        }
        std::fs::write(dir.join("big"), [b'x'; 100]).unwrap();
        let err = read(dir.join("big"), 99).unwrap_err();
        assert!(err.to_string().contains("bound of 99 bytes"), "{err}");
        assert_eq!(read(dir.join("big"), 100).unwrap().len(), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
