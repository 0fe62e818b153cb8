//! A small std-only HTTP server for run folders and the built page.
//!
//! The page comes from [`Assets`]: by default the one compiled into the
//! binary ([`Assets::Embedded`], see [`crate::page`]), or a folder built by
//! `viz-web/build.sh` ([`Assets::Dir`]).
//!
//! It answers `GET` (and `HEAD`) on 127.0.0.1 only:
//! * `/` and `/<asset>`: the page's files (`index.html`, the wasm-bindgen
//!   output, `style.css`), looked up by exact file name among the embedded
//!   files or the entries of the assets folder, so no path can leave it;
//! * `/runs.json`: the runs served, in the order given, each with the name
//!   the page shows (its folder's name, see [`ServedRun::name_all`]) and
//!   the run files present: a JSON array of [`RunListing`];
//! * `/run/<i>/files.json`: run `i`'s files present, as a JSON array of
//!   names (`i` counts from 0, written in decimal without leading zeros);
//! * `/run/<i>/<name>`: one of [`FileKind::RUN_FILES`], read from run
//!   `i`'s folder; any other name, or a run that is not served, is 404.
//!   Only a regular file in the folder itself is served, streamed from
//!   disk: a link (to `/etc/passwd`, say), a device such as `/dev/zero`
//!   or a FIFO is refused with 403, as is a file over
//!   [`MAX_RUN_FILE_BYTES`];
//! * `/run/files.json` and `/run/<name>`: the same for run 0 (the URLs of
//!   one run, kept).
//!
//! No request path is ever joined onto a folder: names are matched against
//! the entries of a fixed list or of the assets folder itself.
//!
//! Requests are bounded as HTTP servers bound them: a request line longer
//! than [`MAX_REQUEST_LINE`] bytes is answered 414, headers beyond
//! [`MAX_HEADER_BYTES`] bytes or [`MAX_HEADERS`] lines 431, a request with a
//! body 413; a request whose line and headers have not all arrived
//! within [`REQUEST_TIMEOUT`] (however slowly they trickle in) is dropped,
//! and so is a keep-alive connection with no next request by then; beyond
//! [`MAX_CONNECTIONS`] open connections a new one is answered 503 and
//! closed. Nothing a client sends is held in memory past these bounds,
//! and no file is read into memory whole.

use std::fmt;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;

use weft_compare::load::{FileKind, RunListing};

/// Longest request line read, in bytes (longer: 414).
pub const MAX_REQUEST_LINE: usize = 8 * 1024;
/// Most header bytes read per request (more: 431).
pub const MAX_HEADER_BYTES: usize = 32 * 1024;
/// Most header lines per request (more: 431).
pub const MAX_HEADERS: usize = 100;
/// Most connections served at once (more: 503).
pub const MAX_CONNECTIONS: usize = 64;
/// How long a write to a client may wait.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request's line and headers may take to arrive, all of them
/// (and how long a kept-alive connection waits for its next request).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest run file served.
pub const MAX_RUN_FILE_BYTES: u64 = 1 << 31;

/// Files the assets folder must hold (what `viz-web/build.sh` writes).
pub const REQUIRED_ASSETS: [&str; 3] = ["index.html", "weft_viz_web.js", "weft_viz_web_bg.wasm"];

/// Where the page's files come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Assets {
    /// The page compiled into the binary ([`crate::page::EMBEDDED`]).
    #[default]
    Embedded,
    /// A folder holding a built page (`viz-web/build.sh` writes
    /// `viz-web/dist/`), e.g. one just built from changed sources.
    Dir(PathBuf),
}

impl Assets {
    /// The file `name` of the page (a plain file name), if it has one.
    fn get(&self, name: &str) -> Option<Vec<u8>> {
        match self {
            Self::Embedded => crate::page::embedded(name).map(|a| a.bytes.to_vec()),
            Self::Dir(dir) => {
                // Only a plain file name that is an entry of the folder.
                let listed = fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
                    e.file_name().to_str() == Some(name) && e.file_type().is_ok_and(|t| t.is_file())
                });
                if listed {
                    fs::read(dir.join(name)).ok()
                } else {
                    None
                }
            }
        }
    }
}

impl fmt::Display for Assets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Embedded => f.write_str("the page built into this binary"),
            Self::Dir(d) => write!(f, "the page in {}", d.display()),
        }
    }
}

