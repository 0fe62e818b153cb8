//! The kernel sources and their compilation with NVRTC.
//!
//! NVRTC compiles CUDA C++ at run time and needs no GPU, no driver and no
//! toolkit headers (the sources include nothing), only `libnvrtc`: so the
//! same [`compile`] that builds the kernels for the device in hand also
//! checks, on a CPU-only machine, that every source compiles for every
//! architecture weft targets.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// Prepended to every source: bf16/fp16 conversions, the CPU's `exp`
/// polynomial, warp and block reductions.
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One kernel source file of `kernels/cuda/`, compiled as one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// `pointwise.cu`: GELU, residual, accumulate, scale, operand rounding.
    Pointwise,
    /// `encoder.cu`: token + position embedding.
    Encoder,
    /// `layernorm.cu`: layernorm, column sums, bias add.
    Layernorm,
    /// `classifier.cu`: fused softmax + cross-entropy.
    Classifier,
    /// `adamw.cu`: the fused AdamW update.
    Adamw,
    /// `reduce.cu`: finiteness count and exact sums.
    Reduce,
    /// `attention.cu`: flash-style causal attention (one module per head
    /// size).
    Attention,
    /// `matmul.cu`: the batch-invariant matrix product.
    Matmul,
}

impl Source {
    /// Every source.
    pub const ALL: [Source; 8] = [
        Source::Pointwise,
        Source::Encoder,
        Source::Layernorm,
        Source::Classifier,
        Source::Adamw,
        Source::Reduce,
        Source::Attention,
        Source::Matmul,
    ];

    /// The file name under `kernels/cuda/`.
    pub fn file(self) -> &'static str {
        match self {
            Source::Pointwise => "pointwise.cu",
            Source::Encoder => "encoder.cu",
            Source::Layernorm => "layernorm.cu",
            Source::Classifier => "classifier.cu",
            Source::Adamw => "adamw.cu",
            Source::Reduce => "reduce.cu",
            Source::Attention => "attention.cu",
            Source::Matmul => "matmul.cu",
        }
    }

    /// The source text (without the common prelude).
    pub fn text(self) -> &'static str {
        match self {
            Source::Pointwise => include_str!("../../cuda/pointwise.cu"),
            Source::Encoder => include_str!("../../cuda/encoder.cu"),
            Source::Layernorm => include_str!("../../cuda/layernorm.cu"),
            Source::Classifier => include_str!("../../cuda/classifier.cu"),
            Source::Adamw => include_str!("../../cuda/adamw.cu"),
            Source::Reduce => include_str!("../../cuda/reduce.cu"),
            Source::Attention => include_str!("../../cuda/attention.cu"),
            Source::Matmul => include_str!("../../cuda/matmul.cu"),
        }
    }

    /// The entry points the module must export.
    pub fn kernels(self) -> &'static [&'static str] {
        match self {
            Source::Pointwise => &[
                "gelu_forward",
                "gelu_backward",
                "residual_forward",
                "accumulate",
                "scale",
                "to_bf16",
                "to_f16",
                "from_bf16",
            ],
            Source::Encoder => &["encoder_forward", "embedding_backward"],
            Source::Layernorm => &[
                "layernorm_forward",
                "layernorm_backward_input",
                "layernorm_backward_weight_partial",
                "layernorm_backward_weight_finish",
                "column_sum_partial",
                "column_sum_finish",
                "add_bias",
            ],
            Source::Classifier => &["fused_classifier_forward", "fused_classifier_backward"],
            Source::Adamw => &["adamw"],
            Source::Reduce => &[
                "count_nonfinite",
                "exact_sum",
                "exact_sum_squares",
                "exact_sum_columns",
            ],
            Source::Attention => &[
                "attention_forward",
                "attention_backward_delta",
                "attention_backward_dkdv",
                "attention_backward_dq",
            ],
            Source::Matmul => &["matmul_invariant"],
        }
    }

    /// Whether the module is compiled `--fmad=false`: the sources that
    /// reproduce a CPU kernel's operations bit for bit (a fused
    /// multiply-add rounds once where the CPU rounds twice).
    pub fn exact(self) -> bool {
        matches!(
            self,
            Source::Pointwise | Source::Encoder | Source::Classifier | Source::Adamw
        )
    }

    /// Whether the module takes a head size (`-DHS=n`).
    pub fn per_head_size(self) -> bool {
        self == Source::Attention
    }
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// PTX for the virtual architecture `compute_XY` (the driver compiles it
    /// when loading; it needs a driver at least as new as NVRTC).
    Ptx {
        /// Compute capability, major.
        major: u32,
        /// Compute capability, minor.
        minor: u32,
    },
    /// Machine code (CUBIN) for `sm_XY`, loaded as it is.
    Cubin {
        /// Compute capability, major.
        major: u32,
        /// Compute capability, minor.
        minor: u32,
    },
}

impl Target {
    /// The `--gpu-architecture` value: `compute_90` or `sm_90`.
    pub fn arch(self) -> String {
        match self {
            Target::Ptx { major, minor } => format!("compute_{major}{minor}"),
            Target::Cubin { major, minor } => format!("sm_{major}{minor}"),
        }
    }
}

