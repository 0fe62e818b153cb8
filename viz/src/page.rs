//! The built page that ships inside the crate, and the stamp that ties it
//! to its sources.
//!
//! `viz/page/` holds the page as `bash viz-web/build.sh --commit`
//! builds it from the app crate `weft-viz-web` (`index.html`,
//! `style.css`, `weft_viz_web.js`, `weft_viz_web_bg.wasm`), committed to
//! the repository, and
//! [`EMBEDDED`] compiles those files into every binary that uses the
//! server, so `weft viz` works on a fresh clone and from an installed
//! binary without building anything for the browser.
//!
//! Beside them, `viz/page/SOURCES` is the page's stamp: the
//! wasm-bindgen version of `Cargo.lock` and one line per source file the
//! page is built from, as `sha256sum` prints it (64 hex digits, two spaces,
//! the path from the repository root). `build.sh --commit` writes it with
//! `sha256sum`; [`Stamp::of_sources`] recomputes it from a source tree, and
//! a test compares that with the committed one and fails,
//! naming the files that changed and the command to run
//! ([`REBUILD_COMMAND`]), when the page's sources changed without a rebuild.
//!
//! The stamped sources ([`STAMPED`]) are the manifests and `src/**` of
//! the crates compiled into the page (`trace`, `compare`, `viz-web`),
//! `viz-web/build.sh` (how the page is built) and `viz-web/static/**`.
//! Dependency versions other than wasm-bindgen's are not stamped: bumping
//! them does not make the committed page stale until one of these files
//! changes. The hash is SHA-256 of the raw bytes, so the stamp can be
//! checked without Rust: from the repository root,
//! `grep -E '^[0-9a-f]{64}  ' viz/page/SOURCES | sha256sum -c`.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// One file of the built page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asset {
    /// File name, as requested by the browser (`/<name>`).
    pub name: &'static str,
    /// Its bytes.
    pub bytes: &'static [u8],
}

/// The committed page (`viz/page/`), compiled in.
pub const EMBEDDED: [Asset; 4] = [
    Asset {
        name: "index.html",
        bytes: include_bytes!("../page/index.html"),
    },
    Asset {
        name: "style.css",
        bytes: include_bytes!("../page/style.css"),
    },
    Asset {
        name: "weft_viz_web.js",
        bytes: include_bytes!("../page/weft_viz_web.js"),
    },
    Asset {
        name: "weft_viz_web_bg.wasm",
        bytes: include_bytes!("../page/weft_viz_web_bg.wasm"),
    },
];

/// The committed stamp (`viz/page/SOURCES`), compiled in.
pub const EMBEDDED_STAMP: &str = include_str!("../page/SOURCES");

/// The command that rebuilds the committed page and its stamp.
pub const REBUILD_COMMAND: &str = "bash viz-web/build.sh --commit";

/// Folders (from the repository root) whose files, recursively, are
/// stamped, and single stamped files.
pub const STAMPED: [&str; 8] = [
    "trace/Cargo.toml",
    "trace/src",
    "compare/Cargo.toml",
    "compare/src",
    "viz-web/Cargo.toml",
    "viz-web/build.sh",
    "viz-web/src",
    "viz-web/static",
];

/// The page's embedded file named `name`, if any.
#[must_use]
pub fn embedded(name: &str) -> Option<&'static Asset> {
    EMBEDDED.iter().find(|a| a.name == name)
}

/// Why a stamp could not be computed or read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StampError {
    /// A source file or folder could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `Cargo.lock` names no wasm-bindgen package.
    #[error(
        "{path} has no wasm-bindgen package (expected a `name = \"wasm-bindgen\"` line followed by its `version = \"...\"`)"
    )]
    NoWasmBindgen {
        /// The lock file.
        path: PathBuf,
    },
    /// A line of a stamp file is neither a comment, the wasm-bindgen line
    /// nor a `sha256sum` line.
    #[error(
        "{file}, line {line}: expected `# comment`, `wasm-bindgen VERSION` or `<64 hex digits>  <path>`, found {text:?}"
    )]
    BadLine {
        /// The stamp file.
        file: String,
        /// 1-based line.
        line: usize,
        /// The line.
        text: String,
    },
}

