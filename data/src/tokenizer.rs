//! GPT-2's byte-level BPE (`r50k_base`), built once per process and shared
//! by everything that tokenizes or decodes: `weft data prepare`, text
//! data, and `weft sample`.

use std::sync::OnceLock;

use crate::error::{DataError, Result};

/// A byte-level BPE tokenizer (tiktoken's), as [`gpt2`] returns it.
pub use tiktoken_rs::CoreBPE;

/// GPT-2's tokenizer, built on first use.
///
/// # Errors
/// [`DataError::Tokenizer`] if it cannot be built (its tables are
/// compiled in, so this does not happen in a working build).
pub fn gpt2() -> Result<&'static CoreBPE> {
    static BPE: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataError::Tokenizer(e.clone()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn gpt2_encodes_as_gpt2_does() {
        // "Hello world." = [15496, 995, 13] in GPT-2's vocabulary
        let bpe = super::gpt2().unwrap();
        assert_eq!(bpe.encode_ordinary("Hello world."), [15496, 995, 13]);
        assert!(std::ptr::eq(bpe, super::gpt2().unwrap()), "built once");
    }
}