/// A run folder being served, and the name the page shows for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedRun {
    /// The legend's name: the folder's name, made unique.
    pub name: String,
    /// The run folder.
    pub dir: PathBuf,
}

impl ServedRun {
    /// Name each folder by its last component (`runs/a` → `a`; `.` by the
    /// folder it is); folders whose last components are the same are
    /// named by their last two (`runs/fp32/seed-42` → `fp32/seed-42`, as
    /// the seed runs of `weft train --seeds` are), and a name still
    /// repeated gets ` (2)`, ` (3)`, ... so the legend tells them apart.
    #[must_use]
    pub fn name_all(dirs: &[PathBuf]) -> Vec<Self> {
        let component = |p: &std::path::Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .or_else(|| {
                    let abs = fs::canonicalize(p).ok()?;
                    Some(abs.file_name()?.to_string_lossy().into_owned())
                })
        };
        let last: Vec<String> = dirs
            .iter()
            .map(|d| component(d).unwrap_or_else(|| d.display().to_string()))
            .collect();
        let mut out: Vec<Self> = Vec::with_capacity(dirs.len());
        for (dir, base) in dirs.iter().zip(&last) {
            let mut base = base.clone();
            if last.iter().filter(|b| **b == base).count() > 1 {
                let parent = fs::canonicalize(dir)
                    .ok()
                    .and_then(|abs| abs.parent().and_then(component))
                    .or_else(|| dir.parent().and_then(component));
                if let Some(parent) = parent {
                    base = format!("{parent}/{base}");
                }
            }
            let mut name = base.clone();
            let mut k = 1;
            while out.iter().any(|r| r.name == name) {
                k += 1;
                name = format!("{base} ({k})");
            }
            out.push(Self {
                name,
                dir: dir.clone(),
            });
        }
        out
    }

    /// The run files present in the folder that are served (regular
    /// files, not links, of at most [`MAX_RUN_FILE_BYTES`]), in
    /// [`FileKind::RUN_FILES`] order.
    #[must_use]
    pub fn files(&self) -> Vec<&'static str> {
        FileKind::RUN_FILES
            .into_iter()
            .filter(|n| {
                fs::symlink_metadata(self.dir.join(n))
                    .is_ok_and(|m| m.is_file() && m.len() <= MAX_RUN_FILE_BYTES)
            })
            .collect()
    }
}

/// Why the server could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The run folder does not exist or is not a folder.
    #[error(
        "run folder {path} not found (expected a folder such as runs/<name> holding trace.json, metrics.jsonl, ...)"
    )]
    RunDirMissing {
        /// The path given.
        path: PathBuf,
    },
    /// No run folder was given.
    #[error("no run folder given (expected one or more folders such as runs/<name>)")]
    NoRuns,
    /// The built page is not there.
    #[error(
        "the viz assets are missing: {path} has no {missing}. Build the page there with `WEFT_VIZ_DIST={path} bash viz-web/build.sh` (by default it writes viz-web/dist/), or leave out --assets and WEFT_VIZ_ASSETS to serve the page built into weft"
    )]
    AssetsMissing {
        /// The assets folder looked in.
        path: PathBuf,
        /// The first missing file.
        missing: &'static str,
    },
    /// The address is not a loopback address.
    #[error("refusing to serve on {addr}: the visualizer only listens on 127.0.0.1 (or ::1)")]
    NotLoopback {
        /// The address given.
        addr: SocketAddr,
    },
    /// Binding the socket failed (port in use, ...).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address given.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Accepting connections failed.
    #[error("accepting a connection failed: {0}")]
    Accept(#[source] std::io::Error),
}

/// A bound server; call [`Server::run`] to serve.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    runs: Arc<[ServedRun]>,
    assets: Assets,
    request_timeout: Duration,
}

