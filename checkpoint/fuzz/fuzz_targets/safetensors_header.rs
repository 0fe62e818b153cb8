//! Any bytes as the start of a safetensors file, with any claimed length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, &[u8])| {
    let (extra, data) = input;
    let path = std::path::Path::new("f.safetensors");
    let _ = weft_checkpoint::parse_header(data, data.len() as u64, path);
    let _ = weft_checkpoint::parse_header(data, (data.len() as u64).saturating_add(extra), path);
});
