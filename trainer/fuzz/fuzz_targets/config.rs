//! Any text as a job file, then any line as a `--set` override: an error
//! naming the key or position, or a configuration that validates and
//! round-trips through its TOML — never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weft_trainer::config::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // the last line is an override, the rest the file
    let (file, set) = text.rsplit_once('\n').unwrap_or((&text, ""));
    let Ok(config) = Config::from_toml(file, "fuzz.toml") else {
        return;
    };
    let config = config.with_override(set).unwrap_or(config);
    if config.validate().is_ok() {
        let again =
            Config::from_toml(&config.to_toml(), "again.toml").expect("its own TOML parses");
        assert_eq!(again, config);
        // what the layout derives from a valid config does not panic
        let _ = config.batch_split();
        let _ = config.parallel.dims().validate();
    }
});