impl Server {
    /// Check the run folders (and an assets folder) and bind `addr` (port 0
    /// picks a free port). The first run is the one the page compares the
    /// others with.
    ///
    /// # Errors
    /// [`ServeError::NoRuns`], [`ServeError::RunDirMissing`] (the first
    /// folder missing), [`ServeError::AssetsMissing`] (its message says how
    /// to build the assets), [`ServeError::NotLoopback`],
    /// [`ServeError::Bind`].
    pub fn bind(
        run_dirs: &[PathBuf],
        assets: &Assets,
        addr: SocketAddr,
    ) -> Result<Self, ServeError> {
        if !addr.ip().is_loopback() {
            return Err(ServeError::NotLoopback { addr });
        }
        if run_dirs.is_empty() {
            return Err(ServeError::NoRuns);
        }
        if let Some(d) = run_dirs.iter().find(|d| !d.is_dir()) {
            return Err(ServeError::RunDirMissing { path: d.clone() });
        }
        if let Assets::Dir(dir) = assets
            && let Some(missing) = REQUIRED_ASSETS.into_iter().find(|f| !dir.join(f).is_file())
        {
            return Err(ServeError::AssetsMissing {
                path: dir.clone(),
                missing,
            });
        }
        let listener =
            TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })?;
        Ok(Self {
            listener,
            runs: ServedRun::name_all(run_dirs).into(),
            assets: assets.clone(),
            request_timeout: REQUEST_TIMEOUT,
        })
    }

    /// The time a request's line and headers may take to arrive
    /// ([`REQUEST_TIMEOUT`] by default).
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The runs served, named, in order.
    #[must_use]
    pub fn runs(&self) -> &[ServedRun] {
        &self.runs
    }

    /// The bound address (with the real port when 0 was asked for).
    ///
    /// # Errors
    /// The OS error, if the socket has gone.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The page's URL, e.g. `http://127.0.0.1:8080/`.
    ///
    /// # Errors
    /// The OS error, if the socket has gone.
    pub fn url(&self) -> std::io::Result<String> {
        Ok(format!("http://{}/", self.local_addr()?))
    }

    /// Serve until the process ends: one thread per connection. A failed
    /// connection only ends that connection.
    ///
    /// # Errors
    /// [`ServeError::Accept`] when the listening socket fails.
    pub fn run(self) -> Result<(), ServeError> {
        let runs = self.runs;
        let assets = self.assets;
        let timeout = self.request_timeout;
        let open = Arc::new(AtomicUsize::new(0));
        for stream in self.listener.incoming() {
            let mut stream = stream.map_err(ServeError::Accept)?;
            if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                open.fetch_sub(1, Ordering::SeqCst);
                // answered on the accepting thread, so briefly
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = reply(
                    &mut stream,
                    &mut plain(503, "too many connections\n"),
                    false,
                    false,
                );
                let _ = drain_and_close(&mut stream, Duration::from_millis(50), 64 * 1024);
                continue;
            }
            let (r, a, open) = (runs.clone(), assets.clone(), open.clone());
            thread::spawn(move || {
                // A client that hangs up mid-response is not the server's
                // problem; the error has nowhere useful to go.
                let _ = handle(stream, &r, &a, timeout);
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Ok(())
    }
}

/// Bind and serve `run_dirs` with the page from `assets` on `addr`;
/// blocks. Equivalent to `Server::bind(..)?.run()`.
///
/// # Errors
/// As [`Server::bind`] and [`Server::run`].
pub fn serve(run_dirs: &[PathBuf], assets: &Assets, addr: SocketAddr) -> Result<(), ServeError> {
    Server::bind(run_dirs, assets, addr)?.run()
}

/// The response to a request path: status, content type, body.
#[derive(Debug)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Body,
}

/// A response's body.
#[derive(Debug)]
pub enum Body {
    /// Bytes in memory (the page, listings, messages).
    Bytes(Vec<u8>),
    /// A run file, opened and checked, streamed from disk.
    File {
        /// The open file.
        file: fs::File,
        /// Its length when opened.
        len: u64,
    },
}

impl Body {
    /// Its length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        match self {
            Self::Bytes(b) => b.len() as u64,
            Self::File { len, .. } => *len,
        }
    }

    /// Whether it is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole body in memory (for tests and small bodies).
    ///
    /// # Errors
    /// Reading the file failed.
    pub fn into_bytes(self) -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        match self {
            Self::Bytes(b) => Ok(b),
            Self::File { file, len } => {
                let mut out = Vec::new();
                file.take(len).read_to_end(&mut out)?;
                Ok(out)
            }
        }
    }

    /// Writes the body to `out`: a file's first `len` bytes (a file that
    /// grew meanwhile is cut at the length announced).
    fn write_to(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        use std::io::Read;
        match self {
            Self::Bytes(b) => out.write_all(b),
            Self::File { file, len } => {
                let sent = std::io::copy(&mut file.take(*len), out)?;
                if sent < *len {
                    // it shrank: the announced length cannot be kept
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the file shrank while it was sent",
                    ));
                }
                Ok(())
            }
        }
    }
}