/// The sources a page was built from: the wasm-bindgen version and each
/// stamped file's SHA-256, sorted by path.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stamp {
    /// wasm-bindgen's version in `Cargo.lock` (the JS glue must match it).
    pub wasm_bindgen: String,
    /// `(path from the repository root with '/', SHA-256 in hex)`, sorted.
    pub files: Vec<(String, String)>,
}

/// How two stamps differ, file by file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StampDiff {
    /// Files whose hash changed.
    pub changed: Vec<String>,
    /// Files only in the newer stamp.
    pub added: Vec<String>,
    /// Files only in the older stamp.
    pub removed: Vec<String>,
    /// `(old, new)` wasm-bindgen versions, if they differ.
    pub wasm_bindgen: Option<(String, String)>,
}

impl StampDiff {
    /// True when the stamps are equal.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
            && self.wasm_bindgen.is_none()
    }
}

impl fmt::Display for StampDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for (what, list) in [
            ("changed", &self.changed),
            ("added", &self.added),
            ("removed", &self.removed),
        ] {
            if !list.is_empty() {
                parts.push(format!("{what}: {}", list.join(", ")));
            }
        }
        if let Some((old, new)) = &self.wasm_bindgen {
            parts.push(format!("wasm-bindgen {old} -> {new}"));
        }
        if parts.is_empty() {
            f.write_str("no difference")
        } else {
            f.write_str(&parts.join("; "))
        }
    }
}

impl Stamp {
    /// The stamp of the source tree at `root` (the repository root): the
    /// files of [`STAMPED`], and wasm-bindgen's
    /// version from `root/Cargo.lock`.
    ///
    /// # Errors
    /// [`StampError::Read`] when a file or folder cannot be read,
    /// [`StampError::NoWasmBindgen`] when the lock file lacks it.
    pub fn of_sources(root: &Path) -> Result<Self, StampError> {
        let read = |p: &Path| {
            fs::read(p).map_err(|source| StampError::Read {
                path: p.to_owned(),
                source,
            })
        };
        let lock_path = root.join("Cargo.lock");
        let lock = String::from_utf8_lossy(&read(&lock_path)?).into_owned();
        let wasm_bindgen = lock_version(&lock, "wasm-bindgen")
            .ok_or(StampError::NoWasmBindgen { path: lock_path })?;
        let mut rel = Vec::new();
        for s in STAMPED {
            collect(root, s, &mut rel)?;
        }
        rel.sort();
        rel.dedup();
        let mut files = Vec::with_capacity(rel.len());
        for p in rel {
            let hash = hex(&sha256(&read(&root.join(&p))?));
            files.push((p, hash));
        }
        Ok(Self {
            wasm_bindgen,
            files,
        })
    }

    /// Parse a stamp file's text (`file` names it in errors).
    ///
    /// # Errors
    /// [`StampError::BadLine`] for a line of another shape.
    pub fn parse(file: &str, text: &str) -> Result<Self, StampError> {
        let mut stamp = Self::default();
        for (i, line) in text.lines().enumerate() {
            let bad = || StampError::BadLine {
                file: file.to_owned(),
                line: i + 1,
                text: line.to_owned(),
            };
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(v) = line.strip_prefix("wasm-bindgen ") {
                v.trim().clone_into(&mut stamp.wasm_bindgen);
                continue;
            }
            let (hash, path) = line.split_once("  ").ok_or_else(bad)?;
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) || path.is_empty() {
                return Err(bad());
            }
            stamp
                .files
                .push((path.to_owned(), hash.to_ascii_lowercase()));
        }
        stamp.files.sort();
        Ok(stamp)
    }

    /// What changed from `self` (older) to `newer`.
    #[must_use]
    pub fn diff(&self, newer: &Self) -> StampDiff {
        let mut d = StampDiff::default();
        for (p, h) in &newer.files {
            match self.files.iter().find(|(q, _)| q == p) {
                Some((_, g)) if g == h => {}
                Some(_) => d.changed.push(p.clone()),
                None => d.added.push(p.clone()),
            }
        }
        for (p, _) in &self.files {
            if !newer.files.iter().any(|(q, _)| q == p) {
                d.removed.push(p.clone());
            }
        }
        if self.wasm_bindgen != newer.wasm_bindgen {
            d.wasm_bindgen = Some((self.wasm_bindgen.clone(), newer.wasm_bindgen.clone()));
        }
        d
    }
}

