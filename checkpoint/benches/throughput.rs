//! Save/load throughput against raw disk bandwidth (filled in below).
fn main() {}