fn content_type(name: &str) -> &'static str {
    match name.rsplit('.').next().unwrap_or("") {
        "html" => "text/html; charset=utf-8",
        "js" => "text/javascript; charset=utf-8",
        "wasm" => "application/wasm",
        "css" => "text/css; charset=utf-8",
        "json" => "application/json",
        "toml" | "jsonl" => "text/plain; charset=utf-8",
        "png" => "image/png",
        "svg" => "image/svg+xml",
        _ => "application/octet-stream",
    }
}

fn not_found(what: &str) -> Response {
    plain(404, &format!("not found: {what}\n"))
}

/// Opens run file `path` for serving: a regular file of at most
/// [`MAX_RUN_FILE_BYTES`], reached without following a link, opened
/// without blocking (a FIFO would wait for a writer). `Err` is the
/// response that says why not.
fn open_run_file(path: &std::path::Path, what: &str) -> Result<(fs::File, u64), Response> {
    use std::os::unix::fs::OpenOptionsExt;
    let refused = |why: &str| plain(403, &format!("refused: {what}: {why}\n"));
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => not_found(what),
            _ if e.raw_os_error() == Some(libc::ELOOP) => {
                refused("a link; only files in the run folder itself are served")
            }
            _ => refused(&e.to_string()),
        })?;
    let meta = file.metadata().map_err(|e| refused(&e.to_string()))?;
    if !meta.is_file() {
        return Err(refused("not a regular file"));
    }
    if meta.len() > MAX_RUN_FILE_BYTES {
        return Err(refused(&format!(
            "{} bytes, more than the {MAX_RUN_FILE_BYTES} served",
            meta.len()
        )));
    }
    Ok((file, meta.len()))
}

/// Answer a `GET` of `path` (without query): the routing of [`Server`],
/// exposed for tests and other front ends.
#[must_use]
pub fn respond(path: &str, runs: &[ServedRun], assets: &Assets) -> Response {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let json = |body: Vec<u8>| Response {
        status: 200,
        content_type: "application/json",
        body: Body::Bytes(body),
    };
    if path == "/runs.json" {
        let list: Vec<RunListing> = runs
            .iter()
            .map(|r| RunListing {
                name: r.name.clone(),
                files: r.files().into_iter().map(str::to_owned).collect(),
            })
            .collect();
        return json(serde_json::to_vec(&list).unwrap_or_else(|_| b"[]".to_vec()));
    }
    if let Some(rest) = path.strip_prefix("/run/") {
        // `/run/<i>/<name>`, or `/run/<name>` for run 0
        let (run, name) = match rest.split_once('/') {
            Some((i, name)) => match run_index(i).and_then(|i| runs.get(i)) {
                Some(r) => (r, name),
                None => return not_found(path),
            },
            None => match runs.first() {
                Some(r) => (r, rest),
                None => return not_found(path),
            },
        };
        if name == "files.json" {
            return json(serde_json::to_vec(&run.files()).unwrap_or_else(|_| b"[]".to_vec()));
        }
        // Only a name of the fixed list; the path joined is the list's.
        let Some(n) = FileKind::RUN_FILES.into_iter().find(|n| *n == name) else {
            return not_found(path);
        };
        return match open_run_file(&run.dir.join(n), path) {
            Ok((file, len)) => Response {
                status: 200,
                content_type: content_type(n),
                body: Body::File { file, len },
            },
            Err(r) => r,
        };
    }
    let name = path.strip_prefix('/').unwrap_or(path);
    let name = if name.is_empty() { "index.html" } else { name };
    match assets.get(name) {
        Some(body) => Response {
            status: 200,
            content_type: content_type(name),
            body: Body::Bytes(body),
        },
        None => not_found(path),
    }
}

/// A run index as written in a URL: decimal digits, no sign, no leading
/// zero (so each run has exactly one URL).
fn run_index(s: &str) -> Option<usize> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 1 && s.starts_with('0') {
        return None;
    }
    s.parse().ok()
}

