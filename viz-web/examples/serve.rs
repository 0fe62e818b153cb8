//! Serve a run folder with the built page, as `weft viz` does:
//! `cargo run -p weft-viz-web --example serve -- RUN_DIR [ASSETS_DIR] [PORT]`.

#![allow(clippy::print_stdout)] // an example prints its URL

use std::net::SocketAddr;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let run = PathBuf::from(
        args.next()
            .ok_or("usage: serve RUN_DIR [ASSETS_DIR] [PORT]")?,
    );
    let assets = args.next().map_or_else(
        || PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/dist")),
        PathBuf::from,
    );
    let port: u16 = args.next().map_or(Ok(8080), |p| p.parse())?;
    let server =
        weft_viz_web::serve::Server::bind(&run, &assets, SocketAddr::from(([127, 0, 0, 1], port)))?;
    println!("{}", server.url()?);
    server.run()?;
    Ok(())
}
