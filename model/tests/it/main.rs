//! weft-model integration tests, compiled into one binary (fixtures in `tests/fixtures`).

mod cp;
mod hf_io;
mod hf_python;
mod invariance;
mod llama_reference;
mod qwen3moe_reference;
mod reference;
