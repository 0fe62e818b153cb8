//! Any bytes as manifest.json: an error or a valid manifest, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = weft_checkpoint::Manifest::from_json(data, std::path::Path::new("manifest.json"))
    {
        // What parses re-serializes (sealed with its own checksum, which a
        // manifest written before checksums lacks) and parses to the same
        // manifest, checksum aside.
        let sealed = m.to_json();
        let again = weft_checkpoint::Manifest::from_json(&sealed, std::path::Path::new("again"))
            .expect("re-parse of a valid manifest");
        assert!(again.manifest_crc32c.is_some());
        let unsealed = |mut x: weft_checkpoint::Manifest| {
            x.manifest_crc32c = None;
            x
        };
        assert_eq!(unsealed(m), unsealed(again.clone()));
        assert_eq!(again.to_json(), sealed, "serializing is idempotent");
    }
});
