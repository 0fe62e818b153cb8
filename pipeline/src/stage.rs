//! [`Stage`]: what the executor runs — one model chunk of one rank, of any
//! model.

use std::ops::Range;

/// A parameter that two virtual stages use (tied embeddings: the first
/// stage's token embedding is the last stage's output projection).
///
/// The *owner* holds the trained parameter; the *user* keeps a copy. Per
/// micro-batch the user's backward produces its part of the gradient
/// ([`Stage::shared_grad`]), which the executor sends to the owner
/// ([`Stage::add_shared_grad`]) before the owner's backward of the same
/// micro-batch that accumulates the parameter's gradient (its `BW`, or its
/// `W`); after the optimizer step [`Executor::sync_shared`](crate::Executor::sync_shared)
/// copies the owner's value back to the user. Both stages declare the same
/// `Shared`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shared {
    /// Names the parameter; the same on both stages, distinct per parameter.
    pub id: u32,
    /// The virtual stage that owns and trains it.
    pub owner: usize,
    /// The virtual stage that uses a copy.
    pub user: usize,
    /// Floats of the parameter (and of each gradient contribution).
    pub len: usize,
}

/// One model chunk held by one rank: the executor calls these in the order
/// of the schedule, and moves activations and gradients between ranks.
///
/// [`Batch`](Self::Batch) is the data of one micro-batch as the caller
/// passes it to [`Executor::step`](crate::Executor::step) (token ids and
/// targets for a language model); the first virtual stage reads its input
/// from it, the last its loss targets, the others ignore it. Activations
/// are flat `f32` messages of fixed length.
///
/// Gradients accumulate (`+=`) in the stage's [`grads`](Self::grads)
/// buffer. Each backward call returns the ranges of that buffer whose
/// gradients for the micro-batch are now final (a whole backward: every
/// range it touches; `B` of a zero-bubble schedule: what the input half
/// computes; `W`: the rest), so that a caller can take each micro-batch's
/// gradient piece by piece (see [`GradEvent`](crate::GradEvent)).
pub trait Stage {
    /// One micro-batch's data.
    type Batch<'a>;

    /// The stage's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Floats of the activation this stage receives (and of the gradient
    /// it sends back); unused on the first virtual stage.
    fn input_len(&self) -> usize;

    /// Floats of the activation this stage sends on (and of the gradient
    /// it receives); unused on the last virtual stage.
    fn output_len(&self) -> usize;

    /// Micro-batches whose activations the stage can hold at once.
    fn slots(&self) -> usize;

    /// Whether the stage can split its backward into
    /// [`backward_input`](Self::backward_input) and
    /// [`backward_weight`](Self::backward_weight).
    fn splits_backward(&self) -> bool;

    /// Forward of micro-batch `mb`: from `input` (the previous stage's
    /// output), or on the first virtual stage (`input = None`) from
    /// `batch`. A stage that is not last writes its output into `output`
    /// (`output_len` floats); the last returns its loss on `batch`.
    ///
    /// # Errors
    /// The stage's own.
    fn forward(
        &mut self,
        mb: usize,
        batch: &Self::Batch<'_>,
        input: Option<&[f32]>,
        output: Option<&mut [f32]>,
    ) -> Result<Option<f64>, Self::Error>;

    /// Whole backward of micro-batch `mb`: from `dout`, the gradient of the
    /// stage's output (`None` on the last stage, which starts from its
    /// loss); a stage that is not first writes its input's gradient into
    /// `dinput`. Frees the micro-batch.
    ///
    /// # Errors
    /// The stage's own.
    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, Self::Error>;

    /// The input half (`B`) of [`backward`](Self::backward), for
    /// zero-bubble schedules; the weight gradients wait for
    /// [`backward_weight`](Self::backward_weight).
    ///
    /// # Errors
    /// The stage's own.
    fn backward_input(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, Self::Error>;

    /// The weight half (`W`) of [`backward`](Self::backward), after
    /// [`backward_input`](Self::backward_input). Frees the micro-batch.
    ///
    /// # Errors
    /// The stage's own.
    fn backward_weight(&mut self, mb: usize) -> Result<Vec<Range<usize>>, Self::Error>;

    /// Frees micro-batch `mb` after a forward with no backward to come (a
    /// [forward-only](crate::Schedule::forward_only) schedule: evaluation).
    ///
    /// # Errors
    /// The stage's own.
    fn discard(&mut self, mb: usize) -> Result<(), Self::Error>;

    /// The stage's gradient buffer.
    fn grads(&self) -> &[f32];

    /// The stage's gradient buffer, mutably (the executor zeroes the
    /// pieces it hands to a [`GradEvent`](crate::GradEvent) hook).
    fn grads_mut(&mut self) -> &mut [f32];

    /// The shared parameters this stage owns or uses (none by default).
    fn shared(&self) -> Vec<Shared> {
        Vec::new()
    }

    /// On the user side, after the backward of `mb` that computes it
    /// (`BW` or `B`): this stage's part of shared parameter `id`'s gradient
    /// for `mb`.
    fn shared_grad(&self, id: u32, mb: usize) -> Option<&[f32]> {
        let _ = (id, mb);
        None
    }

    /// On the owner side, before the backward of `mb` that accumulates
    /// parameter `id`'s gradient (`BW` or `W`): the user's part.
    ///
    /// # Errors
    /// The stage's own (it does not share `id`, `mb` is not in flight).
    fn add_shared_grad(&mut self, id: u32, mb: usize, grad: &[f32]) -> Result<(), Self::Error> {
        let _ = (id, mb, grad);
        Ok(())
    }

    /// On the owner side: the current value of shared parameter `id`.
    fn shared_param(&self, id: u32) -> Option<&[f32]> {
        let _ = id;
        None
    }

    /// On the user side: replaces its copy of shared parameter `id`.
    ///
    /// # Errors
    /// The stage's own (it does not use `id`, or the length is wrong).
    fn set_shared_param(&mut self, id: u32, value: &[f32]) -> Result<(), Self::Error> {
        let _ = (id, value);
        Ok(())
    }
}
