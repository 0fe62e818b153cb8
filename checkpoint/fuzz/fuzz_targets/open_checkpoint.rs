//! A checkpoint folder with a fuzzed manifest and shard file: open, verify
//! and read everything; errors are fine, panics and hangs are not.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&[u8], &[u8])| {
    let (manifest, shard) = input;
    let dir = std::env::temp_dir().join(format!("weft-ckpt-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    std::fs::write(dir.join("manifest.json"), manifest).unwrap();
    std::fs::write(dir.join("rank-00000.safetensors"), shard).unwrap();
    if let Ok(c) = weft_checkpoint::Checkpoint::open(&dir) {
        let _ = c.verify();
        for name in c.manifest().tensors.keys() {
            let _ = c.read_tensor(name);
        }
    }
});