fn plain(status: u16, text: &str) -> Response {
    Response {
        status,
        content_type: "text/plain; charset=utf-8",
        body: Body::Bytes(text.as_bytes().to_vec()),
    }
}

/// Reads one line of at most `limit` bytes (the newline included):
/// `Ok(None)` at the end of the stream, `Err(())` when the line is longer.
fn bounded_line(
    reader: &mut BufReader<Deadline>,
    limit: usize,
) -> std::io::Result<Option<Result<String, ()>>> {
    use std::io::Read;
    let mut line = Vec::new();
    let n = reader
        .by_ref()
        .take(limit as u64 + 1)
        .read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.len() > limit || !line.ends_with(b"\n") && line.len() == limit + 1 {
        return Ok(Some(Err(())));
    }
    Ok(Some(Ok(String::from_utf8_lossy(&line).into_owned())))
}

/// Writes `resp` (its body unless `head`).
fn reply(
    out: &mut TcpStream,
    resp: &mut Response,
    head: bool,
    keep_alive: bool,
) -> std::io::Result<()> {
    let reason = match resp.status {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Bad Request",
    };
    write!(
        out,
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: {}\r\n\r\n",
        resp.status,
        resp.content_type,
        resp.body.len(),
        if keep_alive { "keep-alive" } else { "close" }
    )?;
    if !head {
        resp.body.write_to(out)?;
    }
    out.flush()
}

/// Answers a request refused before it was read whole, then closes the way
/// HTTP servers do: the write side first, then what the client still sends
/// is read and dropped (at most 1 MiB, for at most a second) so that the
/// answer is not lost to a reset.
fn refuse(out: &mut TcpStream, mut resp: Response) -> std::io::Result<()> {
    reply(out, &mut resp, false, false)?;
    drain_and_close(out, Duration::from_secs(1), 1 << 20)
}

/// Shuts the write side, then reads and drops what the client still
/// sends (at most `bytes`, waiting at most `wait` for each read), so the
/// answer already sent is not lost to a reset.
fn drain_and_close(stream: &mut TcpStream, wait: Duration, bytes: u64) -> std::io::Result<()> {
    use std::io::Read;
    stream.shutdown(std::net::Shutdown::Write)?;
    stream.set_read_timeout(Some(wait))?;
    let _ = std::io::copy(&mut stream.take(bytes), &mut std::io::sink());
    Ok(())
}

/// The reading side of a connection, against a deadline that covers a
/// whole request's line and headers: each read waits at most what is left
/// of it, so a client that trickles a byte at a time is cut off too.
struct Deadline {
    stream: TcpStream,
    until: Instant,
}

impl std::io::Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self
            .until
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "request too slow"))?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

