//! The device parameter store: one allocation, named views, the host
//! layout's names and ranges — so the gradient buffer, the moments, FSDP's
//! shards, the collectives' reductions and the checkpoint's tensors are
//! the same ranges on the device as on the host.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::device::{Gpu, cuda_err};
use super::ops::{adamw_update, round_to_bf16};
use crate::adamw::AdamW;
use crate::error::{Error, Result};

/// One tensor of a [`DeviceParams`]: its name, its range in the flat
/// buffer, and whether AdamW decays it (GPT-2 practice: matrices do,
/// biases and layernorm gains do not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The host layout's name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Its elements in the flat buffer.
    pub range: Range<usize>,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// A flat f32 buffer on the device with named tensors (the host layout's),
/// and optionally its bf16 copy (same layout, the operands of bf16
/// products, refreshed by [`GpuAdamW::step`] or
/// [`refresh_bf16`](Self::refresh_bf16)).
#[derive(Debug)]
pub struct DeviceParams {
    data: CudaSlice<f32>,
    bf16: Option<CudaSlice<u16>>,
    tensors: Vec<TensorSpec>,
}

impl DeviceParams {
    /// Copies `host` to the device with the tensors `tensors` (ranges inside
    /// `host`, in increasing order, not overlapping).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer or out of
    /// order; [`Error::Cuda`] if the copy fails.
    pub fn upload(gpu: &Gpu, host: &[f32], tensors: Vec<TensorSpec>) -> Result<Self> {
        check_specs(host.len(), &tensors)?;
        Ok(Self {
            data: gpu.upload(host)?,
            bf16: None,
            tensors,
        })
    }

    /// Zeros in the layout of `like` (for gradients and moments).
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocation fails.
    pub fn zeros_like(gpu: &Gpu, like: &DeviceParams) -> Result<Self> {
        Ok(Self {
            data: gpu.zeros(like.len())?,
            bf16: None,
            tensors: like.tensors.clone(),
        })
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.data.len() == 0
    }

    /// The tensors, in buffer order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    fn range(&self, name: &str) -> Result<Range<usize>> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.range.clone())
            .ok_or_else(|| Error::InvalidArgument {
                op: "DeviceParams",
                reason: format!("no tensor named `{name}`"),
            })
    }

    /// The whole buffer.
    pub fn all(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// The whole buffer, writable.
    pub fn all_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }

    /// Tensor `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name.
    pub fn view(&self, name: &str) -> Result<CudaView<'_, f32>> {
        let r = self.range(name)?;
        Ok(self.data.slice(r))
    }

    /// Tensor `name`, writable.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name.
    pub fn view_mut(&mut self, name: &str) -> Result<CudaViewMut<'_, f32>> {
        let r = self.range(name)?;
        Ok(self.data.slice_mut(r))
    }

    /// Tensor `name` of the bf16 copy (raw bits).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name or when there is no
    /// bf16 copy ([`refresh_bf16`](Self::refresh_bf16) makes it).
    pub fn view_bf16(&self, name: &str) -> Result<CudaView<'_, u16>> {
        let r = self.range(name)?;
        match &self.bf16 {
            Some(b) => Ok(b.slice(r)),
            None => Err(Error::InvalidArgument {
                op: "DeviceParams::view_bf16",
                reason: "the parameters have no bf16 copy yet (refresh_bf16 makes it)".into(),
            }),
        }
    }

    /// (Re)writes the bf16 copy from the f32 values.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn refresh_bf16(&mut self, gpu: &Gpu) -> Result<()> {
        if self.bf16.is_none() {
            self.bf16 = Some(gpu.zeros(self.data.len())?);
        }
        if let Some(b) = self.bf16.as_mut() {
            round_to_bf16(gpu, b, &self.data)?;
        }
        Ok(())
    }

    /// A host copy of the f32 buffer.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn download(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        gpu.download(&self.data)
    }

    /// A host copy of tensor `name` (waits for the work queued before).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name; [`Error::Cuda`].
    pub fn read(&self, gpu: &Gpu, name: &str) -> Result<Vec<f32>> {
        gpu.download(&self.view(name)?)
    }

    /// Overwrites tensor `name` with `host`, in stream order (and the bf16
    /// copy, when there is one).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown name;
    /// [`Error::ShapeMismatch`] if `host` is not the tensor's length;
    /// [`Error::Cuda`].
    pub fn write(&mut self, gpu: &Gpu, name: &str, host: &[f32]) -> Result<()> {
        let r = self.range(name)?;
        if host.len() != r.len() {
            return Err(Error::ShapeMismatch {
                op: "DeviceParams::write",
                buffer: "host",
                expected: r.len(),
                got: host.len(),
            });
        }
        let mut dst = self.data.slice_mut(r);
        gpu.stream()
            .memcpy_htod(host, &mut dst)
            .map_err(|e| cuda_err("DeviceParams::write", e))?;
        if self.bf16.is_some() {
            self.refresh_bf16(gpu)?;
        }
        Ok(())
    }
}

