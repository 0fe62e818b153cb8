//! `weft viz`'s native side: a small std-only HTTP server for run folders,
//! and the browser page it serves.
//!
//! The page is the yew app of `weft-viz-web`, built to WebAssembly. Its
//! build is committed in `viz/page/` and compiled into this crate
//! ([`page::EMBEDDED`]), so `weft viz` needs no browser toolchain, neither
//! on a fresh clone nor from an installed binary, and no binary that
//! serves it links yew. The page's stamp (`viz/page/SOURCES`,
//! [`page::Stamp`]) records the sources it was built from; a test fails
//! when they have changed since, naming the command that rebuilds it
//! (`bash viz-web/build.sh --commit`). A page built from the current
//! sources (`bash viz-web/build.sh`, into `viz-web/dist/`) is served with
//! `weft viz --assets viz-web/dist`.
//!
//! # Overview
//! * [`serve::Server`] — `GET` on 127.0.0.1 for the page
//!   ([`serve::Assets`]: embedded or a folder) and the run files of one or
//!   more run folders; no request path is ever joined onto a folder.
//! * [`page`] — the embedded page, its stamp, and the check that it is not
//!   stale.
//!
//! # Example
//! ```no_run
//! use std::path::PathBuf;
//! use weft_viz::serve::{Assets, Server};
//!
//! let runs = [PathBuf::from("runs/first"), PathBuf::from("runs/second")];
//! let server = Server::bind(&runs, &Assets::Embedded, "127.0.0.1:0".parse()?)?;
//! println!("open {}", server.url()?);
//! server.run()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! None.

#![deny(missing_docs)]

pub mod page;
pub mod serve;
