//! Prints the causality audit of the standard routers (what `weft moe
//! audit` shows): `cargo run -p weft-moe --example audit -- [E] [K] [TRIALS]`.

use weft_moe::{AuditOptions, audit_suite};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let e = args.first().copied().unwrap_or(8);
    let k = args.get(1).copied().unwrap_or(2);
    let trials = args.get(2).copied().unwrap_or(500);
    let opts = AuditOptions {
        trials,
        ..AuditOptions::default()
    };
    for report in audit_suite(e, k, &opts)? {
        #[allow(clippy::print_stdout)]
        {
            println!("{report}");
        }
    }
    Ok(())
}