fn check_specs(len: usize, tensors: &[TensorSpec]) -> Result<()> {
    let mut end = 0;
    for t in tensors {
        if t.range.start < end || t.range.end < t.range.start || t.range.end > len {
            return Err(Error::InvalidArgument {
                op: "DeviceParams",
                reason: format!(
                    "tensor `{}` has range {:?}: ranges must lie in 0..{len}, in order, without overlap",
                    t.name, t.range
                ),
            });
        }
        end = t.range.end;
    }
    Ok(())
}

/// AdamW over a [`DeviceParams`]: the moments (f32, same layout) and the
/// step count; one launch per run of tensors with the same decay flag.
/// Bit for bit the CPU's [`adamw_update`](crate::adamw_update) on the
/// same runs.
#[derive(Debug)]
pub struct GpuAdamW {
    /// Hyper-parameters (the learning rate may change between steps).
    pub hp: AdamW,
    m: DeviceParams,
    v: DeviceParams,
    step: u32,
}

impl GpuAdamW {
    /// Zero moments for `params`.
    ///
    /// # Errors
    /// [`Error::Cuda`] if the allocations fail.
    pub fn new(gpu: &Gpu, params: &DeviceParams, hp: AdamW) -> Result<Self> {
        Ok(Self {
            hp,
            m: DeviceParams::zeros_like(gpu, params)?,
            v: DeviceParams::zeros_like(gpu, params)?,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u32 {
        self.step
    }

    /// The first and second moments.
    pub fn moments(&self) -> (&DeviceParams, &DeviceParams) {
        (&self.m, &self.v)
    }

    /// Replaces the moments with host copies `m` and `v` (the parameters'
    /// layout) and the step count with `step`: the state a checkpoint
    /// holds, to continue from it.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if `m` or `v` has another length than the
    /// moments; [`Error::Cuda`] if the copies fail (the old state is kept
    /// then).
    pub fn set_state(&mut self, gpu: &Gpu, m: &[f32], v: &[f32], step: u32) -> Result<()> {
        for (buffer, host) in [("m", m), ("v", v)] {
            if host.len() != self.m.len() {
                return Err(Error::ShapeMismatch {
                    op: "GpuAdamW::set_state",
                    buffer,
                    expected: self.m.len(),
                    got: host.len(),
                });
            }
        }
        let tensors = self.m.tensors.clone();
        let new_m = DeviceParams::upload(gpu, m, tensors.clone())?;
        let new_v = DeviceParams::upload(gpu, v, tensors)?;
        (self.m, self.v, self.step) = (new_m, new_v, step);
        Ok(())
    }

    /// One step: `params` updated from `grads` (the same layout), and the
    /// bf16 copy rewritten in the same pass when `params` has one.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if the buffers differ in length;
    /// [`Error::Cuda`].
    pub fn step(
        &mut self,
        gpu: &Gpu,
        params: &mut DeviceParams,
        grads: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = params.len();
        if grads.len() != n || self.m.len() != n {
            return Err(Error::ShapeMismatch {
                op: "GpuAdamW::step",
                buffer: "grads",
                expected: n,
                got: grads.len(),
            });
        }
        self.step += 1;
        // Runs of consecutive tensors with one decay flag; elements
        // outside every tensor are left alone.
        let mut runs: Vec<(Range<usize>, bool)> = Vec::new();
        for t in &params.tensors {
            match runs.last_mut() {
                Some((r, d)) if *d == t.decay && r.end == t.range.start => r.end = t.range.end,
                _ => runs.push((t.range.clone(), t.decay)),
            }
        }
        for (r, decay) in runs {
            let mut p = params.data.slice_mut(r.clone());
            let mut h = params.bf16.as_mut().map(|b| b.slice_mut(r.clone()));
            let g = grads.slice(r.clone());
            let mut m = self.m.data.slice_mut(r.clone());
            let mut v = self.v.data.slice_mut(r);
            adamw_update(
                gpu,
                &mut p,
                h.as_mut(),
                &g,
                &mut m,
                &mut v,
                &self.hp,
                self.step,
                decay,
            )?;
        }
        Ok(())
    }
}