fn handle(
    stream: TcpStream,
    runs: &[ServedRun],
    assets: &Assets,
    request_timeout: Duration,
) -> std::io::Result<()> {
    stream.set_write_timeout(Some(IDLE_TIMEOUT))?;
    let mut reader = BufReader::new(Deadline {
        stream: stream.try_clone()?,
        until: Instant::now() + request_timeout,
    });
    let mut out = stream;
    loop {
        // the next request's line and headers, all within the timeout
        reader.get_mut().until = Instant::now() + request_timeout;
        let request = match bounded_line(&mut reader, MAX_REQUEST_LINE)? {
            None => return Ok(()),
            Some(Ok(r)) => r,
            Some(Err(())) => {
                return refuse(&mut out, plain(414, "request line too long\n"));
            }
        };
        let mut keep_alive = request.contains("HTTP/1.1");
        let (mut header_bytes, mut headers, mut body) = (0usize, 0usize, false);
        let mut too_large = false;
        loop {
            let left = MAX_HEADER_BYTES.saturating_sub(header_bytes);
            let h = match bounded_line(&mut reader, left)? {
                None => break,
                Some(Ok(h)) => h,
                Some(Err(())) => {
                    too_large = true;
                    break;
                }
            };
            if h.trim().is_empty() {
                break;
            }
            header_bytes += h.len();
            headers += 1;
            if headers > MAX_HEADERS {
                too_large = true;
                break;
            }
            let lower = h.to_ascii_lowercase();
            if lower.starts_with("connection:") && lower.contains("close") {
                keep_alive = false;
            }
            let length = lower
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<u64>().map_or(true, |n| n > 0));
            if length == Some(true) || lower.starts_with("transfer-encoding:") {
                body = true;
            }
        }
        if too_large {
            return refuse(&mut out, plain(431, "request headers too large\n"));
        }
        if body {
            // the body is never read: answer and close
            return refuse(&mut out, plain(413, "requests carry no body here\n"));
        }
        let mut parts = request.split_whitespace();
        let method = parts.next().unwrap_or("");
        let target = parts.next().unwrap_or("/");
        let mut resp = match method {
            "GET" | "HEAD" => respond(target, runs, assets),
            _ => plain(405, "only GET and HEAD\n"),
        };
        reply(&mut out, &mut resp, method == "HEAD", keep_alive)?;
        if !keep_alive {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A response's status and whole body.
    fn got(r: Response) -> (u16, Vec<u8>) {
        (r.status, r.body.into_bytes().unwrap())
    }

    fn dirs(tag: &str) -> (PathBuf, Assets) {
        let base =
            std::env::temp_dir().join(format!("weft-viz-serve-{tag}-{}", std::process::id()));
        let (run, assets) = (base.join("run"), base.join("assets"));
        fs::create_dir_all(&run).unwrap();
        fs::create_dir_all(&assets).unwrap();
        fs::write(base.join("secret.txt"), "secret").unwrap();
        (run, Assets::Dir(assets))
    }

    #[test]
    fn routes_and_traversal() {
        let (run, assets) = dirs("routes");
        let Assets::Dir(dir) = &assets else { panic!() };
        for a in REQUIRED_ASSETS {
            fs::write(dir.join(a), a).unwrap();
        }
        fs::write(run.join("trace.json"), "{}").unwrap();
        fs::write(run.join("notes.txt"), "x").unwrap();
        let run = ServedRun::name_all(std::slice::from_ref(&run));
        assert_eq!(
            got(respond("/", &run, &assets)),
            (200, b"index.html".to_vec())
        );
        assert_eq!(
            respond("/weft_viz_web_bg.wasm", &run, &assets).content_type,
            "application/wasm"
        );
        let r = respond("/run/files.json?x=1", &run, &assets);
        assert_eq!(got(r).1, br#"["trace.json"]"#);
        assert_eq!(respond("/run/trace.json", &run, &assets).status, 200);
        assert_eq!(
            respond("/run/metrics.jsonl", &run, &assets).status,
            404,
            "absent run file"
        );
        for bad in [
            "/run/notes.txt",
            "/../secret.txt",
            "/run/../../secret.txt",
            "/%2e%2e/secret.txt",
            "/run/../assets/index.html",
            "//etc/passwd",
            "/assets/../secret.txt",
        ] {
            assert_eq!(respond(bad, &run, &assets).status, 404, "{bad}");
            assert_eq!(respond(bad, &run, &Assets::Embedded).status, 404, "{bad}");
        }
    }

    #[test]
    fn the_embedded_page_is_served_without_any_folder() {
        let (run, _) = dirs("embedded");
        let run = ServedRun::name_all(&[run]);
        let page = |name: &str| crate::page::embedded(name).unwrap().bytes;
        let r = respond("/", &run, &Assets::Embedded);
        assert_eq!(got(r), (200, page("index.html").to_vec()));
        let r = respond("/weft_viz_web_bg.wasm", &run, &Assets::Embedded);
        assert_eq!(r.content_type, "application/wasm");
        assert_eq!(got(r).1, page("weft_viz_web_bg.wasm"));
        let r = respond("/weft_viz_web.js", &run, &Assets::Embedded);
        assert!(r.content_type.starts_with("text/javascript"));
        assert_eq!(respond("/style.css", &run, &Assets::Embedded).status, 200);
        assert_eq!(respond("/SOURCES", &run, &Assets::Embedded).status, 404);
        assert_eq!(
            respond("/dist/index.html", &run, &Assets::Embedded).status,
            404
        );
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert!(Server::bind(&[run[0].dir.clone()], &Assets::Embedded, local).is_ok());
    }

    #[test]
    fn bind_checks_folders_and_address_then_serves_over_tcp() {
        let (run, assets) = dirs("bind");
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let err = Server::bind(std::slice::from_ref(&run), &assets, local).unwrap_err();
        assert!(err.to_string().contains("viz-web/build.sh"), "{err}");
        assert!(err.to_string().contains("built into weft"), "{err}");
        assert!(matches!(
            err,
            ServeError::AssetsMissing {
                missing: "index.html",
                ..
            }
        ));
        let Assets::Dir(dir) = &assets else { panic!() };
        for a in REQUIRED_ASSETS {
            fs::write(dir.join(a), a).unwrap();
        }
        let err = Server::bind(&[run.clone(), run.join("nope")], &assets, local).unwrap_err();
        assert!(matches!(err, ServeError::RunDirMissing { .. }), "{err}");
        assert!(err.to_string().contains("nope"), "{err}");
        let err = Server::bind(&[], &assets, local).unwrap_err();
        assert!(matches!(err, ServeError::NoRuns), "{err}");
        let err = Server::bind(
            std::slice::from_ref(&run),
            &assets,
            "0.0.0.0:0".parse().unwrap(),
        )
        .unwrap_err();
        assert!(matches!(err, ServeError::NotLoopback { .. }), "{err}");
        fs::write(run.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
        let server = Server::bind(std::slice::from_ref(&run), &assets, local).unwrap();
        let addr = server.local_addr().unwrap();
        assert!(server.url().unwrap().starts_with("http://127.0.0.1:"));
        thread::spawn(move || server.run());
        let get = |path: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).unwrap();
            text
        };
        let r = get("/run/metrics.jsonl");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.ends_with("\r\n\r\n{\"step\":1}\n"), "{r}");
        assert!(get("/run/../../x").starts_with("HTTP/1.1 404"));
        // bounded requests, answered as HTTP servers answer them
        let send = |raw: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            // the server may answer and close before reading all of it
            let _ = s.write_all(raw);
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            text
        };
        let long_line = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(256 * 1024));
        assert!(send(long_line.as_bytes()).starts_with("HTTP/1.1 414"));
        let many: String = (0..200).map(|i| format!("X-{i}: y\r\n")).collect();
        let r = send(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes());
        assert!(r.starts_with("HTTP/1.1 431"), "{r}");
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "b".repeat(40 * 1024));
        assert!(send(big.as_bytes()).starts_with("HTTP/1.1 431"));
        let r = send(b"POST /run/metrics.jsonl HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello");
        assert!(r.starts_with("HTTP/1.1 413"), "{r}");
        // connections beyond the limit are turned away, the others served
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut turned_away = String::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !turned_away.starts_with("HTTP/1.1 503") && Instant::now() < deadline {
            turned_away = send(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n");
        }
        assert!(turned_away.starts_with("HTTP/1.1 503"), "{turned_away}");
        drop(idle);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut served = String::new();
        while !served.starts_with("HTTP/1.1 200") && Instant::now() < deadline {
            served = get("/run/metrics.jsonl");
            thread::sleep(Duration::from_millis(20));
        }
        assert!(
            served.starts_with("HTTP/1.1 200"),
            "served again once they close: {served}"
        );
    }

    #[test]
    fn several_runs_each_under_its_index_named_by_folder() {
        let (a, assets) = dirs("multi");
        let base = a.parent().unwrap().to_owned();
        let (b, c) = (base.join("seed-2"), base.join("other").join("run"));
        fs::create_dir_all(&b).unwrap();
        fs::create_dir_all(&c).unwrap();
        fs::write(a.join("metrics.jsonl"), "a").unwrap();
        fs::write(b.join("metrics.jsonl"), "b").unwrap();
        fs::write(b.join("trace.json"), "{}").unwrap();
        let runs = ServedRun::name_all(&[a.clone(), b, c.clone()]);
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        // the two `run` folders are named by their parents too
        let parent = base.file_name().unwrap().to_string_lossy();
        assert_eq!(
            names,
            [format!("{parent}/run").as_str(), "seed-2", "other/run"]
        );
        // the same folder twice is told apart by a number
        let twice = ServedRun::name_all(&[c.clone(), c]);
        assert_eq!(twice[1].name, "other/run (2)");
        let r = respond("/runs.json", &runs, &assets);
        assert_eq!(r.content_type, "application/json");
        let list: Vec<RunListing> = serde_json::from_slice(&got(r).1).unwrap();
        assert_eq!(list[1].name, "seed-2");
        assert_eq!(list[1].files, ["trace.json", "metrics.jsonl"]);
        assert!(list[2].files.is_empty());
        let body = |p: &str| {
            let (status, b) = got(respond(p, &runs, &assets));
            (status, String::from_utf8_lossy(&b).into_owned())
        };
        assert_eq!(body("/run/0/metrics.jsonl"), (200, "a".into()));
        assert_eq!(body("/run/1/metrics.jsonl"), (200, "b".into()));
        assert_eq!(body("/run/metrics.jsonl"), (200, "a".into()), "run 0");
        assert_eq!(
            body("/run/1/files.json"),
            (200, r#"["trace.json","metrics.jsonl"]"#.into())
        );
        assert_eq!(
            body("/run/files.json"),
            (200, r#"["metrics.jsonl"]"#.into())
        );
        for bad in [
            "/run/3/metrics.jsonl",
            "/run/01/metrics.jsonl",
            "/run/+1/metrics.jsonl",
            "/run/-1/metrics.jsonl",
            "/run//metrics.jsonl",
            "/run/1/../0/metrics.jsonl",
            "/run/1/x/metrics.jsonl",
            "/run/1/",
            "/run/18446744073709551616/metrics.jsonl",
            "/run/2/metrics.jsonl",
        ] {
            assert_eq!(respond(bad, &runs, &assets).status, 404, "{bad}");
        }
    }

    /// A hostile run folder: its run files are links out of it, a device,
    /// a FIFO, a file too large. None is served (403, the reason named),
    /// none is listed, nothing blocks.
    #[test]
    fn only_regular_files_inside_the_run_folder_are_served() {
        use std::os::unix::fs::symlink;
        let (run, assets) = dirs("links");
        let secret = run.parent().unwrap().join("secret.txt");
        symlink(&secret, run.join("metrics.jsonl")).unwrap();
        symlink("/dev/zero", run.join("events.jsonl")).unwrap();
        symlink("/etc/passwd", run.join("config.toml")).unwrap();
        let fifo = std::ffi::CString::new(run.join("trace.json").to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let big = fs::File::create(run.join("summary.json")).unwrap();
        big.set_len(MAX_RUN_FILE_BYTES + 1).unwrap(); // sparse
        let runs = ServedRun::name_all(std::slice::from_ref(&run));
        for (name, why) in [
            ("metrics.jsonl", "a link"),
            ("events.jsonl", "a link"),
            ("config.toml", "a link"),
            ("trace.json", "not a regular file"),
            ("summary.json", "more than"),
        ] {
            let started = Instant::now();
            let (status, body) = got(respond(&format!("/run/{name}"), &runs, &assets));
            let body = String::from_utf8_lossy(&body);
            assert_eq!(status, 403, "{name}: {body}");
            assert!(
                body.contains(why) && !body.contains("secret"),
                "{name}: {body}"
            );
            assert!(started.elapsed() < Duration::from_secs(2), "{name} blocked");
        }
        assert!(runs[0].files().is_empty(), "{:?}", runs[0].files());
        // a regular file is streamed whole
        fs::remove_file(run.join("summary.json")).unwrap();
        fs::write(run.join("summary.json"), "{\"steps\": 3}").unwrap();
        assert_eq!(
            got(respond("/run/summary.json", &runs, &assets)),
            (200, b"{\"steps\": 3}".to_vec())
        );
    }

    /// A client that trickles its request a byte at a time is cut off
    /// once the request's time is up, and others are served meanwhile.
    #[test]
    fn a_request_that_trickles_in_is_cut_off() {
        let (run, _) = dirs("slow");
        fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = Server::bind(std::slice::from_ref(&run), &Assets::Embedded, local)
            .unwrap()
            .with_request_timeout(Duration::from_millis(800));
        let addr = server.local_addr().unwrap();
        thread::spawn(move || server.run());
        let mut slow = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let trickle = thread::spawn(move || {
            // a byte every 100 ms, never finishing the request
            for b in b"GET /run/metrics.jsonl HTTP/1.1\r\nX-Slow: "
                .iter()
                .cycle()
            {
                if slow.write_all(&[*b]).is_err() || started.elapsed() > Duration::from_secs(10) {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
            started.elapsed()
        });
        let mut quick = TcpStream::connect(addr).unwrap();
        write!(
            quick,
            "GET /run/metrics.jsonl HTTP/1.1\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        quick.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let cut = trickle.join().unwrap();
        assert!(cut < Duration::from_secs(5), "cut off after {cut:?}");
    }
}