/// Checks that libnvrtc can be loaded (cudarc panics on first use when it
/// cannot).
pub(crate) fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen the library under its candidate names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Unavailable {
            what: "NVRTC (the CUDA runtime compiler)".into(),
            reason: "libnvrtc.so.13 cannot be loaded: install the CUDA 13 NVRTC \
                     (`pip install nvidia-cuda-nvrtc`, then put its nvidia/cu13/lib on \
                     LD_LIBRARY_PATH) or a CUDA 13 toolkit"
                .into(),
        })
    }
}

/// The version of the NVRTC library found, e.g. `(13, 0)`.
///
/// # Errors
/// [`Error::Unavailable`] if libnvrtc cannot be loaded.
pub fn nvrtc_version() -> Result<(u32, u32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0 as c_int, 0 as c_int);
    // SAFETY: the library is present; two valid out-pointers.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_ok(r, "nvrtcVersion")?;
    Ok((major.unsigned_abs(), minor.unsigned_abs()))
}

fn nvrtc_ok(r: sys::nvrtcResult, what: &'static str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        // SAFETY: nvrtcGetErrorString returns a static C string.
        let msg = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) };
        Err(Error::Cuda {
            op: what,
            message: msg.to_string_lossy().into_owned(),
        })
    }
}

type Key = (Source, Target, usize);

/// Compiled images of this process, by source, target and head size.
fn cache() -> &'static Mutex<HashMap<Key, Arc<Vec<u8>>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Vec<u8>>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles `source` for `target` with NVRTC (cached for the process);
/// `head_size` is the attention module's `HS` (ignored by the others).
/// Returns the PTX text (NUL-terminated) or the CUBIN image.
///
/// # Errors
/// [`Error::Unavailable`] without libnvrtc; [`Error::Compile`] with the
/// compiler's log if the source does not compile; [`Error::InvalidArgument`]
/// for a head size outside `1..=256`.
pub fn compile(source: Source, target: Target, head_size: usize) -> Result<Arc<Vec<u8>>> {
    nvrtc_present()?;
    let hs = if source.per_head_size() {
        if !(1..=256).contains(&head_size) {
            return Err(Error::InvalidArgument {
                op: "cuda::compile",
                reason: format!("head size {head_size} is outside 1..=256"),
            });
        }
        head_size
    } else {
        0
    };
    let key = (source, target, hs);
    if let Some(hit) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(hit.clone());
    }
    let image = Arc::new(compile_uncached(source, target, hs)?);
    cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, image.clone());
    Ok(image)
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed
        // once; a failure leaks it, nothing worse.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn compile_uncached(source: Source, target: Target, hs: usize) -> Result<Vec<u8>> {
    let file = source.file();
    let arch = target.arch();
    let text = format!("{COMMON}\n#line 1 \"{file}\"\n{}", source.text());
    let bad = |what: &str| Error::Compile {
        file: file.into(),
        arch: arch.clone(),
        log: what.into(),
    };
    let src = CString::new(text).map_err(|_| bad("the source holds a NUL byte"))?;
    let name = CString::new(file).map_err(|_| bad("the file name holds a NUL byte"))?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        format!("--fmad={}", !source.exact()),
    ];
    if hs > 0 {
        options.push(format!("-DHS={hs}"));
    }
    let options: Vec<CString> = options
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| bad("an option holds a NUL byte")))
        .collect::<Result<_>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut prog = Program(std::ptr::null_mut());
    // SAFETY: valid NUL-terminated strings that outlive the call; no headers.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog.0,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    nvrtc_ok(r, "nvrtcCreateProgram")?;
    let n_opts = c_int::try_from(option_ptrs.len()).unwrap_or(c_int::MAX);
    // SAFETY: `prog` is a live program; the option pointers are valid
    // NUL-terminated strings that outlive the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, n_opts, option_ptrs.as_ptr()) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Compile {
            file: file.into(),
            arch,
            log: program_log(&prog),
        });
    }
    let cubin = matches!(target, Target::Cubin { .. });
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    let r = unsafe {
        if cubin {
            sys::nvrtcGetCUBINSize(prog.0, &mut size)
        } else {
            sys::nvrtcGetPTXSize(prog.0, &mut size)
        }
    };
    nvrtc_ok(r, "nvrtcGetPTXSize")?;
    let mut out = vec![0u8; size];
    // SAFETY: `out` holds the `size` bytes NVRTC reported.
    let r = unsafe {
        if cubin {
            sys::nvrtcGetCUBIN(prog.0, out.as_mut_ptr().cast())
        } else {
            sys::nvrtcGetPTX(prog.0, out.as_mut_ptr().cast())
        }
    };
    nvrtc_ok(r, "nvrtcGetPTX")?;
    if out.is_empty() {
        return Err(bad("NVRTC produced an empty image"));
    }
    Ok(out)
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: a live program and a valid out-pointer.
    if unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return "(no log)".into();
    }
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: `log` holds the `size` bytes NVRTC reported.
    if unsafe { sys::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast()) }
        != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return "(no log)".into();
    }
    String::from_utf8_lossy(&log)
        .trim_end_matches('\0')
        .trim()
        .to_string()
}
