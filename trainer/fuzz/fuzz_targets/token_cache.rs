//! Any bytes as a token cache file: an error, or data whose batches can
//! be read — never a panic, whatever the header claims.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_trainer::data::{Data, TextData};

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("weft-fuzz-cache-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let cache = dir.join("cache.tok");
    std::fs::write(&cache, data).unwrap();
    if let Ok(d) = TextData::open_cache(std::path::Path::new("corpus.txt"), &cache, 4, 0.25, 7) {
        let (train, val) = d.split_sizes();
        assert!(train >= 5 && val >= 5);
        let d = Data::Text(d);
        for step in 0..3 {
            let _ = d.train_batch(step, 0, 2);
        }
        let _ = d.val_batches(2, 1);
    }
});