impl fmt::Display for Stamp {
    /// The stamp file's text: a header, the wasm-bindgen line, then the
    /// `sha256sum` lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "# The sources viz/page/ was built from (see viz/src/page.rs):"
        )?;
        writeln!(
            f,
            "# wasm-bindgen's version in Cargo.lock, then `sha256sum` lines of the"
        )?;
        writeln!(
            f,
            "# files, paths from the repository root. Written by `{REBUILD_COMMAND}`."
        )?;
        writeln!(f, "wasm-bindgen {}", self.wasm_bindgen)?;
        for (p, h) in &self.files {
            writeln!(f, "{h}  {p}")?;
        }
        Ok(())
    }
}

/// The version of package `name` in a `Cargo.lock` text.
fn lock_version(lock: &str, name: &str) -> Option<String> {
    let want = format!("name = \"{name}\"");
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l.trim() == want {
            let v = lines.next()?.trim().strip_prefix("version = ")?;
            return Some(v.trim_matches('"').to_owned());
        }
    }
    None
}

/// Push `rel` (a file) or every file below it (a folder), as paths from
/// `root` with '/'.
fn collect(root: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), StampError> {
    let path = root.join(rel);
    let meta = fs::metadata(&path).map_err(|source| StampError::Read {
        path: path.clone(),
        source,
    })?;
    if meta.is_file() {
        out.push(rel.to_owned());
        return Ok(());
    }
    let entries = fs::read_dir(&path).map_err(|source| StampError::Read {
        path: path.clone(),
        source,
    })?;
    for e in entries {
        let e = e.map_err(|source| StampError::Read {
            path: path.clone(),
            source,
        })?;
        let name = e.file_name().to_string_lossy().into_owned();
        // editor droppings are not sources
        if name.starts_with('.') || name.ends_with('~') || name.ends_with(".swp") {
            continue;
        }
        collect(root, &format!("{rel}/{name}"), out)?;
    }
    Ok(())
}

