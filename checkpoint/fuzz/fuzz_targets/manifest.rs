//! Any bytes as manifest.json: an error or a valid manifest, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = weft_checkpoint::Manifest::from_json(data, std::path::Path::new("manifest.json")) {
        // What parses must re-serialize and parse to the same manifest.
        let again = weft_checkpoint::Manifest::from_json(&m.to_json(), std::path::Path::new("again"))
            .expect("re-parse of a valid manifest");
        assert_eq!(m, again);
    }
});