/// Lower-case hex of `bytes`.
#[must_use]
pub fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// SHA-256 (FIPS 180-4) of `data`.
#[must_use]
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a_2f98,
        0x7137_4491,
        0xb5c0_fbcf,
        0xe9b5_dba5,
        0x3956_c25b,
        0x59f1_11f1,
        0x923f_82a4,
        0xab1c_5ed5,
        0xd807_aa98,
        0x1283_5b01,
        0x2431_85be,
        0x550c_7dc3,
        0x72be_5d74,
        0x80de_b1fe,
        0x9bdc_06a7,
        0xc19b_f174,
        0xe49b_69c1,
        0xefbe_4786,
        0x0fc1_9dc6,
        0x240c_a1cc,
        0x2de9_2c6f,
        0x4a74_84aa,
        0x5cb0_a9dc,
        0x76f9_88da,
        0x983e_5152,
        0xa831_c66d,
        0xb003_27c8,
        0xbf59_7fc7,
        0xc6e0_0bf3,
        0xd5a7_9147,
        0x06ca_6351,
        0x1429_2967,
        0x27b7_0a85,
        0x2e1b_2138,
        0x4d2c_6dfc,
        0x5338_0d13,
        0x650a_7354,
        0x766a_0abb,
        0x81c2_c92e,
        0x9272_2c85,
        0xa2bf_e8a1,
        0xa81a_664b,
        0xc24b_8b70,
        0xc76c_51a3,
        0xd192_e819,
        0xd699_0624,
        0xf40e_3585,
        0x106a_a070,
        0x19a4_c116,
        0x1e37_6c08,
        0x2748_774c,
        0x34b0_bcb5,
        0x391c_0cb3,
        0x4ed8_aa4a,
        0x5b9c_ca4f,
        0x682e_6ff3,
        0x748f_82ee,
        0x78a5_636f,
        0x84c8_7814,
        0x8cc7_0208,
        0x90be_fffa,
        0xa450_6ceb,
        0xbef9_a3f7,
        0xc671_78f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09_e667,
        0xbb67_ae85,
        0x3c6e_f372,
        0xa54f_f53a,
        0x510e_527f,
        0x9b05_688c,
        0x1f83_d9ab,
        0x5be0_cd19,
    ];
    let mut msg = data.to_vec();
    let bits = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bits.to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, c) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (o, x) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("viz sits in the repository root")
            .to_owned()
    }

    #[test]
    fn sha256_matches_the_standard_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            hex(&sha256(&vec![b'a'; 1_000_000])),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    /// The check CI relies on: the committed page was built from the
    /// sources in this tree.
    #[test]
    fn committed_page_is_built_from_these_sources() {
        let root = repo_root();
        let now = Stamp::of_sources(&root).unwrap();
        let built = Stamp::parse("viz/page/SOURCES", EMBEDDED_STAMP).unwrap();
        let diff = built.diff(&now);
        assert!(
            diff.is_empty(),
            "the committed page viz/page/ is stale: its sources changed since it was built ({diff}). Rebuild it with `{REBUILD_COMMAND}` and commit viz/page/."
        );
        assert!(now.files.iter().any(|(p, _)| p == "viz-web/src/app.rs"));
        assert!(now.files.iter().any(|(p, _)| p == "trace/src/lib.rs"));
        assert!(now.files.iter().any(|(p, _)| p == "compare/src/chart.rs"));
    }

    #[test]
    fn stamp_text_round_trips_and_diffs_name_files() {
        let a = Stamp {
            wasm_bindgen: "0.2.1".into(),
            files: vec![
                ("a/x.rs".into(), "0".repeat(64)),
                ("a/y.rs".into(), "1".repeat(64)),
            ],
        };
        assert_eq!(Stamp::parse("S", &a.to_string()).unwrap(), a);
        let mut b = a.clone();
        b.files[0].1 = "2".repeat(64);
        b.files.remove(1);
        b.files.push(("a/z.rs".into(), "3".repeat(64)));
        "0.2.2".clone_into(&mut b.wasm_bindgen);
        let d = a.diff(&b);
        assert_eq!(
            d.to_string(),
            "changed: a/x.rs; added: a/z.rs; removed: a/y.rs; wasm-bindgen 0.2.1 -> 0.2.2"
        );
        let err = Stamp::parse("S", "# ok\nzz  a.rs\n").unwrap_err();
        assert!(err.to_string().starts_with("S, line 2: expected"), "{err}");
        assert_eq!(
            lock_version(
                "[[package]]\nname = \"wasm-bindgen\"\nversion = \"0.2.9\"\n",
                "wasm-bindgen"
            )
            .as_deref(),
            Some("0.2.9")
        );
    }

    #[test]
    fn embedded_page_has_every_required_file() {
        for a in crate::serve::REQUIRED_ASSETS {
            assert!(embedded(a).is_some_and(|a| !a.bytes.is_empty()), "{a}");
        }
        assert!(
            embedded("weft_viz_web_bg.wasm")
                .unwrap()
                .bytes
                .starts_with(b"\0asm")
        );
        assert!(embedded("../Cargo.toml").is_none());
    }
}
